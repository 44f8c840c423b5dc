"""The run folder `<output_dir>/<run_name>/` belongs to one run, trained by one process at a time.

    with claim_run(run_dir, run_stem, accelerator, resume_state=..., overwrite=..., stop_file=..., say=...):
        ... load, train, save ...

Checked before any model loads, on the main process (the other ranks wait for its verdict and raise the same error):

* a stop file that already exists is refused: it would end the run after its first step;
* a second process training into the folder is refused, naming the holder (pid, host, start time). The lock is an
  OS lock (flock / msvcrt) on `.anima-train.lock`: the kernel drops it when its process dies, however it dies, so a
  lock left by a crashed or killed run is taken over (and said so) without guessing from pids;
* the run folder must not land among what the run reads (outputs/guard.py), and a stop file must not be one of
  those files;
* a fresh run into a folder that holds files of an earlier run of that name is refused, naming the folder and the
  ways out: resume it (resume_from inside the folder is allowed), another run_name, or `--overwrite`, which lists the
  earlier run's checkpoints, states and config copy and sets them aside (Claim): deleted once the new run has saved
  its first checkpoint, put back if it ends before. What is the earlier run's is what its manifest lists
  (outputs/manifest.py), never what its names look like: an entry under a run's names that no run recorded (a
  user's own `logs/`, a run of before manifests) is refused with or without --overwrite, and never deleted. Nothing
  else in the folder (the ComfyUI node's job files, a user's notes) counts as a run file. A folder holding only the
  config copy of a run that saved nothing is no earlier run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from anima_train.errors import UserError
from anima_train.outputs import guard, manifest
from anima_train.outputs.layout import (LOCK_NAME, LOGS_DIR, LOSS_PLOT_NAME, MANIFEST_NAME, SAMPLES_DIR, STATE_SUFFIX,
                                        latest_state)
IS_WINDOWS = os.name == "nt"
_WIN_LOCK_OFFSET = 1 << 30  # msvcrt locks are mandatory: lock a byte far past the holder info, so it stays readable
_O_BINARY = getattr(os, "O_BINARY", 0)  # Windows: no newline translation in the holder info os.write puts there


class RunRefused(UserError, ValueError):
    """This run must not start: its stop file exists, another process trains into its folder, or the folder holds
    another run's files. The message names the file or folder and what to do."""


# -- files of a run ------------------------------------------------------------------------------------------------


