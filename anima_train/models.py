"""Load the parts of a converted Anima diffusers repo that the trainer needs.

    parts = load_components("../anima-diffusers", dtype="bfloat16", device="cuda")
    parts.transformer, parts.text_conditioner, parts.text_encoder      # nn.Modules, eval mode, on `device`
    parts.tokenizer, parts.t5_tokenizer, parts.scheduler
    parts.vae                                                          # loaded on first access (lazy)

The repo is the one `anima-train convert` writes (or any diffusers Anima repo with the same subfolders). Every
component is loaded from its own subfolder with the plain `from_pretrained` of its class (MODEL.md §2); the
modular-pipeline index is never read. Everything is checked *before* the first weight is read, so a repo converted
without tokenizers fails in a second with a message naming the fix, not after loading 4 GB.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from anima_train.config import DTYPE_NAMES
from anima_train.errors import UserError

# subfolder -> the file that must exist in it (any one of the names)
REQUIRED_FILES = {
    "transformer": ("config.json",),
    "text_conditioner": ("config.json",),
    "text_encoder": ("config.json",),
    "vae": ("config.json",),
    "scheduler": ("scheduler_config.json",),
    "tokenizer": ("tokenizer.json", "vocab.json", "tokenizer_config.json"),
    "t5_tokenizer": ("tokenizer.json", "spiece.model", "tokenizer_config.json"),
}
TOKENIZER_FOLDERS = ("tokenizer", "t5_tokenizer")
DEFAULT_TOKENIZER_REPO = "circlestone-labs/Anima-Base-v1.0-Diffusers"  # see convert.py for why this one


class ModelRepoError(UserError, FileNotFoundError):
    """A model_path that is not a usable Anima diffusers repo; the message says what is missing and the fix."""


def tokenizer_fix_hint(model_path: str | os.PathLike) -> str:
    return (f"Add them in one of two ways: run the same `anima-train convert` (or Convert node) again, same files "
            f"and out folder, with `--tokenizers DIR|REPO_ID` (default repo {DEFAULT_TOKENIZER_REPO}): it adds them "
            f"to the repo it wrote; or copy the two folders into the repo, e.g. `hf download "
            f"{DEFAULT_TOKENIZER_REPO} --include 'tokenizer/*' 't5_tokenizer/*' --local-dir {model_path}`")


def check_repo(model_path: str | os.PathLike) -> Path:
    """Raise ModelRepoError unless every subfolder the trainer loads is present. Reads no weights."""
    root = Path(model_path).expanduser()
    if not root.is_dir():
        raise ModelRepoError(
            f"model_path {str(root)!r} is not a directory. Point train.model_path (or ANIMA_MODEL) at a diffusers "
            f"Anima repo; make one from the ComfyUI single files with `anima-train convert --anima F --qwen F "
            f"--vae F --out DIR`")
    missing = [sub for sub, names in REQUIRED_FILES.items() if not any((root / sub / n).is_file() for n in names)]
    missing_tok = [m for m in missing if m in TOKENIZER_FOLDERS]
    missing_weights = [m for m in missing if m not in TOKENIZER_FOLDERS]
    if missing_weights:
        raise ModelRepoError(
            f"{root} is not a complete Anima diffusers repo: missing {', '.join(f'{m}/' for m in missing_weights)}"
            f"{' and ' + ', '.join(f'{m}/' for m in missing_tok) if missing_tok else ''}. "
            f"Convert the ComfyUI single files with `anima-train convert --anima F --qwen F --vae F --out DIR`")
    if missing_tok:
        raise ModelRepoError(
            f"{root} has no {' and no '.join(f'{m}/' for m in missing_tok)} folder: the tokenizers are required to "
            f"train (captions are tokenized on every step) and conversion cannot synthesise them. "
            + tokenizer_fix_hint(root))
    return root


DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the [train] dtype names -> torch dtypes
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    return DTYPES[name]


@dataclass
class AnimaComponents:
    transformer: Any
    text_conditioner: Any
    text_encoder: Any
    tokenizer: Any
    t5_tokenizer: Any
    scheduler: Any
    model_path: Path
    dtype: torch.dtype
    device: torch.device
    _vae: Any = field(default=None, repr=False)

    @property
    def vae(self):
        """AutoencoderKLQwenImage, loaded on first access (training from a latent cache never needs it)."""
        if self._vae is None:
            from diffusers import AutoencoderKLQwenImage

            self._vae = AutoencoderKLQwenImage.from_pretrained(self.model_path, subfolder="vae", dtype=self.dtype)
            self._vae.to(self.device).eval().requires_grad_(False)
        return self._vae

    def release_vae(self) -> None:
        """Drop the VAE (e.g. after encoding the latent cache); the next `.vae` loads it again."""
        self._vae = None


def load_components(model_path: str | os.PathLike, dtype: str | torch.dtype = torch.bfloat16,
                    device: str | torch.device = "cpu", load_vae: bool = False) -> AnimaComponents:
    """Load transformer, text_conditioner, text_encoder (Qwen3Model), both tokenizers and the scheduler from a
    diffusers Anima repo; the VAE is lazy unless `load_vae`. Models come back in eval mode with requires_grad off
    (the trainer decides what to train) in `dtype` on `device`."""
    from diffusers import CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    from transformers import AutoTokenizer, Qwen3Model

    root = check_repo(model_path)  # before any weight is read
    dtype, device = resolve_dtype(dtype), torch.device(device)
    tokenizer = AutoTokenizer.from_pretrained(root, subfolder="tokenizer")
    t5_tokenizer = AutoTokenizer.from_pretrained(root, subfolder="t5_tokenizer")
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root, subfolder="scheduler")

    def ready(model):
        return model.to(device).eval().requires_grad_(False)

    parts = AnimaComponents(
        transformer=ready(CosmosTransformer3DModel.from_pretrained(root, subfolder="transformer", dtype=dtype)),
        text_conditioner=ready(AnimaTextConditioner.from_pretrained(root, subfolder="text_conditioner", dtype=dtype)),
        text_encoder=ready(Qwen3Model.from_pretrained(root, subfolder="text_encoder", dtype=dtype)),
        tokenizer=tokenizer, t5_tokenizer=t5_tokenizer, scheduler=scheduler,
        model_path=root, dtype=dtype, device=device)
    if load_vae:
        parts.vae  # noqa: B018 (loads it)
    return parts
