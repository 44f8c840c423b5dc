"""The rules across keys: what `validate` checks after every key has its type, choices and bounds.

`RULES` lists them in the order their messages appear (the texture source rule first: nothing else about texture
matters without per-step encoding), each with its scope: the table it reads ("dataset", "dataset.caption", one
"curriculum" phase, ...), or "" for a rule across tables. A table built in code runs the rules of its own scope and of
the tables inside it; a whole Config (and load_config) runs them all. A rule adds its problems to the `Problems`
collector, naming the key and the fix, and skips keys that already failed (`p.ok`), so a config with several problems
is refused once with all of them and no follow-on noise.

A rule is `rule(table, p, ctx, where)`: `ctx` says which keys the config wrote (`ctx.given(name, table)`), where
files named by keys are read from (`ctx.base_dir`, None for a table built in code: load_config reads them) and
whether the config must name its training data (`ctx.require_data`, a file must, a table built in code need not
yet). No import of the tables: this module only reads their attributes.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
from pathlib import Path

from anima_train import adapters
from anima_train.config.constants import (CAME_BETAS, CAPTION_VARIANTS, COMPONENT_LR_KEYS, ROPE_SIDE_DECLARED,
                                          ROPE_SIDE_LIMIT)
from anima_train.config.keys import Problems, as_toml, table_label
from anima_train.config.normalise import named_path, prompt_lines, text_lines
from anima_train.fixes import ref

# ------------------------------------------------------------------------------------------------ [train], tiers


def _tiers(d, p: Problems, ctx, w) -> None:
    given = ctx.given("dataset", d)
    tiers_ok = p.ok("dataset.resolution", "dataset.resolutions", "dataset.max_bucket_reso")
    if "resolution" in given and "resolutions" in given:
        p.error("[dataset] sets both resolution and resolutions; keep one: resolution = N for one tier, or "
                "resolutions = [..] for several", "dataset.resolutions")
        tiers_ok = False
    elif d.resolutions is not None and p.ok("dataset.resolutions"):
        if not d.resolutions:
            p.error("[dataset] resolutions = []: give at least one tier, or remove it and use resolution",
                    "dataset.resolutions")
            tiers_ok = False
        elif any(r <= 0 for r in d.resolutions):
            p.error(f"[dataset] resolutions = {as_toml(d.resolutions)}: every tier must be > 0", "dataset.resolutions")
            tiers_ok = False
    if tiers_ok and p.ok("dataset.max_bucket_reso"):
        too_big = [t for t in d.tiers if t > d.max_bucket_reso]
        if too_big:
            key = "resolutions" if d.resolutions is not None else "resolution"
            p.error(f"[dataset] {key}: tier(s) {as_toml(too_big)} exceed max_bucket_reso = {d.max_bucket_reso} (the "
                    f"per-side cap); lower the tier or raise max_bucket_reso", f"dataset.{key}")
            tiers_ok = False

    if tiers_ok and p.ok("dataset.bucket_reso_steps"):
        too_small = [t for t in d.tiers if t < d.bucket_reso_steps]
        if too_small:  # no bucket (sides are multiples of bucket_reso_steps) fits such a tier's area
            key = "resolutions" if d.resolutions is not None else "resolution"
            p.error(f"[dataset] {key}: tier(s) {as_toml(too_small)} are below bucket_reso_steps = "
                    f"{d.bucket_reso_steps}: raise the tier (e.g. 1024) or lower bucket_reso_steps; no image can be "
                    f"bucketed (bucket sides are multiples of it)", f"dataset.{key}")


def _tiers_ok(p: Problems) -> bool:
    """The declared tiers can be trusted: _tiers marks one of these keys whenever it refuses them."""
    return p.ok("dataset.resolution", "dataset.resolutions", "dataset.max_bucket_reso")


def _checkpoint_blocks(t, p: Problems, ctx, w) -> None:
    blocks = t.checkpoint_blocks
    if isinstance(blocks, str) and blocks not in ("auto", "all") and p.ok("train.checkpoint_blocks"):
        p.error(f"[train] checkpoint_blocks = {as_toml(blocks)}: choose \"auto\", \"all\" or a number of blocks",
                "train.checkpoint_blocks")


def _swap_blocks(cfg, p: Problems, ctx, w) -> None:
    t = cfg.train
    if isinstance(t.swap_blocks, str):  # "auto" swaps only where blocks can swap (training/plan.swap_unavailable)
        if t.swap_blocks != "auto" and p.ok("train.swap_blocks"):
            p.error(f"[train] swap_blocks = {as_toml(t.swap_blocks)}: choose \"auto\" or a number of blocks",
                    "train.swap_blocks")
        return
    if t.swap_blocks == 0 or not p.ok("train.swap_blocks", "adapter.kind", "quant.mode"):
        return
    head = f"[train] swap_blocks = {t.swap_blocks}"
    if adapters.method(cfg.adapter.kind).trains_base:
        p.error(f"{head} swaps frozen weights, but [adapter] kind = \"none\" trains them all (full finetune); "
                "set swap_blocks = 0, or train an adapter (e.g. kind = \"lora\")", "train.swap_blocks")
    elif cfg.quant.mode != "none":
        p.error(f"{head}: not available with a quantized base ([quant] mode = {as_toml(cfg.quant.mode)}) in this "
                "version; set swap_blocks = 0 or [quant] mode = \"none\"", "train.swap_blocks")
    elif not t.gradient_checkpointing:
        p.error(f"{head}: a swapped block recomputes in backward, but gradient_checkpointing = false; set "
                "gradient_checkpointing = true or swap_blocks = 0", "train.swap_blocks")
    elif not t.compile_regional and t.compile != "off":  # eager: nothing compiles, the swap runs around each block
        p.error(f"{head}: the swap runs between compiled blocks, but compile_regional = false compiles the whole "
                "trunk; set compile_regional = true, compile = \"off\" or swap_blocks = 0", "train.swap_blocks")


def _base_matmul(cfg, p: Problems, ctx, w) -> None:
    t = cfg.train
    if t.base_matmul == "bf16" or not p.ok("train.base_matmul", "adapter.kind", "quant.mode", "train.dtype"):
        return
    head = f"[train] base_matmul = {as_toml(t.base_matmul)}"
    if adapters.method(cfg.adapter.kind).trains_base:
        p.error(f"{head} multiplies frozen weights in FP8, but [adapter] kind = \"none\" trains them all (full "
                "finetune); set base_matmul = \"bf16\", or train an adapter (e.g. kind = \"lora\")",
                "train.base_matmul")
    elif cfg.quant.mode != "none":
        p.error(f"{head} and [quant] mode = {as_toml(cfg.quant.mode)} both quantize the base; choose one: "
                "base_matmul = \"bf16\" or [quant] mode = \"none\"", "train.base_matmul")
    elif t.dtype != "bfloat16":
        p.error(f"{head}: the FP8 GEMMs write bfloat16, but [train] dtype = {as_toml(t.dtype)}; set dtype = "
                "\"bfloat16\" or base_matmul = \"bf16\"", "train.base_matmul")


def _batch_size(t, p: Problems, ctx, w) -> None:
    bs = t.batch_size
    if isinstance(bs, dict) and p.ok("train.batch_size"):
        small = {k: v for k, v in bs.items() if v < 1}
        if small:
            p.error(f"[train] batch_size = {as_toml(bs)}: every batch size must be >= 1 (got {as_toml(small)})",
                    "train.batch_size")
    elif isinstance(bs, int) and bs < 1:
        p.error(f"[train] batch_size = {bs}: must be >= 1", "train.batch_size")


def _batch_size_tiers(cfg, p: Problems, ctx, w) -> None:
    bs, d = cfg.train.batch_size, cfg.dataset
    if isinstance(bs, dict) and p.ok("train.batch_size") and _tiers_ok(p) and set(bs) != set(d.tiers):
        missing = sorted(set(d.tiers) - set(bs))
        extra = sorted(set(bs) - set(d.tiers))
        p.error(f"[train] batch_size keys {sorted(bs)} must equal the declared tiers {d.tiers} exactly "
                f"(tiers without a key: {missing or 'none'}; keys that are not tiers: {extra or 'none'}); "
                f"write one entry per tier, e.g. batch_size = "
                f"{as_toml({t: bs.get(t, 1) for t in d.tiers})} (not a threshold ladder)", "train.batch_size")


# ------------------------------------------------------------------------------------------------ [dataset]


def _sources(d, p: Problems, ctx, w) -> None:
    if p.ok("dataset.path", "dataset.subsets"):
        if d.path is not None and d.subsets:
            p.error("[dataset] sets both path and [[dataset.subsets]]; use one: move path into a "
                    "[[dataset.subsets]] entry to train on several folders")
        elif d.path is None and not d.subsets and ctx.require_data:
            p.error(ref("set dataset", '[dataset] no training data: set [dataset] path = "/your/images", or add '
                            "[[dataset.subsets]] tables with a path each"))
    if d.subsets and "num_repeats" in ctx.given("dataset", d):
        p.warnings.append("[dataset] num_repeats only applies to the single-path form and is ignored with "
                          "[[dataset.subsets]]; set num_repeats in each subset instead")
    seen: dict[str, int] = {}
    for i, s in enumerate(d.subsets):
        norm = os.path.normpath(s.path)
        if norm in seen:
            p.error(f"{table_label('dataset.subsets', i)} path = {as_toml(s.path)} is the same folder as "
                    f"{table_label('dataset.subsets', seen[norm])}; list each folder once and use num_repeats "
                    "to weight it")
        seen.setdefault(norm, i)


def _text_cache(cfg, p: Problems, ctx, w) -> None:
    """A cached Qwen3 output is the output of one caption string: a caption that changes every epoch would fill the
    cache with strings never seen again, and a Qwen3 that trains changes every output after each step."""
    if not cfg.dataset.cache_text_encoder_outputs or not p.ok("dataset.cache_text_encoder_outputs"):
        return
    c = cfg.dataset.caption
    head = "[dataset] cache_text_encoder_outputs = true keeps one Qwen3 output per caption"
    varying = [f"[dataset.caption] {key} = {as_toml(getattr(c, key))}"
               for key in ("shuffle_tags", "nl_shuffle_sentences", "tag_dropout_percent")
               if getattr(c, key) and p.ok(f"dataset.caption.{key}")]
    if varying:
        verb = "makes" if len(varying) == 1 else "make"
        p.error(f"{head}, but {' and '.join(varying)} {verb} a new caption every epoch; set [dataset] "
                "cache_text_encoder_outputs = false, or turn those off ([dataset.caption] caption_dropout_percent "
                "may stay)", "dataset.cache_text_encoder_outputs")
    if cfg.adapter.train_text_encoder and p.ok("adapter.train_text_encoder"):
        p.error(f"{head}, but [adapter] train_text_encoder = true changes Qwen3 at every step; set one of them to "
                "false", "dataset.cache_text_encoder_outputs")


def _buckets(d, p: Problems, ctx, w) -> None:
    if p.ok("dataset.bucket_reso_steps") and d.bucket_reso_steps % 16:
        p.error(f"[dataset] bucket_reso_steps = {d.bucket_reso_steps}: must be a multiple of 16 (VAE factor 8 "
                "x patch 2), e.g. 64", "dataset.bucket_reso_steps")
    if (not d.bucket_no_upscale and p.ok("dataset.min_bucket_reso", "dataset.max_bucket_reso")
            and d.min_bucket_reso > d.max_bucket_reso):
        p.error(f"[dataset] min_bucket_reso = {d.min_bucket_reso} exceeds max_bucket_reso = {d.max_bucket_reso}")


def _caption(c, p: Problems, ctx, w) -> None:
    if p.ok("dataset.caption.mixed_weights"):
        unknown = [k for k in c.mixed_weights if k not in CAPTION_VARIANTS]
        if unknown:
            close = {k: difflib.get_close_matches(k, CAPTION_VARIANTS, n=1) for k in unknown}
            sugg = "".join(f" (did you mean '{v[0]}' for '{k}'?)" for k, v in close.items() if v)
            p.error(f"[dataset.caption] mixed_weights: unknown key(s) {', '.join(unknown)}{sugg}; valid keys: "
                    f"{', '.join(CAPTION_VARIANTS)}", "dataset.caption.mixed_weights")
        elif any(weight < 0 for weight in c.mixed_weights.values()):
            p.error(f"[dataset.caption] mixed_weights = {as_toml(c.mixed_weights)}: weights must be >= 0",
                    "dataset.caption.mixed_weights")
    if p.ok("dataset.caption.tag_delimiter") and not c.tag_delimiter.strip():
        p.error(f"[dataset.caption] tag_delimiter = {as_toml(c.tag_delimiter)}: tags are split on the trimmed "
                'delimiter, so it needs a visible character, e.g. ", "', "dataset.caption.tag_delimiter")
    if c.protected_tags_file is not None and ctx.base_dir is not None and p.ok("dataset.caption.protected_tags_file"):
        _read_text_lines(p, "dataset.caption", "protected_tags_file", c.protected_tags_file, ctx.base_dir)


def _texture(t, p: Problems, ctx, w) -> None:
    if p.ok("dataset.texture.canvases"):
        if not t.canvases:
            p.error("[dataset.texture] canvases = []: give at least one [w, h] canvas")
        for cv in t.canvases:
            if len(cv) != 2:
                p.error(f"[dataset.texture] canvases: {as_toml(cv)} is not a [w, h] pair")
                continue
            for side in cv:
                if side <= 0 or side % 16:
                    p.error(f"[dataset.texture] canvases: {as_toml(cv)} has side {side}, which is not a positive "
                            "multiple of 16 (VAE factor 8 x patch 2)")
                elif side > ROPE_SIDE_LIMIT:
                    p.error(f"[dataset.texture] canvases: {as_toml(cv)} has side {side} > {ROPE_SIDE_LIMIT}, past "
                            f"the model's RoPE position table; use sides <= {ROPE_SIDE_DECLARED}")
                elif side > ROPE_SIDE_DECLARED:
                    p.warnings.append(f"[dataset.texture] canvases: {as_toml(cv)} has side {side} > "
                                      f"{ROPE_SIDE_DECLARED}; RoPE extrapolates past the declared range")
    if p.ok("dataset.texture.mask_ratio"):
        mr = t.mask_ratio
        if len(mr) != 2 or not (0 < mr[0] <= mr[1] <= 1):
            p.error(f"[dataset.texture] mask_ratio = {as_toml(mr)}: need a pair [lo, hi] with 0 < lo <= hi <= 1")


# ------------------------------------------------------------------------------------------------ [adapter], LRs


def _adapter(a, p: Problems, ctx, w) -> None:
    if p.ok("adapter.components"):
        dup = sorted({c for c in a.components if a.components.count(c) > 1})
        if dup:
            p.error(f"[adapter] components = {as_toml(a.components)}: {', '.join(dup)} listed twice",
                    "adapter.components")
    adapters.check_config(a, _AdapterRules(p, type(a)()))


def _component_lrs(cfg, p: Problems, ctx, w) -> None:
    a, lrs = cfg.adapter, cfg.component_lr
    if not p.ok("adapter.kind", "adapter.components", "adapter.train_llm_adapter", "adapter.train_text_encoder",
                "optimizer.lr", *(f"component_lr.{k}" for k in COMPONENT_LR_KEYS)):
        return
    injected = cfg.injected_components()
    full = adapters.method(a.kind).trains_base
    if not full:
        defaults = type(lrs)()
        for comp in COMPONENT_LR_KEYS:
            value = getattr(lrs, comp)
            if comp not in injected and value not in (None, 0.0) and value != getattr(defaults, comp):
                how = {"llm_adapter": "set [adapter] train_llm_adapter = true",
                       "text_encoder": "set [adapter] train_text_encoder = true"}.get(
                    comp, f'add "{comp}" to [adapter] components')
                p.error(f"[component_lr] {comp} = {as_toml(value)}, but no adapter is injected into {comp} "
                        f"([adapter] components = {as_toml(a.components)}); {how}, or remove the key")
    effective = cfg.component_learning_rates()
    if not any(lr > 0 for lr in effective.values()):
        shown = ", ".join(f"{k} = {as_toml(v)}" for k, v in effective.items()) or "none"
        p.error(f"nothing to train: every trainable component is frozen ({shown}; [adapter] kind = "
                f"{as_toml(a.kind)}, components = {as_toml(a.components)}); give one a non-zero [component_lr] "
                "or add components")
        return
    written = ctx.given("component_lr", lrs)
    if not full:
        for comp in injected:
            if effective[comp] == 0.0 and comp not in written:
                p.warnings.append(f"[adapter] injects an adapter into {comp}, but [component_lr] {comp} defaults "
                                  f"to 0.0 (frozen); set [component_lr] {comp} to train it")
    if a.train_text_encoder and lrs.text_encoder is None:
        p.warnings.append(f"[adapter] train_text_encoder = true with [component_lr] text_encoder unset: the "
                          f"Qwen3 LoRA inherits optimizer.lr = {cfg.optimizer.lr}, normally far too high for it")


def _adapter_base(cfg, p: Problems, ctx, w) -> None:
    """The chosen method's rules on the base weights (adapters.BaseFacts): a method's own check sees only [adapter]."""
    if p.ok("adapter.kind", "train.base_matmul", "quant.mode", "train.swap_blocks"):
        # swap_blocks = "auto" swaps none for a method that refuses a swap (training/plan.swap_unavailable asks it)
        swap = cfg.train.swap_blocks if isinstance(cfg.train.swap_blocks, int) else 0
        facts = adapters.BaseFacts(matmul=cfg.train.base_matmul, quant=cfg.quant.mode, swap_blocks=swap)
        adapters.check_base(cfg.adapter, facts, _AdapterRules(p, type(cfg.adapter)()))


class _AdapterRules:
    """The adapters' view of the problem collector (adapters.Rules): [adapter] key names, our TOML spelling."""

    def __init__(self, p: Problems, defaults) -> None:
        self.p, self.defaults = p, defaults

    def ok(self, *keys: str) -> bool:
        return self.p.ok(*(f"adapter.{k}" for k in keys))

    def error(self, message: str, key: str | None = None) -> None:
        self.p.error(message, *([f"adapter.{key}"] if key else []))

    toml = staticmethod(as_toml)

    def default(self, key: str):
        return getattr(self.defaults, key)


