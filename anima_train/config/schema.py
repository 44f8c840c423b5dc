"""The config's tables: one dataclass per TOML table, one field per key.

Every key is a field whose metadata carries a one-line `help`, its `choices` when it is an enum, its numeric
bounds (`ge`/`gt`/`le`/`lt`), and `path=True` when its value names a file or folder of this machine (a shared
checkpoint records only its last part), so the checks (validate.py), the CLI, the ComfyUI node inputs and
docs/config.md are all generated from it (`iter_fields`). Each table class is `@section` (the Config `@root`):
building one checks it, see validate.py. No torch here: this module is imported by the CLI's `--help` and by
ComfyUI at start-up.
"""

from __future__ import annotations

import dataclasses
import os
import re
import unicodedata
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, NamedTuple, Sequence

from anima_train import adapters
from anima_train.config.constants import (CAPTION_MODES, CAPTION_VARIANTS, DEFAULT_MODEL_PATH, DIT_COMPONENTS,
                                          DTYPE_NAMES, LORA_FORMATS, MAX_LEARNING_RATE, MAX_RANK, MAX_REPEATS,
                                          MODEL_PATH_ENV, SAMPLE_SHIFT, SDNQ_OPTIMIZERS, TIER_COLLAPSE_MODES)
from anima_train.config.keys import field_default, hints, is_key
from anima_train.config.validate import array_tables, root, section, tables


_LR_HINT = "LoRAs train at about 1e-4, Prodigy-style optimizers at 1.0"


def _key(default: Any = MISSING, *, help: str, factory: Any = MISSING, choices: tuple | None = None,
         ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
         hint: str = "", nonempty: bool = False, type_desc: str = "", **extra: Any) -> Any:
    """A config key: a dataclass field with the metadata the loader and the generators read."""
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt, "hint": hint,
            "nonempty": nonempty, "type_desc": type_desc, **extra}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _lr_key(default: float | None, *, help: str, gt: float | None = None) -> Any:
    """A learning rate (or a multiplier of one): at least 0 (or above `gt`), at most MAX_LEARNING_RATE."""
    return _key(default, ge=None if gt is not None else 0.0, gt=gt, le=MAX_LEARNING_RATE, hint=_LR_HINT, help=help)


def _table(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help, "table": cls})


def _array(cls: type, help: str) -> Any:
    return field(default_factory=list, metadata={"help": help, "array": cls})


def _default_model_path() -> str:
    # The environment changes the *default* only; a model_path written in the config always wins.
    return os.environ.get(MODEL_PATH_ENV) or DEFAULT_MODEL_PATH


# --------------------------------------------------------------------------------------------------- tables


