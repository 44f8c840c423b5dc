"""The run folder's layout: every name a run writes into `<output_dir>/<run_name>/`, defined once.

    <run_name>.toml                      the config, copied verbatim
    <run_name>-step000060.safetensors    periodic checkpoint, 6-digit step     (checkpoint_stem)
    <run_name>-epoch005.safetensors      periodic checkpoint, 1-based epoch
    <run_name>.safetensors               the final checkpoint (a full finetune may be a diffusers folder `<stem>/`)
    <stem>_te.safetensors                the Qwen3 LoRA beside a checkpoint  (adapters' text_encoder_lora_path)
    <stem>-state/                        what resuming needs (outputs/resume_state.py)
    loss.png, samples/, logs/            the loss chart, [sample] previews, [logging] TensorBoard
    .anima-train.lock                    held while a process trains into the folder (outputs/run_folder.py)
    .anima-train-run.json                what the run created in the folder (outputs/manifest.py)

docs/training.md#outputs-and-resume has the user's view.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from safetensors import safe_open

STATE_SUFFIX = "-state"
STATE_FILE = "state.json"
LOSSES_FILE = "losses.json"
ACCELERATOR_DIR = "accelerator"
TRAINABLE_FILE = "trainable.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
TORCH_FILES = (OPTIMIZER_FILE, SCHEDULER_FILE)  # torch.save zip archives
LOSS_PLOT_NAME = "loss.png"  # the loss chart, at the end of every run that saves
SAMPLES_DIR = "samples"  # [sample] preview images
LOGS_DIR = "logs"  # [logging] TensorBoard runs
LOCK_NAME = ".anima-train.lock"  # outputs/run_folder.py: one process trains into a folder at a time
MANIFEST_NAME = ".anima-train-run.json"  # outputs/manifest.py: the entries the run created, by the run itself


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.safetensors"


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



def checkpoint_step(path: Path) -> int | None:
    """The optimizer step a checkpoint file records in its metadata (None: not ours, or not readable)."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        return int(meta["step"]) if "step" in meta else None
    except Exception:
        return None


def latest_state(run_dir: str | os.PathLike, run_stem: str | None = None, exclude: Path | None = None) -> Path | None:
    """The complete `-state` folder with the highest recorded step in run_dir (of the run named `run_stem` only,
    when given); hidden temp folders and `exclude` are skipped. What `resume_from` should name."""
    best, best_step = None, -1
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    mine = re.compile(rf"^{re.escape(run_stem)}(?:-(?:step|epoch)\d+)?{re.escape(STATE_SUFFIX)}$") if run_stem else None
    for p in sorted(run_dir.iterdir()):
        if p.name.startswith(".") or not p.name.endswith(STATE_SUFFIX) or p == exclude or not p.is_dir():
            continue
        if mine is not None and not mine.match(p.name):
            continue
        try:
            step = int(json.loads((p / STATE_FILE).read_text(encoding="utf-8"))["global_step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if step > best_step:
            best, best_step = p, step
    return best
