"""The Windows branches (ComfyUI portable), run on Linux: os.name / the module's IS_WINDOWS, subprocess, psutil,
msvcrt and kernel32 are stood in for, and Windows paths are PureWindowsPath strings.

What Linux can run for real is run for real: the embeddable-Python behaviour (a `._pth` file makes CPython ignore
PYTHONPATH on every platform) with a real interpreter, and the TOML round trip of Windows paths.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import subprocess
import sys
import sysconfig
import tomllib
import types
from pathlib import PureWindowsPath

import pytest

from anima_train.outputs import run_folder
from anima_train.system import check, parent_watch
from nodes import worker
from tests.fixtures_tiny import forget_inductor_cpu_checks

PORTABLE_PYTHON = r"C:\Users\Me\ComfyUI_windows_portable\python_embeded\python.exe"


# -- the worker's command line -------------------------------------------------------------------------------------


def _windows_argv(line: str) -> list[str]:
    """How a Windows program (the MS C runtime, CommandLineToArgvW) splits its command line into argv."""
    args, cur, i, in_arg, quoted = [], [], 0, False, False
    while i < len(line):
        c = line[i]
        if c == "\\":
            n = 0
            while i < len(line) and line[i] == "\\":
                n, i = n + 1, i + 1
            if i < len(line) and line[i] == '"':
                cur.append("\\" * (n // 2))
                if n % 2:
                    cur.append('"')
                    i += 1
            else:
                cur.append("\\" * n)
            in_arg = True
            continue
        if c == '"':
            quoted, in_arg = not quoted, True
        elif c in " \t" and not quoted:
            if in_arg:
                args.append("".join(cur))
            cur, in_arg = [], False
        else:
            cur.append(c)
            in_arg = True
        i += 1
    if in_arg:
        args.append("".join(cur))
    return args


WINDOWS_PATHS = [r"D:\My Datasets\anime set 1", "C:\\Users\\Me\\new folder\\", r"\\nas\share\runs\lora a",
                 r"C:\Program Files (x86)\x", r"E:\データ\画像"]


def test_windows_worker_command_is_the_portable_python_with_utf8_and_paths_survive_the_command_line(monkeypatch):
    monkeypatch.setattr(worker, "IS_WINDOWS", True)
    monkeypatch.setattr(worker.sys, "executable", PORTABLE_PYTHON)
    # a venv python, not the embedded one
    monkeypatch.setattr(worker, "ignores_environment", lambda python: False, raising=False)
    cmd = worker.anima_train_command(["train", WINDOWS_PATHS[0] + r"\job.toml", "--stop-file", *WINDOWS_PATHS[1:]])
    assert cmd[:6] == [PORTABLE_PYTHON, "-u", "-X", "utf8", "-m", "anima_train"]
    # what Popen hands to CreateProcess (and the log header shows) splits back into exactly these arguments
    line = worker.command_line(cmd)
    assert line == subprocess.list2cmdline(cmd)
    assert _windows_argv(line) == cmd


def test_windows_spawn_starts_a_new_process_group_and_logs_a_pasteable_command(monkeypatch, tmp_path):
    monkeypatch.setattr(worker, "IS_WINDOWS", True)
    seen = {}

    class FakePopen:
        def __init__(self, args, **kw):
            seen.update(kw, args=args)
            self.pid = 4242

    monkeypatch.setattr(worker.subprocess, "Popen", FakePopen)
    cmd = [PORTABLE_PYTHON, "-u", "-m", "anima_train", "train", r"D:\My Runs\job 1.toml"]
    proc = worker.spawn(cmd, log_path=tmp_path / "w.log")
    assert seen["creationflags"] == 0x00000200  # CREATE_NEW_PROCESS_GROUP: the target of CTRL_BREAK_EVENT
    assert "start_new_session" not in seen and seen["args"] == cmd
    assert seen["encoding"] == "utf-8" and seen["stdin"] == subprocess.DEVNULL
    header = (tmp_path / "w.log").read_text().strip().splitlines()[-1]
    assert header.endswith(subprocess.list2cmdline(cmd)) and '"D:\\My Runs\\job 1.toml"' in header
    assert proc.anima_started > 0


# -- the embeddable Python ------------------------------------------------------------------------------------------


@pytest.fixture
def embedded_python(tmp_path):
    """This interpreter as an embeddable one: a `._pth` file beside it lists its stdlib and site-packages (no
    `import site`, no project folder), as ComfyUI portable's python_embeded does."""
    folder = tmp_path / "ComfyUI portable" / "python_embeded"
    folder.mkdir(parents=True)
    exe = folder / "python"
    exe.symlink_to(os.path.realpath(sys.executable))
    paths = sysconfig.get_paths()
    lines = [p for p in sys.path if p and p.startswith(sys.base_prefix)] + [paths["purelib"], paths["platlib"]]
    (folder / "python._pth").write_text("\n".join(dict.fromkeys(lines)) + "\n")
    return exe


