"""AdamW for bf16 weights with no fp32 copy of them: `[optimizer] kind = "adamw"` with `use_kahan = true`.

Per bf16 tensor it keeps the two moments in the tensor's dtype and a Kahan residual (what rounding the last
update into the weight left out), 6 bytes per element instead of the 12 of fp32 masters with fp32 moments. Tensors
of one length are stepped together, up to 16 in one call of one function (`_step_bf16`) that reads weight,
gradient, moments and residual once and writes them back: compiled (the trainer passes `compiled=True` when
torch.compile works on its CUDA device), that is one fused kernel per tensor and 48 calls for a full
finetune's 567 tensors; eager, about 40 kernels per tensor. Why fused per tensor, grouped by length: the cost of
an optimizer step over the DiT's 1.96 B parameters is launching kernels, not arithmetic (a GPU step is ~11 ms of a
~55 ms step on an H200), and on a small CPU the Python calls are, so grouping tensors cuts the calls without
changing a kernel. The measurements of each design tried are in bench/results/adamw_kahan_designs.md.

The arithmetic is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments, eps outside the square root):

    m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g^2
    w = (weight + residual) * (1 - lr * weight_decay) - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
    weight = round(w);  residual = w - weight

- The weight is rounded to nearest; the residual carries the rest to the next step, so updates far below the
  weight's half-ulp still add up (a bf16 weight alone drops them: docs/sdnq.md#optimizers).
- The moments are written back with stochastic rounding: with beta2 = 0.999 the change to v per step (0.1 %) is
  below bf16's half-ulp (0.2 %), and rounding to nearest would freeze it. The noise is a hash of the element's
  place among all the optimizer's elements and the tensor's step count (`_noise`), not a generator's draw: it is
  the same in every process under DDP (whose global seeds differ by rank) so the ranks keep identical weights,
  a resume continues the same noise with nothing extra saved, and it compiles into the step's kernel.
- fp32 tensors (a LoRA in fp32, norms kept in fp32) get fp32 moments and no residual: nothing to correct. fp16
  tensors are refused (the config says so first): fp16 moments under- and overflow, and fp32 ones would come back
  as fp16 from a resume, since torch's load_state_dict casts each state tensor to its parameter's dtype.
"""

from __future__ import annotations

import torch

LOW32 = 0xFFFFFFFF
STEP_SALT = 0x2545F491  # spreads the step count over the 32-bit element ids: each step gets other noise


# tensors per call, largest first: graphs per function = lengths x ranks (a DiT's are 1 and 2),
# under dynamo's limit of 8
CHUNKS = (16, 4, 1)


class AdamWKahan(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, compiled: bool = False):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        # dynamic: the tensors are stepped flattened, and one graph serves every length (a bucket's tensors share
        # theirs, so one size symbol); two functions, so bf16 and fp32 graphs do not share dynamo's recompile limit
        # Inductor's combo kernels (a call's per-tensor kernels launched as one, up to 8 each) took the step from
        # 0.058 to 0.032 s on an H200 (bench/results/fullkahan24_2026-12-03, Q1 and R1) and step to the same bits as
        # without them (H200, 3 steps of the DiT's 30 tensor shapes: bench/results/optimizer_check_2026-12-04);
        # Inductor's C++ backend (CPU) has none and ignores the option
        wrap = ((lambda f: torch.compile(f, dynamic=True, options={"combo_kernels": True})) if compiled
                else (lambda f: f))
        self._step_bf16, self._step_fp32 = wrap(_step_bf16), wrap(_step_fp32)
        self._first = {}  # param -> 0-d int64 tensor on its device: its first element's place among all elements
        start = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in (torch.bfloat16, torch.float32):
                    # torch's load_state_dict casts every state tensor to its parameter's dtype: fp32 moments of
                    # an fp16 tensor would come back as fp16, and a resume would not continue the run
                    raise ValueError(f"AdamWKahan steps bfloat16 and float32 tensors, not {p.dtype}")
                self._first[p] = torch.tensor(start, dtype=torch.int64, device=p.device)
                start += p.numel()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # tensors bucketed by what one call can share: their numbers for this step (group, step count) and their
        # kind (device, dtype, length, and rank: dynamo guards the flattened views' bases, whose rank it keys on);
        # a full finetune's 567 tensors make 11 buckets (its 28 alike blocks) and 48 calls
        buckets: dict[tuple, list[torch.Tensor]] = {}
        # (group, step count, device) -> the numbers, all sent before any kernel
        scalars: dict[tuple, torch.Tensor] = {}
        for index, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    if p.dtype == torch.bfloat16:
                        state["residual"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                n = float(state["step"])
                if (index, n, p.device) not in scalars:
                    scalars[index, n, p.device] = _scalars(group, n, p.device)
                buckets.setdefault((index, n, p.device, p.dtype, p.numel(), p.dim()), []).append(p)
        for (index, n, device, dtype, _, _), params in buckets.items():
            for chunk in _chunks(params):
                states = [self.state[p] for p in chunk]
                tensors = ([_flat(p) for p in chunk], [_flat(p.grad) for p in chunk],
                           [_flat(s["exp_avg"]) for s in states], [_flat(s["exp_avg_sq"]) for s in states])
                if dtype == torch.bfloat16:
                    self._step_bf16(*tensors, [_flat(s["residual"]) for s in states], scalars[index, n, device],
                                    [self._first[p] for p in chunk])
                else:
                    self._step_fp32(*tensors, scalars[index, n, device])
        return loss

    def load_state_dict(self, state_dict) -> None:
        for index, saved in state_dict["state"].items():
            if "exp_avg" in saved and saved["exp_avg"].dtype == torch.bfloat16 and "residual" not in saved:
                raise ValueError("optimizer state has no Kahan residual: it was saved by another optimizer "
                                 "configuration than [optimizer] kind = \"adamw\" with use_kahan = true")
        super().load_state_dict(state_dict)


def _scalars(group: dict, n: float, device: torch.device) -> torch.Tensor:
    """A step's numbers as one fp32 tensor on the device, read by the kernels: a moving learning rate is data, not a
    constant baked into a graph, so it never recompiles. Sent from pinned memory without waiting: a copy from
    ordinary host memory holds the host until the GPU has run all it was given, and between launches that made the
    GPU's and the host's time add up (0.055 s per full-finetune step on an H200, 14 ms of it kernels)."""
    beta1, beta2 = group["betas"]
    lr = group["lr"]
    numbers = torch.tensor([lr, 1 - lr * group["weight_decay"], 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1 ** n),
                            (1 - beta2 ** n) ** 0.5, group["eps"], n % 2**24], dtype=torch.float32,
                           pin_memory=device.type == "cuda")
    return numbers.to(device, non_blocking=True)


