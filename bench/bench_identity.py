"""What the input-identity check (anima_train/data/identity.py) costs per run on a folder of images: the record a
cache writer takes, the check while nothing changed (a stat per image), and the check after every image was
rewritten with its own bytes (each is hashed again).

    python bench/bench_identity.py [--n 200] [--side 1024]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from anima_train.data import identity


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--side", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        paths = []
        for i in range(args.n):
            p = Path(tmp) / f"img{i:04d}.png"
            Image.fromarray(rng.integers(0, 256, (args.side, args.side, 3), dtype=np.uint8)).save(p, compress_level=1)
            paths.append(p)
        mib = sum(p.stat().st_size for p in paths) / 2**20

        def timed(label, fn):
            identity._DIGEST_MEMO.clear()  # each run of the trainer starts without the memo
            t0 = time.perf_counter()
            out = [fn(p) for p in paths]
            print(f"{label:<44} {time.perf_counter() - t0:8.3f} s")
            return out

        print(f"{args.n} PNG images {args.side}x{args.side}, {mib:.0f} MiB")
        records = timed("record (cache writer: stat + sha256)", identity.file_identity)
        timed("check, nothing changed (stat only)", lambda p: identity.file_change(records[paths.index(p)], p))
        for p in paths:
            os.utime(p, ns=(time.time_ns(), time.time_ns()))
        timed("check, every image touched (sha256 again)", lambda p: identity.file_change(records[paths.index(p)], p))


if __name__ == "__main__":
    main()
