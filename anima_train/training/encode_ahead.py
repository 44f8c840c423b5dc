"""Qwen3's outputs for the next micro-batches, encoded in one visit of the parked Qwen3.

On a small card Qwen3 waits in host memory between uses (memory.ParkedWeights), and every micro-batch brought it in
for its captions: the copy in cost 45 ms of a 0.33 s step, LoRA b2 under 8 GiB on an H100 (14 %,
bench/results/caps_2026-12-06). Its output depends on the captions alone (frozen, eval mode, nothing random), and a
batch's captions are fixed once the loader has made it (shuffled tags, dropout and the curriculum's caption choice
included). So one visit encodes the next `AHEAD` batches, each batch alone with the same call its own step would
make: the run trains to the same bits, with one copy in per `AHEAD` micro-batches.

The outputs wait in host memory (batch x tokens x 1024 in bf16: a few MB a batch) until their step moves them in.
The window never crosses an epoch (the loop makes a loader pass per epoch), and a run that stops mid-window drops
batches it had not trained: a resumed run's loader makes them again.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import torch

from anima_train.model.prompts import encode_qwen, tokenize
from anima_train.training.memory import host_copy

# micro-batches per visit: 1/16 of the copies. A window's batches wait in host memory: latents ~1 MB a batch at
# 1024², images (source = "encode") 12 MB each
AHEAD = 16
ENCODED_KEY = "qwen_hidden"  # the batch's Qwen3 output, on the host, when it was encoded ahead


def encoded_ahead(batches: Iterable[dict], model) -> Iterator[dict]:
    """`batches` (one epoch's loader pass) as they come, each with its Qwen3 output under ENCODED_KEY where Qwen3 is
    parked for the window. A Qwen3 that stays on the device (the plan found room), one that trains, or the run's text
    cache ([dataset] cache_text_encoder_outputs) leaves the batches as they are.

    A window never takes the epoch's last batch before its turn: accelerate's loader marks its end when that batch
    is fetched, and the end of the loader closes a gradient accumulation (an optimizer step on fewer micro-batches),
    which must come where it would without the window."""
    if model.parked is None or model.text_cache is not None:  # nothing to bring in: as the loader paces them
        yield from batches
        return
    try:
        remaining = len(batches)
    except TypeError:  # a loader without a length: no window can know where the epoch ends
        remaining = 0
    batches = iter(batches)
    while remaining > 0:
        window = list(itertools.islice(batches, 1 if remaining == 1 else min(AHEAD, remaining - 1)))
        if not window:
            return
        remaining -= len(window)
        parked = model.parked
        if not parked.resident:  # the plan may keep it on the device from the first step on
            parts, pin = model.parts, model.device.type == "cuda"
            with parked.on_device(), torch.no_grad():
                for batch in window:
                    host = tokenize(batch["caption"], parts.tokenizer, parts.t5_tokenizer)
                    hidden = encode_qwen(model.text_encoder, host["qwen_ids"], host["qwen_mask"], model.device)
                    batch[ENCODED_KEY] = host_copy(hidden, pin)
        yield from window
    yield from batches  # any the length did not count, as they come
