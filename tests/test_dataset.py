"""Dataset pipeline: scanning, source modes, cache validation, tiers, per-tier batch size, sampler, report.

Caches here hold random latents written through the real metadata path (`plan_metadata` + `save_cache`), so these
tests need no VAE; tests/test_cache.py covers the VAE encode end to end.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from anima_train.data.buckets import Bucketer
from anima_train.data.latent_cache import save_cache
from anima_train.config import parse_config
from anima_train.data.cache_files import cache_path
from anima_train.data.dataset import bucket_batch_sizes, build_training_data, collate
from anima_train.data.errors import DatasetError
from anima_train.data.scan import IMAGE_EXTENSIONS
from anima_train.data.planning import BucketSettings, plan_metadata
from anima_train.data.batches import BucketBatchSampler, steps_per_epoch


def write_image(folder: Path, stem: str, size, ext=".png", caption: str | None = "red circle, white background"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}{ext}"
    fmt = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP", ".bmp": "BMP"}[ext]
    Image.new("RGB", size, (200, 40, 40)).save(path, format=fmt)
    if caption is not None:
        (folder / f"{stem}.txt").write_text(caption, encoding="utf-8")
    return path


def config(paths, tiers=(128,), source="auto", steps=32, extra_dataset="", train="", subsets=None):
    res = f"resolution = {tiers[0]}" if len(tiers) == 1 else f"resolutions = {list(tiers)}"
    if subsets is None:
        head = f'path = "{paths}"'
        tail = ""
    else:
        head = ""
        tail = "".join(f'\n[[dataset.subsets]]\npath = "{p}"\nnum_repeats = {n}\ntexture = {str(t).lower()}\n'
                       for p, n, t in subsets)
    return parse_config(f"[train]\nseed = 7\n{train}\n[dataset]\n{head}\n{res}\nbucket_reso_steps = {steps}\n"
                       f'source = "{source}"\nmax_bucket_reso = 512\n{extra_dataset}\n{tail}')


def image_of(stem: Path) -> Path | None:
    """The image a hand-made cache is made from, as `anima-train cache` records it (None when there is none)."""
    return next((p for p in sorted(stem.parent.glob(f"{stem.name}.*")) if p.suffix.lower() in IMAGE_EXTENSIONS), None)


def fake_caches(folder: Path, sizes: dict, settings: BucketSettings, vae_id=None, keep_original_size=True):
    """Write the caches `anima-train cache` would write for these images (random latents)."""
    written = {}
    for stem, size in sizes.items():
        seen = set()
        for t in settings.tiers:
            plan = Bucketer(t, bucket_reso_steps=settings.bucket_reso_steps,
                            bucket_no_upscale=settings.bucket_no_upscale, max_bucket_reso=settings.max_bucket_reso,
                            min_bucket_reso=settings.min_bucket_reso).select(*size)
            if plan.bucket in seen:
                continue
            seen.add(plan.bucket)
            meta = plan_metadata(plan, settings, t, vae_id, image_of(folder / stem))
            if not keep_original_size:
                del meta["original_size"]
            w, h = plan.bucket
            latents = torch.randn(16, 1, h // 8, w // 8)
            path = cache_path(folder / stem, plan.bucket)
            save_cache(path, latents, meta)
            written[(stem, t)] = (path, latents)
    return written


SIZES = {"a": (160, 96), "b": (96, 160), "c": (128, 128), "d": (200, 120)}


@pytest.fixture
def image_set(tmp_path):
    folder = tmp_path / "set"
    for i, (stem, size) in enumerate(SIZES.items()):
        write_image(folder, stem, size, [".png", ".jpg", ".webp", ".bmp"][i])
    return folder


# ------------------------------------------------------------------------------------------------ scanning


def test_scan_formats_repeat_folders_and_ignored_subfolders(tmp_path):
    root = tmp_path / "data"
    for i, ext in enumerate((".png", ".jpg", ".jpeg", ".webp", ".bmp", ".PNG")):
        write_image(root, f"top{i}", (64, 64), ext.lower() if ext != ".PNG" else ".png")
    (root / "top5.png").rename(root / "top5.PNG")  # extension case does not matter
    (root / "notes.gif").write_bytes(b"GIF89a")  # not an accepted format: ignored
    write_image(root / "3_char", "c0", (64, 64))
    write_image(root / "3_char", "c1", (64, 64))
    write_image(root / "misc", "m0", (64, 64))  # not N_name: not scanned, reported
    cfg = config(root, tiers=(64,), source="encode", extra_dataset="num_repeats = 2")
    data = build_training_data(cfg)
    assert data.mode == "encode"
    assert len(data.entries) == 6 + 2
    assert len(data.dataset) == 6 * 2 + 2 * 3 * 2  # top-level x num_repeats, 3_char x (3 * num_repeats)
    assert any("misc" in w and "not scanned" in w for w in data.warnings)
    report = "\n".join(data.report)
    assert "x2/x6" in report


def test_unreadable_images_listed_at_once_and_skippable(image_set):
    (image_set / "bad1.png").write_bytes(b"not a png at all")
    (image_set / "bad2.jpg").write_bytes(b"\xff\xd8 truncated")
    for s in ("bad1", "bad2"):
        (image_set / f"{s}.txt").write_text("x")
    cfg = config(image_set, source="encode")
    with pytest.raises(DatasetError) as exc:
        build_training_data(cfg)
    msg = str(exc.value)
    assert "2 image(s) cannot be read" in msg and "bad1.png" in msg and "bad2.jpg" in msg and "skip" in msg
    data = build_training_data(cfg, skip_unreadable=True)
    assert len(data.sources) == len(SIZES)
    assert any("skipped 2 unreadable" in w for w in data.warnings)


def test_missing_captions_refused_listing_all(image_set):
    (image_set / "a.txt").unlink()
    (image_set / "c.txt").unlink()
    with pytest.raises(DatasetError, match=r"2 image\(s\) have no caption") as exc:
        build_training_data(config(image_set, source="encode"))
    assert "a.txt" in str(exc.value) and "c.txt" in str(exc.value)


def test_captions_that_are_not_utf8_are_refused_at_scan_listing_all(image_set):
    (image_set / "b.txt").write_bytes("café, red circle".encode("latin-1"))
    (image_set / "c_nl.txt").write_bytes("A red circle in a café.".encode("cp1252"))
    (image_set / "d.txt").write_bytes("\ufeffred circle, white background".encode("utf-8"))  # a BOM is fine
    with pytest.raises(DatasetError) as exc:
        build_training_data(config(image_set, source="encode"))
    msg = str(exc.value)
    assert "2 caption file(s) cannot be read" in msg and msg.count("re-save it as UTF-8") == 2
    assert str(image_set / "b.txt") in msg and str(image_set / "c_nl.txt") in msg and "d.txt" not in msg


def test_same_stem_twice_is_refused(image_set):
    write_image(image_set, "a", (64, 64), ".jpg")
    with pytest.raises(DatasetError, match="share the stem 'a'"):
        build_training_data(config(image_set, source="encode"))


# ------------------------------------------------------------------------------------------ modes and caches


def test_images_mode_needs_every_cache_then_yields_them(image_set):
    cfg = config(image_set, source="images")
    settings = BucketSettings.from_config(cfg.dataset)
    with pytest.raises(DatasetError, match="4 \\(source, tier\\) pair\\(s\\) have no valid latent cache") as exc:
        build_training_data(cfg)
    assert "anima-train cache" in str(exc.value) and "--resolution 128" in str(exc.value)
    written = fake_caches(image_set, SIZES, settings)
    data = build_training_data(cfg)
    assert data.mode == "images"
    for i in range(len(data.dataset)):
        item = data.dataset[i]
        stem = data.dataset.items[i].stem.name
        assert torch.equal(item["latents"], written[(stem, 128)][1])
        assert item["latents"].shape[-2:] == (item["bucket"][1] // 8, item["bucket"][0] // 8)


@pytest.mark.parametrize("change, expect", [
    ("bucket_reso_steps", "bucket_reso_steps=32, the config says 64"),
    ("resolution", "resolution=128, the config says 96"),
    ("bucket_no_upscale", "bucket_no_upscale=true, the config says false"),
])
def test_changed_settings_refuse_naming_the_setting(image_set, change, expect):
    # validity is decided by the plan (a cache whose crop would be identical stays valid), so include a source
    # whose plan each change moves: 64x64 is kept as is without upscaling and enlarged to 128x128 with it
    write_image(image_set, "e", (64, 64))
    cfg = config(image_set, source="images")
    fake_caches(image_set, dict(SIZES, e=(64, 64)), BucketSettings.from_config(cfg.dataset))
    build_training_data(cfg)  # valid as cached
    if change == "bucket_reso_steps":
        cfg = config(image_set, steps=64, source="images")
    elif change == "resolution":
        cfg = config(image_set, tiers=(96,), source="images")
    else:
        cfg = config(image_set, extra_dataset="bucket_no_upscale = false\nmin_bucket_reso = 64", source="images")
    with pytest.raises(DatasetError) as exc:
        build_training_data(cfg)
    assert expect in str(exc.value)
    assert "re-run `anima-train cache" in str(exc.value)
    # source = "auto" never trains on the stale caches either: it encodes every image in the loop, and says so
    auto = build_training_data(dataclasses.replace(cfg, dataset=dataclasses.replace(cfg.dataset, source="auto")))
    assert auto.mode == "encode" and all("pixels" in auto.dataset[i] for i in range(len(auto.dataset)))
    assert any(line.startswith("source   auto: ") and "`anima-train cache`" in line for line in auto.report), \
        auto.report


def test_auto_trains_on_the_caches_when_all_are_valid_and_encodes_all_images_otherwise(image_set):
    cfg = config(image_set)  # source = "auto"
    none = build_training_data(cfg)
    live = [line for line in none.report if line.startswith("source   auto: ")]
    assert none.mode == "encode" and "pixels" in none.dataset[0] and len(live) == 1, none.report
    assert f"{len(SIZES)} of {len(SIZES)} image(s) have no valid latent cache" in live[0]
    written = fake_caches(image_set, SIZES, BucketSettings.from_config(cfg.dataset))
    written[("a", 128)][0].unlink()  # one image without its cache: every image is encoded (one kind per batch)
    some = build_training_data(cfg)
    assert some.mode == "encode" and any("1 of 4 image(s)" in line for line in some.report), some.report
    fake_caches(image_set, SIZES, BucketSettings.from_config(cfg.dataset))
    cached = build_training_data(cfg)
    assert cached.mode == "images" and "latents" in cached.dataset[0]
    assert not [line for line in cached.report if line.startswith("source   auto: ")]


def test_vae_identity_mismatch_is_stale(image_set, tmp_path):
    cfg = config(image_set, source="images")
    fake_caches(image_set, SIZES, BucketSettings.from_config(cfg.dataset), vae_id="sha256:" + "1" * 64)
    model = tmp_path / "model"
    (model / "vae").mkdir(parents=True)
    (model / "vae" / "config.json").write_text('{"z_dim": 16, "_diffusers_version": "x"}')
    (model / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"weights")
    with pytest.raises(DatasetError, match="VAE sha256:1111"):
        build_training_data(cfg, model)
    build_training_data(cfg)  # without a model the VAE is not checked


def test_latents_mode_after_deleting_images(image_set):
    cfg = config(image_set, tiers=(96, 128))
    written = fake_caches(image_set, SIZES, BucketSettings.from_config(cfg.dataset))
    for p in list(image_set.iterdir()):
        if p.suffix in (".png", ".jpg", ".webp", ".bmp"):
            p.unlink()
    data = build_training_data(cfg)
    assert data.mode == "latents"
    got = {(it.stem.name, it.tier): data.dataset[i]["latents"] for i, it in enumerate(data.dataset.items)}
    # dedup: a tier that collapses onto the lower one's bucket adds no entry
    assert set(got) == set(written)
    for key, (path, latents) in written.items():
        assert torch.equal(got[key], latents)
    # a stale leftover from other settings matches no tier: warned, ignored
    extra = Bucketer(64, bucket_reso_steps=32, max_bucket_reso=512).select(*SIZES["a"])
    save_cache(cache_path(image_set / "a", extra.bucket),
               torch.zeros(16, 1, extra.bucket[1] // 8, extra.bucket[0] // 8),
               plan_metadata(extra, BucketSettings(tiers=(64,), bucket_reso_steps=32, max_bucket_reso=512), 64, None,
                             image_of(image_set / "a")))
    data = build_training_data(cfg)
    assert any("match no declared tier" in w and "resolutions=[64]" in w for w in data.warnings)
    # a cache without its caption
    (image_set / "b.txt").unlink()
    with pytest.raises(DatasetError, match=r"cache\(s\) have no caption"):
        build_training_data(cfg)


def test_latents_mode_missing_pair_and_setting_change(image_set):
    cfg = config(image_set)
    written = fake_caches(image_set, SIZES, BucketSettings.from_config(cfg.dataset))
    for p in image_set.glob("*.png"):
        p.unlink()
    for p in image_set.glob("*.jpg"):
        p.unlink()
    for p in image_set.glob("*.webp"):
        p.unlink()
    for p in image_set.glob("*.bmp"):
        p.unlink()
    written[("c", 128)][0].unlink()  # the only cache of "c": the source is gone entirely
    assert len(build_training_data(cfg).entries) == 3
    with pytest.raises(DatasetError, match="bucket_reso_steps=32, the config says 64") as exc:
        build_training_data(config(image_set, steps=64))
    assert "images are gone" in str(exc.value)


def test_caches_without_original_size(image_set, tmp_path):
    cfg = config(image_set)
    fake_caches(image_set, SIZES, BucketSettings.from_config(cfg.dataset), keep_original_size=False)
    for p in image_set.iterdir():
        if not p.name.endswith((".txt", ".safetensors")):
            p.unlink()
    data = build_training_data(cfg)  # one tier: used as-is, with a warning
    assert len(data.entries) == 4 and any("no original_size" in w for w in data.warnings)
    with pytest.raises(DatasetError, match="cannot be attributed"):
        build_training_data(config(image_set, tiers=(96, 128)))
    # two unattributable caches for one stem
    save_cache(image_set / "a_0064x0064_anima.safetensors", torch.zeros(16, 1, 8, 8),
               {"format": "anima-latent-cache/1"})
    with pytest.raises(DatasetError, match="only one can be used"):
        build_training_data(cfg)


def rewrite_latents(path: Path, latents: torch.Tensor) -> None:
    """Replace a cache's tensor, dtype as given, and keep its metadata (what a buggy tool leaves behind)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    save_file({"latents": latents}, str(path), metadata=meta)