@section
@dataclass
class TrainConfig:
    model_path: str = _key(factory=_default_model_path, nonempty=True, env=MODEL_PATH_ENV, path=True,
                           help="converted diffusers repo (incl. tokenizer/, t5_tokenizer/); env ANIMA_MODEL "
                                "overrides the default")
    output_dir: str = _key("output", nonempty=True, path=True, help="runs are written to <output_dir>/<run_name>/")
    run_name: str = _key("anima", help="stem of every output file (sanitised)")
    epochs: int = _key(1, ge=1, help="passes over the dataset")
    max_steps: int | None = _key(None, ge=1, help="optimizer steps: schedule horizon and hard stop")
    batch_size: int | dict[int, int] = _key(
        1, help="micro-batch per process: one number, or one per tier { 768 = 16, 1024 = 12 }",
        type_desc="an integer or a table of integers keyed by tier (e.g. { 768 = 16, 1024 = 12 })")
    gradient_accumulation_steps: int = _key(1, ge=1, help="micro-batches per optimizer step")
    gradient_checkpointing: bool = _key(True, help="recompute activations in backward to save memory")
    checkpoint_blocks: int | str = _key(
        "auto", ge=0, help="with gradient_checkpointing: DiT blocks that recompute: auto = the fewest that fit the "
        "card (measured on the first step; all off CUDA), all, or a number",
        type_desc='"auto", "all" or an integer >= 0')
    recompute: str = _key(
        "graph", choices=("graph", "block"),
        help="how a recomputed block recomputes: graph = inside its compiled backward (regionally compiled runs; "
        "faster; the same numbers as block, since compiled runs round bf16 results where eager does); block = its "
        "whole forward again (what eager or whole-trunk compiled runs do either way)")
    swap_blocks: int | str = _key(
        "auto", ge=0, help="an adapter on a small card: the frozen weights of the first N DiT blocks stay in host "
        "memory and are copied to the GPU one block at a time (these blocks always recompute): auto = the fewest "
        "with which the step fits the card (predicted before the model loads; none off CUDA, or where blocks "
        "cannot swap), a number, or 0 = all weights on the GPU",
        type_desc='"auto" or an integer >= 0')
    dtype: str = _key("bfloat16", choices=DTYPE_NAMES,
                      help="the only precision control: modules load in this dtype")
    base_matmul: str = _key(
        "bf16", choices=("bf16", "fp8"),
        help="an adapter's frozen DiT Linears multiply in: bf16 = the weights as loaded (exact); fp8 = FP8 copies "
        "with per-channel scales and FP8 GEMMs, faster on GPUs of compute capability 8.9+ (RTX 40xx, Hopper, "
        "Blackwell); the frozen path is approximate (about 4 % per layer), the adapter trains in bf16")
    seed: int = _key(42, ge=0, help="seeds batch sampler, caption RNG, noise and timesteps")
    num_workers: int = _key(2, ge=0, help="data-loader worker processes (started once per run, kept across epochs)")
    vae_encode_chunk: int = _key(1, ge=1, help="images per VAE forward under source = \"encode\"")
    save_every_steps: int | None = _key(None, ge=1, help="periodic checkpoint every N optimizer steps")
    save_every_epochs: int = _key(1, ge=0, help="periodic checkpoint every N epochs (0 = none)")
    save_native: bool = _key(True, help="full finetune: native single file; false = diffusers folders")
    save_optimizer_state: bool = _key(False, help="also write <stem>-state/ (required to resume)")
    save_state_on_stop: bool = _key(True, help="a stop (Cancel, the stop file, ComfyUI or the console closing) "
                                               "writes <stem>-state/ too, so the run resumes; false skips it "
                                               "(a full finetune's state is large)")
    keep_last_n: int | None = _key(None, ge=1, help="prune older periodic checkpoints, keeping the newest N")
    resume_from: str | None = _key(None, nonempty=True, path=True,
                                   help="checkpoint file or its -state folder to resume")
    skip_final_save: bool = _key(False, help="do not write the final checkpoint (benchmarking only)")
    allow_multi_gpu_texture: bool = _key(False, help="allow texture phases on more than one process")
    log_every: int = _key(1, ge=1, help="report cadence in optimizer steps")
    progress: str = _key("auto", choices=("auto", "bar", "plain", "off"),
                         help="auto = bar on a terminal, plain line otherwise")
    compile: str = _key("auto", choices=("auto", "off", "default", "reduce-overhead", "max-autotune",
                                         "max-autotune-no-cudagraphs"),
                        help="torch.compile mode; auto = \"default\" on CUDA with Triton for runs of 200+ steps, "
                             "else eager; off = eager")
    compile_dynamic: bool = _key(True, help="compile with dynamic shapes (recompile limit 32)")
    compile_regional: bool = _key(True, help="compile the repeated block once, not the whole trunk")


@section
@dataclass
class SubsetConfig:
    path: str = _key(MISSING, nonempty=True, path=True, help="source directory")
    num_repeats: int = _key(1, ge=1, le=MAX_REPEATS, help="repeat this subset's entries N times per epoch")
    texture: bool = _key(True, help="false = always full-resolution with its captions, even in texture phases")


