"""The training loop on the tiny model: it learns, resumes exactly, stops on request, writes the documented outputs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from anima_train import adapters
from anima_train.config import parse_config
from anima_train.training.fixed_eval import cached_eval_set, evaluate
from anima_train.model.components import load_components
from anima_train.data.synthetic import make_synthetic_latents
from anima_train.outputs.layout import MANIFEST_NAME
from anima_train.training.train import train
from tests.fixtures_tiny import anima_train_cli



def make_cfg(model: Path, data: Path, out: Path, extra: str = "", **train_keys):
    keys = dict(epochs=1000, batch_size=4, dtype='"float32"', num_workers=0, progress='"off"',
                gradient_checkpointing="false", save_every_epochs=0, run_name='"tiny"')
    keys.update({k: v for k, v in train_keys.items()})
    train_lines = "\n".join(f"{k} = {v}" for k, v in keys.items())
    text = f"""# tiny run
[train]
model_path = "{model}"
output_dir = "{out}"
{train_lines}

[dataset]
path = "{data}"
resolution = 128

[adapter]
rank = 8
alpha = 8.0
{extra}"""
    return parse_config(text)


def test_a_loha_run_through_the_cli_writes_the_hada_file_comfyui_loads(tiny_anima, latents_dir, tmp_path):
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "out", 'kind = "loha"\n[optimizer]\nlr = 1e-3\n',
                   max_steps=3, save_optimizer_state="true")
    config = tmp_path / "loha.toml"
    config.write_text(cfg.source_text)
    out = anima_train_cli("train", config, "--cpu", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "out" / "tiny"
    sd = load_file(str(run / "tiny.safetensors"))
    modules = {k.rsplit(".", 1)[0] for k in sd}
    assert {k.rsplit(".", 1)[1] for k in sd} == {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"}
    assert all(re.fullmatch(r"diffusion_model\.blocks\.\d+\.(self_attn\.(q|k|v|output)_proj|"
                            r"cross_attn\.(q|k|v|output)_proj|mlp\.layer[12])", m) for m in modules), modules
    assert len(modules) == 10 * len({m.split(".")[2] for m in modules})  # 4 + 4 + 2 Linears in every block
    assert all(sd[f"{m}.alpha"].item() == 8.0 and sd[f"{m}.hada_w1_b"].shape[0] == 8 for m in modules)
    assert all(torch.count_nonzero(sd[f"{m}.hada_w2_b"]) > 0 for m in modules)  # trained away from its zero init
    with safe_open(str(run / "tiny.safetensors"), "pt") as f:
        md = f.metadata()
    assert json.loads(md["ss_network_args"])["algo"] == "loha" and md["ss_steps"] == "3"
    assert md["ss_network_module"] == "lycoris.kohya" and md["modelspec.architecture"].endswith("/lycoris")
    state = json.loads((run / "tiny-state" / "state.json").read_text())
    assert state["adapter"] == {"kind": "loha", "rank": 8, "components": ["cross_attn", "mlp", "self_attn"],
                                "train_llm_adapter": False, "train_text_encoder": False}


@pytest.mark.slow
def test_it_learns_from_its_captions(tiny_anima, latents_dir, tmp_path):
    latents, captions = cached_eval_set(latents_dir)
    before = evaluate(load_components(tiny_anima.diffusers_dir, dtype="float32"), latents, captions)
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, "[optimizer]\nlr = 1e-2\n", max_steps=100)
    result = train(cfg, cpu=True, no_save=True)
    after = evaluate(result.components, latents, captions)
    # fixed-quantile eval loss (same noise, same timesteps) drops by at least a quarter...
    assert after.true_captions < 0.75 * before.true_captions, (before, after)
    # ...and the prediction depends on the caption: shuffling captions costs more than before training
    assert before.margin < 0.005
    assert after.margin > before.margin + 0.01, (before, after)


def test_a_production_run_records_no_test_digest_or_batches(tiny_anima, latents_dir, tmp_path, monkeypatch):
    """The digest copies every trained tensor to the host (a full finetune: ~4 GB, seconds per rank) for a value
    only tests read; a run computes it, and the batch record, only under ANIMA_TRAIN_RECORD=1."""
    from anima_train.outputs import resume_state

    digests = []
    monkeypatch.setattr(resume_state, "digest", lambda models: digests.append(1) or "d")
    monkeypatch.delenv("ANIMA_TRAIN_RECORD")
    result = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, max_steps=2), cpu=True, no_save=True)
    assert len(result.losses) == 2 and not digests
    assert result.trainable_digest == "" and not result.batches_seen
    monkeypatch.setenv("ANIMA_TRAIN_RECORD", "1")
    result = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, max_steps=2), cpu=True, no_save=True)
    assert digests == [1] and result.trainable_digest == "d" and len(result.batches_seen) == 2


def test_the_tests_ask_for_the_digest_their_run_comparisons_read():
    # without it every `a.trainable_digest == b.trainable_digest` would compare "" with ""
    import os
    assert os.environ.get("ANIMA_TRAIN_RECORD") == "1"


def test_resume_reproduces_the_uninterrupted_run(tiny_anima, latents_dir, tmp_path):
    extra = "[optimizer]\nlr = 1e-3\n[flow]\nuse_ot = true\nhf_scale = 0.25\n"
    # 3 batches per epoch; the step-2 state is mid-epoch, so the resumed run must skip exactly the used batches
    full = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "a", extra, max_steps=7,
                          save_every_steps=2, save_optimizer_state="true"), cpu=True)
    state = tmp_path / "a" / "tiny" / "tiny-step000002-state"
    info = json.loads((state / "state.json").read_text())
    assert info["global_step"] == 2 and info["batch_in_epoch"] == 2
    resumed = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "b", extra, max_steps=7,
                             save_every_steps=2, save_optimizer_state="true",
                             resume_from=f'"{tmp_path / "a" / "tiny" / "tiny-step000002.safetensors"}"'), cpu=True)
    assert len(full.losses) == 7 and len(resumed.losses) == 5
    assert resumed.batches_seen == full.batches_seen[2:]
    assert resumed.losses == full.losses[2:]  # bit-identical: same batches, noise, timesteps, optimizer moments
    assert resumed.trainable_digest == full.trainable_digest
    a = load_file(str(tmp_path / "a" / "tiny" / "tiny.safetensors"))
    b = load_file(str(tmp_path / "b" / "tiny" / "tiny.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resuming_a_finished_run_says_so_and_raising_max_steps_continues_it(tiny_anima, latents_dir, tmp_path,
                                                                          capsys):
    model = tiny_anima.diffusers_dir
    reference = train(make_cfg(model, latents_dir, tmp_path / "ref", max_steps=5), cpu=True, no_save=True)
    train(make_cfg(model, latents_dir, tmp_path, epochs=1, save_optimizer_state="true"), cpu=True)  # 3 steps
    final_state = f'"{tmp_path / "tiny" / "tiny-state"}"'
    # finished by its epochs, or by max_steps: either way the message says so and how to go on
    for keys, limit in ((dict(epochs=1), "epochs = 1"), (dict(max_steps=3), "max_steps = 3")):
        with pytest.raises(ValueError) as exc:  # ResumeError
            train(make_cfg(model, latents_dir, tmp_path, resume_from=final_state, save_optimizer_state="true",
                           **keys), cpu=True)
        msg = str(exc.value)
        assert "finished" in msg and "step 3 of 3" in msg and limit in msg
        assert "raise [train] max_steps or epochs" in msg
    capsys.readouterr()
    more = train(make_cfg(model, latents_dir, tmp_path, resume_from=final_state, max_steps=5,
                          save_optimizer_state="true"), cpu=True)
    assert more.global_step == 5 and more.losses == reference.losses[3:]  # as if it had never stopped
    assert more.trainable_digest == reference.trainable_digest
    assert "done: 2 step(s) this run (steps 4–5)" in capsys.readouterr().out


@pytest.mark.parametrize("target", ["optimizer.pt", "tiny-step000004.safetensors"])
def test_a_full_disk_during_a_save_names_the_file_and_keeps_earlier_checkpoints(tiny_anima, latents_dir, tmp_path,
                                                                               monkeypatch, target):
    import errno

    import safetensors.torch
    from safetensors import SafetensorError

    from anima_train.outputs.resume_state import resolve_resume

    real_torch_save, real_save_file = torch.save, safetensors.torch.save_file

    def torch_save(obj, f, *a, **kw):  # the state's optimizer.pt at step 4 hits a full disk
        if Path(f).name == target and "step000004" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_torch_save(obj, f, *a, **kw)

    def save_file(tensors, filename, *a, **kw):  # the step-4 LoRA file hits it (as safetensors reports it)
        if target in Path(filename).name:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save_file(tensors, filename, *a, **kw)

    monkeypatch.setattr(torch, "save", torch_save)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    run = tmp_path / "tiny"
    with pytest.raises(OSError) as exc:  # SaveError
        train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, max_steps=6, save_every_steps=2,
                       save_optimizer_state="true"), cpu=True)
    msg = str(exc.value)
    failed = run / ("tiny-step000004-state/accelerator/optimizer.pt" if target == "optimizer.pt" else target)
    assert f"could not write {failed}" in msg and "No space left on device" in msg and "is full" in msg
    assert f"resume from the newest state, {run / 'tiny-step000002-state'}" in msg
    assert [p.name for p in run.iterdir() if p.name.startswith(".") and p.name != MANIFEST_NAME] == []  # no temp left
    assert not (run / "tiny-step000004-state").exists()
    for f in run.glob("*.safetensors"):  # every checkpoint under a final name is whole
        assert load_file(str(f))
    assert resolve_resume(run / "tiny-step000002.safetensors") == run / "tiny-step000002-state"


def test_a_caption_that_is_not_utf8_stops_the_run_before_training(tiny_anima, tmp_path):
    data = tmp_path / "data"
    make_synthetic_latents(data, n=4, seed=0)
    bad = sorted(data.glob("*.txt"))[2]
    bad.write_bytes(("café, " + bad.read_text(encoding="utf-8")).encode("latin-1"))  # saved by a cp1252 editor
    events = tmp_path / "events.jsonl"
    with pytest.raises(ValueError) as exc:  # DatasetError
        train(make_cfg(tiny_anima.diffusers_dir, data, tmp_path / "out", max_steps=4), cpu=True, events=str(events))
    msg = str(exc.value)
    assert str(bad) in msg and "not UTF-8" in msg and "re-save it as UTF-8" in msg
    assert '"event": "step"' not in events.read_text()  # refused at the scan, before any step


def test_outputs_follow_the_documented_layout(tiny_anima, latents_dir, tmp_path):
    events = tmp_path / "events.jsonl"
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, "[schedule]\nkind = \"cosine\"\n",
                   max_steps=7, save_every_steps=2, keep_last_n=2, save_optimizer_state="true",
                   run_name='"my run"')
    result = train(cfg, cpu=True, events=str(events))
    run = tmp_path / "my-run"
    names = sorted(p.name for p in run.iterdir() if p.name != MANIFEST_NAME)  # the manifest: test_hostile_outputs
    # steps 2, 4, 6 were saved; keep_last_n = 2 pruned step 2 (file and state together); final + TOML untouched;
    # the loss chart of the run
    assert names == ["loss.png", "my-run-state", "my-run-step000004-state", "my-run-step000004.safetensors",
                     "my-run-step000006-state", "my-run-step000006.safetensors", "my-run.safetensors", "my-run.toml"]
    assert (run / "my-run.toml").read_text() == cfg.source_text  # verbatim, comments kept
    assert result.final == run / "my-run.safetensors"
    with safe_open(str(result.final), "pt") as f:
        meta, keys = f.metadata(), list(f.keys())
    assert meta["step"] == "7" and meta["run"] == "my-run" and meta["ss_network_dim"] == "8"
    assert json.loads(meta["ss_training_config"])["train"]["max_steps"] == 7
    assert keys and all(k.startswith("diffusion_model.") and (".lora_A." in k or ".lora_B." in k) for k in keys)
    records = [json.loads(line) for line in events.read_text().splitlines()]
    kinds = [r["event"] for r in records]
    assert kinds[0] == "status" and "start" in kinds and kinds[-1] == "done"
    start = records[kinds.index("start")]  # the epochs the 7 steps reach (3 an epoch), not the config's 1000
    assert (start["epochs"], start["device"], start["losses"]) == (3, "cpu", []), start
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 8)) and all(r["total"] == 7 for r in steps)
    assert [r["step"] for r in records if r["event"] == "checkpoint"] == [2, 4, 6, 7]
    lrs = [r["lr"][0] for r in steps]
    assert lrs[0] > lrs[-1]  # cosine decays


def _metadata(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_checkpoint_metadata_describes_the_run_that_wrote_it(tiny_anima, latents_dir, tmp_path):
    # 3 steps per epoch; epochs = 1000 in the config, but max_steps = 7 makes this a 3-epoch, 7-step run
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, max_steps=7, save_every_steps=3,
                   save_every_epochs=2)
    result = train(cfg, cpu=True)
    run = tmp_path / "tiny"
    want = {"tiny-step000003.safetensors": ("3", "1"), "tiny-step000006.safetensors": ("6", "2"),
            "tiny-epoch002.safetensors": ("6", "2"), "tiny.safetensors": ("7", "3")}  # file: (ss_steps, ss_epoch)
    assert sorted(p.name for p in result.saved) == sorted(want)
    for name, (steps, epoch) in want.items():
        meta = _metadata(run / name)
        got = {k: meta.get(k) for k in ("ss_steps", "ss_epoch", "ss_num_epochs", "ss_max_train_steps")}
        assert got == {"ss_steps": steps, "ss_epoch": epoch, "ss_num_epochs": "3", "ss_max_train_steps": "7"}, name
        assert meta["modelspec.title"] == meta["ss_output_name"] == "tiny"
        assert meta["modelspec.architecture"] == "anima-2-blocks/lora" and meta["modelspec.resolution"] == "128x128"
        assert meta["ss_sd_model_name"] == "diffusers"  # the tiny repo's folder: no convert record names a file


def test_resumed_run_never_prunes_the_checkpoint_it_resumed_from(tiny_anima, latents_dir, tmp_path):
    keys = dict(save_every_steps=2, save_optimizer_state="true", keep_last_n=1)
    # a run that crashed after its step-4 save (no final: a resume from an older state than the newest is refused)
    train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, max_steps=5, skip_final_save="true", **keys),
          cpu=True)
    run = tmp_path / "tiny"
    resume = run / "tiny-step000004.safetensors"
    assert resume.is_file() and not (run / "tiny-step000002.safetensors").exists()  # keep_last_n = 1 pruned
    # the config a user re-runs after a crash: same run folder, resume_from set, keep_last_n = 1
    train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, max_steps=10, resume_from=f'"{resume}"',
                   **keys), cpu=True)
    assert sorted(p.name for p in run.iterdir() if p.name != MANIFEST_NAME) == [
        "loss.png", "tiny-state", "tiny-step000004-state", "tiny-step000004.safetensors", "tiny-step000008-state",
        "tiny-step000008.safetensors", "tiny.safetensors", "tiny.toml"]


def test_kohya_output_format_applies_the_trained_update(tiny_anima, latents_dir, tmp_path):
    from peft.tuners.lora import LoraLayer

    from anima_train.model import keymaps

    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, 'output_format = "kohya"\n'
                   '[optimizer]\nlr = 1e-2\n', max_steps=2)
    assert cfg.adapter.output_format == "kohya"
    result = train(cfg, cpu=True)
    sd = load_file(str(result.final))
    assert all(k.startswith("lora_unet_") for k in sd)
    transformer = result.components.transformer
    deltas = {keymaps.dit_module_to_native(name): m.get_delta_weight("default").detach()
              for name, m in transformer.named_modules() if isinstance(m, LoraLayer)}
    assert deltas and len(sd) == 3 * len(deltas)
    for native, want in deltas.items():
        stem = "lora_unet_" + native.replace(".", "_")
        down, up, alpha = sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"], sd[f"{stem}.alpha"]
        # what ComfyUI and sd-scripts apply: (alpha / rank) * up @ down, rank = lora_down.shape[0]
        got = (alpha.item() / down.shape[0]) * up @ down
        assert want.abs().max() > 0 and torch.allclose(got, want, atol=1e-6), native
    assert _metadata(result.final)["ss_network_module"] == "networks.lora"


def _stop_at_step_2(monkeypatch, stop: Path) -> None:
    from anima_train.outputs.progress import Progress

    step = Progress.step

    def step_then_stop(self, stats, **kw):  # the user asks to stop while step 2 is reported
        step(self, stats, **kw)
        if stats.step == 2:
            stop.write_text("")
    monkeypatch.setattr(Progress, "step", step_then_stop)


def test_stop_file_saves_a_resumable_checkpoint_and_exits(tiny_anima, latents_dir, tmp_path, monkeypatch):
    # the default config: save_optimizer_state = false, yet a stop (a Cancel in ComfyUI) is not a finished run and
    # keeps what resuming needs; resuming it gives the uninterrupted run's final weights
    stop = tmp_path / "STOP"
    _stop_at_step_2(monkeypatch, stop)
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "a", max_steps=4)
    assert cfg.train.save_optimizer_state is False and cfg.train.save_state_on_stop is True
    result = train(cfg, cpu=True, stop_file=str(stop))
    run = tmp_path / "a" / "tiny"
    assert result.stopped and result.global_step == 2
    assert (run / "tiny-step000002.safetensors").is_file()
    assert (run / "tiny-step000002-state" / "state.json").is_file()
    assert not (run / "tiny.safetensors").exists()
    stop.unlink()
    resumed = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "a", max_steps=4,
                             resume_from=f'"{run / "tiny-step000002-state"}"'), cpu=True)
    full = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "b", max_steps=4), cpu=True)
    assert resumed.losses == full.losses[2:] and resumed.trainable_digest == full.trainable_digest


def test_a_stop_writes_no_state_when_the_config_opts_out(tiny_anima, latents_dir, tmp_path, monkeypatch):
    stop = tmp_path / "STOP"
    _stop_at_step_2(monkeypatch, stop)
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, max_steps=50, save_state_on_stop="false")
    result = train(cfg, cpu=True, stop_file=str(stop))
    assert result.stopped and (tmp_path / "tiny" / "tiny-step000002.safetensors").is_file()
    assert not (tmp_path / "tiny" / "tiny-step000002-state").exists()


def test_dry_run_takes_one_step_and_writes_nothing(tiny_anima, latents_dir, tmp_path):
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, max_steps=50)
    result = train(cfg, cpu=True, dry_run=True, no_save=True)
    assert result.global_step == 1 and len(result.losses) == 1
    assert not (tmp_path / "tiny").exists()


def test_curriculum_lr_mul_and_full_finetune(tiny_anima, latents_dir, tmp_path):
    extra = ('kind = "none"\n[component_lr]\nadaln = 0.0\nbase = 0.0\n[optimizer]\nlr = 1e-4\n'
             '[[curriculum]]\nat = 0.0\nt_range = [0.0, 1.0]\n[[curriculum]]\nat = 0.5\nt_range = [0.0, 0.6]\n'
             'lr_mul = 0.5\n')
    events = tmp_path / "ev.jsonl"
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, extra, max_steps=4)
    result = train(cfg, cpu=True, events=str(events))
    lrs = [json.loads(line)["lr"] for line in events.read_text().splitlines() if '"step"' in line and
           json.loads(line)["event"] == "step"]
    assert lrs[0][0] == pytest.approx(1e-4) and lrs[-1][0] == pytest.approx(5e-5)  # phase 2 halves the LR
    sd = load_file(str(result.final))
    assert any(k.startswith("net.llm_adapter.") for k in sd) and any(k.startswith("net.blocks.") for k in sd)


def _eval_drop(tiny_anima, latents_dir, cfg, **kw):
    latents, captions = cached_eval_set(latents_dir)
    before = evaluate(load_components(tiny_anima.diffusers_dir, dtype="float32"), latents, captions)
    result = train(cfg, cpu=True, **kw)
    after = evaluate(result.components, latents, captions)
    return before.true_captions, after.true_captions, result


@pytest.mark.parametrize("optimizer", ["adamw8bit", "came", "lion"])
def test_sdnq_frozen_int8_base_lora_learns(tiny_anima, latents_dir, tmp_path, optimizer, capsys):
    betas = "[0.9, 0.999, 0.9999]" if optimizer == "came" else "[0.9, 0.99]"
    lr = "3e-3" if optimizer == "lion" else "1e-2"
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path,
                   f'[quant]\nmode = "frozen"\n[optimizer]\nkind = "{optimizer}"\nlr = {lr}\nbetas = {betas}\n'
                   'quantize_state = true\n', max_steps=12)
    before, after, _ = _eval_drop(tiny_anima, latents_dir, cfg)
    out = capsys.readouterr().out
    assert "quant: mode=frozen" in out and "Linears quantized (int8)" in out
    assert after < 0.97 * before, (before, after)


def test_sdnq_training_mode_full_finetune_exports_plain_weights(tiny_anima, latents_dir, tmp_path):
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path,
                   'kind = "none"\n[quant]\nmode = "training"\n[optimizer]\nkind = "adamw8bit"\nlr = 1e-3\n',
                   max_steps=12)
    before, after, result = _eval_drop(tiny_anima, latents_dir, cfg)
    assert after < before, (before, after)
    exported = load_file(str(result.final))
    native = load_file(str(tiny_anima.anima_file))
    assert exported.keys() == native.keys()  # same names and count as the input checkpoint, dequantized
    assert all(exported[k].dtype == torch.float32 and exported[k].shape == native[k].shape for k in native)


def test_text_encoder_lora_goes_to_a_te_sibling(tiny_anima, latents_dir, tmp_path):
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path,
                   "train_text_encoder = true\ntext_encoder_rank = 4\n[component_lr]\ntext_encoder = 1e-4\n",
                   epochs=1)  # no max_steps: the horizon is one epoch, 3 steps
    result = train(cfg, cpu=True)
    te_path = tmp_path / "tiny" / "tiny_te.safetensors"
    te = load_file(str(te_path))
    assert te and all(k.startswith("lora_te_") for k in te)
    assert any(k.endswith(".lora_up.weight") and v.abs().sum() > 0 for k, v in te.items())  # it trained
    assert not any(k.startswith("lora_te") for k in load_file(str(result.final)))
    # each file's metadata describes its own adapter: the Qwen3 LoRA is rank 4 with the DiT's alpha/rank scale
    main, te_meta = _metadata(result.final), _metadata(te_path)
    assert (main["ss_network_dim"], main["ss_network_alpha"]) == ("8", "8.0")
    assert (te_meta["ss_network_dim"], te_meta["ss_network_alpha"]) == ("4", "4.0")
    assert all(te[k].item() == 4.0 for k in te if k.endswith(".alpha"))  # the file's own alphas agree
    for meta in (main, te_meta):
        assert (meta["ss_steps"], meta["ss_epoch"], meta["ss_num_epochs"], meta["ss_max_train_steps"]) == (
            "3", "1", "1", "3")


def test_parked_weights_round_trip(tiny_anima):
    from anima_train.model.prompts import encode_prompts
    from anima_train.training.memory import ParkedWeights

    parts = load_components(tiny_anima.diffusers_dir, dtype="float32")
    kw = dict(tokenizer=parts.tokenizer, t5_tokenizer=parts.t5_tokenizer, text_encoder=parts.text_encoder,
              conditioner=parts.text_conditioner, device="cpu")
    with torch.no_grad():
        ref = encode_prompts(["red circle, white background"], **kw)
        parked = ParkedWeights(parts.text_encoder, torch.device("cpu"))
        host = [p.data_ptr() for p in parts.text_encoder.parameters()]
        with parked.on_device():
            inside = encode_prompts(["red circle, white background"], **kw)
        assert [p.data_ptr() for p in parts.text_encoder.parameters()] == host  # parked again after use
        parked.restore()
        after = encode_prompts(["red circle, white background"], **kw)
    assert torch.equal(ref, inside) and torch.equal(ref, after)


@pytest.mark.slow
def test_regional_compile_matches_eager(tiny_anima, latents_dir, tmp_path):
    # compiles each DiT block (inductor on the CPU here: ~50 s the first time); losses equal eager's to 4 dp
    kw = dict(max_steps=3, gradient_checkpointing="true")
    eager = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "e", **kw), cpu=True, no_save=True)
    compiled = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "c", **kw, compile='"default"'),
                     cpu=True, no_save=True)
    assert compiled.losses == pytest.approx(eager.losses, abs=1e-4)
    blocks = compiled.components.transformer.transformer_blocks
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)


def test_encode_mode_runs_the_vae_in_the_loop(tiny_anima, tmp_path):
    from anima_train.model.tiny import make_synthetic_dataset

    data = tmp_path / "images"
    make_synthetic_dataset(data, n=6, sizes=[(128, 128), (192, 64)])
    cfg = make_cfg(tiny_anima.diffusers_dir, data, tmp_path, max_steps=2, vae_encode_chunk=1)
    cfg.dataset.source = "encode"
    result = train(cfg, cpu=True, no_save=True)
    assert result.global_step == 2 and all(loss == loss for loss in result.losses)  # finite, no caches needed
    assert not list(data.glob("*_anima.safetensors"))


def test_loader_workers_start_once_per_run_and_each_epoch_still_draws_its_own_captions(tiny_anima, latents_dir,
                                                                                        tmp_path, monkeypatch):
    """num_workers = 2 over 3 epochs: the same two worker processes build every caption (persistent workers; on
    Windows each new one re-imports torch), and each caption is the one of its own epoch (the epoch travels with the
    sample key: a persistent worker's dataset copy never sees set_epoch). The resumed run stays bit-exact."""
    import os

    from anima_train.data import captions, dataset

    record = tmp_path / "captions.jsonl"
    real = captions.build_caption

    def recording(tags, nl, options, seed, epoch, index):  # runs in the worker processes (forked: patched there too)
        text = real(tags, nl, options, seed, epoch, index)
        with open(record, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "epoch": epoch, "index": index, "caption": text}) + "\n")
        return text

    monkeypatch.setattr(dataset, "build_caption", recording)
    extra = "[dataset.caption]\nshuffle_tags = true\ncaption_dropout_percent = 0.3\n"
    full = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "a", extra, max_steps=9, num_workers=2,
                          save_every_steps=4, save_optimizer_state="true"), cpu=True)
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert len({r["pid"] for r in rows}) == 2 and os.getpid() not in {r["pid"] for r in rows}
    assert sorted({r["epoch"] for r in rows}) == [0, 1, 2]  # 12 latents, batch 4: 3 steps an epoch
    by_epoch = {e: {r["index"]: r["caption"] for r in rows if r["epoch"] == e} for e in (0, 1, 2)}
    assert all(sorted(by_epoch[e]) == list(range(12)) for e in by_epoch)
    assert by_epoch[0] != by_epoch[1] != by_epoch[2]  # tag shuffle and dropout are drawn per epoch
    data = dataset.build_training_data(full_cfg := make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "c",
                                                            extra), full_cfg.train.model_path)
    for e in by_epoch:  # what an in-process dataset gives for that epoch
        data.dataset.set_epoch(e)
        assert {i: data.dataset[i]["caption"] for i in range(12)} == by_epoch[e]

    state = tmp_path / "a" / "tiny" / "tiny-step000004.safetensors"  # mid-epoch 2: the resume skips a batch
    resumed = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "b", extra, max_steps=9,
                             num_workers=2, save_every_steps=4, save_optimizer_state="true",
                             resume_from=f'"{state}"'), cpu=True)
    assert resumed.batches_seen == full.batches_seen[4:] and resumed.losses == full.losses[4:]
    assert resumed.trainable_digest == full.trainable_digest


@pytest.mark.parametrize("kind", [m.kind for m in adapters.METHODS.values()
                                  if not m.trains_base and m.kind != "lora"])  # LoRA: test_resume_reproduces_...
def test_every_adapter_method_resumes_to_the_uninterrupted_run(tiny_anima, latents_dir, tmp_path, kind):
    """Every method's trainable tensors (DoRA's magnitude included) go into the state and come back: the resumed
    run's losses and final file are the uninterrupted run's, bit for bit."""
    extra = f'kind = "{kind}"\n[optimizer]\nlr = 1e-3\n'
    keys = dict(max_steps=4, save_every_steps=2, save_optimizer_state="true")
    full = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "a", extra, **keys), cpu=True)
    resumed = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "b", extra, **keys,
                             resume_from=f'"{tmp_path / "a" / "tiny" / "tiny-step000002.safetensors"}"'), cpu=True)
    assert resumed.losses == full.losses[2:]
    a = load_file(str(tmp_path / "a" / "tiny" / "tiny.safetensors"))
    b = load_file(str(tmp_path / "b" / "tiny" / "tiny.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = json.loads((tmp_path / "b" / "tiny" / "tiny-state" / "state.json").read_text())
    assert state["adapter"]["kind"] == kind
