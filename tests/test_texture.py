"""Texture mode (docs/training.md#texture-mode): each rung of the oversize cascade on constructed images whose
correct crop, padding and mask are known by construction; the energy-weighted position; the legacy byte-for-byte
case; the sampler/dataset in a texture phase; a tiny-model fullres -> texture -> fullres run that learns and resumes
bit-exactly from a state saved inside the texture phase; the refusal under two processes (torchrun, gloo)."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from anima_train.data import texture as T
from anima_train.config import ConfigError, CurriculumPhase, TextureConfig, parse_config
from tests.fixtures_tiny import torchrun

ROOT = Path(__file__).resolve().parents[1]
NODE = shutil.which("node")


def coords_image(w: int, h: int) -> Image.Image:
    """Every pixel names its own position: R = x mod 256, G = y mod 256, B = 16·(x // 256) + (y // 256)."""
    x, y = np.meshgrid(np.arange(w), np.arange(h))
    arr = np.stack([x % 256, y % 256, 16 * (x // 256) + (y // 256)], axis=-1).astype(np.uint8)
    return Image.fromarray(arr)


def tcfg(**over) -> TextureConfig:
    return dataclasses.replace(TextureConfig(), **over)


LEGACY = dict(fit_aware=False, cover_max_scale=1.0, pad_mode="black", mask_padding=False, oversize="pad")


# ------------------------------------------------------------------------------------------- native crop


def test_a_source_that_holds_the_canvas_is_cut_at_native_scale_where_the_window_says():
    src = coords_image(600, 400)
    arr = np.asarray(src)
    rng = random.Random(1)
    positions = set()
    for _ in range(50):
        crop = T.crop_texture(src, (256, 128), tcfg(), rng)
        x, y = crop.position
        assert 0 <= x <= 600 - 256 and 0 <= y <= 400 - 128
        assert crop.rung == "native" and crop.scale == 1.0 and crop.valid is None
        assert np.array_equal(crop.pixels, arr[y:y + 128, x:x + 256])
        positions.add((x, y))
    assert len(positions) > 10  # the position is drawn, not fixed


# ------------------------------------------------------------------------------------------- rung 1


def _shares(draws) -> dict:
    return {c: draws.count(c) / len(draws) for c in set(draws)}


def test_rung1_the_canvas_is_drawn_among_those_the_batch_holds_with_multiplicity():
    canvases = [[64, 64], [64, 64], [128, 64], [256, 256]]
    rng = random.Random(0)
    draws = [T.draw_canvas(canvases, [(200, 100), (130, 70)], True, rng) for _ in range(3000)]
    shares = _shares(draws)
    assert set(shares) == {(64, 64), (128, 64)}  # 256x256 fits neither source
    assert shares[(64, 64)] == pytest.approx(2 / 3, abs=0.03)  # listed twice: twice the weight
    # the narrowest source decides: 120 px wide holds no 128-wide canvas
    assert {T.draw_canvas(canvases, [(200, 100), (120, 70)], True, rng) for _ in range(200)} == {(64, 64)}
    # none fits, an unknown size, or fit_aware = false: all canvases, still weighted
    for sizes, fit in (([(32, 32)], True), ([(200, 100), None], True), ([(200, 100)], False)):
        shares = _shares([T.draw_canvas(canvases, sizes, fit, rng) for _ in range(4000)])
        assert set(shares) == {(64, 64), (128, 64), (256, 256)}
        assert shares[(64, 64)] == pytest.approx(0.5, abs=0.03) and shares[(256, 256)] == pytest.approx(0.25, abs=0.03)


# ------------------------------------------------------------------------------------------- rung 2


def test_rung2_a_slightly_small_source_is_covered_by_a_lanczos_upscale():
    src = Image.fromarray(np.random.RandomState(0).randint(0, 256, (100, 100, 3), dtype=np.uint8))
    crop = T.crop_texture(src, (112, 112), tcfg(), random.Random(0))  # scale 1.12 <= 1.15
    assert crop.rung == "cover" and crop.scale == pytest.approx(1.12) and crop.valid is None
    assert np.array_equal(crop.pixels, np.asarray(src.resize((112, 112), Image.LANCZOS)))
    # 1.28x is past cover_max_scale: padded, never magnified
    assert T.crop_texture(src, (128, 128), tcfg(), random.Random(0)).rung == "pad"
    assert T.crop_texture(src, (128, 128), tcfg(cover_max_scale=1.3), random.Random(0)).rung == "cover"


def test_oversize_cover_and_skip_cover_at_any_scale_and_pad_pads():
    src = Image.fromarray(np.random.RandomState(1).randint(0, 256, (100, 100, 3), dtype=np.uint8))
    for mode in ("cover", "skip"):
        crop = T.crop_texture(src, (256, 256), tcfg(oversize=mode), random.Random(0))
        assert crop.rung == "cover" and crop.scale == pytest.approx(2.56)
        assert np.array_equal(crop.pixels, np.asarray(src.resize((256, 256), Image.LANCZOS)))
    assert T.crop_texture(src, (256, 256), tcfg(oversize="pad"), random.Random(0)).rung == "pad"


# ------------------------------------------------------------------------------------------- rung 3


def test_rung3_reflect_mirrors_the_source_evenly_on_both_sides():
    src = coords_image(96, 300)  # narrower than the 128 canvas, taller: cut vertically, mirrored horizontally
    arr = np.asarray(src)
    crop = T.crop_texture(src, (128, 128), tcfg(pad_mode="reflect"), random.Random(3))
    x, y = crop.position
    assert crop.rung == "pad" and x == 0 and 0 <= y <= 300 - 128
    window = arr[y:y + 128]
    assert np.array_equal(crop.pixels[:, 16:112], window)  # 32 px of padding: 16 left, 16 right
    for k in range(16):
        assert np.array_equal(crop.pixels[:, 15 - k], window[:, k])  # mirror image, edge pixel repeated
        assert np.array_equal(crop.pixels[:, 112 + k], window[:, 95 - k])
    valid = np.zeros((128, 128))
    valid[:, 16:112] = 1
    assert np.array_equal(crop.valid, valid)


def test_rung3_black_fills_zeros_right_and_below():
    src = coords_image(100, 90)
    crop = T.crop_texture(src, (128, 128), tcfg(pad_mode="black"), random.Random(0))
    assert crop.rung == "pad" and crop.position == (0, 0)
    assert np.array_equal(crop.pixels[:90, :100], np.asarray(src))
    assert not crop.pixels[90:].any() and not crop.pixels[:, 100:].any()
    assert crop.valid[:90, :100].all() and not crop.valid[90:].any() and not crop.valid[:, 100:].any()


# ------------------------------------------------------------------------------------------- rung 4


def _sample(tmp_path, size, canvas, **over):
    path = tmp_path / f"src_{size[0]}x{size[1]}.png"
    coords_image(*size).save(path)
    return T.texture_sample(path, canvas, tcfg(**over), seed=0, epoch=0, index=0)


def test_rung4_mask_padding_averages_pixel_validity_over_each_latent_cell(tmp_path):
    whole = dict(mask_ratio=[1.0, 1.0], feather_latent_px=0)
    black = _sample(tmp_path, (100, 128), (128, 128), pad_mode="black", **whole)["loss_mask"]
    assert black.shape == (1, 1, 16, 16)
    # columns 0..99 are real: cells 0-11 whole, cell 12 (px 96-103) half, the rest none; every row alike
    assert torch.equal(black[0, 0], torch.tensor([[1.0] * 12 + [0.5] + [0.0] * 3] * 16))
    reflect = _sample(tmp_path, (100, 128), (128, 128), pad_mode="reflect", **whole)["loss_mask"]
    # 28 px of padding, 14 each side: real columns 14..113
    assert torch.equal(reflect[0, 0, 0], torch.tensor([0.0, 0.25] + [1.0] * 12 + [0.25, 0.0]))
    off = _sample(tmp_path, (100, 128), (128, 128), pad_mode="black", mask_padding=False, **whole)["loss_mask"]
    assert torch.equal(off, torch.ones(1, 1, 16, 16))


def test_the_supervised_sub_region_is_a_box_with_a_cosine_feather():
    box = T.supervised_mask((16, 12), [0.5, 0.5], 0, random.Random(0))
    ys, xs = np.nonzero(box)
    assert box.shape == (12, 16) and box.sum() == 8 * 6 and box.max() == 1.0
    assert xs.max() - xs.min() == 7 and ys.max() - ys.min() == 5  # one ratio for both sides: the canvas shape
    full = T.supervised_mask((16, 16), [1.0, 1.0], 4, random.Random(0))
    ramp = [0.5 * (1 - np.cos(np.pi * d / 4)) for d in (0.5, 1.5, 2.5, 3.5)]
    row = np.array(ramp + [1.0] * 8 + ramp[::-1])
    assert np.allclose(full, np.outer(row, row))
    tiny = T.supervised_mask((16, 16), [0.01, 0.01], 0, random.Random(0))
    assert tiny.sum() == 16  # never below 4 x 4 latent px
    narrow = T.supervised_mask((16, 16), [0.5, 0.5], 10, random.Random(0))  # F = min(10, 8 / 2) = 4
    inside = narrow[np.nonzero(narrow.sum(1))[0]][:, np.nonzero(narrow.sum(0))[0]]
    assert np.allclose(inside, np.outer(*[np.array(ramp + ramp[::-1])] * 2))


# ------------------------------------------------------------------------------------------- energy


def test_the_crop_goes_where_the_detail_is():
    rs = np.random.RandomState(0)
    arr = np.full((512, 512, 3), 128, dtype=np.uint8)
    arr[40:104, 400:464] = rs.randint(0, 256, (64, 64, 3))  # a detailed patch on a flat field
    src = Image.fromarray(arr)

    def hits(config, n=300):
        rng = random.Random(0)
        count = 0
        for _ in range(n):
            x, y = T.crop_texture(src, (128, 128), config, rng).position
            count += x < 464 and x + 128 > 400 and y < 104 and y + 128 > 40  # the window overlaps the patch
        return count / n

    # a uniform position overlaps the patch with probability ~ (192/385)^2 ~ 0.25
    assert hits(tcfg()) > 0.95
    assert hits(tcfg(energy_power=0.0)) < 0.4
    flat = Image.fromarray(np.full((512, 512, 3), 77, dtype=np.uint8))
    assert not T.energy_map(np.asarray(flat.convert("L")), 8).any()  # exactly 0.0
    rng = random.Random(0)
    spots = [T.crop_texture(flat, (128, 128), tcfg(), rng).position for _ in range(300)]
    xs = [x for x, _ in spots]
    assert len(set(spots)) > 100 and 150 < np.mean(xs) < 235  # uniform over 0..384


# ------------------------------------------------------------------------------------------- legacy


def test_legacy_settings_reproduce_plain_black_padding_byte_for_byte():
    canvases = [[128, 128], [64, 192], [192, 64], [128, 128]]
    config = tcfg(canvases=canvases, **LEGACY)
    rs, rng = np.random.RandomState(7), random.Random(7)
    padded = 0
    drawn = set()
    for i in range(240):
        w, h = int(rs.randint(40, 400)), int(rs.randint(40, 400))
        src = Image.fromarray(rs.randint(0, 256, (h, w, 3), dtype=np.uint8))
        cw, ch = T.draw_canvas(config.canvases, [(w, h)], config.fit_aware, rng)
        drawn.add((cw, ch))
        crop = T.crop_texture(src, (cw, ch), config, rng)
        x, y = crop.position
        assert 0 <= x <= max(0, w - cw) and 0 <= y <= max(0, h - ch) and crop.scale == 1.0
        reference = np.asarray(src.crop((x, y, x + cw, y + ch)))  # PIL fills outside the image with zeros
        assert crop.pixels.tobytes() == reference.tobytes(), i
        padded += crop.rung == "pad"
    assert padded > 60 and drawn == {(128, 128), (64, 192), (192, 64)}  # canvases drawn regardless of fit


# ------------------------------------------------------------------------------------------- report


def test_the_startup_table_gives_fit_share_and_median_slack_per_canvas():
    lines = T.feasibility_report([(1200, 900), (2048, 2048), (800, 1400)], [[1024, 1024], [1024, 1024], [640, 1536]])
    assert lines[0] == "texture  canvas feasibility over 3 texture-eligible source(s) (native scale):"
    assert lines[1] == "  1024x1024  weight 2/3  fits  33.3%  median slack -124 px"
    assert lines[2] == "  640x1536  weight 1/3  fits  33.3%  median slack -136 px"


# ------------------------------------------------------------------------------------------- config


D = '[dataset]\npath = "/data"\n'


def test_a_texture_phase_needs_encode_and_that_is_said_first():
    with pytest.raises(ConfigError) as exc:
        parse_config(D + '[dataset.texture]\ncanvases = []\n[[curriculum]]\nat = 0.0\nmode = "texture"\n')
    assert exc.value.errors[0] == ('[[curriculum]] #1 mode = "texture" needs [dataset] source = "encode" (a crop is '
                                   'chosen per sample per step, so no cached latent can express it); it is "auto"')
    assert any("canvases = []" in e for e in exc.value.errors[1:])


def test_a_seed_texture_config_loads_unchanged():
    cfg = parse_config(D + 'source = "encode"\n[dataset.texture]\ncanvases = [[1024, 1024], [832, 1216], '
                      '[1216, 832], [640, 1536], [1024, 1024]]\ntrigger = ""\noversize = "pad"\n'
                      '[train]\nallow_multi_gpu_texture = false\n'
                      '[[curriculum]]\nat = 0.0\nt_range = [0.0, 1.0]\nmode = "fullres"\n'
                      '[[curriculum]]\nat = 0.15\nt_range = [0.0, 0.6]\nmode = "texture"\nlr_mul = 0.5\n')
    assert [ph.mode for ph in cfg.curriculum] == ["fullres", "texture"]
    assert cfg.dataset.texture.canvases[0] == [1024, 1024]


def test_refusal_under_several_processes_unless_allowed():
    cfg = parse_config(D + 'source = "encode"\n[[curriculum]]\nat = 0.0\nmode = "texture"\n')
    T.refuse_multi_process(cfg, 1)
    with pytest.raises(T.TextureError, match="on 2 processes is refused: run it on one process"):
        T.refuse_multi_process(cfg, 2)
    cfg.train.allow_multi_gpu_texture = True
    T.refuse_multi_process(cfg, 2)
    T.refuse_multi_process(parse_config(D), 8)  # no texture phase: nothing to refuse


# ------------------------------------------------------------------------------------------- sampler + dataset


def _two_subsets(tmp_path):
    from anima_train.model.tiny import make_synthetic_dataset

    crops, flat = tmp_path / "crops", tmp_path / "flat"
    make_synthetic_dataset(crops, n=8, sizes=[(192, 160), (160, 192)], seed=1)
    make_synthetic_dataset(flat, n=4, sizes=[(128, 128)], seed=2)
    return crops, flat


def test_texture_batches_in_texture_phases_only_exempt_subsets_keep_their_captions(tmp_path):
    from anima_train.data.dataset import build_training_data, collate

    crops, flat = _two_subsets(tmp_path)
    cfg = parse_config(f'[train]\nbatch_size = 2\n[dataset]\nresolution = 128\nsource = "encode"\n'
                      f'[[dataset.subsets]]\npath = "{crops}"\n[[dataset.subsets]]\npath = "{flat}"\ntexture = false\n'
                      f'[dataset.texture]\ncanvases = [[64, 64], [128, 64], [128, 64]]\ntrigger = "tex"\n'
                      '[[curriculum]]\nat = 0.0\n[[curriculum]]\nat = 0.5\nmode = "texture"\n')
    data = build_training_data(cfg)
    assert any(line.startswith("texture  canvas feasibility over 8") for line in data.report), data.report
    n = len(data.sampler)  # 4 + 2 batches: 1 epoch = 6 steps, texture from step 3
    data.set_run(total=n, steps_per_epoch=n)
    batches = data.sampler.batches(0)
    for position, batch in enumerate(batches):
        items = [data.dataset[k] for k in batch]
        textured = isinstance(batch[0], tuple)
        exempt = all(not it["texture"] for it in items)
        assert textured == (position >= n // 2 and not exempt), (position, batch)
        assert len({it["texture"] for it in items}) == 1  # never half one and half the other
        out = collate(items)
        if textured:
            cw, ch = batch[0][1]
            assert {k[1] for k in batch} == {(cw, ch)} and (cw, ch) in {(64, 64), (128, 64)}
            assert out["pixels"].shape == (len(batch), 3, 1, ch, cw)
            assert out["loss_mask"].shape == (len(batch), 1, 1, ch // 8, cw // 8)
            assert out["caption"] == ["tex"] * len(batch)
        else:
            assert "loss_mask" not in out and all(c and c != "tex" for c in out["caption"])
    assert data.sampler.batches(0) == batches  # deterministic per (seed, epoch)
    schedule, data.sampler.texture = data.sampler.texture, None
    plain = data.sampler.batches(0)  # the same batches in the same order as without texture phases
    data.sampler.texture = schedule
    assert [[k[0] if isinstance(k, tuple) else k for k in b] for b in batches] == plain


# ------------------------------------------------------------------------------------------- training


def _texture_run_toml(model, data, out, **train):
    keys = dict(epochs=1000, batch_size=2, dtype='"float32"', num_workers=0, progress='"off"',
                gradient_checkpointing="false", save_every_epochs=0, run_name='"tex"', **train)
    lines = "\n".join(f"{k} = {v}" for k, v in keys.items())
    return f"""[train]
model_path = "{model}"
output_dir = "{out}"
{lines}
[dataset]
path = "{data}"
resolution = 128
source = "encode"
[dataset.texture]
canvases = [[64, 64], [96, 64], [64, 96]]
trigger = "texture"
[adapter]
rank = 8
alpha = 8.0
[optimizer]
lr = 1e-2
[flow]
use_ot = true
hf_scale = 0.25
[[curriculum]]
at = 0.0
[[curriculum]]
at = 0.3
mode = "texture"
t_range = [0.0, 0.6]
lr_mul = 0.5
[[curriculum]]
at = 0.7
"""


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from anima_train.model.tiny import make_synthetic_dataset

    out = tmp_path_factory.mktemp("tex_images")
    make_synthetic_dataset(out, n=6, sizes=[(160, 128), (128, 160), (128, 128)], seed=4)
    return out


def _eval_set(model_dir, folder):
    """Every image at its bucket, through the VAE: fixed latents for the fixed-quantile eval loss."""
    from anima_train.data.captions import read_caption_files
    from anima_train.data.dataset import build_training_data, encode_latents, load_pixels
    from anima_train.model.components import load_components

    cfg = parse_config(f'[dataset]\npath = "{folder}"\nresolution = 128\nsource = "encode"\n')
    data = build_training_data(cfg)
    vae = load_components(model_dir, dtype="float32").vae
    latents = [encode_latents(vae, load_pixels(it.image, it.plan)[None])[0] for it in data.dataset.items]
    captions = [read_caption_files(it.stem)[0].strip() for it in data.dataset.items]
    return latents, captions


def test_fullres_texture_fullres_run_learns_and_resumes_bit_exactly_inside_the_texture_phase(tiny_anima, images,
                                                                                           tmp_path):
    from anima_train.training.fixed_eval import evaluate
    from anima_train.model.components import load_components
    from anima_train.training.train import train

    model = tiny_anima.diffusers_dir
    latents, captions = _eval_set(model, images)
    before = evaluate(load_components(model, dtype="float32"), latents, captions)
    events = tmp_path / "events.jsonl"
    # 6 images / batch 2 = 3 batches per epoch; 10 steps: fullres 0-2, texture 3-6, fullres 7-9
    full = train(parse_config(_texture_run_toml(model, images, tmp_path / "a", max_steps=10, save_every_steps=5,
                                               save_optimizer_state="true")), cpu=True, events=str(events))
    after = evaluate(full.components, latents, captions)
    assert after.true_captions < 0.8 * before.true_captions, (before, after)
    steps = [json.loads(line) for line in events.read_text().splitlines() if '"event": "step"' in line]
    assert [s["phase"]["mode"] for s in steps] == ["fullres"] * 3 + ["texture"] * 4 + ["fullres"] * 3
    assert [s["phase"]["index"] for s in steps] == [1] * 3 + [2] * 4 + [3] * 3
    assert steps[4]["phase"] == {"index": 2, "count": 3, "mode": "texture", "t_range": [0.0, 0.6], "lr_mul": 0.5}
    assert steps[4]["lr"][0] == pytest.approx(5e-3) and steps[0]["lr"][0] == pytest.approx(1e-2)
    # hf loss and OT ran in every phase
    assert all(np.isfinite(s["terms"]["hf"]) and s["ot"] is not None for s in steps)
    # the state at step 5 lies inside the texture phase (steps 3-6)
    state = tmp_path / "a" / "tex" / "tex-step000005-state"
    assert json.loads((state / "state.json").read_text())["global_step"] == 5
    resumed = train(parse_config(_texture_run_toml(model, images, tmp_path / "b", max_steps=10,
                                                  resume_from=f'"{state}"')), cpu=True, no_save=True)
    assert resumed.batches_seen == full.batches_seen[5:]
    assert resumed.losses == full.losses[5:]  # bit-identical: same crops, masks, noise, timesteps, moments
    assert resumed.trainable_digest == full.trainable_digest


def test_a_texture_phase_on_a_cached_dataset_built_in_code_is_refused(tiny_anima, images, tmp_path):
    from anima_train.data.dataset import build_training_data
    from anima_train.data.errors import DatasetError

    cfg = parse_config(_texture_run_toml(tiny_anima.diffusers_dir, images, tmp_path))
    cfg.dataset.source = "images"  # past load_config, which refuses this
    with pytest.raises(DatasetError, match='needs \\[dataset\\] source = "encode"'):
        build_training_data(cfg)


@pytest.mark.slow
def test_torchrun_two_processes_refuse_a_texture_phase_with_the_reason(tiny_anima, images, tmp_path):
    cfg = tmp_path / "tex.toml"
    cfg.write_text(_texture_run_toml(tiny_anima.diffusers_dir, images, tmp_path / "out", max_steps=2))
    cmd = ["-m", "anima_train", "train", cfg, "--cpu"]
    out = torchrun(cmd, cwd=tmp_path, timeout=300)
    assert out.returncode != 0
    assert out.stderr.count("a texture-mode [[curriculum]] phase on 2 processes is refused") == 1, out.stderr
    assert "allow_multi_gpu_texture = true" in out.stderr  # (torchrun adds its own ChildFailedError traceback)
    assert not (tmp_path / "out" / "tex").exists()  # refused before anything was written
    # the deliberate override: the same run goes through on two processes
    cfg.write_text(_texture_run_toml(tiny_anima.diffusers_dir, images, tmp_path / "out", max_steps=2,
                                     allow_multi_gpu_texture="true"))
    ok = torchrun(cmd, cwd=tmp_path)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert (tmp_path / "out" / "tex" / "tex.safetensors").is_file()


# ------------------------------------------------------------------------------------------- the Train node's chart


@pytest.mark.skipif(NODE is None, reason="needs node (js/loss_chart.js is a plain ES module)")
def test_the_train_nodes_chart_shows_the_active_phase():
    script = f"""
    import {{ applyEvent, statusLines }} from {json.dumps((ROOT / "js" / "loss_chart.js").as_uri())};
    let run = applyEvent(null, {{ event: "start", total: 10, epochs: 1 }});
    const shown = [];
    run = applyEvent(run, {{ event: "step", step: 1, total: 10, epoch: 1, loss: 0.5, lr: [1e-4] }});
    shown.push(statusLines(run));
    run = applyEvent(run, {{ event: "step", step: 4, total: 10, epoch: 1, loss: 0.4, lr: [5e-5],
                            phase: {{ index: 2, count: 3, mode: "texture", t_range: [0, 0.6], lr_mul: 0.5 }} }});
    shown.push(statusLines(run));
    console.log(JSON.stringify(shown));
    """
    result = subprocess.run([NODE, "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    plain, textured = json.loads(result.stdout)
    assert "phase" not in plain[0]["text"]  # no curriculum: the line is as before
    assert textured[0]["kind"] == "main" and "phase 2/3 texture" in textured[0]["text"], textured
    assert "t 0–0.6" in textured[0]["text"] and "LR ×0.5" in textured[0]["text"]


def test_phase_summary_numbers_phases_in_at_order():
    from anima_train.training.flow import active_phase, phase_summary

    phases = [CurriculumPhase(at=0.5, mode="texture"), CurriculumPhase(at=0.0)]
    assert phase_summary(phases, None) is None and phase_summary([], None) is None
    assert phase_summary(phases, active_phase(phases, 0.6))["index"] == 2
    assert phase_summary(phases, active_phase(phases, 0.1)) == {"index": 1, "count": 2, "mode": "fullres",
                                                                 "t_range": [0.0, 1.0], "lr_mul": 1.0}
