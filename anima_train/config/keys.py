"""What a config key is, how one value of it is checked, and how messages name it.

A key is a dataclass field whose metadata carries its `help`, its `choices`, its bounds (`ge`/`gt`/`le`/`lt`; beyond
them every integer must fit 64 bits and every number a float32, the types the values reach),
`nonempty`, a `hint` for the bound's message and a `type_desc` for the type's; its annotation is its type. `check_key`
checks one value against all of that (the type first: an int is converted where a float is expected, a TOML
table's string keys to integers) and reports a problem into a `Problems` collector, naming the key as a config file
does (`[train] epochs`) or as code does (`train.epochs`), see `Where`. Nothing here knows the tables themselves.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import operator
import re
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Literal

from anima_train.config.constants import FLOAT_LIMIT, INT_LIMIT
from anima_train.errors import UserError


class ConfigError(UserError, ValueError):
    """A config that cannot be used. `errors` holds one message per problem (the lines of the message)."""

    def __init__(self, message: str, errors: list[str] | None = None):
        super().__init__(message)
        self.errors = list(errors) if errors is not None else [message]


class ConfigWarning(UserWarning):
    """A config that loads but probably does not do what its author meant."""


REQUIRED = object()  # the default iter_fields reports for a key without one (a subset's path); its value until given


class Problems:
    """Errors and warnings found while checking, plus the keys whose values could not be trusted."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.bad: set[str] = set()  # dotted keys with a wrong type or an out-of-range/unknown value

    def error(self, msg: str, *bad_keys: str) -> None:
        self.errors.append(msg)
        self.bad.update(bad_keys)

    def ok(self, *keys: str) -> bool:
        """True if none of these keys failed on its own (cross-field rules skip untrustworthy inputs)."""
        return not any(k in self.bad for k in keys)


def table_label(name: str, index: int | None = None) -> str:
    return f"[[{name}]] #{index + 1}" if index is not None else f"[{name}]"


@dataclass(frozen=True)
class Where:
    """A table's place in the config (`table` is its TOML name, `index` its position in an array of tables) and how
    messages name its keys: as a config file does (`[train] epochs`, `[[curriculum]] #2 t_range`) when `toml`, else
    as code does (`train.epochs`, `curriculum[1].t_range`)."""

    table: str
    index: int | None = None
    array: bool = False
    toml: bool = False

    @property
    def dotted(self) -> str:
        """The prefix of the table's keys in Problems.bad: "train", "curriculum[1]" (the same for file and code)."""
        return self.table if self.index is None else f"{self.table}[{self.index}]"

    @property
    def toml_label(self) -> str:
        """The table as a config file writes it: "[train]", "[[curriculum]] #2" ("[[curriculum]]" without index)."""
        if self.array:
            return f"[[{self.table}]]" + (f" #{self.index + 1}" if self.index is not None else "")
        return f"[{self.table}]"

    @property
    def label(self) -> str:
        return self.toml_label if self.toml else self.dotted

    def key(self, name: str) -> str:
        if self.toml:
            return f"{self.label} {name}"
        return f"{self.dotted}.{name}" if self.dotted else name


# --------------------------------------------------------------------------------------------------- fields


def is_key(f: dataclasses.Field) -> bool:
    """A field that is a key (not a nested table, not an array of tables, not data the loader adds)."""
    return f.metadata.get("key", True) and "table" not in f.metadata and "array" not in f.metadata


def is_required(f: dataclasses.Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return REQUIRED


_TYPE_HINTS: dict[type, dict[str, Any]] = {}


def hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a table class (`from __future__ import annotations` keeps them as strings)."""
    if cls not in _TYPE_HINTS:
        _TYPE_HINTS[cls] = typing.get_type_hints(cls)
    return _TYPE_HINTS[cls]


# --------------------------------------------------------------------------------------------------- types


class Mismatch(Exception):
    pass


class BadEntry(Mismatch):
    """A table of the right kind with one wrong key or value: the message says which (not "expected a table,
    got a table")."""

    def __init__(self, why: str):
        super().__init__()
        self.why = why


def describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args if a is not type(None))
    if origin is Literal:
        return " or ".join(as_toml(a) for a in args)
    if origin is list:
        inner = describe(args[0])
        inner = {"an integer": "integers", "a number": "numbers", "a string": "strings"}.get(inner, inner)
        if inner.startswith("a list of "):
            inner = "lists of " + inner[len("a list of "):]
        return f"a list of {inner}"
    if origin is dict:
        return "a table"
    return str(tp)


_SHAPES: dict[Any, tuple[Any, tuple]] = {}


def _shape(tp: Any) -> tuple[Any, tuple]:
    """(origin, args) of an annotation, looked up once (typing's functions are slow for a check on every key)."""
    if tp not in _SHAPES:
        _SHAPES[tp] = (typing.get_origin(tp), typing.get_args(tp))
    return _SHAPES[tp]


def coerce(value: Any, tp: Any) -> Any:
    """Check `value` against annotation `tp`; return it converted (ints to floats, a TOML table's string keys to
    integers, a tuple from code to a list). Raises Mismatch."""
    origin, args = (None, ()) if tp in (bool, int, float, str) else _shape(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):  # true is not 1
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # an int is fine where a float is
            if not math.isfinite(value):
                raise Mismatch("a finite number")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:  # an optional key left unset (TOML has no null: code only)
            return None
        entry = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg)
            except BadEntry as exc:
                entry = exc  # the value is this kind of thing, with one bad entry: that is the message
            except Mismatch:
                pass
        if entry is not None:
            raise entry
    elif origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
    elif origin is list:
        if isinstance(value, (list, tuple)):  # a TOML array is a list; code may pass a tuple
            return [coerce(v, args[0]) for v in value]
    elif origin is dict:
        if isinstance(value, dict):
            key_type, value_type = args
            out = {}
            for k, v in value.items():
                if key_type is int and not (isinstance(k, int) and not isinstance(k, bool)):  # TOML keys are text
                    if not (isinstance(k, str) and re.fullmatch(r"\s*-?\d+\s*", k)):
                        raise BadEntry(f"the key {as_toml(k)} is not a whole number; every key of this table is "
                                       f"an integer (e.g. {{ 768 = 16, 1024 = 12 }})")
                    k = int(k)
                try:
                    out[k] = coerce(v, value_type)
                except Mismatch:
                    raise BadEntry(f"the value of {k} is {toml_type(v)}, expected {describe(value_type)}") from None
            return out
    raise Mismatch()


def toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__}"


def as_toml(value: Any) -> str:
    """A value as it would be written in TOML (for messages)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(as_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {as_toml(v)}" for k, v in value.items()) + " }"
    return str(value)


# --------------------------------------------------------------------------------------------------- one key


def check_key(value: Any, f: dataclasses.Field, tp: Any, where: Where, p: Problems) -> tuple[bool, Any]:
    """(ok, the value converted to its type): the type of one key's value, then its choices, bounds and emptiness.
    The message names the key as `where` does ("[schedule] d" in a file, "schedule.d" in code)."""
    try:
        value = coerce(value, tp)
    except BadEntry as exc:
        p.error(f"{where.key(f.name)} = {as_toml(value)}: {exc.why}", f"{where.dotted}.{f.name}")
        return False, value
    except Mismatch as exc:
        expected = (exc.args[0] if exc.args else "") or f.metadata.get("type_desc") or describe(tp)
        example = field_default(f)
        example = f" (e.g. {f.name} = {as_toml(example)})" if example not in (None, REQUIRED) else ""
        p.error(f"{where.key(f.name)} = {as_toml(value)}: expected {expected}{example}, got {toml_type(value)}",
                f"{where.dotted}.{f.name}")
        return False, value
    return check_value(value, f, where, p), value


_BOUNDS = (("ge", operator.ge, ">="), ("gt", operator.gt, ">"), ("le", operator.le, "<="), ("lt", operator.lt, "<"))


def check_value(value: Any, f: dataclasses.Field, where: Where, p: Problems) -> bool:
    """Per-key checks from the field's metadata: choices, bounds, non-empty. Returns False if it failed."""
    m = f.metadata
    choices = m.get("choices")
    if choices and not isinstance(value, dict):
        items = value if isinstance(value, list) else [value]
        for item in items:
            if item is not None and item not in choices:
                close = difflib.get_close_matches(str(item), [str(c) for c in choices], n=1, cutoff=0.6)
                sugg = f"did you mean {as_toml(close[0])}? " if close else ""
                p.error(f"{where.key(f.name)} = {as_toml(value)}: unknown value {as_toml(item)}; {sugg}"
                        f"choose from {', '.join(as_toml(c) for c in choices)}", f"{where.dotted}.{f.name}")
                return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for bound, test, word in _BOUNDS:
            b = m.get(bound)
            if b is not None and not test(value, b):
                hint = f" ({m['hint']})" if m.get("hint") else ""
                p.error(f"{where.key(f.name)} = {as_toml(value)}: must be {word} {as_toml(b)}{hint}",
                        f"{where.dotted}.{f.name}")
                return False
        limit, what = (INT_LIMIT, "a 64-bit integer, what torch and numpy take") if isinstance(value, int) else (
            FLOAT_LIMIT, "a float32, what the model's tensors hold")
        if abs(value) > limit:  # the type's own bound, for every key: no value may overflow where it goes
            p.error(f"{where.key(f.name)} = {as_toml(value)}: too large; at most {as_toml(limit)} in size ({what})",
                    f"{where.dotted}.{f.name}")
            return False
    if m.get("nonempty") and isinstance(value, str) and not value.strip():
        p.error(f"{where.key(f.name)} is empty; give a path or remove the key", f"{where.dotted}.{f.name}")
        return False
    return True


def flag_type(cls: type, name: str):
    """An argparse `type` for a flag that stands for config key `name` of table class `cls` (`--seed` of the demo is
    [train] seed): the value passes the key's own check, type limits included, so a flag and a config file refuse
    the same values (argparse prints the reason after the flag's name, exit 2)."""
    f = next(x for x in dataclasses.fields(cls) if x.name == name)
    tp = hints(cls)[name]

    def convert(text: str) -> Any:
        try:
            value = int(text) if tp is int else float(text) if tp is float else text
        except ValueError:
            raise ValueError(text) from None  # argparse's own "invalid value" message
        p, where = Problems(), Where("")
        ok, value = check_key(value, f, tp, where, p)
        if not ok:
            raise argparse.ArgumentTypeError(p.errors[0].split(": ", 1)[-1] + f" (as the config key {name})")
        return value

    convert.__name__ = {int: "integer", float: "number"}.get(tp, "text")  # argparse: "invalid integer value"
    return convert