@section
@dataclass
class CaptionConfig:
    caption_mode: str = _key("tags", choices=CAPTION_MODES,
                             help="which caption variant to train on")
    mixed_weights: dict[str, float] = _key(
        factory=lambda: {v: 1.0 for v in CAPTION_VARIANTS}, choices=CAPTION_VARIANTS,
        help="relative weights of tags, nl, tags_nl, nl_tags under caption_mode = \"mixed\" (omitted = 0)",
        type_desc="a table of numbers (e.g. { tags = 2, nl = 1 })")
    shuffle_tags: bool = _key(False, help="shuffle the unpinned tags")
    shuffle_keep_first_n: int = _key(0, ge=0, help="first N tags are pinned (never shuffled or dropped)")
    tag_dropout_percent: float = _key(0.0, ge=0.0, le=1.0, help="fraction of droppable tags removed (0..1)",
                                      hint="it is a fraction despite the name: 0.1 means 10%")
    caption_dropout_percent: float = _key(0.0, ge=0.0, le=1.0, help="probability the caption is empty (0..1)",
                                          hint="it is a fraction despite the name: 0.05 means 5%")
    min_tags_kept: int = _key(3, ge=0, help="tag dropout never leaves fewer tags than this")
    tag_delimiter: str = _key(", ", help="separator between tags")
    protected_tags: list[str] = _key(factory=list, help="tags never dropped (case-insensitive)")
    protected_tags_file: str | None = _key(
        None, nonempty=True, path=True,
        help="file of protected tags, one per line, # comments; relative to the config's folder")
    nl_shuffle_sentences: bool = _key(False, help="shuffle natural-language sentences")
    nl_keep_first_sentence: bool = _key(True, help="keep the first sentence in place when shuffling")
    # Not a key: the lower-cased tags read from protected_tags_file at load.
    file_protected_tags: list[str] = field(default_factory=list, compare=False, repr=False,
                                           metadata={"key": False})

    def protected_tag_set(self) -> frozenset[str]:
        """All protected tags, lower-cased: the inline list plus the file's."""
        return frozenset(t.strip().lower() for t in self.protected_tags) | frozenset(self.file_protected_tags)


def _default_canvases() -> list[list[int]]:
    # 5 shapes; the square is listed twice so it is drawn 1/3 of the time (duplicates are weights).
    return [[640, 1536], [1536, 640], [832, 1216], [1216, 832], [1024, 1024], [1024, 1024]]


@section
@dataclass
class TextureConfig:
    canvases: list[list[int]] = _key(factory=_default_canvases,
                                     help="[w, h] crop canvases, duplicates are weights; one per batch")
    trigger: str = _key("", help="sole caption of texture crops (\"\" = unconditional)")
    oversize: str = _key("pad", choices=("pad", "cover", "skip"),
                         help="a source smaller than the canvas beyond cover_max_scale: pad (rungs 3-4), cover "
                              "(upscale), skip (covered too: a batch must stack)")
    fit_aware: bool = _key(True, help="draw the batch canvas from those its images can hold")
    cover_max_scale: float = _key(1.15, ge=1.0, help="max gentle upscale before padding; 1.0 disables")
    pad_mode: str = _key("reflect", choices=("reflect", "black"), help="how padding pixels are invented")
    mask_padding: bool = _key(True, help="invented pixels carry no loss")
    mask_ratio: list[float] = _key(factory=lambda: [0.5, 1.0],
                                   help="[lo, hi] supervised sub-region, fraction of canvas side")
    feather_latent_px: int = _key(4, ge=0, help="cosine taper of the loss mask, latent px")
    energy_power: float = _key(1.0, ge=0.0, help="crop position ~ detail^power; 0 = uniform")
    energy_downscale: int = _key(8, ge=1, help="energy map averaging factor")


