"""Issue 42, class 6: the files we write are usable and shareable, through the real CLI (`python -m anima_train ...`).

* Every file and folder a command writes has the mode a plain open() / mkdir() gives under the user's umask (the
  umask here is 002, so 0600 and a hard-coded 0644 both fail): a ComfyUI running as another account must read the
  model a user converted or trained. safetensors' writer (also inside save_pretrained) makes 0600 files; the one
  atomic writer (anchor/atomic.py) gives them their normal mode, folders included.
* A file a user shares (the LoRA, the `_te` file, a full finetune, preview images, the loss chart, an anchor) carries
  nothing of the machine it was made on: not the folder it was trained in, not the home folder, not the user name.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import struct
from pathlib import Path

import pytest

from anchor.format import save as save_anchor
from anchor.modules import fresh_anchor
from anima_train.model.tiny import make_synthetic_dataset
from tests.fixtures_tiny import anima_train_cli

pytestmark = pytest.mark.slow

UMASK = 0o002
FILE_MODE, DIR_MODE = 0o666 & ~UMASK, 0o777 & ~UMASK


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def cli(*args, cwd):
    with umask(UMASK):  # the child inherits it, as from the user's shell
        out = anima_train_cli(*args, cwd=cwd)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    return out


def wrong_modes(folder: Path) -> list[str]:
    """Every file and folder under `folder` (itself included) whose permission bits are not the umask's."""
    bad = []
    for p in [folder, *sorted(folder.rglob("*"))]:
        if p.is_symlink():
            continue
        want = DIR_MODE if p.is_dir() else FILE_MODE
        mode = p.stat().st_mode & 0o777
        if mode != want:
            bad.append(f"{p.relative_to(folder.parent)}: {mode:o}, not {want:o}")
    return bad


def text_parts(path: Path) -> bytes:
    """What of a file is text a reader shows: a safetensors header, a PNG's chunks other than pixels, or all of it."""
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        return data[8:8 + struct.unpack("<Q", data[:8])[0]]
    if data.startswith(b"\x89PNG"):
        parts, pos = [], 8
        while pos < len(data):
            length, kind = struct.unpack(">I4s", data[pos:pos + 8])
            if kind != b"IDAT":
                parts.append(data[pos + 8:pos + 8 + length])
            pos += 12 + length
        return b"".join(parts)
    return data


def machine_traces(path: Path, places: list[Path]) -> list[str]:
    """The local folders (each as written and resolved, either slash) and the user name found in `path`."""
    data, text = path.read_bytes(), text_parts(path)
    found = []
    for place in places:
        for spelling in {str(place), str(place.resolve()), place.as_posix(), str(place).replace("/", "\\")}:
            if spelling.encode() in data or json.dumps(spelling)[1:-1].encode() in data:
                found.append(f"{path.name} holds {spelling!r}")
    user = getpass.getuser()
    if re.search(rb"\b" + re.escape(user.encode()) + rb"\b", text):
        found.append(f"{path.name} holds the user name {user!r}")
    return sorted(set(found))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One of everything, written as a user writes it under umask 002: a tiny model, its native files converted
    back, a LoRA run with previews, a periodic checkpoint and its resume state, a full finetune saved as diffusers
    folders, a latent cache, an anchor converted to safetensors. The paths in the configs are absolute."""
    root = tmp_path_factory.mktemp("sharing")
    cli("tiny-model", root / "tm", cwd=root)
    cli("convert", "--anima", root / "tm/native/anima.safetensors", "--qwen", root / "tm/native/qwen3.safetensors",
        "--vae", root / "tm/native/vae.safetensors", "--tokenizers", root / "tm/diffusers", "--out", root / "conv",
        cwd=root)
    make_synthetic_dataset(root / "base", n=4, seed=1, sizes=[(96, 96)], jpeg_every=0)
    common = f"""[train]
model_path = "{(root / 'tm/diffusers').as_posix()}"
output_dir = "{(root / 'out').as_posix()}"
dtype = "float32"
num_workers = 0
gradient_checkpointing = false
progress = "off"
max_steps = 3
{{train}}
[dataset]
path = "{(root / 'base').as_posix()}"
resolution = 64
source = "encode"
[optimizer]
lr = 5e-3
"""
    lora = root / "lora.toml"
    lora.write_text(common.format(train='run_name = "shared"\nsave_every_steps = 2\nsave_optimizer_state = true')
                    + '[adapter]\nrank = 4\n[sample]\nprompts = ["red circle"]\nwidth = 64\nheight = 64\nsteps = 2\n')
    cli("train", lora, "--events", root / "events.jsonl", cwd=root)
    full = root / "full.toml"
    full.write_text(common.format(train='run_name = "whole"\nsave_native = false') + '[adapter]\nkind = "none"\n')
    cli("train", full, cwd=root)
    cli("cache", root / "base", "--model", root / "tm/diffusers", "--resolution", "64", cwd=root)
    src = fresh_anchor("relay", [16, 24], family="cosmos_dit", objective="flow", n_slots=2, K=8, hidden=6)
    (root / "anchors").mkdir()
    with umask(0o077):  # the source's own mode must not decide the output's
        save_anchor(src, root / "anchors/relay.pt")
    cli("anchor-convert", root / "anchors/relay.pt", root / "anchors/relay.safetensors", cwd=root)
    return root


def test_every_file_a_command_writes_takes_the_umask(made):
    """tiny-model and convert wrote their weights 0600 (ComfyUI as another user: "Permission denied"), and so did
    the resume state's files; every writer goes through one atomic writer that gives the umask's modes."""
    written = [made / "tm", made / "conv", made / "out" / "shared", made / "out" / "whole",
               made / "anchors" / "relay.safetensors", made / "events.jsonl"]
    bad = [line for folder in written if folder.is_dir() for line in wrong_modes(folder)]
    bad += [f"{p.name}: {p.stat().st_mode & 0o777:o}" for p in written
            if p.is_file() and p.stat().st_mode & 0o777 != FILE_MODE]
    caches = sorted((made / "base").glob("*.safetensors"))
    assert caches, "the cache command wrote no latent cache"
    bad += [f"{p.name}: {p.stat().st_mode & 0o777:o}" for p in caches if p.stat().st_mode & 0o777 != FILE_MODE]
    assert not bad, "\n".join(bad)
    run = made / "out" / "shared"
    assert (run / "shared-step000002-state").is_dir() and list((run / "samples").glob("*.png"))
    assert (made / "out" / "whole" / "whole" / "transformer").is_dir()  # the full finetune's diffusers folders


def test_a_shared_file_carries_nothing_of_the_machine(made):
    """The LoRA's ss_training_config held the config's absolute paths (model, dataset, output folder): a LoRA posted
    online told the trainer's user name and folders. Path keys keep their last part."""
    run, whole = made / "out" / "shared", made / "out" / "whole"
    shared = [*run.glob("*.safetensors"), *(run / "samples").glob("*.png"), run / "loss.png",
              *whole.glob("*.safetensors"), *(whole / "whole").rglob("*.safetensors"), whole / "loss.png",
              made / "anchors" / "relay.safetensors"]
    assert len(shared) >= 7, shared
    places = [made, Path.home()]
    traces = [t for p in shared for t in machine_traces(p, places)]
    assert not traces, "\n".join(traces)
    header = json.loads(text_parts(run / "shared.safetensors"))
    config = json.loads(header["__metadata__"]["ss_training_config"])
    assert (config["train"]["model_path"], config["dataset"]["path"], config["train"]["output_dir"]) == \
        ("diffusers", "base", "out")  # what the user can still read from it: the folders' names
