"""`anima-train audit`: percentiles and ladders, collapse per ladder, and the SAFE / NOT SAFE verdict.

Caches hold random latents written through the real metadata path, so no VAE is needed here."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image

from anima_train import cli
from anima_train.data.buckets import Bucketer, suggest_ladder
from anima_train.data.latent_cache import save_cache
from anima_train.data.cache_files import cache_path
from anima_train.data.scan import IMAGE_EXTENSIONS
from anima_train.data.planning import BucketSettings, plan_metadata

SIZES = {"a": (160, 96), "b": (96, 160), "c": (128, 128), "d": (64, 64)}
SETTINGS = BucketSettings(tiers=(96, 128), bucket_reso_steps=32)


def png_header(w: int, h: int) -> bytes:
    """A PNG that declares w x h and carries no pixels (a scan reads only the header)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", b"") + chunk(b"IEND", b"")


def image_of(stem: Path) -> Path | None:
    """The image a hand-made cache is made from, as `anima-train cache` records it (None when there is none)."""
    return next((p for p in sorted(stem.parent.glob(f"{stem.name}.*")) if p.suffix.lower() in IMAGE_EXTENSIONS), None)


def fake_caches(folder: Path, sizes: dict, settings: BucketSettings):
    paths = []
    for stem, size in sizes.items():
        for t in settings.tiers:
            plan = Bucketer(t, bucket_reso_steps=settings.bucket_reso_steps).select(*size)
            path = cache_path(folder / stem, plan.bucket)
            if not path.exists():
                save_cache(path, torch.zeros(16, 1, plan.bucket[1] // 8, plan.bucket[0] // 8),
                           plan_metadata(plan, settings, t, None, image_of(folder / stem)))
                paths.append(path)
    return paths


@pytest.fixture
def cached_set(tmp_path):
    folder = tmp_path / "set"
    folder.mkdir()
    for stem, size in SIZES.items():
        Image.new("RGB", size, (10, 200, 30)).save(folder / f"{stem}.png")
        (folder / f"{stem}.txt").write_text("green square, black background")
    return folder


def audit(capsys, *args) -> tuple[int, str]:
    rc = cli.main(["audit", *map(str, args)])
    return rc, capsys.readouterr().out


def test_safe_only_when_every_image_is_cached_and_captioned(cached_set, capsys):
    flags = ("--resolution", 96, 128, "--bucket-reso-steps", 32)
    rc, out = audit(capsys, cached_set, *flags)
    assert rc == 4 and "NOT SAFE" in out and "(image, tier) pair(s) have no cache" in out
    assert "fix: anima-train cache" in out
    caches = fake_caches(cached_set, SIZES, SETTINGS)
    rc, out = audit(capsys, cached_set, *flags)
    assert rc == 0 and "verdict  SAFE" in out and "NOT SAFE" not in out

    # one cache missing
    data = caches[0].read_bytes()
    caches[0].unlink()
    rc, out = audit(capsys, cached_set, *flags)
    assert rc == 4 and "1 (image, tier) pair(s)" in out and "NOT SAFE" in out
    caches[0].write_bytes(data)
    # one caption missing
    (cached_set / "c.txt").unlink()
    rc, out = audit(capsys, cached_set, *flags)
    assert rc == 4 and "1 source(s) have no caption file: c.txt" in out
    (cached_set / "c.txt").write_text("x")
    # an unreadable image
    (cached_set / "e.png").write_bytes(b"nope")
    (cached_set / "e.txt").write_text("x")
    rc, out = audit(capsys, cached_set, *flags)
    assert rc == 4 and "1 image(s) cannot be read" in out
    (cached_set / "e.png").unlink()
    (cached_set / "e.txt").unlink()
    # other settings than the caches were made with
    rc, out = audit(capsys, cached_set, "--resolution", 96, 128, "--bucket-reso-steps", 64)
    assert rc == 4 and "bucket_reso_steps=32, the config says 64" in out
    rc, out = audit(capsys, cached_set, "--resolution", 64, 96, 128, "--bucket-reso-steps", 32)
    assert rc == 4 and "resolutions=[96, 128], the config says [64, 96, 128]" in out
    assert audit(capsys, cached_set, *flags)[0] == 0


def test_after_deleting_images_settings_come_from_the_caches(cached_set, capsys, tmp_path):
    fake_caches(cached_set, SIZES, SETTINGS)
    for p in cached_set.glob("*.png"):
        p.unlink()
    rc, out = audit(capsys, cached_set)  # no --resolution: the caches' own record
    assert "settings taken from the caches' records: resolutions [96, 128], bucket_reso_steps 32" in out
    assert rc == 0 and "verdict  SAFE" in out and "4 cached stem(s) without image" in out
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'[dataset]\npath = "{cached_set}"\nresolutions = [96, 128]\nbucket_reso_steps = 32\n')
    assert audit(capsys, "--config", cfg)[0] == 0
    cfg.write_text(f'[dataset]\npath = "{cached_set}"\nresolution = 128\nbucket_reso_steps = 32\n')
    rc, out = audit(capsys, "--config", cfg)
    assert rc == 0 and "warning: 3 cache file(s) match no declared tier" in out  # tier-96-only leftovers


