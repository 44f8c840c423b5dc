"""LoRA's torch side: the peft config, and the file tensors in ComfyUI's keys.

Scale (why the files look the way they do):
- peft LoRA: ΔW = B·A·s with s = peft's `scaling` (alpha/r, or alpha/√r with rsLoRA). diffusers'
  AnimaLoraLoaderMixin rejects `.alpha` keys and assumes alpha = r without metadata; ComfyUI uses scale 1 without
  `.alpha`. So fmt "peft" folds s into lora_B and writes no `.alpha`: both apply exactly ΔW.
- fmt "kohya": ComfyUI applies alpha/rank with rank = lora_down.shape[0], so `.alpha` = s·r reproduces s.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig

from anima_train.adapters.export import (DIFFUSION_PREFIX, FORMATS, KOHYA_UNET_PREFIX, cast, lora_layers,
                                         native_key, parts, save_adapter_checkpoint)
from anima_train.adapters.base import ADAPTER_NAME


def peft_config(adapter, targets: list[str], rank: int, alpha: float) -> LoraConfig:
    # init_lora_weights=True: A Kaiming-uniform, B = 0 (fresh LoRA = exact no-op).
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=adapter.dropout, target_modules=targets,
                      init_lora_weights=True)


def state_dict(transformer, text_conditioner=None, *, fmt: str = "peft", adapter_name: str = ADAPTER_NAME,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """fmt "peft": `diffusion_model.<native>.lora_A/lora_B.weight` (scale in B); "kohya":
    `lora_unet_<native with _>.lora_down/lora_up.weight` + `.alpha`."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    out = {}
    for part, model in parts(transformer, text_conditioner):
        for name, a, b, scaling, rank in lora_layers(model, adapter_name, part):
            key = native_key(part, name)
            a, b = a.detach().float(), b.detach().float()
            if fmt == "peft":
                out[f"{key}.lora_A.weight"] = a
                out[f"{key}.lora_B.weight"] = b * scaling  # scale folded, no .alpha key
            else:
                base = KOHYA_UNET_PREFIX + key.removeprefix(DIFFUSION_PREFIX).replace(".", "_")
                out[f"{base}.lora_down.weight"] = a
                out[f"{base}.lora_up.weight"] = b
                out[f"{base}.alpha"] = torch.tensor(scaling * rank)  # ComfyUI: alpha / lora_down.shape[0]
    if not out:
        raise ValueError(f"no peft LoRA adapter named {adapter_name!r} on the transformer or text_conditioner")
    return cast(out, dtype)


def save_checkpoint(path: Path, models: dict, cfg, metadata: dict, dtype) -> Path:
    return save_adapter_checkpoint(state_dict, path, models, cfg, metadata, dtype)


def delta(factors: dict, weight: torch.Tensor) -> torch.Tensor:
    """ComfyUI's LoRA ΔW: lora_B·lora_A (the scale folded in), or lora_up·lora_down·alpha/rank (rank =
    lora_down's first dimension; 1 without alpha)."""
    f = factors
    if "lora_A.weight" in f:
        return f["lora_B.weight"] @ f["lora_A.weight"]
    down = f["lora_down.weight"]
    scale = f["alpha"].item() / down.shape[0] if "alpha" in f else 1.0
    return (f["lora_up.weight"] @ down) * scale
