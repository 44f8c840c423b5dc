"""What an Anima repo declares about its size, read from its config.json files alone (no weight is read): the DiT's
block count and widths and every component's parameter count. `anima-train plan` plans from this, and the checks
that count blocks (`swap_blocks`, `checkpoint_blocks`) use the same count the trainer will load.

The counts come from the real model classes built on the meta device (no memory, no weights), so they follow
whatever the classes build from the config, and a config that does not build a model is named as damaged. Why
the block count is read and never looked up from the width: Anima-2B and the community Anima-2.9B share width 2048
and differ only in their 28 and 40 blocks (docs/model.md#the-anima-family).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from anima_train.model.components import WEIGHT_SOURCES, ModelRepoError, _empty_models

CONVERT_RECORD = "anima-convert.json"  # written by `anima-train convert` (model/convert.py RECORD_NAME)

# the Linears of a DiT block an adapter wraps by default: attention (self and cross) and the MLP
ADAPTED_PREFIXES = ("attn1.", "attn2.", "ff.")


@dataclass(frozen=True)
class ModelShape:
    blocks: int  # DiT blocks (transformer/config.json num_layers)
    width: int  # the DiT's model width (heads x head_dim)
    mlp_width: int
    context_width: int  # the cross-attention's input (the LLM adapter's output)
    block_parameters: int  # one DiT block's weights
    adapted_linears: tuple  # (in, out) of each Linear of one block an adapter wraps
    dit_parameters: int  # the DiT with its blocks
    conditioner_parameters: int  # the LLM adapter
    text_encoder_parameters: int  # Qwen3
    vae_parameters: int

    def lora_parameters(self, rank: int) -> int:
        """A LoRA's trainable parameters on every block's adapted Linears: rank x (in + out) each."""
        return self.blocks * rank * sum(i + o for i, o in self.adapted_linears)

    def describe(self) -> str:
        count = self.dit_parameters + self.conditioner_parameters
        size = f"{count / 1e9:.2f} B" if count >= 1e8 else f"{count:,}"
        return (f"{self.blocks} DiT blocks of width {self.width} (MLP {self.mlp_width}, context {self.context_width}), "
                f"{size} parameters in the DiT and its LLM adapter")


def shape_of(models: dict) -> ModelShape:
    """The shape of the four models `_empty_models` builds (or any with the same parts)."""
    transformer = models["transformer"]
    blocks = transformer.transformer_blocks
    block = blocks[0]
    linears = tuple((m.in_features, m.out_features) for name, m in block.named_modules()
                    if isinstance(m, torch.nn.Linear) and name.startswith(ADAPTED_PREFIXES))
    count = {name: sum(p.numel() for p in model.parameters()) for name, model in models.items()}
    return ModelShape(blocks=len(blocks), width=block.attn1.to_q.in_features,
                      mlp_width=block.ff.net[0].proj.out_features, context_width=block.attn2.to_k.in_features,
                      block_parameters=sum(p.numel() for p in block.parameters()), adapted_linears=linears,
                      dit_parameters=count["transformer"], conditioner_parameters=count["text_conditioner"],
                      text_encoder_parameters=count["text_encoder"], vae_parameters=count["vae"])


def declared_shape(model_path: str | os.PathLike, key: str = "[train] model_path") -> ModelShape:
    """The shape `model_path`'s config.json files declare. A missing folder or config is a ModelRepoError naming
    `key` and the fix."""
    root = Path(model_path).expanduser()
    if not root.is_dir():
        raise ModelRepoError(
            f"{key} = {str(model_path)!r}: no such folder ({root.absolute()}), so there is no model to plan or "
            f"train. Point it at a diffusers Anima repo; make one from the ComfyUI single files with `anima-train "
            f"convert --anima F --qwen F --vae F --out DIR`")
    missing = [sub for sub in WEIGHT_SOURCES if not (root / sub / "config.json").is_file()]
    if missing:
        raise ModelRepoError(
            f"{key} = {str(model_path)!r} is not an Anima diffusers repo: it has no "
            f"{', '.join(f'{sub}/config.json' for sub in missing)}. Convert the ComfyUI single files with "
            f"`anima-train convert --anima F --qwen F --vae F --out DIR` and point {key} at DIR")
    stamp = tuple((root / sub / "config.json").stat().st_mtime_ns for sub in WEIGHT_SOURCES)
    return _shape(str(root.resolve()), stamp)


@functools.lru_cache(maxsize=8)
def _shape(root: str, stamp: tuple) -> ModelShape:  # stamp: a config edited since is read again
    return shape_of(_empty_models(Path(root), lambda: torch.device("meta")))


def declared_blocks(model_path: str | os.PathLike) -> int | None:
    """The DiT's block count from transformer/config.json (None when it cannot be read: the repo check says why)."""
    try:
        value = json.loads((Path(model_path).expanduser() / "transformer" / "config.json").read_text("utf-8"))
        return int(value["num_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class BaseModel:
    """The model a run trains, as its files name it (for the metadata of what the run writes)."""
    name: str  # the single file `convert` read (anima-2.9b.safetensors), else the repo's folder name
    sha256: str | None  # of that single file, when convert recorded it
    blocks: int | None


def base_model(model_path: str | os.PathLike) -> BaseModel:
    root = Path(model_path).expanduser()
    name, sha256 = root.resolve().name, None
    try:
        record = json.loads((root / CONVERT_RECORD).read_text("utf-8"))["model"]
        name, sha256 = str(record["file"]), record.get("sha256")
    except (OSError, ValueError, KeyError, TypeError):
        pass  # a repo convert did not write (a download, the tiny model): its folder's name
    return BaseModel(name=name, sha256=sha256, blocks=declared_blocks(root))
