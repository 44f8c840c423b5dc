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

from anima_train import adapters
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
            raise ResumeError(_no_state_message(p, state))
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


def _no_state_message(p: Path, state: Path) -> str:
    """Why `p` (not a state folder) has no state beside it, as far as the files tell: a folder that is no
    checkpoint at all, a checkpoint of a run without save_optimizer_state, or one whose state is missing (the run
    was stopped while writing it, or it was deleted)."""
    hint = _states_hint(p.parent)
    if p.is_dir() and not (p / "transformer").is_dir():
        return (f"resume_from = {str(p)!r} is a folder that is neither a saved state (<run>-step000060-state) nor a "
                f"checkpoint: point it at a state folder of the run to continue, or at the checkpoint file beside "
                f"one.{hint}")
    saved_state = _saved_optimizer_state(p)
    interrupted = any(q.name.startswith(f".{state.name}.") for q in p.parent.iterdir()) if p.parent.is_dir() else False
    if not interrupted and not saved_state:
        why = ("the run had save_optimizer_state = false" if saved_state is False
               else "saved without its optimizer state, or the state was deleted")
        return (f"resume_from = {str(p)!r}: no state directory {state.name!r} beside it. That checkpoint is "
                f"inference-only ({why}); resuming needs the optimizer state. Set [train] save_optimizer_state = "
                f"true for runs you may want to resume.{hint}")
    why = ("it was being written when the run was interrupted" if interrupted else
           "the run saved states (save_optimizer_state = true) but this one is missing: it was interrupted while "
           "being written, or deleted")
    return (f"resume_from = {str(p)!r}: its state {state.name!r} is not there ({why}), so this checkpoint cannot be "
            f"resumed.{hint or ' The run has no other state to resume from.'}")


def _saved_optimizer_state(checkpoint: Path) -> bool | None:
    """save_optimizer_state of the run that wrote this checkpoint (its ss_training_config), None when unknown."""
    files = [checkpoint] if checkpoint.is_file() else sorted(Path(checkpoint).glob("*/*.safetensors"))
    for f in files:
        try:
            from safetensors import safe_open

            with safe_open(str(f), "pt") as fh:
                config = json.loads((fh.metadata() or {})["ss_training_config"])
            return bool(config["train"]["save_optimizer_state"])
        except Exception:  # a file without our metadata (or not safetensors): unknown
            continue
    return None


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


# state.json's numbers: (key, smallest value, required). Each is read on resume, so each is checked: an edited or
# damaged file must not resume at step -5 or skip past the end of its epoch.
STATE_INTS = (("global_step", 1, True), ("epoch", 0, False), ("batch_in_epoch", 0, False),
              ("steps_per_epoch", 1, False), ("processes", 1, False))


def read_state(state_dir: Path) -> dict:
    """state.json, every value the resume reads checked for type and range, and global_step against the checkpoint
    the state belongs to (its step tag, the file's recorded step)."""
    state_dir = Path(state_dir)
    path = state_dir / STATE_FILE
    with load_state_file(path):
        info = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(info, dict):
        raise ResumeError(_bad_state(path, f"holds {type(info).__name__}, not a JSON object of the run's position"))
    for key, least, required in STATE_INTS:
        if key not in info:
            if required:
                raise ResumeError(_bad_state(path, f"has no {key}"))
            continue
        value = info[key]
        if not isinstance(value, int) or isinstance(value, bool):
            raise ResumeError(_bad_state(path, f"{key} = {json.dumps(value)} is not a whole number"))
        if value < least:
            raise ResumeError(_bad_state(path, f"{key} = {value} is below {least}"))
    step = info["global_step"]
    stem = state_dir.name[: -len(STATE_SUFFIX)] if state_dir.name.endswith(STATE_SUFFIX) else ""
    m = re.search(r"-step(\d+)$", stem)
    if m and int(m.group(1)) != step:
        raise ResumeError(_bad_state(path, f"global_step = {step}, but the state folder is of step {int(m.group(1))}"))
    checkpoint = info.get("checkpoint")
    if isinstance(checkpoint, str) and checkpoint:
        recorded = _metadata_step(state_dir.parent / f"{checkpoint}.safetensors")
        if recorded is not None and recorded != step:
            raise ResumeError(_bad_state(path, f"global_step = {step}, but its checkpoint {checkpoint}.safetensors "
                                               f"was saved at step {recorded}"))
    return info  # batch_in_epoch's upper bound needs the data: check_position


