"""A config file in and out: `load_config` (a TOML file -> a validated Config; `parse_config` for TOML text),
`dump_toml`, `copy_config_verbatim`.

    cfg = load_config("configs/lora.toml")      # a file; parse_config(toml_text) for text
    dump_toml(cfg)                              # only non-default values (+ adapter.kind)
    copy_config_verbatim(cfg, run_dir / f"{cfg.run_stem}.toml")   # comments kept

load_config reads the file's structure here (which tables, which keys: an unknown one is answered with the key
meant), builds the Config from the values as written, and hands it to the one gate, validate.validate, which checks
every value and rule and collects every problem; they are raised together in one ConfigError, so a config is fixed
in one pass.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tomllib
import warnings
from pathlib import Path
from typing import Any, Callable

from anima_train.config import aliases
from anima_train.config.keys import ConfigError, ConfigWarning, Problems, Where, as_toml, is_key, toml_type
from anima_train.config.schema import ARRAY_TABLES, TABLES, Config
from anima_train.config.validate import Context, header, keys_by_table, unchecked, unknown_key, validate

TEXT_SOURCE = "<config text>"  # how messages name a config given as text rather than a file


def _read_file(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config path is a folder, not a TOML file: {path}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc}); save the config as UTF-8") from None


Also = Callable[[Config, frozenset[str]], None]


def load_config(path: str | os.PathLike, also: Also | None = None) -> Config:
    """Load and validate the config file at `path` (a str is a path too: parse_config takes TOML text). Raises
    ConfigError listing every problem; the files its keys name are read relative to the file's folder.

    `also(cfg, bad)` checks more of the config (the files and folders it names: training.preflight.path_check) and
    raises its own ConfigError: alone when the values are fine, else its problems join theirs in one message, so a
    config is fixed in one pass. `bad` holds the keys whose values were refused (set back to their defaults, which
    `also` should not judge)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load_config takes a path, not {type(path).__name__}")
    path = Path(path).expanduser()
    return _load(path, _read_file(path), also)


def parse_config(text: str, also: Also | None = None) -> Config:
    """Validate a config given as TOML text, as load_config does a file's; the files its keys name are read
    relative to the current folder, and messages name it TEXT_SOURCE."""
    if not isinstance(text, str):
        raise TypeError(f"parse_config takes TOML text, not {type(text).__name__}")
    return _load(None, text, also)


