"""Patching a ComfyUI diffusion model's blocks with an anchor: the pure logic of the "Anima: Load anchor" node.

No ComfyUI import: everything here works on plain torch modules, so it is unit-tested without ComfyUI. The node
(nodes_anchor.py) supplies the two ComfyUI pieces — how to read a block's current forward (a ModelPatcher's
`get_model_object`, which returns an earlier node's patch so stacked anchors chain) and how to install a new one
(`add_object_patch` on a clone) — plus the model's `model_sampling.timestep` for eps/v trunks.

Per sampling step ComfyUI puts the per-sample sigmas, shape [B] before cond/uncond batching, into
`transformer_options["sigmas"]` (comfy/samplers.py) and hands transformer_options to every block
(docs/comfyui.md#patching-blocks).
Each patched block calls the original forward, then returns `anchor.modules.adapter_output(adapter, out, s01,
strength)` — the same per-site computation `anchor.attach` does on diffusers trunks.

Sites (docs/anchor.md#sites): Cosmos/Anima `blocks.{i}` (output [B, T, H, W, d]); UNet BasicTransformerBlocks
`input_blocks.N.1.transformer_blocks.t` ([B, tokens, d]) or, for 11-site SDXL files, SpatialTransformers
`input_blocks.N.1` ([B, C, H, W]). The host list is built in TRAINING order (diffusers named_modules: mid last),
then `anchor.sites.resolve_sites` maps by identity and checks the width signature.
"""
from __future__ import annotations

import torch

from anchor import AnchorError, SiteMismatch
from anchor.attach import gating_objective, s01_from_sigma
from anchor.modules import MultibandAdapter, adapter_output, build_adapters
from anchor.sites import resolve_sites, site_names, site_width, unet_level

DIT_FAMILY = "cosmos_dit"


def is_dit(diffusion_model):
    return isinstance(getattr(diffusion_model, "blocks", None), torch.nn.ModuleList) and \
        not hasattr(diffusion_model, "input_blocks")


def host_family(anchor, diffusion_model):
    """The file's substrate.family, checked against the host; legacy files without one get the host's."""
    dit = is_dit(diffusion_model)
    family = anchor.family
    where = anchor.path or "anchor"
    if family is not None:
        if (family == DIT_FAMILY) != dit:
            raise SiteMismatch(f"{where}: the file is for {family} but the model is a "
                               f"{type(diffusion_model).__name__} ({'a DiT' if dit else 'a UNet'}); "
                               "load an anchor made for this trunk")
        return family
    if dit:
        return DIT_FAMILY
    guess = {16: "sd15_unet", 70: "sdxl_unet", 11: "sdxl_unet"}.get(anchor.n_sites)
    if guess is None:
        raise SiteMismatch(f"{where}: the file has no substrate.family and {anchor.n_sites} sites, which is "
                           "neither SD1.5 (16) nor SDXL (70 blocks or 11 modules)")
    return guess


def comfy_host_sites(diffusion_model, family, n_sites):
    """[(native name, width, channel_axis)] of the host's candidate sites in TRAINING order.

    Cosmos: every block (resolve_sites picks every 2nd for a half-stack file). UNets: the family's table in
    diffusers order, spelled the ComfyUI way, looked up in the model (a missing module is a trunk mismatch)."""
    if family == DIT_FAMILY:
        return [(f"blocks.{i}", site_width(b, f"blocks.{i}"), -1) for i, b in enumerate(diffusion_model.blocks)]
    channel_axis = 1 if unet_level(family, n_sites) == "module" else -1  # SpatialTransformer out is [B,C,H,W]
    modules = dict(diffusion_model.named_modules())
    out = []
    for name in site_names(family, "comfy", n_sites):
        if name not in modules:
            raise SiteMismatch(f"{family}: the model has no module {name}; it is not a {family} trunk")
        out.append((name, site_width(modules[name], name), channel_axis))
    return out


class NoiseLevel:
    """s01 of the current sampling step from transformer_options["sigmas"], computed once per model call and
    shared by every patched block (they all see the same sigmas tensor object).

    flow trunks: s01 = sigma (Anima's timestep(sigma) == sigma); eps/v: s01 = model_sampling.timestep(sigma) / 1000
    (the model's own discrete t, docs/anchor.md#band-gating). Float64, like anchor.attach, so both give the same
    bits."""

    def __init__(self, objective, timestep_fn=None):
        if objective not in ("flow", "eps", "v"):
            raise AnchorError(f"objective {objective!r} is unknown; expected 'flow', 'eps' or 'v'")
        if objective != "flow" and timestep_fn is None:
            raise AnchorError(f"an {objective} trunk needs model_sampling.timestep to turn sigma into t")
        self.objective, self.timestep_fn = objective, timestep_fn
        self._sigmas = self._s01 = None

    def __call__(self, transformer_options):
        sigmas = (transformer_options or {}).get("sigmas")
        if sigmas is None:
            return None
        if sigmas is not self._sigmas:
            value = sigmas if self.objective == "flow" else self.timestep_fn(sigmas)
            value = torch.as_tensor(value).detach().to(torch.float64).reshape(-1)
            self._sigmas, self._s01 = sigmas, s01_from_sigma(self.objective, value)
        return self._s01


