"""Issue 42, class 1: an output path never writes into a file or folder the user owns, through the real CLI
(`python -m anima_train train ...`, from the folder a user works in, with the issue's relative paths). Each case
asserts the one-line message a user reads, the exit status, and the bytes of every file in the folder before and
after.

The mechanisms: outputs/guard.py (an output is none of the files the run reads and lands in none of its folders,
symlinks resolved; an events file is appended to only when it holds our events) and outputs/manifest.py (a run's
files are what the run recorded, never what their names look like)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from anima_train import errors
from anima_train.model.tiny import make_synthetic_dataset
from tests.fixtures_tiny import anima_train_cli, folder_digests

pytestmark = pytest.mark.slow

CONFIG = """[train]
model_path = "tm/diffusers"
output_dir = "{output_dir}"
dtype = "float32"
num_workers = 0
gradient_checkpointing = false
progress = "off"
max_steps = 3
[dataset]
path = "base"
resolution = 64
source = "encode"
[adapter]
rank = 4
[optimizer]
lr = 5e-3
"""


@pytest.fixture(scope="module")
def model(tiny_anima, tmp_path_factory):
    """A copy of the tiny model per module: a guard that fails must not write into the session's shared one."""
    folder = tmp_path_factory.mktemp("model") / "tm"
    shutil.copytree(tiny_anima.diffusers_dir, folder / "diffusers")
    return folder


@pytest.fixture
def work(tmp_path, model):
    """The issue's setup: tm/ (the tiny model), base/ (4 captioned 96x96 PNGs), run.toml; the user works here."""
    shutil.copytree(model, tmp_path / "tm")
    make_synthetic_dataset(tmp_path / "base", n=4, seed=2, sizes=[(96, 96)], jpeg_every=0)
    (tmp_path / "run.toml").write_text(CONFIG.format(output_dir="out"))
    return tmp_path


def train(work: Path, *args: str, config: str = "run.toml"):
    return anima_train_cli("train", config, "--cpu", *args, cwd=work)


def refused(out, *parts: str, absent: tuple[str, ...] = ()) -> str:
    """Exit 2 with one line `anima-train train: error: ...` naming every part (and none of `absent`)."""
    err = out.stderr
    assert out.returncode == errors.USER_ERROR_EXIT, f"exit {out.returncode}\n{err[-3000:]}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("anima-train train: error: "), err[-3000:]
    for part in parts:
        assert part in err, f"{part!r} not in:\n{err}"
    for part in absent:
        assert part not in err, f"{part!r} in:\n{err}"
    return err


def test_events_never_append_to_the_config_or_any_file_not_ours(work):
    """`--events run.toml` appended 22 JSON lines to the config ("not valid TOML" afterwards); any existing file
    was appended to the same way."""
    (work / "notes.txt").write_text("my notes\n")
    before = folder_digests(work)
    refused(train(work, "--events", "run.toml"), "--events run.toml", "config", "e.g. events.jsonl")
    refused(train(work, "--events", "notes.txt"), "--events notes.txt", "does not hold anima-train's events")
    refused(train(work, "--events", "base/img_0000.txt"), "--events base/img_0000.txt", "[dataset] path")
    assert folder_digests(work) == before


def test_the_stop_file_is_never_the_config_and_the_config_is_never_to_be_deleted(work):
    before = folder_digests(work)
    refused(train(work, "--stop-file", "run.toml"), "--stop-file run.toml", "the config", "e.g. run.stop",
            absent=("delete",))
    assert folder_digests(work) == before


@pytest.mark.parametrize("output_dir,where", [
    ("base", "inside [dataset] path"),  # previews among the training images
    ("tm/diffusers", "inside [train] model_path"),
    ("linked", "inside [dataset] path"),  # a symlink to the dataset: the same folder, whatever its name
    ("tm/../base/..", "is [dataset] path"),  # `..` after a folder, and a run named like the dataset
])
def test_a_run_folder_never_lands_among_what_the_run_reads(work, output_dir, where):
    (work / "linked").symlink_to(work / "base", target_is_directory=True)
    if output_dir == "tm/../base/..":  # the run is named after the dataset: its folder is the dataset folder
        text = CONFIG.format(output_dir=output_dir).replace("max_steps = 3\n", 'max_steps = 3\nrun_name = "base"\n')
    else:
        text = CONFIG.format(output_dir=output_dir)
    (work / "run.toml").write_text(text)
    before = folder_digests(work)
    refused(train(work), "[train] output_dir", where, "outside the model, dataset and validation folders")
    assert folder_digests(work) == before
    assert not (work / "out").exists()


