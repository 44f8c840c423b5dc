"""Atomic file writes: a temp file in the destination's folder, then `os.replace`, so a reader (ComfyUI listing
`models/loras`, a resumed run) or a crash never sees half a file.

The one helper of the pack: `anchor` owns it because `anchor` must not depend on the trainer, and the trainer
(`anima_train.files`) and the nodes import it from here.

The finished file gets the mode a plain `open()` would give it (0666 minus the umask), and a finished folder
(`publish_dir`) gives every file and folder in it the modes `open()` / `mkdir()` would: safetensors' `save_file`
(also inside diffusers' and transformers' `save_pretrained`) and `tempfile.mkstemp` create 0600 files, which other
accounts sharing a ComfyUI models folder could not read. Every file the trainer writes goes through here.

A write that fails for the machine's sake (a full disk, no permission, ...) leaves no temp file or folder behind and
raises an OSError that names the file being written, not its temp name: the trainer's error policy
(anima_train/errors.py) says it in one line with the fix. Libraries that write natively (safetensors) report such a
failure as their own error type with the OS error number in the text; `as_os_error` recovers it.

`overwrite=False` publishes with `os.link`, which fails if the name appeared while the file was being written: no
silent overwrite even under a race (a filesystem without hard links falls back to an existence check + replace).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterator


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _file_mode() -> int:
    return 0o666 & ~_umask()


def _normal_modes(tree: Path) -> None:
    """Every file and folder under `tree` (itself included) as open() and mkdir() would have made it; symlinks
    are left alone (their mode is their target's)."""
    umask = _umask()
    os.chmod(tree, 0o777 & ~umask)
    for folder, dirs, names in os.walk(tree):
        for name in dirs:
            if not os.path.islink(os.path.join(folder, name)):
                os.chmod(os.path.join(folder, name), 0o777 & ~umask)
        for name in names:
            if not os.path.islink(os.path.join(folder, name)):
                os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def temp_path(final: str | os.PathLike) -> Path:
    final = Path(final)
    return final.with_name(f".{final.name}.tmp-{os.getpid()}")


def publish(tmp: str | os.PathLike, final: str | os.PathLike, overwrite: bool = True) -> Path:
    """Give a finished temp file its normal mode and move it into place. With overwrite=False an existing `final`
    raises FileExistsError and the temp file is left for the caller to remove."""
    os.chmod(tmp, _file_mode())
    if overwrite:
        os.replace(tmp, final)
        return Path(final)
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise FileExistsError(f"{final} appeared while writing; refusing to overwrite it") from None
    except OSError:  # filesystems without hard links
        if os.path.exists(final):
            raise FileExistsError(f"{final} exists; refusing to overwrite it") from None
        os.replace(tmp, final)
    return Path(final)


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """`with atomic_path(p) as tmp: write tmp` — published on success, removed on any failure."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(final)
    try:
        yield tmp
        publish(tmp, final, overwrite)
    except Exception as exc:
        raise as_os_error(exc, final) from exc
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def temp_dir(final: str | os.PathLike) -> Iterator[Path]:
    """`with temp_dir(d) as tmp: fill tmp; os.replace(tmp, d)` — a hidden folder beside `d`, removed on any failure
    (a later run must not find it), and a write failure named after `d`."""
    tmp = temp_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        yield tmp
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception):
            raise as_os_error(exc, final) from exc
        raise


_LIBRARY_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's io::Error (safetensors) shows an errno


def as_os_error(exc: Exception, path: str | os.PathLike) -> Exception:
    """A failure met while writing `path`: an OSError (also one a library wrapped in its own type) naming `path`
    where it named a temp file or nothing; anything else unchanged."""
    if isinstance(exc, OSError):
        code, named = exc.errno, exc.filename
    else:
        found = _LIBRARY_OS_ERROR.search(str(exc))
        code, named = (int(found.group(1)) if found else None), None
    if code is None:
        return exc
    if named is not None and ".tmp-" not in os.path.basename(str(named)):
        return exc  # it names a file of its own (a source read while writing): keep that name
    return OSError(code, os.strerror(code), str(path))


def write_text(final: str | os.PathLike, text: str) -> Path:
    """Text written as given (newline="": the text's own line endings are kept)."""
    with atomic_path(final) as tmp:
        with open(tmp, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
    return Path(final)


def publish_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Move a finished temp folder into place. An earlier folder of that name is set aside first and removed only
    once the new one is in place; if the move fails it is put back (a folder cannot be os.replace'd over another on
    every platform, so a plain rmtree + rename would lose the earlier one to a crash in between). What is inside gets
    the modes open() and mkdir() give (the umask's), whatever wrote it."""
    final = Path(final)
    _normal_modes(Path(tmp))
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_json(final: str | os.PathLike, data) -> Path:
    """`data` as indented JSON (keys sorted; a Path or other non-JSON value as its str), written atomically."""
    return write_text(final, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
