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

import contextlib
import errno
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

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


def epoch_of_step(step: int, steps_per_epoch: int) -> int:
    """The 1-based epoch that optimizer step `step` falls in (0 before the first step): the `epoch N/M` of the
    progress line, and what a file's ss_epoch / ss_num_epochs say (sd-scripts: the epoch the file belongs to, and
    the epochs the run really does, so a max_steps cap counts, not the configured epochs)."""
    return -(-step // steps_per_epoch) if steps_per_epoch > 0 else 0


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
                      protect: str | os.PathLike | None = None) -> list[Path]:
    """Delete all but the newest `keep_last_n` periodic checkpoints (ordered by recorded step, not mtime).
    Everything belonging to one checkpoint goes together. Returns what was removed.

    `protect` (the run's `resume_from`: a checkpoint file or its `-state` folder, any spelling of the path) is
    never deleted, nor anything of its checkpoint: the user named it in the config, so re-running that config
    must find it. It does not count towards keep_last_n."""
    if not keep_last_n:
        return []
    found = find_periodic(run_dir, run_name)
    if protect is not None:
        protected = Path(protect).resolve()
        found = [c for c in found if protected not in {p.resolve() for p in c.paths}]
    found.sort(key=lambda c: (c.recorded_step(steps_per_epoch), c.tag == "step", c.number))
    removed = []
    for ckpt in found[:-keep_last_n] if len(found) > keep_last_n else []:
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


TRAINABLE_FILE = "trainable.safetensors"
TORCH_FILES = ("optimizer.pt", "scheduler.pt")  # torch.save zip archives


def resolve_resume(path: str | os.PathLike) -> Path:
    """`resume_from` → the `-state` directory; refuses anything that cannot restore the optimizer, before any
    model loads: a path that is not there, a checkpoint without its state, a state with a missing or damaged file."""
    p = Path(path)
    if not p.exists() and not (p.name.endswith(".safetensors") and state_dir_for(p).exists()):
        raise ResumeError(f"resume_from = {str(p)!r}: not found. Point it at a saved state folder "
                          f"(<run>-step000060-state) or the checkpoint file beside it.{_states_hint(p.parent)}")
    if p.name.endswith(".safetensors") or (p.is_dir() and not p.name.endswith(STATE_SUFFIX)
                                           and not (p / STATE_FILE).exists()):
        state = state_dir_for(p)
        if not state.exists() and p.is_dir() and latest_state(p) is not None:
            raise ResumeError(f"resume_from = {str(p)!r} is a run folder, not a saved state: point it at one of its "
                              f"states (the newest is {latest_state(p)}) or at the checkpoint file beside one")
        if not state.exists():
            raise ResumeError(
                f"resume_from = {str(p)!r}: no state directory {state.name!r} beside it. That checkpoint is "
                f"inference-only (the run had save_optimizer_state = false); resuming needs the optimizer state. "
                f"Set [train] save_optimizer_state = true for runs you may want to resume.")
        p = state
    missing = [n for n in (STATE_FILE, ACCELERATOR_DIR) if not (p / n).exists()]
    missing += [f"{ACCELERATOR_DIR}/{n}" for n in (TRAINABLE_FILE, *TORCH_FILES)
                if ACCELERATOR_DIR not in missing and not (p / ACCELERATOR_DIR / n).is_file()]
    if missing:
        raise ResumeError(f"resume_from = {str(p)!r} is not a complete state directory (missing "
                          f"{', '.join(missing)}); it cannot restore the optimizer, so it cannot be resumed."
                          f"{_states_hint(p.parent, exclude=p)}")
    _check_state_files(p)
    return p


def _check_state_files(state_dir: Path) -> None:
    """Cheap whole-file checks (headers and zip directories, not the tensors) so that a truncated or foreign file
    is named before minutes of model loading; `load_state_file` names one that fails later."""
    import zipfile

    from safetensors import safe_open

    read_state(state_dir)
    inner = state_dir / ACCELERATOR_DIR
    with load_state_file(inner / TRAINABLE_FILE):
        with safe_open(str(inner / TRAINABLE_FILE), "pt"):  # checks the header covers the whole file
            pass
    for name in TORCH_FILES:
        with load_state_file(inner / name):
            with zipfile.ZipFile(inner / name):  # a truncated torch.save archive has no central directory
                pass