def test_overwrite_never_deletes_a_users_own_folders_in_the_run_folder(work):
    """--overwrite deleted a user's own logs/ and samples/ in the run folder (run_files() went by name); without
    --overwrite the refusal suggested the flag that deletes them."""
    first = train(work)
    assert first.returncode == 0, first.stderr[-3000:]
    run = work / "out" / "anima"
    (run / "logs").mkdir()
    (run / "logs" / "my-notes.txt").write_text("mine")
    (run / "samples").mkdir()
    (run / "samples" / "reference.png").write_bytes(b"my reference image")
    before = folder_digests(work)
    for args in (("--overwrite",), ()):  # the flag that deleted them first
        refused(train(work, *args), str(Path("out/anima")), "logs/", "samples/", "no run recorded them",
                'run_name = "anima-2"', absent=("pass --overwrite", "loading model"))
        assert folder_digests(work) == before


def test_a_users_loss_png_in_a_fresh_run_folder_is_never_replaced(work):
    run = work / "out" / "anima"
    run.mkdir(parents=True)
    (run / "loss.png").write_bytes(b"my own chart")
    before = folder_digests(work)
    for args in (("--overwrite",), ()):  # the flag that deleted them first
        refused(train(work, *args), "loss.png", "no run recorded them", absent=("pass --overwrite",))
        assert folder_digests(work) == before


def test_a_run_folder_without_a_manifest_is_never_deleted(work):
    """A folder of files under a run's names that no run recorded (a run of before manifests, or a user's copies):
    --overwrite cannot prove them ours, so it deletes nothing and says what the user can do."""
    run = work / "out" / "anima"
    (run / "anima-state").mkdir(parents=True)
    (run / "anima-state" / "state.json").write_text('{"global_step": 3}')
    (run / "anima.safetensors").write_bytes(b"a checkpoint of an older anima-train")
    (run / "anima.toml").write_text("# its config\n")
    before = folder_digests(work)
    for args in (("--overwrite",), ()):  # the flag that deleted them first
        refused(train(work, *args), "anima-state/", "anima.safetensors", "anima.toml", "Move them out of",
                'run_name = "anima-2"', f'resume_from = "{Path("out/anima/anima-state").as_posix()}"',
                absent=("pass --overwrite",))
        assert folder_digests(work) == before


def test_what_a_run_recorded_is_what_overwrite_replaces(work):
    """The manifest lists what the run wrote, and a second run with --overwrite replaces exactly that."""
    first = train(work)
    assert first.returncode == 0, first.stderr[-3000:]
    run = work / "out" / "anima"
    recorded = json.loads((run / ".anima-train-run.json").read_text())
    assert recorded["run"] == "anima" and {"anima.safetensors", "anima.toml", "loss.png"} <= set(recorded["entries"])
    (run / "notes.txt").write_text("mine")
    again = train(work, "--overwrite")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "deleting the earlier run's 3 file(s)" in again.stdout
    assert (run / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("flags", [(), ("--overwrite",)])
def test_cache_never_writes_over_a_file_it_did_not_write(work, flags):
    """A file of the user's under a cache's name (`<stem>_WWWWxHHHH_anima.safetensors`) was taken for a damaged
    cache and re-encoded over; `--overwrite` wrote over it too. What `cache` wrote is told by the file's own header
    (its format record), not by its name."""
    args = ("cache", "base", "--resolution", "64", "--model", "tm/diffusers", "--device", "cpu")
    first = anima_train_cli(*args, cwd=work)
    assert first.returncode == 0, first.stderr[-3000:]
    caches = sorted((work / "base").glob("*_anima.safetensors"))
    assert caches, first.stdout
    caches[0].write_bytes(b"my own file, named like a cache\n")
    before = folder_digests(work / "base")
    out = anima_train_cli(*args, *flags, cwd=work)
    err = out.stderr
    assert out.returncode == errors.USER_ERROR_EXIT, f"exit {out.returncode}\n{err[-3000:]}"
    lines = [line for line in err.splitlines() if line.strip()]
    # the verdict and its fix on one line (a node's popup shows it alone), the file on the next: nothing else
    assert len(lines) == 2 and lines[0].startswith("anima-train cache: error: "), err[-3000:]
    assert "move or rename them" in lines[0] and str(caches[0].relative_to(work)) in lines[1], err
    assert str(caches[0].relative_to(work)) in err and "move or rename" in err and "delete" not in err, err
    assert folder_digests(work / "base") == before
