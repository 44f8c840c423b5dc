"""`anima-train config`: the config reference (docs/config.md), generated from the config dataclasses, and a check
of one config file without training.

    anima-train config --reference                  # print docs/config.md (every key: type, default, bounds, help)
    anima-train config --reference --out FILE       # write it (docs/config.md is this output, kept in sync by a test)
    anima-train config cfg.toml                     # load + check a config and the paths it names; no model loads

The reference is built from the config's tables (schema.py: TABLES, iter_fields and each key's metadata) and the
sd-scripts name table (aliases.py), so it cannot disagree with the loader. No torch here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from pathlib import Path

from anima_train.config import schema as C
from anima_train.config.aliases import ALIASES, NO_EQUIVALENT
from anima_train.config.constants import MODEL_PATH_ENV
from anima_train.config.keys import REQUIRED, as_toml, describe
from anima_train.config.load import load_config
from anima_train.data.batches import steps_per_epoch
from anima_train.data.dataset import build_training_data
from anima_train.errors import UserError
from anima_train.files import atomic_path
from anima_train.training import honoured
from anima_train.training.preflight import check_run_paths, path_check

INTRO = """\
# Config reference

<!-- Generated from anima_train/config/ by `anima-train config --reference`; do not edit by hand
     (tests/test_config_reference.py fails when this file is out of date). -->

One TOML file configures a run, for `anima-train train CFG.toml` and for the ComfyUI nodes alike; it is read by
`anima_train.config.load_config`. Every key is optional except a dataset path; the smallest config is

```toml
[dataset]
path = "/data/my_set"
```