# ------------------------------------------------------------------------------------------------ [quant]

_WEIGHTS_DTYPE = re.compile(r"u?int([1-9]|1[0-6])|float8_e4m3fn|float8_e5m2|float16|bfloat16|float32"
                            r"|float\d+_e\d+m\d+(fn)?u?")


def _quant_mode(cfg, p: Problems, ctx, w) -> None:
    q, kind = cfg.quant, cfg.adapter.kind
    if p.ok("quant.mode", "adapter.kind"):
        full = adapters.method(kind).trains_base
        if q.mode == "frozen" and full:
            p.error('[quant] mode = "frozen" quantizes a base that an adapter trains on, but [adapter] kind = '
                    '"none" (full finetune); use mode = "training" for a quantized full finetune, or an adapter')
        if q.mode == "training" and not full:
            p.error(f'[quant] mode = "training" quantizes the trained weights (full finetune), but [adapter] '
                    f'kind = {as_toml(kind)}; use mode = "frozen" under an adapter, or kind = "none"')


def _quant_dtype(q, p: Problems, ctx, w) -> None:
    if p.ok("quant.weights_dtype") and not _WEIGHTS_DTYPE.fullmatch(q.weights_dtype):
        p.error(f"[quant] weights_dtype = {as_toml(q.weights_dtype)}: not an SDNQ weight dtype; use e.g. "
                '"int8", "uint8", "int4" or "float8_e4m3fn"')


