"""Errors a user can fix, in one place.

Raise `UserError` (or a subclass) for every problem that comes from the user's input or machine rather than from a
bug: a config key, a missing file or folder, a dataset without captions, a stale cache, an unusable `resume_from`, a
run folder in use, a full disk. Its message is all the user sees, so it names the file/key and the fix in plain
words. `anima-train` (cli.main) prints it as

    anima-train COMMAND: error: <message>

on stderr and exits 2, with no traceback; anything else that escapes a command is an internal error (exit 1, with a
hint to re-run with `--debug` or ANIMA_TRAIN_DEBUG=1 for the traceback). Under accelerate/torchrun only the main
process prints a user error (every process hits the same one; the launcher's own report follows).

The library's own error types are UserErrors: config.ConfigError, data.errors.DatasetError, buckets.BucketError,
checkpoints.ResumeError, checkpoints.SaveError, captions.CaptionError, runs.RunRefused, models.ModelRepoError,
convert.ConvertError. New checks should raise one of those, or
UserError itself (or a new subclass of it) when none fits.

No imports beyond the standard library and anima_train.fixes (how a fix names a flag or a command; standard
library only): the config package (no torch) and the CLI's start-up import this module.
"""

from __future__ import annotations

import errno
import os
import re
import sys

from anima_train import fixes

# exit statuses of every command (the README's table is tested against these; 3 = parent_watch.EXIT_PARENT_GONE)
INTERNAL_ERROR_EXIT = 1  # a bug in anima-train
USER_ERROR_EXIT = 2  # bad input: a config key, a path, a flag, a damaged file
DATA_VERDICT_EXIT = 4  # the command ran and judged the data: `cache` found images it cannot decode, `audit` NOT SAFE
DIVERGED_EXIT = 5  # training stopped because the loss or the gradient norm became non-finite (training/divergence.py)
INTERRUPTED_EXIT = 130  # Ctrl-C (SIGINT), or SIGTERM (timeout, Slurm, a service manager): one interrupt policy
DEBUG_ENV = "ANIMA_TRAIN_DEBUG"
QUIET_RANK_GRACE_S = 10.0  # how long a non-main rank waits for the main one to report a user error

# OSErrors that describe the user's machine or the paths given, not a bug: each with its fix. The writers name the
# file they were writing (anchor/atomic.py: also a full disk met inside safetensors, and no temp files left).
_FREE_SPACE = "free some space (or give a path on another disk) and run again"
_ENVIRONMENT_FIXES = {
    errno.ENOSPC: _FREE_SPACE, errno.EDQUOT: _FREE_SPACE,
    errno.EFBIG: "the file is larger than this disk or account allows: give a path on another disk",
    errno.EACCES: "give a path your account may write (or read), or change its permissions",
    errno.EPERM: "give a path your account may write (or read), or change its permissions",
    errno.EROFS: "the disk is read-only: give a path on a writable one",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n) or close other programs",
    errno.ENFILE: "too many open files: raise the limit (ulimit -n) or close other programs",
    errno.ENOTDIR: "this path, or a folder on it, is a file: give a path of folders",
    errno.EISDIR: "this is a folder: give a file path",
    errno.EEXIST: "it already exists: give a new name, or move it away first",
    errno.ENOTEMPTY: "it already exists and is not empty: give a new name, or move it away first",
    errno.ENAMETOOLONG: "give a shorter path",
}


