"""A run never replaces another run's files: a fresh run into a used run folder, a second process in a folder that
is being trained into, and a stop file that already exists are all refused before the model loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anima_train.outputs import manifest, run_folder
from anima_train.training.train import train
from tests.fixtures_tiny import anima_train_cli, folder_digests
from tests.test_train import make_cfg

ROOT = Path(__file__).resolve().parents[1]


def test_a_fresh_run_refuses_a_folder_holding_an_earlier_run_and_resuming_it_works(tiny_anima, latents_dir,
                                                                                   tmp_path):
    kw = dict(max_steps=2, save_every_steps=1, save_optimizer_state="true")
    earlier = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, **kw), cpu=True)
    run_dir = tmp_path / "tiny"
    before = folder_digests(run_dir)
    assert "tiny.safetensors" in before and "tiny.toml" in before

    # the CLI, as a user runs it a second time with the same config
    config = tmp_path / "again.toml"
    config.write_text(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, **kw).source_text)
    events = tmp_path / "events.jsonl"
    out = anima_train_cli("train", config, "--cpu", "--events", events, cwd=tmp_path)
    assert out.returncode != 0, out.stdout[-2000:]
    err = out.stderr
    assert str(run_dir) in err and "already holds a run named 'tiny'" in err
    assert f'resume_from = "{(run_dir / "tiny-state").as_posix()}"' in err  # its latest state (step 2)
    assert 'run_name = "tiny-2"' in err and "--overwrite" in err
    assert folder_digests(run_dir) == before  # not one byte of the earlier run changed
    statuses = [json.loads(line).get("message") for line in events.read_text().splitlines()] if events.exists() else []
    assert "loading model" not in statuses  # refused before the model loads

    # resuming the run that lives in the folder (from its newest state) is not a fresh run: allowed
    resumed = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, max_steps=3, save_optimizer_state="true",
                             resume_from=f'"{run_dir / "tiny-state"}"'), cpu=True)
    assert resumed.global_step == 3 and resumed.losses and earlier.global_step == 2


def test_overwrite_deletes_only_the_earlier_runs_files_and_says_which(tiny_anima, latents_dir, tmp_path, capsys):
    run_dir = tmp_path / "tiny"
    (run_dir / "tiny-step000009-state").mkdir(parents=True)
    (run_dir / "tiny-step000009-state" / "state.json").write_text('{"global_step": 9}')
    (run_dir / "tiny-step000009.safetensors").write_bytes(b"an old checkpoint")
    (run_dir / "tiny.toml").write_text("# the old run's config\n")
    (run_dir / "notes.txt").write_text("my notes")  # not a run file: never touched
    (run_dir / "comfyui-worker.log").write_text("the node's log")
    (run_dir / "samples").mkdir()  # the earlier run's previews and loss plot are its files too
    (run_dir / "samples" / "step000009-prompt00.png").write_bytes(b"an old preview")
    (run_dir / "loss.png").write_bytes(b"the old run's loss plot")
    # the earlier run recorded what it wrote (notes.txt and the log are not in it)
    manifest.start(run_dir, "tiny", adopted=["tiny-step000009-state", "tiny-step000009.safetensors", "tiny.toml",
                                             "samples", "loss.png"])
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, max_steps=1)
    with pytest.raises(ValueError, match="already holds a run"):
        train(cfg, cpu=True)
    result = train(cfg, cpu=True, overwrite=True)
    said = capsys.readouterr().out
    assert f"--overwrite: deleting the earlier run's 5 file(s) in {run_dir}" in said
    assert "tiny-step000009-state/" in said and "tiny-step000009.safetensors" in said and "tiny.toml" in said
    assert "samples/" in said and "loss.png" in said
    names = sorted(p.name for p in run_dir.iterdir())
    assert names == [".anima-train-run.json", "comfyui-worker.log", "loss.png", "notes.txt", "tiny.safetensors",
                     "tiny.toml"]
    assert (run_dir / "loss.png").read_bytes().startswith(b"\x89PNG")  # this run's plot, not the old one
    assert (run_dir / "tiny.toml").read_text() == cfg.source_text and result.final == run_dir / "tiny.safetensors"


def test_a_second_process_cannot_train_into_a_run_folder_in_use(tiny_anima, latents_dir, tmp_path, capsys):
    long_run = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, max_steps=100000)
    config = tmp_path / "long.toml"
    config.write_text(long_run.source_text)
    events = tmp_path / "events.jsonl"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    holder = subprocess.Popen([sys.executable, "-m", "anima_train", "train", str(config), "--cpu", "--events",
                               str(events)], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (events.exists() and '"event": "step"' in events.read_text()):
            assert holder.poll() is None, holder.stderr.read()
            assert time.monotonic() < deadline, "the first run never reached a step"
            time.sleep(0.2)
        second = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, max_steps=1)
        with pytest.raises(ValueError) as refused:
            train(second, cpu=True)
        msg = str(refused.value)
        assert f"{tmp_path / 'tiny'} is in use by another training run" in msg
        assert f"pid {holder.pid} on {socket.gethostname()}, started " in msg
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the holder was killed: its lock is stale, and is taken over (the folder holds its config copy: --overwrite)
    capsys.readouterr()
    result = train(second, cpu=True, overwrite=True)
    said = capsys.readouterr().out
    assert f"taking over the lock of {tmp_path / 'tiny'} left by pid {holder.pid}" in said
    assert "which is no longer running" in said
    assert result.final.is_file() and not (tmp_path / "tiny" / ".anima-train.lock").exists()


def test_an_existing_stop_file_is_refused_before_the_run_starts(tiny_anima, latents_dir, tmp_path):
    stop = tmp_path / "STOP"
    stop.write_text("left over from yesterday")
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, max_steps=5)
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as refused:
        train(cfg, cpu=True, stop_file=str(stop))
    assert f"--stop-file {stop}: the file already exists" in str(refused.value)
    assert "delete it" in str(refused.value)
    assert stop.read_text() == "left over from yesterday"  # not ours to delete: it may be another job's request
    assert not (tmp_path / "tiny").exists()  # nothing was written
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("output_dir_existed", [False, True], ids=["new-output-folder", "existing-output-folder"])
def test_a_run_stopped_before_it_wrote_anything_leaves_no_folder(tiny_anima, latents_dir, tmp_path, monkeypatch,
                                                                   output_dir_existed):
    """Ctrl-C while the model loaded left an empty run folder (and output folder) behind: the lock made them.
    A folder that was there before stays, empty or not."""
    out = tmp_path / "out"
    if output_dir_existed:
        out.mkdir()

    def interrupted(*_args, **_kwargs):
        assert (out / "tiny" / ".anima-train.lock").is_file()  # the run got as far as its lock
        raise KeyboardInterrupt

    monkeypatch.setattr("anima_train.training.train.build_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(make_cfg(tiny_anima.diffusers_dir, latents_dir, out, max_steps=3), cpu=True)
    assert sorted(os.listdir(tmp_path)) == (["out"] if output_dir_existed else [])
    if output_dir_existed:
        assert os.listdir(out) == []


def test_a_lock_taken_while_the_last_holder_takes_its_folder_back_is_taken(tmp_path, monkeypatch):
    """The folder is removed between this lock's mkdir and its open: the lock makes it again and is held (not the
    "cannot create the lock file" note, which would leave the run unlocked)."""
    real_open, gone = os.open, []

    def open_after_the_folder_went(path, *args):
        if not gone:
            gone.append(os.rmdir(Path(path).parent))
        return real_open(path, *args)

    monkeypatch.setattr(run_folder.os, "open", open_after_the_folder_went)
    lock = run_folder.RunLock(tmp_path / "out" / "run")
    lock.acquire(say=pytest.fail)
    assert gone and run_folder.lock_holder(tmp_path / "out" / "run")["pid"] == os.getpid()
    lock.release()
    assert os.listdir(tmp_path) == []


def test_only_the_runs_own_files_count_as_an_earlier_run(tmp_path):
    from anima_train.outputs.run_folder import free_run_name, latest_state, run_files

    run = tmp_path / "cat"
    run.mkdir()
    for name in ("cat-2.safetensors", "catnip.safetensors", "comfyui-job.toml", "comfyui-worker.log",
                 "cat-step000003.toml", "notes.txt", ".cat.safetensors.tmp-12"):
        (run / name).write_text("x")
    assert run_files(run, "cat") == []  # other runs' names, node job files, temp files: not this run
    for name in ("cat.toml", "cat.safetensors", "cat_te.safetensors", "cat-step000004.safetensors",
                 "cat-epoch002_te.safetensors"):
        (run / name).write_text("x")
    for name, step in (("cat-step000004-state", 4), ("cat-state", 9), ("cat", None)):  # `cat/`: diffusers final
        (run / name).mkdir()
        if step is not None:
            (run / name / "state.json").write_text(json.dumps({"global_step": step}))
    assert [p.name for p in run_files(run, "cat")] == [
        "cat", "cat-epoch002_te.safetensors", "cat-state", "cat-step000004-state", "cat-step000004.safetensors",
        "cat.safetensors", "cat.toml", "cat_te.safetensors"]
    assert latest_state(run, "cat") == run / "cat-state"
    (tmp_path / "cat-2").mkdir()
    (tmp_path / "cat-2" / "cat-2.toml").write_text("x")
    assert free_run_name(tmp_path, "cat") == "cat-3"