def test_a_cache_of_the_wrong_shape_or_dtype_is_refused_naming_the_file(image_set):
    # the report: an 8x8 latent in a 128x128-bucket cache, metadata kept, was trained on
    cfg = config(image_set, source="images")  # caches required (source = "auto" would encode the images instead)
    written = fake_caches(image_set, SIZES, BucketSettings.from_config(cfg.dataset))
    bad = written[("c", 128)][0]  # c is 128x128: latents [16, 1, 16, 16]
    assert bad.name == "c_0128x0128_anima.safetensors"
    rewrite_latents(bad, torch.zeros(16, 1, 8, 8))
    with pytest.raises(DatasetError) as exc:
        build_training_data(cfg)
    msg = str(exc.value)
    assert str(bad) in msg and "float32 [16, 1, 8, 8], but bucket 128x128 needs float32 [16, 1, 16, 16]" in msg
    assert "damaged" in msg and "anima-train cache" in msg
    # the right shape in half precision is not what anima-train cache writes either
    rewrite_latents(bad, torch.zeros(16, 1, 16, 16, dtype=torch.float16))
    with pytest.raises(DatasetError, match=r"float16 \[16, 1, 16, 16\], but bucket 128x128 needs float32"):
        build_training_data(cfg)
    # latents mode (images deleted): the same refusal
    rewrite_latents(bad, torch.zeros(16, 1, 8, 8))
    for p in list(image_set.iterdir()):
        if p.suffix in (".png", ".jpg", ".webp", ".bmp"):
            p.unlink()
    cfg = config(image_set)  # source = "auto": latents, the images being gone
    with pytest.raises(DatasetError) as exc:
        build_training_data(cfg)
    assert str(bad) in str(exc.value) and "needs float32 [16, 1, 16, 16]" in str(exc.value)
    # a truncated cache names the file too
    rewrite_latents(bad, torch.zeros(16, 1, 16, 16))
    build_training_data(cfg)
    bad.write_bytes(bad.read_bytes()[:-100])
    with pytest.raises(DatasetError, match="c_0128x0128_anima.safetensors cannot be read"):
        build_training_data(cfg)


