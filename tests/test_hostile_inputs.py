"""The second hostile-input sweep (issue 24), as a user meets it: every input goes through the real CLI
(`python -m anima_train ...`) and each case asserts on what the user sees (one error message naming the file or
key and the fix, no traceback, no "internal error"), the exit status, and the files left behind.

The images part: every image that a viewer shows like a plain RGB twin must cache to the same latents as the twin
(16-bit grayscale, transparency, EXIF orientation, CMYK, palette)."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from anima_train import errors
from anima_train.system import parent_watch
from anima_train.config import TextureConfig
from anima_train.data.images import decoded_size, header_size
from anima_train.data.texture import texture_sample
from anima_train.model.tiny import make_synthetic_dataset
from tests.fixtures_tiny import anima_train_cli, small_run_toml

ROOT = Path(__file__).resolve().parents[1]




def refused(out: subprocess.CompletedProcess, command: str, code: int, *parts: str, one_line: bool = False) -> str:
    """Exit `code`; stderr is one `anima-train COMMAND: error: ...` message that names every part; no traceback.
    one_line: the message is one line (several problems of a config file come as a header and a line each)."""
    err = out.stderr
    assert out.returncode == code, f"exit {out.returncode}\n{err}"
    assert "Traceback" not in err and "internal error" not in err, err
    assert err.startswith(f"anima-train {command}: error: ") and err.count("error:") == 1, err
    if one_line:
        lines = err.splitlines()
        assert len(lines) == 1, err
    for part in parts:
        assert part in err, f"{part!r} not in:\n{err}"
    return err


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


@pytest.fixture(scope="module")
def model(tiny_anima):
    return tiny_anima.diffusers_dir


def good_images(folder: Path, n: int = 2) -> Path:
    make_synthetic_dataset(folder, n=n, seed=3, sizes=[(128, 128), (160, 96)], jpeg_every=0)
    return folder


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def noisy(path: Path, size=(128, 128)) -> Path:
    """An image that compresses badly, so half of its file is missing real pixel data."""
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    path.with_suffix(".txt").write_text("noise")
    return path


def config(tmp_path: Path, model, data, extra: str = "", train: str = "", dataset: str = "") -> Path:
    text = small_run_toml(model, data, tmp_path / "out", train=train, tables=extra)
    text = text.replace("resolution = 128\n", "resolution = 128\n" + dataset)
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------------ images (item 6)

def _rgb(gray: np.ndarray) -> np.ndarray:
    return np.repeat(gray[..., None], 3, axis=2)


def _gray16(folder):
    """16-bit grayscale: a gradient over the whole 16-bit range, shown as the same 8-bit gradient."""
    v = np.tile(np.linspace(0, 255, 96).astype(np.uint8), (64, 1))
    Image.fromarray(v.astype(np.uint16) * 257).save(folder / "odd_gray16.png")  # mode I;16
    Image.fromarray(_rgb(v)).save(folder / "twin_gray16.png")


def _checker(h=64, w=96) -> np.ndarray:
    return ((np.indices((h, w)) // 8).sum(axis=0) % 2).astype(bool)


def _la(folder):
    """Gray + alpha: transparent squares show the white background, not their hidden black."""
    clear = _checker()
    gray = np.where(clear, 0, 90).astype(np.uint8)
    Image.fromarray(np.stack([gray, np.where(clear, 0, 255).astype(np.uint8)], axis=2),
                    "LA").save(folder / "odd_la.png")
    Image.fromarray(_rgb(np.where(clear, 255, 90).astype(np.uint8))).save(folder / "twin_la.png")


def _rgba(folder):
    clear = _checker()
    rgb = np.zeros((64, 96, 3), np.uint8)
    rgb[~clear] = (200, 40, 10)
    alpha = np.where(clear, 0, 255).astype(np.uint8)
    Image.fromarray(np.dstack([rgb, alpha]), "RGBA").save(folder / "odd_rgba.png")
    shown = rgb.copy()
    shown[clear] = 255
    Image.fromarray(shown).save(folder / "twin_rgba.png")


def _palette_transparent(folder):
    clear = _checker()
    index = np.where(clear, 0, 1).astype(np.uint8)
    im = Image.fromarray(index, "P")
    im.putpalette([0, 0, 0, 30, 160, 60] + [0] * 762)
    im.info["transparency"] = 0
    im.save(folder / "odd_ptrans.png", transparency=0)
    shown = np.zeros((64, 96, 3), np.uint8)
    shown[clear] = 255
    shown[~clear] = (30, 160, 60)
    Image.fromarray(shown).save(folder / "twin_ptrans.png")


def _exif_rotated(folder):
    """A camera JPEG stored sideways with EXIF orientation 6 (rotate 90° clockwise to view): trains upright."""
    pixels = np.random.default_rng(1).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(pixels).save(folder / "odd_exif.jpg", quality=95, exif=exif)
    with Image.open(folder / "odd_exif.jpg") as im:
        stored = np.asarray(im.convert("RGB"))
    Image.fromarray(np.ascontiguousarray(np.rot90(stored, k=-1))).save(folder / "twin_exif.png")  # 90° clockwise


def _cmyk(folder):
    pixels = np.random.default_rng(2).integers(0, 256, (64, 96, 4), dtype=np.uint8)
    Image.fromarray(pixels, "CMYK").save(folder / "odd_cmyk.jpg", quality=95)
    with Image.open(folder / "odd_cmyk.jpg") as im:
        im.convert("RGB").save(folder / "twin_cmyk.png")


def _palette(folder):
    index = (np.indices((64, 96)).sum(axis=0) % 4).astype(np.uint8)
    im = Image.fromarray(index, "P")
    palette = [10, 20, 30, 200, 100, 0, 0, 90, 250, 255, 255, 255]
    im.putpalette(palette + [0] * (768 - len(palette)))
    im.save(folder / "odd_palette.png")
    colours = np.array(palette, np.uint8).reshape(4, 3)
    Image.fromarray(colours[index]).save(folder / "twin_palette.png")


IMAGE_CASES = {"gray16": _gray16, "la": _la, "rgba": _rgba, "ptrans": _palette_transparent, "exif": _exif_rotated,
               "cmyk": _cmyk, "palette": _palette}


@pytest.fixture(scope="module")
def cached_pairs(model, tmp_path_factory):
    """One `anima-train cache` run over every odd image and its twin."""
    folder = tmp_path_factory.mktemp("odd_images")
    for make in IMAGE_CASES.values():
        make(folder)
    for image in list(folder.iterdir()):
        image.with_suffix(".txt").write_text("an image")
    out = anima_train_cli("cache", folder, "--resolution", 64, "--bucket-reso-steps", 16, "--model", model,
                          "--device", "cpu", cwd=folder)
    assert out.returncode == 0, out.stderr[-3000:]
    return folder


@pytest.mark.parametrize("case", list(IMAGE_CASES))
def test_an_image_caches_as_a_viewer_shows_it(cached_pairs, case):
    odd = sorted(cached_pairs.glob(f"odd_{case}_*_anima.safetensors"))
    twin = sorted(cached_pairs.glob(f"twin_{case}_*_anima.safetensors"))
    assert len(odd) == len(twin) == 1, (odd, twin)
    assert odd[0].name.replace("odd_", "") == twin[0].name.replace("twin_", ""), "different buckets (sizes)"
    a, b = load_file(odd[0])["latents"], load_file(twin[0])["latents"]
    assert torch.equal(a, b), f"{case}: max |diff| {(a - b).abs().max().item()}"


@pytest.mark.parametrize("case", list(IMAGE_CASES))
def test_texture_crops_and_the_audit_see_the_same_image(tmp_path, case):
    """The other readers use the same loader: texture crops are pixel-equal to the twin's, and the scan's sizes
    (which the audit reports) are the twin's."""
    IMAGE_CASES[case](tmp_path)
    odd, twin = (next(tmp_path.glob(f"{kind}_{case}.*")) for kind in ("odd", "twin"))
    assert header_size(odd) == header_size(twin) == decoded_size(odd)
    a, b = (texture_sample(p, (32, 32), TextureConfig(), seed=0, epoch=0, index=0)["pixels"] for p in (odd, twin))
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------ undecodable images (item 8)