@pytest.mark.skipif(sys.version_info < (3, 11), reason="._pth files work outside Windows from Python 3.11 on")
def test_embedded_python_ignores_pythonpath_so_the_worker_puts_the_pack_on_sys_path_itself(embedded_python, tmp_path):
    env = worker.worker_env()
    probe = subprocess.run([str(embedded_python), "-c", "import anima_train"], env=env, capture_output=True,
                           text=True, cwd=worker.pack_dir(), timeout=60)
    assert probe.returncode != 0 and "anima_train" in probe.stderr  # the premise: PYTHONPATH and the cwd are ignored
    cmd = worker.anima_train_command(["--help"], python=str(embedded_python))
    res = worker.run_job(cmd, log_path=tmp_path / "w.log", env=env, cwd=tmp_path)
    assert res.returncode == 0, worker.failure_message(res, "help")
    assert worker.ignores_environment(embedded_python) and not worker.ignores_environment(sys.executable)
    out = "\n".join(res.lines)
    assert "usage: anima-train" in out and "train" in out


# -- stopping the worker: CTRL_BREAK_EVENT, then taskkill /T /F, then the orphans ---------------------------------


class FakeProc:
    """A Windows worker: exits on CTRL_BREAK (or not), or cannot be sent one (no shared console)."""

    def __init__(self, *, on_break="exit", returncode=None, started=1000.0):
        self.pid, self.returncode, self.calls, self.on_break = 4242, returncode, [], on_break
        self.anima_started = started

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.calls.append(("signal", sig))
        if self.on_break == "no console":
            raise OSError(errno.EINVAL, "GenerateConsoleCtrlEvent failed")
        if self.on_break == "exit":
            self.returncode = 0xC000013A  # STATUS_CONTROL_C_EXIT

    def wait(self, timeout=None):
        self.calls.append(("wait", timeout))
        if self.returncode is None:
            raise subprocess.TimeoutExpired("worker", timeout)
        return self.returncode


class FakePsutilProcess:
    def __init__(self, pid, ppid, create_time, killed):
        self.pid, self.info, self._killed = pid, {"ppid": ppid, "create_time": create_time}, killed

    def kill(self):
        self._killed.append(self.pid)


@pytest.fixture
def windows_kill(monkeypatch):
    """Windows semantics for kill_group: a recorded taskkill (which ends the tree) and a fake process table."""
    monkeypatch.setattr(worker, "IS_WINDOWS", True)
    state = types.SimpleNamespace(taskkill=[], killed=[], table=[], proc=None)

    def run(args, **kw):
        state.taskkill.append(args)
        if state.proc is not None and str(state.proc.pid) in args:
            state.proc.returncode = 1
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(worker.subprocess, "run", run)
    fake_psutil = types.ModuleType("psutil")
    fake_psutil.process_iter = lambda attrs=None: list(state.table)
    monkeypatch.setitem(sys.modules, "psutil", fake_psutil)

    def process(pid, ppid, create_time):
        state.table.append(FakePsutilProcess(pid, ppid, create_time, state.killed))
    state.process = process
    return state


def test_windows_stop_sends_ctrl_break_first_and_needs_no_tree_kill_when_the_worker_obeys(windows_kill):
    proc = windows_kill.proc = FakeProc(on_break="exit")
    worker.kill_group(proc, term_wait_s=7.0)
    assert proc.calls[0] == ("signal", 1)  # CTRL_BREAK_EVENT
    assert ("wait", 7.0) in proc.calls
    assert windows_kill.taskkill == []


