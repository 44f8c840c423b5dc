"""Time torch's attention kernels on the shapes the Anima DiT trains with (issue #45, point 4's attention lever).

Forward and backward of `scaled_dot_product_attention` in bf16, per backend (flash, cuDNN, memory-efficient), for
the self-attention of a 1024x1024 image (4,096 tokens) and the cross-attention to the 512 text tokens, 16 heads of
128, at batch 1, 2, 4 and 8. The inputs come in the layout diffusers' Cosmos attention hands over: (batch, heads,
tokens, dim) views of a (batch, tokens, heads, dim) tensor. Each backend's output and input gradients are compared
with an fp32 math reference on one batch, so that a fast kernel that is wrong shows. One JSON line per measurement.

    python bench/sdpa_backends_gpu.py [--iters 20]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
HEADS, DIM = 16, 128


def inputs(batch: int, q_tokens: int, kv_tokens: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def one(tokens):  # diffusers transposes (B, N, H, D) to (B, H, N, D) without a copy
        x = torch.randn(batch, tokens, HEADS, DIM, device="cuda", dtype=dtype, generator=g)
        return x.transpose(1, 2).detach().requires_grad_(True)

    return one(q_tokens), one(kv_tokens), one(kv_tokens)


def step(backend, q, k, v, grad):
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v)
    out.backward(grad)
    return out


def time_backend(backend, batch, q_tokens, kv_tokens, iters):
    q, k, v = inputs(batch, q_tokens, kv_tokens)
    grad = torch.randn(batch, HEADS, q_tokens, DIM, device="cuda", dtype=q.dtype)
    for _ in range(3):
        step(backend, q, k, v, grad)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        step(backend, q, k, v, grad)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def error_against_fp32(backend, q_tokens, kv_tokens):
    q, k, v = inputs(1, q_tokens, kv_tokens)
    grad = torch.randn(1, HEADS, q_tokens, DIM, device="cuda", dtype=q.dtype)
    out = step(backend, q, k, v, grad)
    ref = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        ref_out = F.scaled_dot_product_attention(*ref)
    ref_out.backward(grad.float())
    pairs = [(out, ref_out)] + [(a.grad, b.grad) for a, b in zip((q, k, v), ref)]
    return [round(float((a.detach().float() - b.detach()).abs().max() / b.detach().abs().max()), 6) for a, b in pairs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "cudnn": torch.backends.cudnn.version()}), flush=True)
    for kind, kv_tokens in (("self", 4096), ("cross", 512)):
        q, k, v = inputs(2, 4096, kv_tokens)  # which kernel torch picks when nobody asks (torch's own choice)
        print(json.dumps({"attention": kind, "default_choice": SDPBackend(torch._fused_sdp_choice(q, k, v)).name}),
              flush=True)
        for name, backend in BACKENDS.items():
            try:
                err = error_against_fp32(backend, 4096, kv_tokens)
                times = {b: round(time_backend(backend, b, 4096, kv_tokens, args.iters), 3) for b in (1, 2, 4, 8)}
                print(json.dumps({"attention": kind, "backend": name, "ms_fwd_bwd_by_batch": times,
                                  "rel_err_out_dq_dk_dv": err}), flush=True)
            except RuntimeError as exc:
                print(json.dumps({"attention": kind, "backend": name, "error": str(exc)[:300]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
