"""What only Windows needs: refusing several processes, and saving when the console window is closed.

Several GPUs: accelerate picks NCCL for CUDA, which does not exist on Windows; torchrun's TCP store wants libuv,
which Windows builds of torch lack; the gloo fallback fails for users. No tested path exists, so `gpus > 1` is refused
on the Train node before any worker or run folder exists, and `anima-train train` under a launcher (WORLD_SIZE > 1)
before accelerate starts.

The console: closing the window (or logging off, or shutting down) sends CTRL_CLOSE_EVENT (CTRL_LOGOFF_EVENT,
CTRL_SHUTDOWN_EVENT) to every process attached to it, the worker included. Python's `signal` module does not expose
these; without a handler the process is simply terminated. `install_console_handler()` registers one through
SetConsoleCtrlHandler (ctypes): it asks the training loop to stop like a stop file does (save the checkpoint and,
unless save_state_on_stop = false, the resumable state at the end of the current step) and blocks until training has
returned, because Windows ends the process as soon as the handler returns, or when its own timeout runs out (about
5 s for a closed window, 20 s at logoff/shutdown): a save that needs longer is cut off there.
"""

from __future__ import annotations

import os
import sys
import threading
import ctypes

from anima_train import errors

CTRL_CLOSE_EVENT, CTRL_LOGOFF_EVENT, CTRL_SHUTDOWN_EVENT = 2, 5, 6
CLOSE_EVENTS = (CTRL_CLOSE_EVENT, CTRL_LOGOFF_EVENT, CTRL_SHUTDOWN_EVENT)
EVENT_NAMES = {CTRL_CLOSE_EVENT: "the console window was closed", CTRL_LOGOFF_EVENT: "the user is logging off",
               CTRL_SHUTDOWN_EVENT: "Windows is shutting down"}
HANDLER_WAIT_S = 60.0  # longer than Windows allows: the wait ends when training returns or Windows ends the process

MULTI_GPU_REFUSAL = ("{n} processes on Windows: multi-GPU training needs NCCL, which exists on Linux only (torchrun's "
                     "store also wants libuv, which Windows builds of torch lack), and no other path is tested; "
                     "train on one GPU (gpus = 1), or on Linux for several")

_requested = threading.Event()  # a close event arrived: the loop stops at the end of its step
_finished = threading.Event()  # training returned (saved, or ended): the handler may let Windows end the process
_reason: list[str] = []
_installed: list = []  # the registered ctypes callback: kept alive for the life of the process


def on_windows() -> bool:
    return sys.platform == "win32"


def refuse_multi_gpu(processes: int) -> None:
    """Several processes on Windows: a UserError with the reason, before anything starts."""
    if processes > 1 and on_windows():
        raise errors.UserError(MULTI_GPU_REFUSAL.format(n=processes))


def launcher_processes() -> int:
    """How many processes the launcher (accelerate launch, torchrun) started: WORLD_SIZE, 1 without one."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def close_requested() -> bool:
    """True once the console was closed (or the user logs off, or Windows shuts down): the loop's stop condition."""
    return _requested.is_set()


def close_reason() -> str:
    return _reason[0] if _reason else "the console is closing"


def on_console_event(event: int) -> bool:
    """The console control handler. A close, logoff or shutdown event asks the training loop to stop and save, then
    waits until training has returned (Windows ends the process when this returns). Other events (Ctrl+C, the
    Ctrl+Break the node's Cancel sends) return False: the next handler, the C runtime's, raises SIGINT or SIGBREAK,
    which the command's interrupt policy turns into its unwinding (anima_train/system/interrupts.py)."""
    if event not in CLOSE_EVENTS:
        return False
    if not _reason:
        _reason.append(EVENT_NAMES[event])
    _requested.set()
    try:
        print(f"anima-train: {EVENT_NAMES[event]}: saving at the end of this step, then exiting", file=sys.stderr,
              flush=True)
    except (OSError, ValueError):
        pass
    _finished.wait(HANDLER_WAIT_S)
    return True


def training_finished() -> None:
    """Training returned (or failed): a waiting console handler may now let Windows end the process."""
    _finished.set()


def install_console_handler() -> bool:
    """Register on_console_event with SetConsoleCtrlHandler (Windows; once per process). Returns whether a handler is
    in place, i.e. whether the loop must watch close_requested()."""
    if _installed:
        return True
    if not on_windows():
        return False
    try:
        # lazy: Windows-only types: the function runs on Windows only
        from ctypes import wintypes

        handler_type = ctypes.WINFUNCTYPE(wintypes.BOOL, wintypes.DWORD)
        callback = handler_type(lambda event: bool(on_console_event(int(event))))
        if not ctypes.windll.kernel32.SetConsoleCtrlHandler(callback, True):
            return False
    except (AttributeError, OSError, ImportError):  # no console API here: nothing to install
        return False
    _installed.append(callback)
    return True