def run_files(run_dir: str | os.PathLike, run_stem: str) -> list[Path]:
    """The entries of run_dir under the names a run named `run_stem` writes: its config copy `<stem>.toml`, its
    checkpoints (final and periodic, `_te` siblings, diffusers folders) and their `-state` folders, its loss plot,
    preview images and TensorBoard logs. Sorted; empty for a new folder. Whose they are, the manifest says."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    tagged = rf"{re.escape(run_stem)}(?:-(?:step|epoch)\d+)?"
    as_file = re.compile(rf"^(?:{re.escape(run_stem)}\.toml|{tagged}(?:_te)?\.safetensors)$")
    as_dir = re.compile(rf"^{tagged}(?:{re.escape(STATE_SUFFIX)})?$")
    return sorted(p for p in run_dir.iterdir()
                  if (as_dir if p.is_dir() else as_file).match(p.name)
                  or p.name in ((SAMPLES_DIR, LOGS_DIR) if p.is_dir() else (LOSS_PLOT_NAME,)))


def run_names(run_stem: str):
    """`<stem>`, `<stem>-2`, `<stem>-3`, …: the names a run of `run_stem` may take, in order."""
    yield run_stem
    n = 2
    while True:
        yield f"{run_stem}-{n}"
        n += 1


def holds_no_run(folder: str | os.PathLike, name: str) -> bool:
    """Nothing of a run named `name` is in `folder`, and no process trains into it."""
    return not run_files(folder, name) and lock_holder(folder) is None


def free_run_name(output_dir: str | os.PathLike, run_stem: str) -> str:
    """`<stem>-2`, `<stem>-3`, … : the first name whose folder holds no run and is not locked."""
    names = run_names(run_stem)
    next(names)
    return next(name for name in names if holds_no_run(Path(output_dir) / name, name))


def _inside(path: Path, folder: Path) -> bool:
    try:
        return Path(path).resolve().is_relative_to(Path(folder).resolve())
    except OSError:
        return False


ASIDE_PREFIX = ".anima-train-overwritten-"  # hidden folder in the run folder: an earlier run's files under --overwrite


class Claim:
    """What the run holds of its folder besides the lock: under --overwrite, the earlier run's files, set aside in a
    hidden folder of the run folder (a rename: nothing is copied or deleted yet). They are deleted only once this run
    has published its first checkpoint (`published`), and put back if it ends before that (`put_back`): a refused
    image, a crash or Ctrl-C must not leave the user with neither run."""

    def __init__(self, run_dir: Path, run_stem: str, say: Callable[[str], None], aside: Path | None = None):
        self.run_dir, self.run_stem, self.say, self.aside = Path(run_dir), run_stem, say, aside

    def published(self) -> None:
        if self.aside is None:
            return
        aside, self.aside = self.aside, None
        shutil.rmtree(aside, ignore_errors=True)
        self.say(f"--overwrite: this run saved its first checkpoint; deleted the earlier run's files set aside in "
                 f"{aside.name}")

    def put_back(self) -> None:
        if self.aside is None:
            return
        aside, self.aside = self.aside, None
        restored = _restore_aside(self.run_dir, self.run_stem, aside)
        self.say(f"--overwrite: this run ended without saving a checkpoint; put the earlier run's {restored} file(s) "
                 f"back in {self.run_dir}")


def _aside_dir(run_dir: Path, run_stem: str) -> Path:
    return Path(run_dir) / f"{ASIDE_PREFIX}{run_stem}"


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()


def _restore_aside(run_dir: Path, run_stem: str, aside: Path) -> int:
    """Move the set-aside files back. What the failed run wrote meanwhile under the same names (its config copy,
    previews, logs; never a checkpoint, or the aside would be gone) makes way for them."""
    moved = 0
    for p in sorted(aside.iterdir()):
        target = Path(run_dir) / p.name
        if target.exists() or target.is_symlink():
            _remove(target)
        os.replace(p, target)
        moved += p.name != MANIFEST_NAME  # the earlier run's files, as --overwrite counted them when it set them aside
    with contextlib.suppress(OSError):
        aside.rmdir()
    return moved


def _recover_aside(run_dir: Path, run_stem: str, say: Callable[[str], None]) -> None:
    """An aside folder left by a --overwrite run that was killed (no Python left to put it back; the caller holds
    the lock, so that run is gone): put the files back when the killed run published no checkpoint; else that run
    had replaced them, and they go."""
    aside = _aside_dir(run_dir, run_stem)
    if not aside.is_dir():
        return
    newer = [p for p in run_files(run_dir, run_stem) if p.name != f"{run_stem}.toml"
             and (p.name.endswith(".safetensors") or p.name.endswith(STATE_SUFFIX))]
    if newer:
        shutil.rmtree(aside, ignore_errors=True)
        say(f"note: removed {aside}, the earlier run's files set aside by a --overwrite run that was stopped after "
            f"saving its own checkpoints")
        return
    restored = _restore_aside(run_dir, run_stem, aside)
    say(f"note: a --overwrite run into {run_dir} was stopped before its first checkpoint; put the earlier run's "
        f"{restored} file(s) it had set aside back")


def check_fresh(run_dir: Path, run_stem: str, *, resume_state: Path | None, overwrite: bool,
                say: Callable[[str], None]) -> Path | None:
    """Refuse to start a fresh run over another run's files, or (overwrite) set them aside, saying which; returns
    the aside folder (Claim). A folder whose only file of this run is its config copy holds no earlier run: a run
    that ended before its first checkpoint leaves just that, and the next run writes its own copy over it."""
    _recover_aside(run_dir, run_stem, say)
    found = run_files(run_dir, run_stem)
    if resume_state is not None and _inside(resume_state, run_dir):
        # continuing the run that lives in the folder: its state proves the run's files are ours (a run of before
        # manifests has none; it gets one now)
        manifest.start(run_dir, run_stem, adopted=[p.name for p in found])
        return None
    state = latest_state(run_dir, run_stem)
    resume = (f'resume it: [train] resume_from = "{state.as_posix()}"' if state is not None else
              "resume it: set [train] resume_from to one of its -state folders (it has none: it was saved without "
              "save_optimizer_state, so it cannot be resumed)")
    recorded = manifest.entries(run_dir, run_stem)
    strangers = [p.name + ("/" if p.is_dir() else "") for p in found if p.name not in recorded]
    if strangers:
        raise RunRefused(
            f"{run_dir} holds {', '.join(strangers)} under the names a run {run_stem!r} writes, but no run recorded "
            f"them as its own ({MANIFEST_NAME} does not list them), so anima-train will neither write over nor "
            f"delete them (--overwrite included). Move them out of {run_dir}, or give this run another name: "
            f"[train] run_name = \"{free_run_name(run_dir.parent, run_stem)}\""
            + (f", or {resume}" if state is not None else ""))
    if not found or [p.name for p in found] == [f"{run_stem}.toml"]:
        if found:
            say(f"note: {found[0]} is the config copy of an earlier run that saved no checkpoint; this run replaces "
                f"it")
        manifest.start(run_dir, run_stem)
        return None
    names = ", ".join(p.name + ("/" if p.is_dir() else "") for p in found)
    if overwrite:
        aside = _aside_dir(run_dir, run_stem)
        say(f"--overwrite: deleting the earlier run's {len(found)} file(s) in {run_dir}: {names} (set aside in "
            f"{aside.name} until this run saves its first checkpoint, and put back if it ends before)")
        aside.mkdir(exist_ok=True)
        try:
            for p in found + [m for m in (run_dir / MANIFEST_NAME,) if m.exists()]:  # its manifest goes with them
                os.replace(p, aside / p.name)
        except BaseException:
            _restore_aside(run_dir, run_stem, aside)
            raise
        manifest.start(run_dir, run_stem)
        return aside
    raise RunRefused(
        f"{run_dir} already holds a run named {run_stem!r} ({names}); a new run would replace its files. Either\n"
        f"  - {resume},\n"
        f"  - or give this run another name: [train] run_name = "
        f"\"{free_run_name(run_dir.parent, run_stem)}\",\n"
        f"  - or pass --overwrite to replace that run's checkpoints, states and config copy (deleted once this run "
        f"saves its first checkpoint).")


def check_stop_file(stop_file: str | os.PathLike | None, reads: list[guard.Read] = ()) -> None:
    read = guard.stop_file_read(stop_file, list(reads))
    if read is not None:
        raise RunRefused(
            f"--stop-file {os.fspath(stop_file)}: that is {read.label}, which this run reads, not a stop file (the "
            f"run stops when the stop file appears). Name a path that does not exist yet, e.g. "
            f"{Path(stop_file).with_suffix('.stop').name}")
    if stop_file and os.path.exists(stop_file):
        raise RunRefused(
            f"--stop-file {os.fspath(stop_file)}: the file already exists, so this run would stop after its first "
            f"step. If it is a stop request left over from an earlier run or another running job's, delete it; "
            f"otherwise name another path (one that does not exist yet) and start again.")


# -- the lock ------------------------------------------------------------------------------------------------------


def _os_lock(fd: int) -> bool:
    """Take the OS lock on fd without waiting; False if another process holds it."""
    try:
        if IS_WINDOWS:
            # lazy: platform module: msvcrt exists on Windows only, fcntl on POSIX only
            import msvcrt

            os.lseek(fd, _WIN_LOCK_OFFSET, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        else:
            import fcntl  # lazy: POSIX only (see msvcrt above)

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):
        return False
    except OSError as exc:
        if IS_WINDOWS and exc.errno in (13, 36):  # EACCES / EDEADLOCK: locked by another process
            return False
        raise
    return True


def _os_unlock(fd: int) -> None:
    if IS_WINDOWS:
        # lazy: platform module: see _os_lock
        import msvcrt

        os.lseek(fd, _WIN_LOCK_OFFSET, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
    else:
        import fcntl  # lazy: POSIX only (see msvcrt above)

        fcntl.flock(fd, fcntl.LOCK_UN)


def _read_holder(path: Path) -> dict | None:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    try:
        info = json.loads(text)
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def describe_holder(info: dict | None) -> str:
    if not info:
        return "a process that is just starting"
    return f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}"


def lock_holder(run_dir: str | os.PathLike, name: str = LOCK_NAME) -> dict | None:
    """Who trains into run_dir now (their lock info; `{}` when it is not written yet), or None when nobody does.
    `name`: another lock file of the folder (the ComfyUI node's job lock)."""
    path = Path(run_dir) / name
    if not path.exists():
        return None
    try:
        fd = os.open(path, os.O_RDWR | _O_BINARY)
    except OSError:
        return None
    try:
        if _os_lock(fd):
            _os_unlock(fd)
            return None
        return _read_holder(path) or {}
    finally:
        os.close(fd)


class RunLock:
    """An exclusive lock on a run folder, with the holder's pid/host/start time in the lock file for others to read.

    The OS drops the lock when its process ends, however it ends; the file itself is removed on release. The file
    is checked to be the one still at the path after locking (a releasing holder may have just removed it).
    `name`: the lock file; the ComfyUI node holds its own (`.comfyui-job.lock`) from picking a folder until its worker
    ends, as the worker takes this one only once it has started.

    The folders the lock had to make (the run folder, an output folder that did not exist) are taken back on
    release when nothing else was written into them: a run stopped or refused before it wrote anything leaves no
    trace. Only those: a folder that was there before is never removed, empty or not."""

    def __init__(self, run_dir: str | os.PathLike, name: str = LOCK_NAME):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / name
        self._fd: int | None = None
        self._made: list[Path] = []  # deepest first

    def acquire(self, say: Callable[[str], None] = print) -> None:
        while True:
            self._made += _missing_folders(self.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _O_BINARY, 0o666)
            except FileNotFoundError:  # an earlier holder took the folder back between the mkdir and the open
                continue
            except OSError as exc:
                say(f"note: cannot create the lock file {self.path} ({exc}); nothing stops a second run from "
                    f"writing into {self.run_dir}")
                return
            try:
                locked = _os_lock(fd)
            except OSError as exc:  # a filesystem without locks (some network / FUSE mounts)
                os.close(fd)
                say(f"note: the filesystem of {self.run_dir} does not support file locks ({exc}); nothing stops "
                    f"a second run from writing into it")
                return
            if not locked:
                os.close(fd)
                raise RunRefused(
                    f"{self.run_dir} is in use by another training run ({describe_holder(_read_holder(self.path))}); "
                    f"two runs in one folder would mix their checkpoints. Wait for it to end or stop it, or give "
                    f"this run another [train] run_name.")
            if IS_WINDOWS or _same_file(fd, self.path):
                break
            os.close(fd)  # locked a file its holder removed on release: lock the new one
        stale = _read_holder(self.path)
        if stale and stale.get("pid") != os.getpid():
            say(f"note: taking over the lock of {self.run_dir} left by {describe_holder(stale)}, which is no longer "
                f"running")
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": " ".join(sys.argv)}
        data = (json.dumps(info) + "\n").encode()
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, data)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if not IS_WINDOWS:  # Windows cannot remove an open file; the next holder overwrites the info
            with contextlib.suppress(OSError):
                self.path.unlink()
        else:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        with contextlib.suppress(OSError):
            _os_unlock(fd)
        os.close(fd)
        made, self._made = list(dict.fromkeys(self._made)), []
        if made and IS_WINDOWS:  # unlocked and closed, the lock file can go now (unless another holder opened it)
            with contextlib.suppress(OSError):
                self.path.unlink()
        for folder in made:
            try:
                folder.rmdir()  # only an empty one: anything written into it keeps it and the folders above it
            except OSError:
                break


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and those above it that do not exist, deepest first."""
    missing = []
    while not folder.exists() and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    return missing


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


# -- all of it, before the model loads ----------------------------------------------------------------------------


@contextlib.contextmanager
def claim_run(run_dir: Path, run_stem: str, accelerator, *, resume_state: Path | None, overwrite: bool,
              stop_file: str | None, saving: bool, say: Callable[[str], None],
              reads: list[guard.Read] = ()) -> Iterator[Claim]:
    """The start-up checks of a run, and its folder lock for the run's duration. Yields the Claim: call
    `published()` once the run's first checkpoint is saved.

    Only the main process checks and locks; every rank waits for its verdict and raises the same message (the main
    process its own exception), so a refused DDP run ends on all ranks at once instead of hanging in the first
    collective. `reads`: what the run reads (guard.run_reads), which its folder and stop file must not be."""
    lock = RunLock(run_dir) if saving else None
    failed: Exception | None = None
    claim = Claim(run_dir, run_stem, say)
    if accelerator.is_main_process:
        try:
            check_stop_file(stop_file, reads)
            guard.check_run_folder(run_dir, list(reads))
            if lock is not None:
                lock.acquire(say)
                claim.aside = check_fresh(run_dir, run_stem, resume_state=resume_state, overwrite=overwrite,
                                          say=say)
        except Exception as exc:  # noqa: BLE001 (re-raised below, after the other ranks were told)
            if lock is not None:
                lock.release()
            failed = exc
    if accelerator.num_processes > 1:
        # lazy: accelerate (~4 s measured cold): only a multi-process claim needs it
        from accelerate.utils import broadcast_object_list

        verdict = broadcast_object_list([None if failed is None else str(failed)])[0]
        if verdict is not None and failed is None:
            failed = RunRefused(verdict)
    if failed is not None:
        raise failed
    try:
        yield claim
    finally:
        # a run that saved no checkpoint (failed, interrupted, or skip_final_save without periodic saves) replaced
        # nothing: the earlier run comes back, before the lock goes (no other run may see it half restored)
        claim.put_back()
        if lock is not None:
            manifest.drop_if_unused(run_dir)
            lock.release()