def check_position(state_dir: Path, info: dict, batches_per_epoch: int) -> None:
    """What only the resume itself reads: the epoch, and batch_in_epoch within an epoch of this run's data (known once
    the data loader is built)."""
    if "epoch" not in info:
        raise ResumeError(_bad_state(Path(state_dir) / STATE_FILE, "has no epoch"))
    batch = info.get("batch_in_epoch", 0)
    if batch > batches_per_epoch:
        raise ResumeError(_bad_state(Path(state_dir) / STATE_FILE,
                                     f"batch_in_epoch = {batch} is past the end of an epoch ({batches_per_epoch} "
                                     f"batches per epoch here)"))


def _bad_state(path: Path, what: str) -> str:
    state = path.parent
    return (f"{path}: {what}; the state file was edited or is damaged, so {state.name} cannot be resumed. Resume "
            f"from another state, or restore the file.{_states_hint(state.parent, state)}")


def describe_adapter(cfg) -> dict:
    """What the trainable tensors' names and shapes depend on, as state.json records it: a resume with another
    adapter (rank 8 state, rank 4 config) is named by key before the model loads."""
    a = cfg.adapter
    out = {"kind": a.kind, "components": sorted(a.components), "train_llm_adapter": a.train_llm_adapter,
           "train_text_encoder": a.train_text_encoder}
    if a.train_text_encoder:
        out["text_encoder_rank"] = a.text_encoder_rank or a.rank
    out.update(adapters.method(a.kind).describe(a))  # the method's own keys: rank, lokr_factor, ...
    return out


def refuse_adapter_change(state_dir: Path, info: dict, cfg) -> None:
    saved = info.get("adapter")
    if not isinstance(saved, dict):
        return  # a state from before the description: the tensors are compared when they load
    now = describe_adapter(cfg)
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            def show(v):
                return "unset" if v is None else json.dumps(v)

            raise ResumeError(
                f"resume_from = {str(state_dir)!r}: [adapter] {key}: the state has {show(saved.get(key))}, this "
                f"config has {show(now.get(key))}. A run resumes with the adapter it was trained with: set [adapter] "
                f"{key} = {show(saved.get(key))} to resume it, or start a new run (no resume_from) for the new "
                f"adapter.")


def refuse_older_state(state_dir: Path, step: int, run_dir: Path, free_name: str) -> None:
    """A resume into the run folder the state belongs to must start from its newest state: from an older one it
    would overwrite the run's later final checkpoint, state and config copy (the later periodic files staying
    beside them). A checkpoint whose state is missing (a run killed while writing it) is no newer state."""
    try:
        same_run = Path(state_dir).resolve().parent == Path(run_dir).resolve()
    except OSError:
        return
    newest = latest_state(run_dir) if same_run else None
    if newest is None or newest.resolve() == Path(state_dir).resolve():
        return
    newest_step = int(json.loads((newest / STATE_FILE).read_text(encoding="utf-8"))["global_step"])
    if newest_step <= step:
        return
    raise ResumeError(
        f"resume_from = {str(state_dir)!r} is at step {step}, but its run folder holds a later state, {newest} "
        f"(step {newest_step}): resuming from the older one would replace that run's newer files (its final "
        f"checkpoint, -state and config copy). Resume from the newest state: [train] resume_from = "
        f"\"{newest.as_posix()}\", or to branch off at step {step}, keep resume_from and give this run a new "
        f"[train] run_name = \"{free_name}\".")


LOSSES_FILE = "losses.json"  # in a state folder: the loss of every step so far, so a resumed run plots all of them


def read_losses(state_dir: Path, step: int) -> tuple[int, list[float]]:
    """(first step, losses up to `step`) from the state's losses.json; (step + 1, []) when it has none (a state
    from before the file) or it does not end at `step`."""
    try:
        data = json.loads((Path(state_dir) / LOSSES_FILE).read_text(encoding="utf-8"))
        first, losses = int(data["first_step"]), [float(v) for v in data["losses"]]
    except (OSError, ValueError, KeyError, TypeError):
        return step + 1, []
    if first < 1 or first + len(losses) - 1 != step:
        return step + 1, []
    return first, losses


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