@section
@dataclass
class DatasetConfig:
    path: str | None = _key(None, nonempty=True, path=True, help="single source directory (or use [[dataset.subsets]])")
    subsets: list[SubsetConfig] = _array(SubsetConfig, "several source directories")
    resolution: int = _key(1024, gt=0, help="area budget (about r x r pixels), not a side length")
    resolutions: list[int] | None = _key(None, help="several area budgets (tiers); unset = [resolution]")
    tier_collapse: str = _key("dedup", choices=TIER_COLLAPSE_MODES,
                              help="a tier above a source's size: keep one entry (dedup) or all (repeat)")
    min_source_area: float = _key(0.0, ge=0.0, help="drop sources with w*h < value * (smallest tier)^2")
    min_bucket_reso: int = _key(256, gt=0, help="smallest bucket side (inert when bucket_no_upscale)")
    max_bucket_reso: int = _key(1920, gt=0, help="per-side cap of every bucket")
    bucket_reso_steps: int = _key(64, gt=0, help="bucket sides are multiples of this (a multiple of 16)")
    bucket_no_upscale: bool = _key(True, help="never enlarge a source (changing it invalidates caches)")
    multires_training: bool = _key(False, help="area tie-break among equal aspect ratios (upscale branch)")
    num_repeats: int = _key(1, ge=1, le=MAX_REPEATS, help="repeat factor of the single-path form")
    source: str = _key("auto", choices=("images", "latents", "encode", "auto"),
                       help="auto: the latent caches when every image has a valid one, else every image encoded "
                            "in the loop (the start-up report says which); images: cached latents, a missing or "
                            "stale cache refused; latents: caches only; encode: the VAE in the loop")
    cache_text_encoder_outputs: bool = _key(
        False, help="keep Qwen3's output for each caption in host memory after its first encode (each caption "
                    "encoded alone), so later steps neither run Qwen3 nor copy it to the GPU; needs captions that "
                    "do not change between epochs (no tag shuffle or tag dropout; caption dropout is fine)")
    caption: CaptionConfig = _table(CaptionConfig, "caption handling")
    texture: TextureConfig = _table(TextureConfig, "texture-mode crops, read only when a [[curriculum]] phase has "
                                                   "mode = \"texture\" (which needs source = \"encode\")")

    @property
    def tiers(self) -> list[int]:
        """The declared area budgets, ascending."""
        return list(self.resolutions) if self.resolutions is not None else [self.resolution]

    def resolved_subsets(self) -> list[SubsetConfig]:
        """The single-path form is one subset with the top-level num_repeats and texture = true."""
        if self.path is not None:
            return [SubsetConfig(path=self.path, num_repeats=self.num_repeats, texture=True)]
        return list(self.subsets)


@section
@dataclass
class FlowConfig:
    timestep_sample_method: str = _key("logit_normal", choices=("logit_normal", "uniform"),
                                       help="logit_normal (t = sigmoid(scale * N(0,1))) or uniform")
    sigmoid_scale: float = _key(1.0, gt=0.0, help="logistic width; > 1 widens toward both ends")
    shift: float | None = _key(None, gt=0.0, help="static shift t' = t*s/(1+(s-1)t); 3.0 = inference default",
                               hint="0 sends every t to 0 and the loss pins at 1.0; omit the key for no shift")
    flux_shift: bool = _key(False, help="resolution-dependent shift")
    use_ot: bool = _key(False, help="optimal-transport noise pairing within a micro-batch")
    phase_mapping: str = _key("rescale", choices=("rescale", "truncate"),
                              help="how a curriculum phase's t_range applies")
    hf_scale: float = _key(0.0, ge=0.0, help="high-frequency token loss weight; 0 = off")
    hf_exponent: float = _key(1.0, gt=0.0, help="concentration of that loss on detailed tokens")


@section
@dataclass
class OptimizerConfig:
    kind: str = _key("adamw", choices=("adamw",) + SDNQ_OPTIMIZERS,
                     help="adamw (torch, fp32 moments) or an SDNQ optimizer")
    lr: float = _lr_key(1e-5, gt=0.0, help="peak LR for groups without a component_lr")
    betas: list[float] = _key(factory=lambda: [0.9, 0.95], help="2 values; 3 for came")
    eps: float = _key(1e-8, gt=0.0, help="denominator epsilon")
    weight_decay: float = _key(0.01, ge=0.0, help="decoupled weight decay, per param group")
    max_grad_norm: float = _key(1.0, ge=0.0, help="gradient clip on sync steps; 0 disables")
    quantize_state: bool = _key(False, help="SDNQ only: uint8 optimizer state (~4x smaller)")
    offload_state: bool = _key(False, help="SDNQ only: optimizer state in pinned host RAM")
    use_kahan: bool = _key(False, help="a bf16 Kahan residual instead of fp32 master weights (less memory); with "
                                          "adamw also bf16 moments: the lean full finetune")


