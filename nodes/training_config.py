"""The Training config node's library: its widgets, generated from `anima_train.config`'s field metadata (type,
default, help, choices and bounds: the config module stays the single source of truth), and the TOML text and
`Config` those widgets and the extra_toml box make, checked by the CLI's own gate, `parse_config`."""

from __future__ import annotations

import json
import os
import tomllib
import types
import typing
import warnings
from dataclasses import dataclass

import tomlkit

import anima_train.config as anima_config  # called through the module: tests count parse_config's calls
from anima_train.config import ConfigError, iter_fields
from anima_train.training.preflight import path_check

from . import comfy
from . import paths
from . import queue_memo
from . import run_records
from .comfy import io

OUTPUT_SUBDIR = "anima_train"  # <ComfyUI output>/anima_train/<run>/ when output_dir is left empty


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
    Knob("train.swap_blocks", "swap_blocks", advanced=True, unset_zero=True),  # 0: the key's default, "auto"
    Knob("train.base_matmul", "base_matmul", advanced=True, unset_default=True),
    Knob("dataset.cache_text_encoder_outputs", "cache_text_encoder_outputs", advanced=True, unset_default=True),
]
ALL_KNOBS = KNOBS + LATE_KNOBS
EXTRA_TOML = "extra_toml"
# A table in extra_toml that replaces widget keys (parse_config refuses both forms at once).
REPLACES = {"dataset.subsets": ("dataset.path", "dataset.num_repeats"), "dataset.resolutions": ("dataset.resolution",)}
WIDGET_DEFAULTS = {"train.model_path": "", "train.output_dir": "", "train.run_name": "anima_lora",
                   "adapter.rank": 16, "adapter.alpha": 16.0,
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
    named = kind is int and isinstance(default, str)  # "auto" or a number: 0 in the widget stands for the name
    tip = _tooltip(info) + (f" [0 here = {default}]" if named else " [0 or empty = unset]" if knob.unset_zero else "")
    common = dict(tooltip=tip, advanced=knob.advanced or None)
    if info.choices:
        return io.Combo.Input(knob.widget, options=list(info.choices), default=default, **common)
    if kind is bool:
        return io.Boolean.Input(knob.widget, default=bool(default), **common)
    if kind in (int, float):
        common["tooltip"] += _range_text(info)
    if kind is int:
        # control_after_generate=False: re-rolling a knob after each queue would retrain on every queue
        return io.Int.Input(knob.widget, default=0 if named else int(default or 0), min=INT_LIMITS[0],
                            max=INT_LIMITS[1], control_after_generate=False, **common)
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
    if problems := paths.confine_tree(tree, paths.current_policy(), skip=is_linked):
        raise paths.refused(problems)
    return tomlkit.dumps(tree)


def is_linked(value: str) -> bool:
    return value.startswith("<linked")


def build_config(values: dict):
    """(Config, TOML text) from the node's values; ConfigError listing every problem. Once per queue: the TOML text
    is kept too, so that Train's execute, given this text, uses this Config (confined and checked) as it is."""
    cfg, text = queue_memo.once_per_queue("values", json.dumps(values, sort_keys=True, default=str),
                                lambda: _build_config(values))
    queue_memo.once_per_queue("toml", text, lambda: cfg)
    return cfg, text


def _build_config(values: dict):
    text = config_toml(values)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # warnings are shown by the Train node's log, not as node errors
        # the model repo, dataset folders, output folder and resume_from in the same message as the values (the
        # trainer's own preflight; a value linked from another node is not known yet and is skipped)
        return anima_config.parse_config(text, also=path_check(skip=is_linked)), text


def model_and_data_digest(cfg) -> dict:
    model = cfg.train.model_path
    folders = [s.path for s in cfg.dataset.resolved_subsets()]

    def digest() -> dict:
        return {"dataset": run_records.dataset_digest(folders),
                "model": run_records.files_digest([model]) if model and not model.startswith("<linked") else ""}

    return queue_memo.once_per_queue("digest", json.dumps([folders, model]), digest)
