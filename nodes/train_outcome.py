"""What the Train node gives back when a run ends: the result copied where the stock loaders list it, the loss
chart as an IMAGE, the summary text; and after a Cancel, the record that lets the same inputs resume and the text
that says so."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from anima_train import adapters
from anima_train.adapters.export import text_encoder_lora_path
from anima_train.outputs.layout import LOSS_PLOT_NAME, state_dir_for
from anima_train.outputs.plot import plot_losses

from . import comfy
from . import run_records
from .relay import Relay
from .run_picking import JOB_CONFIG_NAME, JOB_LOCK_NAME

PUBLISH_SUBDIR = "anima_train"  # models/loras/anima_train/<run>.safetensors (full finetunes: diffusion_models)


def loss_image(losses: list[float], run_dir: Path):
    """The run's loss chart as a ComfyUI IMAGE tensor [1, H, W, 3] in 0..1: the trainer's own `loss.png` (a
    resumed run's covers the whole run); drawn from `losses` without writing a file when the run has none."""
    chart = run_dir / LOSS_PLOT_NAME
    if chart.is_file():
        img = Image.open(chart).convert("RGB")
    elif losses:
        with tempfile.TemporaryDirectory() as tmp:
            plot_losses(losses, Path(tmp) / LOSS_PLOT_NAME, title=f"training loss: {run_dir.name}")
            img = Image.open(Path(tmp) / LOSS_PLOT_NAME).convert("RGB")
    else:
        img = Image.new("RGB", (64, 64), "white")
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)[None]


def publish(final: Path, kind: str, run_stem: str) -> Path | None:
    """Copy the trained file where the stock loaders list it: <the method's comfy_folder>/anima_train/ (loras for
    an adapter, diffusion_models for a full finetune's native single file). Never replaces a user's file."""
    if not final.is_file():
        return None  # a full finetune saved as diffusers folders: nothing a stock loader reads
    folder = adapters.method(kind).comfy_folder
    dest = run_records.publish_copy(final, Path(comfy.model_folder(folder)) / PUBLISH_SUBDIR, f"{run_stem}.safetensors")
    te = text_encoder_lora_path(final)
    if te.is_file():  # the Qwen3 LoRA sibling, named after the copy
        run_records.publish_copy(te, dest.parent, text_encoder_lora_path(dest).name)
    return dest


def summary(cfg, final, published, steps, seconds, reused, warnings=(), note=None, memory_plan=None,
             validation=()) -> str:
    lines = [f"{'re-used the finished run' if reused else 'trained'} {cfg.run_stem}: {steps} step(s)"
             + ("" if reused else f" in {seconds:.0f} s"),
             f"file     {final}"]
    lines += [f"memory   {line}" for line in memory_plan or ()]  # the plan the run chose, as the trainer said it
    lines += list(validation)  # "validation loss A → B, margin C → D"; its verdicts are among the warnings
    if note:
        lines.insert(0, note)
    if published:
        lines.append(f"copy     {published} (listed by the stock loaders)")
    lines += [f"warning: {w}" for w in warnings]
    return "\n".join(lines)


def after_cancel(run_dir: Path, key: str, relay: Relay) -> None:
    """After Cancel: say on the node where the run stopped and how it goes on, and record a resumable stop so that
    queueing the same inputs again resumes it. Never raises (ComfyUI's interrupt must go on)."""
    try:
        done = relay.stop_done or {}
        step, total = done.get("step") or relay.last_step.get("step"), done.get("total") or relay.total
        saved = [Path(p) for p in done.get("saved") or []]
        state = state_dir_for(saved[-1]) if saved else None
        if not relay.steps_seen:  # nothing trained: a folder only this job wrote to goes (no "-3" left over)
            run_records.discard_unstarted_run(run_dir, {JOB_CONFIG_NAME, JOB_LOCK_NAME})
        if not done or not saved:
            text = (f"cancelled at step {step} of {total}: the worker was ended before it saved (nothing new "
                    f"was written); queue again to start over" if step else
                    "cancelled before the first step: nothing was trained or saved")
        elif state is not None and state.is_dir():
            run_records.write_cancelled(run_dir, key, state, step, total)
            text = (f"cancelled at step {step} of {total}: saved {saved[-1]} and its resume state; queue "
                    f"again (same inputs) to resume from step {step}")
        else:
            text = (f"cancelled at step {step} of {total}: saved {saved[-1]} (no resume state: "
                    f"save_state_on_stop = false)")
        relay.after_stop({"event": "cancelled", "step": step, "total": total, "text": text,
                          "resumable": bool(state is not None and state.is_dir())})
    except Exception:  # noqa: BLE001
        pass