# ------------------------------------------------------------------------------------------------ [flow]


def _flow(f, p: Problems, ctx, w) -> None:
    if p.ok("flow.shift", "flow.flux_shift") and f.shift is not None and f.flux_shift:
        p.error("[flow] shift and flux_shift = true are both set, but they are exclusive; use one (flux_shift picks "
                "the shift from the resolution, shift is static)")
    if (p.ok("flow.sigmoid_scale", "flow.timestep_sample_method", "flow.shift") and f.sigmoid_scale != 1.0
            and not (f.timestep_sample_method == "logit_normal" and f.shift in (None, 1.0))):
        why = ("it only shapes logit_normal" if f.timestep_sample_method != "logit_normal"
               else f"shift = {as_toml(f.shift)} already reshapes the distribution")
        p.error(f"[flow] sigmoid_scale = {as_toml(f.sigmoid_scale)} is rejected here ({why}); set it back to 1.0, "
                'or use timestep_sample_method = "logit_normal" with shift unset or 1.0')
    if p.ok("flow.use_ot") and f.use_ot and importlib.util.find_spec("scipy") is None:
        p.error("[flow] use_ot = true needs scipy (linear_sum_assignment), which is not importable; install "
                "scipy or set use_ot = false")


# ------------------------------------------------------------------------------------------------ [[curriculum]]


