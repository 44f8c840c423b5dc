"""`anima-train cache` end to end with a tiny random VAE: plan, encode, metadata, skip/overwrite, stale caches,
and the cache -> delete images -> train-from-latents path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from anima_train import cli
from anima_train.data.buckets import Bucketer
from anima_train.config import parse_config
from anima_train.data.cache_files import vae_identity
from anima_train.data.dataset import build_training_data, collate, encode_latents, load_pixels
from anima_train.data.errors import DatasetError
from anima_train.errors import DATA_VERDICT_EXIT
from anima_train.model.tiny import CONFIGS, make_synthetic_dataset

SIZES = [(64, 64), (96, 64), (64, 128), (128, 96)]


def make_vae_repo(root: Path, seed: int) -> Path:
    """A diffusers-layout folder with only vae/ (all `cache` needs): the tiny VAE of docs/model.md#tiny-models."""
    from diffusers import AutoencoderKLQwenImage

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLQwenImage(**CONFIGS["tiny"]["vae"]).eval()
    vae.save_pretrained(str(root / "vae"))
    return root


@pytest.fixture(scope="module")
def vae_repo(tmp_path_factory):
    return make_vae_repo(tmp_path_factory.mktemp("vae_repo"), seed=0)


@pytest.fixture
def images(tmp_path):
    folder = tmp_path / "data"
    make_synthetic_dataset(folder, n=len(SIZES), seed=1, sizes=SIZES)  # .png and every 3rd .jpg
    return folder


def cache_cli(*args) -> int:
    return cli.main(["cache", *map(str, args)])


def train_config(folder, tiers=(64, 96), steps=32, source="auto"):
    res = f"resolution = {tiers[0]}" if len(tiers) == 1 else f"resolutions = {list(tiers)}"
    return parse_config(f'[dataset]\npath = "{folder}"\n{res}\nbucket_reso_steps = {steps}\nsource = "{source}"\n')


def cache_files(folder):
    return sorted(folder.glob("*_anima.safetensors"))


def test_cache_plan_encode_skip_and_train_from_latents(images, vae_repo, capsys):
    # dry run: the plan and the size, nothing written
    assert cache_cli(images, "--resolution", 64, 96, "--bucket-reso-steps", 32, "--model", vae_repo, "--dry-run") == 0
    out = capsys.readouterr().out
    assert "tier 64:" in out and "tier 96:" in out and "cache    " in out and "MiB" in out
    assert cache_files(images) == []

    assert cache_cli(images, "--resolution", 64, 96, "--bucket-reso-steps", 32, "--model", vae_repo,
                     "--batch-size", 2) == 0
    files = cache_files(images)
    assert not list(images.glob(".*tmp*"))  # atomic writes left no temp files
    expected = set()
    for i, size in enumerate(SIZES):
        for t in (64, 96):
            expected.add(f"img_{i:04d}_{Bucketer(t, bucket_reso_steps=32).select(*size).bucket[0]:04d}x"
                         f"{Bucketer(t, bucket_reso_steps=32).select(*size).bucket[1]:04d}_anima.safetensors")
    assert {p.name for p in files} == expected

    from diffusers import AutoencoderKLQwenImage

    vae = AutoencoderKLQwenImage.from_pretrained(str(vae_repo), subfolder="vae").eval()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    for path in files:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        rec = json.loads(meta["settings"])
        assert rec["resolutions"] == [64, 96] and rec["bucket_reso_steps"] == 32 and rec["bucket_no_upscale"] is True
        assert rec["vae"] == vae_identity(vae_repo) and rec["tier"] in (64, 96)
        stem = "_".join(path.name.split("_")[:2])
        image = next(p for p in images.glob(stem + ".*") if p.suffix in (".png", ".jpg"))
        plan = Bucketer(rec["tier"], bucket_reso_steps=32).select(*Image.open(image).size)
        assert meta["bucket"] == f"{plan.bucket[0]}x{plan.bucket[1]}"
        assert meta["original_size"] == "x".join(map(str, Image.open(image).size))
        assert json.loads(meta["crop_ltrb"]) == list(plan.crop_ltrb)
        latents = load_file(str(path))["latents"]
        assert latents.shape == (16, 1, plan.bucket[1] // 8, plan.bucket[0] // 8) and latents.dtype == torch.float32
        pixels = load_pixels(image, plan)[None]
        with torch.no_grad():
            raw = vae.encode(pixels).latent_dist.mode()
        assert torch.allclose(latents[None], (raw - mean) / std, atol=1e-4)  # normalised per channel
        assert torch.allclose(latents[None], encode_latents(vae, pixels), atol=1e-4)

    # re-run: everything valid, nothing rewritten
    mtimes = {p: p.stat().st_mtime_ns for p in files}
    capsys.readouterr()
    assert cache_cli(images, "--resolution", 64, 96, "--bucket-reso-steps", 32, "--model", vae_repo) == 0
    assert "todo     0 of" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in files} == mtimes

    # the cache -> train path: images deleted, the dataset yields exactly the cached latents
    cfg = train_config(images)
    assert build_training_data(cfg, vae_repo).mode == "images"
    for p in images.iterdir():
        if p.suffix in (".png", ".jpg"):
            p.unlink()
    data = build_training_data(cfg, vae_repo)
    assert data.mode == "latents" and len(data.dataset) == len(files)
    seen = set()
    for i in range(len(data.dataset)):
        item = data.dataset[i]
        path = data.dataset.items[i].cache
        seen.add(path)
        assert torch.equal(item["latents"], load_file(str(path))["latents"])
        assert item["caption"]
    assert seen == set(files)
    batch = next(iter(data.sampler))
    stacked = collate([data.dataset[i] for i in batch])
    assert stacked["latents"].shape[0] == len(batch)


