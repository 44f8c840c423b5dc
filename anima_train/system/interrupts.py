"""One interrupt policy for a whole command: Ctrl-C, SIGTERM and Windows' Ctrl+Break unwind alike.

    with interrupts.policy() as received:     # cli.main, around importing a command, its arguments and its run
        ...                                   # KeyboardInterrupt (errors.Interrupted) wherever the signal lands
    received.how                              # how it was interrupted ("" if it was not), after a library
                                              # swallowed the interrupt and failed with an error of its own

SIGTERM (`timeout`, Slurm, a service manager, the ComfyUI worker's end) and Ctrl+Break (the Train node's Cancel on
Windows) would kill the process where it stands: no `finally`, so no run put back after --overwrite, no lock
released, temp files left. Under the policy each is raised as Ctrl-C is, and the command says it in one line with
exit 130. Two places cannot take an exception, and an interrupt that lands in them is raised later instead of lost:

* an import: torch's runs C++ that calls back into Python through pybind11, which cannot pass an exception on and
  aborts the process ("terminate called after throwing an instance of 'pybind11::error_already_set'"); a module cut
  off mid-import breaks the unwinding anyway. The interrupt is raised the moment the outermost import returns, in
  the code that imported (_raise_when_back_in). A second interrupt meanwhile is raised at once: an import that
  hangs must not keep a command from stopping;
* a finalizer: an exception cannot leave it (Python prints "Exception ignored in ..." and goes on), so the command
  ran on to its end, its finalizer cut short. An interrupt that arrives in a `__del__` waits for it to end, as for
  an import, and is raised in the code the `__del__` interrupted, at its next line; one that ends in any other
  finalizer (a weakref callback, `weakref.finalize`) reaches the policy's `sys.unraisablehook`, which sends the
  signal again from another thread, and lands a moment later.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator

from anima_train import errors

# The signals of the policy, and how each is said. SIGBREAK is Windows' SIGTERM: Ctrl+Break, and the
# CTRL_BREAK_EVENT the Train node's Cancel sends its worker (nodes/worker.py).
SAID = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated (SIGTERM)"}
if hasattr(signal, "SIGBREAK"):
    SAID[signal.SIGBREAK] = "terminated (Ctrl+Break)"

IMPORT_RETRY_S = 0.05


class Received:
    """How the command was interrupted, if it was (the last signal raised), and the signals in flight."""

    def __init__(self):
        self.signum: int | None = None  # the last signal raised
        self.waiting = False  # an interrupt waits for an import or a __del__ to end
        self.watched = None  # ... in the frame that is traced for it (_raise_when_back_in)
        self.resent = 0  # the policy's own re-sends not yet arrived (told from the user's by this count)

    @property
    def how(self) -> str:
        return "" if self.signum is None else SAID.get(self.signum, "interrupted")


_received: Received | None = None  # the policy in force, on the main thread


@contextlib.contextmanager
def policy() -> Iterator[Received]:
    """The policy for the block's duration, then the handlers and hook it replaced. Off the main thread (an
    in-process caller's worker) nothing is installed: only the main thread gets signals."""
    global _received
    received = Received()
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    kept = {sig: signal.getsignal(sig) for sig in SAID}
    kept = {sig: handler for sig, handler in kept.items() if handler is not signal.SIG_IGN}  # nohup, `cmd &`: theirs
    outer, hook = _received, sys.unraisablehook
    _received = received
    for sig in kept:
        signal.signal(sig, _raise_interrupted)
    sys.unraisablehook = _unraisable(hook)
    try:
        yield received
    finally:
        _stop_watching(received)
        for sig, handler in kept.items():
            signal.signal(sig, handler)
        sys.unraisablehook = hook
        _received = outer


def _raise_interrupted(signum, frame):
    received = _received
    if received is None:  # a re-send that arrived after the policy ended: the command is over
        return
    resent = received.resent > 0
    if resent:
        received.resent -= 1
    outermost = _outermost_that_cannot_raise(frame)
    if outermost is not None and (resent or not received.waiting):
        received.waiting = True
        if received.watched is None:
            _raise_when_back_in(outermost.f_back, received, signum)
        return
    _interrupted(received, signum)


def _interrupted(received: Received, signum: int):
    """Raise the interrupt here, the trace that waited for this moment (if any) taken off."""
    _stop_watching(received)
    received.waiting = False
    received.signum = signum
    raise errors.Interrupted(received.how)


def _raise_when_back_in(caller, received: Received, signum: int) -> None:
    """Raise the interrupt in `caller`, the frame below the outermost import or finalizer, as soon as it runs its
    next line or returns: right after `import torch` (the module imported) or the `__del__`. A trace function on
    that one frame sees the moment and may raise into it (as a debugger's quit does); the global one, needed for
    any frame to be traced, is `getattr`, a C function that answers None for every new frame (`getattr(frame,
    "call", None)`: frames have no attribute "call"), so while an interrupt waits the other frames run only the
    tracing mode's overhead, and nothing otherwise. Under a tracer of the user's (a debugger, coverage), which this
    would replace, the signal is sent again every 50 ms instead, until it lands outside."""
    if sys.gettrace() is not None or caller is None:
        _resend_later(received, signum, IMPORT_RETRY_S)
        return

    def trace(frame, event, arg):
        if event in ("line", "return"):
            _interrupted(received, signum)
        return trace

    received.watched = caller
    caller.f_trace_lines = True
    caller.f_trace = trace
    sys.settrace(getattr)


def _stop_watching(received: Received) -> None:
    if received.watched is not None:
        received.watched.f_trace, received.watched = None, None
        sys.settrace(None)


def _unraisable(hook):
    def unraisable(info):
        received = _received
        if received is None or received.signum is None or not isinstance(info.exc_value, KeyboardInterrupt):
            return hook(info)
        _resend_later(received, received.signum, 0.0)  # from another thread: this hook cannot raise either
        return None

    return unraisable


def _resend_later(received: Received, signum: int, delay: float) -> None:
    retry = threading.Timer(delay, _resend, (received, signum))
    retry.daemon = True  # a command that ends first is not kept waiting for it
    retry.start()


def _resend(received: Received, signum: int) -> None:
    """The signal again, to the main thread: a wait there (sleep, a lock, a pipe) ends for it as for the first."""
    if received is not _received:  # the command ended meanwhile
        return
    received.resent += 1
    if hasattr(signal, "pthread_kill"):
        signal.pthread_kill(threading.main_thread().ident, signum)
    else:  # Windows: Python's waits there end on its Ctrl-C event, which the handler sets in any thread
        signal.raise_signal(signum)


def _outermost_that_cannot_raise(frame):
    """The frame nearest the bottom of the stack from `frame` down that is an import (Python's import machinery), a
    `__del__`, or this module's hook for what finalizers could not raise; None when there is none."""
    found = None
    while frame is not None:
        code = frame.f_code
        if (code.co_filename.startswith("<frozen importlib._bootstrap") or code.co_name == "__del__"
                or code.co_filename == __file__ and code.co_name == "unraisable"):
            found = frame
        frame = frame.f_back
    return found