def _texture_source(cfg, p: Problems, ctx, w) -> None:
    # First of all texture rules: a texture phase is impossible without per-step encoding, whatever else is set.
    for i, ph in enumerate(cfg.curriculum):
        if (p.ok(f"curriculum[{i}].mode", "dataset.source") and ph.mode == "texture"
                and cfg.dataset.source != "encode"):
            p.error(f'{table_label("curriculum", i)} mode = "texture" needs [dataset] source = "encode" (a crop is '
                    f'chosen per sample per step, so no cached latent can express it); it is '
                    f'{as_toml(cfg.dataset.source)}')


def _phase(ph, p: Problems, ctx, w) -> None:
    key = f"{w.dotted}.t_range"
    if p.ok(key):
        tr = ph.t_range
        if len(tr) != 2:
            p.error(f"{w.toml_label} t_range = {as_toml(tr)}: must be a pair [lo, hi]", key)
        elif any(v > 1 for v in tr):
            fixed = [v / 1000 for v in tr]
            p.error(f"{w.toml_label} t_range = {as_toml(tr)} looks like discrete timesteps, divide by 1000: "
                    f"t_range = {as_toml(fixed)} (timesteps are continuous in [0, 1])", key)
        elif not (0 <= tr[0] < tr[1] <= 1):
            p.error(f"{w.toml_label} t_range = {as_toml(tr)}: need 0 <= lo < hi <= 1", key)


