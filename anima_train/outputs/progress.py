"""How a run reports itself: a tqdm bar, plain lines, or nothing per step — plus a JSON-lines event stream.

Human output (docs/training.md#progress-output):
  bar    e3  47%|█████▍      | 1410/3000 [42:11<47:34, 1.80s/step, loss 0.0712 (mse 0.0650 + hf 0.0062)  lr 2.71e-05  peak 8.1GB]
  plain  e3 step 1410/3000 (47%)  loss 0.0712 (mse 0.0650 + hf 0.0062)  lr 2.71e-05  1.80s/it  peak 8.1GB  eta 47m34s
`auto` draws the bar on a terminal and plain lines otherwise (a bar redirected into a log file is thousands of
\\r-fragments); `off` drops the per-step report but keeps start-up and checkpoint messages.

The ETA is the cumulative mean step time since an anchor taken *after* the first step, times the steps left: buckets
differ in token count, so the last interval would swing the estimate several-fold, and step 1 carries one-off costs
(compile, the first dataloader fork).

Events (`--events PATH` or `-` for stdout) are one JSON object per line, for the ComfyUI node and other tools:
  {"event": "start", "total", "steps_per_epoch", "epochs" (as many as the steps reach), "processes", "run_dir",
  "device" ("cpu", "cuda"), "resumed_step", "first_loss_step", "losses" (a resumed run's before it: the node's
  chart draws the whole run)} {"event": "status", "message": ...} {"event": "step", "step", "total", "epoch", "loss",
  "terms": {name: value} (the loss's terms as the loss function names them, training/flow.py LOSS_TERMS; only those
  reported, {} when the loss has one term: it is the loss), "ot", "lr": [...],
  "s_per_step", "eta_s", "peak_gb": [...], "phase": {"index", "count", "mode", "t_range", "lr_mul"} (with a
  curriculum only)} {"event": "message", "text"}
  {"event": "warning", "text"} {"event": "checkpoint", "path", "step"} {"event": "done", ...}
  {"event": "error", "message", "traceback"}
Only the main process reports; the trainer passes `enabled=False` on other ranks.
"""  # noqa: E501 (the bar line above is shown as the terminal draws it, on one line)

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any

from tqdm import tqdm

from anima_train import errors
from anima_train.errors import UserError

# The memory plan's `message` events start with this (training/memory.py says them): the Train node keeps the
# latest one and shows it in its result text, not only as the chart's passing note.
PLAN_PREFIX = "checkpointing auto:"
SWAP_PREFIX = "swap auto:"  # the same for swap_blocks = "auto" (training/swap_plan.py), said before the model loads
# the start of the run's one-line [validation] summary (training/validation.summary); the node keeps that line
VALIDATION_PREFIX = "validation loss "

PROGRESS_MODES = ("auto", "bar", "plain", "off")


def _hms(seconds: float | None) -> tuple[int, int, int] | None:
    if seconds is None or not math.isfinite(seconds):
        return None
    h, rem = divmod(int(round(seconds)), 3600)
    return (h, *divmod(rem, 60))


def format_duration(seconds: float | None) -> str:
    """47m34s, 1h02m03s, 9s — compact, as in the plain progress line."""
    hms = _hms(seconds)
    if hms is None:
        return "?"
    h, m, s = hms
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def format_clock(seconds: float | None) -> str:
    """tqdm-style 42:11 / 1:02:03."""
    hms = _hms(seconds)
    if hms is None:
        return "?"
    h, m, s = hms
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


@dataclass
class StepStats:
    step: int  # optimizer steps done (1-based after the first)
    epoch: int  # 1-based
    loss: float
    lrs: list[float]
    # the loss's terms by name (training/flow.py LOSS_TERMS), the `step` event's "terms"; None where not reported
    # (a run whose loss has one term reports none: it is the loss)
    terms: dict[str, float | None] = field(default_factory=dict)
    ot: float | None = None  # fraction of noise rows moved, only with use_ot
    peak_gb: list[float] = field(default_factory=list)  # one per rank; empty on CPU
    phase: dict | None = None  # the curriculum phase of the step (flow.phase_summary); None without a curriculum


def describe_step(stats: StepStats) -> str:
    """The part of a progress line after the counters: loss parts, ot, lr, peak."""
    terms = " + ".join(f"{name} {value:.4f}" for name, value in stats.terms.items() if value is not None)
    parts = [f"loss {stats.loss:.4f}" + (f" ({terms})" if terms else "")]
    if stats.ot is not None:
        parts.append(f"ot {stats.ot:.2f}")
    if stats.phase:
        parts.append(f"phase {stats.phase['index']}/{stats.phase['count']} {stats.phase['mode']}")
    distinct = []
    for lr in stats.lrs:
        if f"{lr:.2e}" not in distinct:
            distinct.append(f"{lr:.2e}")
    parts.append("lr " + "/".join(distinct))
    return "  ".join(parts)


def _peak(stats: StepStats) -> str:
    return f"peak {'/'.join(f'{g:.1f}' for g in stats.peak_gb)}GB" if stats.peak_gb else ""


def _open_events(path: str) -> IO[str]:
    """The events file, opened for appending; a path that cannot be one is the user's to fix (one line)."""
    if os.path.isdir(path):
        raise UserError(f"--events {path}: is a folder; give a file path in it "
                        f"(e.g. {os.path.join(path, 'events.jsonl')}) or - for stdout")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UserError(f"--events {path}: the folder {folder} does not exist; create it first or give a path in an "
                        f"existing folder")
    try:
        return open(path, "a", encoding="utf-8", buffering=1)
    except OSError as exc:
        raise UserError(f"--events {path}: cannot be opened for writing ({exc.strerror}); give another path") from None


