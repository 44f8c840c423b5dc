"""Fault injection: a run with periodic state saves is killed with SIGKILL at random points and resumed from its
newest state, over and over; every resume ends on the uninterrupted run's weights and losses, bit for bit.

Kill points (seeded; ANIMA_FAULT_SEED=N reproduces or varies them): anywhere inside a training step, inside a
periodic state save, right after a periodic state is complete, right after the final checkpoint file, and right
after the final state — where the resume must refuse with the "finished" message instead. After each kill, every
file under a final name must be whole (loadable) and every `-state` folder resumable; unfinished writes may only
remain as hidden temp files.

Each run is a separate process running `python -m anima_train train cfg.toml --events …` (forked from a server
that has done the imports, see fault_child.py), so the kill is real. Resumes use `resume_from` = the run folder's
newest state, into the same run folder (the supported way to continue a run, whatever a stale lock left behind).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import runpy
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from anima_train.outputs import resume_state as ckpt
from anima_train.data.synthetic import make_synthetic_latents
from tests.fixtures_tiny import small_run_toml

STEPS, SAVE_EVERY = 8, 2  # 6 latents in batches of 2: 3 steps per epoch, so the step-6 state ends an epoch
KILLS = 10
SEED = int(os.environ.get("ANIMA_FAULT_SEED", "11"))
RUN_TIMEOUT_S = 120
CHILD = Path(__file__).with_name("fault_child.py")
STATUS_LOST = 255  # multiprocessing's exit status for a child whose status the forkserver could not report


@pytest.fixture(scope="module")
def forkserver(tiny_anima):
    from multiprocessing import forkserver as server

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.fault_child"])
    with pytest.MonkeyPatch.context() as env:  # the server starts now, with this in its environment
        env.setenv("ANIMA_FAULT_WARM_MODEL", str(tiny_anima.diffusers_dir))
        server.ensure_running()
    yield ctx
    getattr(server._forkserver, "_stop", lambda: None)()  # do not keep a server with torch loaded for the session


def _config(folder: Path, model: Path, data: Path, resume_from: Path | None = None) -> Path:
    resume = f'resume_from = "{resume_from}"\n' if resume_from else ""
    path = folder / ("resume.toml" if resume_from else "train.toml")
    train = (f'run_name = "tiny"\nmax_steps = {STEPS}\nepochs = 100\nbatch_size = 2\n'
             f"save_every_epochs = 0\nsave_every_steps = {SAVE_EVERY}\nsave_optimizer_state = true\n{resume}")
    path.write_text(small_run_toml(model, data, folder / "out", train=train, tables="[optimizer]\nlr = 1e-3\n",
                                  progress="plain"))
    return path


class Run:
    """One `anima-train train` process with its events file and log."""

    def __init__(self, ctx, config: Path, name: str):
        self.events, self.log = config.parent / f"{name}.jsonl", config.parent / f"{name}.log"
        self._records, self._read = [], 0
        argv = ["train", str(config), "--cpu", "--events", str(self.events)]
        self.process = ctx.Process(target=runpy.run_path, kwargs=dict(
            path_name=str(CHILD), run_name="__main__", init_globals=dict(ARGV=argv, LOG=str(self.log))))
        self.process.start()

    def records(self) -> list[dict]:
        """The events so far (read incrementally: this is polled every millisecond)."""
        if self.events.exists():
            with open(self.events, "rb") as f:
                f.seek(self._read)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a last line may be half written
            self._read += len(complete)
            self._records += [json.loads(line) for line in complete.splitlines()]
        return self._records

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records() if r["event"] == "step"}

    def wait(self) -> int:
        """The run's exit status. 255 is multiprocessing's own when the forkserver could not report the child's status
        (popen_forkserver: "perhaps the forkserver process itself got killed"; seen once, on a busy CI machine, after a
        resumed run had printed `done`): then the run's own events say how it ended, 0 where the last one is `done`."""
        self.process.join(RUN_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
            pytest.fail(f"a run did not end within {RUN_TIMEOUT_S} s; log:\n{self.output()}")
        if self.process.exitcode == STATUS_LOST and self.records() and self.records()[-1]["event"] == "done":
            return 0
        return self.process.exitcode

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _checkpoint_at(step):
    return lambda run, run_dir: any(r["event"] == "checkpoint" and r["step"] == step for r in run.records())


def _step_done(step):
    return lambda run, run_dir: any(r["event"] == "step" and r["step"] >= step for r in run.records())


def _state_written(name):
    return lambda run, run_dir: (run_dir / name / ckpt.STATE_FILE).exists()


def kill_plans(rng: random.Random, step_s: float) -> list[tuple[str, object, float]]:
    """(what, condition, then wait s). Conditions are checked only once the run has a state to resume from."""
    periodic = list(range(SAVE_EVERY, STEPS, SAVE_EVERY))
    s_save, s_done = rng.choice(periodic[1:]), rng.choice(periodic)
    plans = [("right after the final state", _state_written("tiny-state"), 0.0),
             ("right after the final checkpoint file", _checkpoint_at(STEPS), rng.uniform(0, 0.01)),
             (f"inside the step-{s_save} state save", _checkpoint_at(s_save), rng.uniform(0, 0.02)),
             (f"right after the step-{s_done} state", _state_written(f"tiny-step{s_done:06d}-state"), 0.0)]
    while len(plans) < KILLS:
        k, frac = rng.randint(SAVE_EVERY, STEPS - 1), rng.random()
        plans.append((f"{frac:.2f} of a step after step {k}", _step_done(k), frac * step_s))
    return plans


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def _assert_equal_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{what}: {len(different)} tensor(s) differ, e.g. {different[0]}"


def _assert_whole(run_dir: Path, what: str) -> None:
    """Every file under a final name loads; every state folder resumes (its files are complete)."""
    for p in run_dir.iterdir():
        if p.name.startswith("."):
            continue  # a temp file or dir of an unfinished write: never read by anyone
        if p.suffix == ".safetensors":
            _tensors(p)
        elif p.name.endswith(ckpt.STATE_SUFFIX):
            assert ckpt.resolve_resume(p) == p, f"{what}: {p.name} is not resumable"


class Reference:
    def __init__(self, run: Run, run_dir: Path):
        self.losses = run.losses()
        self.final = _tensors(run_dir / "tiny.safetensors")
        self.state = _tensors(run_dir / "tiny-state" / ckpt.ACCELERATOR_DIR / ckpt.TRAINABLE_FILE)
        steps = [r for r in run.records() if r["event"] == "step"]
        self.step_s = (steps[-1]["time"] - steps[0]["time"]) / (len(steps) - 1)


def kill_and_resume(ctx, folder: Path, model: Path, data: Path, plan, ref: Reference, where: str) -> str:
    """One trial: a fresh run killed at the planned point, then resumed from its newest state. Returns the outcome."""
    what, condition, delay = plan
    for attempt in range(3):  # a run that got to its end before the kill (a starved poller) is tried again
        trial = folder / f"attempt{attempt}"
        trial.mkdir(parents=True)
        run_dir = trial / "out" / "tiny"
        victim = Run(ctx, _config(trial, model, data), "killed")
        resumable = False
        while victim.process.is_alive():
            resumable = resumable or ckpt.latest_state(run_dir) is not None  # kill only once there is a state
            if resumable and condition(victim, run_dir):
                break
            time.sleep(0.001)
        time.sleep(delay)
        victim.process.kill()
        if victim.wait() == -signal.SIGKILL:
            break
    else:
        pytest.fail(f"{where}: the run ended before the kill 3 times\n{victim.output()}")
    _assert_whole(run_dir, where)
    killed_losses = victim.losses()
    assert all(killed_losses[s] == ref.losses[s] for s in killed_losses), where

    state = ckpt.latest_state(run_dir)
    resumed_at = ckpt.read_state(state)["global_step"]
    resume = Run(ctx, _config(trial, model, data, resume_from=state), "resumed")
    code = resume.wait()
    if resumed_at == STEPS:  # killed after the final state: nothing is left to do, and it says so
        assert code != 0 and f"finished (step {STEPS} of {STEPS}" in resume.output(), f"{where}\n{resume.output()}"
        assert not resume.losses(), where
    else:
        assert code == 0, f"{where}: the resume from step {resumed_at} failed\n{resume.output()}"
        losses = resume.losses()
        assert sorted(losses) == list(range(resumed_at + 1, STEPS + 1)), where
        assert all(losses[s] == ref.losses[s] for s in losses), f"{where}: losses differ from the reference"
    _assert_equal_tensors(_tensors(run_dir / "tiny.safetensors"), ref.final, f"{where}: final checkpoint")
    _assert_equal_tensors(_tensors(run_dir / "tiny-state" / ckpt.ACCELERATOR_DIR / ckpt.TRAINABLE_FILE),
                          ref.state, f"{where}: final state")
    _assert_whole(run_dir, where)
    outcome = "finished" if resumed_at == STEPS else f"resumed at step {resumed_at}"
    return f"{what}: {outcome}" + (f" (attempt {attempt + 1})" if attempt else "")


@pytest.mark.slow
def test_sigkill_at_random_points_then_resume_reaches_the_same_weights_and_losses(forkserver, tiny_anima, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    data = tmp_path / "data"
    make_synthetic_latents(data, n=6, seed=0)
    model = tiny_anima.diffusers_dir
    (tmp_path / "reference").mkdir()
    run = Run(forkserver, _config(tmp_path / "reference", model, data), "run")
    assert run.wait() == 0, run.output()
    ref = Reference(run, tmp_path / "reference" / "out" / "tiny")
    assert sorted(ref.losses) == list(range(1, STEPS + 1))

    plans = kill_plans(random.Random(SEED), ref.step_s)
    with ThreadPoolExecutor(max_workers=2) as pool:  # two runs at a time: one per core
        futures = [pool.submit(kill_and_resume, forkserver, tmp_path / f"trial{i}", model, data, plan, ref,
                               f"kill {i} ({plan[0]}; ANIMA_FAULT_SEED={SEED})") for i, plan in enumerate(plans)]
        outcomes = [f.result() for f in futures]
    assert len(outcomes) == KILLS >= 10 and any(": finished" in o for o in outcomes)
    print(f"\n{KILLS} kills in {time.perf_counter() - t0:.1f} s (ANIMA_FAULT_SEED={SEED}):\n  " + "\n  ".join(outcomes))
