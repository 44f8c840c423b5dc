"""The trainer's configuration: one TOML file, typed dataclasses, every rule checked at load.

This module is the single source of truth for the config keys (see /work/shared/spec/CONFIG.md). Every key is a
dataclass field whose metadata carries a one-line `help`, its `choices` when it is an enum, and its numeric bounds
(`ge`/`gt`/`le`/`lt`), so the CLI, the ComfyUI node inputs and the docs can all be generated from `iter_fields`.

    cfg = load_config("configs/lora.toml")      # or load_config(toml_text)
    cfg.train.epochs, cfg.dataset.tiers, cfg.component_learning_rates()
    dump_toml(cfg)                              # only non-default values (+ adapter.kind)
    copy_config_verbatim(cfg, run_dir / f"{cfg.run_stem}.toml")   # comments kept

`load_config` collects every problem it can find and raises them together in one `ConfigError`, so a config is
fixed in one pass: here each key's type, bounds and choices; the rules across keys are in `config_rules.py`. Features whose code has not landed are listed in `NOT_IMPLEMENTED`; setting one of their keys
to a non-default value is refused after all other validation passed.

No torch here: this module is imported by the CLI's `--help` and by ComfyUI at start-up.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tomllib
import types
import typing
import unicodedata
import warnings
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, NamedTuple

from anima_train import adapters, config_aliases
from anima_train.captions import CAPTION_MODES, CAPTION_VARIANTS
from anima_train.errors import UserError

DEFAULT_MODEL_PATH = "../anima-diffusers"
MODEL_PATH_ENV = "ANIMA_MODEL"

DIT_COMPONENTS = ("self_attn", "cross_attn", "mlp", "adaln", "base")
COMPONENT_LR_KEYS = DIT_COMPONENTS + ("llm_adapter", "text_encoder")
DTYPE_NAMES = ("bfloat16", "float16", "float32")  # [train] dtype; models.DTYPES maps them to torch dtypes
LORA_FORMATS = ("peft", "kohya")  # LoRA file layouts (adapters/lora/model.py state_dict's fmt)
SDNQ_OPTIMIZERS = ("adamw8bit", "adafactor", "came", "lion", "muon")
CAME_BETAS = [0.9, 0.999, 0.9999]
ROPE_SIDE_LIMIT = 2048  # RoPE position table length in px (128 patch units x 16); 2112 crashes (CONFIG.md B.1)
ROPE_SIDE_DECLARED = 1920  # declared spatial range (120 units x 16 px); beyond it RoPE extrapolates
TIER_COLLAPSE_MODES = ("dedup", "repeat")  # buckets.plan_tiers
MAX_RANK = 4096  # above every layer width of Anima and Qwen3: a larger rank adds nothing (and 10**20 crashes torch)
MAX_REPEATS = 10_000  # per subset/folder; an epoch holds every repeat, so 10**20 would never end (or overflow)

# Features whose code has not landed yet. A key here set to a non-default value is refused at load (after all
# other validation). Remove the line when the feature lands. A table name ("quant") or "curriculum" gates the
# whole table / every phase.
NOT_IMPLEMENTED: dict[str, str] = {}


class ConfigError(UserError, ValueError):
    """A config that cannot be used. `errors` holds one message per problem (the lines of the message)."""

    def __init__(self, message: str, errors: list[str] | None = None):
        super().__init__(message)
        self.errors = list(errors) if errors is not None else [message]


class ConfigWarning(UserWarning):
    """A config that loads but probably does not do what its author meant."""


def _key(default: Any = MISSING, *, help: str, factory: Any = MISSING, choices: tuple | None = None,
         ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
         hint: str = "", nonempty: bool = False, type_desc: str = "", **extra: Any) -> Any:
    """A config key: a dataclass field with the metadata the loader and the generators read."""
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt, "hint": hint,
            "nonempty": nonempty, "type_desc": type_desc, **extra}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _table(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help, "table": cls})


def _array(cls: type, help: str) -> Any:
    return field(default_factory=list, metadata={"help": help, "array": cls})


def _default_model_path() -> str:
    # The environment changes the *default* only; a model_path written in the config always wins.
    return os.environ.get(MODEL_PATH_ENV) or DEFAULT_MODEL_PATH


# --------------------------------------------------------------------------------------------------- tables


@dataclass
class TrainConfig:
    model_path: str = _key(factory=_default_model_path, nonempty=True, env=MODEL_PATH_ENV,
                           help="converted diffusers repo (incl. tokenizer/, t5_tokenizer/); env ANIMA_MODEL "
                                "overrides the default")
    output_dir: str = _key("output", nonempty=True, help="runs are written to <output_dir>/<run_name>/")
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
    dtype: str = _key("bfloat16", choices=DTYPE_NAMES,
                      help="the only precision control: modules load in this dtype")
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
    resume_from: str | None = _key(None, nonempty=True, help="checkpoint file or its -state folder to resume")
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


@dataclass
class SubsetConfig:
    path: str = _key(MISSING, nonempty=True, help="source directory")
    num_repeats: int = _key(1, ge=1, le=MAX_REPEATS, help="repeat this subset's entries N times per epoch")
    texture: bool = _key(True, help="false = always full-resolution with its captions, even in texture phases")


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
        None, nonempty=True,
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


@dataclass
class DatasetConfig:
    path: str | None = _key(None, nonempty=True, help="single source directory (or use [[dataset.subsets]])")
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
                       help="images (cached latents), latents (caches only), encode (VAE in the loop), auto")
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


@dataclass
class OptimizerConfig:
    kind: str = _key("adamw", choices=("adamw",) + SDNQ_OPTIMIZERS,
                     help="adamw (torch, fp32 moments) or an SDNQ optimizer")
    lr: float = _key(1e-5, gt=0.0, help="peak LR for groups without a component_lr")
    betas: list[float] = _key(factory=lambda: [0.9, 0.95], help="2 values; 3 for came")
    eps: float = _key(1e-8, gt=0.0, help="denominator epsilon")
    weight_decay: float = _key(0.01, ge=0.0, help="decoupled weight decay, per param group")
    max_grad_norm: float = _key(1.0, ge=0.0, help="gradient clip on sync steps; 0 disables")
    quantize_state: bool = _key(False, help="SDNQ only: uint8 optimizer state (~4x smaller)")
    offload_state: bool = _key(False, help="SDNQ only: optimizer state in pinned host RAM")
    use_kahan: bool = _key(False, help="SDNQ only: a bf16 Kahan residual instead of fp32 master weights (less memory)")


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


@dataclass
class ComponentLRConfig:
    self_attn: float | None = _key(None, ge=0.0, help="LR of self-attention (attn1); unset = optimizer.lr")
    cross_attn: float | None = _key(None, ge=0.0, help="LR of cross-attention (attn2); unset = optimizer.lr")
    mlp: float | None = _key(None, ge=0.0, help="LR of the MLP (ff); unset = optimizer.lr")
    adaln: float = _key(0.0, ge=0.0, help="LR of the adaLN modulation; 0 = frozen")
    base: float = _key(0.0, ge=0.0, help="LR of the in/out projections; 0 = frozen")
    llm_adapter: float = _key(0.0, ge=0.0, help="LR of the LLM adapter (text conditioner); 0 = frozen")
    text_encoder: float | None = _key(None, ge=0.0, help="LR of the Qwen3 LoRA; unset = optimizer.lr")


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


@dataclass
class CurriculumPhase:
    at: float = _key(0.0, ge=0.0, lt=1.0, help="training progress at which the phase starts, in [0, 1)")
    t_range: list[float] = _key(factory=lambda: [0.0, 1.0], help="[lo, hi] continuous timestep range")
    mode: str = _key("fullres", choices=("fullres", "texture"), help="full-resolution or texture crops")
    lr_mul: float = _key(1.0, gt=0.0, help="multiplies the scheduler's current LR")


SAMPLE_SHIFT = 3.0  # ComfyUI's Anima model_sampling (supported_models.Anima: shift 3.0, multiplier 1.0)


@dataclass
class SampleConfig:
    prompts: list[str] = _key(factory=list, help="preview prompts, one image each (with prompts_file: both)")
    prompts_file: str | None = _key(None, nonempty=True,
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


@dataclass
class LoggingConfig:
    tensorboard: bool = _key(False, help="TensorBoard event files under <run_dir>/logs/<run start time>/ "
                                         "(needs the tensorboard package: pip install tensorboard)")


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


TABLES: dict[str, type] = {
    "train": TrainConfig,
    "dataset": DatasetConfig,
    "dataset.subsets": SubsetConfig,
    "dataset.caption": CaptionConfig,
    "dataset.texture": TextureConfig,
    "flow": FlowConfig,
    "optimizer": OptimizerConfig,
    "schedule": ScheduleConfig,
    "component_lr": ComponentLRConfig,
    "adapter": AdapterConfig,
    "quant": QuantConfig,
    "curriculum": CurriculumPhase,
    "sample": SampleConfig,
    "logging": LoggingConfig,
}
ARRAY_TABLES = ("dataset.subsets", "curriculum")

REQUIRED = object()  # default reported by iter_fields for a key without one (a subset's path)


class FieldInfo(NamedTuple):
    name: str
    type: Any
    default: Any
    help: str
    choices: tuple | None
    metadata: dict


def _is_key(f: dataclasses.Field) -> bool:
    return f.metadata.get("key", True) and "table" not in f.metadata and "array" not in f.metadata


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return REQUIRED


def iter_fields(table: str | type | Any) -> Iterator[FieldInfo]:
    """The keys of one table (a TABLES name like "dataset.caption", a table class or instance), in order.

    Nested tables ([dataset.caption], [[dataset.subsets]]) are not keys; walk TABLES for them.
    """
    cls = TABLES[table] if isinstance(table, str) else (table if isinstance(table, type) else type(table))
    for f in dataclasses.fields(cls):
        if _is_key(f):
            yield FieldInfo(f.name, _hints(cls)[f.name], _field_default(f), f.metadata["help"],
                            f.metadata.get("choices"), dict(f.metadata))


# --------------------------------------------------------------------------------------------------- typing

_TYPE_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    # `from __future__ import annotations` keeps annotations as strings; resolve them once per class.
    if cls not in _TYPE_HINTS:
        _TYPE_HINTS[cls] = typing.get_type_hints(cls)
    return _TYPE_HINTS[cls]


class _Mismatch(Exception):
    pass


class _BadEntry(_Mismatch):
    """A table of the right kind with one wrong key or value: the message says which (not "expected a table,
    got a table")."""

    def __init__(self, why: str):
        super().__init__()
        self.why = why


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args if a is not type(None))
    if origin is Literal:
        return " or ".join(as_toml(a) for a in args)
    if origin is list:
        inner = _describe(args[0])
        inner = {"an integer": "integers", "a number": "numbers", "a string": "strings"}.get(inner, inner)
        if inner.startswith("a list of "):
            inner = "lists of " + inner[len("a list of "):]
        return f"a list of {inner}"
    if origin is dict:
        return "a table"
    return str(tp)


