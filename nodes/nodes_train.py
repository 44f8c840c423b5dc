"""Training nodes: Training config -> Train -> Load trained LoRA, plus a prompt encoder for sampling.

* Anima: Training config — the common knobs of `anima_train.config` as widgets (type, default, help, choices and
  bounds read from the dataclass field metadata: the config module stays the single source of truth) plus a TOML
  text box for every other key. The result is validated by the same `load_config` as the CLI in `validate_inputs`,
  so a bad value is shown on the node before anything runs. Output: ANIMA_TRAIN_CONFIG {toml, digest}.
* Anima: Train — runs `python -m anima_train train` (or accelerate's launcher for 2+ GPUs) in a worker process
  (nodes/worker.py), relays its events to the progress bar and to the `anima_train.progress` websocket event,
  copies the result where the stock LoraLoader lists it, and re-uses a finished run whose inputs are unchanged.
* Anima: Load trained LoRA — ComfyUI's own LoRA loading (what LoraLoader does) from a path or the loras folder.
* Anima: Encode prompt (trainer) — Qwen3 + both tokenizers of the diffusers repo the trainer uses, returned as the
  CONDITIONING ComfyUI's Anima model consumes (`cross_attn` + `t5xxl_ids`/`t5xxl_weights`; ComfyUI runs the LLM
  adapter itself). Prompts are encoded exactly as in training, and it works with any converted repo — including
  the tiny test models, whose Qwen3 ComfyUI's fixed-size text encoder cannot load.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import tempfile
import threading
import tomllib
import types
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tomlkit
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen3Model

from anchor.atomic import write_text
from anima_train import adapters
from anima_train.adapters.export import text_encoder_lora_path
import anima_train.config as anima_config  # called through the module: tests count load_config's calls
from anima_train.config import ConfigError, iter_fields
from anima_train.data.texture import refuse_multi_process
from anima_train.model.components import check_repo
from anima_train.model.prompts import encode_qwen, qwen_attention_mask, tokenize
from anima_train.outputs import run_folder
from anima_train.outputs.layout import LOSS_PLOT_NAME, state_dir_for
from anima_train.outputs.plot import plot_losses
from anima_train.outputs.progress import PLAN_PREFIX, VALIDATION_PREFIX
from anima_train.system.windows import refuse_multi_gpu
from anima_train.training.preflight import path_check

from . import comfy
from . import fixes
from . import paths
from . import previews
from . import run_records
from . import worker
from .comfy import CATEGORY, io

CONFIG_TYPE = "ANIMA_TRAIN_CONFIG"
ConfigType = io.Custom(CONFIG_TYPE)
OUTPUT_SUBDIR = "anima_train"  # <ComfyUI output>/anima_train/<run>/ when output_dir is left empty
PUBLISH_SUBDIR = "anima_train"  # models/loras/anima_train/<run>.safetensors (full finetunes: diffusion_models)
JOB_CONFIG_NAME = "comfyui-job.toml"
JOB_LOCK_NAME = ".comfyui-job.lock"  # held by the node from picking a run folder until its worker has ended
# Cancel: the worker stops after the step in progress and saves (checkpoint + resume state), then it is ended. It
# gets two of its slowest steps so far plus GRACE_SAVE_S for the save, never more than GRACE_MAX_S in all.
GRACE_SAVE_S = 60.0
GRACE_MAX_S = 900.0


def cancel_grace(slowest_step_s: float) -> float:
    return min(GRACE_MAX_S, GRACE_SAVE_S + 2.0 * max(0.0, slowest_step_s))


# ----------------------------------------------------------------------------------------------------------
# Training config: widgets generated from anima_train.config field metadata


@dataclass(frozen=True)
class Knob:
    key: str  # dotted config key, e.g. "train.epochs"
    widget: str  # the node input name (unique across tables)
    advanced: bool = False
    unset_zero: bool = False  # 0 / "" in the widget means "key not written" (an optional key)
    step: float | None = None
    unset_default: bool = False  # the key's default in the widget means "key not written" (LATE_KNOBS)


KNOBS = [
    Knob("train.model_path", "model_path"),
    Knob("dataset.path", "dataset_path", unset_zero=True),
    Knob("train.run_name", "run_name"),
    Knob("train.output_dir", "output_dir", unset_zero=True),
    Knob("adapter.kind", "adapter"),
    Knob("adapter.rank", "rank"),
    Knob("adapter.alpha", "alpha", step=1.0),
    Knob("optimizer.lr", "learning_rate", step=1e-6),
    Knob("train.epochs", "epochs"),
    Knob("train.max_steps", "max_steps", unset_zero=True),
    Knob("train.batch_size", "batch_size"),
    Knob("dataset.resolution", "resolution"),
    Knob("dataset.num_repeats", "num_repeats"),
    # not "seed": the frontend gives an INT input of that name a "control after generate" widget, which shifts the
    # saved widget values of every older workflow and frontend; a training seed is never re-rolled per queue
    Knob("train.seed", "training_seed"),
    Knob("train.gradient_accumulation_steps", "gradient_accumulation_steps", advanced=True),
    Knob("train.gradient_checkpointing", "gradient_checkpointing", advanced=True),
    Knob("train.dtype", "dtype", advanced=True),
    Knob("dataset.source", "source", advanced=True),
    Knob("dataset.caption.caption_mode", "caption_mode", advanced=True),
    Knob("dataset.caption.shuffle_tags", "shuffle_tags", advanced=True),
    Knob("dataset.caption.tag_dropout_percent", "tag_dropout", advanced=True, step=0.01),
    Knob("dataset.caption.caption_dropout_percent", "caption_dropout", advanced=True, step=0.01),
    Knob("schedule.kind", "lr_schedule", advanced=True),
    Knob("schedule.warmup_steps", "warmup_steps", advanced=True),
    Knob("flow.timestep_sample_method", "timestep_sampling", advanced=True),
    Knob("flow.sigmoid_scale", "sigmoid_scale", advanced=True, step=0.05),
    Knob("flow.shift", "shift", advanced=True, unset_zero=True, step=0.1),
    Knob("adapter.train_llm_adapter", "train_llm_adapter", advanced=True),
    Knob("component_lr.llm_adapter", "llm_adapter_lr", advanced=True, step=1e-6),
    Knob("train.save_every_epochs", "save_every_epochs", advanced=True),
    Knob("train.save_every_steps", "save_every_steps", advanced=True, unset_zero=True),
    Knob("train.save_optimizer_state", "save_optimizer_state", advanced=True),
    Knob("train.keep_last_n", "keep_last_n", advanced=True, unset_zero=True),
    Knob("adapter.output_format", "output_format", advanced=True),
    Knob("train.num_workers", "num_workers", advanced=True),
]
# Keys that became widgets after workflows had been saved with this node. A saved workflow holds widget values by
# position, so these come after extra_toml: an older workflow gives every earlier widget its own value, and these
# their defaults. A default is not written into the config, so an older workflow's config text, and with it the
# node's key for re-using a finished run or resuming a cancelled one (run_records.result_key), is what it was.
LATE_KNOBS = [
    Knob("train.swap_blocks", "swap_blocks", advanced=True, unset_default=True),
    Knob("train.base_matmul", "base_matmul", advanced=True, unset_default=True),
]
ALL_KNOBS = KNOBS + LATE_KNOBS
EXTRA_TOML = "extra_toml"
# A table in extra_toml that replaces widget keys (load_config refuses both forms at once).
REPLACES = {"dataset.subsets": ("dataset.path", "dataset.num_repeats"), "dataset.resolutions": ("dataset.resolution",)}
WIDGET_DEFAULTS = {"train.model_path": "", "train.output_dir": "", "train.run_name": "anima_lora", "adapter.rank": 16, "adapter.alpha": 16.0,
                   "optimizer.lr": 1e-4}  # the trainer's defaults suit a TOML file; these suit a first LoRA


def _field(dotted: str):
    table, name = dotted.rsplit(".", 1)
    for info in iter_fields(table):
        if info.name == name:
            return info
    raise KeyError(dotted)


def _base_type(tp) -> type:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return int if int in args else args[0]  # batch_size: int | dict -> int
    return tp


def _tooltip(info) -> str:
    hint = info.metadata.get("hint")
    return f"{info.name}: {info.help}" + (f" ({hint})" if hint else "")


# The widgets' own limits are wide on purpose: the frontend clamps a typed value to a widget's min/max without a
# word (tag_dropout 1.5 would train at 1.0, a negative LR would become 0), so out-of-range values go through to the
# config gate, which refuses them with the key, the value typed and the valid range. The range is in the tooltip.
INT_LIMITS = (-(2**31), 2**31 - 1)
FLOAT_LIMITS = (-1e9, 1e9)


def _range_text(info) -> str:
    """The valid range of a numeric key, as the tooltip says it ("> 0", ">= 1, <= 64")."""
    m = info.metadata
    parts = [f"{op} {m[key]:g}" for key, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
             if m.get(key) is not None]
    return f" [valid: {', '.join(parts)}]" if parts else ""


def knob_input(knob: Knob):
    """The widget of one config key, from its field metadata."""
    info = _field(knob.key)
    default = WIDGET_DEFAULTS.get(knob.key, info.default)
    kind = _base_type(info.type)
    tip = _tooltip(info) + (" [0 or empty = unset]" if knob.unset_zero else "")
    common = dict(tooltip=tip, advanced=knob.advanced or None)
    if info.choices:
        return io.Combo.Input(knob.widget, options=list(info.choices), default=default, **common)
    if kind is bool:
        return io.Boolean.Input(knob.widget, default=bool(default), **common)
    if kind in (int, float):
        common["tooltip"] += _range_text(info)
    if kind is int:
        # control_after_generate=False: re-rolling a knob after each queue would retrain on every queue
        return io.Int.Input(knob.widget, default=int(default or 0), min=INT_LIMITS[0], max=INT_LIMITS[1],
                            control_after_generate=False, **common)
    if kind is float:
        step = knob.step or 0.01
        return io.Float.Input(knob.widget, default=float(default or 0.0), min=FLOAT_LIMITS[0], max=FLOAT_LIMITS[1],
                              step=step, round=step / 10, **common)
    return io.String.Input(knob.widget, default="" if default is None else str(default), **common)


def _set(tree: dict, dotted: str, value) -> None:
    *tables, key = dotted.split(".")
    for t in tables:
        tree = tree.setdefault(t, {})
    tree[key] = value


def _merge(base: dict, over: dict) -> dict:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v
    return base


def _has(tree: dict, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def default_output_dir() -> str:
    try:
        return os.path.join(comfy.output_directory(), OUTPUT_SUBDIR)
    except ImportError:  # outside ComfyUI (CLI-style use of the node code)
        return os.path.abspath(OUTPUT_SUBDIR)


def config_toml(values: dict) -> str:
    """TOML text from the widget values (input name -> value) and the extra_toml text, which wins on conflicts.
    Every path in it is confined to the folders the nodes may use and replaced by the path it resolves to
    (nodes/paths.py; PathRefused otherwise), before anything reads it.

    A value of None is a linked input not known yet (validation before the graph runs): a placeholder is used."""
    try:
        extra = tomllib.loads(values.get(EXTRA_TOML) or "")
    except ValueError as exc:
        raise ConfigError(f"{EXTRA_TOML}: not valid TOML: {exc}") from None
    tree: dict = {}
    for knob in ALL_KNOBS:
        if knob.widget not in values:
            continue
        value = values[knob.widget]
        if value is None:  # linked, not known before the graph runs: a placeholder the path checks skip
            if _base_type(_field(knob.key).type) is not str:
                continue
            value = f"<linked {knob.widget}>"
        if knob.unset_zero and value in (0, 0.0, ""):
            continue
        if knob.unset_default and value == _field(knob.key).default:
            continue
        if any(_has(extra, table) and knob.key in replaced for table, replaced in REPLACES.items()):
            continue
        _set(tree, knob.key, value)
    if not _has(tree, "train.output_dir") and not _has(extra, "train.output_dir"):
        _set(tree, "train.output_dir", default_output_dir())
    tree = _merge(tree, extra)
    if problems := paths.confine_tree(tree, paths.current_policy(), skip=_is_linked):
        raise paths.refused(problems)
    return tomlkit.dumps(tree)


def _is_linked(value: str) -> bool:
    return value.startswith("<linked")


# One queue parses its config once and walks its dataset once: ComfyUI calls the Training config's validate_inputs,
# fingerprint_inputs and execute, then Train's execute, all for the same queued prompt (comfy.queued_prompt_id), so
# what they compute from the same inputs is kept for that prompt, and dropped when the next one comes. Outside a
# queued prompt nothing is kept.
_QUEUE_MEMO: dict[tuple[str, str, str], object] = {}
_QUEUE_LOCK = threading.Lock()  # validation runs on the server's thread, execution on the prompt worker's


def _queued(what: str, key: str):
    """What this queue computed for `key` (None if nothing)."""
    prompt = comfy.queued_prompt_id()
    with _QUEUE_LOCK:
        return _QUEUE_MEMO.get((prompt, what, key)) if prompt is not None else None


def _once_per_queue(what: str, key: str, compute):
    """compute(), once per queued prompt and key."""
    prompt = comfy.queued_prompt_id()
    if prompt is None:
        return compute()
    with _QUEUE_LOCK:
        if (prompt, what, key) in _QUEUE_MEMO:
            return _QUEUE_MEMO[(prompt, what, key)]
    value = compute()
    with _QUEUE_LOCK:
        for old in [k for k in _QUEUE_MEMO if k[0] != prompt]:
            del _QUEUE_MEMO[old]
        _QUEUE_MEMO[(prompt, what, key)] = value
    return value


def build_config(values: dict):
    """(Config, TOML text) from the node's values; ConfigError listing every problem. Once per queue: the TOML text
    is kept too, so that Train's execute, given this text, uses this Config (confined and checked) as it is."""
    cfg, text = _once_per_queue("values", json.dumps(values, sort_keys=True, default=str),
                                lambda: _build_config(values))
    _once_per_queue("toml", text, lambda: cfg)
    return cfg, text