def _phase_order(cfg, p: Problems, ctx, w) -> None:
    phases = cfg.curriculum
    if not all(p.ok(f"curriculum[{i}].at") for i in range(len(phases))) or not phases:
        return
    ats = [ph.at for ph in phases]
    dups = sorted({a for a in ats if ats.count(a) > 1})
    if dups:
        p.error(f"[[curriculum]] several phases start at the same at = {', '.join(as_toml(a) for a in dups)}; each "
                "phase needs its own start")
    first = min(ats)
    if first != 0.0:
        p.error(f"[[curriculum]] the first phase starts at {as_toml(first)}; add a phase with at = 0.0 "
                "(training must start inside a phase)")


# ------------------------------------------------------------------------------------------------ [optimizer]


def _optimizer(o, p: Problems, ctx, w) -> None:
    if p.ok("optimizer.kind", "optimizer.betas"):
        betas = o.betas
        if o.kind == "came" and len(betas) != 3:
            p.error(f'[optimizer] betas = {as_toml(list(betas))}: kind = "came" needs 3 betas (first moment, second '
                    f"moment, instability), e.g. betas = {as_toml(CAME_BETAS)} (CAME's defaults)")
        elif o.kind != "came" and len(betas) != 2:
            p.error(f"[optimizer] betas = {as_toml(list(betas))}: kind = {as_toml(o.kind)} needs 2 betas, e.g. "
                    "betas = [0.9, 0.95]")
        elif any(not 0.0 <= b < 1.0 for b in betas):
            p.error(f"[optimizer] betas = {as_toml(list(betas))}: every beta must be in [0, 1)")
    if p.ok("optimizer.kind") and o.kind == "adamw":
        sdnq_only = [k for k in ("quantize_state", "offload_state") if getattr(o, k)]
        if sdnq_only:
            p.error(f'[optimizer] {", ".join(sdnq_only)} = true only works with an SDNQ optimizer, but kind = '
                    f'"adamw" (torch); use e.g. kind = "adamw8bit", or remove the key(s)')



