"""A loss chart as a PNG, drawn with Pillow (already a dependency) — raw per-step loss plus its EMA.

Flow-matching loss is noisy by construction (every step draws a different timestep), so the EMA line is the one
to read; the raw points show the spread.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from PIL import Image, ImageDraw

from anima_train.files import atomic_path


# The loss EMA of both charts: this PNG and the node's live chart (js/loss_chart.js EMA_BETA, which a test holds
# equal to this; the browser cannot import Python and a page opened mid-run gets no start event to carry it).
# ~20-step memory: smooths the per-bucket noise, still follows LR-schedule changes.
LOSS_EMA_BETA = 0.95


def ema(values: list[float], beta: float = LOSS_EMA_BETA) -> list[float]:
    """Bias-corrected exponential moving average (no ramp up from 0), as the live chart draws it."""
    out, acc = [], 0.0
    for n, v in enumerate(values, 1):
        acc = beta * acc + (1 - beta) * v
        out.append(acc / (1 - beta ** n))
    return out


def nice_ticks(lo: float, hi: float, target: int = 5) -> tuple[list[float], int]:
    """Round tick values covering [lo, hi] (steps of 1, 2, 2.5 or 5 x 10^k, about `target` of them) and the
    number of decimals that prints each one exactly: 1.3, 1.4, 1.5 rather than 1.285, 1.42, 1.555."""
    span = max(hi - lo, 1e-12)
    raw = span / max(1, target - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9)
    ticks = [round(k * step, 12) for k in range(first, math.floor(hi / step + 1e-9) + 1)]
    decimals = max(0, -math.floor(math.log10(step) + 1e-9) + (1 if step / power == 2.5 else 0))
    return ticks, decimals


def plot_losses(losses: list[float], path: str | os.PathLike, title: str = "training loss",
                size: tuple[int, int] = (800, 450), first_step: int = 1,
                validation: list[tuple[int, float]] = ()) -> Path:
    """Write a PNG chart of `losses` (one value per optimizer step, the first being step `first_step`) and the
    `[validation]` loss as a second line, orange (`validation`: (optimizer step, loss) pairs; step 0 = before the
    first step). Atomic write."""
    if not losses:
        raise ValueError("no losses to plot")
    w, h = size
    left, right, top, bottom = 70, 20, 40, 45
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)
    val_losses = [v for _, v in validation]
    lo, hi = min(losses + val_losses), max(losses + val_losses)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    pad = 0.05 * (hi - lo)
    lo, hi = lo - pad, hi + pad
    n = len(losses)

    x_lo = min([0] + [s - first_step for s, _ in validation])  # a validation point may precede the first step

    def xy(i: float, v: float) -> tuple[float, float]:
        x = left + (w - left - right) * ((i - x_lo) / max(1, n - 1 - x_lo))
        y = top + (h - top - bottom) * (1 - (v - lo) / (hi - lo))
        return x, y

    # axes, grid and labels
    d.rectangle([left, top, w - right, h - bottom], outline="black")
    ticks, decimals = nice_ticks(lo, hi)
    for v in ticks:
        _, y = xy(0, v)
        d.line([left, y, w - right, y], fill=(225, 225, 225))
        label = f"{v:.{decimals}f}"
        d.text((left - 6 - d.textlength(label), y - 6), label, fill="black")
    steps = sorted({round((n - 1) * k / 4) for k in range(5)})
    for i in steps:
        x, _ = xy(i, lo)
        label = str(first_step + i)
        d.line([x, h - bottom, x, h - bottom + 4], fill="black")
        d.text((x - d.textlength(label) / 2, h - bottom + 8), label, fill="black")
    legend = "grey: per step, blue: EMA" + (", orange: validation" if validation else "")
    d.text((left, 12), f"{title}  ({n} steps; {legend})", fill="black")
    d.text((w // 2 - 30, h - 18), "optimizer step", fill="black")
    d.text((5, top - 16), "loss", fill="black")

    raw = [xy(i, v) for i, v in enumerate(losses)]
    if n > 1:
        d.line(raw, fill=(170, 170, 170), width=1)
        d.line([xy(i, v) for i, v in enumerate(ema(losses))], fill=(30, 90, 200), width=3)
    for x, y in raw:
        d.ellipse([x - 2, y - 2, x + 2, y + 2], fill=(120, 120, 120))
    val = [xy(s - first_step, v) for s, v in validation]
    if len(val) > 1:
        d.line(val, fill=(230, 120, 20), width=3)
    for x, y in val:
        d.ellipse([x - 4, y - 4, x + 4, y + 4], fill=(230, 120, 20))

    with atomic_path(path) as tmp:
        img.save(tmp, format="PNG")
    return Path(path)