class Progress:
    def __init__(self, mode: str, total_steps: int, *, enabled: bool = True, events: str | None = None,
                 stream: IO[str] | None = None, start_step: int = 0):
        if mode not in PROGRESS_MODES:
            raise ValueError(f"progress mode {mode!r}: use one of {', '.join(PROGRESS_MODES)}")
        self.enabled = enabled
        self.total = total_steps
        self._events: IO[str] | None = None
        self._own_events = False
        # With events on stdout, stdout belongs to the machine-readable stream; humans get stderr.
        self.stream = stream or (sys.stderr if events == "-" else sys.stdout)
        if enabled and events:
            if events == "-":
                self._events = sys.stdout
            else:
                self._events, self._events_path = _open_events(events), events
                self._own_events = True
        if mode == "auto":
            mode = "bar" if _isatty(self.stream) else "plain"
        self.mode = mode
        self._bar = None
        self._start_step = start_step
        self._anchor: tuple[float, int] | None = None  # (time, step) after the first step
        self._t0 = time.perf_counter()
        if enabled and mode == "bar":
            self._bar = tqdm(total=total_steps, initial=start_step, file=self.stream, dynamic_ncols=True,
                             bar_format="{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{postfix}]")

    def set_total(self, total: int, start_step: int = 0) -> None:
        """The step count is known only after the data is planned (the bar starts before, at 1)."""
        self.total, self._start_step = total, start_step
        if self._bar is not None:
            self._bar.total = total
            self._bar.n = start_step
            self._bar.refresh()

    # -- events ------------------------------------------------------------------------------------------
    def event(self, kind: str, **data: Any) -> None:
        if self._events is None:
            return
        record = {"event": kind, "time": round(time.time(), 3), **data}
        try:
            self._events.write(json.dumps(record, default=_json_default) + "\n")
            self._events.flush()
        except BrokenPipeError:
            # The reader went away (the ComfyUI that started this worker ended): losing the events must not end the
            # run before anima_train.system.parent_watch has had it save its state.
            self._events = None
        except OSError as exc:  # a full disk, say: the flag's to fix, said once (later events are dropped)
            self._drop_events()
            said = errors.user_message(OSError(exc.errno, exc.strerror)) or f"{exc.strerror or exc}; give another path"
            raise UserError(f"--events {self._events_path}: {said}") from None

    def _drop_events(self) -> None:
        if self._own_events and self._events is not None:
            with contextlib.suppress(OSError):  # what it still buffers cannot be written either
                self._events.close()
        self._events = None

    # -- human messages ----------------------------------------------------------------------------------
    def message(self, text: str) -> None:
        """Start-up, checkpoint and warning lines: printed in every mode (written above the bar)."""
        if not self.enabled:
            return
        self._write(text)
        self.event("message", text=text)

    def warning(self, text: str) -> None:
        """Something the user should fix or accept (dataset warnings): "warning: ..." in every mode, and a
        `warning` event, which the ComfyUI Train node lists under its chart and in its result text."""
        if not self.enabled:
            return
        self._write(f"warning: {text}")
        self.event("warning", text=text)

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)  # above the bar
        else:
            print(line + "\n", end="", file=self.stream, flush=True)  # one write: an interrupt cannot split it

    # -- per step ----------------------------------------------------------------------------------------
    def eta_seconds(self, step: int) -> float | None:
        if self._anchor is None or step <= self._anchor[1]:
            return None
        t_anchor, s_anchor = self._anchor
        per_step = (time.perf_counter() - t_anchor) / (step - s_anchor)
        return per_step * max(0, self.total - step)

    def seconds_per_step(self, step: int) -> float | None:
        if self._anchor is None or step <= self._anchor[1]:
            done = step - self._start_step
            return (time.perf_counter() - self._t0) / done if done > 0 else None
        return (time.perf_counter() - self._anchor[0]) / (step - self._anchor[1])

    def step(self, stats: StepStats, report: bool = True) -> None:
        if not self.enabled:
            return
        if self._anchor is None:
            # first completed step of this process: anchor the mean after it (compile, first fork excluded)
            self._anchor = (time.perf_counter(), stats.step)
        s_per_step = self.seconds_per_step(stats.step)
        eta = self.eta_seconds(stats.step)
        terms = {name: value for name, value in stats.terms.items() if value is not None}
        self.event("step", step=stats.step, total=self.total, epoch=stats.epoch, loss=stats.loss, terms=terms,
                   ot=stats.ot, lr=stats.lrs, s_per_step=s_per_step, eta_s=eta, peak_gb=stats.peak_gb,
                   **({"phase": stats.phase} if stats.phase else {}))
        if not report or self.mode == "off":
            if self._bar is not None:
                self._bar.n = stats.step
            return
        body = describe_step(stats)
        rate = f"{s_per_step:.2f}s" if s_per_step is not None else "?s"
        if self._bar is not None:
            self._bar.set_description_str(f"e{stats.epoch} ", refresh=False)
            elapsed = format_clock(time.perf_counter() - self._t0)
            post = ", ".join(x for x in (f"{elapsed}<{format_clock(eta)}", f"{rate}/step", body, _peak(stats)) if x)
            self._bar.set_postfix_str(post, refresh=False)
            self._bar.update(stats.step - self._bar.n)
        else:
            pct = 100 * stats.step / self.total if self.total else 100.0
            fields = [f"e{stats.epoch} step {stats.step}/{self.total} ({pct:.0f}%)", body, f"{rate}/it",
                      _peak(stats), f"eta {format_duration(eta) if eta is not None else '?'}"]
            print("  ".join(f for f in fields if f) + "\n", end="", file=self.stream, flush=True)  # one write, as above

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._drop_events()


def _isatty(stream) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)