def _kahan_adamw_dtype(cfg, p: Problems, ctx, w) -> None:
    o = cfg.optimizer
    if p.ok("optimizer.kind", "optimizer.use_kahan", "train.dtype") and o.kind == "adamw" and o.use_kahan \
            and cfg.train.dtype == "float16":
        p.error('[optimizer] use_kahan = true with kind = "adamw" keeps the moments in the weights\' dtype, where '
                'float16 under- and overflows: set [train] dtype = "bfloat16", or use kind = "adamw8bit" with '
                "use_kahan = true")


# ------------------------------------------------------------------------------------------------ [sample], [logging]


def _read_text_lines(p: Problems, table: str, key: str, value: str, base_dir: Path) -> tuple[Path, list[str] | None]:
    """The path of a UTF-8 text file a config key names (relative to the config file's folder) and its lines, or
    None for the lines after reporting why it cannot be read."""
    path = named_path(value, base_dir)
    lines = text_lines(path)
    if isinstance(lines, FileNotFoundError):
        p.error(f"[{table}] {key} = {as_toml(value)}: file not found ({path}); relative paths are read from the "
                f"config file's folder", f"{table}.{key}")
    elif isinstance(lines, Exception):
        p.error(f"[{table}] {key} = {as_toml(value)}: cannot read {path} as UTF-8 text ({lines})", f"{table}.{key}")
    else:
        return path, lines
    return path, None


