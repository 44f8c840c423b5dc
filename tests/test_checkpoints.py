"""Checkpoint naming, keep_last_n pruning and resume resolution (docs/training.md#outputs-and-resume)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from anima_train.outputs import checkpoint_files as C
from anima_train.config import parse_config
from anima_train.outputs import layout, manifest, resume_state


def _ckpt(run_dir: Path, stem: str, *, step_meta=None, te=False, state_step=None):
    meta = {"step": str(step_meta)} if step_meta is not None else {}
    save_file({"x": torch.zeros(1)}, str(run_dir / f"{stem}.safetensors"), metadata=meta)
    if te:
        save_file({"x": torch.zeros(1)}, str(run_dir / f"{stem}_te.safetensors"))
    if state_step is not None:
        d = run_dir / f"{stem}-state"
        (d / "accelerator").mkdir(parents=True)
        (d / "state.json").write_text(json.dumps({"global_step": state_step}))
        save_file({"0/w": torch.zeros(2)}, str(d / "accelerator" / "trainable.safetensors"))
        torch.save({"state": {}, "param_groups": []}, d / "accelerator" / "optimizer.pt")
        torch.save({"last_epoch": state_step}, d / "accelerator" / "scheduler.pt")


def test_names():
    assert layout.checkpoint_stem("run", step=60) == "run-step000060"
    assert layout.checkpoint_stem("run", epoch=5) == "run-epoch005"
    assert layout.checkpoint_stem("run") == "run"
    assert layout.state_dir_for(Path("o/run-step000060.safetensors")) == Path("o/run-step000060-state")
    with pytest.raises(ValueError):
        layout.checkpoint_stem("run", step=1, epoch=1)


def test_prune_orders_by_recorded_step_and_removes_siblings_together(tmp_path):
    # steps_per_epoch = 10. epoch002 is step 20; step000015 < epoch002 < step000025 (mtime order is scrambled)
    _ckpt(tmp_path, "run-step000025", step_meta=25, te=True, state_step=25)
    _ckpt(tmp_path, "run-epoch002", step_meta=20, te=True, state_step=20)
    _ckpt(tmp_path, "run-step000015", te=True)  # no metadata: falls back to the tag
    _ckpt(tmp_path, "run-step5")  # legacy unpadded name
    (tmp_path / "run-step000030").mkdir()  # diffusers-directory checkpoint (full FT without save_native)
    (tmp_path / "run-step000030" / "transformer").mkdir()
    _ckpt(tmp_path, "run")  # final: never touched
    (tmp_path / "run.toml").write_text("# config\n")
    _ckpt(tmp_path, "other-step000001")  # another run's: never touched
    manifest.start(tmp_path, "run", adopted=[p.name for p in tmp_path.iterdir()])  # all of it the run's own ...
    _ckpt(tmp_path, "run-step000001", step_meta=1)  # ... but this, which a user put there under a run's name
    (tmp_path / "notes.txt").write_text("mine")

    removed = C.prune_checkpoints(tmp_path, "run", keep_last_n=2, steps_per_epoch=10)
    names = sorted(p.name for p in removed)
    assert names == sorted(["run-step5.safetensors", "run-step000015.safetensors", "run-step000015_te.safetensors",
                            "run-epoch002.safetensors", "run-epoch002_te.safetensors", "run-epoch002-state"])
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != layout.MANIFEST_NAME)
    assert left == sorted(["run-step000025.safetensors", "run-step000025_te.safetensors", "run-step000025-state",
                           "run-step000030", "run.safetensors", "run.toml", "other-step000001.safetensors",
                           "run-step000001.safetensors", "notes.txt"])
    assert C.prune_checkpoints(tmp_path, "run", keep_last_n=None, steps_per_epoch=10) == []


def test_state_json_beats_metadata_and_tag(tmp_path):
    _ckpt(tmp_path, "run-epoch001", step_meta=999, state_step=7)
    (found,) = C.find_periodic(tmp_path, "run")
    assert found.recorded_step(steps_per_epoch=100) == 7


def test_resume_resolution(tmp_path):
    _ckpt(tmp_path, "run-step000010", state_step=10)
    state = tmp_path / "run-step000010-state"
    assert resume_state.resolve_resume(tmp_path / "run-step000010.safetensors") == state
    assert resume_state.resolve_resume(state) == state
    _ckpt(tmp_path, "run-step000020")
    with pytest.raises(resume_state.ResumeError, match="inference-only.*save_optimizer_state = true"):
        resume_state.resolve_resume(tmp_path / "run-step000020.safetensors")
    broken = tmp_path / "run-step000030-state"
    broken.mkdir()
    (broken / "state.json").write_text("{}")
    with pytest.raises(resume_state.ResumeError, match="missing accelerator"):
        resume_state.resolve_resume(broken)
    with pytest.raises(resume_state.ResumeError, match="not found"):
        resume_state.resolve_resume(tmp_path / "nope-state")


def test_resume_from_a_path_that_is_not_there_says_not_found(tmp_path):
    _ckpt(tmp_path, "run-step000010", state_step=10)
    with pytest.raises(resume_state.ResumeError) as exc:
        resume_state.resolve_resume(tmp_path / "run-step000099.safetensors")  # a typo in the step number
    msg = str(exc.value)
    assert "run-step000099.safetensors" in msg and "not found" in msg and "inference-only" not in msg
    assert f"newest state in {tmp_path} is {tmp_path / 'run-step000010-state'}" in msg
    with pytest.raises(resume_state.ResumeError,
                       match=f"is a run folder, not a saved state.*newest is {tmp_path}/run-step000010"):
        resume_state.resolve_resume(tmp_path)


@pytest.mark.parametrize("name", ["trainable.safetensors", "optimizer.pt", "scheduler.pt"])
def test_a_truncated_state_file_is_named(tmp_path, name):
    _ckpt(tmp_path, "run-step000010", state_step=10)
    _ckpt(tmp_path, "run-step000020", state_step=20)
    damaged = tmp_path / "run-step000020-state" / "accelerator" / name
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])  # a copy cut short
    with pytest.raises(resume_state.ResumeError) as exc:
        resume_state.resolve_resume(tmp_path / "run-step000020.safetensors")
    msg = str(exc.value)
    assert str(damaged) in msg and "damaged" in msg
    assert f"newest state in {tmp_path} is {tmp_path / 'run-step000010-state'}" in msg  # where to go instead


def test_latest_state_is_the_highest_recorded_step(tmp_path):
    assert layout.latest_state(tmp_path) is None
    _ckpt(tmp_path, "run-step000010", state_step=10)
    _ckpt(tmp_path, "run-epoch001", state_step=30)
    _ckpt(tmp_path, "run-step000020", state_step=20)
    (tmp_path / ".run-step000040-state.tmp").mkdir()  # an unfinished save is never a candidate
    assert layout.latest_state(tmp_path) == tmp_path / "run-epoch001-state"


def test_publish_dir_replaces_a_folder(tmp_path):
    from anchor.atomic import publish_dir

    final = tmp_path / "x-state"
    final.mkdir()
    (final / "old").write_text("old")
    tmp = tmp_path / ".x-state.tmp"
    tmp.mkdir()
    (tmp / "new").write_text("new")
    publish_dir(tmp, final)
    assert sorted(p.name for p in final.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x-state"]


def test_a_full_finetune_folder_survives_a_failed_replace(tmp_path, monkeypatch):
    """full.save_diffusers(overwrite=True) over an earlier folder, with the final rename failing (a full disk, an
    open handle on Windows): the earlier folder is still there, whole. The old code deleted it first, then renamed."""
    from anima_train.adapters.full import model as full
    from anima_train.model.components import load_components
    from anima_train.model.tiny import build_tiny_anima

    parts = load_components(build_tiny_anima(tmp_path / "repo").diffusers_dir, dtype="float32")
    folder = full.save_diffusers(tmp_path / "ft", parts.transformer, parts.text_conditioner)
    before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    real = os.replace

    def failing(src, dst):
        if Path(src).name.startswith(".ft.tmp-"):  # the finished folder's rename, not its files
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="No space left"):
        full.save_diffusers(folder, parts.transformer, parts.text_conditioner, overwrite=True)
    monkeypatch.setattr(os, "replace", real)
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ft", "repo"]  # no temp or set-aside folder left


def test_prune_never_deletes_the_checkpoint_resumed_from(tmp_path, monkeypatch):
    for step in (10, 20, 30):
        _ckpt(tmp_path, f"run-step{step:06d}", step_meta=step, te=True, state_step=step)
    manifest.start(tmp_path, "run", adopted=[p.name for p in tmp_path.iterdir()])  # the run's own files
    # resume_from as a user writes it: relative to the working directory, spelled differently from run_dir
    monkeypatch.chdir(tmp_path.parent)
    resume_from = Path(tmp_path.name) / ".." / tmp_path.name / "run-step000010.safetensors"
    removed = C.prune_checkpoints(tmp_path, "run", keep_last_n=1, steps_per_epoch=10, protect=resume_from)
    assert sorted(p.name for p in removed) == ["run-step000020-state", "run-step000020.safetensors",
                                               "run-step000020_te.safetensors"]
    # the -state folder names the same checkpoint; it never takes one of the keep_last_n places
    manifest.output(tmp_path, "run-step000040.safetensors", "run-step000040-state")  # recorded, then written
    _ckpt(tmp_path, "run-step000040", step_meta=40, state_step=40)
    removed = C.prune_checkpoints(tmp_path, "run", keep_last_n=1, steps_per_epoch=10,
                                  protect=str(tmp_path / "run-step000010-state"))
    assert sorted(p.name for p in removed) == ["run-step000030-state", "run-step000030.safetensors",
                                               "run-step000030_te.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != layout.MANIFEST_NAME) == [
        "run-step000010-state", "run-step000010.safetensors", "run-step000010_te.safetensors",
        "run-step000040-state", "run-step000040.safetensors"]


def test_epoch_of_step_is_the_one_based_epoch_the_step_falls_in():
    assert [C.epoch_of_step(s, 3) for s in range(8)] == [0, 1, 1, 1, 2, 2, 2, 3]


def test_a_loha_state_records_its_rank_and_a_resume_with_another_kind_is_refused(tmp_path):
    base = '[dataset]\npath = "/data/train"\n[adapter]\nrank = 4\n'
    loha = parse_config(base + 'kind = "loha"\n')
    assert resume_state.describe_adapter(loha) == {"kind": "loha", "rank": 4,
                                                   "components": ["cross_attn", "mlp", "self_attn"],
                                                   "train_llm_adapter": False, "train_text_encoder": False}
    lokr = parse_config(base + 'kind = "lokr"\n')  # the other methods record what they always did
    assert resume_state.describe_adapter(lokr) == {**resume_state.describe_adapter(loha), "kind": "lokr",
                                                   "lokr_factor": -1, "lokr_decompose_both": False}
    assert "rank" not in resume_state.describe_adapter(parse_config(base + 'kind = "none"\n'))
    state = tmp_path / "run-state"
    with pytest.raises(resume_state.ResumeError,
                       match=r'\[adapter\] kind: the state has "loha", this config has "lora"'):
        resume_state.refuse_adapter_change(state, {"adapter": resume_state.describe_adapter(loha)}, parse_config(base))
    # the same adapter resumes
    resume_state.refuse_adapter_change(state, {"adapter": resume_state.describe_adapter(loha)}, loha)
