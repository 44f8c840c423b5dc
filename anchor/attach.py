"""Attach an anchor to a diffusers trunk (UNet2DConditionModel, CosmosTransformer3DModel) with forward hooks.

    att = attach(unet, "grounding.safetensors", strength=0.8)   # or an AnchorFile
    ...sample...                        # multiband3 reads the noise level from the model's `timestep` argument
    att.detach()                        # hooks gone; the model is bit-for-bit what it was

The trunk's parameters are never touched: adapters live in the Attachment (not in the model's state dict),
hooks add `strength · delta` to each site's output, and detach() removes the hooks.

Noise level (multiband3): s01 = sigma for flow trunks (Anima), t/1000 for eps/v trunks (SD1.5, SDXL). With
noise_level="auto" a pre-hook reads the model's `timestep` argument on every call: diffusers UNets get the discrete
t (0..999), the diffusers Anima pipeline passes t/1000 == sigma. With noise_level="manual" the caller sets it per
step: att.set_noise_level(s01), or att.set_sigma(value) which applies s01_from_sigma.
"""
import torch

from . import AnchorError, SiteMismatch
from .format import AnchorFile, load
from .modules import MultibandAdapter, adapter_output, build_adapters
from .sites import resolve_sites, unet_level

_BLOCK_CLASSES = ("BasicTransformerBlock", "CosmosTransformerBlock")


def s01_from_sigma(objective, value):
    """The band gate's normalised noise level. flow: the (shift-warped) sigma itself; eps/v: timestep / 1000.

    In ComfyUI pass model_sampling.timestep(sigma): a 0..999 index for SD1.5/SDXL, and == sigma for Anima
    (multiplier 1) — dividing that by 1000 would put every step of a flow trunk in the LOW band."""
    if objective == "flow":
        top = float(torch.as_tensor(value, dtype=torch.float64).max())
        if top > 1.0 + 1e-4:
            raise AnchorError(f"flow trunk: s01 is sigma in [0, 1], got {top:g}; pass sigma, not a 0..1000 timestep")
        return value
    if objective in ("eps", "v"):
        return torch.as_tensor(value, dtype=torch.float64) / 1000 if isinstance(value, (list, tuple)) else value / 1000
    raise AnchorError(f"objective {objective!r} is unknown; expected 'flow', 'eps' or 'v' (meta.objective.kind)")


def default_objective(anchor):
    """meta.objective.kind, else by family: Cosmos/Anima is a flow trunk; UNets are eps or v, which gate the same."""
    return anchor.objective or ("flow" if anchor.family == "cosmos_dit" else "eps")


def _site_width(module):
    attn = getattr(module, "attn1", None)
    if attn is not None and hasattr(attn, "to_q"):
        return int(attn.to_q.in_features)
    if hasattr(module, "in_channels"):  # Transformer2DModel: output has the input's channels
        return int(module.in_channels)
    raise AnchorError(f"cannot read the width of site module {type(module).__name__}")


def host_sites(model, family=None, n_sites=None):
    """[(name, module, width, channel_axis)] of a diffusers trunk's candidate sites in training order
    (named_modules order). UNets: BasicTransformerBlocks, or Transformer2DModels for an 11-site SDXL file;
    Cosmos: transformer_blocks.i."""
    blocks = [(n, m) for n, m in model.named_modules() if type(m).__name__ in _BLOCK_CLASSES]
    if not blocks:
        raise AnchorError(f"{type(model).__name__} has no transformer blocks to attach to "
                          "(expected a diffusers UNet2DConditionModel or CosmosTransformer3DModel)")
    is_cosmos = type(blocks[0][1]).__name__ == "CosmosTransformerBlock"
    if family is not None and (family == "cosmos_dit") != is_cosmos:
        raise SiteMismatch(f"the file is for {family} but the host is a {type(model).__name__}")
    modules = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "Transformer2DModel"]
    module_level = (unet_level(family, n_sites) == "module" if family
                    else (not is_cosmos and n_sites != len(blocks) and n_sites == len(modules)))
    if module_level:
        return [(n, m, _site_width(m), 1) for n, m in modules]  # Transformer2DModel output is [B, C, H, W]
    return [(n, m, _site_width(m), -1) for n, m in blocks]