def _chunks(items: list) -> list[list]:
    """`items` cut into lists whose lengths are in CHUNKS (28 -> 16, 4, 4, 4)."""
    out, at = [], 0
    for size in CHUNKS:
        while len(items) - at >= size:
            out.append(items[at:at + size])
            at += size
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t` as one dimension, the same storage (written in place); parameters, their gradients and this class's state
    are contiguous."""
    return t.view(-1)


def _step_bf16(ws, gs, ms, vs, residuals, scalars, firsts) -> None:
    """One AdamW step of bf16 tensors, in place (see the module's note); `scalars` as built by _scalars."""
    lr, keep, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, n = scalars.unbind()
    for w, g, m, v, residual, first in zip(ws, gs, ms, vs, residuals, firsts):
        m32, v32, update = _moments(g, m, v, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps)
        held = (w.float() + residual.float()) * keep - step_size * update
        rounded = _round_nearest(held)
        residual.copy_(held - rounded)  # what the rounding left out
        w.copy_(rounded)
        noise = _noise(w.numel(), first, n, w.device)
        m.copy_(_round_stochastic(m32, noise & 0xFFFF))
        v.copy_(_round_stochastic(v32, noise >> 16))


def _step_fp32(ws, gs, ms, vs, scalars) -> None:
    """One AdamW step of fp32 tensors, in place, as torch AdamW: nothing to round, no residual."""
    lr, keep, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps, n = scalars.unbind()
    for w, g, m, v in zip(ws, gs, ms, vs):
        m32, v32, update = _moments(g, m, v, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps)
        m.copy_(m32)
        v.copy_(v32)
        w.copy_(w * keep - step_size * update)


def _moments(g, m, v, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps):
    """The moments' new values in fp32 and the update they give (before the step size)."""
    g32 = g.float()
    m32 = m.float().lerp(g32, one_minus_beta1)
    v32 = v.float() * beta2 + one_minus_beta2 * g32 * g32
    return m32, v32, m32 / (v32.sqrt() / bc2_sqrt + eps)


def _noise(numel: int, first: torch.Tensor, n: torch.Tensor, device) -> torch.Tensor:
    """32 random-looking bits per element: a hash (lowbias32's shifts; multipliers below 2^31, so int64 never
    overflows) of the element's place among all of the optimizer's elements and the step count `n`."""
    x = (torch.arange(numel, device=device, dtype=torch.int64) + first + n.to(torch.int64) * STEP_SALT) & LOW32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & LOW32
    x = ((x ^ (x >> 15)) * 0x5BD1E995) & LOW32
    return x ^ (x >> 16)


def _round_nearest(value: torch.Tensor) -> torch.Tensor:
    """fp32 `value` rounded to the nearest bf16 (ties to even), as fp32. Written on the bits rather than as
    `value.to(bfloat16).float()`: Inductor drops such a down-and-up cast pair unless told to emulate precision
    casts, and the residual then came out zero (seen on its CPU backend)."""
    bits = value.view(torch.int32)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    return (bits & -(1 << 16)).view(torch.float32)


def _round_stochastic(value: torch.Tensor, noise16: torch.Tensor) -> torch.Tensor:
    """fp32 `value` rounded to bf16 up or down with the probability of its distance: bf16 is fp32's upper 16 bits, so
    add uniform noise below them and cut them off (toward zero in magnitude: the sign bit is untouched, and exact
    zero stays zero); the cast of the result is exact."""
    bits = value.view(torch.int32) + noise16.to(torch.int32)
    return (bits & -(1 << 16)).view(torch.float32).to(torch.bfloat16)