def _coerce(value: Any, tp: Any) -> Any:
    """Check `value` (from TOML) against annotation `tp`; return it converted (ints to floats, str keys to int)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):  # true is not 1
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # an int is fine where a float is
            if not math.isfinite(value):
                raise _Mismatch("a finite number")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin in (typing.Union, types.UnionType):
        entry = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except _BadEntry as exc:
                entry = exc  # the value is this kind of thing, with one bad entry: that is the message
            except _Mismatch:
                pass
        if entry is not None:
            raise entry
    elif origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
    elif origin is list:
        if isinstance(value, list):
            return [_coerce(v, args[0]) for v in value]
    elif origin is dict:
        if isinstance(value, dict):
            key_type, value_type = args
            out = {}
            for k, v in value.items():
                if key_type is int:
                    if not re.fullmatch(r"\s*-?\d+\s*", k):
                        raise _BadEntry(f"the key {as_toml(k)} is not a whole number; every key of this table is "
                                        f"an integer (e.g. {{ 768 = 16, 1024 = 12 }})")
                    k = int(k)
                try:
                    out[k] = _coerce(v, value_type)
                except _Mismatch:
                    raise _BadEntry(f"the value of {k} is {_toml_type(v)}, expected {_describe(value_type)}") from None
            return out
    raise _Mismatch()


def _toml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__}"


def as_toml(value: Any) -> str:
    """A value as it would be written in TOML (for messages)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(as_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {as_toml(v)}" for k, v in value.items()) + " }"
    return str(value)