which trains a rank-32 LoRA. Every problem in a file is reported at once, naming the table, the key and the fix; an
unknown key names the closest real one (also for sd-scripts' names, listed at the end).
`anima-train config CFG.toml` checks a config and the paths it names without loading a model.
"""
GATED_INTRO = """
Features that have not landed yet are refused at load when their keys are set to anything but the default:
"""


def _cell(text: str) -> str:
    # `|` would end the cell and `<stem>` would render as an HTML tag
    return text.replace("|", "\\|").replace("<", "\\<").replace("\n", " ")


@contextlib.contextmanager
def _without_env(names: list[str]):
    """Defaults that an environment variable changes are documented as they are without it."""
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def _bounds(meta: dict) -> str:
    parts = [f"{word} {as_toml(meta[b])}" for b, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
             if meta.get(b) is not None]
    if meta.get("choices"):
        parts.append("one of " + ", ".join(f"`{as_toml(c)}`" for c in meta["choices"]))
    if meta.get("nonempty"):
        parts.append("not empty")
    return "; ".join(parts)


def _default(info: C.FieldInfo) -> str:
    if info.default is REQUIRED:
        return "*required*"
    text = f"`{as_toml(info.default)}`" if info.default is not None else "unset"
    if info.metadata.get("env"):
        text += f" (or `${info.metadata['env']}`)"
    return text


def _table_help() -> dict[str, str]:
    """Each table's one-line help, from the field that holds it (Config.train, DatasetConfig.caption, ...)."""
    out = {}
    for name, cls in C.TABLES.items():
        parent_name, _, own = name.rpartition(".")
        parent = C.TABLES[parent_name] if parent_name else C.Config
        for f in dataclasses.fields(parent):
            if f.name == own:
                out[name] = f.metadata.get("help", "")
    return out


def _gated_name(dotted: str) -> str:
    if dotted == "curriculum.texture":  # not a key: the gate's name for phases with mode = "texture"
        return '`[[curriculum]]` phases with `mode = "texture"`'
    if dotted in C.TABLES:
        return f"the `[{dotted}]` table"
    table, _, key = dotted.rpartition(".")
    return f"`[{table}] {key}`"


def reference_markdown() -> str:
    """docs/config.md: every table and key with its type, default, bounds/choices and help."""
    helps = _table_help()
    gated = "".join(f"- {_gated_name(k)} ({feature})\n" for k, feature in C.NOT_IMPLEMENTED.items())
    lines = [INTRO + (GATED_INTRO + gated if gated else "")]
    with _without_env([MODEL_PATH_ENV]):
        for name in C.TABLES:
            header = f"[[{name}]]" if name in C.ARRAY_TABLES else f"[{name}]"
            gated = f" *Not implemented yet ({C.NOT_IMPLEMENTED[name]}).*" if name in C.NOT_IMPLEMENTED else ""
            lines += [f"## `{header}`", "", _cell(helps.get(name, "")).capitalize() + "." + gated, "",
                      "| key | type | default | allowed | description |", "|---|---|---|---|---|"]
            for info in C.iter_fields(name):
                what = info.metadata.get("type_desc") or describe(info.type)
                help_text = info.help + (f" ({info.metadata['hint']})" if info.metadata.get("hint") else "")
                if f"{name}.{info.name}" in C.NOT_IMPLEMENTED:
                    help_text += " *(not implemented yet)*"
                lines.append(f"| `{info.name}` | {_cell(what)} | {_cell(_default(info))} | "
                             f"{_cell(_bounds(info.metadata))} | {_cell(help_text)} |")
            lines.append("")
    lines += ["## Names from sd-scripts", "",
              "What sd-scripts (and other trainers, or plain English) call a setting, and the key it is here. An "
              "unknown key with one of these names is answered with its counterpart.", "",
              "| name elsewhere | here |", "|---|---|"]
    for foreign, ours in ALIASES.items():
        table, _, key = ours.rpartition(".")
        lines.append(f"| `{foreign}` | `[{table}] {key}` |")
    for foreign, note in NO_EQUIVALENT.items():
        lines.append(f"| `{foreign}` | {_cell(note)} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------- command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", metavar="CFG.toml",
                        help="check this config and the paths it names (model, dataset, output folder, resume_from)")
    parser.add_argument("--reference", action="store_true",
                        help="print the reference of every config key (docs/config.md)")
    parser.add_argument("--out", metavar="FILE", help="with --reference: write it to FILE instead of printing it")
    # the dataset is checked as `train` checks it, so the flags that change train's verdict are here too
    parser.add_argument("--skip-unreadable", action="store_true", help="as train: skip unreadable images")
    parser.add_argument("--allow-missing-captions", action="store_true",
                        help="as train: accept images without a <stem>.txt")


def _write_new(out: Path, text: str) -> None:
    """--out FILE: written atomically, and never over an existing file (it may be the user's own notes or config;
    published with a hard link, so a file that appears meanwhile is not replaced either)."""
    refused = UserError(f"--out {out}: the file already exists; give another path, or delete it first to replace it")
    if out.exists() or out.is_symlink():
        raise refused
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: the folder {out.parent} does not exist; create it or give another path")
    try:
        with atomic_path(out, overwrite=False) as tmp:
            tmp.write_text(text, encoding="utf-8", newline="")
    except FileExistsError:
        raise refused from None


def run(args) -> int:
    if args.reference:
        text = reference_markdown()
        if args.out:
            _write_new(Path(args.out), text)
            print(f"wrote {args.out}")
        else:
            sys.stdout.write(text)
        return 0
    if not args.config:
        raise UserError("give a config file to check (anima-train config CFG.toml), or --reference for the list "
                        "of every key")

    # its warnings are printed as they come (cli.main formats them); its paths' problems come with its values'
    cfg = load_config(args.config, also=path_check())
    check_run_paths(cfg)  # and the weights' shapes
    # what `train` checks before it loads the model: images (decoded when they will be), captions, caches, buckets
    data = build_training_data(cfg, cfg.train.model_path, skip_unreadable=args.skip_unreadable,
                               allow_missing_captions=args.allow_missing_captions)
    per_epoch = steps_per_epoch(len(data.sampler), 1, cfg.train.gradient_accumulation_steps)  # one process
    for text in data.warnings + honoured.report(cfg, data, per_epoch):
        print(f"warning: {text}")
    print(f"{args.config}: OK ({cfg.adapter.kind if cfg.adapter.kind != 'none' else 'full finetune'}; the model, "
          f"dataset ({len(data.sources)} source(s), {len(data.entries)} entries, {data.mode}) and output folder are "
          f"usable)")
    return 0
