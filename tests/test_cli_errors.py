"""What a user sees when `anima-train` is given bad input: one message naming the file/key and the fix, exit 2, no
traceback, before any model loads (issue 11, items 4, 5 and 9). Every test runs the real CLI in a subprocess."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from anima_train.data.synthetic import make_synthetic_latents
from anima_train.model.tiny import make_synthetic_dataset
from tests.fixtures_tiny import anima_train_cli, small_run_toml, stand_in_command, torchrun

ROOT = Path(__file__).resolve().parents[1]




def assert_user_error(out: subprocess.CompletedProcess, command: str, *parts: str) -> str:
    """Exit 2, nothing but `anima-train COMMAND: error: ...` on stderr (no traceback), naming every part."""
    err = out.stderr
    assert out.returncode == 2, f"exit {out.returncode}\n{err}"
    assert "Traceback" not in err, err
    assert err.startswith(f"anima-train {command}: error: "), err
    assert err.count("error:") == 1, err
    for part in parts:
        assert part in err, f"{part!r} not in:\n{err}"
    return err


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_config(path: Path, model, data, out, extra: str = "", train_extra: str = "") -> Path:
    path.write_text(small_run_toml(model, data, out, train=train_extra, tables=extra))
    return path


@pytest.fixture(scope="module")
def latents(tmp_path_factory):
    out = tmp_path_factory.mktemp("latents")
    make_synthetic_latents(out, n=4, seed=0)
    return out


# ------------------------------------------------------------------------------------------ config errors


@pytest.mark.parametrize("text, parts", [
    ("[train\nepochs = 2\n", ["not valid TOML"]),
    ('[train]\nlearning_rate = 1e-4\n[dataset]\npath = "/d"\n',
     ["[train] unknown key 'learning_rate' (did you mean [optimizer] lr?)"]),
    ('[train]\nepochs = "3"\n[dataset]\npath = "/d"\n', ['[train] epochs = "3": expected an integer']),
    ('[dataset]\npath = "/d"\n[[curriculum]]\nat = 0.0\nmode = "texture"\n',
     ['[[curriculum]] #1 mode = "texture" needs [dataset] source = "encode"']),
], ids=["bad-toml", "unknown-key", "wrong-type", "texture"])
def test_config_errors_are_one_message_naming_the_file(tmp_path, text, parts):
    cfg = tmp_path / "my run.toml"
    cfg.write_text(text)
    assert_user_error(anima_train_cli("train", cfg.name, cwd=tmp_path), "train", "my run.toml", *parts)


def test_missing_config_file_and_bad_flag_value(tmp_path):
    assert_user_error(anima_train_cli("train", "nope.toml", cwd=tmp_path), "train", "config file not found",
                      "nope.toml")
    cfg = tmp_path / "c.toml"
    cfg.write_text('[dataset]\npath = "/d"\n')
    assert_user_error(anima_train_cli("train", cfg, "--max-steps", "0", cwd=tmp_path), "train", "--max-steps 0")


# ------------------------------------------------------------------------------------------ fail fast


def test_every_unusable_path_is_named_before_any_model_loads(tmp_path):
    (tmp_path / "out-file").write_text("not a folder")
    cfg = write_config(tmp_path / "c.toml", tmp_path / "no-model", tmp_path / "no-data", tmp_path / "out-file",
                       train_extra=f'resume_from = "{tmp_path / "gone-state"}"')
    ev = tmp_path / "events.jsonl"
    err = assert_user_error(anima_train_cli("train", cfg, "--events", ev, cwd=tmp_path), "train",
                            "c.toml: 4 paths cannot be used",
                            "model_path", "no-model", "anima-train convert",
                            "[dataset] path", "no-data", "dataset folder not found",
                            "output_dir", "out-file", "is a file",
                            "resume_from", "gone-state")
    assert not any(e.get("message") == "loading model" for e in events(ev)), err


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="needs a non-root POSIX user for permissions")
def test_an_unwritable_output_dir_is_refused_before_loading(tiny_anima, latents, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        cfg = write_config(tmp_path / "c.toml", tiny_anima.diffusers_dir, latents, locked / "runs")
        assert_user_error(anima_train_cli("train", cfg, cwd=tmp_path), "train", "output_dir", str(locked),
                          "not writable")
    finally:
        locked.chmod(0o755)


def test_an_output_dir_that_cannot_be_created_or_written_is_named(tmp_path, monkeypatch):
    # (in-process: as root every folder is writable, so the permission branch is reached through os.access)
    from anima_train.training import preflight
    from anima_train.config import parse_config

    (tmp_path / "a-file").write_text("x")
    cfg = parse_config(f'[train]\noutput_dir = "{tmp_path / "a-file" / "runs"}"\n[dataset]\npath = "{tmp_path}"\n')
    assert any("a-file is a file, so the folder cannot be created" in p for p in preflight.path_problems(cfg))
    cfg.train.output_dir = str(tmp_path / "new" / "runs")
    assert not any("output_dir" in p for p in preflight.path_problems(cfg))
    monkeypatch.setattr(preflight.os, "access", lambda path, mode: False)
    assert any(f"{tmp_path} is not writable" in p for p in preflight.path_problems(cfg))
    assert not any("output_dir" in p for p in preflight.path_problems(cfg, saving=False))


def test_missing_captions_fail_fast_and_name_the_escape_flag(tiny_anima, latents, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for p in latents.iterdir():
        (data / p.name).write_bytes(p.read_bytes())
    uncaptioned = sorted(data.glob("*.txt"))[0]
    uncaptioned.unlink()
    cfg = write_config(tmp_path / "c.toml", tiny_anima.diffusers_dir, data, tmp_path / "out")
    ev = tmp_path / "events.jsonl"
    err = assert_user_error(anima_train_cli("train", cfg, "--events", ev, cwd=tmp_path), "train", "no caption file",
                            str(uncaptioned), "--allow-missing-captions")
    assert not any(e.get("message") == "loading model" for e in events(ev)), err

    ok = anima_train_cli("train", cfg, "--dry-run", "--cpu", "--allow-missing-captions", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "1 source(s) have no caption file and train on an empty caption" in ok.stdout


def test_config_check_passes_a_good_config_and_prints_its_warnings_plainly(tiny_anima, latents, tmp_path):
    cfg = write_config(tmp_path / "c.toml", tiny_anima.diffusers_dir, latents, tmp_path / "out",
                       extra="train_text_encoder = true\n")
    out = anima_train_cli("config", cfg, cwd=tmp_path)
    assert out.returncode == 0 and "c.toml: OK" in out.stdout, out.stderr
    assert out.stderr.startswith("anima-train config: warning: ") and "train_text_encoder" in out.stderr
    assert "warnings.warn" not in out.stderr and out.stderr.count("\n") == 1  # one line, no source echo


# ------------------------------------------------------------------------------------------ stale caches


def test_the_stale_cache_fix_command_works_as_printed(tiny_anima, tmp_path):
    data = tmp_path / "images"
    make_synthetic_dataset(data, n=4, seed=1, sizes=[(128, 128), (160, 96)])
    cfg = write_config(tmp_path / "c.toml", tiny_anima.diffusers_dir, data, tmp_path / "out")
    # the caches are required (source = "auto" would encode the images in the loop instead)
    cfg.write_text(cfg.read_text().replace("resolution = 128", 'resolution = 128\nsource = "images"'))
    cached = anima_train_cli("cache", "--config", cfg, "--device", "cpu", cwd=tmp_path)
    assert cached.returncode == 0, cached.stderr[-3000:]
    # the user changes a bucket setting: every cache is stale
    text = cfg.read_text().replace("resolution = 128", "resolution = 128\nbucket_reso_steps = 32")
    cfg.write_text(text)
    err = assert_user_error(anima_train_cli("train", cfg, "--dry-run", "--cpu", cwd=tmp_path), "train",
                            "bucket_reso_steps=64, the config says 32")
    fix = re.search(r"fix: re-run `([^`]+)`", err).group(1)
    redo = subprocess.run(shlex.split(fix), capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert redo.returncode == 0, f"{fix}\n{redo.stderr[-3000:]}"
    again = anima_train_cli("train", cfg, "--dry-run", "--cpu", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]


# ------------------------------------------------------------------------------------------ internal errors


BOOM = "def add_arguments(parser):\n    pass\n\ndef run(args):\n    raise RuntimeError('kaboom')\n"


def test_an_internal_error_is_one_line_exit_1_with_the_debug_hint(tmp_path):
    out = stand_in_command("boom", BOOM, "boom", cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "anima-train boom: internal error: RuntimeError: kaboom" in out.stderr
    assert "--debug" in out.stderr and "ANIMA_TRAIN_DEBUG=1" in out.stderr
    for shown in (stand_in_command("boom", BOOM, "boom", "--debug", cwd=tmp_path),
                  stand_in_command("boom", BOOM, "--debug", "boom", cwd=tmp_path),
                  stand_in_command("boom", BOOM, "boom", cwd=tmp_path, env={"ANIMA_TRAIN_DEBUG": "1"})):
        assert "Traceback" in shown.stderr and "RuntimeError: kaboom" in shown.stderr


# what torch 2.11 said when a full finetune's first step did not fit a 24 GiB cap (bench/results/fullft24_2026-12-03)
TORCH_OOM = ("CUDA out of memory. Tried to allocate 16.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
             "115.05 GiB is free. Including non-PyTorch memory, this process has 24.74 GiB memory in use. 24.00 GiB "
             "allowed; Of the allocated memory 23.82 GiB is allocated by PyTorch, and 180.14 MiB is reserved by "
             "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
             "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


def test_a_step_that_does_not_fit_the_gpu_is_a_user_error_with_what_to_change(tmp_path):
    # a config that asks more than the card has is not a bug in anima-train: before, this printed "internal error:
    # OutOfMemoryError ... This is a bug in anima-train, not in your input" and exited 1
    out = stand_in_command("oom", "import torch\n\ndef add_arguments(parser):\n    pass\n\n"
                           f"def run(args):\n    raise torch.OutOfMemoryError({TORCH_OOM!r})\n", "oom", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    (line,) = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert line.startswith("anima-train oom: error: the GPU ran out of memory (Tried to allocate 16.00 MiB; "
                           "this process has 24.74 GiB memory in use; 24.00 GiB allowed)"), line
    for fix in ("anima-train plan CONFIG --vram", "batch_size", "checkpoint_blocks = \"all\"", "use_kahan = true",
                "adamw8bit", "swap_blocks"):  # swap_blocks: the one way a LoRA trains on a 6 GiB card
        assert fix in line, (fix, line)
    assert "bug" not in line and "expandable_segments" not in line


@pytest.mark.slow
def test_only_the_main_process_reports_a_user_error(tmp_path):
    import time

    from anima_train.errors import QUIET_RANK_GRACE_S

    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nlearning_rate = 1\n")
    t0 = time.monotonic()
    other = anima_train_cli("train", cfg, cwd=tmp_path, env={"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"})
    # a non-main rank must not exit first: the launcher would end the main process before it printed the message
    # (seen under load: torchrun showed no message at all). Alone, after the grace period, it says it itself.
    assert other.returncode == 2 and time.monotonic() - t0 >= QUIET_RANK_GRACE_S
    assert other.stderr.startswith("[rank 1] anima-train train: error: ") and other.stderr.count("error:") == 1
    main = anima_train_cli("train", cfg, cwd=tmp_path, env={"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    assert_user_error(main, "train", "learning_rate")


@pytest.mark.slow
def test_torchrun_prints_a_user_error_once(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nlearning_rate = 1\n")
    out = torchrun(["-m", "anima_train", "train", cfg], cwd=tmp_path, timeout=300)
    assert out.returncode != 0
    assert out.stderr.count("anima-train train: error:") == 1, out.stderr
    assert "unknown key 'learning_rate' (did you mean [optimizer] lr?)" in out.stderr


# ------------------------------------------------------------------------------------------ the error type


def test_the_library_errors_are_user_errors():
    from anima_train.data.buckets import BucketError
    from anima_train.outputs.resume_state import ResumeError
    from anima_train.config import ConfigError
    from anima_train.model.convert import ConvertError
    from anima_train.data.errors import DatasetError
    from anima_train.errors import UserError
    from anima_train.model.components import ModelRepoError

    for kind in (ConfigError, DatasetError, BucketError, ResumeError, ModelRepoError, ConvertError):
        assert issubclass(kind, UserError), kind
    assert issubclass(ModelRepoError, FileNotFoundError) and issubclass(ConfigError, ValueError)  # callers' excepts


class _Unreadable:
    def __len__(self):
        return 1

    def __getitem__(self, i):
        from anima_train.data.errors import DatasetError

        raise DatasetError("latent cache /d/x_0128x0128_anima.safetensors cannot be read: delete it")


def test_a_user_error_from_a_data_loader_worker_keeps_only_its_message():
    from torch.utils.data import DataLoader

    from anima_train.data.errors import DatasetError
    from anima_train.errors import user_message

    with pytest.raises(DatasetError) as caught:
        next(iter(DataLoader(_Unreadable(), num_workers=1)))
    assert "Traceback" in str(caught.value)  # what torch re-raises
    assert user_message(caught.value) == "latent cache /d/x_0128x0128_anima.safetensors cannot be read: delete it"