# --------------------------------------------------------------------------------------------------- loading


class Problems:
    """Errors and warnings found while loading, plus the keys whose values could not be trusted."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.bad: set[str] = set()  # dotted keys with a wrong type or an out-of-range/unknown value

    def error(self, msg: str, *bad_keys: str) -> None:
        self.errors.append(msg)
        self.bad.update(bad_keys)

    def ok(self, *keys: str) -> bool:
        """True if none of these keys failed on its own (cross-field rules skip untrustworthy inputs)."""
        return not any(k in self.bad for k in keys)


def _all_keys_by_table() -> dict[str, list[str]]:
    out = {}
    for name, cls in TABLES.items():
        out[name] = [f.name for f in dataclasses.fields(cls) if f.metadata.get("key", True)]
    return out


def table_label(name: str, index: int | None = None) -> str:
    return f"[[{name}]] #{index + 1}" if index is not None else f"[{name}]"


def _table_header(table: str) -> str:
    return f"[[{table}]]" if table in ARRAY_TABLES else f"[{table}]"


def _unknown_key(where: str, table: str, key: str, valid: list[str], what: str = "key") -> str:
    hint = ""
    if what == "key":  # the name a user meant, also when it is another trainer's name (config_aliases)
        found = config_aliases.suggestion(key, table, _all_keys_by_table())
        if isinstance(found, str):
            hint = f" ({found})"
        elif found is not None:
            home, name = found
            hint = (f" (did you mean '{name}'?)" if home == table else
                    f" ('{key}' belongs in {_table_header(home)})" if name == key else
                    f" (did you mean {_table_header(home)} {name}?)")
    else:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
    return f"{where} unknown {what} '{key}'{hint}; valid {what}s: {', '.join(valid)}"


def _build(cls: type, raw: dict, table: str, where: str, prefix: str, p: Problems) -> Any:
    """Type-check one TOML table into dataclass `cls`. Bad values are reported and left at their defaults."""
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("key", True)}
    for key in raw:
        if key not in fields:
            p.error(_unknown_key(where, table, key, list(fields)))
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        dotted = f"{prefix}.{name}"
        if "table" in f.metadata or "array" in f.metadata:
            continue  # nested tables are built by the caller
        if name not in raw:
            if f.default is MISSING and f.default_factory is MISSING:
                p.error(f"{where} is missing the required key '{name}' ({f.metadata['help']})", dotted)
            continue
        value = raw[name]
        try:
            value = _coerce(value, hints[name])
        except _BadEntry as exc:
            p.error(f"{where} {name} = {as_toml(value)}: {exc.why}", dotted)
            continue
        except _Mismatch as exc:
            expected = (exc.args[0] if exc.args else "") or f.metadata.get("type_desc") or _describe(hints[name])
            example = _field_default(f)
            example = f" (e.g. {name} = {as_toml(example)})" if example not in (None, REQUIRED) else ""
            p.error(f"{where} {name} = {as_toml(value)}: expected {expected}{example}, got {_toml_type(value)}",
                    dotted)
            continue
        if not _check_value(value, f, f"{where} {name}", dotted, p):
            continue
        kwargs[name] = value
    if any(f.default is MISSING and f.default_factory is MISSING and n not in kwargs for n, f in fields.items()):
        return None
    return cls(**kwargs)


def _check_value(value: Any, f: dataclasses.Field, label: str, dotted: str, p: Problems) -> bool:
    """Per-key checks from the field's metadata: choices, bounds, non-empty. Returns False if it failed.
    `label` names the key in the message ("[schedule] d", or "schedule.d" for a table built in code)."""
    m = f.metadata
    hint = f" ({m['hint']})" if m.get("hint") else ""
    choices = m.get("choices")
    if choices and not isinstance(value, dict):
        items = value if isinstance(value, list) else [value]
        for item in items:
            if item is not None and item not in choices:
                close = difflib.get_close_matches(str(item), [str(c) for c in choices], n=1, cutoff=0.6)
                sugg = f"did you mean {as_toml(close[0])}? " if close else ""
                p.error(f"{label} = {as_toml(value)}: unknown value {as_toml(item)}; {sugg}"
                        f"choose from {', '.join(as_toml(c) for c in choices)}", dotted)
                return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        for bound, test, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                                  ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
            b = m.get(bound)
            if b is not None and not test(value, b):
                p.error(f"{label} = {as_toml(value)}: must be {word} {as_toml(b)}{hint}", dotted)
                return False
    if m.get("nonempty") and isinstance(value, str) and not value.strip():
        p.error(f"{label} is empty; give a path or remove the key", dotted)
        return False
    return True


def check_table(table: Any, name: str) -> None:
    """load_config's per-key rules (choices and bounds, from the field metadata: their one definition) for a
    table built in code, which never went through load_config (e.g. `ScheduleConfig(d=1.0)` passed to the
    schedule). Raises ConfigError naming `name.key`."""
    p = Problems()
    for f in dataclasses.fields(table):
        if f.metadata.get("key", True) and "table" not in f.metadata and "array" not in f.metadata:
            _check_value(getattr(table, f.name), f, f"{name}.{f.name}", f"{name}.{f.name}", p)
    if p.errors:
        raise ConfigError("\n".join(p.errors), p.errors)


def betas_problem(kind: str, betas: list[float]) -> str | None:
    """The [optimizer] betas rule (3 for came, 2 otherwise, each in [0, 1)), or None when they are fine; checked by
    load_config and, for a config built in code, by build_optimizer."""
    if kind == "came" and len(betas) != 3:
        return (f'[optimizer] betas = {as_toml(list(betas))}: kind = "came" needs 3 betas (first moment, second '
                f"moment, instability), e.g. betas = {as_toml(CAME_BETAS)} (CAME's defaults)")
    if kind != "came" and len(betas) != 2:
        return f"[optimizer] betas = {as_toml(list(betas))}: kind = {as_toml(kind)} needs 2 betas, e.g. betas = [0.9, 0.95]"
    if any(not 0.0 <= b < 1.0 for b in betas):
        return f"[optimizer] betas = {as_toml(list(betas))}: every beta must be in [0, 1)"
    return None


def shift_problem(flow: Any) -> str | None:
    """The [flow] rule that shift and flux_shift exclude each other, or None; checked by load_config and, for a
    config built in code, by flow.sample_timesteps."""
    if flow.shift is not None and flow.flux_shift:
        return ("[flow] shift and flux_shift = true are both set, but they are exclusive; use one (flux_shift picks "
                "the shift from the resolution, shift is static)")
    return None


def _build_config(raw: dict, p: Problems) -> Config:
    top = {f.name: f for f in dataclasses.fields(Config) if f.metadata.get("key", True)}
    for key, value in raw.items():
        if key not in top:
            if isinstance(value, dict):
                p.error(_unknown_key("config:", "", key, list(top), what="table"))
            else:
                found = config_aliases.suggestion(key, "", _all_keys_by_table())
                fix = (f"; {found}" if isinstance(found, str) else
                       f"; keys go inside a table, e.g. {_table_header(found[0])} {found[1]}" if found else
                       "; it is not a key of any table either (docs/config.md lists every key)")
                p.error(f"config: key '{key}' is outside any table{fix} (tables: {', '.join(top)})")
        elif key == "curriculum":
            if isinstance(value, dict):
                p.error("[curriculum] is a single table, but curriculum phases are an array of tables: write "
                        "[[curriculum]] (double brackets) for each phase", "curriculum")
            elif not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
                p.error(f"curriculum = {as_toml(value)}: expected [[curriculum]] tables", "curriculum")
        elif not isinstance(value, dict):
            p.error(f"config: '{key}' must be a table ([{key}]), got {_toml_type(value)}", key)

    def sub(name: str) -> dict:
        v = raw.get(name, {})
        return v if isinstance(v, dict) else {}

    cfg = Config()
    cfg.train = _build(TrainConfig, sub("train"), "train", "[train]", "train", p)
    draw = sub("dataset")
    cfg.dataset = _build(DatasetConfig, draw, "dataset", "[dataset]", "dataset", p)
    for nested in ("caption", "texture"):
        value = draw.get(nested, {})
        if not isinstance(value, dict):
            p.error(f"[dataset] {nested} must be a table ([dataset.{nested}]), got {_toml_type(value)}",
                    f"dataset.{nested}")
            value = {}
        setattr(cfg.dataset, nested, _build(TABLES[f"dataset.{nested}"], value, f"dataset.{nested}",
                                            f"[dataset.{nested}]", f"dataset.{nested}", p))
    subsets = draw.get("subsets", [])
    if isinstance(subsets, dict) or not (isinstance(subsets, list) and all(isinstance(s, dict) for s in subsets)):
        p.error("[dataset] subsets must be an array of tables: write [[dataset.subsets]] (double brackets) "
                "for each subset", "dataset.subsets")
        subsets = []
    for i, s in enumerate(subsets):
        built = _build(SubsetConfig, s, "dataset.subsets", table_label("dataset.subsets", i),
                       f"dataset.subsets[{i}]", p)
        if built is not None:
            cfg.dataset.subsets.append(built)
        else:
            p.bad.add("dataset.subsets")  # a subset was dropped: "no training data" would be misleading

    for name in ("flow", "optimizer", "schedule", "component_lr", "adapter", "quant", "sample", "logging"):
        setattr(cfg, name, _build(TABLES[name], sub(name), name, table_label(name), name, p))

    phases = raw.get("curriculum", [])
    if isinstance(phases, list) and all(isinstance(v, dict) for v in phases):
        for i, ph in enumerate(phases):
            cfg.curriculum.append(_build(CurriculumPhase, ph, "curriculum", table_label("curriculum", i),
                                         f"curriculum[{i}]", p))
    return cfg


# --------------------------------------------------------------------------------------------------- gate


def _get_dotted(cfg: Config, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _gate(cfg: Config) -> list[str]:
    defaults = Config()
    out = []
    for dotted, feature in NOT_IMPLEMENTED.items():
        if dotted == "curriculum.texture":
            if any(phase.mode == "texture" for phase in cfg.curriculum):
                out.append(f"`[[curriculum]] mode = \"texture\"` is not implemented yet ({feature}); use "
                           f"mode = \"fullres\" or remove the phase")
            continue
        if _get_dotted(cfg, dotted) == _get_dotted(defaults, dotted):
            continue
        if dotted in ARRAY_TABLES:
            out.append(f"`[[{dotted}]]` is not implemented yet ({feature}); remove the [[{dotted}]] tables")
        elif dotted in TABLES:
            out.append(f"`[{dotted}]` is not implemented yet ({feature}); remove the table or set its keys back "
                       "to their defaults")
        else:
            table, key = dotted.rsplit(".", 1)
            default = _get_dotted(defaults, dotted)
            back = "remove it (it is unset by default)" if default is None else \
                f"remove it or set it back to its default {as_toml(default)}"
            out.append(f"`[{table}] {key}` is not implemented yet ({feature}); {back}")
    return out


# --------------------------------------------------------------------------------------------------- API


def _read_source(source: str | os.PathLike) -> tuple[Path | None, str]:
    # A string is a path if it names a file, or if it is one line that cannot be a useful TOML document
    # (no '=' and no '[': "configs/lora.toml" that does not exist must say "not found", not "invalid TOML").
    if isinstance(source, os.PathLike) or (
            isinstance(source, str) and "\n" not in source and source.strip() and (os.path.isfile(source) or (
                "=" not in source and "[" not in source and not source.lstrip().startswith("#")))):
        path = Path(source).expanduser()
        try:
            text = path.read_bytes().decode("utf-8")
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except IsADirectoryError:
            raise ConfigError(f"config path is a folder, not a TOML file: {path}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text ({exc}); save the config as UTF-8") from None
        return path, text
    if not isinstance(source, str):
        raise TypeError(f"load_config takes a path or TOML text, not {type(source).__name__}")
    return None, source


TEXT_SOURCE = "<config text>"  # how messages name a config given as text rather than a file


def load_config(source: str | os.PathLike) -> Config:
    """Load and validate a config from a .toml path or from TOML text. Raises ConfigError listing every problem."""
    path, text = _read_source(source)
    name = str(path) if path is not None else TEXT_SOURCE
    try:
        raw = tomllib.loads(text.removeprefix("\ufeff"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{name}: not valid TOML: {exc}") from None
    p = Problems()
    cfg = _build_config(raw, p)
    from anima_train.config_rules import check_rules  # the rules import this module's types

    check_rules(cfg, raw, path.parent if path is not None else Path.cwd(), p)
    if p.errors:
        n = len(p.errors)
        if n == 1:  # one problem, one line
            raise ConfigError(f"{name}: {p.errors[0]}", p.errors)
        raise ConfigError(f"{name}: {n} problems in the config:\n" + "\n".join(f"  - {e}" for e in p.errors),
                          p.errors)
    for w in p.warnings:
        warnings.warn(f"{name}: {w}", ConfigWarning, stacklevel=2)
    gated = _gate(cfg)
    if gated:
        n = len(gated)
        raise ConfigError(f"{name}: {n} setting{'s' if n > 1 else ''} not implemented yet:\n"
                          + "\n".join(f"  - {g}" for g in gated), gated)
    cfg.source_path, cfg.source_text = path, text
    return cfg


def copy_config_verbatim(config: Config, dest_path: str | os.PathLike) -> Path:
    """Write the config exactly as it was read (comments kept) to dest_path, atomically.

    A config built in code (no source text) is written as dump_toml. Refuses to write over its own source file.
    """
    from anima_train.atomic import write_text

    dest = Path(dest_path)
    if config.source_path is not None and dest.exists() and dest.resolve() == config.source_path.resolve():
        raise ValueError(f"refusing to copy the config onto its own source file {dest}")
    write_text(dest, config.source_text if config.source_text is not None else dump_toml(config))
    return dest


def _toml_value(value: Any) -> Any:
    import tomlkit
    if isinstance(value, dict):
        tbl = tomlkit.inline_table()
        tbl.update({str(k): _toml_value(v) for k, v in value.items()})
        return tbl
    if isinstance(value, list):
        return [_toml_value(v) for v in value]
    return value


def _dump_table(obj: Any, default: Any, always: tuple[str, ...] = ()) -> Any:
    import tomlkit
    tbl = tomlkit.table()
    for f in dataclasses.fields(obj):
        if not f.metadata.get("key", True):
            continue
        value = getattr(obj, f.name)
        if "table" in f.metadata:
            sub = _dump_table(value, getattr(default, f.name))
            if len(sub):
                tbl[f.name] = sub
        elif "array" in f.metadata:
            if value:
                aot = tomlkit.aot()
                for item in value:  # every key of a subset: an entry reads best complete
                    aot.append(_dump_table(item, None))
                tbl[f.name] = aot
        elif value is not None and (f.name in always or default is None
                                    or value != getattr(default, f.name)):
            tbl[f.name] = _toml_value(value)
    return tbl


def dump_toml(config: Config) -> str:
    """TOML text of the non-default values (adapter.kind always). Loads back with load_config to an equal Config."""
    import tomlkit
    doc = tomlkit.document()
    defaults = Config()
    for f in dataclasses.fields(Config):
        if "table" not in f.metadata:
            continue
        always = ("kind",) if f.name == "adapter" else ()
        tbl = _dump_table(getattr(config, f.name), getattr(defaults, f.name), always)
        if len(tbl):
            doc[f.name] = tbl
    if config.curriculum:
        aot = tomlkit.aot()
        for ph in config.curriculum:  # every key of a phase: a phase reads best complete
            aot.append(_dump_table(ph, None))
        doc["curriculum"] = aot
    return tomlkit.dumps(doc)


_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}


def sanitize_run_name(name: str, fallback: str = "anima") -> str:
    """A run name safe as a file stem on every OS (CONFIG.md B.13): `my run 2` -> `my-run-2`, `.hidden` -> `hidden`.

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
