"""End a worker when the program that started it (ComfyUI) ends, saving first when the training loop can.

A worker spawned by the ComfyUI node gets `ANIMA_TRAIN_PARENT_PID` (nodes/worker.py); `python -m anima_train`
starts the watch before anything heavy is imported. A shell-started `anima-train` has no such variable and is never
watched (`nohup anima-train train …` must survive its terminal).

When the parent is gone — noticed at once on Linux (PR_SET_PDEATHSIG delivers a signal that wakes the watch thread),
within POLL_S elsewhere (the thread polls the parent pid and our own parent pid; on Windows a handle to the parent
opened at start, since Windows re-uses a dead process's pid at once and a pid check would then see a stranger alive)
— the watch thread:

* points stdout at the null device: it was a pipe to the dead parent, and the next progress write would otherwise
  end the process with BrokenPipeError before anything is saved;
* inside the training loop (`save_before_exit()` was called): sets the flag the loop checks after every optimizer
  step (`parent_gone()`), so the loop saves its checkpoint (and state, when the config keeps it) like a stop-file
  stop and returns; the process is ended anyway after SAVE_GRACE_S;
* otherwise (importing, loading the model, scanning data — nothing to save yet): ends the process at once.

Every line it prints goes to stderr, which the node points at the run's worker log.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
import ctypes

from anima_train.system.proc import proc_stat

PARENT_PID_ENV = "ANIMA_TRAIN_PARENT_PID"
POLL_S = 0.5
SAVE_GRACE_S = 60.0  # time for the loop to finish its step and save (the node's Cancel grace with state is 60 s)
EXIT_PARENT_GONE = 3
IS_WINDOWS = os.name == "nt"
_SYNCHRONIZE = 0x00100000
_PROCESS_QUERY_LIMITED_INFORMATION = 0x1000
_WAIT_TIMEOUT = 0x102
_PR_SET_PDEATHSIG = 1
_DEATH_SIGNAL = getattr(signal, "SIGUSR1", None)

_gone = threading.Event()  # the parent is gone: the loop stops at its next step
_saving = threading.Event()  # the training loop will see _gone and save before exiting
_watch: "Watch | None" = None


def parent_gone() -> bool:
    """True once the watched parent process has ended (the training loop's stop condition)."""
    return _gone.is_set()


def save_before_exit() -> bool:
    """Called by the training loop before it starts: from now on a dead parent means "save, then exit" instead of
    "exit now". Returns whether a parent is watched at all (the loop then checks `parent_gone()` every step)."""
    if _watch is None:
        return False
    _saving.set()
    return True


def _kernel32():
    return ctypes.windll.kernel32


class _WindowsProcess:
    """Windows: a handle to a process, opened once. While it is open the process object, and so its pid, stays
    reserved; the handle is signalled when the process ends (WaitForSingleObject with timeout 0 is the test)."""

    def __init__(self, pid: int):
        self.handle = _kernel32().OpenProcess(_SYNCHRONIZE | _PROCESS_QUERY_LIMITED_INFORMATION, False, pid)

    def alive(self) -> bool:
        # no handle: the parent had ended before we looked (or is not ours to see): gone
        return bool(self.handle) and _kernel32().WaitForSingleObject(self.handle, 0) == _WAIT_TIMEOUT

    def close(self) -> None:
        if self.handle:
            _kernel32().CloseHandle(self.handle)
            self.handle = None


def _pid_alive(pid: int) -> bool:
    if IS_WINDOWS:
        process = _WindowsProcess(pid)
        try:
            return process.alive()
        finally:
            process.close()
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = proc_stat(pid)  # a killed parent nobody has reaped yet is a zombie: gone for our purposes
    return stat is None or stat[0] != "Z"


def _set_death_signal() -> bool:
    """Linux: have the kernel signal us when our parent process ends (prctl PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux") or _DEATH_SIGNAL is None:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(_DEATH_SIGNAL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class Watch:
    def __init__(self, parent_pid: int, *, death_signal: bool = True):
        self.parent_pid = parent_pid
        self.ppid = os.getppid()  # our direct parent: the parent itself, or accelerate's launcher under DDP
        self.windows_parent = _WindowsProcess(parent_pid) if IS_WINDOWS else None
        self.death_signal = False
        self.wake_r = self.wake_w = None
        # signal handlers can only be installed from the main thread (where `python -m anima_train` starts this)
        if death_signal and _DEATH_SIGNAL is not None and threading.current_thread() is threading.main_thread():
            # The handler writes a byte to a pipe the watch thread waits on, and takes no lock: a dying ComfyUI sends
            # one death signal per thread it ends (the kernel re-parents us each time), and Python runs a handler
            # again when a signal arrives while it runs. A handler that set a threading.Event waited, so called, for
            # the lock its interrupted self held, and the worker hung for good (tests/test_parent_watch.py).
            self.wake_r, self.wake_w = os.pipe()
            os.set_blocking(self.wake_r, False)
            os.set_blocking(self.wake_w, False)
            signal.signal(_DEATH_SIGNAL, self._poke)
            self.death_signal = _set_death_signal()
        self.thread = threading.Thread(target=self._run, daemon=True, name="anima-train-parent-watch")

    def parent_alive(self) -> bool:
        # The death signal also fires when only the spawning *thread* of the parent ends: always re-check here.
        if self.windows_parent is not None:  # Windows keeps a child's parent pid when the parent ends
            return self.windows_parent.alive()
        return os.getppid() == self.ppid and _pid_alive(self.parent_pid)

    def _poke(self, *_) -> None:
        try:
            os.write(self.wake_w, b"\0")
        except OSError:  # the pipe is full: a wake-up is pending anyway
            pass

    def _wait(self) -> None:
        """Until a death signal arrives, or POLL_S."""
        if self.wake_r is None:
            time.sleep(POLL_S)
            return
        select.select([self.wake_r], [], [], POLL_S)
        try:
            os.read(self.wake_r, 4096)
        except OSError:  # nothing to read (BlockingIOError): woken by the timeout
            pass

    def _run(self) -> None:
        while self.parent_alive():
            self._wait()
        self._parent_ended()

    def _parent_ended(self) -> None:
        _silence_stdout()
        _gone.set()
        if _saving.is_set():
            _say(f"the parent process (pid {self.parent_pid}) ended: saving at the end of this step, then exiting")
            deadline = time.monotonic() + SAVE_GRACE_S
            while time.monotonic() < deadline:
                time.sleep(0.5)
            _say(f"the save did not finish within {SAVE_GRACE_S:.0f} s of the parent's end: exiting")
        else:
            _say(f"the parent process (pid {self.parent_pid}) ended before training started: exiting (nothing to "
                 f"save yet)")
        os._exit(EXIT_PARENT_GONE)


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno() if sys.__stdout__ is not None else 1)
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _say(text: str) -> None:
    try:
        print(f"anima-train: {text}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def start(parent_pid: int, *, death_signal: bool = True) -> Watch:
    """Watch `parent_pid` for the rest of this process (at most one watch per process)."""
    global _watch
    if _watch is None:
        _watch = Watch(parent_pid, death_signal=death_signal)
        _watch.thread.start()
    return _watch


def start_from_env() -> Watch | None:
    value = os.environ.get(PARENT_PID_ENV, "").strip()
    if not value:
        return None
    try:
        pid = int(value)
    except ValueError:
        _say(f"ignoring {PARENT_PID_ENV}={value!r}: not a process id")
        return None
    return start(pid)
