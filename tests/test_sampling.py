"""Previews while training ([sample]) and TensorBoard ([logging]) on the tiny model, read back as a user reads them:
the PNG files in <run_dir>/samples/, the `samples` events, and the event files through TensorBoard's own reader."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from anima_train.training import previews
from anima_train.config import ConfigError, load_config, parse_config
from anima_train.model.components import load_components
from anima_train.data.synthetic import make_synthetic_latents
from anima_train.training.train import train


@pytest.fixture(scope="module")
def latents_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("latents")
    make_synthetic_latents(out, n=8, seed=0)
    return out


def config_text(model, data, out, *, sample: str = "", logging: str = "", max_steps: int = 4, seed: int = 0) -> str:
    from tests.fixtures_tiny import small_run_toml

    return small_run_toml(model, data, out,
                          train=f'run_name = "prev"\nepochs = 100\nmax_steps = {max_steps}\nbatch_size = 2\n'
                                f'save_every_epochs = 0\nseed = {seed}',
                          tables=f"dropout = 0.1\n[optimizer]\nlr = 1e-2\n{sample}\n{logging}")


SAMPLE = """[sample]
prompts = ["red circle, white background", "blue square, black background"]
negative_prompt = "gray"
every_n_steps = 2
before_first_step = true
width = 64
height = 48
steps = 3
cfg_scale = 3.0
seed = 7
"""


# ------------------------------------------------------------------------------------------------ schedule


def test_simple_sigmas_are_comfyuis_table_for_anima():
    # ComfyUI: sigmas[k] = shift(k/1000), k = 1..1000; "simple" takes sigmas[-(1 + int(i * 1000/steps))], then 0
    sig = previews.simple_sigmas(4, 3.0)
    assert sig.tolist() == pytest.approx([1.0, 0.9, 0.75, 0.5, 0.0], abs=1e-6)  # docs/comfyui.md#sampling
    three = previews.simple_sigmas(3, 3.0)
    # i = 1: int(333.33) = 333 -> t = (1000 - 333)/1000 = 0.667 -> 3t/(1 + 2t)
    assert three[1].item() == pytest.approx(3 * 0.667 / (1 + 2 * 0.667), abs=1e-6)
    assert previews.simple_sigmas(2, 1.0).tolist() == pytest.approx([1.0, 0.5, 0.0])


def test_initial_noise_is_comfyuis_and_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    noise = previews.initial_noise(7, 48, 64)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(7)  # what comfy.sample.prepare_noise does
    assert torch.equal(noise, torch.randn((1, 16, 1, 6, 8), dtype=torch.float32))


def test_euler_cfg_matches_a_float64_reference(tiny_anima):
    parts = load_components(tiny_anima.diffusers_dir, dtype="float32")
    g = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(1, 64, 32, generator=g), torch.randn(1, 64, 32, generator=g)
    noise = previews.initial_noise(3, 32, 32)
    sigmas = previews.simple_sigmas(3, 3.0)
    got = previews.euler_cfg(parts.transformer, noise, sigmas, cond, uncond, 2.5, torch.float32)

    dit = parts.transformer.double()
    x = noise.double()
    mask = x.new_zeros(1, 1, 32, 32)
    with torch.no_grad():
        for s, s_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
            t = torch.tensor([s], dtype=torch.float64)
            v_c = dit(x, timestep=t, encoder_hidden_states=cond.double(), padding_mask=mask, return_dict=False)[0]
            v_u = dit(x, timestep=t, encoder_hidden_states=uncond.double(), padding_mask=mask, return_dict=False)[0]
            x = x + (s_next - s) * (v_u + 2.5 * (v_c - v_u))  # Euler on the guided velocity
    assert (got.double() - x).abs().max().item() < 1e-4
    assert got.abs().mean() > 0.1  # not a degenerate all-zero latent


# ------------------------------------------------------------------------------------------------ config


def test_sample_config_errors_name_the_key_and_fix(tmp_path, tiny_anima, latents_dir):
    base = config_text(tiny_anima.diffusers_dir, latents_dir, tmp_path, sample="[sample]\nwidth = 100\n"
                       "every_n_steps = 5\nprompts_file = \"missing.txt\"\n")
    (tmp_path / "cfg.toml").write_text(base)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "cfg.toml")
    text = str(err.value)
    assert "[sample] width = 100: must be a multiple of 16" in text and "e.g. 96" in text
    assert "[sample] prompts_file = \"missing.txt\": file not found" in text
    no_prompt = config_text(tiny_anima.diffusers_dir, latents_dir, tmp_path, sample="[sample]\nevery_n_steps = 5\n")
    with pytest.raises(ConfigError, match=r"every_n_steps set, but there is no prompt"):
        parse_config(no_prompt)
    (tmp_path / "comments.txt").write_text("# only a comment\n\n", encoding="utf-8")
    only_comments = config_text(tiny_anima.diffusers_dir, latents_dir, tmp_path,
                                sample="[sample]\nprompts_file = \"comments.txt\"\n")
    (tmp_path / "cfg.toml").write_text(only_comments)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "cfg.toml")
    assert f"{tmp_path / 'comments.txt'} has no prompt (one per line" in str(err.value)


def test_prompts_file_is_read_relative_to_the_config(tmp_path, tiny_anima, latents_dir):
    (tmp_path / "prompts.txt").write_text("# previews\nred circle\n\n  green triangle  \n", encoding="utf-8")
    (tmp_path / "cfg.toml").write_text(config_text(tiny_anima.diffusers_dir, latents_dir, tmp_path,
                                                   sample='[sample]\nprompts = ["cat"]\nprompts_file = "prompts.txt"'))
    cfg = load_config(tmp_path / "cfg.toml")
    assert cfg.sample.all_prompts() == ["cat", "red circle", "green triangle"]


def test_tensorboard_missing_is_one_clear_message(tmp_path, tiny_anima, latents_dir):
    """With tensorboard not importable, `anima-train train` says what to install; no traceback."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(config_text(tiny_anima.diffusers_dir, latents_dir, tmp_path / "out",
                               logging="[logging]\ntensorboard = true\n"))
    hide = ("import sys, runpy; sys.modules['tensorboard'] = None; "
            "sys.argv = ['anima-train', 'train', sys.argv[1]]; runpy.run_module('anima_train', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", hide, str(cfg)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "[logging] tensorboard = true needs the tensorboard package" in proc.stderr
    assert "pip install tensorboard" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ runs


def rgb(image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image, dtype=np.float32).copy())


