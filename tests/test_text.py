"""Our per-step prompt encoding equals the diffusers Anima pipeline's (AnimaTextEncoderStep + conditioner)."""

from __future__ import annotations

import types

import torch

from anima_train.model.prompts import encode_prompts, tokenize
from tests.fixtures_tiny import load_repo


def _pipeline_context(parts, captions):
    from diffusers.modular_pipelines.anima.encoders import AnimaTextEncoderStep

    components = types.SimpleNamespace(tokenizer=parts["tokenizer"], t5_tokenizer=parts["t5_tokenizer"],
                                       text_encoder=parts["text_encoder"], _execution_device=torch.device("cpu"))
    out = AnimaTextEncoderStep.encode_prompt(components, captions, prepare_unconditional_embeds=False,
                                             device=torch.device("cpu"), dtype=torch.float32)
    return parts["text_conditioner"](source_hidden_states=out["qwen_prompt_embeds"],
                                     target_input_ids=out["t5_input_ids"],
                                     target_attention_mask=out["t5_attention_mask"],
                                     source_attention_mask=out["qwen_attention_mask"])


def test_matches_diffusers_pipeline(tiny_anima):
    parts = load_repo(tiny_anima.diffusers_dir)
    with torch.no_grad():
        for captions in (["red circle, white background", "blue square"], ["", "green triangle, black background"],
                         ["", ""], ["red circle, white background"]):
            ours = encode_prompts(captions, tokenizer=parts["tokenizer"], t5_tokenizer=parts["t5_tokenizer"],
                                  text_encoder=parts["text_encoder"], conditioner=parts["text_conditioner"],
                                  device="cpu")
            ref = _pipeline_context(parts, captions)
            assert ours.shape == ref.shape
            assert torch.equal(ours, ref), captions
            assert torch.isfinite(ours).all()


def test_qwen_mask_is_decided_on_the_host(tiny_anima):
    # transformers reads a device [B, L] mask back twice per call (two host syncs per training step on a GPU); we
    # hand SDPA the mask it would build: none without padding, causal & padding with it (equality: test above)
    from anima_train.model.prompts import qwen_attention_mask

    parts = load_repo(tiny_anima.diffusers_dir)
    te = parts["text_encoder"]
    assert te.config._attn_implementation == "sdpa"
    padded = tokenize(["red circle, white background", "blue square"], parts["tokenizer"], parts["t5_tokenizer"])
    mask = qwen_attention_mask(te, padded["qwen_mask"])
    n = padded["qwen_mask"].shape[1]
    assert mask.shape == (2, 1, n, n) and mask.dtype == torch.bool
    assert not mask[1, 0, -1, -1] and mask[0, 0, -1, -1] and not mask[0, 0, 0, 1]
    assert qwen_attention_mask(te, torch.ones(2, 5, dtype=torch.long)) is None
    te.config._attn_implementation = "eager"
    try:
        assert qwen_attention_mask(te, padded["qwen_mask"]) is padded["qwen_mask"]
    finally:
        te.config._attn_implementation = "sdpa"


def test_empty_batch_gets_one_masked_token(tiny_anima):
    parts = load_repo(tiny_anima.diffusers_dir)
    tok = tokenize(["", ""], parts["tokenizer"], parts["t5_tokenizer"])
    assert tok["qwen_ids"].tolist() == [[0], [0]] and tok["qwen_mask"].tolist() == [[0], [0]]
    assert tok["t5_ids"].tolist() == [[1], [1]]  # T5 appends </s>


def test_conditioner_gets_gradients_text_encoder_does_not(tiny_anima):
    parts = load_repo(tiny_anima.diffusers_dir)
    ctx = encode_prompts(["red circle"], tokenizer=parts["tokenizer"], t5_tokenizer=parts["t5_tokenizer"],
                         text_encoder=parts["text_encoder"], conditioner=parts["text_conditioner"], device="cpu")
    ctx.square().mean().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in parts["text_conditioner"].parameters())
    assert all(p.grad is None for p in parts["text_encoder"].parameters())
