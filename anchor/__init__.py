"""anchor: load, check and attach `amoe.diffusion.anchor` adapter files (relay / multiband3 block adapters).

Importing this package is cheap (no torch): ComfyUI imports the pack at start-up. The work lives in submodules
that the caller imports explicitly, or reaches lazily through this package's attributes:

    anchor.format   read/write .safetensors and .pt, content hash v2, kind detection, widths, card()
    anchor.modules  RelayAdapter, MultibandAdapter, band_weights(s01), adapter_output(...)
    anchor.sites    site tables (diffusers and ComfyUI naming), name mapping, width-signature checks (pure Python)
    anchor.attach   attach(model, anchor) / detach() on diffusers models, s01_from_sigma(objective, value)
    anchor.cli      `anchor-info` and `anchor-convert` subcommands

File format and runtime: docs/anchor.md.
"""

import importlib

FORMAT = "amoe.diffusion.anchor"
VERSION = 1
ATTACHABLE_KINDS = ("relay", "multiband3")
LOAD_ONLY_KINDS = ("mono", "bank", "cond")
FAMILIES = ("sd15_unet", "sdxl_unet", "cosmos_dit")
OBJECTIVES = ("eps", "v", "flow")
# Which objective gates the bands: the file's (checked against the model: flow vs eps/v) or the model's own.
OBJECTIVE_SOURCES = ("file", "model")

# Band law of multiband3 (exp008): constants of the trained experts, not settings.
BAND_EDGES = (0.35, 0.75)
XFADE = 0.06
N_BANDS = 3


class AnchorError(ValueError):
    """A file or a host that cannot be used as asked; the message names the file/key and the fix."""


class SiteMismatch(AnchorError):
    """Sites of the file and of the host do not line up (count or width signature)."""

    def __init__(self, message, expected=None, got=None, differing=()):
        super().__init__(message)
        self.expected = list(expected) if expected is not None else None  # the file's widths
        self.got = list(got) if got is not None else None  # the host's widths, in the file's site order
        self.differing = list(differing)  # every index where they differ


# Lazy re-exports: `anchor.load(...)` works without importing torch until it is called.
_LAZY = {
    "AnchorFile": "format", "load": "format", "save": "format", "content_hash_v2": "format",
    "is_safetensors": "format", "detect_kind": "format",
    "RelayAdapter": "modules", "MultibandAdapter": "modules", "band_weights": "modules",
    "build_adapter": "modules", "build_adapters": "modules", "adapter_output": "modules", "fresh_anchor": "modules",
    "attach": "attach", "Attachment": "attach", "s01_from_sigma": "attach",
    "site_names": "sites", "reference_widths": "sites", "resolve_sites": "sites", "check_widths": "sites",
    "to_diffusers_name": "sites", "to_comfy_name": "sites",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
