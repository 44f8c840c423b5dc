"""How a message names the thing the user changes, so that each front says the fix in its own terms.

A fix names a config key, a command's flag, or a command to run. A shell user changes `[optimizer] lr` in the TOML,
passes `--resolution`, runs `anima-train cache --config run.toml`; a ComfyUI user sets the widget learning_rate on
"Anima: Training config", the widget resolutions on "Anima: Audit dataset", runs "Anima: Cache latents". The trainer
writes each as a reference that every front renders:

* a config key as a config file spells it, `[table] key` or `[[table]] #N key` (keys.Where and the rules write
  them so): the schema says which (table, key) pairs exist, so that spelling is a reference already, and a front that
  names settings otherwise finds and renames them (ComfyUI: nodes/fixes.py, from the Training config's widgets);
* a flag or a command as `ref(what, cli_text)`: `what` says which ("flag cache --allow-missing-captions",
  "run convert"), `cli_text` is the whole clause a shell user reads. A shell (the default) gets `cli_text` as it is;
  a process whose messages another front shows gets the token ⟦what⟧ instead, which that front replaces with its own
  clause (nodes/fixes.py: a widget and a node, or nothing where a node has no such option).

Which one a process writes: tokens when REFS_ENV is "refs" (the ComfyUI worker sets it for the `python -m anima_train`
children it runs; it is no flag, so the CLI's help does not show it) or inside `with writing_refs():` (the node code
calling the library in ComfyUI's own process), else the shell's text. Standard library only: errors.py level.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import shlex
import shutil
import sys
from typing import Iterator

REFS_ENV = "ANIMA_TRAIN_FIXES"  # "refs": this process's messages are shown by another front (nodes/worker.py sets it)
OPEN, CLOSE = "\u27e6", "\u27e7"  # ⟦what⟧: a reference token, rendered by the front that shows the message
TOKEN = re.compile(f"{OPEN}([^{CLOSE}]*){CLOSE}")

_REFS: contextvars.ContextVar[bool | None] = contextvars.ContextVar("anima_train_fix_refs", default=None)


def writes_refs() -> bool:
    """True when messages written now are shown by another front (tokens), False in a shell."""
    here = _REFS.get()
    return here if here is not None else os.environ.get(REFS_ENV, "") == "refs"


@contextlib.contextmanager
def writing_refs() -> Iterator[None]:
    """Messages built inside carry tokens (for code of another front calling the library in its own process)."""
    reset = _REFS.set(True)
    try:
        yield
    finally:
        _REFS.reset(reset)


def ref(what: str, cli_text: str) -> str:
    """The clause that names a flag or a command: `cli_text` in a shell, the token ⟦what⟧ for another front.

    `what` is "<kind> <command> [<flag>]": "flag audit --resolution" (use this flag), "run cache" (run this
    command), "name cache" (the command as a name). It names what the user does, not the words: each front has one
    clause per `what` (nodes/fixes.py for ComfyUI)."""
    return f"{OPEN}{what}{CLOSE}" if writes_refs() else cli_text


def plain(text: str) -> str:
    """`text` with every token replaced by the name it carries (a front that has no clause of its own for one)."""
    return TOKEN.sub(lambda m: m.group(1), text)


def program() -> str:
    """How this process's user runs anima-train, as a shell prefix, so a command printed in a message (a fix to
    copy) works as printed: `anima-train` when that is on PATH, else the script or `python -m anima_train`."""
    argv0 = sys.argv[0] if sys.argv else ""
    name = os.path.basename(argv0)
    if name in ("anima-train", "anima-train.exe"):
        on_path = shutil.which("anima-train")
        if on_path and os.path.realpath(on_path) == os.path.realpath(argv0):
            return "anima-train"
        return shlex.quote(argv0)
    if name == "__main__.py" and os.path.basename(os.path.dirname(argv0)) == "anima_train":
        return f"{shlex.quote(sys.executable)} -m anima_train"
    return "anima-train"  # in-process callers (ComfyUI node code, tests): the documented command
