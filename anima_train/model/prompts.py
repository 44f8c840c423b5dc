"""Prompt encoding for training: Qwen3 hidden states + T5 ids → LLM adapter context, as the diffusers pipeline does.

Both tokenizers and Qwen3 run on every step by default: tag shuffling and tag dropout make a different caption for the
same image each epoch (docs/model.md#prompt-encoding). Where captions stay the same, `[dataset]
cache_text_encoder_outputs` keeps Qwen3's output per caption string (`QwenOutputs`). The conditioner (LLM adapter)
runs inside the training graph because it may be trainable, so its output is never cached.

Facts (diffusers `AnimaTextEncoderStep`; docs/model.md#prompt-encoding): both tokenizers get the raw prompt, no
template; padding "longest", truncation at `max_sequence_length` (512); Qwen adds no BOS/EOS, T5 appends `</s>`;
when the whole batch tokenises to zero Qwen tokens the ids become a single 0 with mask 0; the Qwen hidden state is
multiplied by its mask.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from anima_train.system.device import to_device

MAX_SEQUENCE_LENGTH = 512


def tokenize(captions: list[str], tokenizer, t5_tokenizer, max_length: int = MAX_SEQUENCE_LENGTH) -> dict:
    """Token ids and masks for both streams (CPU tensors)."""
    qwen_ids, qwen_mask = tokenize_qwen(captions, tokenizer, max_length)
    t5 = t5_tokenizer(captions, padding="longest", max_length=max_length, truncation=True, return_tensors="pt")
    return {"qwen_ids": qwen_ids, "qwen_mask": qwen_mask, "t5_ids": t5["input_ids"], "t5_mask": t5["attention_mask"]}


def tokenize_qwen(captions: list[str], tokenizer, max_length: int = MAX_SEQUENCE_LENGTH) -> tuple[torch.Tensor, ...]:
    """Qwen3's token ids and padding mask [B, L] (CPU tensors)."""
    if max_length > 4096:
        raise ValueError(f"max_length {max_length} is above the pipeline's limit of 4096")
    qwen = tokenizer(captions, padding="longest", max_length=max_length, truncation=True, return_tensors="pt")
    qwen_ids, qwen_mask = qwen["input_ids"], qwen["attention_mask"]
    if qwen_ids.shape[1] == 0:  # every caption empty (e.g. a batch of dropped captions)
        qwen_ids = torch.zeros(len(captions), 1, dtype=torch.long)
        qwen_mask = torch.zeros(len(captions), 1, dtype=torch.long)
    return qwen_ids, qwen_mask


def qwen_attention_mask(text_encoder, mask: torch.Tensor) -> torch.Tensor | None:
    """What Qwen3 attends to, from the host's [B, L] padding mask, for its `attention_mask`.

    Given a [B, L] mask on the GPU, transformers reads it back twice per call (two host syncs) to choose between
    plain causal attention (no padding) and a [B, 1, L, L] causal-and-padding mask. Deciding here, on the host copy,
    gives SDPA the same arguments without the syncs. Other attention backends get the [B, L] mask as before."""
    config = getattr(getattr(text_encoder, "module", text_encoder), "config", None)  # DDP-wrapped when trained
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return mask
    if bool(mask.all()):
        return None  # no padding: transformers then runs causal SDPA without a mask
    n = mask.shape[1]
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]


def encode_qwen(text_encoder, qwen_ids: torch.Tensor, qwen_mask: torch.Tensor,
                device: torch.device | str | None = None) -> torch.Tensor:
    """Qwen3's last hidden state on `device` (default: the ids'), zeroed on padding. `qwen_ids` and `qwen_mask` are
    the host's (tokenize): the attention mask is decided on the host copy (qwen_attention_mask) before anything moves.
    """
    device = qwen_ids.device if device is None else device
    attention = qwen_attention_mask(text_encoder, qwen_mask)
    hidden = text_encoder(input_ids=to_device(qwen_ids, device), use_cache=False,
                          attention_mask=None if attention is None else to_device(attention, device)).last_hidden_state
    return hidden * to_device(qwen_mask, device)[..., None].to(hidden.dtype)


