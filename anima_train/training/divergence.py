"""A run whose loss or gradient norm becomes non-finite stops there, saving nothing of that step on.

The loss is checked when its step is read (training/readout.py). A gradient norm is queued on the device and read
one step late (reading this step's would wait for its backward), and always before a checkpoint is written, so no
saved weights were touched by a non-finite gradient.

A non-finite loss is blamed on the learning rate only when the base model's own weights are finite: a damaged model
file is said as such (the lr did not cause it, and lowering it would not help).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from anima_train import errors
from anima_train.outputs.layout import latest_state
from anima_train.training.memory import HostCopy


class Diverged(errors.UserError):
    """The loss or the gradient norm became non-finite: the run stops there, saving nothing of that step on."""

    exit_code = errors.DIVERGED_EXIT


def grad_norm(params) -> torch.Tensor | None:
    """The total gradient norm (what clip_grad_norm_ returns) when nothing clips: queued on the device, not read."""
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None


def diverged(cfg, run_dir: Path, saved: list, step: int, what: str, model=None) -> Diverged:
    """Every rank sees the same loss (the mean over ranks) and norm (after the all-reduce): all stop here. `model`
    (training.models.Model): its frozen weights are looked at first, as a learning rate cannot have made them
    non-finite."""
    newest = latest_state(run_dir) if run_dir.is_dir() else None
    kept = (f"the last good checkpoint and state are kept (newest: {newest})" if newest is not None
            else "the checkpoints saved before it are kept" if saved
            else "nothing was saved before it")
    damaged = _non_finite_frozen(model) if model is not None else []
    if damaged:
        shown = ", ".join(damaged[:3]) + (f" and {len(damaged) - 3} more" if len(damaged) > 3 else "")
        return Diverged(
            f"training diverged at step {step}: {what}, because the base model itself holds non-finite weights "
            f"({shown}), which training never changes: the model files in [train] model_path = "
            f"{cfg.train.model_path!r} are damaged; convert or download them again ({kept})")
    clip = ("" if cfg.optimizer.max_grad_norm > 0
            else ", set [optimizer] max_grad_norm (gradient clipping, e.g. 1.0)")
    return Diverged(
        f"training diverged at step {step}: {what}; nothing from this step on was saved, {kept}. Lower [optimizer] "
        f"lr (now {cfg.optimizer.lr:g}){clip}, or look for damaged data, then resume from the newest state or start "
        f"again")


def _non_finite_frozen(model) -> list[str]:
    """The names of the frozen floating-point weights (the base model's) that hold a NaN or an infinity."""
    bad, seen = [], set()
    for module in (model.transformer, model.conditioner, model.text_encoder):
        for name, p in module.named_parameters():
            if p.requires_grad or id(p) in seen or not p.is_floating_point():
                continue
            seen.add(id(p))
            if not bool(torch.isfinite(p).all()):
                bad.append(name)
    return bad


class GradNorms:
    """Pre-clip gradient norms by optimizer step, on their way to the host: checked to be finite, and logged to
    TensorBoard when it is on."""

    def __init__(self, cfg, run_dir: Path, saved: list, *, logged: bool):
        self.cfg, self.run_dir, self.saved, self.logged = cfg, run_dir, saved, logged
        self.unchecked: list[tuple[int, HostCopy]] = []
        self.unlogged: list[tuple[int, HostCopy]] = []

    def add(self, step: int, norm: torch.Tensor | None) -> None:
        if norm is None:
            return
        copy = HostCopy(norm.float().reshape(1))
        self.unchecked.append((step, copy))
        if self.logged:
            self.unlogged.append((step, copy))

    def check(self, before: int | None = None) -> None:
        """Raise Diverged at the first non-finite norm of the steps before `before` (None: every step so far,
        which waits for the last backward: done before a save, which waits for it anyway)."""
        while self.unchecked and (before is None or self.unchecked[0][0] < before):
            step, copy = self.unchecked.pop(0)
            value = copy.read()[0]
            if not math.isfinite(value):
                raise diverged(self.cfg, self.run_dir, self.saved, step, f"the gradient norm is {value}")

    def log(self, tracker, before: int | None = None) -> None:
        """Send the norms of the steps before `before` (None: all) to the tracker."""
        while self.unlogged and (before is None or self.unlogged[0][0] < before):
            step, copy = self.unlogged.pop(0)
            tracker.grad_norm(step, copy.read()[0])