@section
@dataclass
class ScheduleConfig:
    kind: str = _key("constant", choices=("constant", "linear", "cosine", "rex", "rerex"),
                     help="LR multiplier curve after warmup")
    warmup_steps: int = _key(0, ge=0, help="linear warmup, optimizer steps")
    min_lr_ratio: float = _key(0.0, ge=0.0, lt=1.0, help="floor, fraction of each group's peak LR")
    d: float = _key(0.9, ge=0.0, lt=1.0, help="REX curvature; 0 = linear", hint="d = 1 makes REX 0/0")
    global_d: float = _key(0.78, ge=0.0, lt=1.0, help="ReREX outer curve d")
    local_d: float = _key(0.85, ge=0.0, lt=1.0, help="ReREX within-segment d")
    weight_power: float = _key(1.5, ge=0.0, help="ReREX budget skew to early segments; 0 = equal")
    num_segments: int = _key(8, ge=1, help="ReREX segments")


@section
@dataclass
class ComponentLRConfig:
    self_attn: float | None = _lr_key(None, help="LR of self-attention (attn1); unset = optimizer.lr")
    cross_attn: float | None = _lr_key(None, help="LR of cross-attention (attn2); unset = optimizer.lr")
    mlp: float | None = _lr_key(None, help="LR of the MLP (ff); unset = optimizer.lr")
    adaln: float = _lr_key(0.0, help="LR of the adaLN modulation; 0 = frozen")
    base: float = _lr_key(0.0, help="LR of the in/out projections; 0 = frozen")
    llm_adapter: float = _lr_key(0.0, help="LR of the LLM adapter (text conditioner); 0 = frozen")
    text_encoder: float | None = _lr_key(None, help="LR of the Qwen3 LoRA; unset = optimizer.lr")


@section
@dataclass
class AdapterConfig:
    kind: str = _key("lora", choices=adapters.kinds(), help=adapters.kind_help())
    rank: int = _key(32, ge=1, le=MAX_RANK, help="adapter rank")
    alpha: float = _key(32.0, gt=0.0, help="scale alpha/rank (alpha = rank keeps the LR rank-independent)")
    dropout: float = _key(0.0, ge=0.0, lt=1.0, help=adapters.dropout_help())
    components: list[str] = _key(factory=lambda: ["self_attn", "cross_attn", "mlp"], choices=DIT_COMPONENTS,
                                 help="DiT parts that get an adapter")
    train_llm_adapter: bool = _key(False, help="also adapt the LLM adapter (text conditioner)")
    train_text_encoder: bool = _key(False, help="LoRA on Qwen3, exported to a _te file")
    text_encoder_rank: int | None = _key(None, ge=1, le=MAX_RANK, help="rank of the Qwen3 LoRA (unset = rank)")
    lokr_factor: int = _key(-1, help="LoKr only: Kronecker factor; -1 = most balanced")
    lokr_decompose_both: bool = _key(False, help="LoKr only: decompose both Kronecker factors")
    output_format: str = _key("peft", choices=LORA_FORMATS,
                              help="LoRA file layout: peft = diffusion_model.*.lora_A/B (ComfyUI and diffusers), "
                                   "kohya = lora_unet_*.lora_down/lora_up/alpha as sd-scripts writes (ComfyUI, "
                                   "sd-scripts tools; diffusers' Anima loader ignores it)")


@section
@dataclass
class QuantConfig:
    mode: str = _key("none", choices=("none", "frozen", "training"),
                     help="none, frozen (quantized base under an adapter), training (quantized full finetune)")
    weights_dtype: str = _key("int8", help="SDNQ weight dtype (int8, uint8, float8_e4m3fn, ...)")
    use_quantized_matmul: bool | Literal["auto"] = _key("auto", choices=(True, False, "auto"),
                                                        help="quantized matmul; leave on auto")
    skip_policy: str = _key("default", choices=("default", "all_adaln", "first_block_adaln", "anima_int8_mm",
                                                "mlp_down"), help="which layers stay unquantized")
    quantize_text_conditioner: bool = _key(False, help="also quantize the LLM adapter")
    quantize_text_encoder: bool = _key(False, help="also quantize Qwen3")
    extra_skip: list[str] = _key(factory=list, help="more layers to skip: full name, dot component or glob")
    dynamic_loss_threshold: float | None = _key(None, gt=0.0, help="per-layer bit search threshold")
    group_size: int = _key(0, help="quantization group size; 0 = per-channel scales")
    use_stochastic_rounding: bool = _key(True, help="stochastic rounding (load-bearing for training)")