def test_stale_settings_then_recache_and_other_vae(images, vae_repo, tmp_path, capsys):
    assert cache_cli(images, "--resolution", 128, "--bucket-reso-steps", 32, "--model", vae_repo) == 0
    n_before = len(cache_files(images))
    build_training_data(train_config(images, tiers=(128,), steps=32), vae_repo)
    cfg64 = train_config(images, tiers=(128,), steps=64, source="images")  # "auto" would encode instead
    with pytest.raises(DatasetError, match="bucket_reso_steps=32, the config says 64") as exc:
        build_training_data(cfg64, vae_repo)
    assert "--bucket-reso-steps 64" in str(exc.value)
    capsys.readouterr()
    # 96x64 -> 64x64 and 128x96 -> 128x64 at step 64; the other two keep their buckets (valid, skipped)
    assert cache_cli(images, "--resolution", 128, "--bucket-reso-steps", 64, "--model", vae_repo) == 0
    assert "todo     2 of 4" in capsys.readouterr().out
    build_training_data(cfg64, vae_repo)
    assert len(cache_files(images)) == n_before + 2

    other = make_vae_repo(tmp_path / "other_vae", seed=1)
    assert vae_identity(other) != vae_identity(vae_repo)
    with pytest.raises(DatasetError, match="VAE sha256:"):
        build_training_data(cfg64, other)


def test_captions_unreadable_and_config(images, vae_repo, tmp_path, capsys):
    (images / "img_0001.txt").unlink()
    (images / "img_0002.txt").unlink()
    assert cache_cli(images, "--resolution", 64, "--model", vae_repo, "--bucket-reso-steps", 32) == 2
    err = capsys.readouterr().err
    assert "2 image(s) have no caption" in err and "img_0001.txt" in err and "img_0002.txt" in err
    assert cache_cli(images, "--resolution", 64, "--bucket-reso-steps", 32, "--allow-missing-captions",
                     "--dry-run") == 0
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    (images / "broken2.webp").write_bytes(b"RIFF")
    assert cache_cli(images, "--resolution", 64, "--bucket-reso-steps", 32, "--allow-missing-captions",
                     "--dry-run") == DATA_VERDICT_EXIT  # a verdict on the data (issue 24)
    err = capsys.readouterr().err
    assert "broken.png" in err and "broken2.webp" in err and "2 image(s) cannot be read" in err
    assert cache_cli(images, "--resolution", 64, "--bucket-reso-steps", 32, "--allow-missing-captions",
                     "--dry-run", "--skip-unreadable") == 0
    assert "2 unreadable skipped" in capsys.readouterr().out
    assert cache_cli(images) == 2  # no tiers given
    assert "--resolution" in capsys.readouterr().err

    # --config supplies folders, tiers and bucket settings; flags override
    (images / "broken.png").unlink()
    (images / "broken2.webp").unlink()
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'[train]\nmodel_path = "{vae_repo}"\n[dataset]\npath = "{images}"\nresolutions = [64, 96]\n'
                   f"bucket_reso_steps = 32\n", encoding="utf-8")
    assert cache_cli("--config", cfg, "--dry-run", "--allow-missing-captions") == 0
    out = capsys.readouterr().out
    assert "tier 64:" in out and "tier 96:" in out
    assert cache_cli("--config", cfg, "--dry-run", "--allow-missing-captions", "--resolution", 128) == 0
    out = capsys.readouterr().out
    assert "tier 128:" in out and "tier 64:" not in out


