"""The training worker seen from ComfyUI: spawn `python -m anima_train ...`, relay its events, stop it (the
records that let the Train node reuse a result are in nodes/run_records.py).

No ComfyUI import here: everything ComfyUI-specific (interrupt check, progress bar, websocket send) is passed in as
a callable, so this file is unit-tested with plain Python stand-ins and a fake worker script.

    result = run_job(cmd, log_path=run_dir / LOG_NAME, on_event=relay, check_interrupt=comfy.throw_if_interrupted,
                     stop_file=run_dir / STOP_NAME, grace_s=30)
    raise_for_failure(result, "training")

Why a process and not a thread (docs/comfyui.md#why-a-process): an OOM or a crash in training must not take ComfyUI
down, Cancel must end the job for real, and the job must not hold ComfyUI's VRAM. The worker's stdout is the JSON
event stream (one object per line, anima_train/outputs/progress.py); its stderr goes to a log file (a PIPE nobody reads
deadlocks at ~64 KB) whose tail becomes the error message when the worker fails — a silent failure is the most
common complaint about training packs.

Cancel: ComfyUI's interrupt is an exception raised by `check_interrupt`, called at least every `poll_s` (a reader
thread feeds a queue read with a timeout, so a silent worker — model loading, a hang — cannot delay it). On the way
out the worker is asked to stop gracefully (the stop file: it saves a checkpoint, plus the optimizer state when the
config keeps it, and exits), then its whole process group (DataLoader workers, accelerate ranks) gets SIGTERM and,
after `term_wait_s`, SIGKILL. The worker runs in its own session (POSIX) / process group (Windows) for that.
On Windows the same three steps are: the stop file, CTRL_BREAK_EVENT to the worker's console process group, then
`taskkill /T /F` on its process tree and a sweep (psutil, which ComfyUI ships) for children whose parent already
ended, which `taskkill /T` can no longer reach.

ComfyUI portable's `python_embeded\\python.exe` is an embeddable Python: its `._pth` file makes it ignore PYTHONPATH
(and every other PYTHON* variable) and the current folder, so there the worker is started through a `-c` bootstrap
that puts the pack on sys.path itself, and with `-s`, which keeps the user's site-packages out (`anima_train_command`).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from anima_train.errors import DATA_VERDICT_EXIT, USER_ERROR_EXIT
from anima_train.fixes import REFS_ENV
from anima_train.system import third_party_noise
from anima_train.system.parent_watch import PARENT_PID_ENV
from anima_train.system.proc import group_has_live_member

LOG_NAME = "comfyui-worker.log"  # the worker's stderr, in the run dir
STOP_NAME = "comfyui-stop"  # .comfyui-stop-<job id>: created to ask one job's trainer to save and exit
POLL_S = 0.25  # interrupt-check cadence: at least every 0.5 s (docs/comfyui.md#progress-and-cancel-points)
TERM_WAIT_S = 5.0  # SIGTERM -> SIGKILL
IS_WINDOWS = os.name == "nt"
# The Windows constants, spelled out so the Windows branches also run (under test) where the module lacks them.
CREATE_NEW_PROCESS_GROUP = getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0x00000200)
CTRL_BREAK_EVENT = getattr(signal, "CTRL_BREAK_EVENT", 1)


class WorkerError(RuntimeError):
    """The worker failed; the message carries its own error text and the tail of its log.

    ComfyUI names a node's exception beside its message (the error's exception_type: module + "." + qualified name,
    the module left out for builtins), so this class is named in words there, not as a python path."""

    __module__ = "builtins"
    __qualname__ = "Anima trainer"


# ----------------------------------------------------------------------------------------------------------
# Command and environment


def pack_dir() -> Path:
    """The folder holding anima_train/ (this file is nodes/worker.py in it)."""
    return Path(__file__).resolve().parents[1]


def worker_env(extra_path: str | os.PathLike | None = None, base: dict | None = None) -> dict:
    """ComfyUI's environment plus: the pack on PYTHONPATH (ComfyUI does not install it), unbuffered output, this
    process's pid, which the worker watches to end (after saving, when it can) if ComfyUI ends, and the fix texts'
    front (its messages are shown on a node)."""
    env = dict(os.environ if base is None else base)
    env[PARENT_PID_ENV] = str(os.getpid())
    here = str(extra_path or pack_dir())
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in parts if p != here])
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHONIOENCODING", "utf-8")
    env[REFS_ENV] = "refs"  # its messages name flags and commands as references the node says (nodes/fixes.py)
    # ComfyUI sets the allocator under its old name: renamed here too, since accelerate's launcher (2+ GPUs)
    # imports torch before our CLI's own filter runs
    third_party_noise.rename_variables(env)
    without_comfy_allocator(env)
    return env


COMFY_ALLOCATOR = "backend:cudaMallocAsync"  # what ComfyUI adds to its own allocator setting (cuda_malloc.py)
ALLOC_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def without_comfy_allocator(env: dict) -> None:
    """The worker trains on torch's own caching allocator, as `anima-train train` from a shell does. ComfyUI adds
    cudaMallocAsync to its allocator setting at start-up (unless --disable-cuda-malloc) and every child inherits it:
    the trainer then keeps a user's setting as given, so the worker trained without expandable segments on an
    allocator whose counters its memory plan does not read the same way, and the same TOML ran 5 % slower with it
    (bench/results/node_vs_cli_2026-12-05). Only that item goes; the rest of a setting stays."""
    for name in ALLOC_VARIABLES:
        if name in env:
            kept = [item for item in env[name].split(",") if item.strip() and item.replace(" ", "") != COMFY_ALLOCATOR]
            if kept:
                env[name] = ",".join(kept)
            else:
                del env[name]


def job_stop_file(run_dir: str | os.PathLike) -> Path:
    """A stop file that belongs to one job: cancelling one run can never stop another (anima-train train
    --stop-file honours only the path it was given)."""
    return Path(run_dir) / f".{STOP_NAME}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ignores_environment(python: str | os.PathLike) -> bool:
    """Is `python` an embeddable Python (ComfyUI portable's python_embeded) that ignores PYTHONPATH, PYTHONIOENCODING
    and the current folder? CPython does so whenever a `._pth` file sits next to its executable or DLL."""
    try:
        return any(Path(python).parent.glob("*._pth"))
    except OSError:
        return False


def _bootstrap(pack: Path, module: str = "anima_train") -> str:
    """`python -c` code equivalent to `-m MODULE` that finds the pack without PYTHONPATH (sys.argv[0] becomes the
    module's file, as with -m)."""
    return (f"import runpy, sys; sys.path.insert(0, {str(pack)!r}); "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")


def anima_train_command(args: list[str], processes: int = 1, python: str | None = None,
                        module: str = "anima_train") -> list[str]:
    """`python -u -X utf8 -m anima_train ARGS`, or accelerate's launcher with one process per GPU for processes >= 2.

    ComfyUI's own python runs it (sys.executable), so the worker sees ComfyUI's torch. `python -m
    accelerate.commands.launch` is `accelerate launch` without relying on the script being on PATH. `-X utf8`: the
    event pipe and the log are UTF-8 even where PYTHONIOENCODING is ignored (embeddable Python), so a non-ASCII path
    in an event cannot end the worker with UnicodeEncodeError on a cp1252 console encoding. `-s` for an embedded
    Python (ComfyUI portable: its launchers and ComfyUI-Manager pass it too): without it the user's site-packages
    (%APPDATA%\\Python\\Python3XX) come before the portable's own and shadow them.
    """
    python = python or sys.executable
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    embedded = ignores_environment(python)
    flags = ["-u", "-X", "utf8"] + (["-s"] if embedded else [])
    if processes == 1:
        if embedded:
            return [python, *flags, "-c", _bootstrap(pack_dir(), module), *args]
        return [python, *flags, "-m", module, *args]
    return [python, *flags, "-m", "accelerate.commands.launch", "--num_processes", str(processes), "--multi_gpu",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), "-m", "anima_train", *args]


# ----------------------------------------------------------------------------------------------------------
# Process group handling


def spawn(cmd: list[str], *, log_path: str | os.PathLike, env: dict | None = None,
          cwd: str | os.PathLike | None = None) -> subprocess.Popen:
    """Start `cmd` in its own process group; stdout is a text pipe, stderr appends to `log_path`."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    args = [os.fspath(c) for c in cmd]
    log = _open_log(log_path, args)
    try:
        return _popen(args, stdin=subprocess.DEVNULL, stderr=log, env=env, cwd=cwd)
    finally:
        log.close()  # the child holds its own copy of the descriptor


def _open_log(log_path: Path, args: list[str]):
    """The worker log, opened for appending, with this run's header line written (log_tail reads from it)."""
    log = open(log_path, "ab")
    log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {command_line(args)}\n".encode())
    log.flush()
    return log


def _popen(args: list[str], *, stdin, stderr, env: dict | None, cwd) -> subprocess.Popen:
    """A worker process in its own process group, its stdout a text pipe read line by line."""
    kw = {"creationflags": CREATE_NEW_PROCESS_GROUP} if IS_WINDOWS else {"start_new_session": True}
    started = time.time()
    proc = subprocess.Popen(args, stdin=stdin, stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=cwd, text=True,
                            encoding="utf-8", errors="replace", bufsize=1, **kw)
    proc.anima_started = started  # what the Windows orphan sweep compares children's creation times with
    return proc


def command_line(args: list[str]) -> str:
    """`args` as the platform's shell would need it typed (the log's header line can be pasted to re-run it)."""
    if IS_WINDOWS:
        return subprocess.list2cmdline(args)

    return shlex.join(args)


def group_alive(pgid: int) -> bool:
    """Is any process of the group still running (POSIX)?"""
    if IS_WINDOWS:
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return group_has_live_member(pgid)  # killpg(0) succeeds while a member is a zombie


def kill_group(proc: subprocess.Popen, term_wait_s: float = TERM_WAIT_S) -> None:
    """SIGTERM the worker's whole process group, wait, then SIGKILL it (POSIX); the process tree on Windows.

    Also run after a normal exit: DataLoader workers or ranks left behind by a crashed leader are orphans."""
    if IS_WINDOWS:
        kill_tree_windows(proc, term_wait_s)
        return
    pgid = proc.pid  # start_new_session: the worker leads its own group
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + (term_wait_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            if proc.poll() is not None and not group_alive(pgid):
                break
            time.sleep(0.05)
        else:
            continue
        break
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        pass


def kill_tree_windows(proc: subprocess.Popen, term_wait_s: float = TERM_WAIT_S) -> None:
    """Windows: CTRL_BREAK_EVENT to the worker's process group (every console process in it ends, like SIGTERM),
    then `taskkill /T /F` on the tree that is left, then kill the worker's children that outlived it.

    CTRL_BREAK needs a console shared with ComfyUI (the portable build's console window); without one it raises
    OSError and the tree kill follows at once. `taskkill /T` walks the tree from a live leader only, so a child
    whose parent already ended (the normal exit of a crashed leader) is found by psutil: a process whose parent
    pid is the worker's and which started after it (a pid re-used by an older process does not match)."""
    if proc.poll() is None:
        try:
            proc.send_signal(CTRL_BREAK_EVENT)
            proc.wait(term_wait_s)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is None:
        try:
            subprocess.run(["taskkill", "/T", "/F", "/PID", str(proc.pid)], capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            pass
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
    started = getattr(proc, "anima_started", None)  # set by spawn(); without it no child can be told from a stranger
    for child in _orphans(proc.pid, started) if started is not None else ():
        try:
            child.kill()
        except Exception:  # noqa: BLE001 (gone meanwhile, or not ours to end: nothing more to do)
            pass


def _orphans(pid: int, started: float) -> list:
    """The live descendants of the (ended) process `pid`, found by parent pid (psutil); [] without psutil."""
    try:
        import psutil  # lazy: optional (not in requirements.txt): without it, no orphan search
    except ImportError:
        return []
    children: dict[int, list] = {}
    try:
        for p in psutil.process_iter(["ppid", "create_time"]):
            children.setdefault(p.info["ppid"], []).append(p)
    except Exception:  # noqa: BLE001 (psutil.Error and access errors: sweep nothing rather than fail the cleanup)
        return []
    found, todo = [], [pid]
    while todo:
        for p in children.get(todo.pop(), []):
            if (p.info["create_time"] or 0.0) + 1.0 >= started and p.pid != os.getpid() and p not in found:
                found.append(p)
                todo.append(p.pid)
    return found


# ----------------------------------------------------------------------------------------------------------
# The standby worker: the next job's process, started ahead with its imports done (anima_train/standby.py)

STANDBY_MODULE = "anima_train.standby"
STANDBY_ENV = "ANIMA_TRAIN_STANDBY"  # "0" in ComfyUI's environment: no waiting worker (it holds host memory)
_standby: dict = {}  # "proc", "env": the one waiting worker of this ComfyUI, and the environment it was started with
_standby_lock = threading.Lock()


def start_standby(env: dict | None = None) -> bool:
    """Start the worker the next job of this environment runs in (run_job(standby=True)), or keep the one of this
    environment waiting; whether one waits now. Its stderr until a job arrives is dropped: an import failing there
    fails again in the job, which reports it."""
    if os.environ.get(STANDBY_ENV) == "0":
        return False
    env = dict(os.environ if env is None else env)
    with _standby_lock:
        proc = _standby.get("proc")
        if proc is not None and proc.poll() is None and _standby.get("env") == env:
            return True
        _standby.clear()
    if proc is not None:
        _end(proc)
    # ComfyUI's folder as its current one (one of its own is held against deletion on Windows); -P: not on sys.path
    args = anima_train_command([], module=STANDBY_MODULE)
    try:
        proc = _popen([args[0], "-P", *args[1:]], stdin=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=None)
    except OSError:
        return False  # no standby: the next job starts its own process, as without one
    with _standby_lock:
        _standby.update(proc=proc, env=env)
    return True


def stop_standby() -> None:
    """End the waiting worker, if any (at ComfyUI's exit; end of input tells it to exit, a kill makes sure)."""
    with _standby_lock:
        proc = _standby.pop("proc", None)
        _standby.clear()
    if proc is not None:
        _end(proc)


def _end(proc: subprocess.Popen) -> None:
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
    kill_group(proc, term_wait_s=1.0)


atexit.register(stop_standby)


def _standby_args(cmd: list[str]) -> list[str] | None:
    """The arguments a waiting worker is given to run `cmd`: those after a one-process `anima_train_command`'s
    prefix; None for any other command (a waiting worker cannot run it)."""
    prefix, args = anima_train_command([]), [os.fspath(c) for c in cmd]
    return args[len(prefix):] if args[:len(prefix)] == prefix else None


def _take_standby(cmd: list[str], argv: list[str], *, log_path: Path, env: dict | None,
                  cwd) -> subprocess.Popen | None:
    """The waiting worker, given `cmd`'s job (`argv`: _standby_args), when it was started with the job's
    environment; else None (a waiting worker of another environment, or a dead one, is ended)."""
    with _standby_lock:
        proc, standby_env = _standby.pop("proc", None), _standby.get("env")
        _standby.clear()
    if proc is None:
        return None
    if standby_env != dict(os.environ if env is None else env) or proc.poll() is not None:
        _end(proc)
        return None
    _open_log(log_path, [os.fspath(c) for c in cmd]).close()  # the same header line a started worker's log gets
    job = {"argv": argv, "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
           "log": os.fspath(log_path)}
    try:
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.close()
    except (OSError, ValueError):  # it ended meanwhile
        _end(proc)
        return None
    return proc


# ----------------------------------------------------------------------------------------------------------
# Reading the worker


def parse_event(line: str) -> dict | None:
    """A worker event, or None for a plain text line."""
    line = line.strip()
    if not (line.startswith("{") and line.endswith("}")):
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and isinstance(obj.get("event"), str) else None


def _reader(stream, q: queue.Queue) -> None:
    try:
        for line in stream:  # text mode: "\r" (tqdm) also ends a line
            q.put(line.rstrip("\n"))
    except (OSError, ValueError):
        pass
    finally:
        q.put(None)


def log_tail(path: str | os.PathLike, lines: int = 30, max_bytes: int = 64 * 1024) -> str:
    """The last `lines` lines of the worker log (the part of it written by the last run)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    text = text.rsplit("\n==== ", 1)[-1]  # only this run (spawn writes a ==== header per run)
    text = text.replace("\r", "\n")
    kept = [ln for ln in text.splitlines() if ln.strip()][1:]  # drop the header line itself
    return "\n".join(kept[-lines:])


@dataclass
class JobResult:
    returncode: int | None
    log_path: Path
    events: list[dict] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)  # stdout lines that were not events (bounded)
    seconds: float = 0.0
    pid: int | None = None

    def last(self, kind: str) -> dict | None:
        return next((e for e in reversed(self.events) if e.get("event") == kind), None)


def run_job(cmd: list[str], *, log_path: str | os.PathLike, on_event: Callable[[dict], None] | None = None,
            on_line: Callable[[str], None] | None = None, check_interrupt: Callable[[], None] = lambda: None,
            env: dict | None = None, cwd: str | os.PathLike | None = None,
            stop_file: str | os.PathLike | None = None, grace_s: float | Callable[[], float] = 10.0,
            on_stop_event: Callable[[dict], None] | None = None, poll_s: float = POLL_S,
            term_wait_s: float = TERM_WAIT_S, keep_lines: int = 4000,
            on_spawn: Callable[[subprocess.Popen], None] | None = None, standby: bool = False) -> JobResult:
    """Run `cmd` to the end, feeding each stdout event to `on_event` and other lines to `on_line`.

    `check_interrupt` runs every `poll_s` and between events; whatever it raises (ComfyUI's interrupt is a
    BaseException) propagates after the worker was stopped: stop file, up to `grace_s` for the worker to save and
    exit (its events still go to `on_stop_event`, which must not raise), then the process group is killed.
    `grace_s` may be a callable, asked at that moment (e.g. 0 before training started: nothing to save yet).
    `standby`, for a one-process `anima_train_command`: run in the waiting worker when it can (start_standby), and
    after a job that ended by itself start one for the next (the Train node: its runs skip Python's imports, a warm
    start's largest part). Any other command runs as without it.
    """
    if stop_file is not None:
        Path(stop_file).unlink(missing_ok=True)  # a stale one would stop the new run at its first step
    t0 = time.perf_counter()
    proc, argv = None, _standby_args(cmd) if standby else None
    standby = argv is not None
    if standby:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        proc = _take_standby(cmd, argv, log_path=Path(log_path), env=env, cwd=cwd)
    proc = proc or spawn(cmd, log_path=log_path, env=env, cwd=cwd)
    result = JobResult(None, Path(log_path), pid=proc.pid)
    lines: deque[str] = deque(maxlen=keep_lines)
    q: queue.Queue = queue.Queue()
    reader = threading.Thread(target=_reader, args=(proc.stdout, q), daemon=True, name="anima-train-reader")
    reader.start()
    eof = False

    def take(item: str, callbacks: bool) -> None:
        event = parse_event(item)
        if event is not None:
            result.events.append(event)
            handler = on_event if callbacks else on_stop_event
            if handler is not None:
                handler(event)
        elif item.strip():
            lines.append(item)
            if callbacks and on_line is not None:
                on_line(item)

    try:
        if on_spawn is not None:
            on_spawn(proc)
        while not eof:
            try:
                item = q.get(timeout=poll_s)
            except queue.Empty:
                item = ""
            check_interrupt()
            if item is None:
                eof = True
            elif item:
                take(item, callbacks=True)
        proc.wait()
    finally:
        if proc.poll() is None:  # interrupted (or a callback raised): stop gracefully, then for good
            grace = grace_s() if callable(grace_s) else grace_s
            if stop_file is not None and grace > 0:
                try:
                    Path(stop_file).parent.mkdir(parents=True, exist_ok=True)
                    Path(stop_file).write_text("stop requested by ComfyUI\n")
                except OSError:
                    pass
                deadline = time.monotonic() + grace
                while time.monotonic() < deadline and proc.poll() is None:
                    try:
                        item = q.get(timeout=0.1)
                    except queue.Empty:
                        continue
                    if item:
                        try:
                            take(item, callbacks=False)
                        except Exception:  # noqa: BLE001 (cleanup must go on)
                            pass
        kill_group(proc, term_wait_s)
        reader.join(timeout=2.0)
        while True:  # whatever the worker printed last (its final events)
            try:
                item = q.get_nowait()
            except queue.Empty:
                break
            if item:
                try:
                    take(item, callbacks=False)
                except Exception:  # noqa: BLE001
                    pass
        if proc.stdout is not None:
            proc.stdout.close()
        if stop_file is not None:
            Path(stop_file).unlink(missing_ok=True)
        result.returncode = proc.returncode
        result.lines = list(lines)
        result.seconds = time.perf_counter() - t0
    if standby:  # not after a Cancel (the exception above skips this): the user is stopping, not queueing again
        start_standby(env)
    return result


def failure_message(result: JobResult, what: str) -> str:
    """The worker's own error (its `error` event), then the tail of its log, then where the full log is.

    A user error (exit status 2, anima_train.errors: a refused run folder, a bad path, a data verdict, ...) is the
    whole story: its own first line (what is wrong and the fix: the one line a node's popup shows) leads the text,
    then "<what> did not start" (or "stopped" after the first step), with no exit status, and the log lines that
    only repeat it are left out. So is a data verdict of `cache` (exit status 4: images it cannot decode), which
    is the same kind of message: the verdict leads, not the exit status."""
    error = result.last("error") or {}
    message = str(error.get("message") or "") or _said_error(result)
    if message and not error.get("traceback") and result.returncode == USER_ERROR_EXIT:
        parts = [message, f"{what} {'stopped' if result.last('start') else 'did not start'}"]
    elif message and not error.get("traceback") and result.returncode == DATA_VERDICT_EXIT:
        parts = [message, f"{what} ended on this verdict on the data"]
    else:
        parts = [f"{what} failed (worker exit status {result.returncode})"] + ([message] if message else [])
    said = {line.strip() for line in message.splitlines() if line.strip()}
    tail = "\n".join(line for line in log_tail(result.log_path).splitlines()
                     if _USER_ERROR_PREFIX.sub("", line.strip()) not in said)
    if tail:
        parts.append("last lines of the worker log:\n" + tail)
    elif result.lines:
        parts.append("last output:\n" + "\n".join(result.lines[-20:]))
    parts.append(f"full log: {result.log_path}")
    return "\n".join(parts)


_USER_ERROR_PREFIX = re.compile(r"^anima-train [\w-]+: (error: )?(?!warning: )")  # how a command prints a user error


def _said_error(result: JobResult) -> str:
    """A user error the command printed on stderr (a command without events: convert, cache, audit): from its last
    `anima-train CMD: error: ` line to the end of the log; "" when it printed none or did not exit with status 2
    (or 4, a data verdict)."""
    if result.returncode not in (USER_ERROR_EXIT, DATA_VERDICT_EXIT):
        return ""
    lines = log_tail(result.log_path, lines=200).splitlines()
    at = next((i for i in range(len(lines) - 1, -1, -1) if _USER_ERROR_PREFIX.match(lines[i])), None)
    return "" if at is None else "\n".join([_USER_ERROR_PREFIX.sub("", lines[at])] + lines[at + 1:])


def raise_for_failure(result: JobResult, what: str, ok_codes: tuple[int, ...] = (0,)) -> None:
    if result.returncode not in ok_codes:
        raise WorkerError(failure_message(result, what))