def test_windows_stop_escalates_to_taskkill_of_the_whole_tree(windows_kill):
    proc = windows_kill.proc = FakeProc(on_break="ignore")
    worker.kill_group(proc, term_wait_s=0.5)
    assert proc.calls[:2] == [("signal", 1), ("wait", 0.5)]
    assert windows_kill.taskkill == [["taskkill", "/T", "/F", "/PID", "4242"]]
    assert proc.returncode is not None


def test_windows_stop_without_a_console_goes_straight_to_taskkill(windows_kill):
    proc = windows_kill.proc = FakeProc(on_break="no console")
    worker.kill_group(proc, term_wait_s=30.0)
    assert ("wait", 30.0) not in proc.calls  # no 30 s wait for a signal that was never sent
    assert windows_kill.taskkill == [["taskkill", "/T", "/F", "/PID", "4242"]]


def test_windows_children_of_an_ended_worker_are_killed_and_nothing_else(windows_kill):
    proc = windows_kill.proc = FakeProc(returncode=0, started=1000.0)  # the worker itself already exited
    windows_kill.process(5001, ppid=4242, create_time=1002.0)  # its DataLoader worker, orphaned
    windows_kill.process(5002, ppid=5001, create_time=1003.0)  # and that one's child
    windows_kill.process(5003, ppid=4242, create_time=900.0)  # a child of an older process that had pid 4242
    windows_kill.process(5004, ppid=1, create_time=1002.0)  # unrelated
    worker.kill_group(proc)
    assert sorted(windows_kill.killed) == [5001, 5002]
    assert proc.calls == [] and windows_kill.taskkill == []


# -- the parent watch ---------------------------------------------------------------------------------------------


class FakeKernel32:
    """Processes by pid; a handle refers to the process it was opened on, as on Windows."""

    def __init__(self):
        self.by_pid, self.handles, self.next_handle = {}, {}, 100

    def start(self, pid):
        self.by_pid[pid] = {"alive": True}

    def end(self, pid):
        self.by_pid.pop(pid)["alive"] = False

    def OpenProcess(self, access, inherit, pid):
        if pid not in self.by_pid:
            return 0
        self.next_handle += 4
        self.handles[self.next_handle] = self.by_pid[pid]
        return self.next_handle

    def WaitForSingleObject(self, handle, ms):
        return 0x102 if self.handles[handle]["alive"] else 0  # WAIT_TIMEOUT / WAIT_OBJECT_0

    def GetExitCodeProcess(self, handle, code_ref):
        code_ref._obj.value = 259 if self.handles[handle]["alive"] else 0
        return 1

    def CloseHandle(self, handle):
        self.handles.pop(handle, None)
        return 1


def test_windows_parent_watch_is_not_fooled_by_a_reused_pid(monkeypatch):
    kernel32 = FakeKernel32()
    monkeypatch.setattr(ctypes, "windll", types.SimpleNamespace(kernel32=kernel32), raising=False)
    monkeypatch.setattr(parent_watch, "IS_WINDOWS", True, raising=False)
    kernel32.start(7000)
    with monkeypatch.context() as m:
        m.setattr(os, "name", "nt")
        watch = parent_watch.Watch(7000, death_signal=False)
        assert watch.parent_alive()
        kernel32.end(7000)
        kernel32.start(7000)  # Windows hands the dead ComfyUI's pid to the next new process
        alive = watch.parent_alive()
    assert not alive, "the watch took the new owner of the pid for ComfyUI"


def test_windows_parent_watch_sees_a_parent_that_ended_before_it_started(monkeypatch):
    kernel32 = FakeKernel32()
    monkeypatch.setattr(ctypes, "windll", types.SimpleNamespace(kernel32=kernel32), raising=False)
    monkeypatch.setattr(parent_watch, "IS_WINDOWS", True, raising=False)
    with monkeypatch.context() as m:
        m.setattr(os, "name", "nt")
        alive = parent_watch.Watch(7001, death_signal=False).parent_alive()
    assert not alive


# -- the run-folder lock (msvcrt) -------------------------------------------------------------------------------