@section
@dataclass
class CurriculumPhase:
    at: float = _key(0.0, ge=0.0, lt=1.0, help="training progress at which the phase starts, in [0, 1)")
    t_range: list[float] = _key(factory=lambda: [0.0, 1.0], help="[lo, hi] continuous timestep range")
    mode: str = _key("fullres", choices=("fullres", "texture"), help="full-resolution or texture crops")
    lr_mul: float = _lr_key(1.0, gt=0.0, help="multiplies the scheduler's current LR")


def active_phase(phases: Sequence[CurriculumPhase], progress: float) -> CurriculumPhase | None:
    """The last phase with at <= progress (progress > 1 stays in the last); None without a curriculum.
    The config requires a phase at 0.0, so some phase is always active; a negative progress gets the first."""
    if not phases:
        return None
    ordered = sorted(phases, key=lambda p: p.at)
    current = ordered[0]
    for phase in ordered:
        if phase.at <= progress:
            current = phase
    return current


@section
@dataclass
class SampleConfig:
    prompts: list[str] = _key(factory=list, help="preview prompts, one image each (with prompts_file: both)")
    prompts_file: str | None = _key(None, nonempty=True, path=True,
                                    help="file of preview prompts, one per line, # comments; relative to the "
                                         "config's folder")
    negative_prompt: str = _key("", help="negative prompt of every preview (the uncond side of CFG)")
    every_n_steps: int | None = _key(None, ge=1, help="render the previews every N optimizer steps")
    every_n_epochs: int | None = _key(None, ge=1, help="render the previews every N epochs")
    before_first_step: bool = _key(False, help="render them once before training starts (the base model)")
    at_end: bool = _key(True, help="render them once after the last step")
    width: int = _key(1024, ge=16, help="preview width in px (a multiple of 16)")
    height: int = _key(1024, ge=16, help="preview height in px (a multiple of 16)")
    steps: int = _key(30, ge=1, help="Euler steps (ComfyUI KSampler: sampler euler, scheduler simple)")
    cfg_scale: float = _key(4.0, ge=1.0, help="classifier-free guidance scale; 1 = no negative pass")
    seed: int = _key(0, ge=0, help="noise seed of every preview (ComfyUI's noise for that seed)")
    shift: float = _key(SAMPLE_SHIFT, gt=0.0, help="sigma shift of the schedule; 3.0 = ComfyUI's Anima setting")
    # Not a key: the prompts read from prompts_file at load.
    file_prompts: list[str] = field(default_factory=list, compare=False, repr=False, metadata={"key": False})

    def all_prompts(self) -> list[str]:
        """The inline prompts, then the file's."""
        return list(self.prompts) + list(self.file_prompts)


@section
@dataclass
class LoggingConfig:
    tensorboard: bool = _key(False, help="TensorBoard event files under <run_dir>/logs/<run start time>/ "
                                         "(needs the tensorboard package: pip install tensorboard)")


@section
@dataclass
class ValidationConfig:
    folder: str | None = _key(None, nonempty=True, path=True,
                              help="held-out image folder (captioned and cached like the dataset, never trained "
                                   "on); relative to the config's folder")
    fraction: float = _key(0.0, ge=0.0, lt=1.0,
                           help="or: this fraction of the dataset's images (at least 2) split off by `seed`, never "
                                "trained on (their names are printed); 0 = none")
    seed: int = _key(0, ge=0, help="seed of the split, of the fixed noise and of the shuffled captions")
    every_n_steps: int | None = _key(None, ge=1, help="evaluate every N optimizer steps (and before the first "
                                                      "step and at the end)")
    every_n_epochs: int | None = _key(None, ge=1, help="evaluate every N epochs")
    timesteps: list[float] = _key(factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9],
                                  help="the fixed timesteps every held-out latent is evaluated at, each in (0, 1)")

    @property
    def enabled(self) -> bool:
        return self.folder is not None or self.fraction > 0