@contextlib.contextmanager
def load_state_file(path: Path) -> Iterator[None]:
    """Reading one file of a state: any failure becomes a ResumeError that names the file."""
    try:
        yield
    except ResumeError:
        raise
    except Exception as e:
        state = Path(path).parent.parent if Path(path).parent.name == ACCELERATOR_DIR else Path(path).parent
        raise ResumeError(f"{path} cannot be read ({type(e).__name__}: {e}); the state {state.name} is damaged "
                          f"(truncated or overwritten), so it cannot be resumed.{_states_hint(state.parent, state)}"
                          ) from e


def read_state(state_dir: Path) -> dict:
    path = Path(state_dir) / STATE_FILE
    with load_state_file(path):
        info = json.loads(path.read_text(encoding="utf-8"))
        int(info["global_step"])
    return info


def latest_state(run_dir: Path, exclude: Path | None = None) -> Path | None:
    """The complete `-state` directory with the highest recorded step in run_dir (temp dirs are hidden)."""
    best, best_step = None, -1
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    for p in sorted(run_dir.iterdir()):
        if p.name.startswith(".") or not p.name.endswith(STATE_SUFFIX) or p == exclude or not p.is_dir():
            continue
        try:
            step = int(json.loads((p / STATE_FILE).read_text(encoding="utf-8"))["global_step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if step > best_step:
            best, best_step = p, step
    return best


def _states_hint(folder: Path, exclude: Path | None = None) -> str:
    newest = latest_state(folder, exclude)
    return f" The newest state in {folder} is {newest}." if newest is not None else ""


def finished_error(state_dir: Path, step: int, total: int, max_steps: int | None, epochs: int) -> ResumeError:
    """Resuming a state that is already at (or past) this config's last step: nothing is left to train."""
    limit = f"max_steps = {max_steps}, epochs = {epochs}" if max_steps else f"epochs = {epochs}"
    return ResumeError(
        f"resume_from = {str(state_dir)!r}: this run is finished (step {step} of {total}; {limit}), so there is "
        f"nothing left to train. To continue it, raise [train] max_steps or epochs past where it stopped and "
        f"resume from this state again.")


def refuse_finished(state_dir: Path, max_steps: int | None, epochs: int) -> None:
    """The part of the finished check that state.json answers alone (before the model and the data load): a state
    at max_steps, or after the last epoch. The trainer checks the exact step total again once it is known."""
    info = read_state(state_dir)
    step, epoch = int(info["global_step"]), int(info.get("epoch", 0))
    if (max_steps and step >= max_steps) or epoch >= epochs:
        total = max_steps if max_steps and step >= max_steps else step
        raise finished_error(state_dir, step, total, max_steps, epochs)


# -- writing ---------------------------------------------------------------------------------------------------


class SaveError(UserError, OSError):
    """A checkpoint or state file could not be written (disk full, permissions, ...); names the file."""


@contextlib.contextmanager
def writing(path: Path, run_dir: Path, lost: str = "") -> Iterator[None]:
    """Writing one output file of a run: any failure becomes a SaveError that names the file, says what was not
    saved and where to resume from. torch.save and safetensors report a full disk as RuntimeError ("file write
    failed") / SafetensorError ("... (os error 28)"), not as OSError, so every exception is caught."""
    try:
        yield
    except SaveError:
        raise
    except Exception as e:
        path = Path(path)
        code = getattr(e, "errno", None)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
        message = f"could not write {path}: {reason}."
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(run_dir if Path(run_dir).is_dir() else Path(run_dir).parent).free
            text = str(e)
            if (code == errno.ENOSPC or f"os error {errno.ENOSPC})" in text or os.strerror(errno.ENOSPC) in text
                    or (not isinstance(e, OSError) and free < 64 * 2**20)):
                message += f" The disk holding {run_dir} is full ({free / 2**20:.0f} MiB free): free space first."
        if lost:
            message += f" {lost} was not saved."
        newest = latest_state(run_dir)
        message += " Earlier checkpoints are untouched" + (f"; resume from the newest state, {newest}." if newest
                                                          else ".")
        error = SaveError(message)
        error.errno = code
        raise error from e


def write_json_atomic(path: Path, data: dict) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


