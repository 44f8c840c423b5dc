"""SDNQ quantization of the models ([quant]; the facts it relies on: docs/sdnq.md), sdnq 0.2.8.

    report = quantize_models({"transformer": t, "text_conditioner": c, "text_encoder": q}, cfg,
                             token_counts=[dit_tokens(w, h) for w, h in sample_sizes])
    print(report.summary())
    ... inject_adapters(...), build_param_groups(...), build_optimizer(...)   # quantize FIRST, then inject
    export: dequantized_state_dict(model, dtype)                            # plain tensors for safetensors

Both modes use SDNQ's *training* format (`sdnq.training.sdnq_training_post_load_quant`): each selected nn.Linear
weight becomes an `SDNQTensor` parameter and the layer gets SDNQ's autograd forward. The inference format
(`sdnq_post_load_quant`) is never used: its layers run under torch.no_grad, which silently cuts the gradient to
every adapter before the last one (docs/sdnq.md#training-format-only).

- mode = "frozen" (LoRA/LoKr): base weights quantized with deterministic rounding and requires_grad False;
  the adapters (injected afterwards; SDNQ's layer subclasses nn.Linear, so peft wraps it) train in plain tensors.
- mode = "training" (full finetune): the weights stay quantized while they train: an SDNQ optimizer dequantizes,
  updates and re-quantizes each tensor per step, with stochastic rounding (use_stochastic_rounding) so that updates
  smaller than one quantization step survive on average. Layers of a component frozen by [component_lr] 0.0 are
  quantized without stochastic rounding. torch's AdamW cannot update SDNQTensor weights
  (training/optimizers.py refuses it).
- Only nn.Linear is quantized (embeddings, norms, convs stay in train.dtype). Which Linears: see SKIP_POLICIES,
  extra_skip (skip_matches) and the size floor (SDNQ's own: >= 16384 elements and >= 32 input features).
- group_size: 0 (config default) = one scale per output channel (SDNQ's -1, row-wise; the only layout its int8
  matmul uses without re-quantizing); n > 0 = groups of n inputs; -1 row-wise, -2 tensor-wise as in SDNQ.
- dynamic_loss_threshold: SDNQ's per-layer dtype search (its inference-format `use_dynamic_quantization`, which
  the training format lacks): for each layer the first dtype from weights_dtype *upward* in SDNQ's order whose
  normalised MSE (mse / var(w)) is <= the threshold is chosen and passed on through `modules_dtype_dict`; a layer
  that meets it with no dtype stays unquantized. So weights_dtype is the smallest dtype you accept (e.g. "int4").
- use_quantized_matmul: "auto" = docs/sdnq.md#quantized-matmul (resolve_quantized_matmul); off in mode "training".
- use_grad_ckpt (SDNQ's inverted flag, docs/sdnq.md#use_grad_ckpt) follows train.gradient_checkpointing.
- No autocast: SDNQ's backward has no custom_fwd/custom_bwd and fails on mixed dtypes (docs/sdnq.md#no-autocast).

CPU (this machine): every path here runs on CPU (quantized matmul through torch._int_mm, with a warning about
Triton). SDNQ's GPU kernels (Triton int8/fp8 matmul) and its torch.compile of the dequantizers are untested here.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from anima_train.config import Config, QuantConfig
from anima_train.model.keymaps import owner_component

SDNQ_VERSION = "0.2.8"
QUANTIZED_MATMUL_MIN_TOKENS = 2900  # "auto": token-weighted mean DiT length (docs/sdnq.md#quantized-matmul)
MIN_NUMEL, MIN_CHANNELS = 16384, 32  # SDNQ's own floor (minimum_allowed_numel / minimum_allowed_channel_size)

# DiT layers that stay unquantized, per skip_policy (patterns as in skip_matches). Base: the in/out projections,
# the timestep MLP and the final adaLN; every quantizer keeps these (SDNQ's built-in CosmosTransformer3DModel list).
_DIT_IO = ["patch_embed", "time_embed", "proj_out", "norm_out"]
SKIP_POLICIES: dict[str, list[str]] = {
    # SDNQ's own list for CosmosTransformer3DModel: in/out layers + the adaLN of block 0
    "default": _DIT_IO + ["transformer_blocks.0.norm*"],
    # the same set, named for configs that spell it out
    "first_block_adaln": _DIT_IO + ["transformer_blocks.0.norm*"],
    # every block's adaLN stays in train.dtype (~13% lower error for ~0.13 GB, docs/sdnq.md#which-linears)
    "all_adaln": _DIT_IO + ["transformer_blocks.*.norm[123].*"],
    # int8-matmul preset: adaLN runs on one row per sample, under SDNQ's 32-row floor for quantized matmul, so
    # quantizing it only adds dequantization work; same set as all_adaln
    "anima_int8_mm": _DIT_IO + ["transformer_blocks.*.norm[123].*"],
    # default + the MLP down projections (widest input, post-GELU outliers: the most quantization-sensitive)
    "mlp_down": _DIT_IO + ["transformer_blocks.0.norm*", "transformer_blocks.*.ff.net.2"],
}


def import_sdnq():
    """Import sdnq (SDNQ_* environment variables are read once, at the first import).

    On a machine without CUDA, SDNQ_USE_TORCH_COMPILE defaults to 0 (eager): its import-time compile smoke test
    needs a C++ toolchain and ~20 s, for no gain on small CPU models. Any value already set wins.
    """
    if "sdnq" not in sys.modules and not torch.cuda.is_available():
        os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")
    # lazy: optional dependency (SDNQ): a missing sdnq must not break import
    import sdnq
    import sdnq.optim  # noqa: F401  (submodules used through the package)
    import sdnq.training  # noqa: F401
    if sdnq.__version__ != SDNQ_VERSION:
        warnings.warn(f"sdnq {sdnq.__version__} is installed; this trainer is written against sdnq=={SDNQ_VERSION} "
                      "(its keyword names change between releases)", stacklevel=2)
    return sdnq


# ------------------------------------------------------------------------------------------------ decisions


def skip_matches(name: str, pattern: str) -> bool:
    """Does a skip pattern select the Linear `name` (a module name; its parameter is `name + ".weight"`)?

    - the full name, or the full parameter name (`transformer_blocks.3.ff.net.2[.weight]`);
    - whole dot components, anywhere: `attn2`, `ff.net.2`, `to_k` (never a substring: `attn` is not `attn1`);
      a leading dot anchors them at the root (`.proj_out`);
    - a glob with * ? [ ] over the full name (fnmatch; `*` also crosses dots): `transformer_blocks.*.norm1.*`.
    """
    if not pattern:
        return False
    full = (name, name + ".weight")
    if any(ch in pattern for ch in "*?["):
        return any(fnmatch.fnmatchcase(n, pattern) for n in full)
    if pattern in full:
        return True
    parts = name.split(".")
    if pattern.startswith("."):
        want = pattern[1:].split(".")
        return parts[:len(want)] == want
    want = pattern.split(".")
    return any(parts[i:i + len(want)] == want for i in range(len(parts) - len(want) + 1))


def dit_tokens(width: int, height: int) -> int:
    """DiT sequence length of one image: (H/8 latent, 2x2 patches) = (H/16)·(W/16)."""
    return (int(height) // 16) * (int(width) // 16)


def token_weighted_mean(token_counts: Sequence[int]) -> float:
    """Σt²/Σt: the mean sequence length seen by a token (long samples dominate the matmul time)."""
    counts = [int(t) for t in token_counts]
    total = sum(counts)
    if total <= 0:
        raise ValueError("token_weighted_mean: no tokens (empty dataset?)")
    return sum(t * t for t in counts) / total


def resolve_quantized_matmul(qcfg: QuantConfig, token_counts: Sequence[int] | None = None) -> bool:
    """docs/sdnq.md#quantized-matmul: off in mode "training"; an explicit true/false wins otherwise; "auto" = on iff
    Σt²/Σt >= 2900 over the samples' DiT token counts (≈ 860 px square; below ~1024 px it is a slowdown)."""
    if qcfg.mode in ("none", "training"):
        if qcfg.mode == "training" and qcfg.use_quantized_matmul is True:
            warnings.warn('[quant] use_quantized_matmul = true does not apply in mode = "training" (quantized '
                          "matmul is off for quantized full finetunes); ignoring it", stacklevel=2)
        return False
    if isinstance(qcfg.use_quantized_matmul, bool):
        return qcfg.use_quantized_matmul
    if not token_counts:
        raise ValueError('[quant] use_quantized_matmul = "auto" needs the DiT token counts of the training samples '
                         "(token_counts=[dit_tokens(w, h), ...]); pass them, or set use_quantized_matmul to true/false")
    return token_weighted_mean(token_counts) >= QUANTIZED_MATMUL_MIN_TOKENS