@root
@dataclass
class Config:
    train: TrainConfig = _table(TrainConfig, "run, batching, saving")
    dataset: DatasetConfig = _table(DatasetConfig, "data sources and bucketing")
    flow: FlowConfig = _table(FlowConfig, "flow matching: timesteps and loss")
    optimizer: OptimizerConfig = _table(OptimizerConfig, "optimizer")
    schedule: ScheduleConfig = _table(ScheduleConfig, "learning-rate schedule")
    component_lr: ComponentLRConfig = _table(ComponentLRConfig, "per-component learning rates")
    adapter: AdapterConfig = _table(AdapterConfig, adapters.table_help())
    quant: QuantConfig = _table(QuantConfig, "SDNQ quantization")
    curriculum: list[CurriculumPhase] = _array(CurriculumPhase, "curriculum phases, sorted by at")
    sample: SampleConfig = _table(SampleConfig, "preview images rendered while training")
    logging: LoggingConfig = _table(LoggingConfig, "TensorBoard logging")
    validation: ValidationConfig = _table(ValidationConfig, "validation loss on held-out images (off unless folder "
                                                            "or fraction is set)")
    # Where the config came from, so the run can copy it verbatim (comments kept). Not part of equality.
    source_path: Path | None = field(default=None, compare=False, repr=False, metadata={"key": False})
    source_text: str | None = field(default=None, compare=False, repr=False, metadata={"key": False})

    @property
    def run_stem(self) -> str:
        """The sanitised run name: the stem of every output file."""
        return sanitize_run_name(self.train.run_name)

    def injected_components(self) -> list[str]:
        """component_lr keys that own trainable weights under the current [adapter] settings."""
        a = self.adapter
        full = adapters.method(a.kind).trains_base
        comps = list(DIT_COMPONENTS) + ["llm_adapter"] if full else list(a.components)
        if not full and a.train_llm_adapter:
            comps.append("llm_adapter")
        if a.train_text_encoder:
            comps.append("text_encoder")
        return comps

    def component_learning_rates(self) -> dict[str, float]:
        """Effective LR of each trainable component (0.0 = frozen); unset keys inherit optimizer.lr."""
        out = {}
        for comp in self.injected_components():
            lr = getattr(self.component_lr, comp)
            out[comp] = self.optimizer.lr if lr is None else lr
        return out


TABLES: dict[str, type] = tables()  # every table by its TOML name, in file order (from Config's nested fields)
ARRAY_TABLES = array_tables()  # ("dataset.subsets", "curriculum")


class FieldInfo(NamedTuple):
    name: str
    type: Any
    default: Any
    help: str
    choices: tuple | None
    metadata: dict


def iter_fields(table: str | type | Any) -> Iterator[FieldInfo]:
    """The keys of one table (a TABLES name like "dataset.caption", a table class or instance), in order.

    Nested tables ([dataset.caption], [[dataset.subsets]]) are not keys; walk TABLES for them.
    """
    cls = TABLES[table] if isinstance(table, str) else (table if isinstance(table, type) else type(table))
    for f in dataclasses.fields(cls):
        if is_key(f):
            yield FieldInfo(f.name, hints(cls)[f.name], field_default(f), f.metadata["help"],
                            f.metadata.get("choices"), dict(f.metadata))


_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}


def sanitize_run_name(name: str, fallback: str = "anima") -> str:
    """A run name safe as a file stem on every OS (docs/training.md#run-names): `my run 2` -> `my-run-2`,
    `.hidden` -> `hidden`.

    Keeps Unicode letters/digits and - _ . ; any other run of characters becomes one '-'; leading/trailing '-'
    and '.' are stripped; Windows device names get '-run' appended; an empty result gives `fallback`.
    """
    s = unicodedata.normalize("NFC", str(name)).strip()
    s = re.sub(r"[^\w.\-]+", "-", s)  # \w is Unicode-aware: letters, digits, underscore
    s = s.strip("-.")
    if not s:
        return fallback
    # Windows reserves the device name even with an extension ("con.v2.safetensors"), so test the first part.
    head, dot, tail = s.partition(".")
    if head.upper() in _RESERVED:
        s = f"{head}-run{dot}{tail}"
    return s
