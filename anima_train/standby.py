"""`python -m anima_train.standby`: a worker started before its job, so that the job does not wait for Python to
import torch, transformers, diffusers and peft — most of a warm start's wait before a worker's first line
(bench/results/caps_2026-12-06b). The Train node starts one after each run for the next (nodes/worker.py).

It imports the trainer, then reads one line from stdin, {"argv": [...], "cwd": DIR, "log": FILE}, and from there it
is `python -m anima_train ARGV` run in DIR with its stderr appended to FILE. End of input instead (ComfyUI let it go,
or ended): it exits, having done nothing. Nothing it imports starts CUDA, so while it waits it holds host memory
only, and CUDA's settings in the environment (the allocator, the visible devices) are read by the job as usual.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from anima_train.cli import main as cli_main
from anima_train.system import parent_watch, third_party_noise


def preload() -> None:
    """What `python -m anima_train train` imports, Inductor's compiler included (a compiled run's probe and compile
    import it; anima_train/training/compiling.py keeps it lazy for the runs that do not). A failure is left for the
    job to meet and report."""
    with contextlib.suppress(Exception), contextlib.redirect_stdout(sys.stderr), third_party_noise.filtered():
        # lazy: importing them while no job waits is the point
        import anima_train.training.train  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401


def main() -> int:
    parent_watch.start_from_env()  # as `python -m anima_train` does: it ends with ComfyUI
    preload()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    job = json.loads(line)
    sys.stderr.flush()  # what waiting said stays in the waiting process's stderr; the job's goes to its log
    fd = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(job["cwd"])
    # what `-m anima_train` leaves in sys.argv: the run folder's lock records it, a printed fix names the command
    sys.argv[:] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py"), *job["argv"]]
    return cli_main(list(job["argv"]))


if __name__ == "__main__":
    sys.exit(main())
