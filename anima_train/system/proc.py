"""A process's state as Linux's /proc shows it: the one reader of `/proc/<pid>/stat` (the parent watch asks whether
ComfyUI is a zombie, the node's worker whether a process group still has a live member)."""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


def proc_stat(pid: int | str) -> tuple[str, int] | None:
    """(state letter, process group id) of `pid`; None where /proc has no such entry or cannot be read. A state of
    "Z" is a zombie: ended, not yet reaped."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": the command may hold spaces and ")"
        return fields[0], int(fields[2])
    except (OSError, ValueError, IndexError):
        return None


def group_has_live_member(pgid: int) -> bool:
    """Whether any process of group `pgid` is alive and not a zombie (True where /proc does not exist: unknown)."""
    if not PROC.is_dir():
        return True
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            stat = proc_stat(entry.name)
            if stat is not None and stat[1] == pgid and stat[0] != "Z":
                return True
    return False
