"""The config's one gate: `validate` checks a table or a whole Config, however it was built.

Every table class is declared `@section` (the Config itself `@root`), which makes its constructor call `validate`:
`ScheduleConfig(d=1.0)`, `Config(...)` and `dataclasses.replace(...)` raise a ConfigError naming the key and the fix,
exactly as load_config does for a file, where `validate` runs once over the whole config it built. An unknown
keyword is answered with the key meant (did-you-mean, other trainers' names: aliases.py), and assigning a key of a
built table (`cfg.train.epochs = 0`) checks that key.

`validate` checks every key of the table and of the tables inside it (type, choices, bounds: keys.check_key, from
the field metadata), then puts what they say in final form (normalise.NORMALISE: tiers ascending, the files the keys
name read) and runs the rules across keys of that scope (rules.RULES), which only read and report. Messages name keys as
a file does (`[train] epochs`) when load_config checks a file, and as code does (`train.epochs`) otherwise. A value that
is its key's declared default is valid as declared (tests/test_config.py checks every default), so a constructor checks
the keys it was given and the rules, and `Config()` costs what a plain dataclass does.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from anima_train.config import aliases
from anima_train.config.keys import (REQUIRED, ConfigError, ConfigWarning, Problems, Where, check_key, field_default,
                                     hints, is_key, is_required)
from anima_train.config.normalise import NORMALISE, NORMALISE_AFTER
from anima_train.config.rules import RULES


@dataclass(frozen=True)
class Context:
    """How `validate` runs. The defaults are those of a table built in code; load_config gives a file's."""

    toml: bool = False  # name keys as a config file does
    base_dir: Path | None = None  # read the files that keys name from here; None: not read (load_config reads them)
    require_data: bool = False  # a config file must name its training data; a table built in code may leave it unset
    written: dict[str, frozenset[str]] | None = None  # the keys a file sets, per table; None: those off their default

    def given(self, table: str, obj: Any) -> set[str]:
        """The keys of `table` the author set (rules that treat "written" differently from "default")."""
        if self.written is not None:
            return set(self.written.get(table, ()))
        return {f.name for f in dataclasses.fields(obj) if is_key(f) and getattr(obj, f.name) != field_default(f)}


IN_CODE = Context()

# Filled by the decorators: the raw dataclass __init__ of each table, its keys, and (once @root ran) every table's
# TOML name.
_RAW_INIT: dict[type, Any] = {}
_KEYS: dict[type, list[dataclasses.Field]] = {}
_KEY_BY_NAME: dict[type, dict[str, dataclasses.Field]] = {}
_NESTED: dict[type, list[dataclasses.Field]] = {}  # the fields that hold a table or an array of tables
_REQUIRED: dict[type, list[str]] = {}
_NAMES: dict[type, str] = {}
_TABLES: dict[str, type] = {}
_ARRAYS: set[str] = set()


def tables() -> dict[str, type]:
    """Every table class by its TOML name ("train", "dataset.caption", ...), in file order."""
    return dict(_TABLES)


def array_tables() -> tuple[str, ...]:
    """The tables written as arrays ([[dataset.subsets]], [[curriculum]])."""
    return tuple(n for n in _TABLES if n in _ARRAYS)


@functools.cache
def keys_by_table() -> dict[str, list[str]]:
    """Every table's key names (nested table names included), for suggesting the key a user meant."""
    return {name: [f.name for f in dataclasses.fields(cls) if f.metadata.get("key", True)]
            for name, cls in _TABLES.items()}


def header(table: str, toml: bool) -> str:
    if not toml:
        return table
    return f"[[{table}]]" if table in _ARRAYS else f"[{table}]"


def unknown_key(where: Where, key: str, valid: list[str]) -> str:
    """The message for a key `where`'s table does not have, with the key the user most likely meant."""
    if where.table == "":
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"{'config:' if where.toml else 'Config:'} unknown table '{key}'{hint}; valid tables: {', '.join(valid)}"
    hint = ""
    found = aliases.suggestion(key, where.table, keys_by_table())
    if isinstance(found, str):
        hint = f" ({found})"
    elif found is not None:
        home, name = found
        hint = (f" (did you mean '{name}'?)" if home == where.table else
                f" ('{key}' belongs in {header(home, where.toml)})" if name == key else
                f" (did you mean {header(home, where.toml)} {name}?)" if where.toml else
                f" (did you mean {home}.{name}?)")
    return f"{where.label}{'' if where.toml else ':'} unknown key '{key}'{hint}; valid keys: {', '.join(valid)}"