def sdnq_group_size(group_size: int) -> int:
    """Config group_size -> SDNQ's: 0 (per output channel) -> -1 (row-wise); n > 0, -1, -2 unchanged."""
    if group_size == 0:
        return -1
    if group_size > 0 or group_size in (-1, -2):
        return group_size
    raise ValueError(f"[quant] group_size = {group_size}: use 0 (per-channel scales), a positive group size, "
                     "-1 (row-wise) or -2 (tensor-wise)")


# ------------------------------------------------------------------------------------------------ quantize


@dataclass
class QuantReport:
    """What quantize_models did: per model role, the quantized Linears (name -> weights dtype) and the skipped
    ones (name -> reason)."""
    mode: str
    use_quantized_matmul: bool = False
    quantized: dict[str, dict[str, str]] = field(default_factory=dict)
    skipped: dict[str, dict[str, str]] = field(default_factory=dict)

    def summary(self) -> str:
        if self.mode == "none":
            return "quant: off"
        lines = [f"quant: mode={self.mode}, quantized matmul {'on' if self.use_quantized_matmul else 'off'}"]
        for role, q in self.quantized.items():
            skipped = self.skipped.get(role, {})
            dtypes = sorted(set(q.values()))
            lines.append(f"  {role:<17}{len(q):4d} Linears quantized ({', '.join(dtypes) or '-'}), "
                         f"{len(skipped)} kept in full precision")
        return "\n".join(lines)