def _build_config(values: dict):
    text = config_toml(values)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # warnings are shown by the Train node's log, not as node errors
        # the model repo, dataset folders, output folder and resume_from in the same message as the values (the
        # trainer's own preflight; a value linked from another node is not known yet and is skipped)
        return anima_config.load_config(text, also=path_check(skip=_is_linked)), text


def _model_and_data_digest(cfg) -> dict:
    model = cfg.train.model_path
    folders = [s.path for s in cfg.dataset.resolved_subsets()]

    def digest() -> dict:
        return {"dataset": run_records.dataset_digest(folders),
                "model": run_records.files_digest([model]) if model and not model.startswith("<linked") else ""}

    return _once_per_queue("digest", json.dumps([folders, model]), digest)


class ConfigRefused(ValueError):
    """The Training config's problems, one message for the whole node (see AnimaTrainConfig.validate_inputs)."""


class AnimaTrainConfig(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="AnimaTrainConfig",
            display_name="Anima: Training config",
            category=CATEGORY,
            description="The training settings, checked by the same rules as `anima-train train`. The common keys "
                        "are widgets; any other key of the config (see the trainer's README) goes into extra_toml, "
                        "which overrides the widgets. Empty output_dir = ComfyUI's output/anima_train. Relative "
                        "paths are in ComfyUI's input (datasets), models (model_path) or output folder (the rest); "
                        "folders outside ComfyUI's must be allowed first (README: folders the nodes may use).",
            inputs=[knob_input(k) for k in KNOBS] + [
                io.String.Input(EXTRA_TOML, multiline=True, default="",
                                tooltip="more config keys as TOML, e.g.\n[dataset]\nresolutions = [768, 1024]\n"
                                        "[component_lr]\nadaln = 1e-5\nThey override the widgets.")]
            + [knob_input(k) for k in LATE_KNOBS],
            outputs=[ConfigType.Output(display_name="config")],
        )

    @classmethod
    @fixes.shown_on(fixes.TRAINING_CONFIG)
    def validate_inputs(cls, **values):
        # Raised, not returned: ComfyUI files a returned message once for every input the method receives (all of
        # this node's ~36: the Errors panel counted 36 identical entries), an exception once, against this node.
        try:
            build_config(values)
        except ConfigError as exc:  # several problems: one line each, the first one first (the popup shows it)
            extra = fixes.extra_keys(values.get(EXTRA_TOML))
            raise ConfigRefused("\n".join(fixes.render(e, fixes.TRAINING_CONFIG, extra) for e in exc.errors)) from None
        return True

    @classmethod
    def fingerprint_inputs(cls, **values):
        # The widgets decide the output, but so do the files: a changed dataset or model must reach Train.
        try:
            cfg, text = build_config(values)
            return run_records.result_key(toml=text, **_model_and_data_digest(cfg))
        except Exception:  # noqa: BLE001 (execute reports the problem)
            return run_records.result_key(values=values)

    @classmethod
    @fixes.shown_on(fixes.TRAINING_CONFIG)
    def execute(cls, **values):
        cfg, text = build_config(values)
        return io.NodeOutput({"toml": text, "digest": hashlib.sha256(text.encode()).hexdigest(),
                              "run_dir": str(Path(cfg.train.output_dir) / cfg.run_stem)})