@pytest.mark.parametrize("suffix", [".png", ".jpg"])
def test_a_truncated_image_is_named_by_every_command(model, tmp_path, suffix):
    data = good_images(tmp_path / "data")
    bad = noisy(data / f"z{suffix}")
    truncate(bad)
    cfg = config(tmp_path, model, data, dataset='source = "encode"\n')
    before = files(data)
    for args, command, code in ((("config", cfg), "config", 2),
                                (("train", cfg, "--dry-run", "--cpu"), "train", 2),
                                (("cache", data, "--resolution", 128, "--model", model, "--device", "cpu"), "cache",
                                 errors.DATA_VERDICT_EXIT)):
        refused(anima_train_cli(*args, cwd=tmp_path), command, code, str(bad), "truncated", "fix or delete")
    assert files(data) == before  # no cache written for the good images either: the refusal comes first
    assert not (tmp_path / "out").exists()
    audit = anima_train_cli("audit", data, "--resolution", 128, cwd=tmp_path)
    assert audit.returncode == errors.DATA_VERDICT_EXIT, audit.stderr
    assert "NOT SAFE" in audit.stdout and f"{bad} (truncated" in audit.stdout and "Traceback" not in audit.stderr


def test_config_decodes_an_image_that_still_needs_its_cache(model, tmp_path):
    """source = images: the truncated image has no cache; `config` names it, not only "run cache"."""
    data = good_images(tmp_path / "data")
    bad = noisy(data / "z.png")
    truncate(bad)
    refused(anima_train_cli("config", config(tmp_path, model, data), cwd=tmp_path), "config", 2, str(bad), "truncated")


