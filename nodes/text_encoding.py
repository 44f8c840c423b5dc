"""The Qwen3 text path of Anima: Encode prompt (trainer): the tokenizers and Qwen3 of a converted diffusers repo,
loaded once per repo (its files' digest) and kept, and the CONDITIONING ComfyUI's Anima model consumes."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer, Qwen3Model

from anima_train.model.components import check_repo
from anima_train.model.prompts import encode_qwen, tokenize

from . import run_records

_TEXT_CACHE: dict = {}  # (repo, stat digest) -> (tokenizer, t5_tokenizer, text_encoder); one entry


def _text_parts(model_path: str):
    root = check_repo(model_path)
    key = (str(root), run_records.files_digest([root / "text_encoder", root / "tokenizer", root / "t5_tokenizer"]))
    if key not in _TEXT_CACHE:
        _TEXT_CACHE.clear()
        _TEXT_CACHE[key] = (AutoTokenizer.from_pretrained(root, subfolder="tokenizer"),
                            AutoTokenizer.from_pretrained(root, subfolder="t5_tokenizer"),
                            Qwen3Model.from_pretrained(root, subfolder="text_encoder", dtype=torch.float32).eval())
    return _TEXT_CACHE[key]


def encode_conditioning(model_path: str, text: str):
    """CONDITIONING [[cross_attn [1, L, 1024], {"t5xxl_ids": int32 [L_t5], "t5xxl_weights": [L_t5]}]], the layout
    ComfyUI's Anima TE produces (docs/comfyui.md#conditioning): Qwen3's masked last hidden state, and the T5 ids that
    feed the LLM adapter inside ComfyUI's Anima model (weights 1.0, as ComfyUI's Anima tokenizer forces)."""
    tokenizer, t5_tokenizer, text_encoder = _text_parts(model_path)
    tok = tokenize([text], tokenizer, t5_tokenizer)
    with torch.inference_mode():
        cross_attn = encode_qwen(text_encoder, tok["qwen_ids"], tok["qwen_mask"]).float()
    t5_ids = tok["t5_ids"][0].to(torch.int32)
    return [[cross_attn, {"t5xxl_ids": t5_ids, "t5xxl_weights": torch.ones(t5_ids.shape[0])}]]
