"""An FP8 frozen base for an adapter (`[train] base_matmul = "fp8"`): the DiT blocks' frozen Linears multiply in FP8.

Under a LoRA, LoKr or LoHa the base weights never change, so each frozen Linear of the DiT blocks is quantized once,
when the run starts, to float8_e4m3fn with one fp32 scale per output channel (row-wise), and multiplies with FP8 GEMMs
(`torch._scaled_mm`, fp32 accumulation, bf16 out):

    forward        y  = x · Wᵀ     x quantized per row (token) on the fly, W per output channel (stored)
    backward       dx = dy · W     dy quantized per row on the fly, W per input channel (a second stored copy)

The backward needs W scaled along the other axis (the row-wise GEMM takes one scale per row of its left operand and
one per column of its right), so each layer keeps two FP8 copies: the same bytes as the one bf16 weight it replaces.
No weight gradient exists (frozen), so nothing of x is saved for backward by the base GEMM; the adapter saves what it
saves. The adapter itself (LoRA's A and B, LoKr's factors) stays in bf16 with fp32 masters: only the frozen path is
approximate.

Which Linears: every frozen nn.Linear inside the DiT blocks whose sizes the FP8 GEMM takes (both multiples of 16),
except the adaLN modulation (`norm1/2/3`, one row per sample) and the cross-attention's key and value (`attn2.to_k`,
`to_v`: they read the 512 text tokens, few rows, where quantizing costs more than the FP8 GEMM saves): SKIPPED.
The patch embedding, timestep MLP, final layer, the LLM adapter and Qwen3 stay as they are.

Numerics: E4M3 has 3 mantissa bits, so each quantized element carries up to 2^-4 relative error; a layer's output
and input gradient differ from the fp32 product by about 3.7 % of their RMS, bf16's by 0.17 % (measured on the H200
per DiT shape, bench/results/fp8_base_2026-12-04; tests/test_fp8_base.py bounds it row by row on the CPU). Over a
training run these errors average out: the A/B there trained the same loss curve and update direction. The LoRA
file a run writes is ordinary: ComfyUI applies it to the bf16 (or its own fp8) base.

GPUs: the row-wise FP8 GEMM needs compute capability 8.9 (Ada, RTX 40xx) or 9.0+ (Hopper, Blackwell);
`fp8_available` says why not elsewhere. The CPU runs the same function (tests).
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
ALIGN = 16  # the FP8 GEMM's size multiple (in and out features)
# Linears left in bf16, by their name in the block (a peft layer's ".base_layer" dropped): the adaLN modulation
# (one row per sample) and the cross-attention's key and value, which read the text (512 rows per sample): on an H200
# at batch 8 their FP8 forward + backward took 0.85 ms against bf16's 0.53 (bench/results/fp8_base_2026-12-04)
SKIPPED = ("norm1.", "norm2.", "norm3.", "attn2.to_k", "attn2.to_v")


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D tensor in E4M3 with one fp32 scale per row: (fp8 [R, C], scale [R, 1]); t ≈ fp8 · scale."""
    # 448.0 = torch.finfo(float8_e4m3fn).max, spelled as a literal: a module-level float read inside the
    # autograd.Function under torch.compile(dynamic=True) becomes a symbolic input that Dynamo cannot lift into the
    # Function's graph
    # ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer", torch 2.14)
    amax = t.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / 448.0
    # contiguous: elementwise ops keep a transposed input's strides, and the GEMM wants its operands row-major
    # (the right one as the transpose of a row-major tensor)
    return (t.float() / scale).clamp(-448.0, 448.0).to(E4M3).contiguous(), scale


class _FrozenFp8Matmul(torch.autograd.Function):
    """y = x · Wᵀ over FP8 copies of a frozen W; the gradient flows to x only."""

    @staticmethod
    def forward(ctx, x, w, w_scale, wt, wt_scale):
        xq, xs = quantize_rows(x)
        ctx.save_for_backward(wt, wt_scale)
        # w [N, K] row-major: w.t() is the column-major right operand the GEMM wants; w_scale [1, N]
        return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad):
        wt, wt_scale = ctx.saved_tensors
        gq, gs = quantize_rows(grad)
        return torch._scaled_mm(gq, wt.t(), scale_a=gs, scale_b=wt_scale, out_dtype=grad.dtype), None, None, None, None


class Fp8FrozenLinear(torch.nn.Module):
    """A frozen nn.Linear as two FP8 copies of its weight (buffers: they never train, and the adapter's
    state-dict keys are unchanged) and its bias, if any, in its own dtype."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        w, w_scale = quantize_rows(weight)
        wt, wt_scale = quantize_rows(weight.t())
        self.register_buffer("weight_fp8", w)
        self.register_buffer("weight_scale", w_scale.reshape(1, -1).contiguous())
        self.register_buffer("weight_t_fp8", wt)
        self.register_buffer("weight_t_scale", wt_scale.reshape(1, -1).contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        # shape and dtype only (peft's LoKr and LoHa reshape their update to base_layer.weight.shape): a meta
        # tensor, so that anything computing with the bf16 weight fails loudly instead of finding it gone
        self.weight = torch.empty(weight.shape, dtype=weight.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = _FrozenFp8Matmul.apply(x.reshape(-1, self.in_features), self.weight_fp8, self.weight_scale,
                                   self.weight_t_fp8, self.weight_t_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the forward multiplies with, in the layer's dtype (tests, diagnostics)."""
        return (self.weight_fp8.float() * self.weight_scale.t()).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 (e4m3, per-channel scales)"


def fp8_available(device: torch.device) -> str | None:
    """None where the row-wise FP8 GEMM runs on `device`, else why not (one sentence)."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"FP8 matmuls run on CUDA GPUs (and the CPU), not on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return (f"the {name} (compute capability {major}.{minor}) has no FP8 matmul; it needs 8.9 or newer "
                "(RTX 40xx, Hopper, Blackwell)")
    return None


def convertible(name: str, module: torch.nn.Module) -> bool:
    """A frozen Linear the FP8 GEMM takes and gains on (see the module docstring)."""
    return (type(module) is torch.nn.Linear and not module.weight.requires_grad
            and module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0
            and not name.removesuffix(".base_layer").startswith(SKIPPED))


def convert_blocks(blocks: list[torch.nn.Module]) -> int:
    """Replace, in place, every convertible Linear of the blocks (a peft layer's base_layer included) by an
    Fp8FrozenLinear on the same device. Returns how many were converted. Run it after the adapters are injected
    (their trainable Linears are left alone) and before the blocks are compiled or swapped."""
    converted = 0
    for block in blocks:
        for name, module in list(block.named_modules()):
            if not convertible(name, module):
                continue
            parent_name, _, child = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, child, Fp8FrozenLinear(module))
            converted += 1
    return converted


def keep_out_of_ddp(model: torch.nn.Module) -> int:
    """Tell DDP to leave the FP8 layers' buffers alone (returns how many): every rank loads the same weights and
    quantizes them the same way, so there is nothing to synchronise, and DDP would otherwise broadcast them from rank 0
    when it wraps the model (gloo has no float8 type: "Invalid scalar type") and again before every forward
    (broadcast_buffers: the whole frozen base, every step)."""
    names = [name for name, _ in model.named_buffers()
             if isinstance(model.get_submodule(name.rpartition(".")[0]), Fp8FrozenLinear)]
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ())) | set(names)
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(ignored))
    return len(names)