# ----------------------------------------------------------------------------------------------------------
# Train


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
        elif kind == "message" and str(event.get("text", "")).startswith(PLAN_PREFIX):
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


def train_command(job_config: Path, stop_file: Path, gpus: int) -> list[str]:
    return worker.anima_train_command(["train", str(job_config), "--events", "-", "--stop-file", str(stop_file)],
                                      processes=gpus)


def pick_run(cfg, toml: str, key: str):
    """(cfg, toml, run_dir, manifest, note, job_lock) of the folder this job uses: a finished run of these exact
    inputs (re-used: manifest), a run of these exact inputs that Cancel stopped with a resume state (resumed there:
    the TOML gets its resume_from), the folder of the run being resumed, or else the first of run_name,
    run_name-2, run_name-3, ... that holds no other run and no running job — a new run never replaces another run's
    files. When that is not run_name itself, the TOML and config get the new name and `note` says so.

    job_lock (None when re-used) is the node's lock on the folder, held until the caller releases it: the trainer
    locks the folder only once its worker has started (seconds later), and in that gap another ComfyUI's node
    (same output folder) would otherwise pick the same free name and overwrite this job's files. A folder
    resumed while another job holds it is refused (RunRefused, naming the holder)."""
    output_dir = Path(cfg.train.output_dir)
    resumed = Path(cfg.train.resume_from).expanduser().resolve().parent if cfg.train.resume_from else None
    job_lock, cancelled = None, None
    for stem in run_folder.run_names(cfg.run_stem):
        run_dir = output_dir / stem
        manifest = run_records.reusable_result(run_dir, key)
        if manifest is not None:
            break
        cancelled = None if resumed is not None else run_records.resumable_cancel(run_dir, key)
        resuming = cancelled is not None or (resumed is not None and resumed == run_dir.resolve())
        if resuming or run_folder.holds_no_run(run_dir, stem):
            job_lock = run_folder.RunLock(run_dir, JOB_LOCK_NAME)
            try:
                job_lock.acquire(say=lambda _note: None)  # a lock left by a crashed ComfyUI is simply taken over
                break
            except run_folder.RunRefused:
                job_lock = None
                if resuming:
                    raise
    notes = []
    if stem != cfg.run_stem:
        notes.append(f"run name {cfg.run_stem!r}: {output_dir / cfg.run_stem} holds an earlier run or a running "
                     f"job, so this one is {stem!r} ({run_dir})")
    if cancelled is not None:
        notes.append(f"resuming the run cancelled at step {cancelled['step']} of {cancelled['total']} "
                     f"(from {cancelled['state']})")
    if not notes:
        return cfg, toml, run_dir, manifest, None, job_lock

    doc = tomlkit.parse(toml)
    if "train" not in doc:
        doc["train"] = tomlkit.table()
    doc["train"]["run_name"] = stem
    if cancelled is not None:
        doc["train"]["resume_from"] = cancelled["state"]
    toml = tomlkit.dumps(doc)
    cfg = copy.deepcopy(cfg)  # what load_config(toml) gives, without parsing it again; the queue's Config stays as is
    cfg.train.run_name = stem
    if cancelled is not None:
        cfg.train.resume_from = cancelled["state"]
    cfg.source_text = toml
    return cfg, toml, run_dir, manifest, "\n".join(notes), job_lock


