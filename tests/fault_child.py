"""The child side of tests/test_faults.py: one `python -m anima_train …` run in a process that can be SIGKILLed.

A forkserver imports this module once (the top-level imports are everything a tiny training run needs, ~6 s), then
each run is forked from it and executes this file as `__main__` (runpy.run_path, the test's Process target; the
imports are then already done), which runs `anima_train` as `python -m anima_train train cfg.toml` does. So every run is
a fresh process with its own state, killed for real, but starts in well under a second: the test does 20+ runs within
its time budget.
"""

import os
import runpy
import sys
import threading

import accelerate  # noqa: F401
import peft  # noqa: F401
import torch
from diffusers import AutoencoderKLQwenImage, CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler  # noqa: F401
from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner  # noqa: F401
from transformers import AutoTokenizer, Qwen3Model  # noqa: F401

import anima_train.cli  # noqa: F401
import anima_train.training.train  # noqa: F401
from anima_train import adapters  # noqa: F401
from anima_train.data import dataset  # noqa: F401
from anima_train.model import components, prompts  # noqa: F401
from anima_train.training import flow, optimizers, schedules  # noqa: F401

# One intra-op thread, set before any computation: no thread pool exists when the runs are forked, and every run (the
# reference included) does its float reductions in the same order.
torch.set_num_threads(1)
if os.environ.get("ANIMA_FAULT_WARM_MODEL") and __name__ != "__main__":
    # one model load in the server fills the caches every run would fill again (transformers compiles ~1000 regular
    # expressions on its first load: ~1 s per run otherwise)
    components.load_components(os.environ["ANIMA_FAULT_WARM_MODEL"], dtype=torch.float32, device="cpu")


def run(argv: list[str], log: str) -> None:
    """`python -m anima_train *argv` with stdout and stderr to `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # tqdm's default lock is a multiprocessing semaphore, which a SIGKILLed process leaves for the resource tracker
    # to reap with a warning; a thread lock does the same job here
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    sys.argv = ["anima_train", *argv]
    runpy.run_module("anima_train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":  # executed by runpy.run_path in the forked child, with ARGV and LOG given
    run(ARGV, LOG)  # noqa: F821