def test_percentiles_ladders_and_collapse(tmp_path, capsys):
    folder = tmp_path / "big"
    folder.mkdir()
    sizes = [(4000, 3000), (1920, 1080), (1024, 1024), (3000, 2000), (800, 600), (2048, 2048), (1500, 1000),
             (600, 900), (2500, 1600), (1280, 720)] * 2
    for i, (w, h) in enumerate(sizes):
        (folder / f"s{i:02d}.png").write_bytes(png_header(w, h))
        (folder / f"s{i:02d}.txt").write_text("x")
    areas = [w * h for w, h in sizes]
    ladder = suggest_ladder(areas, 64, 1920)
    rc, out = audit(capsys, folder, "--resolution", 768, 1024, 1280)
    assert rc == 4  # nothing cached
    assert "source-area distribution (20 sources)" in out and "p10" in out
    assert f"suggested ladder: resolutions = [{', '.join(map(str, ladder))}]" in out
    configured = next(line for line in out.splitlines() if line.strip().startswith("configured"))
    suggested = next(line for line in out.splitlines() if line.strip().startswith("suggested "))
    # 800x600 and 600x900 (4 of 20) are below 1024^2; 1280x720 (2 more) below 1280^2 too
    assert "[768, 1024, 1280]" in configured and "per tier: 768 0.0%, 1024 20.0%, 1280 40.0%" in configured
    assert f"[{', '.join(map(str, ladder))}]" in suggested


def test_a_damaged_cache_is_not_safe_and_named(cached_set, capsys):
    # the report: an 8x8 latent in a 128x128-bucket cache (metadata kept) and the audit said SAFE
    from safetensors import safe_open
    from safetensors.torch import save_file

    flags = ("--resolution", 96, 128, "--bucket-reso-steps", 32)
    fake_caches(cached_set, SIZES, SETTINGS)
    bad = cached_set / "c_0128x0128_anima.safetensors"
    with safe_open(str(bad), "pt") as f:
        meta = f.metadata()
    save_file({"latents": torch.zeros(16, 1, 8, 8)}, str(bad), metadata=meta)
    rc, out = audit(capsys, cached_set, *flags)
    assert rc == 4 and "NOT SAFE" in out and "verdict  SAFE" not in out
    assert f"{bad} (latents float32 [16, 1, 8, 8], but bucket 128x128 needs float32 [16, 1, 16, 16])" in out
    assert "fix: anima-train cache" in out
    # with the images gone (settings from the caches) it is still not safe: the file cannot be re-made later
    for p in cached_set.glob("*.png"):
        p.unlink()
    rc, out = audit(capsys, cached_set)
    assert rc == 4 and "1 cache file(s) are damaged" in out and str(bad) in out
    # a truncated cache: a NOT SAFE finding naming it, not an error
    save_file({"latents": torch.zeros(16, 1, 16, 16)}, str(bad), metadata=meta)
    assert audit(capsys, cached_set)[0] == 0
    bad.write_bytes(bad.read_bytes()[:-64])
    rc, out = audit(capsys, cached_set)
    assert rc == 4 and f"{bad} (cannot be read" in out


def test_audit_prints_the_dataset_warnings(cached_set, capsys, tmp_path):
    # the warnings `train` prints: tier collapse >= 1 %, min_source_area drops, caches no tier uses
    (cached_set / "tiny.png").write_bytes(png_header(16, 16))
    (cached_set / "tiny.txt").write_text("x")
    fake_caches(cached_set, SIZES, SETTINGS)  # made for [96, 128]; the config below asks for [64, 128]
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'[dataset]\npath = "{cached_set}"\nresolutions = [64, 128]\nbucket_reso_steps = 32\n'
                   f"min_source_area = 0.5\n")
    rc, out = audit(capsys, "--config", cfg)
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert any(w.startswith("warning: tier 128: 1/4 sources (25.0%)") for w in warnings), out
    assert "warning: min_source_area = 0.5: dropped 1 source(s) smaller than 0.5 x 64^2 px (e.g. tiny)" in warnings
    assert any("cache file(s) match no declared tier" in w and "resolutions=[96, 128], the config says [64, 128]"
               in w for w in warnings), out
