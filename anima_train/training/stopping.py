"""Stopping a run early, saving first: the stop file (`--stop-file`, the ComfyUI node's Cancel), the parent process
gone (ComfyUI ended: system/parent_watch.py), or the console window closing (Windows: system/windows.py).

Under several processes each rank votes once per optimizer step, sent with the step's loss (training/readout.py):
every rank reads the same votes and all stop at the same step (a lone rank leaving would hang the others).
"""

from __future__ import annotations

import os

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
