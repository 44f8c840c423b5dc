"""Fixed-quantile evaluation loss: the honest way to tell whether a run learned anything.

A single training loss value says little (each step draws a different timestep; loss at t = 0.95 is ~2.5x loss at
t = 0.05). Here every latent is evaluated at the same fixed timesteps with the same fixed noise, before and after
training, so the difference is the model's. The *text-conditioning margin* — eval loss with the captions shuffled
across images minus eval loss with the true captions — measures how much the prediction depends on the caption;
it should widen when a run learns from its captions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from anima_train.training.flow import noisy_latents, velocity_target
from anima_train.model.prompts import QwenOutputs, encode_prompts
from anima_train.data.captions import read_caption_files
from anima_train.data.cache_files import CACHE_NAME, CACHE_TAIL, load_latents

DEFAULT_TIMESTEPS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass
class EvalResult:
    true_captions: float
    shuffled_captions: float

    @property
    def margin(self) -> float:
        return self.shuffled_captions - self.true_captions


def cached_eval_set(folder: str | Path) -> tuple[list[torch.Tensor], list[str]]:
    """Every latent cache in `folder` (sorted by name) with the tag caption of its source (`<stem>.txt`)."""
    latents, captions = [], []
    for path in sorted(Path(folder).glob("*" + CACHE_TAIL)):
        match = CACHE_NAME.match(path.name)
        if match is None:
            continue
        latents.append(load_latents(path))
        captions.append(read_caption_files(path.with_name(match["stem"]))[0].strip())
    return latents, captions


def derangement(n: int, seed: int = 0) -> list[int]:
    """A permutation with no fixed point (every image gets another image's caption)."""
    if n < 2:
        raise ValueError("the text-conditioning margin needs at least 2 samples")
    g = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(n, generator=g).tolist()
        if all(i != p for i, p in enumerate(perm)):
            return perm


@torch.no_grad()
def fixed_quantile_loss(parts, latents: list[torch.Tensor], captions: list[str],
                        timesteps=DEFAULT_TIMESTEPS, seed: int = 1234, cached: QwenOutputs | None = None) -> float:
    """Mean velocity MSE over every latent x every fixed timestep, with noise fixed by `seed`.

    `parts`: anything with transformer, text_conditioner, text_encoder, tokenizer,
    t5_tokenizer (models.AnimaComponents);
    latents: normalised [16,1,h,w] tensors (sizes may differ: each is evaluated on its own);
    `cached`: the run's Qwen3 outputs per caption (prompts.QwenOutputs), which encodes each caption alone as this
    loop does: the same numbers, without Qwen3 for a caption it has seen."""
    transformer = parts.transformer
    device = next(transformer.parameters()).device
    dtype = next(transformer.parameters()).dtype
    was_training = transformer.training
    transformer.eval()
    total, count = 0.0, 0
    g = torch.Generator().manual_seed(seed)
    try:
        for x0, caption in zip(latents, captions):
            x0 = x0.to(device, dtype)[None]
            context = encode_prompts([caption], tokenizer=parts.tokenizer, t5_tokenizer=parts.t5_tokenizer,
                                     text_encoder=parts.text_encoder, conditioner=parts.text_conditioner,
                                     device=device, cached=cached)
            _, _, _, h, w = x0.shape
            pad = x0.new_zeros(1, 1, 8 * h, 8 * w)
            for t_value in timesteps:
                noise = torch.randn(x0.shape, generator=g).to(device, dtype)
                t = torch.full((1,), float(t_value), device=device)
                x_t = noisy_latents(x0, noise, t)
                pred = transformer(x_t, timestep=t.to(dtype), encoder_hidden_states=context.to(dtype),
                                   padding_mask=pad, return_dict=False)[0]
                total += torch.mean((pred.float() - velocity_target(x0, noise).float()) ** 2).item()
                count += 1
    finally:
        transformer.train(was_training)
    return total / count


def evaluate(parts, latents: list[torch.Tensor], captions: list[str], timesteps=DEFAULT_TIMESTEPS,
             seed: int = 1234, cached: QwenOutputs | None = None) -> EvalResult:
    perm = derangement(len(captions), seed)
    return EvalResult(
        true_captions=fixed_quantile_loss(parts, latents, captions, timesteps, seed, cached),
        shuffled_captions=fixed_quantile_loss(parts, latents, [captions[p] for p in perm], timesteps, seed, cached),
    )
