"""`anima-train plan CFG [--vram GiB]`: the memory plan a run would choose, predicted from the config alone (no GPU,
no weights loaded), with the same decision functions the runtime's "auto" plan uses after its first step
(training/memory_plan.py).

The runtime measures four things on its first step (memory before it, its peak, the steady memory after it, one
block's activations); here each is a small model of the config, calibrated on the full-size H200 runs committed in
bench/results/caps_2026-12-02b (LoRA r32 on attention + MLP, 45,875,200 trainable parameters, AdamW, bf16, cached
1024x1024 latents = 4096 tokens per image, batch 2 / 4 / 8 under 8 / 12 / 24 GiB caps; logs A1, B1, B3, D1):

- before the first step: 4.15-4.16 GiB allocated ({"diag": "micro", "n": 0} alloc_gib) = the frozen DiT + LLM adapter
  in bf16 (3.98 GiB) + the LoRA's fp32 parameters (0.17 GiB). Qwen3 is parked in host memory then.
- the first step's growth (peak of micro 1 minus that): 2.12 GiB at 8192 tokens, 4.04 at 16384, 8.03-8.09 at 32768:
  the trainable parameters' gradients plus 2.405e-4 GiB (258,240 bytes) per token x batch (slope of b2..b8).
- after the first step: 0.40-0.41 GiB more than before it: AdamW's two fp32 states (0.34 GiB) and 0.07 GiB measured
  but not attributed (kept as a constant).
- one block's activations ({"diag": "plan"} act_gib): 0.706 GiB at 8192 tokens, 1.412 at 16384, 2.824 at 32768 =
  92,540 bytes per token x batch (45.2 bytes per token per unit of the 2048 model width).
- Qwen3-0.6B in bf16: 1.11 GiB (Qwen3 resident against parked: 5.67 vs 4.56 GiB steady, B1 against A1).

Off this configuration (other ranks, adapter kinds, optimizers, dtypes, resolutions) the terms scale with what they
count (parameters, bytes per parameter, tokens); the constants were measured only here, so the result is an estimate
there. tests/test_plan.py checks the prediction against the committed logs.

The model planned is the one at `[train] model_path`, read from its config.json files (model/shape.py: no weights).
Measured on the full-size 2B (28 blocks of width 2048) and derived for any other Anima from what its configs declare:
the frozen weights scale with the DiT's and the LLM adapter's parameter count, Qwen3's and the VAE's with theirs, a
block's weights are counted on the model's own block, a block's activations scale with the width, and the first
step's growth per token keeps each further block's input (width x 2 bytes per token in bf16) on top of the 2B's.
So the 2B's plan is the measured one and a 2.9B's (40 blocks) or the demo's tiny model's is derived.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
from dataclasses import dataclass

import torch

from anima_train import adapters
from anima_train.config import load_config
from anima_train.config.schema import Config
from anima_train.errors import UserError
from anima_train.model import tiny
from anima_train.model.shape import ModelShape, declared_shape, shape_of
from anima_train.training import recompute, weight_swap
from anima_train.training.encode_ahead import AHEAD
from anima_train.training.memory_plan import GIB, Budget, StepMemory, margin, plan_memory
from anima_train.training.memory import parks_qwen3
from anima_train.training.preflight import block_count_problems


TOKEN_PIXELS = 16  # the VAE's 8x and the DiT's 2x2 patches: one token per 16x16 pixels

# Calibration (the numbers above, from bench/results/caps_2026-12-02b A1/B1/B3/D1).
FROZEN_BYTES_BF16 = int(3.98 * GIB)  # DiT + LLM adapter weights in bf16, before the first step, less the LoRA
QWEN3_BYTES_BF16 = int(1.11 * GIB)  # Qwen3-0.6B
VAE_BYTES_BF16 = int(0.24 * GIB)  # Wan2.1 VAE (127M parameters), on the GPU only under source = "encode"
GROWTH_BYTES_PER_TOKEN = 258_240  # the first step's growth per token x batch, beyond the gradients
BLOCK_ACT_BYTES_PER_TOKEN = 92_540  # activations one DiT block keeps for its backward, per token x batch
STEADY_EXTRA_BYTES = int(0.07 * GIB)  # after the first step, beyond the optimizer state: measured, not attributed
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Optimizer state bytes per trainable parameter: AdamW two fp32 moments; the SDNQ optimizers keep quantised state
# (an estimate: 8-bit moments, or one for lion / muon).
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw8bit": 2, "adafactor": 2, "came": 2, "lion": 1, "muon": 1}
KAHAN_ADAMW_STATE_BYTES = 6  # adamw + use_kahan: bf16 moments and residual (adamw_kahan.py)

NOT_AVAILABLE = "not available in this version"

# Measured s/image of our trainer on one H200 (compiled, 1024x1024, LoRA r32, cached latents), the "auto" plan under
# a cap: (batch, blocks recomputed, recompute = "graph", base_matmul, s/image, where). tests/test_plan.py reads the
# same figures from the logs.
H200_SPEED = (
    (2, 26, False, "bf16", 0.1808, "8 GiB cap, bench/results/caps_2026-12-02b/A1"),
    (4, 26, False, "bf16", 0.1411, "12 GiB cap, bench/results/caps_2026-12-02b/B1"),
    (8, 24, False, "bf16", 0.1340, "24 GiB cap, bench/results/caps_2026-12-02b/B3"),
    (2, 27, True, "bf16", 0.1538, "8 GiB cap, bench/results/recompute_graph_2026-12-04/C2"),
    (4, 27, True, "bf16", 0.1335, "12 GiB cap, bench/results/recompute_graph_2026-12-04/A2"),
    (8, 27, True, "bf16", 0.1286, "16 GiB cap, bench/results/recompute_graph_2026-12-04/B2"),
    (8, 25, True, "bf16", 0.1269, "24 GiB cap, bench/results/recompute_graph_2026-12-04/B1"),
    (8, 0, False, "fp8", 0.0904, "no cap, bench/results/fp8_base_2026-12-04/B2"),
    (2, 27, True, "fp8", 0.1575, "8 GiB cap, bench/results/fp8_base_2026-12-04/C1"),
    (8, 25, True, "fp8", 0.1109, "24 GiB cap, bench/results/fp8_base_2026-12-04/C2"),
)
# [train] base_matmul = "fp8": the frozen Linears of one DiT block that multiply in FP8 (model/fp8_base.convertible:
# self-attention q/k/v/out, cross-attention q/out, the MLP's two; tests/test_plan.py counts them on the full-size
# block). Their two e4m3 copies take the bytes of the bf16 weight, and the measured plans and peaks under 8 and 24
# GiB were the bf16 base's (fp8_base_2026-12-04 C1, C2), so memory is counted as for bf16.
FP8_LINEARS_PER_BLOCK = 8


@dataclass
class Inputs:
    """What the runtime would measure on its first step, predicted (bytes; tokens x batch of the largest batch)."""
    tokens: int
    batch: int
    trainable: int
    start: int
    peak: int
    steady: int
    act: int
    qwen3: int  # Qwen3's weights when parked (0 when it cannot park: trained or quantised)
    estimate: list
    fp32_full_state: int = 0  # a full finetune's fp32 optimizer state (bytes; 0 otherwise): what 8-bit state saves
    swapped: int = 0  # [train] swap_blocks: blocks whose frozen weights wait in host memory
    host_bytes: int = 0  # their weights
    text_cached: bool = False  # [dataset] cache_text_encoder_outputs: Qwen3 stays parked, steps do not run it


@dataclass
class Plan:
    inputs: Inputs
    shape: ModelShape  # the model planned, as its config.json files declare it
    budget: int
    n_blocks: int
    recomputed: int
    resident: bool  # Qwen3 on the GPU
    predicted: int
    fits: bool
    auto: bool  # checkpoint_blocks = "auto" (else the config fixed the count)
    expandable: bool
    swap_fix: int | None = None  # does not fit: the fewest swap_blocks with which it would (an adapter), if any
    swap_auto: bool = False  # swap_blocks = "auto": the count was chosen here (the fewest that fit, else all)
    swap_unavailable: str | None = None  # swap_blocks = "auto" where no block can swap: why
    batch_fix: int | None = None  # does not fit: the largest smaller batch that would (the plan never changes it)
    in_graph: bool = False  # recompute = "graph" (and compiled): the recomputed blocks recompute inside the graph
    base_matmul: str = "bf16"  # [train] base_matmul: how the frozen Linears of the blocks multiply


@functools.lru_cache(maxsize=1)
def measured_shape() -> ModelShape:
    """The full-size 2B the constants were measured on, built from its configs on the meta device."""
    return shape_of(_empty_configs(tiny.CONFIGS["full"]))


def _empty_configs(configs: dict) -> dict:
    # lazy: diffusers + transformers model classes (1.9 s + 4.7 s on top of torch), as model/components.py
    from diffusers import AutoencoderKLQwenImage, CosmosTransformer3DModel
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    from transformers import Qwen3Config, Qwen3Model

    with torch.device("meta"):
        return {"transformer": CosmosTransformer3DModel(**configs["transformer"]),
                "text_conditioner": AnimaTextConditioner(**configs["text_conditioner"]),
                "text_encoder": Qwen3Model(Qwen3Config(**configs["text_encoder"])),
                "vae": AutoencoderKLQwenImage(**configs["vae"])}


def largest_batch(cfg: Config) -> tuple[int, int]:
    """(tokens x batch, batch) of the largest batch the tiers allow (a bucket's area is at most its tier's)."""
    sizes = cfg.train.batch_size
    best = (0, 0)
    for tier in cfg.dataset.tiers:
        batch = int(sizes if isinstance(sizes, int) else sizes.get(tier, max(sizes.values())))
        tokens = (tier // TOKEN_PIXELS) ** 2 * batch
        best = max(best, (tokens, batch))
    return best


def predict_inputs(cfg: Config, shape: ModelShape, swapped: int | None = None,
                   largest: tuple[int, int] | None = None) -> Inputs:
    """`swapped`: the blocks whose weights swap (default: the config's count; "auto" is decided by make_plan);
    `largest`: (tokens x batch, batch) of the largest batch (default: what the config's tiers allow)."""
    estimate = []
    dtype = DTYPE_BYTES[cfg.train.dtype]
    weight_scale = dtype / 2
    ref = measured_shape()
    width = shape.width / ref.width
    if shape != ref:
        estimate.append(f"a model of {shape.blocks} blocks of width {shape.width}: the memory terms were measured on "
                        f"the 2B ({ref.blocks} blocks of width {ref.width}) and scaled by this model's parameter "
                        "counts, width and blocks")
    frozen = int(FROZEN_BYTES_BF16 * weight_scale * (shape.dit_parameters + shape.conditioner_parameters)
                 / (ref.dit_parameters + ref.conditioner_parameters))
    method = adapters.method(cfg.adapter.kind)
    full = method.trains_base
    if full:
        trainable, trainable_bytes = frozen // 2 if dtype == 2 else frozen // 4, dtype
        frozen = 0
        estimate.append("full finetune: measured with a LoRA only")
    else:
        trainable, trainable_bytes = shape.blocks * sum(method.parameters(cfg.adapter, i, o)
                                                        for i, o in shape.adapted_linears), 4
    if cfg.quant.mode != "none":
        estimate.append("quantised DiT: weights counted unquantised (the prediction is high)")
    if cfg.optimizer.kind != "adamw":
        estimate.append(f"{cfg.optimizer.kind}: optimizer state estimated")
    if cfg.train.dtype != "bfloat16":
        estimate.append(f"{cfg.train.dtype}: measured in bfloat16 only")
    if cfg.train.base_matmul == "fp8":
        estimate.append("base_matmul = \"fp8\": memory counted as the bf16 base's (H200: the same plans under 8 and 24 "
                        "GiB, peaks 0.13 GiB higher and 0.24 lower)")
    tokens, batch = largest_batch(cfg) if largest is None else largest
    start = frozen + trainable * trainable_bytes
    if swapped is None:
        swapped = 0 if isinstance(cfg.train.swap_blocks, str) else cfg.train.swap_blocks
    swapped = 0 if full else min(swapped, shape.blocks)
    host_bytes = swapped * shape.block_parameters * dtype
    if swapped:  # on the GPU: the placeholders, and the blocks running (training/weight_swap.py)
        start -= host_bytes - min(swapped, weight_swap.RESIDENT_SLOTS) * shape.block_parameters * dtype
        estimate.append(f"swap_blocks = {swapped}: counted as the resident model less the swapped weights but one "
                        "block's (H200: 6 GiB batch 1 swap 4 predicted 5.3, measured 5.28; 8 GiB batch 4 swap 12: "
                        "7.3, 7.13)")
    if cfg.dataset.source == "encode":
        start += int(VAE_BYTES_BF16 * weight_scale * shape.vae_parameters / ref.vae_parameters)
    # each block beyond the 2B's keeps its input, [tokens, width], for the backward
    growth_per_token = GROWTH_BYTES_PER_TOKEN * width + (shape.blocks - ref.blocks) * shape.width * 2
    growth = trainable * trainable_bytes + int(tokens * growth_per_token * weight_scale)
    state_bytes = OPTIMIZER_STATE_BYTES[cfg.optimizer.kind]
    if cfg.optimizer.kind == "adamw" and cfg.optimizer.use_kahan:
        state_bytes = KAHAN_ADAMW_STATE_BYTES
    steady = start + trainable * state_bytes + STEADY_EXTRA_BYTES
    act = int(tokens * BLOCK_ACT_BYTES_PER_TOKEN * width * weight_scale)
    parks = parks_qwen3(cfg, torch.device("cuda"), cfg.adapter.train_text_encoder)  # the plan is a CUDA run's
    qwen3 = int(QWEN3_BYTES_BF16 * weight_scale * shape.text_encoder_parameters / ref.text_encoder_parameters)
    if not parks:
        start, steady = start + qwen3, steady + qwen3
        qwen3 = 0
    fp32_state = full and cfg.optimizer.kind == "adamw" and not cfg.optimizer.use_kahan
    fp32_full_state = trainable * OPTIMIZER_STATE_BYTES["adamw"] if fp32_state else 0
    return Inputs(tokens=tokens, batch=batch, trainable=trainable, start=start, peak=start + growth, steady=steady,
                  act=act, qwen3=qwen3, estimate=estimate, fp32_full_state=fp32_full_state, swapped=swapped,
                  host_bytes=host_bytes, text_cached=cfg.dataset.cache_text_encoder_outputs)


def expandable_segments_default() -> bool:
    """What the runtime's CUDA allocator will use (memory.use_expandable_segments): on Linux unless the user set it."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    if conf is not None:
        return "expandable_segments:true" in conf.replace(" ", "").lower() and sys.platform.startswith("linux")
    return sys.platform.startswith("linux")


def swap_unavailable(cfg: Config, whole_trunk_compiled: bool | None = None) -> str | None:
    """Why no block's frozen weights can swap under `cfg` (None: they can), the conditions config/rules.py refuses
    an explicit swap_blocks count for: where they hold, swap_blocks = "auto" swaps none. `whole_trunk_compiled`:
    the run's compile decision (None: the config's, where compile = "auto" may compile)."""
    t = cfg.train
    whole_trunk = (not t.compile_regional and t.compile != "off") if whole_trunk_compiled is None \
        else whole_trunk_compiled
    method = adapters.method(cfg.adapter.kind)
    if method.trains_base:
        return "a full finetune trains the frozen weights"
    if adapters.base_refusals(cfg.adapter, adapters.BaseFacts(matmul=t.base_matmul, swap_blocks=1)):
        return f"a {cfg.adapter.kind} needs the base weights on the GPU"
    if cfg.quant.mode != "none":
        return "the base is quantized ([quant] mode)"
    if not t.gradient_checkpointing:
        return "gradient_checkpointing = false (a swapped block recomputes)"
    if whole_trunk:
        return "compile_regional = false compiles the whole trunk"
    return None


def make_plan(cfg: Config, budget: int, expandable: bool | None = None, *, look_for_swap: bool = True,
              shape: ModelShape | None = None, largest: tuple[int, int] | None = None,
              whole_trunk_compiled: bool | None = None, look_for_batch: bool = True) -> Plan:
    """The plan the runtime would choose under `budget` bytes for the model at `[train] model_path` (or `shape`),
    from the predicted first-step measurements. `[train] swap_blocks = "auto"` swaps the fewest blocks with which
    the step fits (every block where none does; none where no block can swap: swap_unavailable), as the run does
    before its model loads (training/swap_plan.py). When it does not fit, also the fewest `swap_blocks` with which
    it would (a count the config fixed, an adapter), and the largest smaller batch with which it would.
    `largest`: (tokens x batch, batch) of the largest batch, when known better than the config's tiers say."""
    shape = declared_shape(cfg.train.model_path) if shape is None else shape
    expandable = expandable_segments_default() if expandable is None else expandable
    setting = cfg.train.swap_blocks
    if setting == "auto":
        unavailable = swap_unavailable(cfg, whole_trunk_compiled)
        for count in [0] if unavailable else range(shape.blocks + 1):
            plan = _plan_with(cfg, budget, expandable, shape, count, largest)
            if plan.fits:
                break
        plan.swap_auto, plan.swap_unavailable = True, unavailable
    else:
        plan = _plan_with(cfg, budget, expandable, shape, setting, largest)
        if not plan.fits and look_for_swap and swap_unavailable(cfg, whole_trunk_compiled) is None:
            plan.swap_fix = next((count for count in range(plan.inputs.swapped + 1, shape.blocks + 1)
                                  if _plan_with(cfg, budget, expandable, shape, count, largest).fits), None)
    if not plan.fits and look_for_batch:
        for batch in range(plan.inputs.batch - 1, 0, -1):
            trial = copy.deepcopy(cfg)
            trial.train.batch_size = batch
            smaller = None if largest is None else (largest[0] * batch // largest[1], batch)
            if make_plan(trial, budget, expandable, look_for_swap=False, shape=shape, largest=smaller,
                         whole_trunk_compiled=whole_trunk_compiled, look_for_batch=False).fits:
                plan.batch_fix = batch
                break
    return plan


def _plan_with(cfg: Config, budget: int, expandable: bool, shape: ModelShape, swapped: int,
               largest: tuple[int, int] | None) -> Plan:
    """The plan with `swapped` blocks' weights in host memory."""
    n_blocks = shape.blocks
    inputs = predict_inputs(cfg, shape, swapped, largest)
    setting = recompute.parse_setting(cfg.train.gradient_checkpointing, cfg.train.checkpoint_blocks, n_blocks,
                                      torch.device("cuda"))
    # "auto" compiles a long run on CUDA, which plans are for
    in_graph = recompute.in_graph_applies(cfg.train, compiled=cfg.train.compile != "off")
    # the runtime's plan of the predicted first step; a fixed count is kept as it is (the runtime makes no plan and
    # Qwen3 stays parked); the swapped blocks always recompute whole
    chosen = plan_memory(StepMemory(act=inputs.act, peak=inputs.peak, steady=inputs.steady, start=inputs.start),
                         Budget(budget, expandable), n_blocks=n_blocks - inputs.swapped,
                         parked_bytes=0 if inputs.text_cached else inputs.qwen3,
                         in_graph=in_graph,
                         keep=None if setting is None else min(n_blocks - setting, n_blocks - inputs.swapped))
    return Plan(inputs=inputs, shape=shape, budget=budget, n_blocks=n_blocks, recomputed=n_blocks - chosen.keep,
                resident=chosen.resident, predicted=chosen.predicted, fits=chosen.fits, auto=setting is None,
                expandable=expandable, in_graph=chosen.in_graph and chosen.keep < n_blocks - inputs.swapped,
                base_matmul=cfg.train.base_matmul)


def step_time_class(plan: Plan) -> str:
    if plan.recomputed == 0:
        kind = "no recompute (fastest)"
    elif plan.recomputed == plan.n_blocks:
        kind = "all blocks recompute (slowest: about a third more compute per step)"
    else:
        kind = f"partial: {plan.recomputed} of {plan.n_blocks} blocks recompute"
    batch, recomputed, in_graph, base, s_per_image, where = min(
        H200_SPEED, key=lambda row: (row[3] != plan.base_matmul, row[2] != plan.in_graph,
                                     abs(row[0] - plan.inputs.batch), abs(row[1] - plan.recomputed)))
    return (f"{kind}; nearest H200 measurement: batch {batch}, {recomputed} of {measured_shape().blocks} recomputed"
            f"{' in the compiled graph' if in_graph else ''}{', FP8 base' if base == 'fp8' else ''}, "
            f"{s_per_image:.4f} s/image ({where}; the 2B on an H200, not your model on your card)")


def weights_text(plan: Plan) -> str:
    """Where the frozen blocks' weights are, and who chose it."""
    i = plan.inputs
    how = ""
    if plan.swap_auto:
        why = (f"no block can swap: {plan.swap_unavailable}" if plan.swap_unavailable
               else "the resident model fits" if plan.fits and not i.swapped
               else "the fewest with which the step fits, decided before the model loads" if plan.fits
               else "none fits, so every block")
        how = f'[train] swap_blocks = "auto": {why}'
    if i.swapped:
        return (f"{i.swapped} blocks swapped ({i.host_bytes / GIB:.2f} GiB in host memory, copied to the GPU one "
                f"block at a time)" + (f"; {how}" if how else ""))
    return "all on the GPU (" + (how or "[train] swap_blocks = 0") + ")"


def peak_text(plan: Plan) -> str:
    """The predicted peak against the budget, with the margin the plan keeps free: '7.1 of 8.0 GiB, with 0.5 GiB
    kept free ...: 0.4 GiB to spare'."""
    kept = margin(plan.budget, plan.expandable)
    room = plan.budget - kept - plan.predicted
    return (f"{plan.predicted / GIB:.1f} of {plan.budget / GIB:.1f} GiB, with {kept / GIB:.1f} GiB kept free "
            f"(allocator{' fragmentation' if not plan.expandable else ''}, GPU libraries' workspaces): "
            f"{(plan.budget - kept) / GIB:.1f} GiB usable, {abs(room) / GIB:.1f} GiB "
            + ("to spare" if room >= 0 else "too much"))


def batch_fix_text(plan: Plan) -> str:
    return (f"[train] batch_size = {plan.batch_fix} (predicted; a smaller batch changes the training, so the run "
            f"keeps the batch the config asks)")


def qwen3_text(plan: Plan) -> str:
    """Where Qwen3 waits during the steps, as the run will place it."""
    i = plan.inputs
    if plan.resident:
        return "on the GPU (resident)"
    if not i.qwen3:
        return "on the GPU (trained or quantised: it cannot park)" + ("; its outputs cached" if i.text_cached else "")
    if i.text_cached:
        return ("in host memory, copied to the GPU only to encode a caption the first time (its outputs cached: "
                "[dataset] cache_text_encoder_outputs)")
    return f"in host memory, copied to the GPU once per {AHEAD} micro-batches to encode their captions (parked)"


def render(plan: Plan, cfg_name: str) -> str:
    gib = GIB
    i = plan.inputs
    keep = plan.n_blocks - plan.recomputed
    lines = [
        f"plan for {cfg_name} under {plan.budget / gib:.1f} GiB "
        + ("(auto: the runtime decides the same way after its first step)" if plan.auto
           else "(count fixed by the config)"),
        f"  model              {plan.shape.describe()} (its config.json files)",
        f"  largest batch      {i.batch} image(s), {i.tokens} tokens; {i.trainable:,} trainable parameters",
        f"  steady memory      {i.steady / gib:.2f} GiB (weights, trainable parameters, optimizer state)"
        + (f" + Qwen3 {i.qwen3 / gib:.2f} GiB" if plan.resident else ""),
        f"  a block keeps      {i.act / gib:.2f} GiB of activations when it does not recompute",
        "",
        "  block   activations                  offloaded   saved selectively   weights",
    ]
    for index in range(plan.n_blocks):
        kept = index >= plan.recomputed  # the first blocks recompute, the last ones keep (recompute.set_recomputed)
        weights = "swapped" if index < i.swapped else "resident"
        how = "kept" if kept else ("recomputed in compiled graph" if plan.in_graph and index >= i.swapped
                                   else "recomputed in backward")
        lines.append(f"  {index:>5}   {how:<28} {'-':<11} {'-':<19} {weights}")
    lines += [
        f"  summary: {plan.recomputed} of {plan.n_blocks} blocks recompute, {keep} keep their activations"
        + (" (recompute = \"graph\": inside the compiled backward" + (", the swapped ones whole)" if i.swapped else ")")
           if plan.in_graph else ""),
        f"  offload / selective saving: {NOT_AVAILABLE}",
        "  frozen base: " + (f"FP8, {FP8_LINEARS_PER_BLOCK * plan.n_blocks} Linears of the blocks (e4m3 copies, the "
                             "bf16 weight's bytes; a GPU of compute capability 8.9 or newer)"
                             if plan.base_matmul == "fp8" else "bf16 ([train] base_matmul = \"bf16\")"),
        "  weights: " + weights_text(plan),
        "  Qwen3 text encoder: " + qwen3_text(plan),
        f"  predicted peak: {peak_text(plan)}",
        f"  step time: {step_time_class(plan) if plan.fits else 'none: the step does not fit'}",
    ]
    lines += [f"  estimate: {e}" for e in i.estimate]
    if not plan.fits:
        every = ", every block's weights in host memory" if plan.swap_auto and i.swapped == plan.n_blocks else ""
        lines.append(f"  DOES NOT FIT: even with every block recomputing{every} and Qwen3 parked the step needs about "
                     f"{plan.predicted / gib:.1f} GiB; lower [train] batch_size or [dataset] resolution "
                     f"(activations grow with images x pixels), or use a card with more memory")
        if plan.batch_fix is not None:
            lines.append(f"  a smaller batch would fit: {batch_fix_text(plan)}")
        if plan.swap_fix is not None:
            lines.append(f"  or keep frozen weights in host memory: [train] swap_blocks = {plan.swap_fix} would fit "
                         "(predicted; each swapped block is copied in twice per step; swap_blocks = \"auto\", the "
                         "default, chooses the count itself)")
        if i.fp32_full_state:
            # measured under a 24 GiB cap on an H200, batch 4, 1024²: bench/results/fullkahan24_2026-12-03 (L2),
            # bench/results/fullft24_2026-12-03
            lines.append(f"  a full finetune's AdamW state alone is {i.fp32_full_state / gib:.1f} GiB in fp32 "
                         "(with its fp32 master weights): [optimizer] use_kahan = true keeps bf16 moments and a "
                         "residual instead (21.3 GiB peak at batch 4, 0.165 s/image); kind = \"adamw8bit\", "
                         "quantize_state = true, use_kahan = true keeps 8-bit moments (17.2 GiB, but half as fast)")
    return "\n".join(lines)


MAX_VRAM_GIB = 1e6  # far above any card, far below where the byte count stops being a finite number


def add_arguments(parser) -> None:
    parser.add_argument("config", help="the training config (TOML)")
    parser.add_argument("--vram", type=float, default=None, metavar="GiB",
                        help="memory budget in GiB (default: the visible CUDA GPU's total memory; the run itself "
                             "plans with what is free then, less if another program holds part of the card)")


def visible_gpu_bytes() -> int | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.mem_get_info(0)[1]


def run(args) -> int:
    cfg = load_config(args.config)
    if args.vram is not None:
        if not 0 < args.vram <= MAX_VRAM_GIB:  # also nan and inf
            raise UserError(f"--vram {args.vram:g}: give the card's memory in GiB, a number above 0 and at most "
                            f"{MAX_VRAM_GIB:g} (e.g. --vram 12)")
        budget = int(args.vram * GIB)
    else:
        budget = visible_gpu_bytes()
        if budget is None:
            raise UserError("no CUDA GPU is visible here: give the card's memory with --vram GiB (e.g. --vram 12)")
    shape = declared_shape(cfg.train.model_path)
    problems = block_count_problems(cfg, shape.blocks)
    if problems:
        raise UserError("\n".join(problems))
    plan = make_plan(cfg, budget, shape=shape)
    print(render(plan, str(args.config)))
    return 0