def _transformer_options(args, kwargs):
    """Cosmos and BasicTransformerBlock get transformer_options by keyword; a SpatialTransformer gets it as the
    third positional argument (forward_timestep_embed), and an earlier wrapper passes both through unchanged."""
    opts = kwargs.get("transformer_options")
    if opts is None:
        opts = next((a for a in args if isinstance(a, dict) and "sigmas" in a), None)
    return opts


class BlockPatch:
    """A block's new forward: the previous forward (the original or an earlier patch), then strength · delta."""

    def __init__(self, forward, adapter, strength, noise_level, channel_axis=-1, site=""):
        self.forward, self.adapter, self.strength = forward, adapter, float(strength)
        self.noise_level, self.channel_axis, self.site = noise_level, channel_axis, site
        self.multiband = isinstance(adapter, MultibandAdapter)

    def __call__(self, *args, **kwargs):
        out = self.forward(*args, **kwargs)
        if self.strength == 0:
            return out  # the block's own output object: bit-exact with the unpatched model
        s01 = None
        if self.multiband:  # a relay reads no noise level
            s01 = self.noise_level(_transformer_options(args, kwargs))
            if s01 is None:
                raise AnchorError(f"anchor site {self.site}: multiband3 needs the sampling step's sigma, but "
                                  "transformer_options has no 'sigmas' (the model was called outside a ComfyUI "
                                  "sampler)")
        p = next(self.adapter.parameters())
        if p.device != out.device:  # the adapters follow the trunk to whatever device ComfyUI loaded it on
            self.adapter.to(out.device)
        # No no_grad here: the adapters are frozen, but gradients must still flow through `out` when ComfyUI
        # trains a LoRA on a model that carries an anchor.
        return adapter_output(self.adapter, out, s01, self.strength, self.channel_axis)


def resolve_strength(strength, anchor):
    """The node's strength widget: a negative value (default -1) means "the card's recommended_strength"."""
    return anchor.card()["recommended_strength"] if strength is None or strength < 0 else float(strength)


OBJECTIVE_FIX = "set the Anima: Load anchor node's objective input to 'model' to gate by the model's own sampling"


def noise_level_objective(anchor, family, sampling=None, objective="file"):
    """The objective gating this anchor on a ComfyUI model (anchor.attach.gating_objective, which refuses a file
    made for the other kind of trunk: flow vs eps/v).

    sampling   (objective, name) of the model's model_sampling, as nodes.comfy.model_sampling_kind reads it:
               objective 'flow' (CONST), 'eps' or 'v' (a discrete 0..999 schedule), or None for a sampling whose
               sigma this loader cannot turn into the band gate's s01 (EDM, continuous v, ...). sampling None: no
               model_sampling at hand (a bare diffusion model), the file's objective or its family's default.
    objective  the node's input: 'file' or 'model' (see gating_objective)"""
    if sampling is None:
        return gating_objective(anchor, None, source=objective, family=family)
    host_objective, host_name = sampling
    if host_objective is None:
        if anchor.kind != "multiband3":  # a relay reads no noise level
            return gating_objective(anchor, None, source=objective, family=family)
        raise AnchorError(f"{anchor.path or 'anchor'}: the model samples with {host_name}, which is neither flow "
                          "(CONST) nor eps/v on a discrete 0..999 timestep schedule, so its sigma cannot be turned "
                          "into the noise level (s01) that gates a multiband3 anchor's bands (a relay has no bands "
                          "and loads). Load it on a model whose sampling is flow, or eps/v on the discrete schedule.")
    return gating_objective(anchor, host_objective, host_name, objective, OBJECTIVE_FIX, family)


def block_patches(anchor, diffusion_model, strength, get_forward, dtype=None, timestep_fn=None,
                  prefix="diffusion_model.", sampling=None, objective="file"):
    """{object-patch key: BlockPatch} for every site of an attachable anchor on a ComfyUI diffusion model.

    anchor          an AnchorFile (relay or multiband3)
    diffusion_model the torch module holding the blocks (ModelPatcher.get_model_object("diffusion_model"))
    strength        the delta scale (already resolved; 0 keeps every output bit-exact)
    get_forward     key -> the block's current forward (ModelPatcher.get_model_object: chains earlier patches)
    dtype           the trunk's declared compute dtype; the adapters are cast to it
    timestep_fn     model_sampling.timestep, needed by eps/v trunks
    sampling        (objective, name) of the model's model_sampling; objective 'file' / 'model': noise_level_objective
    Raises AnchorError / SiteMismatch (both signatures in the message) before anything is patched."""
    where = anchor.path or "anchor"
    if not anchor.attachable:
        raise AnchorError(f"{where}: {anchor.refusal()}")
    family = host_family(anchor, diffusion_model)
    # A legacy file without a family takes the host's: its objective default follows (Cosmos is flow).
    noise_level = NoiseLevel(noise_level_objective(anchor, family, sampling, objective), timestep_fn)
    host = comfy_host_sites(diffusion_model, family, anchor.n_sites)
    names = resolve_sites(family, anchor.widths, [(n, w) for n, w, _ in host], anchor.site_names, where,
                          anchor.block_indices)
    axis = {n: a for n, _, a in host}
    adapters = build_adapters(anchor, dtype=dtype)
    adapters.requires_grad_(False)
    patches = {}
    for adapter, name in zip(adapters, names):
        key = f"{prefix}{name}.forward"
        patches[key] = BlockPatch(get_forward(key), adapter, strength, noise_level, axis[name], name)
    return patches
