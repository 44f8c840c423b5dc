"""Checkpoint files that ComfyUI (and, for LoRA, diffusers) load without conversion.

The trainer holds peft-adapted diffusers models; these functions turn them into files:

    save_lora(path, transformer, text_conditioner, metadata, fmt="peft")     # diffusion_model.<native>.lora_A/B
    save_lora(path, transformer, text_conditioner, metadata, fmt="kohya")    # lora_unet_<native_>.lora_down/up/alpha
    save_lokr(path, transformer, text_conditioner, metadata)                 # diffusion_model.<native>.lokr_*
    save_text_encoder_lora(path, text_encoder, metadata)                     # <stem>_te: lora_te_<qwen path_>.*
    save_full_native(path, transformer, text_conditioner, metadata)          # net.* single file (685 tensors)
    save_full_diffusers(folder, transformer, text_conditioner, metadata)     # transformer/ + text_conditioner/
    metadata = training_metadata(kind="lora", title=..., rank=32, alpha=32, steps=..., ...)

Scale conventions (why the files look the way they do; docs/model.md#scale-conventions, #what-the-loaders-accept):
- peft LoRA: ΔW = B·A·s with s = peft's `scaling` (alpha/r, or alpha/√r with rsLoRA). diffusers'
  AnimaLoraLoaderMixin rejects `.alpha` keys and assumes alpha = r without metadata; ComfyUI uses scale 1 without
  `.alpha`. So s is folded into lora_B and no `.alpha` is written: both apply exactly ΔW.
- kohya LoRA: ComfyUI applies alpha/rank with rank = lora_down.shape[0], so `.alpha` = s·r reproduces s.
- LoKr: peft applies s to kron(w1, w2) always; ComfyUI applies alpha/dim only when a factor is decomposed
  (dim = lokr_w2_b.shape[0], else lokr_w1_b.shape[0]) and ignores alpha otherwise. So decomposed modules get
  `.alpha` = s·dim, and modules with two full factors get s folded into lokr_w1 (no `.alpha`). peft's `.default`
  adapter suffix never reaches a key. LoKr in the kohya `lora_unet_*` layout is refused (see save_lokr).
- Text encoder: ComfyUI maps a single-TE model's `<te>.transformer.model.<path>` to `lora_te_<path with _>`
  (comfy/lora.py `model_lora_keys_clip`, "kohya anima" rule), so Qwen3 LoRA keys are
  `lora_te_layers_N_self_attn_q_proj.lora_down/lora_up/alpha`.

Every file carries sd-scripts style `ss_*` keys and ModelSpec 1.0.1 `modelspec.*` keys (all strings), and is written
atomically (temp file in the same folder + os.replace). An existing file is only replaced with `overwrite=True`.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from anima_train import __version__
from anima_train.model import keymaps
from anima_train.files import atomic_path, publish_dir
from anima_train.config import LORA_FORMATS

DIFFUSION_PREFIX = "diffusion_model."  # ComfyUI's model key prefix; diffusers' Anima LoRA loader expects it too
KOHYA_UNET_PREFIX = "lora_unet_"
KOHYA_TE_PREFIX = "lora_te_"
FORMATS = LORA_FORMATS  # [adapter] output_format

# ModelSpec (https://github.com/Stability-AI/ModelSpec) values. sd-scripts writes "anima-preview" for the preview
# model and IMPL_ANIMA below; we name the released base model.
MODELSPEC_VERSION = "1.0.1"
ARCHITECTURE = "anima-base-v1.0"
IMPLEMENTATION_NATIVE = "https://huggingface.co/circlestone-labs/Anima"
IMPLEMENTATION_DIFFUSERS = "diffusers"
BASE_MODEL_VERSION = "anima"  # ss_base_model_version
STEP_KEY, RUN_KEY = "ss_steps", "ss_output_name"  # where the global step and the run name are recorded

NETWORK_MODULE = {"lora": "networks.lora", "te_lora": "networks.lora", "lokr": "lycoris.kohya"}
ARCH_SUFFIX = {"lora": "/lora", "te_lora": "/lora", "lokr": "/lycoris", "full": ""}


# ----------------------------------------------------------------------------------------------------------
# Metadata


def training_metadata(*, kind: str, title: str, rank: int | None = None, alpha: float | None = None,
                      resolution: int | list[int] | tuple | None = None, steps: int | None = None,
                      epoch: int | None = None, num_epochs: int | None = None, max_steps: int | None = None,
                      tag_frequency: Mapping | None = None, training_config: Mapping | str | None = None,
                      network_args: Mapping | None = None, implementation: str = IMPLEMENTATION_NATIVE,
                      extra: Mapping | None = None) -> dict[str, str]:
    """sd-scripts `ss_*` + ModelSpec `modelspec.*` keys for one checkpoint file (values are strings).

    kind: lora | lokr | te_lora | full. resolution: one side (1024) or the tier list ([768, 1024]).
    tag_frequency: {dataset folder: {tag: count}} (sd-scripts layout). training_config: a dict (JSON-encoded here)
    or the JSON text itself. extra: more keys, written as given (stringified)."""
    if kind not in ARCH_SUFFIX:
        raise ValueError(f"kind must be one of {sorted(ARCH_SUFFIX)}, got {kind!r}")
    tiers = [resolution] if isinstance(resolution, int) else list(resolution or [])
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    md: dict[str, object] = {
        "modelspec.sai_model_spec": MODELSPEC_VERSION,
        "modelspec.architecture": ARCHITECTURE + ARCH_SUFFIX[kind],
        "modelspec.implementation": implementation,
        "modelspec.implementation_version": f"anima-train/{__version__}",
        "modelspec.title": title,
        "modelspec.date": now.isoformat(),
        "modelspec.prediction_type": "flow",  # rectified flow, velocity target (docs/model.md#flow-matching)
        "ss_base_model_version": BASE_MODEL_VERSION,
        RUN_KEY: title,
        "ss_training_finished_at": str(now.timestamp()),
    }
    if tiers:
        md["modelspec.resolution"] = f"{max(tiers)}x{max(tiers)}"
        md["ss_resolution"] = f"({max(tiers)}, {max(tiers)})"  # sd-scripts writes a tuple string
        if len(tiers) > 1:
            md["ss_resolution_tiers"] = json.dumps(sorted(tiers))
    if kind != "full":
        md["ss_network_module"] = NETWORK_MODULE[kind]
        if rank is not None:
            md["ss_network_dim"] = rank
        if alpha is not None:
            md["ss_network_alpha"] = alpha
        args = dict(network_args or {})
        if kind == "lokr":
            args.setdefault("algo", "lokr")
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
# Reading peft adapters off the models


def _module_path(name: str) -> str:
    """Plain module path: drops torch.compile's `_orig_mod.` (whole-model or per-block), DDP's `module.` and a
    PeftModel's `base_model.model.` (diffusers' add_adapter adds none of them)."""
    name = name.replace("_orig_mod.", "")
    for prefix in ("module.", "base_model.model."):
        name = name.removeprefix(prefix)
    return name


def _plain_state_dict(model) -> dict:
    """Plain tensors under clean names; SDNQ-quantized weights (quant.mode = "training") are dequantized."""
    from anima_train.model.quant import dequantized_state_dict

    return {_module_path(k): v for k, v in dequantized_state_dict(model).items()}


def _native_module(part: str, name: str) -> str:
    """Module path inside the native DiT file for a diffusers module of `part` (transformer | text_conditioner)."""
    if part == "transformer":
        return keymaps.dit_module_to_native(name)
    if part == "text_conditioner":
        return keymaps.ADAPTER_PREFIX + name
    raise ValueError(part)


def _lora_layers(model, adapter_name: str, what: str):
    """(module path, A [r,in], B [out,r], scaling, rank) for every peft LoRA layer holding `adapter_name`."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if adapter_name in getattr(module, "lora_embedding_A", {}):
            raise ValueError(f"{what}.{name}: LoRA on an embedding is not exported (ComfyUI/diffusers layouts "
                             f"cover Linear layers); leave embeddings out of the adapter's target modules")
        if adapter_name not in module.lora_A:
            continue
        if module.use_dora.get(adapter_name) or module.lora_bias.get(adapter_name):
            raise ValueError(f"{what}.{name}: DoRA / lora_bias adapters cannot be exported as plain LoRA files")
        if not isinstance(module.lora_A[adapter_name], torch.nn.Linear):
            raise ValueError(f"{what}.{name}: only LoRA on Linear layers is exported (got "
                             f"{type(module.lora_A[adapter_name]).__name__})")
        yield (_module_path(name), module.lora_A[adapter_name].weight, module.lora_B[adapter_name].weight,
               float(module.scaling[adapter_name]), int(module.r[adapter_name]))


