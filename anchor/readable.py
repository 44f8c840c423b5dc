"""Reading a file the user named: one policy for what can be wrong with it, each case with its own fix.

    missing     "no such file"                 check the path
    a folder    "is a folder, not <what>"      give the file itself
    unreadable  "your account may not read it" give it read permission, or copy it
    damaged     "damaged <what> (<cause>)"     the reader's own fix: re-download, re-export, re-save

Every reader of user files (anchors, captions, model files, states) asks `why_unreadable` before it parses, and says
`damaged` when parsing fails, so one kind of problem gets one kind of message whatever the file. Standard library
only: `anchor` stands alone, and the trainer (`anima_train.files`) re-exports these.
"""

from __future__ import annotations

import errno
import os


def why_unreadable(path: str | os.PathLike, what: str, missing_fix: str = "check the path") -> str | None:
    """Why `path` cannot be opened as `what` ("an anchor file", "a caption file"), said with its fix; None if it can.
    Opens it to find out, so a permission or a folder is told apart from a missing file on every platform."""
    path = os.fspath(path)
    if os.path.isdir(path):  # before open: Windows reports a folder as "permission denied"
        return f"{path} is a folder, not {what}; give the file itself"
    try:
        with open(path, "rb"):
            return None
    except FileNotFoundError:
        return f"{path}: no such file; {missing_fix}"
    except PermissionError:
        return (f"{path}: your account may not read this file (permission denied); give it read permission "
                "(chmod u+r, or the file's Security tab on Windows), or copy the file somewhere you own")
    except OSError as exc:
        if exc.errno == errno.ENOTDIR:
            return f"{path}: a part of the path is a file, not a folder; {missing_fix}"
        return f"{path}: {what} that cannot be read ({exc.strerror or exc}); check the disk or copy the file again"


def damaged(path: str | os.PathLike, what: str, cause: str, fix: str) -> str:
    """A file that opens but does not parse as `what`: its cause (short) and the reader's fix."""
    return f"{os.fspath(path)}: damaged {what} ({cause}); {fix}"
