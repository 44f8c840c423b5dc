"""What a run folder keeps for the Train node: the record of a finished result and of a cancelled run (so that
queueing the same inputs again reuses or resumes it), the digests those records are keyed by, the clean-up of a run
cancelled before its first step, and copies published where ComfyUI's loaders list them.

No ComfyUI import here (unit-tested with plain Python, like nodes/worker.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from anchor.atomic import atomic_path, write_json
from anima_train.outputs.layout import LOCK_NAME, MANIFEST_NAME as RUN_MANIFEST_NAME

from .worker import LOG_NAME, STOP_NAME

MANIFEST_NAME = "comfyui-result.json"  # what a finished run produced, and for which inputs
CANCELLED_NAME = "comfyui-cancelled.json"  # a run cancelled with a resume state, and for which inputs
# Files that make up a dataset for the digest: images, captions, latent caches.
DATASET_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".txt", ".caption",
                    ".safetensors", ".json", ".npz"}


def _stat_rows(root: Path, suffixes: set[str] | None) -> list[str]:
    rows = []
    if root.is_file():
        st = root.stat()
        return [f"{root}|{st.st_size}|{st.st_mtime_ns}"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith(".") or (suffixes is not None and Path(name).suffix.lower() not in suffixes):
                continue
            p = Path(dirpath) / name
            try:
                st = p.stat()
            except OSError:
                continue
            rows.append(f"{p.relative_to(root)}|{st.st_size}|{st.st_mtime_ns}")
    return rows


def files_digest(paths, suffixes: set[str] | None = None) -> str:
    """A cheap digest of folders/files: relative path, size and mtime of every file (no content is read).

    Changing, adding or removing an image, caption or cache changes it; so does touching a file."""
    h = hashlib.sha256()
    for p in paths:
        p = Path(p).expanduser()
        h.update(f"## {p.resolve() if p.exists() else p}\n".encode())
        if p.exists():
            h.update("\n".join(_stat_rows(p, suffixes)).encode())
        else:
            h.update(b"<missing>")
    return h.hexdigest()


def dataset_digest(folders) -> str:
    return files_digest(folders, DATASET_SUFFIXES)


def result_key(**parts) -> str:
    """sha256 over the JSON of everything a training result depends on."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _file_record(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_manifest(run_dir: str | os.PathLike, key: str, final: str | os.PathLike, **extra) -> Path:
    """Record a finished run: the key of its inputs and the file it produced (size + mtime, to notice edits)."""
    return write_json(Path(run_dir) / MANIFEST_NAME,
                             {"key": key, "final": _file_record(Path(final)), "finished": time.time(), **extra})


def reusable_result(run_dir: str | os.PathLike, key: str) -> dict | None:
    """The manifest of a finished run with this exact key whose final file is still as it was written, else None."""
    path = Path(run_dir) / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        final = manifest["final"]
        if manifest.get("key") != key:
            return None
        if _file_record(Path(final["path"])) != final:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return manifest


def write_cancelled(run_dir: str | os.PathLike, key: str, state: str | os.PathLike, step: int, total) -> Path:
    """Record a run Cancel stopped with a resume state: the next queue of the same inputs resumes it."""
    return write_json(Path(run_dir) / CANCELLED_NAME,
                             {"key": key, "state": str(state), "step": step, "total": total, "cancelled": time.time()})


def resumable_cancel(run_dir: str | os.PathLike, key: str) -> dict | None:
    """The record of a cancelled run with this exact key whose resume state is still there, else None."""
    try:
        record = json.loads((Path(run_dir) / CANCELLED_NAME).read_text(encoding="utf-8"))
        if record.get("key") != key or not Path(record["state"]).is_dir():
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record


def discard_unstarted_run(run_dir: str | os.PathLike, job_files: set[str]) -> bool:
    """Remove a run folder that holds only what a job writes before its first step (`job_files`: the node's TOML and
    lock; the worker's log, stop file, the trainer's lock and its run manifest, whose entries are not written before
    the first step): a Cancel while the model loads leaves no folder. A folder holding anything else (an earlier
    run, a user's file) is left as it is. True when it was removed."""
    folder = Path(run_dir)
    ours = job_files | {LOG_NAME, LOCK_NAME, RUN_MANIFEST_NAME}
    try:
        entries = list(folder.iterdir())
        if any(not e.is_file() or not (e.name in ours or e.name.startswith(f".{STOP_NAME}-")) for e in entries):
            return False
        for entry in entries:
            entry.unlink(missing_ok=True)
        folder.rmdir()
    except OSError:  # gone already, or a lock still open on Windows: the folder stays
        return False
    return True


def _same_content(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    def digest(p: Path) -> bytes:
        with open(p, "rb") as f:
            return hashlib.file_digest(f, "sha256").digest()
    return digest(a) == digest(b)


def publish_copy(src: str | os.PathLike, dest_dir: str | os.PathLike, name: str | None = None) -> Path:
    """Copy `src` into `dest_dir` (e.g. ComfyUI's loras folder) without ever replacing someone else's file.

    A file of the same name with the same bytes is reused; a different one is left alone and the copy gets the
    next free name (`x-2.safetensors`, `x-3...`). The copy is written to a temp name and renamed into place."""
    src, dest_dir = Path(src), Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    name = name or src.name
    stem, suffix = (name[: -len(".safetensors")], ".safetensors") if name.endswith(".safetensors") else \
        (Path(name).stem, Path(name).suffix)
    n = 1
    while True:
        dest = dest_dir / (name if n == 1 else f"{stem}-{n}{suffix}")
        if not dest.exists():
            break
        if dest.is_file() and _same_content(src, dest):
            return dest
        n += 1
    try:
        with atomic_path(dest, overwrite=False) as tmp:  # never replaces a name that appeared meanwhile
            shutil.copyfile(src, tmp)
    except FileExistsError:
        return publish_copy(src, dest_dir, name)
    return dest
