"""Bucket-plan speed: scan 10 000 image headers and plan them at every tier (acceptance: < 2 s together).

    python bench/bench_buckets.py [--n 10000] [--tiers 640 832 1088] [--upscale] [--multires]

"scan" writes N header-only PNGs (signature + IHDR, the sizes of a mixed set: aspect 0.3-3.2, 0.2-40 MP) to
a temp folder and reads each size with PIL, which parses only the header, as a dataset scan does. "plan" is
`plan_tiers` (every source at every tier, dedup, RoPE check) plus the tier report.
"""

from __future__ import annotations

import argparse
import math
import random
import struct
import sys
import tempfile
import time
import zlib
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from anima_train.data.buckets import make_bucketers, plan_tiers, tier_counts, tier_report  # noqa: E402


def synthetic_sizes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        aspect = math.exp(rng.uniform(math.log(0.3), math.log(3.2)))
        area = math.exp(rng.uniform(math.log(0.2e6), math.log(40e6)))
        w = round(math.sqrt(area * aspect))
        out.append((w, round(area / w)))
    return out


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(w: int, h: int) -> bytes:
    """A PNG that declares w x h (8-bit RGB) and carries no pixels: PIL stops parsing at the IDAT chunk."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", b"") + png_chunk(b"IEND", b"")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--tiers", type=int, nargs="+", default=[640, 832, 1088])
    ap.add_argument("--upscale", action="store_true", help="bucket_no_upscale = false")
    ap.add_argument("--multires", action="store_true", help="multires_training = true (upscale branch only)")
    args = ap.parse_args()

    sizes = synthetic_sizes(args.n)
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, (w, h) in enumerate(sizes):
            p = Path(tmp) / f"{i:05d}.png"
            p.write_bytes(png_header(w, h))
            paths.append(p)
        t0 = time.perf_counter()
        scanned = []
        for p in paths:
            with Image.open(p) as im:
                scanned.append(im.size)
        t_scan = time.perf_counter() - t0
    assert scanned == sizes

    t0 = time.perf_counter()
    bucketers = make_bucketers(
        args.tiers, bucket_no_upscale=not args.upscale, multires_training=args.multires, max_bucket_reso=1920
    )
    entries = plan_tiers(scanned, bucketers, "dedup")
    lines, warnings = tier_report(tier_counts(entries, len(scanned), args.tiers), len(scanned))
    t_plan = time.perf_counter() - t0

    print("\n".join(lines))
    print(f"buckets  {len({e.plan.bucket for e in entries})} distinct, {len(warnings)} collapse warning(s)")
    print(f"scan  {t_scan:6.3f} s  ({args.n} PNG headers via PIL)")
    print(f"plan  {t_plan:6.3f} s  ({args.n} sources x {len(args.tiers)} tiers -> {len(entries)} entries)")
    total = t_scan + t_plan
    print(f"total {total:6.3f} s  {'OK' if total < 2.0 else 'OVER'} (acceptance: < 2 s)")


if __name__ == "__main__":
    main()
