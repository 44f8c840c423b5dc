"""Latent caching throughput on a GPU with the full-size (random-init) Qwen-Image/Wan2.1 VAE at 1024x1024.

    python3 bench/bench_cache_gpu.py [--n-images 64] [--batch-size 4] [--work /tmp/anima-cache-bench]

Writes N generated 1024x1024 images, saves a random full-size `AutoencoderKLQwenImage` as a diffusers `vae/`, and
runs the real `anima-train cache` (bf16 VAE, batched per bucket); prints images/s of the whole command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anima_train.cli import main as cli  # noqa: E402
from anima_train.model.tiny import CONFIGS, make_synthetic_dataset  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n-images", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--work", default="/tmp/anima-cache-bench")
    args = ap.parse_args()
    work = Path(args.work)
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    with torch.device("cuda"):
        AutoencoderKLQwenImage(**CONFIGS["full"]["vae"]).to(torch.bfloat16).save_pretrained(work / "repo" / "vae")
    make_synthetic_dataset(work / "data", n=args.n_images, sizes=[(1024, 1024)], jpeg_every=0)
    for attempt in ("warm-up", "timed"):
        data = work / "data" if attempt == "timed" else work / "warm"
        if attempt == "warm-up":
            make_synthetic_dataset(data, n=args.batch_size, sizes=[(1024, 1024)], jpeg_every=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        code = cli(["cache", str(data), "--resolution", "1024", "--model", str(work / "repo"), "--device", "cuda",
                    "--dtype", "bfloat16", "--batch-size", str(args.batch_size)])
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if code != 0:
            return code
    n = args.n_images
    print(json.dumps({"device": torch.cuda.get_device_name(), "images": n, "resolution": "1024x1024",
                      "batch": args.batch_size, "seconds": round(dt, 2), "images_per_s": round(n / dt, 2),
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
