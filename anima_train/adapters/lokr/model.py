"""LoKr's torch side: the peft config, and the file tensors in ComfyUI's keys.

Scale: peft applies s = alpha/r to kron(w1, w2) always; ComfyUI (comfy/weight_adapter/lokr.py) applies alpha/dim
only when a factor is decomposed (dim = lokr_w2_b.shape[0], else lokr_w1_b.shape[0]) and ignores alpha otherwise.
So decomposed modules get `.alpha` = s·dim, and modules with two full factors get s folded into lokr_w1 (no
`.alpha`). LoKr in the kohya `lora_unet_*` layout is refused: that layout defines LoRA only, so kohya tools could
not read lokr_* factors under lora_unet_* names, and the file would load nowhere but ComfyUI while looking like a
kohya LoRA.
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoKrConfig
from peft.tuners.lokr.layer import LoKrLayer
from peft.tuners.lokr.layer import Linear as LoKrLinear

from anima_train.adapters.export import (adapted_layers, cast, native_key, parts, refuse_kohya,
                                         save_adapter_checkpoint)
from anima_train.adapters.base import ADAPTER_NAME

FACTORS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


def peft_config(adapter, targets: list[str], rank: int, alpha: float) -> LoKrConfig:
    # init_weights=True: peft zeroes one Kronecker factor, so a fresh LoKr is an exact no-op like LoRA.
    return LoKrConfig(r=rank, alpha=alpha, rank_dropout=adapter.dropout, decompose_factor=adapter.lokr_factor,
                      decompose_both=adapter.lokr_decompose_both, target_modules=targets, init_weights=True)


def state_dict(transformer, text_conditioner=None, *, fmt: str = "peft", adapter_name: str = ADAPTER_NAME,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`diffusion_model.<native>.lokr_*` (+ `.alpha` where a factor is decomposed), keys exactly as ComfyUI reads
    them."""
    refuse_kohya("LoKr", fmt, "lokr_*")
    out = {}
    for part, model in parts(transformer, text_conditioner):
        for name, module in adapted_layers(model, adapter_name, part, LoKrLayer, LoKrLinear):
            factors = {f: getattr(module, f)[adapter_name].detach().float()
                       for f in FACTORS if adapter_name in getattr(module, f)}
            scaling = float(module.scaling[adapter_name])
            base = native_key(part, name)
            # ComfyUI's rank for alpha: w2's when w2 is decomposed, else w1's (comfy/weight_adapter/lokr.py)
            dim = (factors["lokr_w2_b"].shape[0] if "lokr_w2_b" in factors
                   else factors["lokr_w1_b"].shape[0] if "lokr_w1_b" in factors else None)
            if dim is None:
                factors["lokr_w1"] = factors["lokr_w1"] * scaling  # ComfyUI ignores alpha for two full factors
            else:
                out[f"{base}.alpha"] = torch.tensor(scaling * dim)
            out.update({f"{base}.{f}": t for f, t in factors.items()})
    if not out:
        raise ValueError(f"no peft LoKr adapter named {adapter_name!r} on the transformer or text_conditioner")
    return cast(out, dtype)


def save_checkpoint(path: Path, models: dict, cfg, metadata: dict, dtype) -> Path:
    return save_adapter_checkpoint(state_dict, path, models, cfg, metadata, dtype)


def delta(factors: dict, weight: torch.Tensor) -> torch.Tensor:
    """ComfyUI's LoKr ΔW: kron(w1, w2), each factor whole or as a product, times alpha/dim where a factor is
    decomposed (dim = lokr_w2_b's first dimension, else lokr_w1_b's; 1 otherwise)."""
    f = factors
    w1 = f["lokr_w1"] if "lokr_w1" in f else f["lokr_w1_a"] @ f["lokr_w1_b"]
    w2 = f["lokr_w2"] if "lokr_w2" in f else f["lokr_w2_a"] @ f["lokr_w2_b"]
    dim = f["lokr_w2_b"].shape[0] if "lokr_w2_b" in f else f["lokr_w1_b"].shape[0] if "lokr_w1_b" in f else None
    scale = f["alpha"].item() / dim if "alpha" in f and dim else 1.0
    return torch.kron(w1, w2) * scale
