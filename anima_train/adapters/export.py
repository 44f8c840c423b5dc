"""Checkpoint files that ComfyUI (and, for LoRA, diffusers) load without conversion: what every method's file shares.

The trainer holds peft-adapted diffusers models; each method's `model.py` turns its adapter into tensors under
ComfyUI's key names (`state_dict`), and this module writes them:

    save_adapter(path, transformer, text_conditioner, metadata, kind="lora", fmt="peft")  # any adapter method
    adapter_state_dict(transformer, text_conditioner, kind="lokr")                         # the tensors only
    save_text_encoder_lora(path, text_encoder, metadata)          # <stem>_te: lora_te_<qwen path_>.* (every kind)
    metadata = training_metadata(kind="lora", title=..., rank=32, alpha=32, steps=..., ...)
    write_safetensors(path, tensors, metadata)                    # atomic; refuses to replace unless overwrite=True

Key names: ComfyUI's model keys are `diffusion_model.<native module>` (native = the released checkpoint's names,
keymaps.dit_module_to_native; the conditioner under `llm_adapter.`); diffusers' Anima LoRA loader expects the same
prefix. peft's `.default` adapter suffix never reaches a key. What each method writes, and how its alpha reproduces
peft's scaling under ComfyUI's `alpha / rank` rule, is in `<method>/model.py`.

Text encoder: ComfyUI maps a single-TE model's `<te>.transformer.model.<path>` to `lora_te_<path with _>`
(comfy/lora.py `model_lora_keys_clip`, "kohya anima" rule), so Qwen3 LoRA keys are
`lora_te_layers_N_self_attn_q_proj.lora_down/lora_up/alpha` with `.alpha` = s·r (ComfyUI applies alpha/rank).

Every file carries sd-scripts style `ss_*` keys and ModelSpec 1.0.1 `modelspec.*` keys (all strings), and is written
atomically (temp file in the same folder + os.replace). An existing file is only replaced with `overwrite=True`.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer

from anima_train import __version__, adapters
from anima_train.model import keymaps
from anima_train.model.shape import BaseModel
from anima_train.adapters.base import ADAPTER_NAME
from anima_train.files import atomic_path
from anima_train.config import LORA_FORMATS

DIFFUSION_PREFIX = "diffusion_model."  # ComfyUI's model key prefix; diffusers' Anima LoRA loader expects it too
KOHYA_UNET_PREFIX = "lora_unet_"
KOHYA_TE_PREFIX = "lora_te_"
FORMATS = LORA_FORMATS  # [adapter] output_format

# ModelSpec (https://github.com/Stability-AI/ModelSpec) values. sd-scripts writes "anima-preview" for the preview
# model. The architecture is the family and its depth, read from the model trained ("anima-28-blocks" for the 2B
# base, aesthetic and turbo alike, "anima-40-blocks" for the 2.9B): the same weights' names go to sd-scripts' keys,
# ss_sd_model_name (the single file convert read) and ss_new_sd_model_hash (its sha256). ComfyUI reads
# ss_base_model_version ("anima") and ss_tag_frequency of a LoRA (app/assets/services/metadata_extract.py), no
# modelspec key but modelspec.base_model and modelspec.air, which we do not write.
MODELSPEC_VERSION = "1.0.1"
ARCHITECTURE = "anima"
IMPLEMENTATION_NATIVE = "https://huggingface.co/circlestone-labs/Anima"
IMPLEMENTATION_DIFFUSERS = "diffusers"
BASE_MODEL_VERSION = "anima"  # ss_base_model_version
STEP_KEY, RUN_KEY = "ss_steps", "ss_output_name"  # where the global step and the run name are recorded

TE_LORA = "te_lora"  # training_metadata's kind for the Qwen3 `_te` file (a LoRA whatever the method)


# ----------------------------------------------------------------------------------------------------------
# Metadata


def architecture(base_model: BaseModel | None) -> str:
    blocks = base_model.blocks if base_model is not None else None
    return ARCHITECTURE if blocks is None else f"{ARCHITECTURE}-{blocks}-blocks"


def training_metadata(*, kind: str, title: str, rank: int | None = None, alpha: float | None = None,
                      resolution: int | list[int] | tuple | None = None, steps: int | None = None,
                      epoch: int | None = None, num_epochs: int | None = None, max_steps: int | None = None,
                      tag_frequency: Mapping | None = None, training_config: Mapping | str | None = None,
                      network_args: Mapping | None = None, implementation: str = IMPLEMENTATION_NATIVE,
                      extra: Mapping | None = None, base_model: BaseModel | None = None) -> dict[str, str]:
    """sd-scripts `ss_*` + ModelSpec `modelspec.*` keys for one checkpoint file (values are strings).

    kind: an adapter method's name (lora, lokr, full, ...: adapters.METHODS) or te_lora (the Qwen3 file).
    resolution: one side (1024) or the tier list ([768, 1024]).
    tag_frequency: {dataset folder: {tag: count}} (sd-scripts layout). training_config: a dict (JSON-encoded here)
    or the JSON text itself. extra: more keys, written as given (stringified). base_model: the model trained
    (model/shape.py base_model), named in the architecture and sd-scripts' model keys."""
    names = [m.name for m in adapters.METHODS.values()] + [TE_LORA]
    if kind not in names:
        raise ValueError(f"kind must be one of {sorted(names)}, got {kind!r}")
    method = adapters.by_name("lora" if kind == TE_LORA else kind)
    tiers = [resolution] if isinstance(resolution, int) else list(resolution or [])
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    md: dict[str, object] = {
        "modelspec.sai_model_spec": MODELSPEC_VERSION,
        "modelspec.architecture": architecture(base_model) + method.architecture,
        "modelspec.implementation": implementation,
        "modelspec.implementation_version": f"anima-train/{__version__}",
        "modelspec.title": title,
        "modelspec.date": now.isoformat(),
        "modelspec.prediction_type": "flow",  # rectified flow, velocity target (docs/model.md#flow-matching)
        "ss_base_model_version": BASE_MODEL_VERSION,
        RUN_KEY: title,
        "ss_training_finished_at": str(now.timestamp()),
    }
    if base_model is not None:
        md["ss_sd_model_name"] = base_model.name
        md["ss_new_sd_model_hash"] = base_model.sha256
    if tiers:
        md["modelspec.resolution"] = f"{max(tiers)}x{max(tiers)}"
        md["ss_resolution"] = f"({max(tiers)}, {max(tiers)})"  # sd-scripts writes a tuple string
        if len(tiers) > 1:
            md["ss_resolution_tiers"] = json.dumps(sorted(tiers))
    if method.network_module is not None:
        md["ss_network_module"] = method.network_module
        if rank is not None:
            md["ss_network_dim"] = rank
        if alpha is not None:
            md["ss_network_alpha"] = alpha
        args = {**method.network_args, **(network_args or {})}
        if args:
            md["ss_network_args"] = json.dumps(args, sort_keys=True)
    for key, value in (("ss_steps", steps), ("ss_epoch", epoch), ("ss_num_epochs", num_epochs),
                       ("ss_max_train_steps", max_steps)):
        if value is not None:
            md[key] = value
    if tag_frequency is not None:
        md["ss_tag_frequency"] = json.dumps(tag_frequency, ensure_ascii=False, sort_keys=True)
    if training_config is not None:
        md["ss_training_config"] = (training_config if isinstance(training_config, str)
                                    else json.dumps(training_config, default=str, sort_keys=True))
    md.update(extra or {})
    return {k: v if isinstance(v, str) else json.dumps(v) if isinstance(v, (dict, list)) else str(v)
            for k, v in md.items() if v is not None}


