"""The ComfyUI front of the trainer's fix texts: a message's references, said as nodes and widgets.

The trainer names what the user changes through references (anima_train/fixes.py): a config key as the file spells
it (`[optimizer] lr`), a flag or a command as a token (⟦flag audit --resolution⟧, ⟦run convert⟧) when the message is
meant for this front — inside `anima_train.fixes.writing_refs()` here, or in a worker child, whose environment says
so (worker.worker_env). `render` turns them into what a ComfyUI user sets: the Training config's widget of that key
(its Knob), the widget of a flag on the node that passes it, the node that runs a command; a key without a widget is
written in extra_toml. The first line of a message is what ComfyUI's "Validation failed" popup and the node's error
show best: `render` keeps it within FIRST_LINE chars, moving the rest of a long one to the lines below.

No ComfyUI import: the node modules decorate their methods with `shown_on(node)`, which makes the library write
references while they run and says every error they raise this way.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import tomllib
from typing import Callable, Collection, Iterator

from anima_train.config import TABLES
from anima_train.config.keys import is_key
from anima_train.fixes import TOKEN, writing_refs

FIRST_LINE = 120  # characters of a message's first line (the popup's one line: the key and the fix)

TRAINING_CONFIG = "Anima: Training config"
CONVERT = "Anima: Convert checkpoint"
AUDIT = "Anima: Audit dataset"
CACHE = "Anima: Cache latents"
TRAIN = "Anima: Train"
LOAD = "Anima: Load trained LoRA"
EXTRA_TOML = "extra_toml"

# One clause per reference the trainer writes (anima_train.fixes.ref): the same fix, done in ComfyUI. "" where a
# node has no such option (the sentence around it reads without it). tests/test_fixes.py checks that every widget
# named here is an input of its node.
CLAUSES = {
    "run convert": f'run "{CONVERT}" on the three model files and give its model_path output to model_path',
    "run convert --tokenizers": f'set tokenizers on "{CONVERT}" (a folder holding tokenizer/ and t5_tokenizer/, or '
                                f"a Hugging Face repo id) and run it again",
    "run cache": f'run "{CACHE}" with dry_run off on this dataset, or set source = "encode" on "{TRAINING_CONFIG}"',
    "name cache": f'"{CACHE}"',
    "set dataset": f'set the dataset_path widget on "{TRAINING_CONFIG}" to the folder of your images',
    "run plan": "",
    "run evaluate": f'; compare the checkpoints by loading each with "{LOAD}"',
    "flag audit --resolution": f'set resolutions on "{AUDIT}" or connect a training config',
    "flag audit --model": f'set model_path on "{AUDIT}"',
    "flag convert --anima": "anima",  # on the Convert node, which shows the message: its widgets
    "flag convert --qwen": "qwen",
    "flag convert --vae": "vae",
    "flag convert --tokenizers": "tokenizers",
    "flag convert --out": "out_dir",
    "flag cache --resolution": f'set resolutions on "{CACHE}" or connect a training config',
    "flag cache --model": f'set model_path on "{CACHE}" to a converted repo (made by "{CONVERT}")',
    "name --resolution": "resolutions",  # the widget of the one flag Cache and Audit pass (named where refused)
    "run one process": {TRAIN: "set gpus to 1", "": f'set gpus to 1 on "{TRAIN}"'},
    "flag cache --allow-missing-captions": f', or turn on allow_missing_captions on "{CACHE}" to cache them anyway',
    "flag train --allow-missing-captions": "",
    "flag train --skip-unreadable": "",
    # the dataset's folder and tiers, said as the node that shows the message takes them (a dict: by that node)
    "name dataset": {TRAINING_CONFIG: "dataset_path", TRAIN: f"dataset_path ({TRAINING_CONFIG})",
                     CACHE: "dataset_dir", AUDIT: "dataset_dir", "": "the dataset folder"},
    "name resolution": {TRAINING_CONFIG: "resolution", TRAIN: f"resolution ({TRAINING_CONFIG})",
                        CACHE: "resolutions", AUDIT: "resolutions", "": "the resolution"},
}
# The widgets CLAUSES names, per node id: checked against the nodes' schemas.
WIDGETS_NAMED = {"AnimaTrainConvert": ["anima", "qwen", "vae", "tokenizers", "out_dir"],
                 "AnimaTrainAudit": ["resolutions", "model_path", "dataset_dir"],
                 "AnimaTrainCache": ["dry_run", "allow_missing_captions", "dataset_dir", "resolutions", "model_path"],
                 "AnimaTrainTrain": ["gpus"],
                 "AnimaTrainConfig": ["source", "model_path", "dataset_path", "resolution"]}


@functools.cache
def _key_pattern() -> re.Pattern:
    """`[table] key`, `[[table]] #N key` and `table.key` for every key of the schema (longest names first)."""
    tables = "|".join(re.escape(t) for t in sorted(TABLES, key=len, reverse=True))
    said = f"(?<!{EXTRA_TOML} )"  # said already (render is idempotent: a node's error passes it twice)
    return re.compile(rf"{said}\[\[({tables})\]\](?: #\d+)? (\w+)|{said}\[({tables})\] (\w+)"
                      rf"|(?<![\w.\[/\\])({tables})\.(\w+)")


@functools.cache
def _keys() -> dict[str, frozenset[str]]:
    """Every table's keys (not the tables inside it)."""
    return {name: frozenset(f.name for f in dataclasses.fields(cls) if is_key(f)) for name, cls in TABLES.items()}


