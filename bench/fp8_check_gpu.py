"""The FP8 frozen base (`[train] base_matmul = "fp8"`, anima_train/model/fp8_base.py) on one GPU, per DiT Linear
shape: its error against an fp32 reference beside bf16's, and the time of forward + input gradient against bf16.

    python3 bench/fp8_check_gpu.py [--tokens 32768] [--reps 20]

For each of the DiT blocks' Linear shapes (in -> out) and M rows (batch x 4096 tokens at 1024x1024): x ~ N(0, 1), W
as the model initialises it (N(0, 0.02)), the upstream gradient ~ N(0, 1). Both layers are compiled, as a
regionally compiled run compiles them; times are CUDA events over `--reps` forward + backward passes after 3 warm
ones. Prints one JSON line per shape and a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anima_train.model.fp8_base import Fp8FrozenLinear, fp8_available  # noqa: E402

# (name, in, out): the DiT block's Linear shapes (not the adaLN ones, one row per sample); the cross-attention's k/v
# measured here slower in FP8 and stay bf16 since (fp8_base.SKIPPED)
SHAPES = [("attn q/k/v/out", 2048, 2048), ("cross-attn k/v (text rows)", 1024, 2048),
          ("mlp up", 2048, 8192), ("mlp down", 8192, 2048)]


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def timed(layer, x, grad, reps: int) -> float:
    def once():
        x.grad = None
        layer(x).backward(grad)
    for _ in range(3):
        once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        once()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768, help="rows of x (batch x tokens; text rows: / 8)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    device = torch.device("cuda")
    if why := fp8_available(device):
        raise SystemExit(why)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    rows = []
    for name, k, n in SHAPES:
        m = args.tokens // 8 if "text" in name else args.tokens
        gen = torch.Generator(device).manual_seed(0)
        lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16).requires_grad_(False)
        lin.weight.copy_(torch.randn(n, k, generator=gen, device=device) * 0.02)
        fp8 = Fp8FrozenLinear(lin)
        x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16).requires_grad_(True)
        grad = torch.randn(m, n, generator=gen, device=device).to(torch.bfloat16)
        x32 = x.detach().float().requires_grad_(True)
        y32 = x32 @ lin.weight.float().t()
        y32.backward(grad.float())
        errs = {}
        for label, layer in (("bf16", lin), ("fp8", fp8)):
            xi = x.detach().clone().requires_grad_(True)
            y = layer(xi)
            y.backward(grad)
            errs[label] = (rel(y, y32), rel(xi.grad, x32.grad))
        times = {label: timed(torch.compile(layer), x, grad, args.reps) for label, layer in (("bf16", lin),
                                                                                           ("fp8", fp8))}
        row = dict(shape=name, m=m, k=k, n=n, bf16_out_rel=round(errs["bf16"][0], 5),
                   bf16_dx_rel=round(errs["bf16"][1], 5), fp8_out_rel=round(errs["fp8"][0], 5),
                   fp8_dx_rel=round(errs["fp8"][1], 5), bf16_ms=round(times["bf16"], 3),
                   fp8_ms=round(times["fp8"], 3), speedup=round(times["bf16"] / times["fp8"], 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'shape':<28}{'M':>7}{'bf16 err out/dx':>18}{'fp8 err out/dx':>17}{'bf16 ms':>9}{'fp8 ms':>8}{'x':>7}")
    for r in rows:
        print(f"{r['shape']:<28}{r['m']:>7}{r['bf16_out_rel']:>9.4f}/{r['bf16_dx_rel']:<8.4f}"
              f"{r['fp8_out_rel']:>8.4f}/{r['fp8_dx_rel']:<8.4f}{r['bf16_ms']:>9.3f}{r['fp8_ms']:>8.3f}"
              f"{r['speedup']:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