# ----------------------------------------------------------------------------------- damaged model repo (item 9)

def _truncated_transformer(repo: Path) -> Path:
    path = repo / "transformer" / "diffusion_pytorch_model.safetensors"
    truncate(path)
    return path


def _random_text_encoder(repo: Path) -> Path:
    path = repo / "text_encoder" / "model.safetensors"
    path.write_bytes(np.random.default_rng(0).bytes(5000))
    return path


def _broken_config(repo: Path) -> Path:
    path = repo / "transformer" / "config.json"
    text = path.read_text()
    path.write_text(text[:len(text) // 2])
    return path


def _wrong_shape(repo: Path) -> Path:
    path = repo / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(path)
    name = next(k for k, v in tensors.items() if v.ndim == 2)
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])
    save_file(tensors, path, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("damage, component, check_train", [
    (_truncated_transformer, "transformer", True), (_random_text_encoder, "text_encoder", False),
    (_broken_config, "transformer", False), (_wrong_shape, "transformer", True)])
def test_a_damaged_model_repo_names_the_component_and_file(model, tmp_path, damage, component, check_train):
    repo = tmp_path / "repo"
    shutil.copytree(model, repo)
    path = damage(repo)
    data = good_images(tmp_path / "data")
    cfg = config(tmp_path, repo, data, dataset='source = "encode"\n')
    parts = (str(path), f"({component}) is damaged", "anima-train convert")
    err = refused(anima_train_cli("config", cfg, cwd=tmp_path), "config", 2, *parts)
    assert "ignore_mismatched_sizes" not in err
    if check_train:
        refused(anima_train_cli("train", cfg, "--dry-run", "--cpu", cwd=tmp_path), "train", 2, *parts)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- folders, keys and flags (11, 12, 13)

def _symlink_loop(tmp_path, model):
    data = good_images(tmp_path / "data")
    os.symlink("b", data / "a")
    os.symlink("a", data / "b")
    return ("cache", data, "--resolution", 128, "--dry-run"), "cache", 2, (str(data / "a"), "symbolic link")


def _huge_repeat_folder(tmp_path, model):
    data = tmp_path / "data"
    good_images(data / "99999999999999999999_big")
    return ("cache", data, "--resolution", 128, "--dry-run"), "cache", 2, ("99999999999999999999_big", "10000")


def _huge_rank(tmp_path, model):
    data = good_images(tmp_path / "data")
    cfg = config(tmp_path, model, data)
    cfg.write_text(cfg.read_text().replace("rank = 4\n", "rank = 100000000000000000000\n"))
    return ("config", cfg), "config", 2, ("[adapter] rank", "<= 4096")


def _events_folder(tmp_path, model):
    cfg = config(tmp_path, model, good_images(tmp_path / "data"))
    return ("train", cfg, "--cpu", "--events", tmp_path), "train", 2, (f"--events {tmp_path}", "is a folder")


def _events_missing_folder(tmp_path, model):
    cfg = config(tmp_path, model, good_images(tmp_path / "data"))
    ev = tmp_path / "nope" / "ev.jsonl"
    return ("train", cfg, "--cpu", "--events", ev), "train", 2, (f"--events {ev}", "does not exist")


def _device_banana(tmp_path, model):
    data = good_images(tmp_path / "data")
    return ("cache", data, "--resolution", 128, "--model", model, "--device", "banana"), "cache", 2, \
        ("--device banana", "cpu, cuda")


def _device_cuda(tmp_path, model):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    data = good_images(tmp_path / "data")
    return ("cache", data, "--resolution", 128, "--model", model, "--device", "cuda"), "cache", 2, \
        ("--device cuda", "no CUDA GPU", "--device cpu")


def _resolution_17(tmp_path, model):
    cfg = config(tmp_path, model, good_images(tmp_path / "data"))
    cfg.write_text(cfg.read_text().replace("resolution = 128\n", "resolution = 17\n"))
    return ("config", cfg), "config", 2, ("[dataset] resolution", "below bucket_reso_steps = 64")


def _batch_size_keys(tmp_path, model):
    cfg = config(tmp_path, model, good_images(tmp_path / "data"), train="batch_size = { 999 = 2, abc = 1 }\n")
    return ("config", cfg), "config", 2, ("[train] batch_size", 'the key "abc" is not a whole number')


def _empty_folder(tmp_path, model):
    (tmp_path / "data").mkdir()
    cfg = config(tmp_path, model, tmp_path / "data")
    return ("config", cfg), "config", 2, (str(tmp_path / "data"), "holds no images")


def _captions_only_folder(tmp_path, model):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("a caption without its image")
    cfg = config(tmp_path, model, tmp_path / "data")
    return ("config", cfg), "config", 2, (str(tmp_path / "data"), "holds no images")


def _cache_nope(tmp_path, model):
    return ("cache", "/nope", "--resolution", 128), "cache", 2, ("/nope", "check the path")


def _audit_nope(tmp_path, model):
    return ("audit", "/nope"), "audit", 2, ("/nope", "check the path")


def _anchor_random(tmp_path, model):
    path = tmp_path / "random.safetensors"
    path.write_bytes(np.random.default_rng(0).bytes(3000))
    return ("anchor-info", path), "anchor-info", 2, (str(path), "not an anchor file")


def _anchor_pickle(tmp_path, model):
    path = tmp_path / "a.pt"
    path.write_bytes(pickle.dumps({"model": Path("x")}))
    return ("anchor-info", path), "anchor-info", 2, (str(path), "not an anchor file")


def _demo_steps(tmp_path, model):
    return ("demo", "--steps", 0, "--out", tmp_path / "demo"), "demo", 2, ("--steps 0", "at least 1")


def _demo_images(tmp_path, model):
    return ("demo", "--images", 0, "--out", tmp_path / "demo"), "demo", 2, ("--images 0", "at least 1")


CASES = [_symlink_loop, _huge_repeat_folder, _huge_rank, _events_folder, _events_missing_folder, _device_banana,
         _device_cuda, _resolution_17, _batch_size_keys, _empty_folder, _captions_only_folder, _cache_nope,
         _audit_nope, _anchor_random, _anchor_pickle, _demo_steps, _demo_images]


# data verdicts that lead with their fix and give the details (the folder) on the lines after: the fix they say first
FIX_FIRST = {_empty_folder: "give a folder of", _captions_only_folder: "give a folder of",
             _huge_repeat_folder: "with a smaller N", _symlink_loop: "remove it"}


@pytest.mark.parametrize("case", CASES, ids=lambda f: f.__name__.strip("_"))
def test_hostile_input_gets_one_clear_message(model, tmp_path, case):
    args, command, code, parts = case(tmp_path, model)
    before = files(tmp_path)
    out = anima_train_cli(*args, cwd=tmp_path)
    if command == "anchor-info":  # the anchor package's own prefix
        assert out.returncode == code and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.startswith("anchor-info: ") and out.stderr.count("\n") == 1, out.stderr
        assert all(p in out.stderr for p in parts), out.stderr
        assert "weights_only" not in out.stderr and "torch.load" not in out.stderr, out.stderr  # never advise that
    else:
        fix_first = case in FIX_FIRST  # a data verdict: its fix on the first line, the folder on the next (#41)
        err = refused(out, command, code, *parts, one_line=not fix_first)
        if fix_first:
            first = err.splitlines()[0]
            assert len(first) <= 120 + len(f"anima-train {command}: error: ") and FIX_FIRST[case] in first, err
        assert "in the config" not in err or command in ("config", "train"), err
        assert "got a table" not in err and "too thin" not in err, err
    assert files(tmp_path) == before  # nothing written: no run folder, no cache, no demo folder


def test_audit_not_safe_is_a_data_verdict(tmp_path):
    data = good_images(tmp_path / "data")
    out = anima_train_cli("audit", data, "--resolution", 128, cwd=tmp_path)
    assert out.returncode == errors.DATA_VERDICT_EXIT and "NOT SAFE" in out.stdout, out.stdout + out.stderr


# ------------------------------------------------------------------------------------------------ exit codes

def test_the_readme_exit_status_table_is_the_code():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", readme, flags=re.M))
    expected = {0: "done", errors.INTERNAL_ERROR_EXIT: "a bug", errors.USER_ERROR_EXIT: "bad input",
                parent_watch.EXIT_PARENT_GONE: "ComfyUI ended", errors.DATA_VERDICT_EXIT: "data verdict",
                errors.DIVERGED_EXIT: "non-finite", errors.INTERRUPTED_EXIT: "interrupted"}
    assert {int(k) for k in rows} == set(expected), rows
    for code, words in expected.items():
        assert words in rows[str(code)], (code, rows[str(code)])