class FakeMsvcrt:
    """msvcrt.locking: mandatory byte-range locks per file handle, from the handle's current position."""

    LK_UNLCK, LK_LOCK, LK_NBLCK, LK_RLCK, LK_NBRLCK = 0, 1, 2, 3, 4

    def __init__(self):
        self.locks: dict[tuple, int] = {}

    def _keys(self, fd, nbytes):
        st, pos = os.fstat(fd), os.lseek(fd, 0, os.SEEK_CUR)
        return [(st.st_dev, st.st_ino, pos + i) for i in range(nbytes)]

    def locking(self, fd, mode, nbytes):
        keys = self._keys(fd, nbytes)
        if mode == self.LK_UNLCK:
            if any(self.locks.get(k) != fd for k in keys):
                raise OSError(errno.EACCES, "Permission denied")  # unlocking what this handle does not hold
            for k in keys:
                del self.locks[k]
            return
        if any(k in self.locks for k in keys):
            raise OSError(errno.EACCES, "Permission denied")
        self.locks.update({k: fd for k in keys})

    def crash(self, fd):
        """The holding process died: Windows drops its locks with its handles."""
        self.locks = {k: v for k, v in self.locks.items() if v != fd}
        os.close(fd)


@pytest.fixture
def msvcrt(monkeypatch):
    fake = FakeMsvcrt()
    monkeypatch.setitem(sys.modules, "msvcrt", fake)
    monkeypatch.setattr(run_folder, "IS_WINDOWS", True)
    return fake


def test_windows_run_lock_refuses_a_second_run_and_frees_on_release(msvcrt, tmp_path):
    first = run_folder.RunLock(tmp_path / "run")
    first.acquire(say=pytest.fail)
    info = run_folder.lock_holder(tmp_path / "run")
    assert info["pid"] == os.getpid()  # readable while locked: the locked byte lies past the holder info
    assert all(offset >= (tmp_path / "run" / run_folder.LOCK_NAME).stat().st_size for _, _, offset in msvcrt.locks)
    with pytest.raises(run_folder.RunRefused, match=f"in use by another training run \\(pid {os.getpid()} on "):
        run_folder.RunLock(tmp_path / "run").acquire(say=pytest.fail)
    first.release()
    assert msvcrt.locks == {} and run_folder.lock_holder(tmp_path / "run") is None
    assert not (tmp_path / "run").exists()  # the lock made the folder and nothing else was written: taken back
    notes = []
    second = run_folder.RunLock(tmp_path / "run")
    second.acquire(say=notes.append)  # a cleanly released lock is no "left by" note
    assert notes == [] and run_folder.lock_holder(tmp_path / "run")["pid"] == os.getpid()
    second.release()


def test_windows_run_lock_left_by_a_dead_run_is_taken_over_and_said_so(msvcrt, tmp_path):
    dead = run_folder.RunLock(tmp_path / "run")
    dead.acquire(say=pytest.fail)
    (tmp_path / "run" / run_folder.LOCK_NAME).write_text(json.dumps({"pid": 99999, "host": "pc", "started": "then"}))
    msvcrt.crash(dead._fd)
    notes = []
    lock = run_folder.RunLock(tmp_path / "run")
    lock.acquire(say=notes.append)
    assert len(notes) == 1 and "taking over the lock" in notes[0] and "pid 99999 on pc" in notes[0]
    lock.release()


# -- TOML: Windows paths round-trip --------------------------------------------------------------------------------


def test_windows_paths_round_trip_through_the_config_toml():
    from anima_train.config import Config, DatasetConfig, SubsetConfig, dump_toml, parse_config

    cfg = Config()
    cfg.train.model_path = r"C:\Users\Me\Anima Models\anima-diffusers"
    cfg.train.output_dir = r"\\NAS\share\new runs\t"  # \n and \t would be escapes in a hand-written TOML string
    cfg.train.resume_from = "C:\\Users\\Me\\runs\\x-state\\"
    cfg.dataset = DatasetConfig(subsets=[SubsetConfig(path=r"E:\データ\画像 1"), SubsetConfig(path=r"D:\u0041")])
    text = dump_toml(cfg)
    with pytest.raises(tomllib.TOMLDecodeError):  # why no path is ever formatted into TOML by hand
        tomllib.loads(f'model_path = "{cfg.train.model_path}"')
    back = parse_config(text)
    assert back.train.model_path == cfg.train.model_path
    assert back.train.output_dir == cfg.train.output_dir and back.train.resume_from == cfg.train.resume_from
    assert [s.path for s in back.dataset.subsets] == [r"E:\データ\画像 1", r"D:\u0041"]
    assert PureWindowsPath(back.train.output_dir).drive == r"\\NAS\share"


