"""Issue 42, class 2: a result is only as fresh as its inputs. Every case goes through the real CLI
(`python -m anima_train ...`) on the issue's common setup (a tiny model, 96x96 PNGs with captions, resolution 64) and
asserts what the user reads, the exit status and the bytes of the user's files before and after.

The mechanism under test: input identities (anima_train/data/identity.py) recorded by the cache writer and by the
resume state, and checked by their readers (docs/architecture.md: Nothing lost)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests import fixtures_tiny
from tests.fixtures_tiny import anima_train_cli, folder_digests


@pytest.fixture(scope="module")
def model(tiny_anima):
    return tiny_anima.diffusers_dir


def pixels(path: Path, seed: int, size: int = 96) -> None:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)


def images(folder: Path, n: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        pixels(folder / f"img{i}.png", seed=i)
        (folder / f"img{i}.txt").write_text(f"tag{i}, solo, red", encoding="utf-8")
    return folder


def config(tmp: Path, model, *, source: str = "encode", train: str = "", tables: str = "", name: str = "run.toml",
           data: str = "base") -> Path:
    path = tmp / name
    path.write_text(f"""[train]
model_path = "{model}"
output_dir = "out"
dtype = "float32"
num_workers = 0
progress = "off"
gradient_checkpointing = false
max_steps = 3
{train}
[dataset]
path = "{data}"
resolution = 64
source = "{source}"
[adapter]
rank = 4
[optimizer]
lr = 5e-3
{tables}""", encoding="utf-8")
    return path


def refused(out, command: str, *parts: str, code: int = 2) -> str:
    """Exit `code`, one `anima-train COMMAND: error:` message naming every part, no traceback."""
    err = out.stderr
    assert out.returncode == code, f"exit {out.returncode}\n{out.stdout}\n{err}"
    assert "Traceback" not in err and "internal error" not in err, err
    assert err.count(f"anima-train {command}: error: ") == 1, err
    for part in parts:
        assert part in err, f"{part!r} not in:\n{err}"
    return err


def user_files(tmp: Path) -> dict:
    """The bytes of the files the user owns (images, captions, configs), not the caches and runs we write."""
    return {k: v for k, v in folder_digests(tmp).items()
            if not k.endswith("_anima.safetensors") and not k.startswith("out/")}


# ---------------------------------------------------------------------------------------------------- caches


def test_a_replaced_image_of_the_same_size_is_stale_for_cache_audit_and_train(tmp_path, model):
    base = images(tmp_path / "base")
    cfg = config(tmp_path, model, source="images")
    first = anima_train_cli("cache", "--config", cfg, cwd=tmp_path)
    assert first.returncode == 0 and "wrote    4 cache file(s)" in first.stdout, first.stdout + first.stderr
    pixels(base / "img1.png", seed=99)  # another picture, the same 96x96
    before = user_files(tmp_path)

    audit = anima_train_cli("audit", "--config", cfg, "--model", model, cwd=tmp_path)
    assert audit.returncode == 4, audit.stdout + audit.stderr
    assert "NOT SAFE" in audit.stdout and "img1_0064x0064_anima.safetensors" in audit.stdout, audit.stdout
    assert "img1.png" in audit.stdout and "SAFE to delete" not in audit.stdout.replace("NOT SAFE to delete", "")

    train = anima_train_cli("train", cfg, cwd=tmp_path)
    err = refused(train, "train", "img1", "its image changed since it was encoded", "cache --config")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("*.safetensors")), err

    again = anima_train_cli("cache", "--config", cfg, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "stale" in again.stdout and "img1_0064x0064_anima.safetensors" in again.stdout, again.stdout
    assert "todo     1 of 4 cache file(s)" in again.stdout and "3 already valid" in again.stdout, again.stdout
    assert user_files(tmp_path) == before  # the user's images and captions untouched

    safe = anima_train_cli("audit", "--config", cfg, "--model", model, cwd=tmp_path)
    assert safe.returncode == 0 and "verdict  SAFE" in safe.stdout, safe.stdout + safe.stderr


def test_a_touched_image_with_the_same_bytes_stays_valid_and_a_deleted_one_keeps_its_cache(tmp_path, model):
    base = images(tmp_path / "base")
    cfg = config(tmp_path, model, source="images")
    assert anima_train_cli("cache", "--config", cfg, cwd=tmp_path).returncode == 0
    data = (base / "img2.png").read_bytes()
    (base / "img2.png").write_bytes(data)  # rewritten: a new modification time, the same picture
    out = anima_train_cli("cache", "--config", cfg, cwd=tmp_path)
    assert out.returncode == 0 and "4 already valid" in out.stdout, out.stdout + out.stderr
    # the image gone: the cache is now the only copy and stands (audit counts it, train reads it as latents)
    (base / "img2.png").unlink()
    audit = anima_train_cli("audit", "--config", cfg, "--model", model, cwd=tmp_path)
    assert "img2_0064x0064_anima.safetensors" not in audit.stdout, audit.stdout


def test_a_cache_from_before_image_records_is_re_encoded_with_one_line(tmp_path, model):
    base = images(tmp_path / "base")
    cfg = config(tmp_path, model, source="images")
    assert anima_train_cli("cache", "--config", cfg, cwd=tmp_path).returncode == 0
    cache = base / "img0_0064x0064_anima.safetensors"
    with safe_open(str(cache), "pt") as f:
        meta = dict(f.metadata())
    meta.pop("image", None)  # as an older anima-train wrote it
    save_file(load_file(str(cache)), str(cache), metadata=meta)

    train = anima_train_cli("train", cfg, cwd=tmp_path)
    refused(train, "train", "img0", "records no image identity")
    out = anima_train_cli("cache", "--config", cfg, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    said = [line for line in out.stdout.splitlines() if "records no image identity" in line]
    assert len(said) == 1 and "1 cache file(s)" in said[0], out.stdout
    assert "todo     1 of 4 cache file(s)" in out.stdout, out.stdout


# ---------------------------------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def resumable(tmp_path_factory, model):
    """A run over 8 images stopped at step 2 of 3 with its state, and a second tiny model (another seed)."""
    tmp = tmp_path_factory.mktemp("resume")
    images(tmp / "base", n=8)
    cfg = config(tmp, model, train="save_optimizer_state = true\nsave_every_steps = 2\nbatch_size = 1",
                 name="first.toml")
    out = anima_train_cli("train", cfg, "--max-steps", "2", cwd=tmp)
    assert out.returncode == 0, out.stdout + out.stderr
    states = sorted((tmp / "out").rglob("*-state"))
    assert states, folder_digests(tmp / "out")
    other = fixtures_tiny.tiny_anima(tmp_path_factory, seed=1).diffusers_dir
    return tmp, states[0], other


def resume_config(tmp: Path, model, state: Path, name: str) -> Path:
    return config(tmp, model, name=name, train=f'save_optimizer_state = true\nbatch_size = 1\n'
                                               f'resume_from = "{state.as_posix()}"\nrun_name = "{name[:-5]}"')


def test_resuming_on_another_base_model_is_refused_before_it_loads(resumable):
    tmp, state, other = resumable
    cfg = resume_config(tmp, other, state, "other.toml")
    before = folder_digests(tmp)
    out = anima_train_cli("train", cfg, cwd=tmp)
    refused(out, "train", "another base model", "model_path", str(other))
    assert folder_digests(tmp) == before


def test_resuming_on_a_copy_of_the_same_model_is_accepted(resumable, model, tmp_path):
    tmp, state, _ = resumable
    copy = shutil.copytree(model, tmp_path / "moved-model")  # new modification times, the same bytes
    out = anima_train_cli("config", resume_config(tmp, copy, state, "moved.toml"), cwd=tmp)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "another base model" not in out.stderr


def test_an_emptied_losses_json_is_refused_like_a_damaged_state_json(resumable, model, tmp_path):
    tmp, state, _ = resumable
    copy = shutil.copytree(state, tmp_path / state.name)
    (copy / "losses.json").write_text("", encoding="utf-8")
    cfg = resume_config(tmp, model, copy, "losses.toml")
    before = folder_digests(tmp_path)
    out = anima_train_cli("train", cfg, cwd=tmp)
    refused(out, "train", "losses.json", "loss history", "Restore the file")
    assert folder_digests(tmp_path) == before


def test_resuming_on_a_changed_dataset_says_what_changed_once(resumable, model, tmp_path):
    tmp, state, _ = resumable
    work = tmp_path / "w"
    shutil.copytree(tmp / "base", work / "base")
    copy = shutil.copytree(state, tmp_path / state.name)
    for i in range(5):  # 5 of the 8 images gone mid-epoch
        (work / "base" / f"img{i}.png").unlink()
        (work / "base" / f"img{i}.txt").unlink()
    cfg = resume_config(work, model, copy, "changed.toml")
    out = anima_train_cli("train", cfg, cwd=work)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout + out.stderr
    said = [line for line in text.splitlines() if "the dataset changed since" in line]
    assert len(said) == 1, text
    assert "5 gone" in said[0] and "img0.png" in said[0] and "8 source file(s) then, 3 now" in said[0], said


# ---------------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("layout", ["equal", "inside", "copy"])
def test_a_validation_folder_holding_training_images_is_refused(tmp_path, model, layout):
    base = images(tmp_path / "base")
    if layout == "equal":
        folder = "base"
    elif layout == "inside":  # an N_name subfolder: the dataset scans it too
        images(base / "2_more", n=2)
        folder = "base/2_more"
    else:  # copies of two training images beside one new image
        val = tmp_path / "val"
        val.mkdir()
        for i in (0, 1):
            shutil.copy(base / f"img{i}.png", val / f"img{i}.png")
            shutil.copy(base / f"img{i}.txt", val / f"img{i}.txt")
        pixels(val / "new.png", seed=50)
        (val / "new.txt").write_text("new", encoding="utf-8")
        folder = "val"
    cfg = config(tmp_path, model, tables=f'[validation]\nfolder = "{folder}"\n')
    before = user_files(tmp_path)
    out = anima_train_cli("train", cfg, "--dry-run", cwd=tmp_path)
    err = refused(out, "train", "[validation] folder = ", f"{folder}'", "training images too", "fraction")
    assert len(err.strip().splitlines()) == 1 and ("img0.png = " in err or layout == "equal"), err
    assert user_files(tmp_path) == before
