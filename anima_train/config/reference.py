"""The config reference (docs/config.md), generated from the config dataclasses; `anima-train config --reference`
prints it (the command is training/config_check.py: its check of a config file reads the dataset, above this layer).

The reference is built from the config's tables (schema.py: TABLES, iter_fields and each key's metadata) and the
sd-scripts name table (aliases.py), so it cannot disagree with the loader. No torch here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

from anima_train.config import schema as C
from anima_train.config.aliases import ALIASES, NO_EQUIVALENT
from anima_train.config.constants import MODEL_PATH_ENV
from anima_train.config.keys import REQUIRED, as_toml, describe

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


def reference_markdown() -> str:
    """docs/config.md: every table and key with its type, default, bounds/choices and help."""
    helps = _table_help()
    lines = [INTRO]
    with _without_env([MODEL_PATH_ENV]):
        for name in C.TABLES:
            header = f"[[{name}]]" if name in C.ARRAY_TABLES else f"[{name}]"
            lines += [f"## `{header}`", "", _cell(helps.get(name, "")).capitalize() + ".", "",
                      "| key | type | default | allowed | description |", "|---|---|---|---|---|"]
            for info in C.iter_fields(name):
                what = info.metadata.get("type_desc") or describe(info.type)
                help_text = info.help + (f" ({info.metadata['hint']})" if info.metadata.get("hint") else "")
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
