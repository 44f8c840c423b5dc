"""The optimizer: torch AdamW, or one of SDNQ's (sdnq 0.2.8, `sdnq.optim`).

    optimizer = build_optimizer(groups, cfg.optimizer)      # groups from adapters.build_param_groups

| kind | class | notes |
|---|---|---|
| adamw | torch.optim.AdamW | eps, betas, weight_decay as given; moments in the parameter dtype (fp32 adapters: fp32) |
| adamw + use_kahan | adamw_kahan.AdamWKahan | torch AdamW's arithmetic without fp32 masters: bf16 moments, a bf16 Kahan residual |
| adamw8bit | sdnq.optim.AdamW | update m/sqrt(v), no eps; "8bit" only with quantize_state |
| adafactor | sdnq.optim.Adafactor | factored 2nd moment, decay step^-0.8 (fixed); no 1st moment; betas unused |
| came | sdnq.optim.CAME | 3 betas (1st moment, factored 2nd moment, instability) |
| lion | sdnq.optim.Lion | 2 betas (interpolation, EMA) |
| muon | sdnq.optim.Muon | matrices (ndim >= 2) get Muon, 1-D tensors (norms, biases) get SDNQ's AdamW |

SDNQ facts that shape this module (docs/sdnq.md#optimizers, read in sdnq/optim/*.py):
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
- SDNQ's stochastic rounding draws from the global generators: each step runs with them seeded alike on every rank
  (SameNoiseOnEveryRank), or DDP ranks drift apart.
- Stock torch.optim.AdamW crashes on SDNQ-quantized weights (quant.mode = "training"); this is refused here.

Precision of the weights being trained (train.dtype = bfloat16/float16). An update `p -= lr * u` written straight
into a bf16 tensor rounds away whenever it is below half an ulp (~0.4 % of |p|): measured on the tiny model over
60 steps, a bf16 LoRA kept 67 % of the fp32 run's changed elements and a full finetune at lr 1e-5 only 3 %. So:
- default, every kind: **fp32 master weights**. The optimizer steps fp32 copies of the bf16/fp16 trainable tensors
  (its state is then fp32 as well, or SDNQ's uint8 with quantize_state); after each step the masters are rounded
  into the model's tensors, which the forward/backward keep using in bf16. Cost per trained element: +4 B master,
  the gradient is up-cast one tensor at a time during the step (+2 B), and torch AdamW's two moments are fp32 (+4 B).
  The masters are part of the optimizer's state_dict, so resume stays bit-exact.
- adamw with use_kahan = true: no masters; AdamWKahan keeps bf16 moments (stochastically rounded) and a bf16 Kahan
  residual per tensor (+6 B), each tensor stepped by one compiled kernel when torch.compile works on the GPU: the
  lean full finetune that is also fast (SDNQ's per-tensor eager step below launches ~49 kernels a tensor: 0.81 s a
  step for a full finetune on an H200).
- SDNQ kinds with use_kahan = true: no masters; SDNQ keeps a bf16 Kahan residual per tensor (+2 B, 1.25 B with
  quantize_state) on top of its stochastic rounding — the realised update equals the fp32 one to ~16 bits.
- SDNQ-quantized weights (quant.mode = "training") and fp32 tensors get no masters (nothing to correct / SDNQ
  re-quantizes the whole tensor itself).
"""  # noqa: E501 (a row of the table above stays on one line)

from __future__ import annotations

import torch

from anima_train.config import OptimizerConfig
from anima_train.model.quant import import_sdnq
from anima_train.training.adamw_kahan import AdamWKahan

SDNQ_CLASSES = {"adamw8bit": "AdamW", "adafactor": "Adafactor", "came": "CAME", "lion": "Lion", "muon": "Muon"}
ADAFACTOR_DECAY_EXPONENT = -0.8


def _is_sdnq_tensor(p: torch.Tensor) -> bool:
    return type(p).__name__ == "SDNQTensor" or type(getattr(p, "data", None)).__name__ == "SDNQTensor"


def build_optimizer(param_groups: list[dict], cfg: OptimizerConfig, *, compiled: bool = False
                    ) -> torch.optim.Optimizer:
    """The optimizer of `cfg.kind` over `param_groups` (dicts with params, lr, weight_decay, optional name);
    `compiled`: torch.compile works on the parameters' device (AdamWKahan compiles its per-tensor step)."""
    if not param_groups or not any(g["params"] for g in param_groups):
        raise ValueError("build_optimizer: no parameters to optimize (every component is frozen)")
    betas = tuple(float(b) for b in cfg.betas)
    params = [p for g in param_groups for p in g["params"]]
    if cfg.kind == "adamw":
        if any(_is_sdnq_tensor(p) for p in params):
            raise ValueError('[optimizer] kind = "adamw" (torch) cannot update SDNQ-quantized weights ([quant] mode '
                             '= "training"); use an SDNQ optimizer, e.g. kind = "adamw8bit"')
        if cfg.use_kahan:
            return AdamWKahan(param_groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                              compiled=compiled)
        # fused kernels only on CUDA; on CPU torch picks foreach/for-loop by itself
        fused = all(p.is_cuda for p in params) or None
        groups = [dict(g) for g in param_groups]
        return AdamWWithMasters(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                fused=fused)

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
    sdnq_class = same_noise_on_every_rank(getattr(sdnq_optim, SDNQ_CLASSES[cfg.kind]))
    optimizer = sdnq_class(groups) if cfg.use_kahan else with_fp32_masters(sdnq_class)(groups)
    for group, ours in zip(optimizer.param_groups, extras):
        group.update(ours)
    return optimizer