def test_damaged_caches_are_re_encoded_and_overwrite_repairs_a_truncated_one(images, vae_repo, capsys):
    flags = ("--resolution", 128, "--bucket-reso-steps", 32, "--model", vae_repo)
    assert cache_cli(images, *flags) == 0
    files = cache_files(images)
    good = {p: load_file(str(p))["latents"] for p in files}
    cfg = train_config(images, tiers=(128,), source="images")  # "auto" would encode instead
    # an 8x8 latent in a bigger bucket's cache, metadata kept: re-encoded without --overwrite, and named
    wrong = next(p for p in files if p.name.startswith("img_0000_"))  # 64x64 source: latents [16, 1, 8, 8]
    big = next(p for p in files if p.name.startswith("img_0003_"))  # 128x96 source: latents [16, 1, 12, 16]
    with safe_open(str(big), "pt") as f:
        meta = f.metadata()
    from safetensors.torch import save_file

    save_file({"latents": good[wrong]}, str(big), metadata=meta)
    capsys.readouterr()
    assert cache_cli(images, *flags) == 0
    out = capsys.readouterr().out
    assert f"damaged  {big}: latents float32 [16, 1, 8, 8], but bucket 128x96 needs float32 [16, 1, 12, 16]" in out
    assert "todo     1 of 4" in out
    assert torch.equal(load_file(str(big))["latents"], good[big])
    build_training_data(cfg, vae_repo)
    # a truncated cache: --overwrite re-encodes everything, this one included (it used to refuse)
    big.write_bytes(big.read_bytes()[:-200])
    with pytest.raises(DatasetError, match=f"{big.name}.*cannot be read"):
        build_training_data(cfg, vae_repo)
    assert cache_cli(images, *flags, "--overwrite") == 0
    assert "todo     4 of 4" in capsys.readouterr().out
    assert torch.equal(load_file(str(big))["latents"], good[big])
    # ... and so does a plain run
    big.write_bytes(big.read_bytes()[:-200])
    assert cache_cli(images, *flags) == 0
    out = capsys.readouterr().out
    assert f"damaged  {big}: cannot be read" in out and "todo     1 of 4" in out
    assert torch.equal(load_file(str(big))["latents"], good[big])
    data = build_training_data(cfg, vae_repo)
    assert all(torch.equal(data.dataset[i]["latents"], good[data.dataset.items[i].cache])
               for i in range(len(data.dataset)))


def test_cache_prints_the_dataset_warnings(images, tmp_path, capsys):
    # what `train` warns about, shown before anything is encoded: tier collapse >= 1 %, sources min_source_area
    # drops, and cache files that no tier uses under these settings
    Image.new("RGB", (16, 16), "white").save(images / "tiny.png")
    (images / "tiny.txt").write_text("white square")
    from anima_train.data.latent_cache import save_cache
    from anima_train.data.cache_files import cache_path
    from anima_train.data.planning import BucketSettings, plan_metadata

    other = BucketSettings(tiers=(48,), bucket_reso_steps=16)
    plan = Bucketer(48, bucket_reso_steps=16).select(64, 64)
    leftover = cache_path(images / "img_0000", plan.bucket)
    save_cache(leftover, torch.zeros(16, 1, plan.bucket[1] // 8, plan.bucket[0] // 8),
               plan_metadata(plan, other, 48, None, None))
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'[dataset]\npath = "{images}"\nresolutions = [64, 128]\nbucket_reso_steps = 32\n'
                   f"min_source_area = 0.5\n", encoding="utf-8")
    assert cache_cli("--config", cfg, "--dry-run") == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning: ")]
    assert any(w.startswith("warning: tier 128: ") and "repeat a lower tier's bucket" in w for w in warnings)
    assert "warning: min_source_area = 0.5: dropped 1 source(s) smaller than 0.5 x 64^2 px (e.g. tiny)" in warnings
    assert any(w.startswith("warning: 1 cache file(s) match no declared tier") and f"{leftover.name}: made with "
               in w for w in warnings), warnings


def test_cache_with_a_config_caches_its_validation_folder_too(vae_repo, tmp_path, capsys):
    train_dir, held_out = tmp_path / "train", tmp_path / "held_out"
    make_synthetic_dataset(train_dir, n=3, seed=1, sizes=[(64, 64)])
    make_synthetic_dataset(held_out, n=2, seed=2, sizes=[(64, 64)])
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'[train]\nmodel_path = "{vae_repo}"\n[dataset]\npath = "{train_dir}"\nresolution = 64\n'
                   f'bucket_reso_steps = 32\n[validation]\nfolder = "{held_out}"\n', encoding="utf-8")
    assert cache_cli("--config", cfg) == 0
    assert len(cache_files(train_dir)) == 3 and len(cache_files(held_out)) == 2  # training reads both
