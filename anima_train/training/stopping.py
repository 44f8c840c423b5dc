"""Stopping a run early, saving first: the stop file (`--stop-file`, the ComfyUI node's Cancel), the parent process
gone (ComfyUI ended: system/parent_watch.py), or the console window closing (Windows: system/windows.py).

An interrupt (Ctrl-C, SIGTERM: cli.main's policy) does not save: it stops where it is, and its message names the
newest state the run did save, with the line that resumes it (with_resume_line).

Under several processes each rank votes once per optimizer step, sent with the step's loss (training/readout.py):
every rank reads the same votes and all stop at the same step (a lone rank leaving would hang the others).
"""

from __future__ import annotations

import os
from pathlib import Path

from anima_train import errors
from anima_train.outputs.layout import checkpoint_step, latest_state
from anima_train.system import parent_watch, windows


class StopRequests:
    """Where a stop request can come from for this run, and whether one has come."""

    def __init__(self, stop_file: str | None):
        self.stop_file = stop_file
        # a worker whose ComfyUI ends, or whose console window is closed (Windows), saves like a stop-file stop
        self.watched = parent_watch.save_before_exit() or windows.install_console_handler()

    def vote(self) -> bool:
        """This process wants to stop now (False when nothing can ask: no stop file and nothing watched)."""
        if not (self.stop_file or self.watched):
            return False
        return bool((self.stop_file and os.path.exists(self.stop_file)) or parent_watch.parent_gone()
                    or windows.close_requested())

    def agreed(self, votes: list[float], world: int) -> bool:
        """One process: its own vote, now. Several: any rank's vote sent with this step's loss (the same list on
        every rank, so all decide alike)."""
        return any(votes) if world > 1 else self.vote()

    def reason(self) -> str:
        return ("the parent process ended" if parent_watch.parent_gone() else windows.close_reason()
                if windows.close_requested() else str(self.stop_file))


def with_resume_line(exc: BaseException, cfg) -> BaseException:
    """An interrupt as errors.Interrupted naming the run's newest saved state and the `resume_from` line that goes on
    from it (or that nothing was saved); any other exception unchanged."""
    if not isinstance(exc, KeyboardInterrupt) or getattr(exc, "detail", ""):
        return exc
    run_dir = Path(cfg.train.output_dir) / cfg.run_stem
    state = latest_state(run_dir, cfg.run_stem)
    if state is not None:
        detail = f'the newest saved state is {state.as_posix()}: resume with [train] resume_from = "{state.as_posix()}"'
    else:
        saved = [(checkpoint_step(p) or 0, p) for p in run_dir.glob(f"{cfg.run_stem}*.safetensors")]
        newest = f"its newest checkpoint is {max(saved)[1].as_posix()}, but " if saved else ""
        detail = (f"{newest}no resume state was saved ([train] save_optimizer_state = true saves one with "
                  "each checkpoint): run it again to start over")
    return errors.Interrupted(getattr(exc, "how", "interrupted"), detail)
