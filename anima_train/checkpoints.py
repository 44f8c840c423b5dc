"""Checkpoint names, pruning, and the resumable `-state` directory (CONFIG.md §B.11, seed §4).

    <output_dir>/<run_name>/
      <run_name>-step000060.safetensors   periodic, 6-digit step
      <run_name>-epoch005.safetensors     periodic, 3-digit 1-based epoch
      <run_name>.safetensors              final (bare name)
      <stem>_te.safetensors               Qwen3 LoRA sibling
      <run_name>.toml                     the config, copied verbatim
      <stem>-state/                       state.json + accelerator/  (only with save_optimizer_state)

One file per checkpoint (not a folder) so twenty LoRAs of one run can sit in ComfyUI's `loras` folder side by side.
A full finetune saved as diffusers directories uses `<stem>/` instead of `<stem>.safetensors`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from anima_train.atomic import write_text
from anima_train.errors import UserError

STATE_SUFFIX = "-state"
STATE_FILE = "state.json"
ACCELERATOR_DIR = "accelerator"


def checkpoint_stem(run_name: str, *, step: int | None = None, epoch: int | None = None) -> str:
    if step is not None and epoch is not None:
        raise ValueError("a checkpoint is tagged by step or by epoch, not both")
    if step is not None:
        return f"{run_name}-step{step:06d}"
    if epoch is not None:
        return f"{run_name}-epoch{epoch:03d}"
    return run_name


def state_dir_for(checkpoint: Path) -> Path:
    """`x.safetensors` or diffusers dir `x/` → `x-state/`."""
    checkpoint = Path(checkpoint)
    stem = checkpoint.name[: -len(".safetensors")] if checkpoint.name.endswith(".safetensors") else checkpoint.name
    return checkpoint.with_name(stem + STATE_SUFFIX)


# -- pruning -------------------------------------------------------------------------------------------------


@dataclass
class Periodic:
    stem: str
    tag: str  # "step" | "epoch"
    number: int
    paths: list[Path]  # the checkpoint file/dir, its _te sibling and its -state dir, whichever exist

    def recorded_step(self, steps_per_epoch: int) -> int:
        """The step this checkpoint was taken at: state.json, else file metadata, else the tag."""
        for p in self.paths:
            if p.name.endswith(STATE_SUFFIX) and (p / STATE_FILE).is_file():
                try:
                    return int(json.loads((p / STATE_FILE).read_text())["global_step"])
                except (ValueError, KeyError, OSError):
                    pass
        for p in self.paths:
            if p.suffix == ".safetensors" and p.is_file():
                step = _metadata_step(p)
                if step is not None:
                    return step
        return self.number if self.tag == "step" else self.number * steps_per_epoch


def _metadata_step(path: Path) -> int | None:
    try:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        return int(meta["step"]) if "step" in meta else None
    except Exception:
        return None


def find_periodic(run_dir: Path, run_name: str) -> list[Periodic]:
    """Periodic checkpoints of this run in run_dir (files, legacy directories, `_te` and `-state` siblings).

    Only names of the form `<run_name>-step<N>` / `<run_name>-epoch<N>` (any digit count, so older unpadded
    names count too) are candidates; the final checkpoint, the TOML and anything else are never touched.
    """
    pattern = re.compile(rf"^{re.escape(run_name)}-(step|epoch)(\d+)(_te)?(\.safetensors|{STATE_SUFFIX})?$")
    groups: dict[str, Periodic] = {}
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    for p in sorted(run_dir.iterdir()):
        m = pattern.match(p.name)
        if not m:
            continue
        tag, number, te, ext = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        if ext is None and not p.is_dir():
            continue  # bare names are checkpoints only as diffusers directories
        if ext == STATE_SUFFIX and (te or not p.is_dir()):
            continue
        stem = f"{run_name}-{tag}{m.group(2)}"
        groups.setdefault(stem, Periodic(stem, tag, number, [])).paths.append(p)
    return list(groups.values())


def prune_checkpoints(run_dir: Path, run_name: str, keep_last_n: int | None, steps_per_epoch: int,
                      protect: Path | None = None) -> list[Path]:
    """Delete all but the newest `keep_last_n` periodic checkpoints (ordered by recorded step, not mtime).
    Everything belonging to one checkpoint goes together. Returns what was removed."""
    if not keep_last_n:
        return []
    found = find_periodic(run_dir, run_name)
    found.sort(key=lambda c: (c.recorded_step(steps_per_epoch), c.tag == "step", c.number))
    removed = []
    for ckpt in found[:-keep_last_n] if len(found) > keep_last_n else []:
        if protect is not None and any(Path(protect) == p for p in ckpt.paths):
            continue  # never delete the checkpoint a run resumed from while it is in use
        for p in ckpt.paths:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
    return removed


# -- resume ----------------------------------------------------------------------------------------------------


class ResumeError(UserError, ValueError):
    """A resume_from that cannot be resumed; the message names the path and the fix."""


def resolve_resume(path: str | os.PathLike) -> Path:
    """`resume_from` → the `-state` directory; refuses anything that cannot restore the optimizer."""
    p = Path(path)
    if p.name.endswith(".safetensors") or (p.is_dir() and not p.name.endswith(STATE_SUFFIX)
                                           and not (p / STATE_FILE).exists()):
        state = state_dir_for(p)
        if not state.exists():
            raise ResumeError(
                f"resume_from = {str(p)!r}: no state directory {state.name!r} beside it. That checkpoint is "
                f"inference-only (the run had save_optimizer_state = false); resuming needs the optimizer state. "
                f"Set [train] save_optimizer_state = true for runs you may want to resume.")
        p = state
    if not p.exists():
        raise ResumeError(f"resume_from = {str(p)!r} does not exist")
    missing = [n for n in (STATE_FILE, ACCELERATOR_DIR) if not (p / n).exists()]
    if missing:
        raise ResumeError(f"resume_from = {str(p)!r} is not a complete state directory (missing "
                          f"{', '.join(missing)}); it cannot restore the optimizer, so it cannot be resumed")
    return p


def read_state(state_dir: Path) -> dict:
    return json.loads((Path(state_dir) / STATE_FILE).read_text())


def write_json_atomic(path: Path, data: dict) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def replace_dir_atomic(tmp_dir: Path, final_dir: Path) -> None:
    """Move a finished temp directory into place; an older directory of the same name is removed only after."""
    final_dir = Path(final_dir)
    old = None
    if final_dir.exists():
        old = final_dir.with_name(f".{final_dir.name}.old-{os.getpid()}")
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
