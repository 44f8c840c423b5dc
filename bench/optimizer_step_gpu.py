"""Time one optimizer step over a full finetune's tensors, alone: the DiT's 1.96 B trainable parameters at their real
shapes (bf16, random), a random bf16 gradient on each, and each optimizer a full finetune can use. No model runs, so
the numbers are the optimizer's share of a training step and nothing else.

    python3 bench/optimizer_step_gpu.py [--only adamw_bf16,adamw_kahan,...] [--steps 5]
    python3 bench/optimizer_step_gpu.py --tiny          # CPU smoke run on the tiny model's shapes

| name | what | bytes per parameter beside the bf16 weight and gradient |
|---|---|---|
| adamw_bf16 | torch AdamW (fused) straight on the bf16 weights: moments in bf16, no master (the seed's plain full finetune) | 4 |
| adamw_masters | ours by default: fp32 masters, torch AdamW (fused) on them | 12 (+4 up-cast gradient) |
| adamw8bit_kahan | ours `full8bit`: SDNQ AdamW, uint8 moments, bf16 Kahan residual, stochastic rounding | ~4.3 |
| adamw8bit_sr | ours `adamw8bit` + `quantize_state` without `use_kahan`: fp32 masters, SDNQ AdamW on them, uint8 moments | ~6.3 (+4 up-cast gradient) |
| adamw_kahan | ours `adamw` + `use_kahan` (anima_train/training/adamw_kahan.py): bf16 moments, bf16 Kahan residual, one compiled kernel per tensor on CUDA (as the trainer runs it when torch.compile works) | 6 |
| adamw_kahan_eager | the same, its eager fallback (compile off or not working) | 6 |

Prints one JSON line per optimizer (median seconds per step after --warmup steps, peak GiB, kernels launched per
step from a profiled step) and writes them to --out when given.
"""  # noqa: E501 (a row of the table above stays on one line)

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from diffusers import CosmosTransformer3DModel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anima_train.config import OptimizerConfig  # noqa: E402
from anima_train.model.tiny import CONFIGS  # noqa: E402
from anima_train.training.optimizers import build_optimizer  # noqa: E402

KINDS = {
    "adamw_bf16": None,  # torch.optim.AdamW on the bf16 tensors themselves
    "adamw_masters": OptimizerConfig(kind="adamw"),
    "adamw8bit_kahan": OptimizerConfig(kind="adamw8bit", quantize_state=True, use_kahan=True),
    "adamw8bit_sr": OptimizerConfig(kind="adamw8bit", quantize_state=True, use_kahan=False),
    "adamw_kahan": OptimizerConfig(kind="adamw", use_kahan=True),
    "adamw_kahan_eager": OptimizerConfig(kind="adamw", use_kahan=True),
}
EAGER = {"adamw_kahan_eager"}  # the others run as the trainer runs them on CUDA with torch.compile working


def shapes(size: str) -> list[torch.Size]:
    """The DiT's parameter shapes (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = CosmosTransformer3DModel(**CONFIGS[size]["transformer"])
    return [p.shape for p in model.parameters()]


def one(name: str, dims: list[torch.Size], device: torch.device, steps: int, warmup: int) -> dict:
    gen = torch.Generator(device).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) * 0.02)
              for s in dims]
    grads = [torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) * 1e-3 for s in dims]
    groups = [{"params": params, "lr": 1e-5, "weight_decay": 0.01}]
    if KINDS[name] is None:
        optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), weight_decay=0.01,
                                      fused=device.type == "cuda" or None)
    else:
        optimizer = build_optimizer(groups, KINDS[name], compiled=device.type == "cuda" and name not in EAGER)

    def step():
        for p, g in zip(params, grads):
            p.grad = g.clone()  # the trainer's step consumes (frees or up-casts) the gradient it is given
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        sync()
        t = time.perf_counter()
        step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    top = sorted(((e.key, round(e.self_device_time_total / 1e3, 2), e.count) for e in prof.key_averages()
                  if e.self_device_time_total > 0), key=lambda r: -r[1])[:8]
    rec = dict(name=name, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               params=sum(p.numel() for p in params), tensors=len(params), steps=steps,
               s_per_step=round(statistics.median(times), 4), times=[round(t, 4) for t in times],
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
               kernels_per_step=len(kernels), top_kernels_ms=top)
    return rec  # its tensors go with this frame; main() empties the cache before the next optimizer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(KINDS), help="comma-separated: " + ", ".join(KINDS))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="the tiny model's shapes on the CPU (smoke run)")
    ap.add_argument("--out", default=None, help="a JSON-lines file to append the results to")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dims = shapes("tiny" if args.tiny else "full")
    for name in args.only.split(","):
        if name not in KINDS:
            raise SystemExit(f"--only: unknown optimizer {name!r}; use {', '.join(KINDS)}")
        rec = one(name, dims, device, args.steps, args.warmup)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        line = json.dumps(rec)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
