"""AdamW for bf16 weights with no fp32 copy of them: `[optimizer] kind = "adamw"` with `use_kahan = true`.

Per bf16 tensor it keeps the two moments in the tensor's dtype and a Kahan residual (what rounding the last
update into the weight left out), 6 bytes per element instead of the 12 of fp32 masters with fp32 moments. A step
works in fp32 on a few tensors at a time (CHUNK elements) with torch's `_foreach_*` ops, so a full finetune's 567
tensors cost a few hundred kernel launches, not the ~28,000 of SDNQ's per-tensor eager step (measured on an H200:
0.81 s per step for SDNQ's adamw8bit with Kahan against 0.02 s for torch's fused AdamW, for the same 1.96 B
parameters; bench/results/optimizer_step_2026-12-03).

The arithmetic is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments, eps outside the square root):

    m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g^2
    w = (weight + residual) * (1 - lr * weight_decay) - lr * (m / bc1) / (sqrt(v / bc2) + eps)
    weight = round(w);  residual = w - weight

- The weight is rounded to nearest; the residual carries the rest to the next step, so updates far below the
  weight's half-ulp still add up (a bf16 weight alone drops them: docs/sdnq.md#optimizers).
- The moments are written back with stochastic rounding: with beta2 = 0.999 the change to v per step (0.1 %) is
  below bf16's half-ulp (0.2 %), and rounding to nearest would freeze it. The noise comes from the optimizer's own
  generator, seeded alike in every process and saved in its state_dict: processes under DDP (whose global seeds
  differ by rank) round alike and keep identical weights, and a resume continues the same draws (the global
  generator is not the same after a resume: a DataLoader draws its worker seed from it at each epoch's start).
- fp32 tensors (a LoRA in fp32, norms kept in fp32) get fp32 moments and no residual: nothing to correct. fp16
  tensors are refused (the config says so first): fp16 moments under- and overflow, and fp32 ones would come back
  as fp16 from a resume, since torch's load_state_dict casts each state tensor to its parameter's dtype.
"""

from __future__ import annotations

import torch



class AdamWKahan(torch.optim.Optimizer):
    CHUNK = 2**25  # elements stepped together (at most five fp32 working copies: 640 MiB)

    GENERATOR_KEY = "rounding_generator"  # its state in state_dict()

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, seed: int = 0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
        self.generator = torch.Generator(device).manual_seed(seed)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in (torch.bfloat16, torch.float32):
                    # torch's load_state_dict casts every state tensor to its parameter's dtype: fp32 moments of
                    # an fp16 tensor would come back as fp16, and a resume would not continue the run
                    raise ValueError(f"AdamWKahan steps bfloat16 and float32 tensors, not {p.dtype}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            chunk, size = [], 0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if p.dtype == torch.bfloat16:
                        state["residual"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                chunk.append(p)
                size += p.numel()
                if size >= self.CHUNK:
                    self._step_chunk(chunk, group)
                    chunk, size = [], 0
            if chunk:
                self._step_chunk(chunk, group)
        return loss

    def _step_chunk(self, params: list[torch.Tensor], group: dict) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        states = [self.state[p] for p in params]
        steps = [float(s["step"]) for s in states]

        grads = _fp32([p.grad for p in params])
        m = _fp32([s["exp_avg"] for s in states])  # an fp32 tensor's moments are updated in place
        v = _fp32([s["exp_avg_sq"] for s in states])
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
        denom = torch._foreach_div(v, [1 - beta2 ** n for n in steps])
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        torch._foreach_mul_(denom, [1 - beta1 ** n for n in steps])
        update = torch._foreach_div(m, denom)  # (m / bc1) / (sqrt(v / bc2) + eps)
        del denom
        _store(m, [s["exp_avg"] for s in states], self.generator)
        _store(v, [s["exp_avg_sq"] for s in states], self.generator)
        del m, v

        low = [i for i, p in enumerate(params) if p.dtype == torch.bfloat16]
        weights = list(params)  # fp32 tensors are stepped in place
        if low:
            residual = [states[i]["residual"] for i in low]
            for i in low:
                weights[i] = grads[i]  # the gradient's fp32 copy is free now: it takes weight + residual
            w_low = [weights[i] for i in low]
            torch._foreach_copy_(w_low, [params[i] for i in low])
            torch._foreach_add_(w_low, _fp32(residual))
        if decay:
            torch._foreach_mul_(weights, 1 - lr * decay)
        torch._foreach_add_(weights, update, alpha=-lr)
        if low:
            torch._foreach_copy_([params[i] for i in low], w_low)  # rounded to nearest
            torch._foreach_sub_(w_low, _fp32([params[i] for i in low]))
            torch._foreach_copy_(residual, w_low)  # what the rounding left out

    def state_dict(self):
        state = super().state_dict()
        state[self.GENERATOR_KEY] = self.generator.get_state()
        return state

    def load_state_dict(self, state_dict) -> None:
        state_dict = dict(state_dict)
        generator = state_dict.pop(self.GENERATOR_KEY, None)
        if generator is None:
            raise ValueError("optimizer state has no rounding generator: it was saved by another optimizer "
                             "configuration than [optimizer] kind = \"adamw\" with use_kahan = true")
        super().load_state_dict(state_dict)
        self.generator.set_state(generator)


def _fp32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 working copies of `tensors`, in one foreach copy; an fp32 tensor is returned itself (worked on in place)."""
    out = [t if t.dtype == torch.float32 else torch.empty(t.shape, dtype=torch.float32, device=t.device)
           for t in tensors]
    pairs = [(o, t) for o, t in zip(out, tensors) if o is not t]
    if pairs:
        torch._foreach_copy_([o for o, _ in pairs], [t for _, t in pairs])
    return out


def _store(values: list[torch.Tensor], into: list[torch.Tensor], generator: torch.Generator) -> None:
    """fp32 working `values` into their bf16 state tensors, rounded stochastically (see the module's note); the fp32
    values are spent."""
    for value, target in zip(values, into):
        if value is target:
            continue
        # bf16 is fp32's upper 16 bits: add uniform noise below them, then cut them off (toward zero in magnitude:
        # the sign bit is untouched, and exact zero stays zero); the copy of the result is then exact
        bits = value.view(torch.int32)
        noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
        bits.add_(noise).bitwise_and_(-(1 << 16))
        target.copy_(value)
