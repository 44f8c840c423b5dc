"""Checkpoint files: writing one in the layout ComfyUI loads, naming the epoch it belongs to, and pruning old ones.

One file per checkpoint (not a folder) so twenty LoRAs of one run can sit in ComfyUI's `loras` folder side by side;
a full finetune saved as diffusers directories uses `<stem>/` instead of `<stem>.safetensors`. The names are in
outputs/layout.py, the `-state` folder beside a checkpoint in outputs/resume_state.py.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from anima_train import adapters
from anima_train.adapters import export as ex
from anima_train.adapters import text_encoder_rank_alpha
from anima_train.config import Config
from anima_train.data.captions import read_caption_file, split_tags
from anima_train.errors import UserError
from anima_train.model.components import DTYPES
from anima_train.model.shape import base_model
from anima_train.outputs import manifest
from anima_train.outputs.layout import STATE_FILE, STATE_SUFFIX, checkpoint_step, latest_state


def epoch_of_step(step: int, steps_per_epoch: int) -> int:
    """The 1-based epoch that optimizer step `step` falls in (0 before the first step): the `epoch N/M` of the
    progress line, and what a file's ss_epoch / ss_num_epochs say (sd-scripts: the epoch the file belongs to, and
    the epochs the run really does, so a max_steps cap counts, not the configured epochs)."""
    return -(-step // steps_per_epoch) if steps_per_epoch > 0 else 0


# -- pruning -------------------------------------------------------------------------------------------------


@dataclass
class Periodic:
    stem: str
    tag: str  # "step" | "epoch"
    number: int
    paths: list[Path]  # the checkpoint file/dir, its _te sibling and its -state dir, whichever exist

    def recorded_step(self, steps_per_epoch: int) -> int:
        """The step this checkpoint was taken at: state.json, else file metadata, else the tag."""
        for p in self.paths:
            if p.name.endswith(STATE_SUFFIX) and (p / STATE_FILE).is_file():
                try:
                    return int(json.loads((p / STATE_FILE).read_text())["global_step"])
                except (ValueError, KeyError, OSError):
                    pass
        for p in self.paths:
            if p.suffix == ".safetensors" and p.is_file():
                step = checkpoint_step(p)
                if step is not None:
                    return step
        return self.number if self.tag == "step" else self.number * steps_per_epoch


def find_periodic(run_dir: Path, run_name: str) -> list[Periodic]:
    """Periodic checkpoints of this run in run_dir (files, legacy directories, `_te` and `-state` siblings).

    Only names of the form `<run_name>-step<N>` / `<run_name>-epoch<N>` (any digit count, so older unpadded
    names count too) are candidates; the final checkpoint, the TOML and anything else are never touched.
    """
    pattern = re.compile(rf"^{re.escape(run_name)}-(step|epoch)(\d+)(_te)?(\.safetensors|{STATE_SUFFIX})?$")
    groups: dict[str, Periodic] = {}
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    for p in sorted(run_dir.iterdir()):
        m = pattern.match(p.name)
        if not m:
            continue
        tag, number, te, ext = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        if ext is None and not p.is_dir():
            continue  # bare names are checkpoints only as diffusers directories
        if ext == STATE_SUFFIX and (te or not p.is_dir()):
            continue
        stem = f"{run_name}-{tag}{m.group(2)}"
        groups.setdefault(stem, Periodic(stem, tag, number, [])).paths.append(p)
    return list(groups.values())


def prune_checkpoints(run_dir: Path, run_name: str, keep_last_n: int | None, steps_per_epoch: int,
                      protect: str | os.PathLike | None = None) -> list[Path]:
    """Delete all but the newest `keep_last_n` periodic checkpoints (ordered by recorded step, not mtime).
    Everything belonging to one checkpoint goes together. Returns what was removed.

    `protect` (the run's `resume_from`: a checkpoint file or its `-state` folder, any spelling of the path) is
    never deleted, nor anything of its checkpoint: the user named it in the config, so re-running that config
    must find it. It does not count towards keep_last_n. Nor is a checkpoint the run manifest does not list."""
    if not keep_last_n:
        return []
    found = find_periodic(run_dir, run_name)
    if protect is not None:
        protected = Path(protect).resolve()
        found = [c for c in found if protected not in {p.resolve() for p in c.paths}]
    ours = manifest.entries(run_dir, run_name)  # only what the run recorded is deleted, whatever its name
    found = [c for c in found if all(p.name in ours for p in c.paths)]
    found.sort(key=lambda c: (c.recorded_step(steps_per_epoch), c.tag == "step", c.number))
    removed = []
    for ckpt in found[:-keep_last_n] if len(found) > keep_last_n else []:
        for p in ckpt.paths:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
    return removed


# -- writing ---------------------------------------------------------------------------------------------------


class SaveError(UserError, OSError):
    """A checkpoint or state file could not be written (disk full, permissions, ...); names the file."""


@contextlib.contextmanager
def writing(path: Path, run_dir: Path, lost: str = "") -> Iterator[None]:
    """Writing one output file of a run: any failure becomes a SaveError that names the file, says what was not
    saved and where to resume from. torch.save and safetensors report a full disk as RuntimeError ("file write
    failed") / SafetensorError ("... (os error 28)"), not as OSError, so every exception is caught."""
    try:
        yield
    except SaveError:
        raise
    except Exception as e:
        path = Path(path)
        code = getattr(e, "errno", None)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {e}"
        message = f"could not write {path}: {reason}."
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(run_dir if Path(run_dir).is_dir() else Path(run_dir).parent).free
            text = str(e)
            if (code == errno.ENOSPC or f"os error {errno.ENOSPC})" in text or os.strerror(errno.ENOSPC) in text
                    or (not isinstance(e, OSError) and free < 64 * 2**20)):
                message += f" The disk holding {run_dir} is full ({free / 2**20:.0f} MiB free): free space first."
        if lost:
            message += f" {lost} was not saved."
        newest = latest_state(run_dir)
        message += " Earlier checkpoints are untouched" + (f"; resume from the newest state, {newest}." if newest
                                                          else ".")
        error = SaveError(message)
        error.errno = code
        raise error from e


# -- writing a checkpoint ------------------------------------------------------------------------------------

def write_checkpoint(run_dir: Path, stem: str, models: dict, cfg: Config, *, step: int, epoch: int, num_epochs: int,
                     max_steps: int, tag_frequency: dict | None = None) -> Path:
    """One checkpoint in the layout ComfyUI loads directly: the [adapter] kind's file (adapters.<method>.model:
    save_checkpoint; a full finetune's is a native single file, or diffusers folders with save_native = false), plus
    the `_te` sibling for a Qwen3 LoRA. Replaces a file of the same name (a re-run of the same step).

    The numbers describe the run that writes the file (sd-scripts' meaning): step = optimizer steps done (ss_steps),
    epoch = the 1-based epoch that step falls in (ss_epoch), num_epochs / max_steps = the epochs and steps the run
    really does (ss_num_epochs, ss_max_train_steps), i.e. after a max_steps cap, not the configured epochs."""
    method = adapters.method(cfg.adapter.kind)
    dtype = DTYPES[cfg.train.dtype]
    base = base_model(cfg.train.model_path)  # the model trained, as its files name it

    def metadata(file_kind: str, rank: int | None, alpha: float | None) -> dict[str, str]:
        return ex.training_metadata(
            kind=file_kind, title=cfg.run_stem, rank=rank, alpha=alpha,
            resolution=cfg.dataset.tiers, steps=step, epoch=epoch, num_epochs=num_epochs,
            max_steps=max_steps, tag_frequency=tag_frequency,
            training_config=config_json(cfg),
            network_args={"components": cfg.adapter.components, "train_llm_adapter": cfg.adapter.train_llm_adapter},
            extra={"step": step, "run": cfg.run_stem}, base_model=base)

    meta = metadata(method.name, *((None, None) if method.trains_base else (cfg.adapter.rank, cfg.adapter.alpha)))
    path = run_dir / method.output_name(stem, cfg)
    with writing(path, run_dir):
        path = method.runtime().save_checkpoint(path, models, cfg, meta, dtype)
    if cfg.adapter.train_text_encoder:  # the Qwen3 LoRA's own rank and alpha, even beside a full finetune
        te_meta = metadata("te_lora", *text_encoder_rank_alpha(cfg))
        te_path = ex.text_encoder_lora_path(run_dir / f"{stem}.safetensors")
        with writing(te_path, run_dir):
            ex.save_text_encoder_lora(te_path, models["text_encoder"], te_meta, dtype=dtype, overwrite=True)
    return path


def config_json(cfg: Config) -> dict:
    """The resolved config as plain data (ss_training_config is JSON, as in sd-scripts), as the file is shared: a
    path key (`path=True` in the schema) keeps only its last part (`base`, not `/home/alice/datasets/base`), so the
    file carries no folder or user name of the machine it was trained on."""
    data = _shareable(cfg)
    for private in ("source_path", "source_text"):
        data.pop(private, None)
    return data


def _last_part(value: str) -> str:
    return re.split(r"[\\/]", value.rstrip("\\/"))[-1]  # either separator: a Windows path read anywhere


def _shareable(table) -> dict:
    data = {}
    for f in dataclasses.fields(table):
        value = getattr(table, f.name)
        if dataclasses.is_dataclass(value):
            value = _shareable(value)
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            value = [_shareable(v) for v in value]
        elif f.metadata.get("path") and isinstance(value, str):
            value = _last_part(value)
        else:
            value = copy.deepcopy(value)
        data[f.name] = value
    return data


def tag_frequency(sources) -> dict[str, dict[str, int]]:
    """sd-scripts' `ss_tag_frequency`: {dataset folder: {tag: count}} over the raw `.txt` captions."""
    freq: dict[str, dict[str, int]] = {}
    for src in sources:
        txt = Path(f"{src.stem}.txt")
        if not txt.is_file():
            continue
        counts = freq.setdefault(txt.parent.name, {})
        for tag in split_tags(read_caption_file(txt), ","):
            counts[tag] = counts.get(tag, 0) + 1
    return freq