# --------------------------------------------------------------------------------------------------- the gate


def validate(obj: Any, p: Problems | None = None, ctx: Context = IN_CODE, given: set[str] | None = None) -> None:
    """Check a table (or a whole Config) and the tables inside it: every key, then the rules across keys.

    With `p`, the problems are added to it (load_config adds the file's name and reports them); without, a
    ConfigError lists them (one line when there is one) and the warnings are issued as ConfigWarning. A bad value is
    set back to its default, so that the rules see no untrusted value; an array entry without a required key is
    dropped. `given` (a constructor's arguments): check only these keys of `obj` itself; its defaults are valid as
    declared and the tables passed to it were checked when they were built."""
    own = p is None
    p = Problems() if p is None else p
    name = _NAMES[type(obj)]
    where = Where(name, array=name in _ARRAYS, toml=ctx.toml)
    if given is None:
        _check_tree(obj, where, p)
    else:
        _check_keys(obj, where, p, given)
        _check_tables(obj, where, p, given)
    for stage in _STAGES:
        for scope, step in _in_scope(name, stage):
            for table, at in _scoped(obj, where, scope):
                step(table, p, ctx, at)
    if own:
        _finish(p)


# normalise, then the rules, then what must wait for them (rules.py says why for each)
_STAGES = {"normalise": NORMALISE, "rules": RULES, "after": NORMALISE_AFTER}


@functools.cache
def _in_scope(table: str, stage: str) -> list:
    """The steps of a stage that read `table` or a table inside it ("" = the Config: all of them), in order."""
    return [(scope, step) for scope, step in _STAGES[stage]
            if table == "" or scope == table or scope.startswith(table + ".")]


def _finish(p: Problems) -> None:
    if p.errors:
        n = len(p.errors)
        raise ConfigError(p.errors[0] if n == 1 else
                          f"{n} problems in the config:\n" + "\n".join(f"  - {e}" for e in p.errors), p.errors)
    for w in p.warnings:
        warnings.warn(w, ConfigWarning, stacklevel=3)


def _check_keys(obj: Any, where: Where, p: Problems, only: set[str] | None = None) -> bool:
    """Every key of one table (or `only` these, and a missing required one); False when a required key is missing or
    bad."""
    types = hints(type(obj))
    ok = True
    for f in _KEYS[type(obj)]:
        value = getattr(obj, f.name)
        if value is REQUIRED:
            p.error(f"{where.label} is missing the required key '{f.name}' ({f.metadata['help']})",
                    f"{where.dotted}.{f.name}")
            ok = False
            continue
        if (only is not None and f.name not in only) or value is f.default:  # a declared default is valid
            continue
        good, value = check_key(value, f, types[f.name], where, p)
        if good:
            object.__setattr__(obj, f.name, value)
        elif is_required(f):
            ok = False
        else:
            object.__setattr__(obj, f.name, field_default(f))
    return ok


def _check_tree(obj: Any, where: Where, p: Problems) -> bool:
    """The keys of `obj`, then of each table inside it, in field order."""
    ok = _check_keys(obj, where, p)
    _check_tables(obj, where, p)
    return ok


def _check_tables(obj: Any, where: Where, p: Problems, shallow: set[str] | None = None) -> None:
    """The tables inside `obj`: each of its class, and checked (`shallow`: only those fields, and not inside them)."""
    for f in _NESTED[type(obj)]:
        cls = f.metadata.get("table") or f.metadata.get("array")
        if shallow is not None and f.name not in shallow:
            continue
        name = f"{where.table}.{f.name}" if where.table else f.name
        value = getattr(obj, f.name)
        if "table" in f.metadata:
            if isinstance(value, cls):
                if shallow is None:
                    _check_tree(value, Where(name, toml=where.toml), p)
            else:
                p.error(f"{where.key(f.name)}: expected a {cls.__name__}, got {type(value).__name__}", name)
                object.__setattr__(obj, f.name, cls())
            continue
        if not isinstance(value, list):
            p.error(f"{where.key(f.name)}: expected a list of {cls.__name__}, got {type(value).__name__}", name)
            object.__setattr__(obj, f.name, [])
            continue
        kept = []
        for i, item in enumerate(value):
            at = Where(name, i, array=True, toml=where.toml)
            if not isinstance(item, cls):
                p.error(f"{at.label}: expected a {cls.__name__}, got {type(item).__name__}", name)
            elif shallow is not None or _check_tree(item, at, p):
                kept.append(item)
            else:
                p.bad.add(name)  # an entry was dropped: "no training data" would be misleading
        if len(kept) != len(value):
            object.__setattr__(obj, f.name, kept)


