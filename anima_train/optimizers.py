"""The optimizer: torch AdamW, or one of SDNQ's (sdnq 0.2.8, `sdnq.optim`).

    optimizer = build_optimizer(groups, cfg.optimizer)      # groups from adapters.build_param_groups

| kind | class | notes |
|---|---|---|
| adamw | torch.optim.AdamW | eps, betas, weight_decay as given; moments in the parameter dtype (fp32 adapters: fp32) |
| adamw8bit | sdnq.optim.AdamW | update m/sqrt(v), no eps; "8bit" only with quantize_state |
| adafactor | sdnq.optim.Adafactor | factored 2nd moment, decay step^-0.8 (fixed); no 1st moment; betas unused |
| came | sdnq.optim.CAME | 3 betas (1st moment, factored 2nd moment, instability) |
| lion | sdnq.optim.Lion | 2 betas (interpolation, EMA) |
| muon | sdnq.optim.Muon | matrices (ndim >= 2) get Muon, 1-D tensors (norms, biases) get SDNQ's AdamW |

SDNQ facts that shape this module (SDNQ.md §6, read in sdnq/optim/*.py):
- Every group dict must have exactly the class's key set (bare AssertionError otherwise), so groups reach SDNQ with
  only params/lr/weight_decay/betas (+ the flags below); `name` and other keys of ours are put back on
  `optimizer.param_groups` after construction.
- No `eps` key: SDNQ's Adam update is m_hat * rsqrt(v_hat), nan_to_num, clamped to +-1; optimizer.eps is unused.
- Gradients are clamped element-wise to +-1 (clip_threshold[0]) before the update, after GradScaler unscaling;
  the global max_grad_norm clip stays the training loop's job.
- quantize_state -> use_quantized_buffers: uint8 state (group 32) only for tensors with >= 16384 elements and
  ndim >= 2; smaller ones keep dense state. offload_state -> offload_buffers: state moved to CPU between steps
  (a no-op on a CPU-only machine). use_kahan -> use_kahan: a residual buffer per tensor, useful for bf16/fp16
  tensors (for fp32 tensors it stays ~0).
- Adafactor: SDNQ's first beta is the decay *exponent* (-0.8), not an EMA factor; the config's [0, 1) betas cannot
  express it, so the exponent is fixed at -0.8 (SDNQ's default) and betas are not used. SDNQ's default
  norm_mode "relative" scales each update to the tensor's own norm (floored at 1e-3), so a zero-initialised
  LoRA B moves by only lr * 1e-3 per step; "rms_clip" (update RMS <= 1, as CAME) is used instead, so `lr` is
  an absolute step size as for the others.
- CAME with 2 betas fails only at the first step ("expected 3, got 2"); checked here by name.
- Muon: given plain groups, it splits each into a Muon and an AdamW group; done here explicitly, per component, so
  the resulting groups keep their names and empty halves are dropped. Its user-facing `ns_coefficients` key is
  ignored by SDNQ (filled from gram_ns_coefficients), so it is not exposed.
- Stock torch.optim.AdamW crashes on SDNQ-quantized weights (quant.mode = "training"); this is refused here.
"""

from __future__ import annotations

import warnings

import torch

from anima_train.config import CAME_BETAS, OptimizerConfig, SDNQ_OPTIMIZERS

SDNQ_CLASSES = {"adamw8bit": "AdamW", "adafactor": "Adafactor", "came": "CAME", "lion": "Lion", "muon": "Muon"}
ADAFACTOR_DECAY_EXPONENT = -0.8


def _check_betas(cfg: OptimizerConfig) -> tuple[float, ...]:
    betas = tuple(float(b) for b in cfg.betas)
    if cfg.kind == "came" and len(betas) != 3:
        raise ValueError(f'[optimizer] betas = {list(cfg.betas)}: kind = "came" needs 3 betas (first moment, '
                         f"second moment, instability), e.g. betas = {CAME_BETAS} (CAME's defaults)")
    if cfg.kind != "came" and len(betas) != 2:
        raise ValueError(f'[optimizer] betas = {list(cfg.betas)}: kind = "{cfg.kind}" needs 2 betas, e.g. '
                         "betas = [0.9, 0.95]")
    return betas