def test_a_cache_without_metadata_of_the_wrong_shape_is_refused(image_set):
    # caches without original_size are used as-is at the one tier: their tensor is still checked
    cfg = config(image_set)
    written = fake_caches(image_set, SIZES, BucketSettings.from_config(cfg.dataset), keep_original_size=False)
    for p in image_set.iterdir():
        if not p.name.endswith((".txt", ".safetensors")):
            p.unlink()
    bad = written[("a", 128)][0]
    rewrite_latents(bad, torch.zeros(16, 1, 2, 2))
    with pytest.raises(DatasetError) as exc:
        build_training_data(cfg)
    assert str(bad) in str(exc.value) and "float32 [16, 1, 2, 2], but bucket" in str(exc.value)


def test_the_loader_checks_the_latents_it_reads(image_set):
    # a cache replaced after the scan (another process re-writing it) must not reach the model
    cfg = config(image_set)
    written = fake_caches(image_set, SIZES, BucketSettings.from_config(cfg.dataset))
    data = build_training_data(cfg)
    index = next(i for i, it in enumerate(data.dataset.items) if it.stem.name == "c")
    assert data.dataset[index]["latents"].shape == (16, 1, 16, 16)
    rewrite_latents(written[("c", 128)][0], torch.zeros(16, 1, 8, 8))
    with pytest.raises(DatasetError) as exc:
        data.dataset[index]
    assert str(written[("c", 128)][0]) in str(exc.value) and "needs float32 [16, 1, 16, 16]" in str(exc.value)


