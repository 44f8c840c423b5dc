"""LoHa's torch side: the peft config, and the file tensors in ComfyUI's keys.

peft's LoHa on a Linear holds hada_w1_a [out, r], hada_w1_b [r, in], hada_w2_a [out, r], hada_w2_b [r, in] and
applies ΔW = (w1_a·w1_b) ⊙ (w2_a·w2_b)·s with s = alpha/r (its `scaling`). ComfyUI's LoHa loader
(comfy/weight_adapter/loha.py) reads the same four factors under `<key>.hada_w1_a` ... in the same orientation and
scales by `alpha / hada_w1_b.shape[0]` when a `.alpha` key is present (by 1 without one). So the factors are
written as they are and `.alpha` = s·r, which gives back s exactly (also for a per-module rank or alpha).
Conv layers (the `hada_t1/t2` Tucker cores) are not exported: the trainer adapts Linear layers only.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoHaConfig
from peft.tuners.loha import layer as loha_layer

from anima_train.adapters.base import ADAPTER_NAME
from anima_train.adapters.export import (adapted_layers, cast, native_key, parts, refuse_kohya,
                                         save_adapter_checkpoint)

FACTORS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")


def peft_config(adapter, targets: list[str], rank: int, alpha: float) -> LoHaConfig:
    # init_weights=True: peft zeroes hada_w2_b, so a fresh LoHa is an exact no-op like LoRA.
    return LoHaConfig(r=rank, alpha=alpha, rank_dropout=adapter.dropout, target_modules=targets, init_weights=True)


def state_dict(transformer, text_conditioner=None, *, fmt: str = "peft", adapter_name: str = ADAPTER_NAME,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`diffusion_model.<native>.hada_w1_a / hada_w1_b / hada_w2_a / hada_w2_b` + `.alpha`, as ComfyUI reads them."""
    refuse_kohya("LoHa", fmt, "hada_*")
    out = {}
    for part, model in parts(transformer, text_conditioner):
        for name, module in adapted_layers(model, adapter_name, part, loha_layer.LoHaLayer, loha_layer.Linear):
            base = native_key(part, name)
            factors = {f: getattr(module, f)[adapter_name].detach().float() for f in FACTORS}
            rank = factors["hada_w1_b"].shape[0]  # ComfyUI's rank for alpha
            out.update({f"{base}.{f}": t for f, t in factors.items()})
            out[f"{base}.alpha"] = torch.tensor(float(module.scaling[adapter_name]) * rank)
    if not out:
        raise ValueError(f"no peft LoHa adapter named {adapter_name!r} on the transformer or text_conditioner")
    return cast(out, dtype)


def save_checkpoint(path: Path, models: dict, cfg, metadata: dict, dtype) -> Path:
    return save_adapter_checkpoint(state_dict, path, models, cfg, metadata, dtype)


def delta(factors: dict, weight: torch.Tensor) -> torch.Tensor:
    """ComfyUI's LoHa ΔW: (w1_a·w1_b) ⊙ (w2_a·w2_b)·alpha/rank (rank = hada_w1_b's first dimension; 1 without alpha)."""
    f = factors
    scale = f["alpha"].item() / f["hada_w1_b"].shape[0] if "alpha" in f else 1.0
    return (f["hada_w1_a"] @ f["hada_w1_b"]) * (f["hada_w2_a"] @ f["hada_w2_b"]) * scale