def _load(path: Path | None, text: str, also: Also | None) -> Config:
    name = str(path) if path is not None else TEXT_SOURCE
    try:
        raw = tomllib.loads(text.removeprefix("\ufeff"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{name}: not valid TOML: {exc}") from None
    p = Problems()
    cfg = _build_config(raw, p)
    validate(cfg, p, Context(toml=True, base_dir=path.parent if path is not None else Path.cwd(), require_data=True,
                             written=_written(raw)))
    if also is not None:
        cfg.source_path = path
        try:
            also(cfg, frozenset(p.bad))
        except ConfigError as exc:
            if not p.errors:
                raise
            p.errors += exc.errors
    if p.errors:
        n = len(p.errors)
        if n == 1:  # one problem, one line
            raise ConfigError(f"{name}: {p.errors[0]}", p.errors)
        raise ConfigError(f"{name}: {n} problems in the config:\n" + "\n".join(f"  - {e}" for e in p.errors),
                          p.errors)
    for w in p.warnings:
        warnings.warn(f"{name}: {w}", ConfigWarning, stacklevel=3)  # the caller of load_config or parse_config
    cfg.source_path, cfg.source_text = path, text
    return cfg


# --------------------------------------------------------------------------------------------------- structure


def _written(raw: dict) -> dict[str, frozenset[str]]:
    """The keys the file sets in each (non-array) table."""
    out = {}
    for name in TABLES:
        node: Any = raw
        for part in name.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            out[name] = frozenset(node)
    return out


@functools.cache
def _names(cls: type) -> tuple[list[str], frozenset[str]]:
    """(the names a table of this class may hold, nested tables included; its keys)."""
    fields = dataclasses.fields(cls)
    return [f.name for f in fields if f.metadata.get("key", True)], frozenset(f.name for f in fields if is_key(f))


def _unknown_keys(cls: type, raw: dict, where: Where, p: Problems) -> None:
    valid = _names(cls)[0]
    for key in raw:
        if key not in valid:
            p.error(unknown_key(where, key, valid))


def _read_table(cls: type, raw: dict, where: Where, p: Problems, **tables: Any) -> Any:
    """One TOML table as its dataclass (with the tables inside it), holding the values as written: validate checks
    them. Unknown keys are reported here (unless the caller did, before reading the tables inside)."""
    if not tables:
        _unknown_keys(cls, raw, where, p)
    keys = _names(cls)[1]
    return unchecked(cls, **{k: v for k, v in raw.items() if k in keys}, **tables)


def _build_config(raw: dict, p: Problems) -> Config:
    top = {f.name: f for f in dataclasses.fields(Config) if f.metadata.get("key", True)}
    for key, value in raw.items():
        if key not in top:
            if isinstance(value, dict):
                p.error(unknown_key(Where("", toml=True), key, list(top)))
            else:
                found = aliases.suggestion(key, "", keys_by_table())
                fix = (f"; {found}" if isinstance(found, str) else
                       f"; keys go inside a table, e.g. {header(found[0], True)} {found[1]}" if found else
                       "; it is not a key of any table either (docs/config.md lists every key)")
                p.error(f"config: key '{key}' is outside any table{fix} (tables: {', '.join(top)})")
        elif key == "curriculum":
            if isinstance(value, dict):
                p.error("[curriculum] is a single table, but curriculum phases are an array of tables: write "
                        "[[curriculum]] (double brackets) for each phase", "curriculum")
            elif not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
                p.error(f"curriculum = {as_toml(value)}: expected [[curriculum]] tables", "curriculum")
        elif not isinstance(value, dict):
            p.error(f"config: '{key}' must be a table ([{key}]), got {toml_type(value)}", key)

    def sub(name: str) -> dict:
        v = raw.get(name, {})
        return v if isinstance(v, dict) else {}

    def at(name: str, index: int | None = None) -> Where:
        return Where(name, index, array=name in ARRAY_TABLES, toml=True)

    tables: dict[str, Any] = {"train": _read_table(TABLES["train"], sub("train"), at("train"), p)}
    draw = sub("dataset")
    _unknown_keys(TABLES["dataset"], draw, at("dataset"), p)
    inside: dict[str, Any] = {}
    for nested in ("caption", "texture"):
        value = draw.get(nested, {})
        if not isinstance(value, dict):
            p.error(f"[dataset] {nested} must be a table ([dataset.{nested}]), got {toml_type(value)}",
                    f"dataset.{nested}")
            value = {}
        inside[nested] = _read_table(TABLES[f"dataset.{nested}"], value, at(f"dataset.{nested}"), p)
    subsets = draw.get("subsets", [])
    if isinstance(subsets, dict) or not (isinstance(subsets, list) and all(isinstance(s, dict) for s in subsets)):
        p.error("[dataset] subsets must be an array of tables: write [[dataset.subsets]] (double brackets) "
                "for each subset", "dataset.subsets")
        subsets = []
    inside["subsets"] = [_read_table(TABLES["dataset.subsets"], s, at("dataset.subsets", i), p)
                         for i, s in enumerate(subsets)]
    tables["dataset"] = _read_table(TABLES["dataset"], draw, at("dataset"), p, **inside)

    for name in ("flow", "optimizer", "schedule", "component_lr", "adapter", "quant", "sample", "logging",
                 "validation"):
        tables[name] = _read_table(TABLES[name], sub(name), at(name), p)

    phases = raw.get("curriculum", [])
    if not (isinstance(phases, list) and all(isinstance(v, dict) for v in phases)):
        phases = []  # reported above
    tables["curriculum"] = [_read_table(TABLES["curriculum"], ph, at("curriculum", i), p)
                            for i, ph in enumerate(phases)]
    return unchecked(Config, **tables)


# --------------------------------------------------------------------------------------------------- writing


def copy_config_verbatim(config: Config, dest_path: str | os.PathLike) -> Path:
    """Write the config exactly as it was read (comments kept) to dest_path, atomically.

    A config built in code (no source text) is written as dump_toml. A config read from dest_path itself (a run
    started from its own copy) is left as it is: it already holds what it was read from.
    """
    from anima_train.files import write_text  # lazy: ~15 ms (anchor.atomic); only a run's start writes the copy

    dest = Path(dest_path)
    if config.source_path is not None and dest.exists() and dest.resolve() == config.source_path.resolve():
        return dest
    write_text(dest, config.source_text if config.source_text is not None else dump_toml(config))
    return dest


# tomlkit is imported where it writes: ~50 ms, which every `import anima_train.config` (ComfyUI's start-up, the
# node's validation) would otherwise pay for a function few callers use.


def _toml_value(value: Any) -> Any:
    # lazy: tomlkit (60-190 ms measured, about what the whole config package costs): only writing TOML needs it
    import tomlkit
    if isinstance(value, dict):
        tbl = tomlkit.inline_table()
        tbl.update({str(k): _toml_value(v) for k, v in value.items()})
        return tbl
    if isinstance(value, list):
        return [_toml_value(v) for v in value]
    return value


def _dump_table(obj: Any, default: Any, always: tuple[str, ...] = ()) -> Any:
    # lazy: tomlkit: see _toml_value
    import tomlkit
    tbl = tomlkit.table()
    for f in dataclasses.fields(obj):
        if not f.metadata.get("key", True):
            continue
        value = getattr(obj, f.name)
        if "table" in f.metadata:
            sub = _dump_table(value, getattr(default, f.name))
            if len(sub):
                tbl[f.name] = sub
        elif "array" in f.metadata:
            if value:
                aot = tomlkit.aot()
                for item in value:  # every key of a subset: an entry reads best complete
                    aot.append(_dump_table(item, None))
                tbl[f.name] = aot
        elif value is not None and (f.name in always or default is None
                                    or value != getattr(default, f.name)):
            tbl[f.name] = _toml_value(value)
    return tbl


def dump_toml(config: Config) -> str:
    """TOML text of the non-default values (adapter.kind always). Loads back with parse_config to an equal Config."""
    # lazy: tomlkit: see _toml_value
    import tomlkit
    doc = tomlkit.document()
    defaults = Config()
    for f in dataclasses.fields(Config):
        if "table" not in f.metadata:
            continue
        always = ("kind",) if f.name == "adapter" else ()
        tbl = _dump_table(getattr(config, f.name), getattr(defaults, f.name), always)
        if len(tbl):
            doc[f.name] = tbl
    if config.curriculum:
        aot = tomlkit.aot()
        for ph in config.curriculum:  # every key of a phase: a phase reads best complete
            aot.append(_dump_table(ph, None))
        doc["curriculum"] = aot
    return tomlkit.dumps(doc)