def test_subsets_must_resolve_to_one_mode(image_set, tmp_path):
    cfg_a = config(image_set)
    fake_caches(image_set, SIZES, BucketSettings.from_config(cfg_a.dataset))
    latents_only = tmp_path / "latents_only"
    latents_only.mkdir()
    for p in image_set.glob("a*"):
        os.link(p, latents_only / p.name)
    (latents_only / "a.png").unlink()
    cfg = config(None, subsets=[(image_set, 1, True), (latents_only, 1, True)])
    with pytest.raises(DatasetError) as exc:
        build_training_data(cfg)
    msg = str(exc.value)
    assert f"subset 0 {image_set}: images" in msg and f"subset 1 {latents_only}: latents" in msg
    assert 'source = "latents"' in msg
    data = build_training_data(config(None, source="latents", subsets=[(image_set, 1, True), (latents_only, 1, True)]))
    assert data.mode == "latents" and len(data.entries) == 5
    with pytest.raises(DatasetError, match='has caches but no images, and source = "encode"'):
        build_training_data(config(None, source="encode", subsets=[(image_set, 1, True), (latents_only, 1, True)]))


def test_encode_mode_yields_pixels_in_range(image_set):
    data = build_training_data(config(image_set, source="encode"))
    for i in range(len(data.dataset)):
        item = data.dataset[i]
        w, h = item["bucket"]
        assert item["pixels"].shape == (3, 1, h, w) and item["pixels"].dtype == torch.float32
        assert -1.0 <= float(item["pixels"].min()) and float(item["pixels"].max()) <= 1.0
    batch = collate([data.dataset[i] for i in next(iter(data.sampler))])
    assert batch["pixels"].ndim == 5 and len(batch["caption"]) == batch["pixels"].shape[0]


