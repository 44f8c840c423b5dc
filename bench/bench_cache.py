"""Dataset pipeline speed: latent caching throughput (tiny VAE, CPU) and scan + bucket plan of 10 000 sources.

    python bench/bench_cache.py [--n-images 200] [--resolution 128] [--n-sizes 10000] [--skip-encode]

1. cache: `make_synthetic_dataset` writes N images (64-256 px, aspect 0.3-3.2, PNG/JPEG) with captions; a tiny
   random VAE (docs/model.md#tiny-models) is saved as a diffusers `vae/` folder; `anima-train cache` encodes them
   (batched by bucket; bucket_reso_steps 16, as the generated set has ~20 px thin images) and the img/s of the
   encode loop and of the whole command are reported.
2. scan + plan: N header-only PNGs with the sizes of a mixed set (bench_buckets.synthetic_sizes: aspect 0.3-3.2,
   0.2-40 MP) and captions; timed: folder scan, header reads, min_source_area, bucketing at 3 tiers (dedup), and
   then the whole `build_training_data` (source = "encode": no caches needed) incl. dataset, sampler and report.
   Acceptance: scan + plan < 2 s.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_buckets import png_header, synthetic_sizes  # noqa: E402

from anima_train.config import parse_config  # noqa: E402
from anima_train.data.dataset import build_training_data
from anima_train.data.planning import BucketSettings, plan_sources
from anima_train.data.scan import resolve_modes, scan_folders
from anima_train.data.sources import image_sources


def bench_encode(n: int, resolution: int, batch_size: int) -> None:
    import torch
    from diffusers import AutoencoderKLQwenImage

    from anima_train import cli
    from anima_train.model.tiny import CONFIGS, make_synthetic_dataset

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_synthetic_dataset(tmp / "data", n=n, seed=0)
        torch.manual_seed(0)
        AutoencoderKLQwenImage(**CONFIGS["tiny"]["vae"]).save_pretrained(str(tmp / "model" / "vae"))
        out = io.StringIO()
        t0 = time.perf_counter()
        with redirect_stdout(out):
            rc = cli.main(["cache", str(tmp / "data"), "--resolution", str(resolution), "--bucket-reso-steps", "16",
                           "--model", str(tmp / "model"), "--batch-size", str(batch_size), "--device", "cpu"])
        total = time.perf_counter() - t0
        assert rc == 0, out.getvalue()
        n_files = len(list((tmp / "data").glob("*_anima.safetensors")))
        wrote = next(line for line in out.getvalue().splitlines() if line.startswith("wrote"))
        buckets = next(line for line in out.getvalue().splitlines() if line.startswith(f"tier {resolution}:"))
    print(f"cache  {n} images, tier {resolution}, batch {batch_size}, torch threads {torch.get_num_threads()}: "
          f"{buckets.split(': ', 1)[1]}")
    print(f"       encode loop: {wrote.split(' in ', 1)[1]}")
    print(f"       whole command {total:.1f} s incl. imports, scan, VAE load -> {n_files / total:.2f} img/s")


def bench_scan(n: int, tiers: list[int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "data"
        folder.mkdir()
        sizes = synthetic_sizes(n)
        for i, (w, h) in enumerate(sizes):
            (folder / f"{i:05d}.png").write_bytes(png_header(w, h))
            (folder / f"{i:05d}.txt").write_text("tag", encoding="utf-8")
        settings = BucketSettings(tiers=tuple(tiers))
        t0 = time.perf_counter()
        scan = scan_folders([type("Subset", (), {"path": str(folder), "num_repeats": 1, "texture": True})()])
        resolve_modes(scan, "encode")
        sources, _ = image_sources(scan)
        t_scan = time.perf_counter() - t0
        t0 = time.perf_counter()
        plan = plan_sources(sources, settings)
        t_plan = time.perf_counter() - t0
        assert [s.size for s in sources] == sizes
        cfg = parse_config(f'[dataset]\npath = "{folder}"\nresolutions = {tiers}\nsource = "encode"\n'
                          f"[train]\nbatch_size = 4\n")
        t0 = time.perf_counter()
        data = build_training_data(cfg)
        t_build = time.perf_counter() - t0
    print(f"scan   {t_scan:6.3f} s  ({n} folder entries + PNG headers)")
    print(f"plan   {t_plan:6.3f} s  ({n} sources x {len(tiers)} tiers -> {len(plan.entries)} entries)")
    total = t_scan + t_plan
    print(f"total  {total:6.3f} s  {'OK' if total < 2.0 else 'OVER'} (acceptance: scan + plan < 2 s)")
    print(f"build_training_data {t_build:6.3f} s  (scan + plan + captions check + dataset + sampler + report: "
          f"{len(data.dataset)} samples, {len(data.sampler)} batches)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-images", type=int, default=200)
    ap.add_argument("--resolution", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--n-sizes", type=int, default=10_000)
    ap.add_argument("--tiers", type=int, nargs="+", default=[640, 832, 1088])
    ap.add_argument("--skip-encode", action="store_true")
    args = ap.parse_args()
    bench_scan(args.n_sizes, args.tiers)
    if not args.skip_encode:
        bench_encode(args.n_images, args.resolution, args.batch_size)


if __name__ == "__main__":
    main()
