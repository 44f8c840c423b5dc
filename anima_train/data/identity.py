"""Input identities: what a file was when a result (a latent cache, a resume state) was made from it, so that the
result's reader can tell when the file has changed since.

    file_identity(path) -> {"size", "mtime_ns", "sha256"}     recorded by the writer
    file_change(record, path) -> None | why                    checked by the reader

A check costs one `stat` while a file keeps its size and modification time (the common case: nothing was touched);
only a file whose time moved is hashed again, so a copy or a `touch` of the same bytes is still the same input, and
an image replaced by another of the same size is not. Files up to SAMPLED_ABOVE are hashed whole (every image);
larger ones (a model's weights) by their size and BLOCKS evenly spaced blocks, enough to tell two trainings of one
architecture apart without reading gigabytes on every resume. What this cannot see: a different file given the
same size and the same nanosecond modification time on purpose (`cp -p` of a same-sized other file).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SAMPLED_ABOVE = 64 * 2**20  # bytes: larger files are identified by sampled blocks (see the module docstring)
BLOCK = 1 << 16
BLOCKS = 16

_DIGEST_MEMO: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> digest: one read per file per run


def _digest(path: Path, st: os.stat_result) -> str:
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _DIGEST_MEMO:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            if st.st_size <= SAMPLED_ABOVE:
                h.update(hashlib.file_digest(f, "sha256").digest())
                prefix = "sha256:"
            else:
                h.update(str(st.st_size).encode())
                for i in range(BLOCKS):
                    f.seek((st.st_size - BLOCK) * i // (BLOCKS - 1))
                    h.update(f.read(BLOCK))
                prefix = "sampled-sha256:"
        _DIGEST_MEMO[key] = prefix + h.hexdigest()
    return _DIGEST_MEMO[key]


def file_identity(path: str | os.PathLike) -> dict:
    """The record a writer keeps of one input file."""
    path = Path(path)
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": _digest(path, st)}


def file_change(record, path: str | os.PathLike) -> str | None:
    """None when `path` is the file `record` (file_identity's) was taken of; else what changed, as a short phrase
    ("is gone", "is 1234 bytes, was 999", "has other content (same size)"). A record that is not one is "unknown"."""
    if not isinstance(record, dict) or not {"size", "mtime_ns", "sha256"} <= set(record):
        return "is not recorded"
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        return "is gone"
    if st.st_size != record["size"]:
        return f"is {st.st_size} bytes, was {record['size']}"
    if st.st_mtime_ns == record["mtime_ns"]:
        return None  # not rewritten since: the fast path, no read
    if _digest(path, st) != record["sha256"]:
        return "has other content (same size, modified since)"
    return None


def same_files(paths, others) -> list[tuple[Path, Path]]:
    """(path, other) for each of `paths` that is one of `others` by content: the same file (a link, another spelling
    of the path) or the same bytes (a copy). Only files of equal size are read."""
    by_size: dict[int, list[Path]] = {}
    for other in others:
        by_size.setdefault(Path(other).stat().st_size, []).append(Path(other))
    out = []
    for path in paths:
        path = Path(path)
        st = path.stat()
        for other in by_size.get(st.st_size, ()):
            ost = other.stat()
            if (st.st_dev, st.st_ino) == (ost.st_dev, ost.st_ino) or _digest(path, st) == _digest(other, ost):
                out.append((path, other))
                break
    return out