def test_windows_paths_round_trip_through_the_node_config_and_the_run_name_rewrite(monkeypatch):
    import tomlkit

    from tests import comfy_double

    comfy_double.install(monkeypatch)
    import nodes.training_config as training_config

    paths = training_config.paths
    monkeypatch.setattr(paths, "current_policy", lambda: None)  # Windows path resolution cannot run here
    monkeypatch.setattr(paths, "confine_tree", lambda tree, policy, skip=None: [])  # every path allowed as typed
    values = {"model_path": r"C:\Users\Me\Anima Models\anima-diffusers", "dataset_path": r"\\nas\share\set 1",
              "output_dir": "D:\\runs\\new\\", training_config.EXTRA_TOML: "[dataset]\ncaption_extension = \".txt\"\n"}
    known = {k: v for k, v in values.items() if k == training_config.EXTRA_TOML or
             any(knob.widget == k for knob in training_config.KNOBS)}
    text = training_config.config_toml(known)
    tree = tomllib.loads(text)
    doc = tomlkit.parse(text)  # what pick_run does to rename a run
    doc["train"]["run_name"] = "x-2"
    again = tomllib.loads(tomlkit.dumps(doc))
    for knob in training_config.KNOBS:
        if knob.widget in known:
            table, key = knob.key.rsplit(".", 1)
            assert tree[table][key] == known[knob.widget] == again[table][key]


# -- packaging and `anima-train check` ---------------------------------------------------------------------------


def _requirements(platform: str) -> set[str]:
    from packaging.requirements import Requirement

    env = {"sys_platform": platform, "platform_system": "Windows" if platform == "win32" else "Linux",
           "os_name": "nt" if platform == "win32" else "posix"}
    lines = [ln.split("#")[0].strip() for ln in (worker.pack_dir() / "requirements.txt").read_text().splitlines()]
    reqs = [Requirement(ln) for ln in lines if ln]
    return {r.name for r in reqs if r.marker is None or r.marker.evaluate(env)}


def test_installing_the_pack_never_installs_triton_windows():
    """Other packs in the same ComfyUI depend on their triton-windows, whose series must match torch's: the pack never
    installs one (the Check names the pin instead)."""
    windows, linux = _requirements("win32"), _requirements("linux")
    assert not {"triton", "triton-windows"} & (windows | linux)
    assert windows == linux  # nothing differs: no Windows-only piece, no Linux-only piece unmarked
    project = tomllib.loads((worker.pack_dir() / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if "triton" in d.lower()]


@pytest.mark.parametrize("torch_version, series", [
    ("2.9.1+cu128", (3, 5)), ("2.10.0+cu130", (3, 6)), ("2.11.0", (3, 6)), ("2.12.1", (3, 7)), ("2.13.0", (3, 7)),
    ("2.14.1+cu130", (3, 8)), ("2.15.0", (3, 9)),
])
def test_the_triton_series_of_each_torch(torch_version, series):
    assert check.triton_series(torch_version, torch_requires=[]) == series


@pytest.mark.parametrize("torch_version, torch_requires, triton_version, ok, pin", [
    ("2.9.1+cu128", [], None, False, "triton-windows==3.5.*"),  # from the table
    ("2.10.0+cu130", [], "3.7.1", False, "triton-windows==3.6.*"),  # the newest triton-windows, too new for torch
    ("2.14.1+cu130", ['triton~=3.8.0; platform_system == "Linux"'], "3.10.0", False, "triton-windows==3.8.*"),
    ("2.14.1+cu130", [], None, False, "triton-windows==3.8.*"),
])
def test_windows_check_names_the_triton_windows_matching_torch(monkeypatch, torch_version, torch_requires,
                                                                 triton_version, ok, pin):
    monkeypatch.setattr(check.sys, "executable", PORTABLE_PYTHON)
    monkeypatch.setattr(check, "_torch_requires", lambda: torch_requires)
    real_import = check._import
    monkeypatch.setattr(check, "_import", lambda name: real_import(name) if name != "triton" else (
        (None, "ModuleNotFoundError: No module named 'triton'") if triton_version is None else
        (types.SimpleNamespace(__version__=triton_version), triton_version)))
    torch = types.SimpleNamespace(__version__=torch_version, cuda=types.SimpleNamespace(is_available=lambda: True))
    item = check._triton_windows_item(torch)
    assert item.ok is ok and not item.required
    # a line to paste into a Command Prompt: the exact pin quoted (`*` and `<` are special), the python quoted, and
    # -s: the portable's python must not look into (nor install next to) the user's own site-packages
    assert f'"{PORTABLE_PYTHON}" -s -m pip install "{pin}"' in item.detail, item.detail


@pytest.fixture
def failing_compiler(tmp_path, monkeypatch):
    """Inductor's C++ compiler, as on an embedded Python without include/: it fails like a missing Python.h. The
    compile probe then really fails (each probe compiles anew)."""
    import torch._inductor.config as inductor_config

    cxx = tmp_path / "bin" / "g++"
    cxx.parent.mkdir()
    cxx.write_text('#!/bin/sh\ncase "$*" in *--version*|*-dumpversion*) exec g++ "$@";; esac\n'
                   'echo "fatal error: Python.h: No such file or directory" >&2\necho "compilation terminated." >&2\n'
                   "exit 1\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cache"))
    with inductor_config.patch({"cpp.cxx": (None, str(cxx))}):
        yield cxx
    forget_inductor_cpu_checks()  # what Inductor concluded from the failing compiler must not outlive the test