@functools.cache
def _widgets() -> dict[str, str]:
    """dotted config key -> the Training config widget that sets it."""
    # lazy: training_config imports ComfyUI's API (nodes/comfy.py), which the fix texts need nowhere else; its Knobs
    # are the one map of keys to widgets
    from .training_config import ALL_KNOBS
    return {k.key: k.widget for k in ALL_KNOBS}


def _key(match: re.Match, here: str, extra: Collection[str]) -> str:
    array = match.group(1) is not None
    table, name = next((match.group(i), match.group(i + 1)) for i in (1, 3, 5) if match.group(i) is not None)
    if name not in _keys().get(table, ()):
        return match.group(0)  # not a key of that table ("[dataset] no training data", "[train] unknown key")
    widget = None if array or f"{table}.{name}" in extra else _widgets().get(f"{table}.{name}")
    said = widget or f"{EXTRA_TOML} {match.group(0) if not match.group(5) else f'[{table}] {name}'}"
    # on another node: whose widget ("learning_rate (Anima: Training config) = 0.0: must be > 0.0")
    return said if here == TRAINING_CONFIG else f"{said} ({TRAINING_CONFIG})"


def _clause(what: str, here: str) -> str:
    """The words of the reference `what` on the node `here` (the reference's own name where none are known)."""
    clause = CLAUSES.get(what, what)
    return clause.get(here, clause[""]) if isinstance(clause, dict) else clause


def extra_keys(extra_toml: str | None) -> set[str]:
    """The dotted keys an extra_toml text sets: they win over their widgets, so a fix names them there."""
    try:
        tree = tomllib.loads(extra_toml or "")
    except ValueError:
        return set()

    def walk(table: dict, prefix: str) -> Iterator[str]:
        for name, value in table.items():
            yield f"{prefix}{name}"
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{name}.")

    return set(walk(tree, ""))


def render(text: str, here: str | None = None, extra: Collection[str] = (), short: bool = True) -> str:
    """`text` for a ComfyUI user: its references as widgets and nodes (`here`: the node that shows it, whose name
    goes without saying; `extra`: the dotted keys extra_toml sets, which win over their widgets), its first line
    at most FIRST_LINE characters (unless not `short`)."""
    text = TOKEN.sub(lambda m: _clause(m.group(1), here or ""), text)
    text = _key_pattern().sub(lambda m: _key(m, here or "", extra), text)
    return short_first_line(text) if short else text


def said(event: dict, here: str = TRAIN) -> dict:
    """A worker event whose texts (an error's message, a message's or warning's text) the page shows, rendered."""
    return {k: render(v, here, short=False) if k in ("message", "text") and isinstance(v, str) else v
            for k, v in event.items()}


def short_first_line(text: str, width: int = FIRST_LINE) -> str:
    """A first line over `width` characters ends at its last clause break (": ", "; ", ". ", ", ") within `width`,
    else at a space; the rest of it becomes the second line."""
    first, _, rest = text.partition("\n")
    if len(first) <= width:
        return text
    breaks, spaces, quoted = [], [], False  # a break outside quotes: "Anima: Cache latents" is one name
    for i, ch in enumerate(first[:width + 1]):
        if ch == '"':
            quoted = not quoted
        elif ch == " " and not quoted and i > 0:
            (breaks if first[i - 1] in ":;.," and i > width // 3 else spaces).append(i - 1)
    cut = max(breaks or spaces or [-1])
    if cut <= 0:
        return text
    head, tail = first[:cut + 1].rstrip(), first[cut + 1:].strip()
    return "\n".join([head, tail] + ([rest] if rest else [])) if tail else text


OUR_PACKAGES = ("anima_train", "anchor", "nodes")
SHOWN_TYPE = "Anima trainer"


@functools.cache
def _in_words(cls: type) -> type:
    return type(cls.__name__, (cls,), {"__module__": "builtins", "__qualname__": SHOWN_TYPE, "__doc__": cls.__doc__})


def named_in_words(cls: type) -> type:
    """The class a node raises our own error as: a subclass of it (every `except` and isinstance still holds) that
    ComfyUI names "Anima trainer" beside the message. ComfyUI shows an exception's type as module + "." + qualified
    name (the module left out for builtins), which for our errors was a python path
    (`anima_train.model.components.ModelRepoError`); other libraries' errors keep their names."""
    if cls.__module__ == "builtins" or cls.__module__.split(".")[0] not in OUR_PACKAGES:
        return cls
    return _in_words(cls)


def shown_on(node: str) -> Callable:
    """Decorator of a node's method: the library it calls writes references (anima_train.fixes.writing_refs), and
    the error it raises says them as `render` does (the same exception, its text changed: ComfyUI shows str())."""

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def shown(*args, **kwargs):
            with writing_refs():
                try:
                    return method(*args, **kwargs)
                except Exception as exc:
                    if exc.args and str(exc) == exc.args[0]:  # a message (not an errno's, not a KeyError's repr)
                        exc.args = (render(exc.args[0], node), *exc.args[1:])
                    if named_in_words(type(exc)) is not type(exc):  # a static (builtin) class cannot be reassigned
                        exc.__class__ = named_in_words(type(exc))
                    raise

        return shown

    return wrap