def _roles_to_quantize(cfg: Config) -> list[str]:
    q = cfg.quant
    roles = ["transformer"]
    if q.quantize_text_conditioner:
        roles.append("text_conditioner")
    if q.quantize_text_encoder:
        roles.append("text_encoder")
    return roles


def select_linears(role: str, model: torch.nn.Module, cfg: Config, min_numel: int = MIN_NUMEL,
                   min_channels: int = MIN_CHANNELS) -> tuple[list[str], dict[str, str]]:
    """The plan for one model: (Linears to quantize, {skipped Linear: reason}). skip_policy applies to the DiT;
    extra_skip and the size floor to every model."""
    policy = SKIP_POLICIES[cfg.quant.skip_policy] if role == "transformer" else []
    chosen, skipped = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        hit = next((p for p in policy if skip_matches(name, p)), None)
        extra = next((p for p in cfg.quant.extra_skip if skip_matches(name, p)), None)
        if hit is not None:
            skipped[name] = f"skip_policy {cfg.quant.skip_policy!r} ({hit})"
        elif extra is not None:
            skipped[name] = f"extra_skip {extra!r}"
        elif module.weight.numel() < min_numel or module.in_features < min_channels:
            skipped[name] = f"too small (< {min_numel} elements or < {min_channels} input features)"
        else:
            chosen.append(name)
    return chosen, skipped


def _dynamic_dtypes(model: torch.nn.Module, names: list[str], cfg: Config, group_size: int) -> dict[str, str | None]:
    # lazy: optional dependency: see import_sdnq
    from sdnq.quantizer import sdnq_quantize_layer_weight_dynamic
    out = {}
    for name in names:
        result = sdnq_quantize_layer_weight_dynamic(
            model.get_submodule(name).weight, layer_class_name="Linear", weights_dtype=cfg.quant.weights_dtype,
            group_size=group_size, dynamic_loss_threshold=cfg.quant.dynamic_loss_threshold,
            use_stochastic_rounding=False, param_name=f"{name}.weight")
        out[name] = None if result is None else result[0].weights_dtype
    return out


