"""Issue 42, class 3: a setting or input that is not honoured is said, once, before training. Every case goes through
the real CLI (`python -m anima_train ...`) on the issue's common setup and asserts what the user reads, the exit
status and the bytes of the user's files before and after.

The mechanism under test: one report of what a run will not honour (anima_train/training/honoured.py, said by
`train` and `config`), the scan's own findings (data/scan.py), and `cache` running the config's [dataset] rules on
its flags (docs/architecture.md: Nothing lost)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.fixtures_tiny import anima_train_cli, folder_digests
from tests.test_hostile_freshness import config, images, pixels, refused, user_files


@pytest.fixture(scope="module")
def model(tiny_anima):
    return tiny_anima.diffusers_dir


def said_once(out, part: str) -> str:
    """`part` is in exactly one line of what the user reads (stdout and stderr), and the command succeeded."""
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line for line in (out.stdout + out.stderr).splitlines() if part in line]
    assert len(lines) == 1, f"{part!r} said {len(lines)} times:\n{out.stdout}\n{out.stderr}"
    return lines[0]


def wrote_nothing(tmp: Path) -> bool:
    """No file under the output folder (the run folder's claim may have made its empty folder)."""
    return not [p for p in (tmp / "out").rglob("*") if p.is_file()]


# ------------------------------------------------------------------------------------------- settings (refused)


@pytest.mark.parametrize("command", ["config", "train"])
def test_nl_caption_mode_without_any_nl_file_is_refused(tmp_path, model, command):
    images(tmp_path / "base")
    cfg = config(tmp_path, model, tables='[dataset.caption]\ncaption_mode = "nl"\n')
    before = user_files(tmp_path)
    out = anima_train_cli(command, cfg, cwd=tmp_path)
    refused(out, command, 'caption_mode = "nl"', "_nl.txt", "none of the 4 source(s)", 'caption_mode = "tags"')
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert user_files(tmp_path) == before and wrote_nothing(tmp_path)


def test_nl_caption_mode_with_some_nl_files_says_which_train_on_tags(tmp_path, model):
    base = images(tmp_path / "base")
    (base / "img0_nl.txt").write_text("A red square.", encoding="utf-8")
    out = anima_train_cli("config", config(tmp_path, model, tables='[dataset.caption]\ncaption_mode = "nl"\n'),
                          cwd=tmp_path)
    line = said_once(out, "_nl.txt and train on their tags")
    assert "3 of 4 source(s)" in line, line


def test_mixed_with_every_weight_zero_is_refused(tmp_path, model):
    images(tmp_path / "base")
    cfg = config(tmp_path, model, tables='[dataset.caption]\ncaption_mode = "mixed"\n'
                                         'mixed_weights = { tags = 0, nl = 0, tags_nl = 0, nl_tags = 0 }\n')
    out = anima_train_cli("train", cfg, cwd=tmp_path)
    refused(out, "train", 'caption_mode = "mixed"', "mixed_weights", "weight > 0")
    assert wrote_nothing(tmp_path)


def test_warmup_beyond_the_run_is_refused(tmp_path, model):
    images(tmp_path / "base")
    cfg = config(tmp_path, model, tables="[schedule]\nwarmup_steps = 100\n")
    out = anima_train_cli("train", cfg, cwd=tmp_path)
    refused(out, "train", "[schedule] warmup_steps = 100", "3 step(s)", "max_steps = 3", "below 3")
    assert wrote_nothing(tmp_path)
    ok = anima_train_cli("config", config(tmp_path, model, tables="[schedule]\nwarmup_steps = 2\n", name="ok.toml"),
                         cwd=tmp_path)
    assert ok.returncode == 0 and "warmup_steps" not in ok.stdout + ok.stderr, ok.stdout + ok.stderr


# ------------------------------------------------------------------------------------------- inputs


def test_a_gif_is_said_and_a_dangling_image_link_is_refused(tmp_path, model):
    base = images(tmp_path / "base")
    pixels(base / "anim.png", seed=7)
    (base / "anim.png").rename(base / "anim.gif")
    (base / "anim.txt").write_text("anim", encoding="utf-8")
    cfg = config(tmp_path, model)
    line = said_once(anima_train_cli("config", cfg, cwd=tmp_path), "format the trainer does not read")
    assert ".gif" in line and "anim.gif" in line, line

    os.symlink(tmp_path / "gone.png", base / "img9.png")  # points at nothing
    before = user_files(tmp_path)
    out = anima_train_cli("train", cfg, cwd=tmp_path)
    refused(out, "train", "img9.png", "symbolic link that cannot be followed")
    assert user_files(tmp_path) == before


def test_a_caption_on_two_lines_is_two_tags(tmp_path, model):
    base = images(tmp_path / "base")
    (base / "img0.txt").write_text("big\nsquare, red", encoding="utf-8")
    cfg = config(tmp_path, model)
    out = anima_train_cli("train", cfg, cwd=tmp_path)
    line = said_once(out, "several lines")
    assert "img0.txt" in line, line
    final = sorted((tmp_path / "out").rglob("*.safetensors"))
    with safe_open(str([p for p in final if "-state" not in str(p)][-1]), "pt") as f:
        frequency = json.loads(f.metadata()["ss_tag_frequency"])
    tags = {t for per_folder in frequency.values() for t in per_folder}
    assert {"big", "square"} <= tags and not any("\n" in t for t in tags), tags


def test_a_folder_linked_into_itself_is_refused_not_counted_twice(tmp_path, model):
    base = images(tmp_path / "base")
    os.symlink(".", base / "3_again")  # 4 files would count as 4 + 4 x 3 sources
    cfg = config(tmp_path, model)
    before = user_files(tmp_path)
    for command in ("config", "train"):
        out = anima_train_cli(command, cfg, cwd=tmp_path)
        refused(out, command, "reached by two paths", "3_again", "remove the link")
    out = anima_train_cli("cache", "base", "--resolution", "64", "--model", model, cwd=tmp_path)
    refused(out, "cache", "reached by two paths")
    assert user_files(tmp_path) == before and not list((tmp_path / "base").glob("*_anima.safetensors"))


def test_cache_of_one_folder_given_twice_encodes_it_once(tmp_path, model):
    images(tmp_path / "base")
    out = anima_train_cli("cache", "base", "base", "--resolution", "64", "--model", model, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    said_once(out, "scanned once")
    assert "wrote    4 cache file(s)" in out.stdout, out.stdout


def test_cache_refuses_a_bucket_step_the_config_refuses(tmp_path, model):
    images(tmp_path / "base")
    before = folder_digests(tmp_path)
    out = anima_train_cli("cache", "base", "--resolution", "64", "--bucket-reso-steps", "7", "--model", model,
                          cwd=tmp_path)
    refused(out, "cache", "--bucket-reso-steps 7", "multiple of 16")
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert folder_digests(tmp_path) == before  # no 56x56 latents the model cannot use
    cfg = config(tmp_path, model, source="images").read_text(encoding="utf-8")
    (tmp_path / "steps.toml").write_text(cfg.replace("resolution = 64", "resolution = 64\nbucket_reso_steps = 7"),
                                         encoding="utf-8")
    refused(anima_train_cli("config", "steps.toml", cwd=tmp_path), "config", "bucket_reso_steps = 7",
            "multiple of 16")


def test_a_caption_the_text_encoder_cuts_is_said_with_its_file(tmp_path, model):
    base = images(tmp_path / "base")
    (base / "img3.txt").write_text(", ".join(f"tag number {i}" for i in range(400)), encoding="utf-8")
    line = said_once(anima_train_cli("config", config(tmp_path, model), cwd=tmp_path), "512 tokens")
    assert "1 caption(s)" in line and "img3.txt" in line, line