def _portable_layout(root) -> str:
    """A python_embeded folder as ComfyUI portable ships it: python.exe beside python3XX._pth, no include/ or libs/."""
    folder = root / "python_embeded"
    folder.mkdir(parents=True)
    (folder / f"python{sys.version_info[0]}{sys.version_info[1]}._pth").write_text("../ComfyUI\nimport site\n")
    return str(folder / "python.exe")


@pytest.mark.parametrize("windows", [True, False])
def test_check_reports_a_triton_that_imports_but_cannot_build_as_broken(monkeypatch, tmp_path, failing_compiler,
                                                                       windows):
    """The check runs the trainer's compile probe: here the compiler really fails. The device is simulated (a CUDA
    device is claimed; the probe runs on the CPU, whose Inductor path needs the same headers)."""
    import torch

    from anima_train.training import compiling

    triton = pytest.importorskip("triton")  # torch's Linux wheel brings it
    monkeypatch.setattr(check, "IS_WINDOWS", windows)
    monkeypatch.setattr(check.sys, "executable", _portable_layout(tmp_path / "portable"))
    monkeypatch.setattr(check, "_probe_device", lambda torch: torch.device("cuda", 0))
    probed = []
    monkeypatch.setattr(check, "_probe", lambda torch: probed.append(1) or compiling.probe_compile("cpu"))
    item = (check._triton_windows_item if windows else check._triton_item)(torch)
    assert probed and not item.ok and not item.required
    assert item.detail.startswith(f"broken: triton {triton.__version__} imports but a compiled kernel failed on "
                                  f"cuda:0 ("), item.detail
    assert "fatal error: Python.h: No such file or directory" in item.detail
    if windows:  # what is missing, and the fix
        lib = f"python{sys.version_info[0]}{sys.version_info[1]}.lib"
        assert "copy the include and libs folders of a full Python" in item.detail
        assert os.path.join("include", "Python.h") in item.detail and os.path.join("libs", lib) in item.detail
    assert len(item.detail.splitlines()) == 1


def test_python_3_13_is_supported_by_the_check_the_installers_and_the_package():
    """What the 3.13 suite (.ci/run) proves by running; here the texts that gate it."""
    assert check.python_item((3, 13, 14)).ok and check.python_item((3, 11, 7)).ok
    too_new = check.python_item((3, 14, 0))
    assert not too_new.ok and too_new.detail.endswith("not supported; use Python 3.11, 3.12 or 3.13")
    root = worker.pack_dir()
    assert tomllib.loads((root / "pyproject.toml").read_text())["project"]["requires-python"] == ">=3.11,<3.14"
    sh, ps1, ci = ((root / name).read_text() for name in ("install.sh", "install.ps1", ".ci/run"))
    assert "3.11|3.12|3.13)" in sh and '$ver -eq "3.13"' in ps1 and '@("py", "-3.13")' in ps1
    assert ("venv313" in ci and "python3.13" in ci
            and "ANIMA_VENV=venv313 bash install.sh && venv313/bin/python -m pytest" in ci)


