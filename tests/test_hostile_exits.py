"""Issue 42, class 4: exit status 1 is for our bugs only. Every case goes through the real CLI (`python -m
anima_train ...`) and asserts what the user reads (one `error:` line naming the file/key/flag and the fix, never
"internal error"), the exit status of the README's table, and the bytes of every user file before and after.

The two mechanisms under test: one config gate for every command that reads a config, with the bounds of the types
the values reach (config/keys.py: 64-bit integers, float32 numbers; a learning rate at most 1000), and one policy for
the machine's errors met while writing (anchor/atomic.py names the file and leaves no temp file or folder;
errors.py says it with the fix). A full disk is simulated portably by a file-size limit on the child
(RLIMIT_FSIZE: every write past it fails with EFBIG, as a full disk fails with ENOSPC), and by a real full tmpfs
where this machine lets the test mount one."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from anima_train import errors
from anima_train.model.tiny import make_synthetic_dataset
from tests.fixtures_tiny import folder_digests

ROOT = Path(__file__).resolve().parents[1]
posix_only = pytest.mark.skipif(os.name != "posix", reason="resource limits and tmpfs are POSIX")


def cli(*args, cwd, limit_bytes: int | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m anima_train ARGS` as a user runs it; `limit_bytes`: no file it writes may grow past that size."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop(errors.DEBUG_ENV, None)
    preexec = None
    if limit_bytes is not None:
        import resource  # noqa: PLC0415 (POSIX only: the tests that pass a limit are)

        def preexec():
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return subprocess.run([sys.executable, "-m", "anima_train", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout, preexec_fn=preexec)


def refused(out: subprocess.CompletedProcess, command: str, *parts: str, code: int = errors.USER_ERROR_EXIT) -> str:
    """Exit `code`, and the last stderr line is the one `anima-train COMMAND: error:` line naming every part."""
    err = out.stderr
    assert out.returncode == code, f"exit {out.returncode}\n{err}"
    assert "Traceback" not in err and "internal error" not in err and "This is a bug" not in err, err
    errors_said = [line for line in err.splitlines() if line.startswith(f"anima-train {command}: error: ")]
    assert len(errors_said) == 1 and err.count("error:") == 1, err
    assert err.rstrip("\n").endswith(errors_said[0]), err  # the last thing said
    for part in parts:
        assert part in errors_said[0], f"{part!r} not in:\n{err}"
    return errors_said[0]


@pytest.fixture(scope="module")
def setup(tiny_anima, tmp_path_factory):
    """The issue's common setup: the tiny model, 4 captioned 96x96 PNGs in base/, the small config."""
    root = tmp_path_factory.mktemp("hostile_exits")
    make_synthetic_dataset(root / "base", n=4, seed=3, sizes=[(96, 96)], jpeg_every=0)
    return root, tiny_anima.diffusers_dir


def write_config(folder: Path, model, *, optimizer: str = "lr = 5e-3", train: str = "") -> Path:
    path = folder / "run.toml"
    path.write_text(f"""[train]
model_path = "{Path(model).as_posix()}"
output_dir = "out"
dtype = "float32"
num_workers = 0
gradient_checkpointing = false
max_steps = 3
{train}
[dataset]
path = "{(folder / 'base').as_posix()}"
resolution = 64
source = "encode"
[adapter]
rank = 4
[optimizer]
{optimizer}
""")
    return path


# ------------------------------------------------------------------------ one gate: every command, the same bounds

GATED_COMMANDS = {"config": [], "train": [], "plan": ["--vram", "12"], "evaluate": [], "cache": None}
BAD_VALUES = [  # (where it goes in the config, the key the refusal names, what the refusal says)
    ({"optimizer": "lr = 1e300"}, "[optimizer] lr = 1e+300", "must be <= 1000000.0"),
    ({"optimizer": "lr = 1e38"}, "[optimizer] lr = 1e+38", "must be <= 1000000.0"),
    ({"train": "seed = 99999999999999999999"}, "[train] seed = 99999999999999999999", "64-bit integer"),
    ({"train": "seed = 9223372036854775808"}, "[train] seed = 9223372036854775808", "64-bit integer"),
]


@pytest.mark.parametrize("command", list(GATED_COMMANDS))
@pytest.mark.parametrize("bad", BAD_VALUES, ids=["lr1e300", "lr1e38", "seed1e20", "seed2pow63"])
def test_every_command_that_reads_a_config_refuses_a_value_beyond_its_type(setup, tmp_path, command, bad):
    """`config` said OK and `train` then died with an internal error (float overflow in the optimizer, an int64
    overflow in torch.manual_seed): now each command refuses the value alike, before it loads anything."""
    root, model = setup
    (tmp_path / "base").symlink_to(root / "base", target_is_directory=True)
    toml_parts, key, why = bad
    path = write_config(tmp_path, model, **toml_parts)
    before = folder_digests(root / "base"), path.read_bytes()
    extra = GATED_COMMANDS[command]
    args = [command, path, *extra] if extra is not None else [command, "--config", path]
    out = cli(*args, cwd=tmp_path)
    line = refused(out, command, key, why, path.name)
    assert line.count("\n") == 0
    assert (folder_digests(root / "base"), path.read_bytes()) == before
    assert not (tmp_path / "out").exists()  # nothing written: refused before anything ran