# ----------------------------------------------------------------------------------------------------------
# Reading peft adapters off the models (used by the methods' state_dict)


def module_path(name: str) -> str:
    """Plain module path: drops torch.compile's `_orig_mod.` (whole-model or per-block), DDP's `module.` and a
    PeftModel's `base_model.model.` (diffusers' add_adapter adds none of them)."""
    name = name.replace("_orig_mod.", "")
    for prefix in ("module.", "base_model.model."):
        name = name.removeprefix(prefix)
    return name


def native_key(part: str, name: str) -> str:
    """`diffusion_model.<native module>`: ComfyUI's key stem for a diffusers module of `part` (transformer |
    text_conditioner)."""
    name = module_path(name)
    if part == "transformer":
        return DIFFUSION_PREFIX + keymaps.dit_module_to_native(name)
    if part == "text_conditioner":
        return DIFFUSION_PREFIX + keymaps.ADAPTER_PREFIX + name
    raise ValueError(part)


def parts(transformer, text_conditioner) -> list[tuple[str, torch.nn.Module]]:
    """(part, model) of the models given (the conditioner is None when it carries no adapter)."""
    return [(p, m) for p, m in (("transformer", transformer), ("text_conditioner", text_conditioner))
            if m is not None]


def adapted_layers(model, adapter_name: str, what: str, layer_type: type, linear_type: type):
    """(module path, layer) of every peft `layer_type` layer of `model` holding `adapter_name`. A layer on anything but
    a Linear (`linear_type`: the method's peft Linear class) is refused: the trainer adapts Linears, and the files'
    layouts are those of Linears."""
    for name, module in model.named_modules():
        if not isinstance(module, layer_type) or adapter_name not in getattr(module, "scaling", {}):
            continue
        if not isinstance(module, linear_type):
            raise ValueError(f"{what}.{name}: only adapters on Linear layers are exported (got "
                             f"{type(module.get_base_layer()).__name__}); leave it out of the target modules")
        yield module_path(name), module


