"""Run by tests/test_ddp.py under `torchrun --nproc_per_node 2`: train, then record what this rank saw and has.

argv: config, folder for the rank records, and "save" to write checkpoints (default: --no-save). A run refused at
start (anima_train.runs.RunRefused) records its message instead, so the test sees that every rank got it."""

import json
import os
import sys
from pathlib import Path

from anima_train.config import load_config
from anima_train.runs import RunRefused
from anima_train.train import train

cfg_path, out_dir = sys.argv[1], Path(sys.argv[2])
save = len(sys.argv) > 3 and sys.argv[3] == "save"
rank = int(os.environ.get("RANK", "0"))  # set by torchrun (the process group is gone after end_training)
try:
    result = train(load_config(cfg_path), cpu=True, no_save=not save)
except RunRefused as exc:
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"refused": str(exc)}))
    sys.exit(3)
(out_dir / f"rank{rank}.json").write_text(json.dumps({
    "digest": result.trainable_digest, "batches": result.batches_seen, "steps": result.global_step,
    "losses": result.losses}))
