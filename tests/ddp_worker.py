"""Run by tests/test_ddp.py under `torchrun --nproc_per_node 2`: train, then record what this rank saw and has."""

import json
import os
import sys
from pathlib import Path

from anima_train.config import load_config
from anima_train.train import train

cfg_path, out_dir = sys.argv[1], Path(sys.argv[2])
result = train(load_config(cfg_path), cpu=True, no_save=True)
rank = int(os.environ.get("RANK", "0"))  # set by torchrun (the process group is gone after end_training)
(out_dir / f"rank{rank}.json").write_text(json.dumps({
    "digest": result.trainable_digest, "batches": result.batches_seen, "steps": result.global_step,
    "losses": result.losses}))
