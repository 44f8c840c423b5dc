"""Hostile inputs that used to lose a run or train something silently wrong (issue 24), fed through the real CLI:
each asserts the one line a user reads on stderr, the exit status, and the run folder's bytes before and after.

Lost: `--overwrite` deleted the earlier run before the new one was checked; a resume from an older state of a
finished run replaced its final; an edited state.json was trusted; `config --reference --out` replaced a file.
Silently wrong: NaN weights saved with exit 0 (a diverging lr, a cache of NaNs); a resumed run's loss.png showed only
its own steps; a rank change on resume died in torch; a run that saved nothing blocked its fixed re-run; a missing
state was called "inference-only (save_optimizer_state = false)"."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from anima_train.outputs.layout import MANIFEST_NAME
from anima_train import errors
from anima_train.training.divergence import Diverged
from anima_train.training.train import train
from tests.fixtures_tiny import anima_train_cli, folder_digests
from tests.test_train import make_cfg

ROOT = Path(__file__).resolve().parents[1]
STATES = dict(save_every_steps=2, save_optimizer_state="true")  # the finished run: 6 steps, a state every 2



@pytest.fixture(scope="module")
def finished(tiny_anima, latents_dir, tmp_path_factory):
    """A finished run `tiny` (6 steps, states at 2, 4 and the final), made once; tests copy it (`_copy_run`)."""
    out = tmp_path_factory.mktemp("finished")
    train(make_cfg(tiny_anima.diffusers_dir, latents_dir, out, max_steps=6, **STATES), cpu=True)
    return out / "tiny"


def _copy_run(finished: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "out" / "tiny"
    shutil.copytree(finished, run_dir)
    return run_dir


def _config(tmp_path: Path, model: Path, data: Path, extra: str = "", name: str = "run.toml", **keys) -> Path:
    """The config a user writes: output_dir = tmp_path/out, run `tiny`; `keys`: more [train] keys (TOML values)."""
    text = make_cfg(model, data, tmp_path / "out", extra, **keys).source_text
    path = tmp_path / name
    path.write_text(text)
    return path






def _error_line(out: subprocess.CompletedProcess, command: str = "train") -> str:
    """The error a user reads: one `anima-train CMD: error:` message (the preflight's may list its problems below),
    and no traceback."""
    assert "Traceback" not in out.stderr and "internal error" not in out.stderr, out.stderr[-3000:]
    errs = [line for line in out.stderr.splitlines() if line.startswith(f"anima-train {command}: error: ")]
    assert len(errs) == 1, out.stderr[-3000:]
    return out.stderr[out.stderr.index(errs[0]):]


def _all_finite(path: Path) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in load_file(str(path)).values())


# -- 1. --overwrite ------------------------------------------------------------------------------------------------


def test_overwrite_puts_the_earlier_run_back_when_the_new_run_is_refused(tiny_anima, finished, tmp_path):
    run_dir = _copy_run(finished, tmp_path)
    before = folder_digests(run_dir)
    data = tmp_path / "photos"
    data.mkdir()
    jpeg = data / "cat.jpg"
    from PIL import Image

    Image.new("RGB", (256, 256), (200, 30, 30)).save(jpeg, quality=95)
    jpeg.write_bytes(jpeg.read_bytes()[: jpeg.stat().st_size // 2])  # truncated
    (data / "cat.txt").write_text("a cat")
    config = _config(tmp_path, tiny_anima.diffusers_dir, data, max_steps=2)
    out = anima_train_cli("train", config, "--cpu", "--overwrite", cwd=tmp_path)
    assert out.returncode == errors.USER_ERROR_EXIT, out.stderr[-3000:]
    assert "cat" in _error_line(out)  # the image (or its missing cache) is named
    assert "put the earlier run's 8 file(s) back" in out.stdout
    assert folder_digests(run_dir) == before  # not one byte lost, no set-aside folder left behind


# -- 2. a resume from an older state of a finished run -------------------------------------------------------------


def test_resuming_a_finished_run_from_an_older_state_is_refused_and_replaces_nothing(tiny_anima, latents_dir,
                                                                                    finished, tmp_path):
    run_dir = _copy_run(finished, tmp_path)
    before = folder_digests(run_dir)
    older = run_dir / "tiny-step000002-state"
    config = _config(tmp_path, tiny_anima.diffusers_dir, latents_dir, max_steps=3, resume_from=f'"{older}"',
                     **STATES)
    for command in ("train", "config"):  # the preflight says it too
        out = anima_train_cli(command, config, *(["--cpu"] if command == "train" else []), cwd=tmp_path)
        assert out.returncode == errors.USER_ERROR_EXIT, out.stderr[-3000:]
        msg = _error_line(out, command)
        assert f"resume_from = '{older}' is at step 2" in msg
        assert f"{run_dir / 'tiny-state'} (step 6)" in msg  # the newer file
        assert f'resume_from = "{(run_dir / "tiny-state").as_posix()}"' in msg and 'run_name = "tiny-2"' in msg
    assert folder_digests(run_dir) == before


# -- 3. config --reference --out -----------------------------------------------------------------------------------


def test_config_reference_out_refuses_an_existing_file(tmp_path):
    mine = tmp_path / "notes.md"
    mine.write_text("my own notes\n")
    out = anima_train_cli("config", "--reference", "--out", mine, cwd=tmp_path)
    assert out.returncode == errors.USER_ERROR_EXIT
    msg = _error_line(out, "config")
    assert f"--out {mine}: the file already exists" in msg and "another path" in msg and "delete" in msg
    assert mine.read_text() == "my own notes\n"
    fresh = tmp_path / "reference.md"
    assert anima_train_cli("config", "--reference", "--out", fresh, cwd=tmp_path).returncode == 0
    assert fresh.read_text() == anima_train_cli("config", "--reference", cwd=tmp_path).stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.md", "reference.md"]  # no temp file left


# -- 4. an edited state.json ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("edit, said", [
    ({"global_step": -5}, "global_step = -5 is below 1"),
    ({"global_step": "6"}, 'global_step = "6" is not a whole number'),
    ({"global_step": 5}, "global_step = 5, but its checkpoint tiny.safetensors was saved at step 6"),
    ({"epoch": -1}, "epoch = -1 is below 0"),
    ({"batch_in_epoch": 999}, "batch_in_epoch = 999 is past the end of an epoch (3 batches per epoch here)"),
])
def test_an_edited_state_json_is_refused_naming_the_key_and_the_file(tiny_anima, latents_dir, finished, tmp_path,
                                                                    edit, said):
    run_dir = _copy_run(finished, tmp_path)
    state = run_dir / "tiny-state"
    info = json.loads((state / "state.json").read_text())
    (state / "state.json").write_text(json.dumps({**info, **edit}))
    before = folder_digests(run_dir)
    config = _config(tmp_path, tiny_anima.diffusers_dir, latents_dir, max_steps=9, resume_from=f'"{state}"',
                     **STATES)
    out = anima_train_cli("train", config, "--cpu", cwd=tmp_path)
    assert out.returncode == errors.USER_ERROR_EXIT, out.stderr[-3000:]
    msg = _error_line(out)
    assert f"{state / 'state.json'}: {said}" in msg and "cannot be resumed" in msg
    assert str(run_dir / "tiny-step000004-state") in msg  # the state to resume from instead
    assert folder_digests(run_dir) == before


# -- 5. non-finite loss, gradient, cache ---------------------------------------------------------------------------


def test_a_diverging_run_stops_at_the_first_nan_loss_and_saves_nothing_of_it(tiny_anima, latents_dir, tmp_path):
    config = _config(tmp_path, tiny_anima.diffusers_dir, latents_dir, "[optimizer]\nlr = 1e6\n", max_steps=6,
                     save_every_steps=1, save_optimizer_state="true")
    out = anima_train_cli("train", config, "--cpu", cwd=tmp_path)
    assert out.returncode == errors.DIVERGED_EXIT == 5, out.stderr[-3000:]
    run_dir = tmp_path / "out" / "tiny"
    msg = _error_line(out)
    assert "training diverged at step 2: the loss is nan" in msg and "lower [optimizer] lr" in msg.lower()
    assert f"the last good checkpoint and state are kept (newest: {run_dir / 'tiny-step000001-state'})" in msg
    names = sorted(p.name for p in run_dir.iterdir() if p.name != MANIFEST_NAME)  # the run's record of its files
    assert names == ["tiny-step000001-state", "tiny-step000001.safetensors", "tiny.toml"]  # no final, no step 2
    for p in run_dir.rglob("*.safetensors"):
        assert _all_finite(p), p


def test_a_non_finite_gradient_norm_is_caught_before_the_next_save_even_without_clipping(
        tiny_anima, latents_dir, tmp_path, monkeypatch):
    # a gradient that overflows while the loss is still finite (what fp16 backward does): the norm at step 3
    real, calls = torch.nn.utils.get_total_norm, []

    def norm(grads, *args, **kwargs):
        calls.append(1)
        value = real(grads, *args, **kwargs)
        return value * float("inf") if len(calls) == 3 else value

    monkeypatch.setattr(torch.nn.utils, "get_total_norm", norm)
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, "[optimizer]\nmax_grad_norm = 0\n", max_steps=5,
                   save_every_steps=1, save_optimizer_state="true")
    with pytest.raises(Diverged, match="training diverged at step 3: the gradient norm is inf") as stopped:
        train(cfg, cpu=True)
    assert stopped.value.exit_code == errors.DIVERGED_EXIT
    run_dir = tmp_path / "tiny"
    assert (run_dir / "tiny-step000002-state").is_dir() and not (run_dir / "tiny-step000003.safetensors").exists()
    assert not (run_dir / "tiny.safetensors").exists()


def test_a_latent_cache_holding_nan_is_refused_like_a_damaged_one(tiny_anima, latents_dir, tmp_path):
    data = tmp_path / "latents"
    shutil.copytree(latents_dir, data)
    cache = sorted(data.glob("*_anima.safetensors"))[3]
    with safe_open(str(cache), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(cache))
    tensors["latents"][0, 0, 0, :2] = float("nan")
    save_file(tensors, str(cache), metadata=meta)
    before = folder_digests(data)
    config = _config(tmp_path, tiny_anima.diffusers_dir, data, max_steps=2)
    for command in ("config", "train"):
        out = anima_train_cli(command, config, *(["--cpu"] if command == "train" else []), cwd=tmp_path)
        assert out.returncode == errors.USER_ERROR_EXIT, out.stderr[-3000:]
        msg = _error_line(out, command)
        assert f"latent cache {cache} is damaged: its latents hold 2 non-finite value(s) (NaN/inf)" in msg
        assert "re-run anima-train cache" in msg
    assert folder_digests(tmp_path / "out") == {} and folder_digests(data) == before  # nothing trained, nothing written


# -- 7. loss.png after a resume --------------------------------------------------------------------------------------


def test_a_resumed_runs_loss_plot_shows_the_whole_run(tiny_anima, latents_dir, finished, tmp_path):
    run_dir = tmp_path / "out" / "tiny"
    run_dir.mkdir(parents=True)
    for name in ("tiny-step000002.safetensors", "tiny-step000002-state"):  # a run stopped after step 2
        (shutil.copytree if (finished / name).is_dir() else shutil.copy)(finished / name, run_dir / name)
    config = _config(tmp_path, tiny_anima.diffusers_dir, latents_dir, max_steps=6,
                     resume_from=f'"{run_dir / "tiny-step000002-state"}"', **STATES)
    out = anima_train_cli("train", config, "--cpu", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    # the resume is bit-exact, so the whole run's chart is the uninterrupted run's, byte for byte
    assert (run_dir / "loss.png").read_bytes() == (finished / "loss.png").read_bytes()
    losses = json.loads((run_dir / "tiny-state" / "losses.json").read_text())  # what the next resume will plot
    assert losses == json.loads((finished / "tiny-state" / "losses.json").read_text())
    assert losses["first_step"] == 1 and len(losses["losses"]) == 6


# -- 10. the adapter changed between the state and the config ---------------------------------------------------------


@pytest.mark.parametrize("described", [True, False], ids=["state-describes-adapter", "older-state"])
def test_resuming_with_another_adapter_rank_names_the_key(tiny_anima, latents_dir, finished, tmp_path, described):
    run_dir = _copy_run(finished, tmp_path)
    state = run_dir / "tiny-state"
    if not described:  # a state written before state.json described its adapter: the tensors' shapes are compared
        info = json.loads((state / "state.json").read_text())
        info.pop("adapter", None)
        (state / "state.json").write_text(json.dumps(info))
    before = folder_digests(run_dir)
    text = _config(tmp_path, tiny_anima.diffusers_dir, latents_dir, max_steps=9, resume_from=f'"{state}"',
                   **STATES).read_text().replace("rank = 8", "rank = 4")
    config = tmp_path / "rank4.toml"
    config.write_text(text)
    out = anima_train_cli("train", config, "--cpu", cwd=tmp_path)
    assert out.returncode == errors.USER_ERROR_EXIT, out.stderr[-3000:]
    msg = _error_line(out)
    if described:
        assert "[adapter] rank: the state has 8, this config has 4" in msg and "set [adapter] rank = 8" in msg
    else:
        assert "is [8, " in msg and "this run's is [4, " in msg and "[adapter]" in msg
    assert folder_digests(run_dir) == before


# -- 13. a run that saved nothing; a missing state; a folder that is no checkpoint --------------------------------


def test_a_run_that_failed_before_its_first_checkpoint_does_not_block_the_fixed_rerun(tiny_anima, latents_dir,
                                                                                      tmp_path):
    config = _config(tmp_path, tiny_anima.diffusers_dir, latents_dir, "[optimizer]\nlr = 1e6\n", max_steps=4)
    failed = anima_train_cli("train", config, "--cpu", cwd=tmp_path)
    assert failed.returncode == errors.DIVERGED_EXIT, failed.stderr[-3000:]
    run_dir = tmp_path / "out" / "tiny"
    assert sorted(p.name for p in run_dir.iterdir() if p.name != MANIFEST_NAME) == ["tiny.toml"]  # all it left
    fixed = _config(tmp_path, tiny_anima.diffusers_dir, latents_dir, max_steps=2, name="fixed.toml")
    out = anima_train_cli("train", fixed, "--cpu", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the config copy of an earlier run that saved no checkpoint" in out.stdout
    assert (run_dir / "tiny.toml").read_text() == fixed.read_text() and (run_dir / "tiny.safetensors").is_file()


@pytest.mark.parametrize("case", ["killed-during-state-write", "state-deleted", "dataset-folder"])
def test_a_resume_from_that_has_no_state_says_why_truthfully(tiny_anima, latents_dir, finished, tmp_path, case):
    run_dir = _copy_run(finished, tmp_path)
    shutil.rmtree(run_dir / "tiny-step000004-state")
    if case == "killed-during-state-write":  # what a kill -9 inside _save_state leaves: the temp folder
        (run_dir / ".tiny-step000004-state.tmp" / "accelerator").mkdir(parents=True)
    target = latents_dir if case == "dataset-folder" else run_dir / "tiny-step000004.safetensors"
    before = folder_digests(run_dir)
    config = _config(tmp_path, tiny_anima.diffusers_dir, latents_dir, max_steps=9, resume_from=f'"{target}"',
                     **STATES)
    out = anima_train_cli("train", config, "--cpu", cwd=tmp_path)
    assert out.returncode == errors.USER_ERROR_EXIT, out.stderr[-3000:]
    msg = _error_line(out)
    assert "save_optimizer_state = false" not in msg and "inference-only" not in msg  # it had true
    if case == "dataset-folder":
        assert f"resume_from = '{latents_dir}' is a folder that is neither a saved state" in msg
    else:
        assert "its state 'tiny-step000004-state' is not there" in msg
        assert ("being written when the run was interrupted" if case == "killed-during-state-write"
                else "is missing") in msg
        assert f"The newest state in {run_dir} is {run_dir / 'tiny-state'}" in msg
    assert folder_digests(run_dir) == before


def test_overwrite_killed_before_its_first_checkpoint_leaves_the_earlier_run_to_the_next_start(
        tiny_anima, latents_dir, finished, tmp_path):
    run_dir = _copy_run(finished, tmp_path)
    before = folder_digests(run_dir)
    config = _config(tmp_path, tiny_anima.diffusers_dir, latents_dir, max_steps=100000)  # saves nothing for ages
    events = tmp_path / "events.jsonl"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    victim = subprocess.Popen([sys.executable, "-m", "anima_train", "train", str(config), "--cpu", "--overwrite",
                               "--events", str(events)], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (events.exists() and '"event": "step"' in events.read_text()):
            assert victim.poll() is None, victim.stderr.read()
            assert time.monotonic() < deadline, "the run never reached a step"
            time.sleep(0.2)
    finally:
        victim.send_signal(signal.SIGKILL)  # no Python left to put the earlier run back
        victim.wait()
    assert sorted(p.name for p in run_dir.iterdir() if p.name != MANIFEST_NAME) == [
        ".anima-train-overwritten-tiny", ".anima-train.lock", "tiny.toml"]
    # the next start (here: the same config without --overwrite) finds the earlier run back in its place
    out = anima_train_cli("train", config, "--cpu", cwd=tmp_path)
    assert out.returncode == errors.USER_ERROR_EXIT, out.stderr[-3000:]
    assert "put the earlier run's 8 file(s) it had set aside back" in out.stdout
    assert "already holds a run named 'tiny'" in _error_line(out)
    assert folder_digests(run_dir) == before
