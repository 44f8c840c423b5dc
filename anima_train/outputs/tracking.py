"""[logging] tensorboard = true: Accelerate's TensorBoard tracker, one run folder per run under <run_dir>/logs/.

    <run_dir>/logs/<YYYYmmdd-HHMMSS>/events.out.tfevents.*     (a resumed run: ...-from-step<N>)

Scalars per optimizer step: loss/total, loss/<term> for each term of the loss it reports (flow.LOSS_TERMS: loss/mse
and loss/hf with the hf loss on), ot/moved_fraction (use_ot), lr/<param group> (the LR the step used), grad_norm
(the pre-clip norm; only when max_grad_norm > 0, the clip computes it), throughput/images_per_s (all processes),
memory/peak_gib_rank<r> (CUDA). Preview images: samples/prompt<i>.
View with `tensorboard --logdir <run_dir>/logs`.

Only the main process writes (Accelerate's trackers do nothing elsewhere). The tensorboard package is optional: a
config that asks for it without it installed is refused at load (anima_train.config), with the install line.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from anima_train.outputs import manifest
from anima_train.outputs.run_folder import LOGS_DIR

TRACKER = "tensorboard"


def accelerator_kwargs(cfg, run_dir: Path) -> dict:
    """Extra Accelerator(...) arguments: the tracker and its folder, or nothing when [logging] leaves it off."""
    if not cfg.logging.tensorboard:
        return {}
    return {"log_with": TRACKER, "project_dir": str(Path(run_dir) / LOGS_DIR)}


def run_folder_name(logs_dir: Path, resumed_step: int = 0) -> str:
    """The run's own folder name: its start time (a resumed run adds the step), never an existing folder's."""
    base = time.strftime("%Y%m%d-%H%M%S") + (f"-from-step{resumed_step}" if resumed_step else "")
    name, n = base, 1
    while (Path(logs_dir) / name).exists():
        n += 1
        name = f"{base}-{n}"
    return name


class Tracker:
    """Scalars and images to Accelerate's TensorBoard tracker; a no-op when logging is off."""

    def __init__(self, accelerator, cfg, run_dir: Path, resumed_step: int = 0):
        self.accelerator = accelerator
        self.on = bool(cfg.logging.tensorboard)
        self.folder: Path | None = None
        self._last: tuple[float, int] | None = None  # (time, step) of the previous log, for images/s
        if not self.on:
            return
        logs = Path(run_dir) / LOGS_DIR
        name = run_folder_name(logs, resumed_step) if accelerator.is_main_process else "rank"
        self.folder = logs / name
        if accelerator.is_main_process:
            manifest.output(run_dir, LOGS_DIR).mkdir(parents=True, exist_ok=True)  # this run's (or refused)
        # flush every few seconds: a run that dies keeps its curve (SummaryWriter's default is 120 s)
        accelerator.init_trackers(name, init_kwargs={TRACKER: {"flush_secs": 5}})

    def step(self, stats, *, group_names: list[str], images: int) -> None:
        """One optimizer step (stats: progress.StepStats); `images` = images this step over all processes."""
        if not self.on:
            return
        now = time.perf_counter()
        values: dict[str, float] = {"loss/total": stats.loss}
        values.update({f"loss/{name}": value for name, value in stats.terms.items() if value is not None})
        if stats.ot is not None:
            values["ot/moved_fraction"] = stats.ot
        for name, lr in zip(group_names, stats.lrs):
            values[f"lr/{name}"] = lr
        if self._last is not None and now > self._last[0]:
            values["throughput/images_per_s"] = images * (stats.step - self._last[1]) / (now - self._last[0])
        for rank, gib in enumerate(stats.peak_gb):
            values[f"memory/peak_gib_rank{rank}"] = gib
        self._last = (now, stats.step)
        self.accelerator.log(values, step=stats.step)

    def grad_norm(self, step: int, value: float) -> None:
        """The pre-clip gradient norm of `step`, logged one step late: reading it at once would stall the GPU."""
        if self.on:
            self.accelerator.log({"grad_norm": value}, step=step)

    def images(self, step: int, images: list) -> None:
        """Preview images (PIL) at `step`: one image series per prompt (main process only)."""
        if not self.on or not self.accelerator.is_main_process:
            return

        writer = self.accelerator.get_tracker(TRACKER, unwrap=True)
        for i, image in enumerate(images):
            writer.add_image(f"samples/prompt{i:02d}", np.asarray(image), step, dataformats="HWC")
        writer.flush()

    def close(self) -> None:
        """Flush and close the event file (a run that fails too; closing twice is harmless)."""
        if self.on:
            for tracker in self.accelerator.trackers:
                tracker.finish()
