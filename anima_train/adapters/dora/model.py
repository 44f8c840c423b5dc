"""DoRA's torch side: the peft config, and the file tensors in ComfyUI's keys.

peft's DoRA on a Linear (a LoRA layer with use_dora) holds A [r, in], B [out, r], the scale s and the magnitude m
[out] (`lora_magnitude_vector`), and computes W' = m / ‖W + s·B·A‖ · (W + s·B·A), the norm taken over each output
row (detached from the gradient, as the paper says).

ComfyUI (comfy/weight_adapter/base.py `weight_decompose`) reads `<key>.lora_up.weight` [out, r], `.lora_down.weight`
[r, in], `.alpha` and `.dora_scale`; a dora_scale with one value per output row ([out, 1]) gives
W' = (W + alpha/r·up·down) · dora_scale / (‖W‖ + eps): the norm is the base weight's, not the updated weight's
(LyCORIS divides by the updated one). So the file holds dora_scale = m · ‖W‖ / ‖W + s·B·A‖, made from the base weight
the adapter trained on, which makes ComfyUI's W' peft's (eps is ComfyUI's float epsilon: 1.2e-7 relative in fp32).
A loader that follows LyCORIS instead would scale each row by a further ‖W‖ / ‖W + s·B·A‖.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer

from anima_train.adapters.base import ADAPTER_NAME
from anima_train.adapters.export import (adapted_layers, cast, native_key, parts, refuse_kohya,
                                         save_adapter_checkpoint)


def peft_config(adapter, targets: list[str], rank: int, alpha: float) -> LoraConfig:
    # init_lora_weights=True: B = 0 and m = ‖W‖, so a fresh DoRA is an exact no-op like LoRA.
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=adapter.dropout, target_modules=targets,
                      init_lora_weights=True, use_dora=True)


def _row_norm(w: torch.Tensor) -> torch.Tensor:
    return w.norm(dim=1, keepdim=True)


def state_dict(transformer, text_conditioner=None, *, fmt: str = "peft", adapter_name: str = ADAPTER_NAME,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`diffusion_model.<native>.lora_up.weight / lora_down.weight / alpha / dora_scale`, as ComfyUI reads them."""
    refuse_kohya("DoRA", fmt, "lora_up/lora_down/alpha/dora_scale")
    out = {}
    for part, model in parts(transformer, text_conditioner):
        for name, module in adapted_layers(model, adapter_name, part, LoraLayer, LoraLinear):
            if not module.use_dora.get(adapter_name):
                raise ValueError(f"{part}.{name}: a LoRA layer without DoRA's magnitude; export it with kind 'lora'")
            weight = module.get_base_layer().weight
            if weight.is_meta or weight.numel() == 0:
                where = "meta" if weight.is_meta else "empty"
                raise ValueError(f"{part}.{name}: its base weight is not here ({where}); DoRA's dora_scale is made "
                                 f"from it")
            a = module.lora_A[adapter_name].weight.detach().float()
            b = module.lora_B[adapter_name].weight.detach().float()
            scaling, rank = float(module.scaling[adapter_name]), a.shape[0]
            magnitude = module.lora_magnitude_vector[adapter_name].weight.detach().float().reshape(-1, 1)
            w = weight.detach().float()
            updated = w + scaling * (b @ a)
            key = native_key(part, name)
            out[f"{key}.lora_up.weight"] = b
            out[f"{key}.lora_down.weight"] = a
            out[f"{key}.alpha"] = torch.tensor(scaling * rank)  # ComfyUI: alpha / lora_down.shape[0]
            out[f"{key}.dora_scale"] = magnitude * _row_norm(w) / _row_norm(updated)
    if not out:
        raise ValueError(f"no peft DoRA adapter named {adapter_name!r} on the transformer or text_conditioner")
    return cast(out, dtype)


def save_checkpoint(path: Path, models: dict, cfg, metadata: dict, dtype) -> Path:
    return save_adapter_checkpoint(state_dict, path, models, cfg, metadata, dtype)


def delta(factors: dict, weight: torch.Tensor) -> torch.Tensor:
    """ComfyUI's DoRA at strength 1, as ΔW: (W + alpha/r·up·down) · dora_scale / (‖W‖ + eps) − W for a dora_scale
    per output row (one per input column: the norm of each column of the updated weight, LyCORIS' other axis)."""
    f = factors
    down, scale = f["lora_down.weight"], f["dora_scale"]
    diff = f["lora_up.weight"] @ down
    if diff.shape != weight.shape:
        return diff
    w = weight.float()
    updated = w + diff * (f["alpha"].item() / down.shape[0] if "alpha" in f else 1.0)
    eps = torch.finfo(w.dtype).eps
    if scale.shape[0] == w.shape[0]:
        norm = _row_norm(w) + eps
    else:
        norm = updated.norm(dim=0, keepdim=True) + eps
    return updated * (scale.reshape(norm.shape) / norm) - w
