"""Learning-rate schedules: one multiplier curve on each param group's own peak LR
(docs/training.md#learning-rate-schedules).

    mult = lr_multiplier(step, total_steps, cfg.schedule)        # pure math, step = optimizer step
    sched = build_scheduler(optimizer, cfg.schedule, total_steps, accelerator.num_processes)
    optimizer, sched = accelerator.prepare(optimizer, sched)    # Accelerate wraps it; see build_scheduler

Notation (as in the docs): W = warmup_steps, D = max(1, total − W), p = min(1, (step − W)/D), f = min_lr_ratio.
Warmup is (step+1)/W for step < W; after it the curve starts at exactly 1, so the two join without a jump.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from anima_train.config import ScheduleConfig


def _rex(p: float, d: float) -> float:
    """REX decay R(p, d) = (1−p) / ((1−d) + d(1−p)): 1 at p = 0, 0 at p = 1; d = 0 is linear, larger d holds
    the peak longer and drops late."""
    return (1.0 - p) / ((1.0 - d) + d * (1.0 - p))


def _check(cfg: ScheduleConfig, total_steps: int) -> None:
    if total_steps < 1:
        raise ValueError(f"total_steps = {total_steps}: a schedule needs at least one optimizer step")


def rerex_segment_lengths(decay_steps: int, num_segments: int, weight_power: float) -> list[int]:
    """ReREX step budget: segment i (0-based) gets ⌊D·w_i/Σw⌋ with w_i = (n−i)^weight_power, the rounding
    remainder going to the last. Short runs leave early-rounded segments at 0 (they are skipped)."""
    weights = [(num_segments - i) ** weight_power for i in range(num_segments)]
    total = sum(weights)
    lengths = [math.floor(decay_steps * w / total) for w in weights[:-1]]
    lengths.append(decay_steps - sum(lengths))
    return lengths


def _rerex(position: float, decay_steps: int, cfg: ScheduleConfig) -> float:
    """ReREX decay in [0, 1] at `position` steps into the decay phase (0 ≤ position ≤ D).

    Segment boundaries sit on the global curve R(·, global_d); inside a segment the value falls from its start
    to its end along R(q, local_d). Segment i ends where i+1 starts, so the curve is continuous and monotone
    (not warm restarts)."""
    start = 0
    for length in rerex_segment_lengths(decay_steps, cfg.num_segments, cfg.weight_power):
        if length == 0:
            continue
        end = start + length
        if position <= end:
            high = _rex(start / decay_steps, cfg.global_d)
            low = _rex(end / decay_steps, cfg.global_d)
            return low + (high - low) * _rex((position - start) / length, cfg.local_d)
        start = end
    return 0.0  # past the horizon (lengths sum to D, so only position > D lands here)


def lr_multiplier(step: int, total_steps: int, cfg: ScheduleConfig | None = None, **keys) -> float:
    """The LR multiplier at optimizer step `step` (0-based) of a `total_steps` run.

    `cfg` is the [schedule] table; alternatively pass its keys by name (`kind="rex", d=0.9, ...`), which override
    the defaults (or `cfg`). Steps past the horizon stay at the floor f."""
    cfg = dataclasses.replace(cfg if cfg is not None else ScheduleConfig(), **keys)
    _check(cfg, total_steps)
    if step < 0:
        raise ValueError(f"step = {step} must be >= 0")
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = max(1, total_steps - warmup)
    p = min(1.0, (step - warmup) / decay_steps)
    f = cfg.min_lr_ratio
    if cfg.kind == "constant":
        return 1.0
    if cfg.kind == "linear":
        decay = 1.0 - p
    elif cfg.kind == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * p))
    elif cfg.kind == "rex":
        decay = _rex(p, cfg.d)
    else:  # rerex
        decay = _rerex(p * decay_steps, decay_steps, cfg)
    return f + (1.0 - f) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int,
                    num_processes: int = 1) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR applying `lr_multiplier` to every param group's own initial (peak) LR, so per-component LR
    ratios survive warmup and decay.

    Under Accelerate with split_batches=False (our setting), AcceleratedScheduler.step() steps the wrapped
    scheduler `AcceleratorState().num_processes` times per optimizer step (accelerate 1.15.0,
    accelerate/scheduler.py, AcceleratedScheduler.step: "the training dataloader batch size was multiplied by
    `num_processes`, so we need to do num_processes steps per training step"). Our warmup and horizon count
    optimizer steps, so the inner step count is divided back by num_processes: the same as multiplying warmup
    and horizon by num_processes, but evaluated at whole optimizer steps, so 1 and N processes get the identical
    curve (unscaled, a 2-GPU cosine reached 0 halfway through the run).

    Step it once per optimizer step, through the Accelerate wrapper when there is one (a bare LambdaLR stepped
    once per optimizer step wants num_processes = 1)."""
    if num_processes < 1:
        raise ValueError(f"num_processes = {num_processes} must be >= 1")
    _check(cfg, total_steps)
    cfg = dataclasses.replace(cfg)  # a private copy: later edits to the config must not bend a running curve

    def multiplier(inner_step: int) -> float:
        return lr_multiplier(inner_step // num_processes, total_steps, cfg)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