def _parts(transformer, text_conditioner):
    return [(p, m) for p, m in (("transformer", transformer), ("text_conditioner", text_conditioner))
            if m is not None]


def lora_state_dict(transformer, text_conditioner=None, fmt: str = "peft", adapter_name: str = "default",
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The LoRA file's tensors (see the module docstring for the two layouts)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    out = {}
    for part, model in _parts(transformer, text_conditioner):
        for name, a, b, scaling, rank in _lora_layers(model, adapter_name, part):
            native = _native_module(part, name)
            a, b = a.detach().float(), b.detach().float()
            if fmt == "peft":
                out[f"{DIFFUSION_PREFIX}{native}.lora_A.weight"] = a
                out[f"{DIFFUSION_PREFIX}{native}.lora_B.weight"] = b * scaling  # scale folded, no .alpha key
            else:
                base = KOHYA_UNET_PREFIX + native.replace(".", "_")
                out[f"{base}.lora_down.weight"] = a
                out[f"{base}.lora_up.weight"] = b
                out[f"{base}.alpha"] = torch.tensor(scaling * rank)  # ComfyUI: alpha / lora_down.shape[0]
    if not out:
        raise ValueError(f"no peft LoRA adapter named {adapter_name!r} on the transformer or text_conditioner")
    return _cast(out, dtype)


LOKR_FACTORS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


def lokr_state_dict(transformer, text_conditioner=None, adapter_name: str = "default",
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`diffusion_model.<native>.lokr_*` (+ `.alpha` where a factor is decomposed), keys exactly as ComfyUI reads them."""
    from peft.tuners.lokr.layer import LoKrLayer

    out = {}
    for part, model in _parts(transformer, text_conditioner):
        for name, module in model.named_modules():
            if not isinstance(module, LoKrLayer) or adapter_name not in module.scaling:
                continue
            factors = {f: getattr(module, f)[adapter_name].detach().float()
                       for f in LOKR_FACTORS if adapter_name in getattr(module, f)}
            scaling = float(module.scaling[adapter_name])
            base = f"{DIFFUSION_PREFIX}{_native_module(part, _module_path(name))}"
            # ComfyUI's rank for alpha: w2's when w2 is decomposed, else w1's (comfy/weight_adapter/lokr.py)
            dim = (factors["lokr_w2_b"].shape[0] if "lokr_w2_b" in factors
                   else factors["lokr_w1_b"].shape[0] if "lokr_w1_b" in factors else None)
            if dim is None:
                factors["lokr_w1"] = factors["lokr_w1"] * scaling  # ComfyUI ignores alpha for two full factors
            else:
                out[f"{base}.alpha"] = torch.tensor(scaling * dim)
            out.update({f"{base}.{f}": t for f, t in factors.items()})
    if not out:
        raise ValueError(f"no peft LoKr adapter named {adapter_name!r} on the transformer or text_conditioner")
    return _cast(out, dtype)


def text_encoder_lora_state_dict(text_encoder, adapter_name: str = "default",
                                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Qwen3Model LoRA -> `lora_te_<path with _>.lora_down.weight / .lora_up.weight / .alpha` (ComfyUI keys)."""
    out = {}
    for name, a, b, scaling, rank in _lora_layers(text_encoder, adapter_name, "text_encoder"):
        name = name.removeprefix("model.")  # a Qwen3ForCausalLM-style wrapper; ComfyUI's path starts at layers.
        base = KOHYA_TE_PREFIX + name.replace(".", "_")
        out[f"{base}.lora_down.weight"] = a.detach().float()
        out[f"{base}.lora_up.weight"] = b.detach().float()
        out[f"{base}.alpha"] = torch.tensor(scaling * rank)
    if not out:
        raise ValueError(f"no peft LoRA adapter named {adapter_name!r} on the text encoder")
    return _cast(out, dtype)


def _cast(sd: dict, dtype: torch.dtype | None) -> dict:
    """Factors to `dtype` (alphas stay fp32 scalars: ComfyUI reads them with .item())."""
    if dtype is None:
        return sd
    return {k: v if k.endswith(".alpha") else v.to(dtype) for k, v in sd.items()}


def _check_plain(model, what: str) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    if any(isinstance(m, BaseTunerLayer) for m in model.modules()):
        raise ValueError(f"{what} still carries peft adapter layers; a full-finetune export needs the plain model "
                         f"(merge_and_unload() first, or export the adapter with save_lora/save_lokr)")


def full_native_state_dict(transformer, text_conditioner, dtype: torch.dtype | None = None) -> dict:
    """The native single-file dict (`net.*`, adapter under `net.llm_adapter.*`): same names as the released file."""
    _check_plain(transformer, "transformer")
    _check_plain(text_conditioner, "text_conditioner")
    sd = keymaps.join_anima_native(_plain_state_dict(transformer), _plain_state_dict(text_conditioner))
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in sd.items()}


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
    from safetensors.torch import save_file

    path = _claim_path(path, overwrite)
    md = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}}
    with atomic_path(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=md)
    return path