def _scoped(obj: Any, where: Where, scope: str) -> Iterator[tuple[Any, Where]]:
    """The tables at `scope` inside `obj` (an array scope: each entry), with their place; none outside obj."""
    if scope == where.table:
        yield obj, where
        return
    if where.table and not scope.startswith(where.table + "."):
        return
    node, at = obj, where
    for part in (scope[len(where.table) + 1:] if where.table else scope).split("."):
        value = getattr(node, part)
        name = f"{at.table}.{part}" if at.table else part
        if isinstance(value, list):
            for i, item in enumerate(value):
                yield item, Where(name, i, array=True, toml=where.toml)
            return
        node, at = value, Where(name, toml=where.toml)
    yield node, at


# --------------------------------------------------------------------------------------------------- tables


def section(cls: type) -> type:
    """Class decorator (above @dataclass) of a config table: its constructor checks it (`validate`), an unknown
    keyword is answered with the key meant, and assigning one of its keys later checks that key."""
    raw_init = cls.__init__
    fields = dataclasses.fields(cls)
    _RAW_INIT[cls] = raw_init
    _KEYS[cls] = [f for f in fields if is_key(f)]
    _KEY_BY_NAME[cls] = {f.name: f for f in _KEYS[cls]}
    _NESTED[cls] = [f for f in fields if "table" in f.metadata or "array" in f.metadata]
    _REQUIRED[cls] = [f.name for f in fields if f.init and is_required(f)]
    names = [f.name for f in fields if f.init]
    valid = [f.name for f in fields if f.metadata.get("key", True)]

    @functools.wraps(raw_init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args and not kwargs and not _REQUIRED[cls]:  # declared defaults: valid (tests/test_config.py checks)
            raw_init(self)
            return
        p = Problems()
        where = _where(cls)
        for key in [k for k in kwargs if k not in names]:
            p.error(unknown_key(where, key, valid))
            del kwargs[key]
        given = set(names[:len(args)]) | set(kwargs)
        raw_init(self, *args, **_required(cls, kwargs, given))
        validate(self, p, given=given)
        _finish(p)

    cls.__init__ = __init__
    cls.__setattr__ = _assign
    return cls


def root(cls: type) -> type:
    """Class decorator of the Config: a section whose nested table fields name every table."""

    def walk(parent: type, prefix: str) -> None:
        for f in dataclasses.fields(parent):
            sub = f.metadata.get("table") or f.metadata.get("array")
            if sub is not None:
                name = f"{prefix}.{f.name}" if prefix else f.name
                _TABLES[name], _NAMES[sub] = sub, name
                if "array" in f.metadata:
                    _ARRAYS.add(name)
                walk(sub, name)

    _NAMES[cls] = ""
    walk(cls, "")
    return section(cls)


def unchecked(cls: type, **values: Any) -> Any:
    """A table holding these values as given, not checked yet: load_config builds the whole config from the file,
    then validates it once."""
    obj = cls.__new__(cls)
    _RAW_INIT[cls](obj, **_required(cls, values))
    return obj


def _required(cls: type, kwargs: dict, given: set[str] = frozenset()) -> dict:
    """A required key not given holds REQUIRED, which validate reports as missing (not a TypeError)."""
    for name in _REQUIRED[cls]:
        if name not in kwargs and name not in given:
            kwargs[name] = REQUIRED
    return kwargs


def _where(cls: type) -> Where:
    name = _NAMES[cls]
    return Where(name, array=name in _ARRAYS)


def _assign(self: Any, name: str, value: Any) -> None:
    f = _KEY_BY_NAME[type(self)].get(name) if name in self.__dict__ else None
    if f is not None:  # a key of a built table (the constructor's own assignments pass)
        p = Problems()
        where = _where(type(self))
        ok, value = check_key(value, f, hints(type(self))[name], where, p)
        if not ok:
            raise ConfigError(p.errors[0], p.errors)
    object.__setattr__(self, name, value)