def quantize_models(models: Mapping[str, torch.nn.Module | None], cfg: Config, *,
                    token_counts: Sequence[int] | None = None, min_numel: int = MIN_NUMEL,
                    min_channels: int = MIN_CHANNELS) -> QuantReport:
    """Quantize the models in place per cfg.quant (before inject_adapters). Returns a QuantReport.

    models: {"transformer", "text_conditioner", "text_encoder"} -> module. The DiT is always quantized (mode !=
    "none"); the conditioner / Qwen3 only with quantize_text_conditioner / quantize_text_encoder.
    token_counts: DiT tokens per training sample (dit_tokens), needed for use_quantized_matmul = "auto" in mode
    "frozen". min_numel / min_channels: SDNQ's size floor (lowered only by tests on tiny models).
    """
    q = cfg.quant
    report = QuantReport(mode=q.mode)
    if q.mode == "none":
        return report
    sdnq = import_sdnq()
    if q.weights_dtype not in sdnq.common.accepted_weight_dtypes:
        raise ValueError(f"[quant] weights_dtype = {q.weights_dtype!r} is not an SDNQ weight dtype; use e.g. "
                         '"int8", "uint8", "int4" or "float8_e4m3fn"')
    group_size = sdnq_group_size(q.group_size)
    report.use_quantized_matmul = resolve_quantized_matmul(q, token_counts)
    lrs = cfg.component_learning_rates()
    for role in _roles_to_quantize(cfg):
        model = models.get(role)
        if model is None:
            raise ValueError(f"[quant] asks to quantize the {role}, but it was not passed to quantize_models")
        if any(isinstance(m, BaseTunerLayer) for m in model.modules()):
            raise ValueError(f"{type(model).__name__} already holds peft adapters: quantize_models must run before "
                             "inject_adapters (peft then wraps SDNQ's Linear layers)")
        if any(type(p).__name__ == "SDNQTensor" for p in model.parameters()):
            raise ValueError(f"{type(model).__name__} is already quantized")
        if q.mode == "frozen" or role == "text_encoder":
            model.requires_grad_(False)  # a frozen base (the quantizer keeps each weight's flag)
        chosen, skipped = select_linears(role, model, cfg, min_numel, min_channels)
        dtypes = {n: q.weights_dtype for n in chosen}
        if q.dynamic_loss_threshold is not None:
            for name, dtype in _dynamic_dtypes(model, chosen, cfg, group_size).items():
                if dtype is None:
                    skipped[name] = f"no dtype from {q.weights_dtype} up meets dynamic_loss_threshold"
                    del dtypes[name]
                else:
                    dtypes[name] = dtype
        # the weights that train with stochastic rounding: full-finetune components with a non-zero LR
        trains = q.mode == "training" and role != "text_encoder"
        per_layer = {}
        for name in dtypes:
            comp = owner_component(f"{name}.weight", role)
            if trains and q.use_stochastic_rounding and lrs.get(comp, 0.0) == 0.0:
                per_layer[f"{name}.weight"] = {"use_stochastic_rounding": False}
        by_dtype: dict[str, list[str]] = {}
        for name, dtype in dtypes.items():
            if dtype != q.weights_dtype:
                by_dtype.setdefault(dtype, []).append(f"{name}.weight")
        sdnq.training.sdnq_training_post_load_quant(
            model, weights_dtype=q.weights_dtype, group_size=group_size,
            use_stochastic_rounding=bool(trains and q.use_stochastic_rounding),
            use_grad_ckpt=cfg.train.gradient_checkpointing, use_quantized_matmul=report.use_quantized_matmul,
            add_skip_keys=False, minimum_allowed_numel=0, minimum_allowed_channel_size=0,
            modules_to_not_convert=[f"{n}.weight" for n in skipped], modules_dtype_dict=by_dtype,
            modules_quant_config=per_layer)
        report.quantized[role] = {n: d for n, d in dtypes.items()
                                  if type(model.get_submodule(n).weight).__name__ == "SDNQTensor"}
        missing = set(dtypes) - set(report.quantized[role])
        if missing:  # SDNQ declined a layer we selected: say so rather than pretend
            raise RuntimeError(f"SDNQ did not quantize {sorted(missing)[:5]} in the {role}")
        report.skipped[role] = skipped
    return report


def is_quantized(model: torch.nn.Module) -> bool:
    return any(type(p).__name__ == "SDNQTensor" for p in model.parameters())


def dequantized_state_dict(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict with every SDNQTensor dequantized (to `dtype`, default its logical dtype) and every
    other floating tensor cast to `dtype`: plain contiguous tensors that safetensors can write."""
    out = {}
    for key, value in model.state_dict().items():
        if type(value).__name__ == "SDNQTensor":
            value = value.dequantize(dtype=dtype or value.dtype)
        elif dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        out[key] = value.detach().contiguous()
    return out