def _is_sdnq_tensor(p: torch.Tensor) -> bool:
    return type(p).__name__ == "SDNQTensor" or type(getattr(p, "data", None)).__name__ == "SDNQTensor"


def build_optimizer(param_groups: list[dict], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer of `cfg.kind` over `param_groups` (dicts with params, lr, weight_decay, optional name)."""
    if not param_groups or not any(g["params"] for g in param_groups):
        raise ValueError("build_optimizer: no parameters to optimize (every component is frozen)")
    betas = _check_betas(cfg)
    params = [p for g in param_groups for p in g["params"]]
    if cfg.kind == "adamw":
        if any(_is_sdnq_tensor(p) for p in params):
            raise ValueError('[optimizer] kind = "adamw" (torch) cannot update SDNQ-quantized weights ([quant] mode '
                             '= "training"); use an SDNQ optimizer, e.g. kind = "adamw8bit"')
        low = sorted({str(p.dtype).removeprefix("torch.") for p in params if p.dtype != torch.float32})
        if low:
            warnings.warn(f'[optimizer] kind = "adamw": torch keeps the moments in the parameter dtype '
                          f'({", ".join(low)} here) and rounds each update to it without stochastic '
                          'rounding; small updates can vanish. Consider an SDNQ optimizer (kind = "adamw8bit", '
                          "optionally use_kahan = true)", stacklevel=2)
        # fused kernels only on CUDA; on CPU torch picks foreach/for-loop by itself
        fused = all(p.is_cuda for p in params) or None
        groups = [dict(g) for g in param_groups]
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                 fused=fused)
    if cfg.kind not in SDNQ_OPTIMIZERS:
        raise ValueError(f"[optimizer] kind = {cfg.kind!r}: unknown; use adamw or one of {', '.join(SDNQ_OPTIMIZERS)}")

    from anima_train.quant import import_sdnq
    sdnq_optim = import_sdnq().optim
    shared = dict(use_kahan=cfg.use_kahan, use_quantized_buffers=cfg.quantize_state,
                  offload_buffers=cfg.offload_state)
    if cfg.kind == "adafactor":
        shared.update(betas=(ADAFACTOR_DECAY_EXPONENT, betas[0]), use_first_moment=False, norm_mode="rms_clip")
    else:
        shared["betas"] = betas
    groups, extras = [], []  # extras: our keys (name, ...) to put back, per resulting group
    for g in param_groups:
        ours = {k: v for k, v in g.items() if k not in ("params", "lr", "weight_decay")}
        base = dict(lr=g.get("lr", cfg.lr), weight_decay=g.get("weight_decay", cfg.weight_decay), **shared)
        if cfg.kind == "muon":
            matrices = [p for p in g["params"] if p.ndim >= 2]
            vectors = [p for p in g["params"] if p.ndim < 2]
            for use_muon, ps in ((True, matrices), (False, vectors)):
                if ps:
                    groups.append(dict(base, params=ps, use_muon=use_muon))
                    extras.append(ours)
        else:
            groups.append(dict(base, params=list(g["params"])))
            extras.append(ours)
    optimizer = getattr(sdnq_optim, SDNQ_CLASSES[cfg.kind])(groups)
    for group, ours in zip(optimizer.param_groups, extras):
        group.update(ours)
    return optimizer


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer state tensors (SDNQ-quantized buffers counted by their stored components)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += _tensor_bytes(value)
    return total


def _tensor_bytes(t: torch.Tensor) -> int:
    if _is_sdnq_tensor(t):  # a wrapper subclass: its storage is the quantized components it flattens to
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()
