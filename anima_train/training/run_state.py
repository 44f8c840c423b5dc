"""The state of one run as the loop carries it: `TrainResult` (what the run gives back) and `Run` (what a step, a
report and a save need, gathered once the run is set up).

Two fields of the result only tests compare: the digest of the trained tensors (it copies every one of them to the
host: for a full finetune about 4 GB and seconds per rank) and the dataset indices of every micro-batch. They are
recorded only when the environment asks (`ANIMA_TRAIN_RECORD=1`, which tests/conftest.py and the GPU bench set), so
a production run pays for neither.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from anima_train.config import Config
from anima_train.outputs.progress import Progress
from anima_train.outputs.run_folder import Claim
from anima_train.training.divergence import GradNorms

RECORD_ENV = "ANIMA_TRAIN_RECORD"


def recording() -> bool:
    """Whether this run records trainable_digest and batches_seen (RECORD_ENV = "1")."""
    return os.environ.get(RECORD_ENV) == "1"


@dataclass
class TrainResult:
    run_dir: Path
    final: Path | None
    global_step: int
    losses: list[float] = field(default_factory=list)  # mean-over-ranks loss per optimizer step
    saved: list[Path] = field(default_factory=list)
    tag_frequency: dict = field(default_factory=dict)
    stopped: bool = False  # ended early through the stop file
    components: object = field(default=None, repr=False)  # the trained models (in-process callers: eval, demo)
    total_steps: int = 0  # the run's horizon in optimizer steps (max_steps capped by the epochs)
    validation: list = field(default_factory=list)  # [validation]: validation.Point per evaluation (every rank)
    # recorded only when recording(): "" and [] otherwise
    trainable_digest: str = ""  # sha256 over this process's trainable tensors: equal on every rank under DDP
    batches_seen: list[list[int]] | None = None  # dataset indices per micro-batch, this rank

    def saw(self, indices) -> None:
        """A micro-batch's dataset indices, when recording."""
        if self.batches_seen is not None:
            self.batches_seen.append([int(i) for i in indices])


@dataclass
class Run:
    """What a step, its report and a save need, gathered once the run is set up."""
    cfg: Config
    accelerator: object
    progress: Progress
    parts: object  # model.components.Components: the bare modules the checkpoint files are written from
    result: TrainResult  # its step, horizon and tag frequency go into the file; each save is added
    run_dir: Path
    per_epoch: int  # optimizer steps per epoch
    trainable: list  # the trained modules as accelerate prepared them, the transformer first
    optimizer: object
    scheduler: object
    gens: dict  # the random generators by stream ("noise", "timestep"): their states go into the resume state
    claim: Claim  # the run folder's claim: an --overwrite's set-aside files go once the first save is in place
    grad_norms: GradNorms
    earlier_losses: list = field(default_factory=list)  # a resumed run's losses before it (its state's losses.json)
    first_loss_step: int = 1  # the step of earlier_losses[0] (or of this run's first loss when there are none)
    inputs: dict = field(default_factory=dict)  # resume_state.run_inputs: what the run trains from, in each state