def test_windows_check_report_says_what_is_missing_and_what_works(monkeypatch):
    monkeypatch.setattr(check, "IS_WINDOWS", True)
    report = check.run_checks()
    names = [i.name for i in report.items]
    assert "triton-windows (SDNQ kernels, compile)" in names and "triton (SDNQ kernels, compile)" not in names
    multi = next(i for i in report.items if i.name.startswith("multi-GPU"))
    assert not multi.ok and not multi.required and "Linux-only" in multi.detail and "one GPU" in multi.detail
    assert report.ok  # neither is required: single-GPU training works without them


# -- confinement of Windows paths (nodes/paths.py judges resolved paths with pathlib's Windows rules) ----------------


@pytest.mark.parametrize("path, root, inside", [
    (r"c:\comfyui\OUTPUT\run 1", r"C:\ComfyUI\output", True),  # Windows paths compare case-insensitively
    (r"C:\ComfyUI\output-evil\x", r"C:\ComfyUI\output", False),  # a prefix of the name is not inside
    (r"D:\ComfyUI\output\x", r"C:\ComfyUI\output", False),  # another drive
    (r"\\NAS\Share\datasets\set 1", r"\\nas\share\datasets", True),  # UNC share
    (r"\\nas\other\datasets", r"\\nas\share\datasets", False),
])
def test_confinement_follows_windows_path_rules(path, root, inside):
    from nodes import paths

    assert paths._under(PureWindowsPath(path), (PureWindowsPath(root),)) is inside


# -- install.ps1 is install.sh's twin --------------------------------------------------------------------------


def test_install_ps1_mirrors_install_sh_and_the_readme_documents_windows():
    root = worker.pack_dir()
    sh, ps1, readme = ((root / name).read_text() for name in ("install.sh", "install.ps1", "README.md"))
    for shared in ("ANIMA_PYTHON", "ANIMA_TORCH_SPEC", ".anima-train-install", "torch.ones(1) + 1",
                   "import anima_train, anchor, pytest", "dependencies up to date", "check"):
        assert shared in sh and shared in ps1, shared
    assert '"install", "-q", "-e", ".[dev]"' in ps1 and "-Recreate" in ps1 and "py\", \"-3.11\"" in ps1
    section = readme[readme.index("### Windows and ComfyUI portable"):readme.index("## Headless CLI")]
    for needle in ("python_embeded\\python.exe -s -m pip install -r", "triton-windows", "install.ps1",
                   "taskkill /T /F", "\\\\server\\share", "'D:\\My Datasets\\set 1'"):
        assert needle in section, needle


# -- several GPUs on Windows: refused before anything starts ------------------------------------------------------


def test_windows_train_node_refuses_several_gpus_before_a_worker_or_a_run_folder(monkeypatch, tmp_path, tiny_anima):
    from anima_train import errors
    from tests.test_nodes_train import _train, widgets

    from tests import comfy_double

    comfy_double.install(monkeypatch)
    import nodes.comfy as comfy
    import nodes.nodes_train as nt

    comfy_double.install_folders(monkeypatch, comfy, tmp_path, [tiny_anima.diffusers_dir])
    monkeypatch.setattr(comfy, "output_directory", lambda: str(tmp_path / "output"))
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.png").write_bytes(b"png")
    (data / "a.txt").write_text("red circle")
    spawned = []
    monkeypatch.setattr(nt.worker, "spawn", lambda *a, **kw: spawned.append(a) or pytest.fail("a worker started"))
    config = nt.AnimaTrainConfig.execute(**widgets(nt, tiny_anima.diffusers_dir, data, run_name="win")).values[0]
    monkeypatch.setattr(sys, "platform", "win32")
    env = types.SimpleNamespace(nt=nt)
    with pytest.raises(errors.UserError) as exc:
        _train(env, config, gpus=2)
    message = str(exc.value)
    assert message.startswith("2 processes on Windows: multi-GPU training needs NCCL, which exists on Linux only")
    flat = " ".join(message.split())  # one message; its first line kept within the popup's 120 characters
    assert "train on one GPU (gpus = 1)" in flat and len(message.splitlines()[0]) <= 120, message
    assert spawned == [] and not os.path.exists(config["run_dir"])