class QwenOutputs:
    """`[dataset] cache_text_encoder_outputs`: Qwen3's last hidden state for each caption string, in host memory
    after the caption's first encode. A step whose captions are all known runs no Qwen3 and needs none of its
    weights on the GPU (parked ones are not copied in: `on_device` is entered only for new captions).

    Each caption is encoded alone, a batch of one without padding, so its output depends on nothing but the caption:
    a resumed run, which starts with an empty cache, gets the outputs the first run used. Encoded inside a padded
    batch (the uncached path) a shorter caption's output differs in the last bits (Qwen3 then attends through a
    padding mask), so a cached run trains to other bits than an uncached one; its captions are the same."""

    def __init__(self, text_encoder, tokenizer, device: torch.device | str, max_length: int = MAX_SEQUENCE_LENGTH,
                 on_device: Callable[[], AbstractContextManager] = nullcontext):
        self.text_encoder, self.tokenizer, self.device, self.max_length = text_encoder, tokenizer, device, max_length
        self.on_device = on_device
        self.outputs: dict[str, torch.Tensor] = {}  # caption -> [its Qwen3 tokens, hidden size], on the host

    def hidden(self, captions: list[str], qwen_mask: torch.Tensor) -> torch.Tensor:
        """Qwen3's hidden state for the batch [B, L, D] on the device, zero on padding as encode_qwen gives it;
        `qwen_mask`: the batch's host mask from `tokenize` (its width L is the batch's padded length)."""
        new = [c for c in dict.fromkeys(captions) if c not in self.outputs]
        if new:
            with self.on_device(), torch.no_grad():
                for caption in new:
                    self.outputs[caption] = self._encode_alone(caption)
        stored = [self.outputs[c] for c in captions]
        batch = stored[0].new_zeros(len(captions), qwen_mask.shape[1], stored[0].shape[-1])
        for row, hidden, mask in zip(batch, stored, qwen_mask.bool()):
            row[mask] = hidden  # the caption's tokens where the mask has them (either padding side)
        return to_device(batch, self.device)

    def _encode_alone(self, caption: str) -> torch.Tensor:
        """[the caption's tokens, hidden size] (none for an empty caption, which runs as `tokenize` gives it: one
        masked-out token; its output's dtype is Qwen3's, whatever its weights are stored in)."""
        ids, mask = tokenize_qwen([caption], self.tokenizer, self.max_length)
        hidden = encode_qwen(self.text_encoder, ids, mask, self.device)
        return hidden[0, : int(mask.sum())].to("cpu")


def encode_prompts(captions: list[str], *, tokenizer, t5_tokenizer, text_encoder, conditioner,
                   device: torch.device | str, max_length: int = MAX_SEQUENCE_LENGTH,
                   train_text_encoder: bool = False, cached: QwenOutputs | None = None,
                   encoded: torch.Tensor | None = None) -> torch.Tensor:
    """Context [B, max(L, min_sequence_length), D] for the DiT's `encoder_hidden_states`.

    Qwen3 runs without autograd unless it is being trained (it is the largest part of the text path and is frozen in
    the common case); the conditioner always runs with autograd enabled so it can be trained or pass gradients.
    `cached`: Qwen3's outputs come from there (QwenOutputs), which runs Qwen3 only for captions it has not seen.
    `encoded`: Qwen3's output for these captions, made by the same call ahead of the step (training/encode_ahead.py).
    """
    host = tokenize(captions, tokenizer, t5_tokenizer, max_length)
    if encoded is not None:
        qwen_hidden = to_device(encoded, device)
    elif cached is not None:
        qwen_hidden = cached.hidden(captions, host["qwen_mask"])
    else:
        with torch.set_grad_enabled(train_text_encoder and torch.is_grad_enabled()):
            qwen_hidden = encode_qwen(text_encoder, host["qwen_ids"], host["qwen_mask"], device)
    tok = {k: to_device(host[k], device) for k in ("t5_ids", "t5_mask", "qwen_mask")}
    return conditioner(source_hidden_states=qwen_hidden, target_input_ids=tok["t5_ids"],
                       target_attention_mask=tok["t5_mask"], source_attention_mask=tok["qwen_mask"])
