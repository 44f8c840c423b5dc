"""The Train node's relay of the worker's events to ComfyUI: its progress bar and the `anima_train.progress`
websocket event (js/loss_chart.js draws them), and what the node's result text and records keep of them."""

from __future__ import annotations

import contextlib

from anima_train.outputs.progress import PLAN_PREFIX, SWAP_PREFIX, VALIDATION_PREFIX

from . import comfy
from . import fixes
from . import previews


class Relay:
    """Worker events -> ComfyUI progress bar + `anima_train.progress` websocket events; keeps the loss history.
    Every event names the node and the prompt it runs for: a chart follows only its own run (js/run_follow.js)."""

    def __init__(self, node_id: str | None, sid: str | None, prompt_id: str | None = None):
        self.node_id, self.sid, self.prompt_id = node_id, sid, prompt_id
        self.bar = None
        self.total = None
        self.losses: list[float] = []
        self.warnings: list[str] = []  # the trainer's `warning` events (dataset warnings), for the result text
        self.memory_plan: list[str] = []  # the memory plan's messages (checkpointing auto), for the result text
        self.validation: list[str] = []  # [validation]: the run's "validation loss A → B, margin C → D" line
        self.validation_points: list[list[float]] = []  # [step, loss, margin] per evaluation, for a re-used chart
        self.steps_seen = 0
        self.slowest_step_s = 0.0  # the Cancel grace follows the step time (cancel_grace)
        self.last_step: dict = {}
        self.stop_done: dict | None = None  # the trainer's `done` event printed while it stopped after Cancel

    def send(self, event: dict) -> None:
        comfy.send_event({"node": self.node_id, "prompt_id": self.prompt_id, **fixes.said(event)}, self.sid)

    def __call__(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "start":
            self.total = int(event.get("total") or 1)
            self.bar = comfy.progress_bar(self.total, node_id=self.node_id)
            self.bar.update_absolute(int(event.get("resumed_step") or 0), self.total)
        elif kind == "step":
            self.steps_seen += 1
            self.last_step = event
            if isinstance(event.get("s_per_step"), (int, float)):
                self.slowest_step_s = max(self.slowest_step_s, float(event["s_per_step"]))
            if event.get("loss") is not None:
                self.losses.append(float(event["loss"]))
            if self.bar is not None:
                # the progress hook also checks ComfyUI's interrupt flag: a cancel point
                self.bar.update_absolute(int(event["step"]), int(event.get("total") or self.total))
        elif kind == "warning":
            self.warnings.append(fixes.render(str(event.get("text", "")), fixes.TRAIN, short=False))  # node text
        elif kind == "validation" and all(isinstance(event.get(k), (int, float)) for k in ("step", "loss", "margin")):
            self.validation_points.append([event["step"], float(event["loss"]), float(event["margin"])])
        elif kind == "message" and str(event.get("text", "")).startswith(VALIDATION_PREFIX):
            self.validation.append(str(event["text"]))
        elif kind == "message" and str(event.get("text", "")).startswith((SWAP_PREFIX, PLAN_PREFIX)):
            self.memory_plan.append(str(event["text"]))  # the plan, then any relief after an allocator retry
        elif kind == "samples":  # preview images: sent inline, as small thumbnails
            event = previews.with_thumbnails(event)
        self.send(event)

    def after_stop(self, event: dict) -> None:
        """Events printed while the worker stops after Cancel: forwarded, never raising."""
        if event.get("event") == "done":
            self.stop_done = event
        with contextlib.suppress(Exception):
            self.send(event)