def lora_layers(model, adapter_name: str, what: str):
    """(module path, A [r,in], B [out,r], scaling, rank) for every peft LoRA layer holding `adapter_name` (the LoRA
    method's file and the Qwen3 `_te` file). A DoRA layer (or one with lora_bias) is refused: a LoRA file would
    drop its magnitude."""
    for name, module in adapted_layers(model, adapter_name, what, LoraLayer, LoraLinear):
        if module.use_dora.get(adapter_name) or module.lora_bias.get(adapter_name):
            raise ValueError(f"{what}.{name}: DoRA / lora_bias adapters cannot be exported as plain LoRA files")
        yield (name, module.lora_A[adapter_name].weight, module.lora_B[adapter_name].weight,
               float(module.scaling[adapter_name]), int(module.r[adapter_name]))


def refuse_kohya(title: str, fmt: str, keys: str) -> None:
    """A LyCORIS-style method's file exists in one layout: `diffusion_model.<module>.<keys>` (fmt "peft")."""
    if fmt != "peft":
        raise ValueError(f"{title} cannot be exported with fmt={fmt!r}: the kohya lora_unet_* layout only defines "
                         f"LoRA (lora_down/lora_up/alpha); {title} is written as diffusion_model.<module>.{keys} "
                         f"(fmt='peft'), which ComfyUI loads")


def cast(sd: dict, dtype: torch.dtype | None) -> dict:
    """Factors to `dtype` (alphas stay fp32 scalars: ComfyUI reads them with .item())."""
    if dtype is None:
        return sd
    return {k: v if k.endswith(".alpha") else v.to(dtype) for k, v in sd.items()}


def check_plain(model, what: str) -> None:
    """Refuse a model that still carries peft layers where the plain model is written (full finetune)."""
    if any(isinstance(m, BaseTunerLayer) for m in model.modules()):
        raise ValueError(f"{what} still carries peft adapter layers; a full-finetune export needs the plain model "
                         f"(merge_and_unload() first, or export the adapter with save_adapter)")


