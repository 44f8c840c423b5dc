"""The run manifest: the entries of a run folder that a run created, recorded by the run itself as it writes them.

    <run_dir>/.anima-train-run.json     {"run": "<run_name>", "entries": ["loss.png", "r.safetensors", "r.toml", …]}

A name says nothing about who made a file: a user's own `logs/`, `samples/` or `loss.png` in a run folder looks like
a run's. So the files `--overwrite` sets aside and deletes, and the periodic checkpoints `keep_last_n` prunes, are
those the manifest lists, never those that merely match a run's names (outputs/run_folder.py). Every writer of the
run folder asks `output(run_dir, name)` for its path: the entry is recorded before anything is written (a crash
mid-write leaves a recorded entry, never an unrecorded file of ours), and a name that exists unrecorded is refused.

Entries are top-level names relative to the run folder: the file carries no local path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from anima_train.errors import UserError
from anima_train.files import write_json
from anima_train.outputs.layout import MANIFEST_NAME


class NotOurs(UserError, ValueError):
    """A run would write a name of its folder that holds something no run recorded."""


def read(run_dir: str | os.PathLike) -> dict | None:
    """The manifest of run_dir, or None when there is none (a new folder, or a run of before manifests)."""
    try:
        data = json.loads((Path(run_dir) / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("entries"), list)
    return data if ok else None


def entries(run_dir: str | os.PathLike, run_stem: str) -> set[str]:
    """The names a run called `run_stem` recorded in run_dir (empty: none, or another run's manifest)."""
    data = read(run_dir)
    if data is None or data.get("run") != run_stem:
        return set()
    return {e for e in data["entries"] if isinstance(e, str)}


def start(run_dir: str | os.PathLike, run_stem: str, adopted=()) -> None:
    """A run takes the folder: a manifest of its own, listing `adopted` (what a resumed run of before manifests had
    written: the state it resumes from proves that run was ours) and what this run's earlier process recorded."""
    names = entries(run_dir, run_stem) | set(adopted)
    write_json(Path(run_dir) / MANIFEST_NAME, {"run": run_stem, "entries": sorted(names)})


def drop_if_unused(run_dir: str | os.PathLike) -> None:
    """Remove the manifest of a run that wrote none of what it recorded (refused after its claim, or stopped before
    its first file): a run that made nothing leaves nothing behind."""
    data = read(run_dir)
    if data is not None and not any((Path(run_dir) / e).exists() for e in data["entries"] if isinstance(e, str)):
        (Path(run_dir) / MANIFEST_NAME).unlink(missing_ok=True)


def output(run_dir: str | os.PathLike, *names: str) -> Path:
    """`run_dir / names[0]`, once every name is recorded as this run's. A name that exists but is not recorded is
    the user's (or a run's of before manifests): refused, naming it and the way out."""
    run_dir = Path(run_dir)
    data = read(run_dir) or {}
    stem = data.get("run", run_dir.name)
    have = entries(run_dir, stem)
    strangers = [n for n in names if n not in have and (run_dir / n).exists()]
    if strangers:
        raise NotOurs(f"{run_dir} holds {', '.join(strangers)}, which this run would write, but no run recorded it as "
                      f"its own ({MANIFEST_NAME} does not list it): anima-train never writes over a file it did "
                      f"not make. Move it out of {run_dir}, or give the run another [train] run_name")
    if not set(names) <= have:
        write_json(run_dir / MANIFEST_NAME, {"run": stem, "entries": sorted(have | set(names))})
    return run_dir / names[0]
