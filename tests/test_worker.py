"""nodes/worker.py: spawning, event relay, cancel (graceful stop, then the whole process group), result re-use.

The "trainer" here is a small Python script speaking the worker protocol (JSON events on stdout, text on stderr,
`--stop-file`), so every path — including a worker that ignores SIGTERM and one with a child process in its
group — runs in a fraction of a second without torch.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from nodes import run_records, worker
from anima_train.outputs.layout import MANIFEST_NAME

FAKE = textwrap.dedent(r'''
    import json, os, signal, subprocess, sys, time
    mode, stop_file, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    def ev(kind, **kw):
        print(json.dumps({"event": kind, **kw}), flush=True)
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode in ("child", "ignore_term"):  # a grandchild in the same group, like a DataLoader worker
        child = subprocess.Popen([sys.executable, "-c", "import time, signal; "
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
        open(os.path.join(out_dir, "child.pid"), "w").write(str(child.pid))
    if mode == "silent":
        time.sleep(60)
    print("plain text line on stdout", flush=True)
    print("a warning on stderr", file=sys.stderr, flush=True)
    ev("start", total=50, resumed_step=0)
    for step in range(1, 51):
        if os.path.exists(stop_file) and mode != "ignore_term":
            ev("checkpoint", path=os.path.join(out_dir, "stopped.safetensors"), step=step - 1)
            ev("done", step=step - 1, final=None, stopped=True)
            sys.exit(0)
        if mode == "fail" and step == 3:
            print("Traceback (most recent call last):\n  ValueError: the dataset is empty", file=sys.stderr, flush=True)
            ev("error", message="ValueError: the dataset is empty", traceback="...")
            sys.exit(3)
        ev("step", step=step, total=50, loss=1.0 / step)
        time.sleep(0.02 if mode in ("ok", "fail") else 0.1)
        if mode == "ok" and step == 5:
            ev("done", step=5, final=os.path.join(out_dir, "final.safetensors"))
            sys.exit(0)
''')


class Stop(BaseException):
    """Stands in for ComfyUI's InterruptProcessingException (also a BaseException)."""


@pytest.fixture
def fake(tmp_path):
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE)

    def cmd(mode):
        return [sys.executable, "-u", str(script), mode, str(tmp_path / "STOP"), str(tmp_path)]
    return cmd


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_events_are_relayed_in_order_and_text_goes_to_lines_and_log(fake, tmp_path):
    seen, texts = [], []
    res = worker.run_job(fake("ok"), log_path=tmp_path / "w.log", on_event=seen.append, on_line=texts.append)
    assert res.returncode == 0
    assert [e["event"] for e in seen] == ["start"] + ["step"] * 5 + ["done"]
    assert [e["step"] for e in seen if e["event"] == "step"] == [1, 2, 3, 4, 5]
    assert texts == ["plain text line on stdout"] and res.lines == texts
    assert "a warning on stderr" in (tmp_path / "w.log").read_text()
    assert res.last("done")["final"].endswith("final.safetensors")
    worker.raise_for_failure(res, "x")  # no exception


def test_failure_carries_the_error_event_and_the_log_tail(fake, tmp_path):
    res = worker.run_job(fake("fail"), log_path=tmp_path / "w.log")
    assert res.returncode == 3
    with pytest.raises(worker.WorkerError) as exc:
        worker.raise_for_failure(res, "training demo")
    msg = str(exc.value)
    assert msg.startswith("training demo failed (worker exit status 3)")
    assert "ValueError: the dataset is empty" in msg and "Traceback" in msg  # event + stderr tail
    assert f"full log: {tmp_path / 'w.log'}" in msg


def test_log_tail_shows_only_the_last_run(fake, tmp_path):
    log = tmp_path / "w.log"
    worker.run_job(fake("fail"), log_path=log)
    worker.run_job(fake("ok"), log_path=log)
    tail = worker.log_tail(log)
    assert "a warning on stderr" in tail and "Traceback" not in tail