class UserError(Exception):
    """A problem the user can fix. The message names the file/key and the fix; it is shown without a traceback."""

    exit_code = USER_ERROR_EXIT


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM, with what the command had done by then (`detail`: the newest saved state and the line that
    resumes it). SIGINT raises a plain KeyboardInterrupt; cli.main turns SIGTERM into this, so both unwind alike
    (a run set aside by --overwrite is put back, the run-folder lock released) at every phase of every command."""

    def __init__(self, how: str = "interrupted", detail: str = ""):
        super().__init__(how)
        self.how, self.detail = how, detail


def interrupted_message(exc: BaseException) -> str:
    """The one line an interrupt prints: how, then what was kept and how to go on."""
    how = getattr(exc, "how", "interrupted")
    detail = getattr(exc, "detail", "")
    return f"{how}; {detail}" if detail else how


def exit_code(exc: BaseException) -> int:
    """The exit status for an error that user_message describes: its class's own code (a diverged run: 5), else 2."""
    code = getattr(exc, "exit_code", USER_ERROR_EXIT)
    return code if isinstance(code, int) and not isinstance(code, bool) else USER_ERROR_EXIT


def user_message(exc: BaseException) -> str | None:
    """The message to show for a user error, or None when `exc` is not one (an internal error: a bug)."""
    if isinstance(exc, UserError):
        return _without_worker_traceback(exc)
    if isinstance(exc, KeyboardInterrupt):
        return interrupted_message(exc)
    anchor = sys.modules.get("anchor")  # a separate package that does not import anima_train
    if anchor is not None and isinstance(exc, getattr(anchor, "AnchorError", ())):
        return _without_worker_traceback(exc)
    if _is_out_of_memory(exc):
        return out_of_memory_message(str(exc))
    if isinstance(exc, OSError) and exc.errno in _ENVIRONMENT_FIXES:
        # a rename names its source and its target: the target is the path the user gave (or will give)
        named = exc.filename2 if exc.errno in (errno.EEXIST, errno.ENOTEMPTY) and exc.filename2 else exc.filename
        where = f"{named}: " if named else ""
        return f"{where}{exc.strerror or os.strerror(exc.errno)}; {_ENVIRONMENT_FIXES[exc.errno]}"
    return None


def _is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA out-of-memory error: the run does not fit the card (or what it is allowed of it). torch is only looked
    up if already loaded (this module imports no torch)."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    return oom is not None and isinstance(exc, oom)


def out_of_memory_message(torch_text: str) -> str:
    """What to do when a step does not fit the GPU (it is not a bug: the config asks more than the card has). Keeps
    torch's numbers (what it tried to allocate, what the process held, its cap) and drops its allocator advice."""
    found = [m.group(0) for m in (re.search(r"Tried to allocate [\d.]+ \w+", torch_text),
                                 re.search(r"this process has [\d.]+ \w+ memory in use", torch_text),
                                 re.search(r"[\d.]+ \w+ allowed", torch_text)) if m]
    numbers = f" ({'; '.join(found)})" if found else ""
    return (f"the GPU ran out of memory{numbers}. "
            + fixes.ref("run plan", "`anima-train plan CONFIG --vram GiB` shows what fits a card of that size. ")
            + "Lower [train] batch_size or [dataset] resolution, or set [train] checkpoint_blocks = \"all\"; "
            "for an adapter keep some blocks' frozen weights in host memory ([train] swap_blocks = N: the plan names "
            "N); for a full finetune drop the fp32 copies ([optimizer] use_kahan = true), or keep the optimizer state "
            "in 8 bits as well (kind = \"adamw8bit\", quantize_state = true, use_kahan = true); close other programs "
            "that use the GPU")


def _without_worker_traceback(exc: BaseException) -> str:
    """A user error raised in a DataLoader worker comes back re-raised with the worker's traceback in its message
    ("Caught X in DataLoader worker process 0. Original Traceback ... pkg.X: message"): keep the message."""
    text = str(exc)
    if "Original Traceback (most recent call last):" not in text:
        return text
    name = f"{type(exc).__module__}.{type(exc).__qualname__}: "
    at = text.rfind(name)
    return text[at + len(name):].strip() if at >= 0 else text


def debug_requested() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def is_main_process() -> bool:
    """False on the non-zero ranks of a torchrun/accelerate launch (they exit quietly; rank 0 speaks)."""
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    try:
        return int(rank) == 0
    except ValueError:
        return True