def test_windows_cli_under_a_launcher_refuses_several_processes_before_accelerate(monkeypatch, tmp_path, tiny_anima,
                                                                                capsys):
    from anima_train import cli
    from anima_train.data.synthetic import make_synthetic_latents
    from tests.fixtures_tiny import small_run_toml

    data = tmp_path / "data"
    make_synthetic_latents(data, n=4)
    cfg = tmp_path / "run.toml"
    cfg.write_text(small_run_toml(tiny_anima.diffusers_dir, data, tmp_path / "out", train='run_name = "win"'))
    monkeypatch.setenv("WORLD_SIZE", "2")  # what accelerate launch / torchrun give each rank
    monkeypatch.setattr(sys, "platform", "win32")
    from anima_train.training import train

    # on the module that builds it: patching `accelerate.Accelerator` reached train.py only when train.py was first
    # imported inside this test, and then left the fake bound there for every later test in the process
    monkeypatch.setattr(train, "Accelerator", lambda *a, **kw: pytest.fail("accelerate started"))
    assert cli.main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("anima-train train: error: 2 processes on Windows: multi-GPU training needs NCCL")
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


# -- closing the console: the handler turns it into the loop's stop (saved weights + resumable state) -------------


def test_console_close_event_saves_a_resumable_state_before_the_process_may_end(monkeypatch, tmp_path, tiny_anima):
    """Off Windows the handler is called directly (SetConsoleCtrlHandler would call it on its own thread), during a
    real tiny run, as a close event arrives after the first step."""
    import threading
    import time

    from anima_train.outputs import resume_state
    from anima_train.system import windows
    from anima_train.config import parse_config
    from anima_train.data.synthetic import make_synthetic_latents
    from anima_train.training.train import train
    from tests.fixtures_tiny import small_run_toml

    for name in ("_requested", "_finished"):
        monkeypatch.setattr(windows, name, threading.Event())
    monkeypatch.setattr(windows, "_reason", [])
    data = tmp_path / "data"
    make_synthetic_latents(data, n=8)
    events = tmp_path / "events.jsonl"
    cfg = parse_config(small_run_toml(tiny_anima.diffusers_dir, data, tmp_path / "out",
                                     train='run_name = "close"\nmax_steps = 400\nsave_optimizer_state = true\n'
                                           'batch_size = 2\nepochs = 1000'))
    answer = {}

    def close_console_after_the_first_step():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if events.exists() and '"event": "step"' in events.read_text():
                break
            time.sleep(0.05)
        handled = windows.on_console_event(windows.CTRL_CLOSE_EVENT)  # blocks until training returned
        # what exists when the handler lets Windows end the process
        answer.update(handled=handled, states=sorted(p.name for p in run_dir.glob("close-step*-state")))

    run_dir = tmp_path / "out" / "close"
    closer = threading.Thread(target=close_console_after_the_first_step)
    closer.start()
    try:
        result = train(cfg, cpu=True, events=str(events), stop_file=str(tmp_path / "never-created"))
    finally:
        closer.join(60)
    assert result.stopped and 1 <= result.global_step < 400
    # the process was let go only once the stop's checkpoint and resumable state were written
    assert answer == {"handled": True, "states": [f"close-step{result.global_step:06d}-state"]}
    state = resume_state.resolve_resume(str(run_dir / f"close-step{result.global_step:06d}.safetensors"))
    info = resume_state.read_state(state)
    assert info["global_step"] == result.global_step and (state / "accelerator" / "optimizer.pt").is_file()
    messages = [json.loads(line) for line in events.read_text().splitlines()]
    assert any("stop requested (the console window was closed)" in m.get("text", m.get("message", ""))
               for m in messages), messages
    # other console events (Ctrl+C, the Ctrl+Break of the node's Cancel) are left to the default handler
    assert windows.on_console_event(1) is False and windows.on_console_event(0) is False