def test_cancel_stops_gracefully_then_no_process_of_the_group_survives(fake, tmp_path):
    steps, after = [], []

    def check():
        if len(steps) >= 2:
            raise Stop()

    t0 = time.perf_counter()
    with pytest.raises(Stop):
        worker.run_job(fake("child"), log_path=tmp_path / "w.log", on_event=steps.append, check_interrupt=check,
                       stop_file=tmp_path / "STOP", grace_s=5, on_stop_event=after.append, term_wait_s=1.0)
    elapsed = time.perf_counter() - t0
    # the worker saw the stop file and reported its checkpoint through on_stop_event
    assert [e["event"] for e in after][:1] == ["checkpoint"] and after[-1]["event"] == "done"
    assert not (tmp_path / "STOP").exists()  # cleaned up for the next run
    child = int((tmp_path / "child.pid").read_text())
    assert not _pid_alive(child), "the worker's child (same process group) survived the cancel"
    assert elapsed < 5.0


def test_a_worker_ignoring_sigterm_is_killed(fake, tmp_path):
    events = []
    started = threading.Event()

    def check():
        if any(e["event"] == "step" for e in events):
            started.set()
            raise Stop()

    t0 = time.perf_counter()
    with pytest.raises(Stop):
        worker.run_job(fake("ignore_term"), log_path=tmp_path / "w.log", on_event=events.append,
                       check_interrupt=check, stop_file=tmp_path / "STOP", grace_s=0.3, term_wait_s=0.5)
    child = int((tmp_path / "child.pid").read_text())
    assert not _pid_alive(child)
    assert time.perf_counter() - t0 < 4.0


def test_interrupt_is_checked_while_the_worker_is_silent(fake, tmp_path):
    flag = threading.Event()
    threading.Timer(0.3, flag.set).start()

    def check():
        if flag.is_set():
            raise Stop()

    t0 = time.perf_counter()
    with pytest.raises(Stop):
        worker.run_job(fake("silent"), log_path=tmp_path / "w.log", check_interrupt=check, poll_s=0.1,
                       stop_file=tmp_path / "STOP", grace_s=0.2, term_wait_s=0.5)
    # 0.3 s until Cancel + at most one poll + the short grace and term waits; a blocking readline would hang 60 s
    assert time.perf_counter() - t0 < 2.5


def test_a_stale_stop_file_is_removed_before_the_run(fake, tmp_path):
    (tmp_path / "STOP").write_text("left over")
    seen = []
    res = worker.run_job(fake("ok"), log_path=tmp_path / "w.log", on_event=seen.append, stop_file=tmp_path / "STOP")
    assert res.returncode == 0 and not any(e.get("stopped") for e in seen)