class Attachment:
    """Live adapters on a model. strength, set_noise_level / set_sigma, set_band_enabled, detach()."""

    def __init__(self, model, anchor, adapters, sites, strength, objective, noise_level):
        self.model, self.anchor, self.adapters = model, anchor, adapters
        self.site_names = [name for name, _, _ in sites]
        self.objective = objective
        self.strength = float(strength)
        self.s01 = None
        self._handles = []
        for i, (_, module, channel_axis) in enumerate(sites):
            self._handles.append(module.register_forward_hook(self._site_hook(i, channel_axis)))
        if noise_level == "auto":
            self._handles.append(model.register_forward_pre_hook(self._read_timestep, with_kwargs=True))
        elif noise_level != "manual":
            raise AnchorError(f"noise_level must be 'auto' or 'manual', got {noise_level!r}")

    @property
    def attached(self):
        return bool(self._handles)

    def set_noise_level(self, s01):
        """The current sampling step's s01 (float, or tensor [B] per sample)."""
        self.s01 = s01

    def set_sigma(self, value):
        """Same as set_noise_level(s01_from_sigma(objective, value)): sigma for flow, timestep for eps/v."""
        self.s01 = s01_from_sigma(self.objective, value)

    def set_band_enabled(self, band, enabled):
        """Lesion (enabled=False) or restore one band (0 LOW, 1 MID, 2 HIGH) on every multiband3 site."""
        if not isinstance(self.adapters[0], MultibandAdapter):
            raise AnchorError("band lesions apply to multiband3 anchors only")
        for a in self.adapters:
            a.band_enabled[band] = bool(enabled)

    def _read_timestep(self, module, args, kwargs):
        t = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        if t is None:
            return
        t = torch.as_tensor(t, dtype=torch.float64).detach()
        if t.ndim > 1:  # Cosmos accepts [B, 1, T, 1, 1]: one level per sample
            t = t.reshape(t.shape[0], -1)[:, 0]
        self.s01 = s01_from_sigma(self.objective, t)

    def _site_hook(self, i, channel_axis):
        def hook(module, args, output):
            if self.strength == 0:
                return None  # leave the output object untouched: bit-exact with the trunk
            hidden = output[0] if isinstance(output, tuple) else getattr(output, "sample", output)
            s01 = self.s01
            if s01 is None and isinstance(self.adapters[i], MultibandAdapter):
                raise AnchorError("multiband3 anchor: no noise level for this step; call set_noise_level(s01) "
                                  "or set_sigma(value) before the forward (or attach with noise_level='auto')")
            new = adapter_output(self.adapters[i], hidden, s01, self.strength, channel_axis)
            if isinstance(output, tuple):
                return (new,) + output[1:]
            if hasattr(output, "sample") and not torch.is_tensor(output):
                output.sample = new
                return output
            return new
        return hook

    def detach(self):
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()


def attach(model, anchor, strength=None, dtype=None, noise_level="auto"):
    """Attach a relay / multiband3 anchor (AnchorFile or path) to a diffusers trunk. Returns an Attachment.

    strength None -> the card's recommended_strength. dtype: the trunk's DECLARED dtype (pass it when the model
    was built lazily); default model.dtype. Load-only kinds (mono, bank, cond) are refused with their evidence."""
    if not isinstance(anchor, AnchorFile):
        anchor = load(anchor)
    where = anchor.path or "anchor"
    if not anchor.attachable:
        raise AnchorError(f"{where}: {anchor.refusal()}")
    family = anchor.family
    candidates = host_sites(model, family, anchor.n_sites)
    if family is None:  # legacy files: the host decides (a Cosmos half stack still takes every 2nd block)
        family = "cosmos_dit" if type(candidates[0][1]).__name__ == "CosmosTransformerBlock" else "unet"
    names = resolve_sites(family, anchor.widths, [(n, w) for n, _, w, _ in candidates],
                          anchor.site_names, where)
    by_name = {n: (m, axis) for n, m, _, axis in candidates}
    sites = [(n, *by_name[n]) for n in names]
    dtype = dtype or getattr(model, "dtype", None) or next(model.parameters()).dtype
    adapters = build_adapters(anchor, dtype=dtype)
    for adapter, (name, module, _) in zip(adapters, sites):
        p = next(module.parameters(), None)
        if p is not None and p.device.type == "meta":
            raise AnchorError(f"site {name} is on the meta device; materialise the model's weights before attaching")
        if p is not None:
            adapter.to(p.device)
    strength = anchor.card()["recommended_strength"] if strength is None else strength
    return Attachment(model, anchor, adapters, sites, strength, default_objective(anchor), noise_level)
