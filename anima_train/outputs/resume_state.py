"""The resumable `<stem>-state/` folder beside a checkpoint: its files, writing it, and reading it back.

    <stem>-state/
      state.json                       the position: global_step, epoch, batch_in_epoch, steps_per_epoch, processes,
                                       run, checkpoint, adapter (what the trainable tensors depend on)
      losses.json                      every step's loss so far (a resumed run's loss plot covers the whole run)
      accelerator/trainable.safetensors  the trained tensors only (a LoRA run's state is megabytes, not the base)
      accelerator/optimizer.pt, scheduler.pt   torch.save of plain tensors and numbers (weights_only loads them)
      accelerator/rng_rank<N>.safetensors      each process's random generators

Every file name is defined here, once; `resolve_resume` and `read_state` refuse a state that cannot be resumed
before any model loads, naming the file and the fix (docs/training.md#outputs-and-resume).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from anima_train import adapters
from anima_train.data.identity import file_change, file_identity
from anima_train.errors import UserError
from anima_train.files import publish_dir, write_json, write_text
from anima_train.outputs.checkpoint_files import writing
from anima_train.outputs.layout import (ACCELERATOR_DIR, LOSSES_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, STATE_FILE,
                                        STATE_SUFFIX, TORCH_FILES, TRAINABLE_FILE, checkpoint_step, latest_state,
                                        rng_file, state_dir_for)


class ResumeError(UserError, ValueError):
    """A resume_from that cannot be resumed; the message names the path and the fix."""


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
            with safe_open(str(f), "pt") as fh:
                config = json.loads((fh.metadata() or {})["ss_training_config"])
            return bool(config["train"]["save_optimizer_state"])
        except Exception:  # a file without our metadata (or not safetensors): unknown
            continue
    return None


def _check_state_files(state_dir: Path) -> None:
    """Cheap whole-file checks (headers and zip directories, not the tensors) so that a truncated or foreign file
    is named before minutes of model loading; `load_state_file` names one that fails later."""
    read_losses(state_dir, read_state(state_dir)["global_step"])
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
        recorded = checkpoint_step(state_dir.parent / f"{checkpoint}.safetensors")
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


def read_losses(state_dir: Path | None, step: int) -> tuple[int, list[float]]:
    """(first step, losses up to `step`) from the state's losses.json; (step + 1, []) for a fresh run (no state) or a
    state from before the file. A file that is there but damaged is refused like a damaged state.json: resuming
    without it would silently drop the run's loss history from the plot and from every later state."""
    if state_dir is None or not (Path(state_dir) / LOSSES_FILE).exists():
        return step + 1, []
    path = Path(state_dir) / LOSSES_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        first, losses = int(data["first_step"]), [float(v) for v in data["losses"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ResumeError(_bad_losses(path, f"cannot be read as the run's loss history ({type(e).__name__})")
                          ) from None
    if first < 1 or first + len(losses) - 1 != step:
        raise ResumeError(_bad_losses(path, f"holds the losses of steps {first} to {first + len(losses) - 1}, but "
                                            f"the state is at step {step}"))
    return first, losses


def _bad_losses(path: Path, what: str) -> str:
    return (f"{path} {what}; the file was edited or is damaged, and resuming would lose the run's loss history. "
            f"Restore the file, resume from another state, or delete the file to resume without the earlier "
            f"losses.{_states_hint(path.parent.parent, path.parent)}")


# -- what a state was trained on: the base model and the dataset (data/identity.py) ------------------------------

def run_inputs(cfg, data) -> dict:
    """state.json's `inputs`: the base model's files (identities) and the dataset's (size, mtime), so a resume on
    another model is refused and one on a changed dataset is said (refuse_model_change, inputs_changed)."""
    root = Path(cfg.train.model_path)
    weights = sorted(p for p in root.rglob("*") if p.is_file() and (p.suffix == ".safetensors"
                                                                    or p.name == "config.json"))
    return {"model_path": str(cfg.train.model_path),
            "model": {p.relative_to(root).as_posix(): file_identity(p) for p in weights},
            "dataset": dataset_record(data)}


def dataset_record(data) -> dict:
    """{"<subset>/<path in its folder>": [size, mtime_ns]} of the file each training entry reads (its image, or its
    cache when the image is gone): what a resume compares (build_training_data's TrainingData)."""
    out = {}
    for e in data.entries:
        src = data.sources[e.source]
        folder = data.scan.folders[src.folder]
        path = src.image or e.cache
        st = path.stat()
        root = Path(data.scan.subsets[folder.subset].path).expanduser()  # as scan_folders reads it
        out[f"{folder.subset}/{path.relative_to(root).as_posix()}"] = [
            st.st_size, st.st_mtime_ns]
    return out


def refuse_model_change(state_dir: Path, info: dict, cfg) -> None:
    """A resume continues the adapter on the base model it was trained on: another model (a file that differs, not
    merely another path) is refused before it loads."""
    saved = info.get("inputs", {}).get("model") if isinstance(info.get("inputs"), dict) else None
    if not isinstance(saved, dict):
        return  # a state from before the record: inputs_changed says so
    root = Path(cfg.train.model_path)
    differ = [(rel, why) for rel, record in sorted(saved.items()) if (why := file_change(record, root / rel))]
    if differ:
        then = info["inputs"].get("model_path")
        rel, why = differ[0]
        raise ResumeError(
            f"resume_from = {str(state_dir)!r} was trained on another base model: [train] model_path = "
            f"{str(cfg.train.model_path)!r} has {rel} that {why}" + (f" (and {len(differ) - 1} more file(s))"
                                                                     if len(differ) > 1 else "")
            + ". A run resumes on the model it was trained on: set [train] model_path = "
            + (f"{json.dumps(then)} again" if then else "back to that model")
            + ", or start a new run (no resume_from) on this one.")


def inputs_changed(state_dir: Path | None, data) -> list[str]:
    """The warning for a resume whose dataset is not the one its state was trained on (files gone, new or changed),
    or whose state records no inputs; [] when there is nothing to say."""
    if state_dir is None:
        return []
    info = read_state(state_dir)
    saved = info.get("inputs") if isinstance(info.get("inputs"), dict) else {}
    if not isinstance(saved.get("dataset"), dict):
        return [f"{Path(state_dir).name} does not record the base model and the dataset it was trained on (saved by "
                f"an older anima-train), so a resume on another model or a changed dataset cannot be told: check that "
                f"[train] model_path and the dataset are the run's"]
    before, now = saved["dataset"], dataset_record(data)
    gone, new = sorted(set(before) - set(now)), sorted(set(now) - set(before))
    changed = sorted(k for k in set(before) & set(now) if before[k] != now[k])
    if not (gone or new or changed):
        return []

    def some(keys):
        names = [k.split("/", 1)[1] for k in keys]
        return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")

    parts = [f"{len(keys)} {what} ({some(keys)})" for keys, what in ((gone, "gone"), (new, "new"),
                                                                       (changed, "changed")) if keys]
    mid = (f"; epoch {info.get('epoch', 0) + 1} goes on at batch {info['batch_in_epoch']} of the new set's order, "
           f"so some of its images come twice or not at all" if info.get("batch_in_epoch") else "")
    return [f"the dataset changed since {Path(state_dir).name} was saved ({len(before)} source file(s) then, "
            f"{len(now)} now): {', '.join(parts)}. The resumed run trains on the dataset as it is now{mid}"]


def _states_hint(folder: Path, exclude: Path | None = None) -> str:
    newest = latest_state(folder, exclude=exclude)
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


# -- writing and loading ---------------------------------------------------------------------------------------

def digest(models) -> str:
    """sha256 over the trainable tensors of `models` (equal on every rank under DDP; tests compare runs by it)."""
    h = hashlib.sha256()
    for name, tensor in sorted(trainable_state(models).items()):
        h.update(name.encode())
        h.update(tensor.float().numpy().tobytes())
    return h.hexdigest()


def trainable_state(models) -> dict[str, torch.Tensor]:
    out = {}
    for i, model in enumerate(models):
        for name, p in model.named_parameters():
            if p.requires_grad:
                t = p.detach()
                if type(t).__name__ == "SDNQTensor":  # quantized master weights (quant.mode = "training")
                    t = t.dequantize()
                out[f"{i}/{name}"] = t.to("cpu").contiguous()
    return out


def save_state(state_dir: Path, accelerator, trainable, optimizer, scheduler, gens, info: dict,
                losses: dict | None = None) -> None:
    """`<stem>-state/`: state.json + accelerator/ {trainable weights, optimizer, scheduler, per-rank RNG}, and
    losses.json (every step's loss so far: the plot of a resumed run covers the whole run).

    Only the trainable tensors are stored (a LoRA run's state is megabytes, not the 4 GB base). Every file is
    safetensors or a `torch.save` of plain tensors/numbers that `torch.load(weights_only=True)` reads back."""
    tmp = state_dir.with_name(f".{state_dir.name}.tmp")
    acc = ACCELERATOR_DIR

    def write(name: str, save) -> None:  # a failure names the file a user knows, not the temp one
        with writing(state_dir / name, state_dir.parent, f"The state {state_dir.name}"):
            save(tmp / name)

    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / acc).mkdir(parents=True)
        accelerator.wait_for_everyone()
        write(f"{acc}/{rng_file(accelerator.process_index)}",
              lambda p: save_file({name: g.get_state() for name, g in gens.items()}, str(p)))
        if accelerator.is_main_process:
            unwrapped = [accelerator.unwrap_model(m) for m in trainable]
            write(f"{acc}/{TRAINABLE_FILE}", lambda p: save_file(trainable_state(unwrapped), str(p)))
            write(f"{acc}/{OPTIMIZER_FILE}", lambda p: torch.save(optimizer.state_dict(), p))
            write(f"{acc}/{SCHEDULER_FILE}", lambda p: torch.save(scheduler.state_dict(), p))
            if losses is not None:
                write(LOSSES_FILE, lambda p: write_text(p, json.dumps(losses) + "\n"))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write(STATE_FILE,
                  lambda p: write_json(p, {**info, "processes": accelerator.num_processes}))
            publish_dir(tmp, state_dir)
    except BaseException:
        if accelerator.is_main_process:  # a half-written state is of no use: leave no hidden temp dir behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()


def load_state(state_dir: Path, trainable, optimizer, scheduler, gens, accelerator, *,
                batches_per_epoch: int) -> tuple[int, int, int]:
    """Restore what `save_state` wrote into the prepared modules, optimizer, scheduler and generators; returns
    (global_step, epoch, batch_in_epoch). Refuses a state of another process count or adapter, naming the file."""
    info = read_state(state_dir)
    check_position(state_dir, info, batches_per_epoch)
    if info.get("processes", 1) != accelerator.num_processes:
        raise ResumeError(
            f"{state_dir} was saved by {info.get('processes')} process(es), this run has {accelerator.num_processes}: "
            f"resume with the same number of processes")
    inner = state_dir / ACCELERATOR_DIR
    with load_state_file(inner / TRAINABLE_FILE):
        weights = load_file(str(inner / TRAINABLE_FILE))
    for i, model in enumerate(accelerator.unwrap_model(m) for m in trainable):
        own = {n: p for n, p in model.named_parameters() if p.requires_grad}
        expected = {f"{i}/{n}" for n in own}
        have = {k for k in weights if k.startswith(f"{i}/")}
        if expected != have:
            raise ResumeError(f"{state_dir}: its trainable tensors do not match this run's "
                                   f"({len(have)} saved vs {len(expected)} here); was the adapter config changed?")
        for n, p in own.items():  # a state from before state.json described its adapter: shapes, by tensor
            saved = weights[f"{i}/{n}"]
            if saved.shape != p.shape:
                raise ResumeError(
                    f"{state_dir}: its tensor {n} is {list(saved.shape)}, this run's is {list(p.shape)}: the [adapter] "
                    f"settings (rank, kind, components) differ from the run that saved it; set them back to resume "
                    f"it, or start a new run")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(weights[f"{i}/{n}"])
    with load_state_file(inner / OPTIMIZER_FILE):
        optimizer_state = torch.load(inner / OPTIMIZER_FILE, weights_only=True, map_location="cpu")
    with load_state_file(inner / SCHEDULER_FILE):
        scheduler_state = torch.load(inner / SCHEDULER_FILE, weights_only=True)
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(scheduler_state)
    rng = inner / rng_file(accelerator.process_index)
    with load_state_file(rng):
        rng_states = load_file(str(rng))
    for name, state in rng_states.items():
        gens[name].set_state(state)
    return int(info["global_step"]), int(info["epoch"]), int(info.get("batch_in_epoch", 0))