def test_commands_and_environment(tmp_path):
    one = worker.anima_train_command(["train", "c.toml"], python="py")
    assert one == ["py", "-u", "-X", "utf8", "-m", "anima_train", "train", "c.toml"]  # -X utf8 everywhere
    two = worker.anima_train_command(["train", "c.toml"], processes=2, python="py")
    assert two[:6] == ["py", "-u", "-X", "utf8", "-m", "accelerate.commands.launch"]
    assert two[two.index("--num_processes") + 1] == "2" and "--multi_gpu" in two
    assert two[-4:] == ["-m", "anima_train", "train", "c.toml"]
    with pytest.raises(ValueError):
        worker.anima_train_command(["train"], processes=0)
    env = worker.worker_env(base={"PYTHONPATH": f"/a{os.pathsep}{worker.pack_dir()}"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(worker.pack_dir()), "/a"]
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["ANIMA_TRAIN_PARENT_PID"] == str(os.getpid())  # the worker ends (saving first) if ComfyUI ends
    # The allocator ComfyUI adds for itself (cudaMallocAsync) does not reach the worker, which trains on torch's own
    # as a shell's run does; the rest of a setting reaches it under the name this torch reads (no deprecation line)
    env = worker.worker_env(base={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    assert "PYTORCH_ALLOC_CONF" not in env and "PYTORCH_CUDA_ALLOC_CONF" not in env
    env = worker.worker_env(
        base={"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6,backend:cudaMallocAsync"})
    assert env["PYTORCH_ALLOC_CONF"] == "garbage_collection_threshold:0.6" and "PYTORCH_CUDA_ALLOC_CONF" not in env
    kept = worker.worker_env(base={"PYTORCH_CUDA_ALLOC_CONF": "a", "PYTORCH_ALLOC_CONF": "b"})
    assert (kept["PYTORCH_CUDA_ALLOC_CONF"], kept["PYTORCH_ALLOC_CONF"]) == ("a", "b")  # the user's own: as set


# -- the standby worker: the next job's process, started ahead with its imports done -----------------------------


@pytest.fixture
def config_job(tmp_path):
    """A quick real job with a user error (exit status 2): `anima-train config bad.toml` in a run folder, its message
    naming the file by the relative path, so it also shows which folder the job ran in."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "bad.toml").write_text("[train]\nbogus_key = 1\n")
    yield worker.anima_train_command(["config", "bad.toml"]), run
    worker.stop_standby()


def _waiting() -> int | None:
    proc = worker._standby.get("proc")
    return proc.pid if proc is not None and proc.poll() is None else None


def _body(log: Path) -> list[str]:
    header, *rest = log.read_text(encoding="utf-8").lstrip("\n").splitlines()
    assert header.startswith("==== ") and header.endswith(" -u -X utf8 -m anima_train config bad.toml"), header
    return rest


def test_the_next_job_runs_in_the_waiting_worker_as_in_a_started_one(config_job, tmp_path):
    """Fails without the standby (no worker.start_standby; run_job has no `standby`): the job would start its own
    process and wait for its imports again."""
    cmd, run = config_job
    env = worker.worker_env()
    started = worker.run_job(cmd, log_path=tmp_path / "started.log", env=env, cwd=run)
    worker.start_standby(env)
    waiting = _waiting()
    assert waiting is not None
    res = worker.run_job(cmd, log_path=run / worker.LOG_NAME, env=env, cwd=run, standby=True)
    assert res.pid == waiting  # it ran in the waiting worker
    assert res.returncode == started.returncode == 2
    assert "bad.toml: 3 problems in the config" in _body(run / worker.LOG_NAME)[0]  # in the job's folder, its log
    assert _body(run / worker.LOG_NAME) == _body(tmp_path / "started.log")  # what a started worker says
    assert _waiting() not in (None, waiting)  # and another one waits for the next job


def test_a_waiting_worker_runs_a_job_only_of_its_own_environment_and_while_it_lives(config_job):
    cmd, run = config_job
    env = worker.worker_env()
    worker.start_standby(env)
    first = worker._standby["proc"]
    other = {**env, "ANIMA_TRAIN_TEST_OTHER": "1"}  # e.g. a variable read when torch is imported
    res = worker.run_job(cmd, log_path=run / "a.log", env=other, cwd=run, standby=True)
    assert res.returncode == 2 and res.pid != first.pid
    assert first.wait(30) is not None  # the one that could not run it is ended
    assert worker._standby["env"] == other  # the next one is started with the new environment
    worker._standby["proc"].kill()
    worker._standby["proc"].wait(30)
    res = worker.run_job(cmd, log_path=run / "b.log", env=other, cwd=run, standby=True)  # a dead one: started anew
    assert res.returncode == 2 and "bad.toml: 3 problems" in (run / "b.log").read_text(encoding="utf-8")
    res = worker.run_job(cmd, log_path=run / "c.log", env=other, cwd=run)  # without standby: none is taken
    assert _waiting() is not None and res.pid != _waiting()


def test_a_command_a_waiting_worker_cannot_run_starts_none(fake, tmp_path):
    res = worker.run_job(fake("ok"), log_path=tmp_path / "w.log", standby=True)
    assert res.returncode == 0 and _waiting() is None


def test_no_waiting_worker_where_comfyui_was_started_without(config_job, monkeypatch):
    cmd, run = config_job
    monkeypatch.setenv(worker.STANDBY_ENV, "0")
    env = worker.worker_env()
    worker.start_standby(env)
    res = worker.run_job(cmd, log_path=run / "a.log", env=env, cwd=run, standby=True)
    assert res.returncode == 2 and _waiting() is None


def test_a_waiting_worker_ends_at_the_end_of_its_input():
    worker.start_standby(worker.worker_env())
    proc = worker._standby["proc"]
    try:
        proc.stdin.close()  # ComfyUI let it go or ended
        assert proc.wait(120) == 0  # after its imports, having run nothing
    finally:
        worker.stop_standby()


def test_parse_event():
    assert worker.parse_event('{"event": "step", "step": 3}') == {"event": "step", "step": 3}
    assert worker.parse_event('{"step": 3}') is None  # not an event
    assert worker.parse_event("loss 0.1") is None
    assert worker.parse_event("{not json}") is None


# -- re-use ----------------------------------------------------------------------------------------------------


def test_dataset_digest_sees_changes_but_not_unrelated_files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.png").write_bytes(b"x")
    (data / "a.txt").write_text("red circle")
    d0 = run_records.dataset_digest([data])
    (data / "notes.md").write_text("unrelated")
    assert run_records.dataset_digest([data]) == d0
    (data / "a.txt").write_text("blue circle, longer")
    d1 = run_records.dataset_digest([data])
    assert d1 != d0
    (data / "b.jpg").write_bytes(b"y")
    assert run_records.dataset_digest([data]) != d1
    assert run_records.dataset_digest([tmp_path / "missing"]) != run_records.dataset_digest([data])


def test_manifest_reuse_needs_the_same_key_and_an_unchanged_file(tmp_path):
    final = tmp_path / "run.safetensors"
    final.write_bytes(b"weights")
    key = run_records.result_key(toml="a", dataset="d")
    assert run_records.reusable_result(tmp_path, key) is None  # nothing recorded yet
    run_records.write_manifest(tmp_path, key, final, steps=7, losses=[0.5])
    got = run_records.reusable_result(tmp_path, key)
    assert got["steps"] == 7 and got["final"]["path"] == str(final)
    assert run_records.reusable_result(tmp_path, run_records.result_key(toml="b", dataset="d")) is None
    final.write_bytes(b"weights, edited")
    assert run_records.reusable_result(tmp_path, key) is None


def test_publish_copy_never_replaces_another_file(tmp_path):
    src = tmp_path / "run" / "x.safetensors"
    src.parent.mkdir()
    src.write_bytes(b"trained")
    loras = tmp_path / "loras"
    loras.mkdir()
    (loras / "x.safetensors").write_bytes(b"the user's own file")
    first = run_records.publish_copy(src, loras)
    assert first.name == "x-2.safetensors" and first.read_bytes() == b"trained"
    assert (loras / "x.safetensors").read_bytes() == b"the user's own file"
    assert run_records.publish_copy(src, loras) == first  # same bytes: re-used, not copied again
    src.write_bytes(b"trained again")
    third = run_records.publish_copy(src, loras)
    assert third.name == "x-3.safetensors" and first.read_bytes() == b"trained"
    assert not [p for p in loras.iterdir() if p.name.startswith(".")]  # no temp files left


def test_write_json_roundtrip(tmp_path):
    path = run_records.write_json(tmp_path / "m.json", {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}


def test_an_unstarted_run_folder_goes_but_one_holding_anything_else_stays(tmp_path):
    job = {"comfyui-job.toml", ".comfyui-job.lock"}
    fresh = tmp_path / "run-3"  # what a Cancel during model load left: the job's TOML, the log, a stop file, locks
    fresh.mkdir()
    for name in ("comfyui-job.toml", ".comfyui-job.lock", worker.LOG_NAME, ".anima-train.lock",
                 worker.job_stop_file(fresh).name, MANIFEST_NAME):  # the trainer claimed the folder before loading
        (fresh / name).write_text("x")
    assert run_records.discard_unstarted_run(fresh, job) and not fresh.exists()
    for extra in ("cat.safetensors", "notes.txt"):  # an earlier run's file, a user's file
        kept = tmp_path / f"kept-{extra}"
        kept.mkdir()
        (kept / "comfyui-job.toml").write_text("x")
        (kept / extra).write_text("mine")
        assert not run_records.discard_unstarted_run(kept, job)
        assert (kept / extra).read_text() == "mine" and (kept / "comfyui-job.toml").is_file()
