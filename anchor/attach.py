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

from . import OBJECTIVE_SOURCES, AnchorError, SiteMismatch
from .format import AnchorFile, load
from .modules import MultibandAdapter, adapter_output, build_adapters
from .sites import resolve_sites, site_width, unet_level

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


def default_objective(anchor, family=None):
    """meta.objective.kind, else by family (the file's, or the host's for a legacy file without one): Cosmos/Anima
    is a flow trunk; UNets are eps or v, which gate the same."""
    return anchor.objective or ("flow" if (anchor.family or family) == "cosmos_dit" else "eps")


_FOLLOW_MODEL = "gate by the model's noise level (objective source 'model')"


def gating_objective(anchor, host_objective=None, host_name="the model", source="file", fix="", family=None):
    """The objective whose noise-level rule gates this anchor's bands: 'flow' (s01 = sigma) or 'eps'/'v'
    (s01 = t/1000). The host decides how its sigma becomes t; the file only says which trunk it was made for.

    host_objective  what the model samples as: 'flow', 'eps', 'v' or 'eps/v'; None when the caller cannot tell
                    (then the file's objective, or its family's default, is used unchecked)
    host_name       the model's sampling, for messages (e.g. "ModelSamplingDiscreteFlow + CONST")
    source          'file' (default): the file's objective.kind, refused when the model samples otherwise (flow vs
                    eps/v; eps and v gate alike). 'model': the model's, whatever the file says (a file tagged
                    wrongly). A file without an objective takes the model's either way.
    fix             how the caller's user picks source='model', for the refusal message"""
    if source not in OBJECTIVE_SOURCES:
        raise AnchorError(f"objective source must be one of {OBJECTIVE_SOURCES}, got {source!r}")
    if host_objective is None:
        return default_objective(anchor, family)
    file_objective = anchor.objective
    host_gate = "eps" if host_objective == "eps/v" else host_objective
    if source == "model" or file_objective is None:
        return host_gate
    if (file_objective == "flow") != (host_gate == "flow"):
        raise AnchorError(
            f"{anchor.path or 'anchor'}: the file's objective is {file_objective!r} (meta.objective.kind) but the "
            f"model samples as {host_objective} ({host_name}). The bands are gated by each step's noise level, which "
            "a flow model gives as sigma and an eps/v model as t/1000; gating by the file's rule would put them on "
            "the wrong steps (on a flow model every step would land in the LOW band). Load an anchor made for this "
            f"model; if the file's objective is tagged wrongly, {fix or _FOLLOW_MODEL}.")
    return file_objective


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
        return [(n, m, site_width(m, n), 1) for n, m in modules]  # Transformer2DModel output is [B, C, H, W]
    return [(n, m, site_width(m, n), -1) for n, m in blocks]


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


def _layerwise_casting_dtype(model):
    """The compute dtype of diffusers' layerwise casting (weights stored in e.g. fp8, computed in this), or None."""
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry.get_hook("layerwise_casting") if hasattr(registry, "get_hook") else None
        if hook is not None and isinstance(getattr(hook, "compute_dtype", None), torch.dtype):
            return hook.compute_dtype
    return None


def declared_dtype(model, dtype=None, site_modules=()):
    """The trunk's declared compute dtype (docs/anchor.md#declared-dtype), which the adapters are cast to:

    1. `dtype`: what the caller loaded or cast the model as (e.g. AnimaComponents.dtype), the declaration itself;
    2. what diffusers records: layerwise casting's compute dtype, or the dtype a quantized model was loaded with
       (config._pre_quantization_dtype);
    3. else the dtype the site blocks compute in: the one holding most of their floating-point weights.
    Not the model's first parameter: that is an input layer (patch_embed, conv_in) which may be kept in another
    dtype than the blocks the adapters sit on (ComfyUI's path reads the model's declared dtype the same way)."""
    if dtype is not None:
        return dtype
    found = _layerwise_casting_dtype(model)
    if found is not None:
        return found
    config = getattr(model, "config", None)
    found = config.get("_pre_quantization_dtype") if hasattr(config, "get") else None
    if isinstance(found, torch.dtype):
        return found
    counts = {}
    for module in site_modules:
        for p in module.parameters():
            if p.is_floating_point():
                counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    if counts:
        return max(counts, key=counts.get)
    return getattr(model, "dtype", None) or next(model.parameters()).dtype


def attach(model, anchor, strength=None, dtype=None, noise_level="auto", objective="file"):
    """Attach a relay / multiband3 anchor (AnchorFile or path) to a diffusers trunk. Returns an Attachment.

    strength None -> the card's recommended_strength. dtype: the trunk's DECLARED compute dtype; when None it is
    found by `declared_dtype`. objective: 'file' gates by the file's objective.kind and refuses a file made for the
    other kind of trunk (a Cosmos/Anima trunk is flow, a UNet eps/v); 'model' gates by the trunk's, for a file
    tagged wrongly. Load-only kinds (mono, bank, cond) are refused with their evidence."""
    if not isinstance(anchor, AnchorFile):
        anchor = load(anchor)
    where = anchor.path or "anchor"
    if not anchor.attachable:
        raise AnchorError(f"{where}: {anchor.refusal()}")
    family = anchor.family
    candidates = host_sites(model, family, anchor.n_sites)
    is_cosmos = type(candidates[0][1]).__name__ == "CosmosTransformerBlock"
    if family is None:  # legacy files: the host decides (a Cosmos half stack still takes every 2nd block)
        family = "cosmos_dit" if is_cosmos else "unet"
    # The diffusers Anima pipeline passes sigma as the timestep (flow); UNets get the discrete t (eps or v).
    gate = gating_objective(anchor, "flow" if is_cosmos else "eps/v", type(model).__name__, objective,
                            "attach with objective='model' to gate by the trunk's own noise level")
    names = resolve_sites(family, anchor.widths, [(n, w) for n, _, w, _ in candidates],
                          anchor.site_names, where, anchor.block_indices)
    by_name = {n: (m, axis) for n, m, _, axis in candidates}
    sites = [(n, *by_name[n]) for n in names]
    adapters = build_adapters(anchor, dtype=declared_dtype(model, dtype, [m for _, m, _ in sites]))
    for adapter, (name, module, _) in zip(adapters, sites):
        p = next(module.parameters(), None)
        if p is not None and p.device.type == "meta":
            raise AnchorError(f"site {name} is on the meta device; materialise the model's weights before attaching")
        if p is not None:
            adapter.to(p.device)
    strength = anchor.card()["recommended_strength"] if strength is None else strength
    return Attachment(model, anchor, adapters, sites, strength, gate, noise_level)
