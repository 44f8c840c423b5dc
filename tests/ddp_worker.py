"""Run by tests/test_ddp.py under `torchrun --nproc_per_node 2`: train, then record what this rank saw and has.

argv: config, folder for the rank records, and "save" to write checkpoints (default: --no-save), then "stop": rank
0 alone is given a stop file, which it creates while it reports step 2 (rank 1's never appears), so only rank 0 asks
to stop. A run refused at start (anima_train.outputs.run_folder.RunRefused) records its message instead, so the test
sees that every rank got it."""

import json
import os
import sys
from pathlib import Path

from anima_train.config import load_config
from anima_train.outputs.run_folder import RunRefused
from anima_train.training.train import train

cfg_path, out_dir = sys.argv[1], Path(sys.argv[2])
save = len(sys.argv) > 3 and sys.argv[3] == "save"
stop = len(sys.argv) > 4 and sys.argv[4] == "stop"
rank = int(os.environ.get("RANK", "0"))  # set by torchrun (the process group is gone after end_training)
stop_file = None
if stop:
    from anima_train.outputs.progress import Progress

    stop_file = str(out_dir / ("STOP" if rank == 0 else "NEVER"))
    report = Progress.step

    def step_then_stop(self, stats, **kw):
        report(self, stats, **kw)
        if rank == 0 and stats.step == 2:
            Path(stop_file).write_text("")

    Progress.step = step_then_stop
try:
    result = train(load_config(cfg_path), cpu=True, no_save=not save, stop_file=stop_file)
except RunRefused as exc:
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"refused": str(exc)}))
    sys.exit(3)
(out_dir / f"rank{rank}.json").write_text(json.dumps({
    "digest": result.trainable_digest, "batches": result.batches_seen, "steps": result.global_step,
    "losses": result.losses, "stopped": result.stopped,
    "validation": [[p.step, p.loss, p.shuffled, p.margin] for p in result.validation],
    "saved": [str(p) for p in result.saved]}))