# ------------------------------------------------------------------------------------------------- tiers


def test_tiers_collapse_min_source_area_and_report(tmp_path):
    folder = tmp_path / "tiers"
    sizes = {"big": (256, 256), "mid": (128, 128), "small": (64, 64), "tiny": (32, 32)}
    for stem, size in sizes.items():
        write_image(folder, stem, size)
    dedup = build_training_data(config(folder, tiers=(64, 128, 256), source="encode",
                                       extra_dataset="min_source_area = 0.5"))
    # tiny (32*32 < 0.5 * 64^2) dropped; big: 3 tiers; mid: 64, 128; small: 64 only
    assert sorted((dedup.dataset.items[i].stem.name, dedup.dataset.items[i].tier) for i in range(len(dedup.dataset))) \
        == sorted([("big", 64), ("big", 128), ("big", 256), ("mid", 64), ("mid", 128), ("small", 64)])
    assert any("dropped 1 source" in w for w in dedup.warnings)
    report = "\n".join(dedup.report)
    assert "tiers    3 sources x 3 tier(s)" in report and "(2 collapsed onto a lower tier)" in report
    repeat = build_training_data(config(folder, tiers=(64, 128, 256), source="encode",
                                        extra_dataset='min_source_area = 0.5\ntier_collapse = "repeat"'))
    assert len(repeat.dataset) == 9


def test_bucket_shared_by_tiers_uses_largest_tiers_batch_size(tmp_path):
    assert bucket_batch_sizes({(64, 64): {64}, (96, 96): {64, 128}, (128, 128): {128}}, {64: 8, 128: 3}) == \
        {(64, 64): 8, (96, 96): 3, (128, 128): 3}
    assert bucket_batch_sizes({(64, 64): {64}}, 5) == {(64, 64): 5}
    folder = tmp_path / "shared"
    write_image(folder, "small", (96, 96))
    for i in range(5):
        write_image(folder, f"big{i}", (128, 128))
    data = build_training_data(config(folder, tiers=(96, 128), source="encode",
                                      extra_dataset='tier_collapse = "repeat"',
                                      train="batch_size = { 96 = 4, 128 = 2 }"))
    # bucket 96x96: big at tier 96 and small at both tiers -> largest tier 128 -> batch 2
    assert data.sampler.batch_sizes[((96, 96), True)] == 2
    assert max(len(b) for b in data.sampler) == 2