def text_encoder_lora_state_dict(text_encoder, adapter_name: str = ADAPTER_NAME,
                                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Qwen3Model LoRA -> `lora_te_<path with _>.lora_down.weight / .lora_up.weight / .alpha` (ComfyUI keys)."""
    out = {}
    for name, a, b, scaling, rank in lora_layers(text_encoder, adapter_name, "text_encoder"):
        name = name.removeprefix("model.")  # a Qwen3ForCausalLM-style wrapper; ComfyUI's path starts at layers.
        base = KOHYA_TE_PREFIX + name.replace(".", "_")
        out[f"{base}.lora_down.weight"] = a.detach().float()
        out[f"{base}.lora_up.weight"] = b.detach().float()
        out[f"{base}.alpha"] = torch.tensor(scaling * rank)
    if not out:
        raise ValueError(f"no peft LoRA adapter named {adapter_name!r} on the text encoder")
    return cast(out, dtype)


def adapter_state_dict(transformer, text_conditioner=None, *, kind: str = "lora", fmt: str = "peft",
                       adapter_name: str = ADAPTER_NAME, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The file tensors of the `kind` adapter on the DiT (and the conditioner, when given)."""
    return adapters.method(kind).runtime().state_dict(transformer, text_conditioner, fmt=fmt,
                                                      adapter_name=adapter_name, dtype=dtype)


# ----------------------------------------------------------------------------------------------------------
# Writing


def _claim_path(path: str | os.PathLike, overwrite: bool) -> Path:
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; pass overwrite=True to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping | None = None,
                      overwrite: bool = False) -> Path:
    """Atomic safetensors write: temp file in the same folder, then os.replace."""
    path = _claim_path(path, overwrite)
    md = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}}
    with atomic_path(path) as tmp:
        safetensors.torch.save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp),
                                    metadata=md)
    return path


def save_adapter(path, transformer, text_conditioner=None, metadata: Mapping | None = None, *, kind: str = "lora",
                 fmt: str = "peft", adapter_name: str = ADAPTER_NAME, dtype: torch.dtype | None = None,
                 overwrite: bool = False) -> Path:
    """The `kind` adapter of the DiT (and the LLM adapter, if it has one) -> one ComfyUI-loadable file.
    fmt="kohya" (LoRA only): sd-scripts' `lora_unet_*` layout."""
    sd = adapter_state_dict(transformer, text_conditioner, kind=kind, fmt=fmt, adapter_name=adapter_name, dtype=dtype)
    return write_safetensors(path, sd, metadata, overwrite)


def save_adapter_checkpoint(state_dict, path: Path, models: dict, cfg, metadata: Mapping, dtype) -> Path:
    """An adapter method's save_checkpoint: its `state_dict` of the DiT (+ the conditioner when train_llm_adapter)
    in [adapter] output_format, replacing a file of the same name."""
    conditioner = models["text_conditioner"] if cfg.adapter.train_llm_adapter else None
    tensors = state_dict(models["transformer"], conditioner, fmt=cfg.adapter.output_format, dtype=dtype)
    return write_safetensors(path, tensors, metadata, overwrite=True)


def text_encoder_lora_path(path: str | os.PathLike) -> Path:
    """`<stem>.safetensors` -> `<stem>_te.safetensors`."""
    path = Path(path)
    return path.with_name(f"{path.stem}_te{path.suffix or '.safetensors'}")


def save_text_encoder_lora(path, text_encoder, metadata: Mapping | None = None, adapter_name: str = ADAPTER_NAME,
                           dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Qwen3 LoRA -> its own file (pass `text_encoder_lora_path(main_file)` for the `_te` sibling); ComfyUI
    applies it through LoraLoader's clip input."""
    return write_safetensors(path, text_encoder_lora_state_dict(text_encoder, adapter_name, dtype), metadata,
                             overwrite)