def _summary(cfg, final, published, steps, seconds, reused, warnings=(), note=None, memory_plan=None,
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


class AnimaTrainTrain(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="AnimaTrainTrain",
            display_name="Anima: Train",
            category=CATEGORY,
            description="Train in a separate worker process (ComfyUI's models are unloaded first; a crash or an "
                        "out-of-memory error ends only the worker). Progress and loss stream to the node; Cancel "
                        "asks the worker to save a checkpoint and stop, then ends its whole process tree. A run "
                        "whose config, dataset and model are unchanged is re-used, not trained again.",
            inputs=[
                ConfigType.Input("config"),
                io.Int.Input("gpus", default=1, min=1, max=64,
                             tooltip="processes (one per GPU); 2 or more run accelerate launch (DDP); Linux "
                                     "only (refused on Windows)"),
                io.Boolean.Input("copy_to_loras", default=True,
                                 tooltip="copy the result into models/loras/anima_train/ (full finetunes: "
                                         "models/diffusion_models/anima_train/) so the stock loaders list it; "
                                         "an existing file of another content is never replaced"),
            ],
            outputs=[io.String.Output(display_name="path"), io.Image.Output(display_name="loss_plot")],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    @fixes.shown_on(fixes.TRAIN)
    def execute(cls, config, gpus=1, copy_to_loras=True):
        refuse_multi_gpu(gpus)  # Windows: no tested multi-GPU path; before any worker or run folder exists
        hidden = getattr(cls, "hidden", None)
        node_id = str(getattr(hidden, "unique_id", None)) if getattr(hidden, "unique_id", None) is not None else None
        toml = config["toml"] if isinstance(config, dict) else str(config)
        cfg = _queued("toml", toml)  # this queue's Training config node built it: confined and checked
        if cfg is None:
            toml = paths.confine_toml(toml, paths.current_policy())  # a posted graph may give any value here
            cfg = anima_config.load_config(toml)
        refuse_multi_process(cfg, gpus)  # the trainer refuses it too, but only after accelerate launched the workers
        key = run_records.result_key(toml=toml, gpus=gpus, **_model_and_data_digest(cfg))
        cfg, toml, run_dir, manifest, note, job_lock = pick_run(cfg, toml, key)
        try:
            return cls._run(cfg, toml, run_dir, manifest, note, key, gpus, copy_to_loras,
                            Relay(node_id, comfy.client_id(), comfy.prompt_id()))
        finally:
            if job_lock is not None:
                job_lock.release()

    @classmethod
    def _run(cls, cfg, toml, run_dir, manifest, note, key, gpus, copy_to_loras, relay):
        run_dir.mkdir(parents=True, exist_ok=True)
        if note:  # the chart keeps it on show through the run (the folder the run trains in, and why)
            relay.send({"event": "run_note", "text": note})
        if manifest is not None:
            final = Path(manifest["final"]["path"])
            losses = [float(x) for x in manifest.get("losses", [])]
            published = publish(final, cfg.adapter.kind, cfg.run_stem) if copy_to_loras else None
            relay.send({"event": "done", "step": manifest.get("steps"), "total": manifest.get("steps"),
                        "final": str(final), "reused": True, "losses": losses,  # the chart shows the run
                        "validation": manifest.get("validation_points", [])})
            image = loss_image(losses, run_dir)
            text = _summary(cfg, final, published, manifest.get("steps"), 0, True, manifest.get("warnings", []),
                            note, manifest.get("memory_plan", []), manifest.get("validation", []))
            return io.NodeOutput(str(final), image, ui={"text": [text]})

        comfy.free_vram()
        job_config = run_dir / JOB_CONFIG_NAME
        write_text(job_config, toml)
        # The trainer reads the stop file after each optimizer step: before the first one (model loading) there is
        # nothing to save, so a Cancel then ends the worker at once instead of waiting out the grace period.
        grace_now = lambda: cancel_grace(relay.slowest_step_s) if relay.steps_seen else 0.0  # noqa: E731
        stop_file = worker.job_stop_file(run_dir)
        try:
            result = worker.run_job(train_command(job_config, stop_file, gpus),
                                    log_path=run_dir / worker.LOG_NAME, on_event=relay,
                                    check_interrupt=comfy.throw_if_interrupted, env=worker.worker_env(),
                                    cwd=str(run_dir), stop_file=stop_file, grace_s=grace_now,
                                    on_stop_event=relay.after_stop)
        except BaseException:  # Cancel (ComfyUI's interrupt) or a failed callback: the worker has been stopped
            cls._cancelled(cfg, run_dir, key, relay)
            raise
        (run_dir / run_records.CANCELLED_NAME).unlink(missing_ok=True)  # this run is past its Cancel now
        worker.raise_for_failure(result, f"training {cfg.run_stem}")
        done = result.last("done") or {}
        if not done.get("final"):
            raise worker.WorkerError(f"training {cfg.run_stem} ended without a final checkpoint (skip_final_save "
                                     f"= true, or the worker stopped early); log: {result.log_path}")
        final = Path(done["final"])
        published = publish(final, cfg.adapter.kind, cfg.run_stem) if copy_to_loras else None
        run_records.write_manifest(run_dir, key, final, steps=done.get("step"), losses=relay.losses,
                              published=str(published) if published else None, warnings=relay.warnings,
                              memory_plan=relay.memory_plan, validation=relay.validation,
                              validation_points=relay.validation_points)
        image = loss_image(relay.losses, run_dir)
        text = _summary(cfg, final, published, done.get("step"), result.seconds, False, relay.warnings, note,
                        relay.memory_plan, relay.validation)
        return io.NodeOutput(str(final), image, ui={"text": [text]})

    @classmethod
    def _cancelled(cls, cfg, run_dir: Path, key: str, relay: Relay) -> None:
        """After Cancel: say on the node where the run stopped and how it goes on, and record a resumable stop so
        that queueing the same inputs again resumes it. Never raises (ComfyUI's interrupt must go on)."""
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


# ----------------------------------------------------------------------------------------------------------
# Load trained LoRA

NO_FILE = "(use lora_path)"


def resolve_lora(lora_path: str, lora_name: str) -> str:
    if lora_path and lora_path.strip():
        path = str(paths.current_policy().resolve(lora_path.strip(), "lora_path", paths.OUTPUT))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"lora_path {path!r}: no such file (connect Anima: Train's path output, or pick "
                                    f"a file in lora_name)")
        return path
    if not lora_name or lora_name == NO_FILE:
        raise ValueError("no LoRA given: connect a path to lora_path or choose a file in lora_name")
    return comfy.model_path("loras", lora_name)


class AnimaLoadTrainedLora(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="AnimaLoadTrainedLora",
            display_name="Anima: Load trained LoRA",
            category=CATEGORY,
            description=f"Apply a trained {adapters.titles(adapters_only=True, sep='/')} file to MODEL (and CLIP, "
                        "when the file has a Qwen3 part) the way the stock LoraLoader does. lora_path (e.g. from Anima: Train) wins over lora_name.",
            inputs=[
                io.Model.Input("model"),
                io.String.Input("lora_path", default="", tooltip="a .safetensors path (a relative one is in ComfyUI's "
                                                                "output folder); empty = use lora_name"),
                io.Combo.Input("lora_name", options=[NO_FILE] + comfy.model_files("loras"), default=NO_FILE,
                               tooltip="a file from models/loras"),
                io.Float.Input("strength_model", default=1.0, min=-100.0, max=100.0, step=0.01),
                io.Float.Input("strength_clip", default=1.0, min=-100.0, max=100.0, step=0.01),
                io.Clip.Input("clip", optional=True),
            ],
            outputs=[io.Model.Output(display_name="MODEL"), io.Clip.Output(display_name="CLIP")],
        )

    @classmethod
    def fingerprint_inputs(cls, lora_path="", lora_name=NO_FILE, strength_model=1.0, strength_clip=1.0, **_):
        try:  # re-run when the file under the same name changes
            path = resolve_lora(lora_path or "", lora_name)
            st = os.stat(path)
            return f"{path}|{st.st_size}|{st.st_mtime_ns}|{strength_model}|{strength_clip}"
        except Exception:  # noqa: BLE001 (a linked path is unknown here; execute reports real problems)
            return f"{lora_path}|{lora_name}|{strength_model}|{strength_clip}"

    @classmethod
    @fixes.shown_on(fixes.LOAD)
    def execute(cls, model, lora_path="", lora_name=NO_FILE, strength_model=1.0, strength_clip=1.0, clip=None):
        path = resolve_lora(lora_path, lora_name)
        if strength_model == 0 and strength_clip == 0:
            return io.NodeOutput(model, clip)
        new_model, new_clip = comfy.load_lora(model, clip, path, strength_model, strength_clip if clip else 0.0)
        return io.NodeOutput(new_model, new_clip if clip is not None else None)


# ----------------------------------------------------------------------------------------------------------
# Prompt encoding with the trainer's own text path

_TEXT_CACHE: dict = {}  # (repo, stat digest) -> (tokenizer, t5_tokenizer, text_encoder); one entry


def _text_parts(model_path: str):
    root = check_repo(model_path)
    key = (str(root), run_records.files_digest([root / "text_encoder", root / "tokenizer", root / "t5_tokenizer"]))
    if key not in _TEXT_CACHE:
        _TEXT_CACHE.clear()
        _TEXT_CACHE[key] = (AutoTokenizer.from_pretrained(root, subfolder="tokenizer"),
                            AutoTokenizer.from_pretrained(root, subfolder="t5_tokenizer"),
                            Qwen3Model.from_pretrained(root, subfolder="text_encoder", dtype=torch.float32).eval())
    return _TEXT_CACHE[key]


def encode_conditioning(model_path: str, text: str):
    """CONDITIONING [[cross_attn [1, L, 1024], {"t5xxl_ids": int32 [L_t5], "t5xxl_weights": [L_t5]}]], the layout
    ComfyUI's Anima TE produces (docs/comfyui.md#conditioning): Qwen3's masked last hidden state, and the T5 ids that
    feed the LLM adapter inside ComfyUI's Anima model (weights 1.0, as ComfyUI's Anima tokenizer forces)."""
    tokenizer, t5_tokenizer, text_encoder = _text_parts(model_path)
    tok = tokenize([text], tokenizer, t5_tokenizer)
    with torch.inference_mode():
        cross_attn = encode_qwen(text_encoder, tok["qwen_ids"], tok["qwen_mask"],
                                 qwen_attention_mask(text_encoder, tok["qwen_mask"])).float()
    t5_ids = tok["t5_ids"][0].to(torch.int32)
    return [[cross_attn, {"t5xxl_ids": t5_ids, "t5xxl_weights": torch.ones(t5_ids.shape[0])}]]


class AnimaTrainTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="AnimaTrainTextEncode",
            display_name="Anima: Encode prompt (trainer)",
            category=CATEGORY,
            description="Encode a prompt with the Qwen3 text encoder and tokenizers of a converted Anima diffusers "
                        "repo, exactly as the trainer encodes captions; feeds KSampler like CLIPTextEncode.",
            inputs=[io.String.Input("model_path", default="", tooltip="the converted diffusers repo (as in the "
                                                                      "training config; a relative "
                                                                      "one is in ComfyUI's models folder)"),
                    io.String.Input("text", multiline=True, default="")],
            outputs=[io.Conditioning.Output(display_name="CONDITIONING")],
        )

    @classmethod
    @fixes.shown_on("Anima: Encode prompt (trainer)")
    def execute(cls, model_path, text):
        if model_path and model_path.strip():
            model_path = str(paths.current_policy().resolve(model_path.strip(), "model_path", paths.MODELS))
        return io.NodeOutput(encode_conditioning(model_path, text))


NODES = [AnimaTrainConfig, AnimaTrainTrain, AnimaLoadTrainedLora, AnimaTrainTextEncode]
