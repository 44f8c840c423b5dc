"""The three models as a training step calls them (`Model`): loaded, quantized, with the adapters wrapped in, block
checkpointing, the swapped blocks and the parked Qwen3 set up (`build_model`), then wrapped by accelerate
(`prepare`)."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from anima_train.adapters import build_param_groups, inject_adapters
from anima_train.config import Config
from anima_train.model import fp8_base
from anima_train.model.components import load_components
from anima_train.model.prompts import QwenOutputs
from anima_train.model.quant import dit_tokens, quantize_models
from anima_train.training import recompute
from anima_train.training.memory import ParkedWeights, parks_qwen3
from anima_train.training.memory_plan import GIB
from anima_train.training.weight_swap import WeightSwap


@dataclass
class Model:
    """The three models as a training step calls them, and what their memory needs.

    `transformer`, `conditioner` and `text_encoder` start as the bare modules; `prepare` swaps in accelerate's
    wrappers for the trained ones. `parts` keeps the bare modules (checkpoint files, previews)."""
    parts: object  # model.components.Components
    device: torch.device
    dtype: torch.dtype
    groups: list  # the optimizer's parameter groups (adapters.build_param_groups)
    train_conditioner: bool
    train_text_encoder: bool
    block_ckpt: recompute.BlockCheckpointing
    recompute: int | None  # DiT blocks that recompute from the start; None = "auto", decided after step one
    parked: ParkedWeights | None  # the frozen Qwen3, when it waits in host memory between steps
    text_cache: QwenOutputs | None  # [dataset] cache_text_encoder_outputs: Qwen3's output per caption
    swap: WeightSwap | None  # [train] swap_blocks: the blocks whose frozen weights wait in host memory
    vae: object  # source = "encode": the VAE encodes each batch in the step; else None (latents are cached)
    transformer: torch.nn.Module
    conditioner: torch.nn.Module
    text_encoder: torch.nn.Module

    def trained(self) -> list[torch.nn.Module]:
        """The modules the optimizer updates, in the order accelerate prepares them (and the resume state numbers
        them): the transformer, then the conditioner and the text encoder when trained."""
        return [m for m, on in ((self.transformer, True), (self.conditioner, self.train_conditioner),
                                (self.text_encoder, self.train_text_encoder)) if on]


def build_model(cfg: Config, data, device: torch.device, dtype: torch.dtype, say, swap_blocks: int) -> Model:
    """The base models, quantized (quant.mode), with the adapters wrapped in, in train mode; block checkpointing,
    the `swap_blocks` swapped blocks (swap_plan.blocks_to_swap) and the parked Qwen3 set up."""
    # swapped blocks: the model loads into host memory, so that its weights never all sit on a small card at once
    swapping = swap_blocks > 0
    parts = load_components(cfg.train.model_path, dtype=dtype, device="cpu" if swapping else device)
    transformer, conditioner, text_encoder = parts.transformer, parts.text_conditioner, parts.text_encoder

    if cfg.quant.mode != "none":  # before the adapters: LoRA/LoKr wrap the quantized Linears
        tokens = [dit_tokens(*e.plan.bucket) for e in data.entries]
        report = quantize_models({"transformer": transformer, "text_conditioner": conditioner,
                                  "text_encoder": text_encoder}, cfg, token_counts=tokens)
        for line in report.summary().splitlines():
            say(line)
    inject_adapters(transformer, conditioner, text_encoder, cfg)
    blocks = list(transformer.transformer_blocks)
    if cfg.train.base_matmul == "fp8":  # after the adapters (they wrap the frozen Linears), before swap and compile
        converted = fp8_base.convert_blocks(blocks)
        fp8_base.keep_out_of_ddp(transformer)
        say(f"base     {converted} frozen Linears of the DiT blocks multiply in FP8 (e4m3, per-channel scales; "
            f"[train] base_matmul = \"fp8\")")
    swap = None
    if swapping:  # the swapped blocks' frozen weights stay in host memory; the rest goes to the device
        swap = WeightSwap(blocks[:swap_blocks], device, others=blocks[swap_blocks:])
        say(f"memory   {len(swap.blocks)} of {len(blocks)} DiT blocks swapped: {swap.host_bytes / GIB:.2f} "
            f"GiB of frozen weights in host memory, copied in one block at a time (they always recompute)")
        for module in (transformer, conditioner, text_encoder):
            module.to(device)
        parts.device = device
    groups, table = build_param_groups({"transformer": transformer, "text_conditioner": conditioner,
                                        "text_encoder": text_encoder}, cfg)
    for line in table.splitlines():
        say(line)
    train_conditioner = any(p.requires_grad for p in conditioner.parameters())
    train_text_encoder = any(p.requires_grad for p in text_encoder.parameters())
    # which DiT blocks recompute their activations in backward: a count, or "auto" = measured on the first step
    recomputed = recompute.parse_setting(cfg.train.gradient_checkpointing, cfg.train.checkpoint_blocks,
                                            len(blocks), device)
    block_ckpt = recompute.BlockCheckpointing(blocks, floor=len(swap.blocks) if swap is not None else 0)
    # "auto": the first step keeps the last block, whose activations it measures (recompute.py)
    block_ckpt.set_recomputed(len(blocks) - 1 if recomputed is None else recomputed)
    if recomputed is None:
        block_ckpt.measure = recompute.Measure(tokens=0)
    if block_ckpt.recomputed:
        transformer.enable_gradient_checkpointing(block_ckpt)
    if cfg.train.gradient_checkpointing and train_conditioner and hasattr(conditioner, "enable_gradient_checkpointing"):
        conditioner.enable_gradient_checkpointing()
    transformer.train()
    conditioner.train(train_conditioner)
    text_encoder.train(train_text_encoder)

    # A frozen Qwen3 is needed for a few milliseconds per step but would sit in VRAM (1.1 GiB) through the DiT's
    # forward and backward, where the peak is: park its weights in pinned host memory between steps.
    parked = ParkedWeights(text_encoder, device) if parks_qwen3(cfg, device, train_text_encoder) else None
    text_cache = None
    if cfg.dataset.cache_text_encoder_outputs:  # the config refused it with a Qwen3 that trains
        text_cache = QwenOutputs(text_encoder, parts.tokenizer, device,
                                 on_device=parked.on_device if parked is not None else nullcontext)
        say("text     Qwen3's output for each caption is kept in host memory after its first encode ([dataset] "
            "cache_text_encoder_outputs): once every caption has been seen, no step runs Qwen3")
    return Model(parts=parts, device=device, dtype=dtype, groups=groups, train_conditioner=train_conditioner,
                 train_text_encoder=train_text_encoder, block_ckpt=block_ckpt, recompute=recomputed, parked=parked,
                 text_cache=text_cache,
                 swap=swap,
                 vae=parts.vae if data.mode == "encode" else None,
                 transformer=transformer, conditioner=conditioner, text_encoder=text_encoder)


def prepare(accelerator, model: Model, optimizer, loader, scheduler):
    """accelerate.prepare: the trained models wrapped (DDP on many processes), which the step calls from now on;
    returns the prepared trainable modules, optimizer, loader and scheduler."""
    trained = model.trained()
    prepared = accelerator.prepare(*trained, optimizer, loader, scheduler)
    trainable, (optimizer, loader, scheduler) = list(prepared[: len(trained)]), prepared[len(trained):]
    model.transformer = trainable[0]
    if model.train_conditioner:
        model.conditioner = trainable[1]
    if model.train_text_encoder:
        model.text_encoder = trainable[-1]
    return trainable, optimizer, loader, scheduler