def test_a_flag_that_stands_for_a_key_passes_the_keys_check(tmp_path):
    """`tiny-model --seed 10**20` crashed in torch.manual_seed; the flag now passes [train] seed's own check."""
    out = cli("tiny-model", tmp_path / "tm", "--seed", "99999999999999999999", cwd=tmp_path)
    assert out.returncode == errors.USER_ERROR_EXIT, out.stderr
    assert "argument --seed: too large" in out.stderr and "internal error" not in out.stderr, out.stderr
    assert not (tmp_path / "tm").exists()


@pytest.mark.parametrize("vram", ["nan", "inf", "-inf", "1e309", "0", "-3"])
def test_plan_refuses_a_vram_that_is_not_a_card_size(setup, tmp_path, vram):
    root, model = setup
    (tmp_path / "base").symlink_to(root / "base", target_is_directory=True)
    path = write_config(tmp_path, model)
    out = cli("plan", path, f"--vram={vram}", cwd=tmp_path)
    refused(out, "plan", "--vram", "GiB", "e.g. --vram 12")


# ------------------------------------------------------------------------ writing: a file in the way, a full disk

def test_anchor_convert_onto_an_existing_file_is_bad_input_and_keeps_it(tmp_path):
    from anchor.format import save
    from anchor.modules import fresh_anchor

    src, dest = tmp_path / "relay.pt", tmp_path / "mine.safetensors"
    save(fresh_anchor("relay", [16, 24], family="cosmos_dit", objective="flow", rank=2), src)
    dest.write_bytes(b"the user's own file")
    out = cli("anchor-convert", src, dest, cwd=tmp_path)
    assert out.returncode == errors.USER_ERROR_EXIT, out.stderr
    assert out.stderr.count("\n") == 1 and "already exists" in out.stderr and str(dest) in out.stderr, out.stderr
    assert "give a new output name" in out.stderr
    assert dest.read_bytes() == b"the user's own file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.safetensors", "relay.pt"]


@pytest.mark.parametrize("command", ["demo", "tiny-model"])
def test_an_output_folder_that_is_a_file_is_named_and_kept(tmp_path, command):
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    args = ["demo", "--out", mine] if command == "demo" else ["tiny-model", mine]
    out = cli(*args, cwd=tmp_path)
    refused(out, command, "notes.txt")
    assert mine.read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["notes.txt"]


@pytest.fixture(params=["file-size-limit", "full-tmpfs"])
def small_disk(request, tmp_path):
    """(folder to write into, the limit to give the child, the fix the message must carry): a folder where writing
    more than a few hundred KiB fails as a full disk does."""
    if request.param == "file-size-limit":
        yield tmp_path / "disk", 150_000, "give a path on another disk"
        return
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root on Linux); the file-size limit covers the same path")
    try:
        yield disk, None, "free some space"
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@posix_only
def test_a_full_disk_during_tiny_model_is_said_and_leaves_nothing_behind(tmp_path, small_disk):
    """It was "internal error: SafetensorError ... This is a bug", left `.diffusers.tmp-PID/` behind, and the re-run
    called the empty-looking folder "not empty"."""
    disk, limit, fix = small_disk
    disk.mkdir(exist_ok=True)
    out = cli("tiny-model", disk / "tm", cwd=tmp_path, limit_bytes=limit)
    refused(out, "tiny-model", str(disk / "tm"), fix)
    assert os.listdir(disk / "tm") == []  # no temp folder, no half model
    if limit is not None:  # the same folder, with room now: the re-run works
        again = cli("tiny-model", disk / "tm", cwd=tmp_path)
        assert again.returncode == 0, again.stderr
        assert sorted(os.listdir(disk / "tm")) == ["diffusers", "native"]


@posix_only
def test_a_full_disk_during_cache_is_said_and_keeps_the_dataset(setup, tmp_path, small_disk):
    root, model = setup
    disk, limit, fix = small_disk
    disk.mkdir(exist_ok=True)
    data = disk / "base"
    make_synthetic_dataset(data, n=4, seed=3, sizes=[(96, 96)], jpeg_every=0)
    if limit is None:  # the tmpfs: fill it up, so no latent fits
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
    else:
        limit = 3000  # a latent file of 64x64 is 4.6 KB: the first one does not fit
    before = folder_digests(data)
    out = cli("cache", data, "--model", model, "--resolution", "64", cwd=tmp_path, limit_bytes=limit)
    refused(out, "cache", str(data), "_anima.safetensors", fix)
    after = folder_digests(data)
    assert {k: v for k, v in after.items() if k in before} == before
    assert not [name for name in after if ".tmp-" in name], after  # no temp file left


@posix_only
def test_two_tiny_models_into_one_folder_never_end_in_an_internal_error(tmp_path):
    """Both start on an empty folder; whichever publishes first wins, the other is refused in one line (or also
    finds it free). Either way: no internal error, no temp folder, one complete model."""
    target = tmp_path / "tm"
    results = [None, None]

    def one(i):
        results[i] = cli("tiny-model", target, cwd=tmp_path)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for out in results:
        assert out.returncode in (0, errors.USER_ERROR_EXIT), out.stderr
        if out.returncode:
            refused(out, "tiny-model", str(target))
    assert any(out.returncode == 0 for out in results)
    assert sorted(os.listdir(target)) == ["diffusers", "native"]
    assert sorted(os.listdir(target / "native")) == ["anima.safetensors", "qwen3.safetensors", "vae.safetensors"]
