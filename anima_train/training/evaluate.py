"""`anima-train evaluate CFG [--checkpoint FILE]`: a config's validation numbers for the base model or a trained file.

    anima-train evaluate run.toml                                   # the base model of run.toml
    anima-train evaluate run.toml --checkpoint out/run/run-step000400.safetensors

The numbers are the ones training prints (training/validation.py): the `[validation]` set of the config (its `folder`,
or the `fraction` of the dataset its seed holds out), the fixed timesteps and noise, the text-conditioning margin.
So the checkpoints of one run can be compared and the best one picked.

A checkpoint is applied to the base model as the weights it changes: an adapter file (each module's tensors read by
the adapter method whose file holds them: adapters.reading, the method's `delta`) is merged as what ComfyUI applies,
a full-finetune native single file replaces the DiT and the LLM adapter;
a `<stem>_te.safetensors` beside an adapter (the Qwen3 LoRA) is merged too. A file whose modules or shapes are not
those of the config's model is refused with one line naming the file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from anima_train import adapters, errors
from anima_train.adapters.export import (DIFFUSION_PREFIX, KOHYA_TE_PREFIX, KOHYA_UNET_PREFIX, native_key,
                                         text_encoder_lora_path)
from anima_train.config import load_config
from anima_train.data.dataset import build_training_data
from anima_train.model import keymaps
from anima_train.model.components import DTYPES, load_components
from anima_train.training.validation import Validation, ValidationSet, describe, validation_items

# the file's tensor names after the module, of every adapter method (longest first: "lora_up.weight" before "weight")
FACTOR_NAMES = tuple(sorted({f for m in adapters.METHODS.values() for f in m.factors}, key=len, reverse=True))


class CheckpointError(errors.UserError):
    """A checkpoint that does not fit the config's model."""


def add_arguments(parser) -> None:
    parser.add_argument("config", help="the run's TOML config (its [validation] table and model_path)")
    parser.add_argument("--checkpoint", metavar="FILE",
                        help=f"a {adapters.titles(adapters_only=True)} or full-finetune .safetensors trained for "
                             "this model; omitted: the base model")
    parser.add_argument("--cpu", action="store_true", help="evaluate on the CPU even when a GPU is visible")


def run(args) -> int:
    cfg = load_config(args.config)
    if not cfg.validation.enabled:
        raise errors.UserError(f"{args.config}: no [validation] set to evaluate on: add [validation] folder = "
                               f"\"held_out/\" or fraction = 0.1 (docs/config.md lists the keys)")
    # what can be refused without the model first: an unreadable file, a held-out set without captions or caches
    tensors = _read(Path(args.checkpoint)) if args.checkpoint else None
    data = None if cfg.validation.folder else build_training_data(cfg, cfg.train.model_path)
    items = validation_items(cfg, data, cfg.train.model_path)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    parts = load_components(cfg.train.model_path, dtype=DTYPES[cfg.train.dtype], device=device,
                            load_vae=any(it.cache is None for it in items))
    what = "the base model"
    if args.checkpoint:
        what = apply_checkpoint(parts, Path(args.checkpoint), tensors)
    vset = ValidationSet.build(cfg, items, vae=lambda: parts.vae)
    print(f"validation: {len(vset.names)} image(s): " + ", ".join(vset.names))
    point = Validation(cfg, vset, parts).at(0)
    print(f"{what}: " + describe(point, len(vset.names), len(cfg.validation.timesteps)).split(": ", 1)[1])
    return 0


# -- applying a checkpoint --------------------------------------------------------------------------------------

def apply_checkpoint(parts, path: Path, tensors: dict | None = None) -> str:
    """Change `parts`' weights as the checkpoint at `path` (its `tensors`, when read already) says; returns what it
    was ("LoRA file X", ...)."""
    tensors = _read(path) if tensors is None else tensors
    if any(k.startswith(keymaps.NATIVE_PREFIXES) for k in tensors):
        _load_full(parts, tensors, path)
        return f"full finetune {path.name}"
    kind = _merge_adapter(tensors, _modules(parts), path)
    te = text_encoder_lora_path(path)
    if te.is_file():
        _merge_adapter(_read(te), _modules(parts), te)
    return f"{kind} {path.name}" + (f" (+ {te.name})" if te.is_file() else "")