def _sample_size(s, p: Problems, ctx, w) -> None:
    for name in ("width", "height"):
        if p.ok(f"sample.{name}") and getattr(s, name) % 16:
            value = getattr(s, name)
            p.error(f"[sample] {name} = {value}: must be a multiple of 16 (VAE factor 8 x patch 2), e.g. "
                    f"{max(16, 16 * round(value / 16))}", f"sample.{name}")


def _sample_prompts_file(s, p: Problems, ctx, w) -> None:
    if s.prompts_file is not None and ctx.base_dir is not None and p.ok("sample.prompts_file"):
        path, lines = _read_text_lines(p, "sample", "prompts_file", s.prompts_file, ctx.base_dir)
        if lines is not None:
            if not prompt_lines(lines):
                p.error(f"[sample] prompts_file = {as_toml(s.prompts_file)}: {path} has no prompt (one per line; "
                        f"lines starting with # are comments)", "sample.prompts_file")


def _tensorboard(lg, p: Problems, ctx, w) -> None:
    if lg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        p.error("[logging] tensorboard = true needs the tensorboard package, which is not installed: pip install "
                "tensorboard (or the extra: pip install 'comfyui-anima-train[tensorboard]'), or set "
                "tensorboard = false", "logging.tensorboard")


def _sample_when(s, p: Problems, ctx, w) -> None:
    unread = s.prompts_file is not None and ctx.base_dir is None  # built in code: its file's prompts are not known
    if p.ok("sample.prompts", "sample.prompts_file") and not s.all_prompts() and not unread:
        when = [k for k in ("every_n_steps", "every_n_epochs") if getattr(s, k) is not None]
        when += [k for k in ("before_first_step",) if getattr(s, k)]
        if when:
            p.error(f"[sample] {', '.join(when)} set, but there is no prompt to render: add prompts = [\"...\"] "
                    f"or prompts_file = \"prompts.txt\"")


# ------------------------------------------------------------------------------------------------ [validation]


def _validation(v, p: Problems, ctx, w) -> None:
    if v.folder is not None and v.fraction > 0 and p.ok("validation.folder", "validation.fraction"):
        p.error(f"[validation] sets both folder and fraction = {as_toml(v.fraction)}; keep one: folder = a held-out "
                f"image folder, or fraction = the share of the dataset to hold out", "validation.fraction")
    if p.ok("validation.timesteps"):
        bad = [t for t in v.timesteps if not 0 < t < 1]
        if not v.timesteps or bad:
            p.error(f"[validation] timesteps = {as_toml(v.timesteps)}: give at least one timestep, each strictly "
                    f"between 0 and 1, e.g. [0.1, 0.5, 0.9]", "validation.timesteps")
    if v.folder is not None and ctx.base_dir is not None and p.ok("validation.folder"):
        path = named_path(v.folder, ctx.base_dir)
        if not path.is_dir():
            p.error(f"[validation] folder = {as_toml(v.folder)}: no such folder ({path}); relative paths are read "
                    f"from the config file's folder", "validation.folder")
    if not v.enabled and p.ok("validation.every_n_steps", "validation.every_n_epochs"):
        when = [k for k in ("every_n_steps", "every_n_epochs") if getattr(v, k) is not None]
        if when:
            p.error(f"[validation] {', '.join(when)} set, but there is nothing to evaluate: add folder = "
                    f"\"held_out/\" or fraction = 0.1")


# (scope, rule), in the order their messages are listed; "" = across tables (run for a whole Config only)
RULES = [
    ("", _texture_source),
    ("dataset", _tiers),
    ("train", _checkpoint_blocks),
    ("", _swap_blocks),
    ("", _base_matmul),
    ("train", _batch_size),
    ("", _batch_size_tiers),
    ("dataset", _sources),
    ("dataset", _buckets),
    ("dataset.caption", _caption),
    ("", _text_cache),
    ("dataset.texture", _texture),
    ("adapter", _adapter),
    ("", _adapter_base),
    ("", _component_lrs),
    ("", _quant_mode),
    ("quant", _quant_dtype),
    ("flow", _flow),
    ("curriculum", _phase),
    ("", _phase_order),
    ("optimizer", _optimizer),
    ("", _kahan_adamw_dtype),
    ("sample", _sample_size),
    ("sample", _sample_prompts_file),
    ("logging", _tensorboard),
    ("sample", _sample_when),
    ("validation", _validation),
]