def _losses(events_path):
    return [json.loads(line) for line in events_path.read_text().splitlines()]


@pytest.mark.slow
def test_previews_and_tensorboard_on_a_tiny_run(tmp_path, tiny_anima, latents_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    text = config_text(tiny_anima.diffusers_dir, latents_dir, tmp_path / "out", sample=SAMPLE,
                       logging="[logging]\ntensorboard = true\n", max_steps=5)
    events = tmp_path / "events.jsonl"
    result = train(parse_config(text), cpu=True, events=str(events))
    run_dir = result.run_dir

    # step 0 (before the first step), 2, 4 (every 2) and 5 (at the end): two prompts each
    names = sorted(p.name for p in (run_dir / "samples").iterdir())
    assert names == [f"step{s:06d}-prompt{i:02d}.png" for s in (0, 2, 4, 5) for i in (0, 1)]
    first = Image.open(run_dir / "samples" / names[0])
    assert first.size == (64, 48) and first.mode == "RGB"
    pixels = {s: [rgb(Image.open(run_dir / "samples" / f"step{s:06d}-prompt{i:02d}.png")) for i in (0, 1)]
              for s in (0, 5)}
    assert (pixels[0][0] - pixels[0][1]).abs().mean() > 0.5  # the prompt matters
    assert (pixels[0][0] - pixels[5][0]).abs().mean() > 0.5  # the trained adapter is active in the preview
    sample_events = [e for e in _losses(events) if e["event"] == "samples"]
    assert [e["step"] for e in sample_events] == [0, 2, 4, 5]
    assert sample_events[-1]["paths"] == [str(run_dir / "samples" / n) for n in names[-2:]]

    # the same step-0 preview, rendered outside training from the base model, is identical
    parts = load_components(tiny_anima.diffusers_dir, dtype="float32")
    base = previews.render(["red circle, white background"], "gray", width=64, height=48, steps=3, cfg_scale=3.0,
                           seed=7, shift=3.0, transformer=parts.transformer, conditioner=parts.text_conditioner,
                           text_encoder=parts.text_encoder, tokenizer=parts.tokenizer,
                           t5_tokenizer=parts.t5_tokenizer, vae=parts.vae, device="cpu", dtype=torch.float32)
    again = rgb(previews.to_pil(base[0]))
    assert torch.equal(again, pixels[0][0])

    # TensorBoard: one run folder, read with TensorBoard's own reader
    folders = list((run_dir / "logs").iterdir())
    assert len(folders) == 1
    acc = EventAccumulator(str(folders[0]), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    loss = [(e.step, e.value) for e in acc.Scalars("loss/total")]
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5]
    assert [v for _, v in loss] == pytest.approx(result.losses, rel=1e-6)
    assert {"lr/self_attn", "lr/cross_attn", "lr/mlp", "grad_norm"} <= set(tags["scalars"])
    assert "throughput/images_per_s" in tags["scalars"]
    # logged one step late (reading it at once would stall the GPU), yet one per step, the last one too
    assert [e.step for e in acc.Scalars("grad_norm")] == [1, 2, 3, 4, 5]
    assert all(e.value > 0 for e in acc.Scalars("grad_norm"))
    assert set(tags["images"]) == {"samples/prompt00", "samples/prompt01"}
    shots = acc.Images("samples/prompt00")
    assert [e.step for e in shots] == [0, 2, 4, 5] and (shots[0].width, shots[0].height) == (64, 48)
    decoded = rgb(Image.open(io.BytesIO(shots[0].encoded_image_string)).convert("RGB"))
    assert torch.equal(decoded, pixels[0][0])

    # the loss plot of every run
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_previews_leave_the_training_rng_alone(tmp_path, tiny_anima, latents_dir):
    """Same seed, with and without previews every step: identical losses and weights (LoRA dropout on, so the
    global RNG is in play too)."""
    runs = {}
    for name, sample in (("plain", ""), ("previews", SAMPLE.replace("every_n_steps = 2", "every_n_steps = 1"))):
        text = config_text(tiny_anima.diffusers_dir, latents_dir, tmp_path / name, sample=sample, max_steps=4)
        runs[name] = train(parse_config(text), cpu=True, no_save=True)
    assert len(list((tmp_path / "previews" / "prev" / "samples").iterdir())) == 2 * 5
    assert runs["previews"].losses == runs["plain"].losses
    assert runs["previews"].trainable_digest == runs["plain"].trainable_digest


@pytest.mark.slow
def test_two_processes_only_the_main_one_samples_and_logs(tiny_anima, tmp_path):
    """Under torchrun (2 CPU processes): one preview set per round, written by the main process while the other
    waits; the adapters stay identical, and one TensorBoard run folder holds the curve."""
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.fixtures_tiny import small_run_toml, torchrun

    root = Path(__file__).resolve().parents[1]
    data = tmp_path / "data"
    make_synthetic_latents(data, n=8, seed=3)
    cfg = tmp_path / "ddp.toml"
    cfg.write_text(small_run_toml(tiny_anima.diffusers_dir, data, tmp_path / "out",
                                  train="epochs = 2\nbatch_size = 2",
                                  tables=SAMPLE + "\n[logging]\ntensorboard = true\n"))
    out = torchrun([root / "tests" / "ddp_worker.py", cfg, tmp_path, "save"], cwd=root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["steps"] == r1["steps"] == 4 and r0["digest"] == r1["digest"]
    run_dir = tmp_path / "out" / "anima"
    names = sorted(p.name for p in (run_dir / "samples").iterdir())
    assert names == [f"step{s:06d}-prompt{i:02d}.png" for s in (0, 2, 4) for i in (0, 1)]
    folders = list((run_dir / "logs").iterdir())
    assert len(folders) == 1
    acc = EventAccumulator(str(folders[0]), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss/total")] == [1, 2, 3, 4]
    assert [e.value for e in acc.Scalars("loss/total")] == pytest.approx(r0["losses"], rel=1e-6)
    assert [e.step for e in acc.Images("samples/prompt01")] == [0, 2, 4]