def _read(path: Path) -> dict[str, torch.Tensor]:
    if path.is_dir():
        raise CheckpointError(f"--checkpoint {path}: a folder; give the .safetensors file (a full finetune saved "
                              f"as diffusers folders: set [train] save_native = true, or load the folder as "
                              f"model_path)")
    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError:
        raise CheckpointError(f"--checkpoint {path}: file not found") from None
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"--checkpoint {path}: not a readable .safetensors file ({exc})") from None


def _modules(parts) -> dict[str, torch.nn.Linear]:
    """Every Linear the files can name, under each name a file uses for it (peft/LyCORIS, kohya, Qwen3 kohya)."""
    out = {}
    for part, model in (("transformer", parts.transformer), ("text_conditioner", parts.text_conditioner)):
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                try:
                    key = native_key(part, name)
                except (KeyError, ValueError):
                    continue
                out[key] = module
                out[KOHYA_UNET_PREFIX + key.removeprefix(DIFFUSION_PREFIX).replace(".", "_")] = module
    for name, module in parts.text_encoder.named_modules():
        if isinstance(module, torch.nn.Linear):
            out[KOHYA_TE_PREFIX + name.removeprefix("model.").replace(".", "_")] = module
    return out


def _merge_adapter(tensors: dict, modules: dict, path: Path) -> str:
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        factor = next((f for f in FACTOR_NAMES if key.endswith("." + f)), None)
        if factor is None:
            raise CheckpointError(f"--checkpoint {path}: tensor {key!r} is not an adapter factor this trainer "
                                  f"writes ({adapters.titles(adapters_only=True, sep=', ')}) nor a native "
                                  f"full-finetune key")
        groups.setdefault(key[: -len(factor) - 1], {})[factor] = value.float()
    kinds = set()
    deltas = []
    for stem, factors in groups.items():
        module = modules.get(stem)
        if module is None:
            raise CheckpointError(f"--checkpoint {path}: made for another model: it adapts {stem}, which the "
                                  f"model of this config does not have")
        method = adapters.reading(factors)
        if method is None:
            raise CheckpointError(f"--checkpoint {path}: {stem} holds {', '.join(sorted(factors))}, which is no "
                                  f"adapter method's set of tensors ({adapters.titles(adapters_only=True, sep=', ')})")
        delta = method.runtime().delta(factors, module.weight.detach())
        if delta.shape != module.weight.shape:
            raise CheckpointError(f"--checkpoint {path}: made for another model: {stem} changes a "
                                  f"{tuple(delta.shape)} weight, this config's model has {tuple(module.weight.shape)}")
        kinds.add(method.title)
        deltas.append((module, delta))
    with torch.no_grad():  # only after every module fitted: a refused file changes nothing
        for module, delta in deltas:
            module.weight += delta.to(module.weight.device, module.weight.dtype)
    return "/".join(sorted(kinds)) + " file"


def _load_full(parts, tensors: dict, path: Path) -> None:
    try:
        dit, adapter = keymaps.split_anima_native(tensors)
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"--checkpoint {path}: made for another model ({exc})") from None
    for model, sd, what in ((parts.transformer, dit, "DiT"), (parts.text_conditioner, adapter, "LLM adapter")):
        own = model.state_dict()
        missing, extra = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
        wrong = [k for k in own if k in sd and own[k].shape != sd[k].shape]
        if missing or extra or wrong:
            detail = (f"{len(missing)} weight(s) missing, e.g. {missing[0]}" if missing else
                      f"{len(extra)} unknown weight(s), e.g. {extra[0]}" if extra else
                      f"{wrong[0]} is {tuple(sd[wrong[0]].shape)}, this config's model has "
                      f"{tuple(own[wrong[0]].shape)}")
            raise CheckpointError(f"--checkpoint {path}: made for another model: its {what} does not fit ({detail})")
    for model, sd in ((parts.transformer, dit), (parts.text_conditioner, adapter)):
        model.load_state_dict(sd, strict=True)
