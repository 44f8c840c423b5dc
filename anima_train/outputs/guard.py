"""The output-path guard: a path a run writes (its run folder, its events file) or watches (its stop file) is checked
here before anything is written, against what the run reads: the config file, the model, the dataset and
validation folders, the prompts and protected-tags files.

* An output is never one of those files, never inside one of those folders, and a run folder never holds one of
  those folders: a checkpoint in the model repo, previews among the training images or events appended to the
  config would change what the next run reads. Paths are compared as the filesystem sees them (`..`, `~` and
  symlinks resolved), whatever they look like.
* An existing file is written to only when it is ours: an events file is appended to only when it already holds
  anima-train's events. Inside the run folder the run manifest decides (outputs/manifest.py).

Each refusal is one line naming the flag or key, the path, what it collides with and what to do instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

from anima_train.errors import UserError


class OutputRefused(UserError, ValueError):
    """An output path would write into something the user owns or the run reads."""


class Read(NamedTuple):
    label: str  # how the user names it: "the config", "[dataset] path"
    path: Path
    folder: bool


def run_reads(cfg) -> list[Read]:
    """What a run of `cfg` reads. Files named by keys that are relative to the config's folder are joined to it."""
    base = Path(cfg.source_path).parent if cfg.source_path is not None else Path.cwd()
    reads = [Read("the config", Path(cfg.source_path), False)] if cfg.source_path is not None else []
    reads.append(Read("[train] model_path", Path(cfg.train.model_path), True))
    single = cfg.dataset.path is not None
    for subset in cfg.dataset.resolved_subsets():
        reads.append(Read("[dataset] path" if single else "[[dataset.subsets]] path", Path(subset.path), True))
    if cfg.validation.folder is not None:
        reads.append(Read("[validation] folder", Path(cfg.validation.folder), True))
    for label, value in (("[sample] prompts_file", cfg.sample.prompts_file),
                         ("[dataset.caption] protected_tags_file", cfg.dataset.caption.protected_tags_file)):
        if value is not None:
            reads.append(Read(label, base / Path(value).expanduser(), False))
    return reads


def real(path: str | os.PathLike) -> Path:
    """The path as the filesystem sees it: absolute, `~` expanded, `..` and every symlink resolved."""
    return Path(os.path.expanduser(os.fspath(path))).absolute().resolve()  # symlinks before `..`, as the OS does


def collision(path: str | os.PathLike, reads: list[Read], *, folder: bool = False) -> Read | None:
    """The read that output `path` is, lies in, or (a folder the run fills: `folder`) holds."""
    out = real(path)
    for read in reads:
        them = real(read.path)
        if out == them or (read.folder and out.is_relative_to(them)) or (
                folder and read.folder and them.is_relative_to(out)):  # a file read inside the run folder is fine
            return read
    return None


def _where(out: Path, read: Read) -> str:
    them = real(read.path)
    if out == them:
        return f"is {read.label} ({read.path}), which this run reads"
    if them.is_relative_to(out):
        return f"holds {read.label} ({read.path}), which this run reads"
    return f"is inside {read.label} ({read.path}), which this run reads"


def check_run_folder(run_dir: Path, reads: list[Read]) -> None:
    """The run folder (checkpoints, states, previews, logs) lands among nothing the run reads."""
    hit = collision(run_dir, reads, folder=True)
    if hit is not None:
        raise OutputRefused(f"[train] output_dir: the run folder {run_dir} {_where(real(run_dir), hit)}: its "
                            f"checkpoints and previews would land among the files the run reads. Choose an "
                            f"output_dir outside the model, dataset and validation folders")


def _holds_events(path: Path) -> bool:
    """The file holds anima-train's events: its first line is one (an empty file is one too: a run that wrote
    nothing yet)."""
    try:
        with open(path, encoding="utf-8") as fh:
            first = fh.readline()
    except (OSError, UnicodeDecodeError):
        return False
    if not first:
        return path.stat().st_size == 0
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and isinstance(record.get("event"), str) and "time" in record


def checked_events(events: str | None, cfg) -> str | None:
    """`--events PATH` as given, once it is known to write into nothing the user owns: not a file or folder the run
    reads, and when the file exists, an events file of an earlier run (appended to)."""
    if not events or events == "-":
        return events
    hit = collision(events, run_reads(cfg))
    if hit is not None:
        raise OutputRefused(f"--events {events}: the file {_where(real(events), hit)}; events are appended to the "
                            f"file, so give a new file for them (e.g. events.jsonl), or - for stdout")
    path = Path(events)
    if path.is_file() and not _holds_events(path):
        raise OutputRefused(f"--events {events}: the file exists and does not hold anima-train's events; events are "
                            f"only ever appended to an events file, so give a path that does not exist yet (e.g. "
                            f"events.jsonl), or - for stdout")
    return events


def stop_file_read(stop_file: str | os.PathLike | None, reads: list[Read]) -> Read | None:
    """The read a `--stop-file` names (its existence would stop the run; it is never deleted or written)."""
    return collision(stop_file, reads) if stop_file else None