# ------------------------------------------------------------------------------------------------- sampler


def test_sampler_deterministic_homogeneous_partial_tail():
    keys = [((64, 64), True)] * 7 + [((128, 64), True)] * 5 + [((64, 64), False)] * 3
    sampler = BucketBatchSampler(keys, {k: 2 for k in set(keys)}, seed=3)
    assert len(sampler) == 4 + 3 + 2
    sampler.set_epoch(0)
    e0 = list(sampler)
    assert list(sampler) == e0  # deterministic per (seed, epoch)
    assert BucketBatchSampler(keys, {k: 2 for k in set(keys)}, seed=3).batches(0) == e0
    sampler.set_epoch(1)
    assert list(sampler) != e0
    assert sorted(i for b in e0 for i in b) == list(range(len(keys)))  # every index once, nothing dropped
    assert all(len({keys[i] for i in b}) == 1 for b in e0)  # one (bucket, texture) per batch
    assert sorted(len(b) for b in e0).count(1) == 3  # one partial tail per group
    assert BucketBatchSampler(keys, {k: 2 for k in set(keys)}, seed=4).batches(0) != e0


def test_steps_per_epoch_worked_example():
    # docs/training.md#batches-and-steps: 113 images, micro-batch 12, accum 2, 2 processes -> 10 batches -> 5/rank
    # -> 3 steps
    sampler = BucketBatchSampler([((64, 64), True)] * 113, {((64, 64), True): 12}, seed=0)
    assert len(sampler) == 10 and len(list(sampler)) == 10
    assert steps_per_epoch(len(sampler), 2, 2) == 3
    assert steps_per_epoch(10, 1, 1) == 10 and steps_per_epoch(10, 1, 3) == 4 and steps_per_epoch(1, 2, 4) == 1
    assert steps_per_epoch(11, 2, 2) == math.ceil(6 / 2)


# ------------------------------------------------------------------------------------------------ captions/report


def test_captions_per_seed_epoch_index_and_subset_report(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for i in range(3):
        write_image(a, f"x{i}", (64, 64), caption="t1, t2, t3, t4, t5, t6, t7, t8")
    write_image(b, "y0", (64, 64), caption="solo")
    cfg = config(None, tiers=(64,), source="encode", subsets=[(a, 3, True), (b, 1, False)],
                 extra_dataset="[dataset.caption]\nshuffle_tags = true")
    data = build_training_data(cfg)
    ds = data.dataset
    c0 = [ds[i]["caption"] for i in range(len(ds))]
    assert [ds[i]["caption"] for i in range(len(ds))] == c0
    assert len(set(c0[:9])) > 1  # repeats of the same image get their own captions (index-seeded)
    ds.set_epoch(1)
    assert [ds[i]["caption"] for i in range(len(ds))] != c0
    report = "\n".join(data.report)
    assert f"{a}: 3 entries, 90.0% of epoch  x3" in report
    assert f"{b}: 1 entries, 10.0% of epoch  x1  [fullres only -- keeps its captions]" in report
    assert "samples  10 per epoch" in report
    # texture eligibility splits groups even within one bucket
    assert set(data.sampler.groups) == {((64, 64), True), ((64, 64), False)}


def test_accelerate_shards_whole_batches():
    from accelerate.data_loader import BatchSamplerShard

    keys = [((64, 64), True)] * 113
    sampler = BucketBatchSampler(keys, {((64, 64), True): 12}, seed=0)
    shards = [list(BatchSamplerShard(sampler, num_processes=2, process_index=r)) for r in range(2)]
    assert [len(s) for s in shards] == [5, 5]  # 10 batches -> 5 per rank
    assert sorted(i for s in shards for b in s for i in b) == list(range(113))
    assert [len(b) for s in shards for b in s].count(5) == 1  # the partial tail travels whole
    mixed = [((64, 64), True)] * 5 + [((32, 96), True)] * 4
    sampler = BucketBatchSampler(mixed, {k: 2 for k in set(mixed)}, seed=1)
    for r in range(2):  # 5 batches on 2 ranks: padded with a whole earlier batch, never a mixed one
        for b in BatchSamplerShard(sampler, num_processes=2, process_index=r):
            assert len({mixed[i] for i in b}) == 1
