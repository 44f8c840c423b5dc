"""Full finetune's torch side: the whole DiT + LLM adapter as the native single file, or as diffusers folders.

    save_native(path, transformer, text_conditioner, metadata)        # net.* single file (685 tensors)
    save_diffusers(folder, transformer, text_conditioner, metadata)   # transformer/ + text_conditioner/
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from anima_train.model import keymaps
from anima_train.adapters.export import IMPLEMENTATION_DIFFUSERS, check_plain, module_path, write_safetensors
from anima_train.adapters.base import ADAPTER_NAME
from anima_train.files import publish_dir
from anima_train.model.quant import dequantized_state_dict


def _plain_state_dict(model) -> dict:
    """Plain tensors under clean names; SDNQ-quantized weights (quant.mode = "training") are dequantized."""
    return {module_path(k): v for k, v in dequantized_state_dict(model).items()}


def state_dict(transformer, text_conditioner=None, *, fmt: str = "peft", adapter_name: str = ADAPTER_NAME,
               dtype: torch.dtype | None = None) -> dict:
    """The native single-file dict (`net.*`, adapter under `net.llm_adapter.*`): same names as the released file.
    (fmt and adapter_name do not apply: the file is the model.)"""
    check_plain(transformer, "transformer")
    check_plain(text_conditioner, "text_conditioner")
    sd = keymaps.join_anima_native(_plain_state_dict(transformer), _plain_state_dict(text_conditioner))
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in sd.items()}


def save_native(path, transformer, text_conditioner, metadata: Mapping | None = None,
                dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Full finetune -> native single file for ComfyUI's UNETLoader (models/diffusion_models)."""
    return write_safetensors(path, state_dict(transformer, text_conditioner, dtype=dtype), metadata, overwrite)


def save_diffusers(folder, transformer, text_conditioner, metadata: Mapping | None = None,
                   dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Full finetune -> `<folder>/transformer/` + `<folder>/text_conditioner/` diffusers folders (config.json +
    one diffusion_pytorch_model.safetensors each, with the metadata); written beside and renamed into place."""
    folder = Path(folder)
    if folder.exists() and not overwrite:
        raise FileExistsError(f"{folder} already exists; pass overwrite=True to replace it")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        md = dict(metadata or {}, **{"modelspec.implementation": IMPLEMENTATION_DIFFUSERS})
        for sub, model in (("transformer", transformer), ("text_conditioner", text_conditioner)):
            check_plain(model, sub)
            (tmp / sub).mkdir(parents=True)
            model.save_config(tmp / sub)
            sd = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
                  for k, v in _plain_state_dict(model).items()}
            write_safetensors(tmp / sub / "diffusion_pytorch_model.safetensors", sd, md)
        publish_dir(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def save_checkpoint(path: Path, models: dict, cfg, metadata: dict, dtype) -> Path:
    """The native file ([train] save_native, the default) or the diffusers folders at `path`."""
    save = save_native if cfg.train.save_native else save_diffusers
    return save(path, models["transformer"], models["text_conditioner"], metadata, dtype=dtype, overwrite=True)