def save_lora(path, transformer, text_conditioner=None, metadata: Mapping | None = None, fmt: str = "peft",
              adapter_name: str = "default", dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """LoRA of the DiT (and the LLM adapter, if it has one) -> one ComfyUI-loadable file.
    fmt="peft": `diffusion_model.*.lora_A/B` (also loads in diffusers); fmt="kohya": `lora_unet_*`."""
    return write_safetensors(path, lora_state_dict(transformer, text_conditioner, fmt, adapter_name, dtype),
                             metadata, overwrite)


def save_lokr(path, transformer, text_conditioner=None, metadata: Mapping | None = None, fmt: str = "peft",
              adapter_name: str = "default", dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """LoKr -> `diffusion_model.*.lokr_*` for ComfyUI. fmt="kohya" is refused: that layout is defined for LoRA
    (lora_down/lora_up/alpha) only, so kohya tools could not read lokr_* factors under lora_unet_* names, and the
    file would load nowhere but ComfyUI while looking like a kohya LoRA."""
    if fmt != "peft":
        raise ValueError(f"LoKr cannot be exported with fmt={fmt!r}: the kohya lora_unet_* layout only defines "
                         f"LoRA (lora_down/lora_up/alpha); LoKr is written as diffusion_model.<module>.lokr_* "
                         f"(fmt='peft'), which ComfyUI loads")
    return write_safetensors(path, lokr_state_dict(transformer, text_conditioner, adapter_name, dtype),
                             metadata, overwrite)


def text_encoder_lora_path(path: str | os.PathLike) -> Path:
    """`<stem>.safetensors` -> `<stem>_te.safetensors` (docs/training.md#outputs-and-resume)."""
    path = Path(path)
    return path.with_name(f"{path.stem}_te{path.suffix or '.safetensors'}")


def save_text_encoder_lora(path, text_encoder, metadata: Mapping | None = None, adapter_name: str = "default",
                           dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Qwen3 LoRA -> its own file (pass `text_encoder_lora_path(main_file)` for the `_te` sibling); ComfyUI
    applies it through LoraLoader's clip input."""
    return write_safetensors(path, text_encoder_lora_state_dict(text_encoder, adapter_name, dtype), metadata,
                             overwrite)


def save_full_native(path, transformer, text_conditioner, metadata: Mapping | None = None,
                     dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Full finetune -> native single file for ComfyUI's UNETLoader (models/diffusion_models)."""
    return write_safetensors(path, full_native_state_dict(transformer, text_conditioner, dtype), metadata, overwrite)


def save_full_diffusers(folder, transformer, text_conditioner, metadata: Mapping | None = None,
                        dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Full finetune -> `<folder>/transformer/` + `<folder>/text_conditioner/` diffusers folders (config.json +
    one diffusion_pytorch_model.safetensors each, with the metadata); written beside and renamed into place."""
    folder = Path(folder)
    if folder.exists() and not overwrite:
        raise FileExistsError(f"{folder} already exists; pass overwrite=True to replace it")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        md = dict(metadata or {}, **{"modelspec.implementation": IMPLEMENTATION_DIFFUSERS})
        for sub, model in (("transformer", transformer), ("text_conditioner", text_conditioner)):
            _check_plain(model, sub)
            (tmp / sub).mkdir(parents=True)
            model.save_config(tmp / sub)
            sd = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v)
                  for k, v in _plain_state_dict(model).items()}
            write_safetensors(tmp / sub / "diffusion_pytorch_model.safetensors", sd, md)
        publish_dir(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