class FP32MasterWeights:
    """Mixin for a torch.optim.Optimizer class: it steps fp32 master copies of the bf16/fp16 tensors it is given.

    The model keeps computing with its low-precision tensors; `param_groups` (and so the LR scheduler, the
    curriculum's lr_mul and the optimizer state) hold the masters. step() up-casts each gradient onto its master
    (freeing the low-precision one as it goes), runs the wrapped optimizer, and rounds the masters back into the
    model's tensors. Tensors that need no master (fp32, SDNQ-quantized) are stepped directly.
    """

    MASTERS_KEY = "fp32_master_weights"

    def __init__(self, params, *args, **kwargs):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.master_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (model tensor, fp32 master)
        stepped = []
        for g in groups:
            own = []
            for p in g["params"]:
                if needs_master(p):
                    master = p.detach().to(torch.float32, copy=True)
                    self.master_pairs.append((p, master))
                    own.append(master)
                else:
                    own.append(p)
            stepped.append({**g, "params": own})
        super().__init__(stepped, *args, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        self._gradients_onto_masters()
        loss = super().step(closure)
        if self.master_pairs:
            torch._foreach_copy_([p for p, _ in self.master_pairs], [m for _, m in self.master_pairs])
            for _, master in self.master_pairs:
                master.grad = None
        return loss

    GRAD_CHUNK = 2**26  # elements up-cast per foreach copy (256 MB in fp32): both copies of a gradient coexist briefly

    def _gradients_onto_masters(self) -> None:
        """Each gradient up-cast onto its master, in a few foreach copies rather than one `.to()` per tensor: a LoRA
        has hundreds of small tensors, and launching one copy each cost more host time than the GPU spent on them."""
        chunk: list[tuple[torch.Tensor, torch.Tensor]] = []

        def flush():
            grads = [torch.empty_like(master) for _, master in chunk]
            torch._foreach_copy_(grads, [p.grad for p, _ in chunk])
            for (p, master), grad in zip(chunk, grads):
                master.grad, p.grad = grad, None
            chunk.clear()

        size = 0
        for p, master in self.master_pairs:
            if p.grad is None:
                master.grad = None
                continue
            chunk.append((p, master))
            size += master.numel()
            if size >= self.GRAD_CHUNK:
                flush()
                size = 0
        if chunk:
            flush()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for p, _ in self.master_pairs:
            p.grad = None

    def state_dict(self):
        state = super().state_dict()
        state[self.MASTERS_KEY] = [m for _, m in self.master_pairs]
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop(self.MASTERS_KEY, None)
        if masters is None or len(masters) != len(self.master_pairs):
            raise ValueError(f"optimizer state holds {0 if masters is None else len(masters)} fp32 master "
                             f"tensor(s), this run needs {len(self.master_pairs)}: it was saved by a run with "
                             "another train.dtype, optimizer or adapter configuration")
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for (p, master), saved in zip(self.master_pairs, masters):
                master.copy_(saved)
                p.copy_(saved)


class SameNoiseOnEveryRank:
    """Mixin for an SDNQ optimizer class. SDNQ's stochastic rounding (of bf16 weights, and of uint8 state) draws from
    the global generators, which the trainer seeds with seed + rank: under DDP every rank rounded the same all-reduced
    update differently and the weights drifted apart (tests/test_ddp.py, a bf16 full finetune with adamw8bit and
    use_kahan). Its step runs inside torch.random.fork_rng with those generators seeded from the optimizer's own step
    count: the same on every rank, restored with the state by a resume, and the training streams are left as found."""

    ROUNDING_SEED = 0x5D9

    def step(self, closure=None):
        count = max((int(s.get("step", 0)) for s in self.state.values()), default=0)
        devices = sorted({p.device.index or 0 for g in self.param_groups for p in g["params"] if p.is_cuda})
        with torch.random.fork_rng(devices=devices):
            torch.random.default_generator.manual_seed(self.ROUNDING_SEED + count)
            for index in devices:
                torch.cuda.default_generators[index].manual_seed(self.ROUNDING_SEED + count)
            return super().step(closure)


def same_noise_on_every_rank(optimizer_class: type) -> type:
    return type(optimizer_class.__name__, (SameNoiseOnEveryRank, optimizer_class), {})


def needs_master(p: torch.Tensor) -> bool:
    return p.is_floating_point() and p.dtype in (torch.bfloat16, torch.float16) and not _is_sdnq_tensor(p)


def with_fp32_masters(optimizer_class: type) -> type:
    """`optimizer_class` stepping fp32 masters of its low-precision tensors (see FP32MasterWeights)."""
    return type(optimizer_class.__name__ + "WithMasters", (FP32MasterWeights, optimizer_class), {})


AdamWWithMasters = with_fp32_masters(torch.optim.AdamW)


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
