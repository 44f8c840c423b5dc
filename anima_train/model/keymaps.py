"""Key names of Anima's four models: native (ComfyUI / original checkpoint) <-> diffusers.

Defined once here; everything that converts, loads or exports state dicts goes through this module.

Conventions
- "native" DiT/adapter keys are written WITHOUT the file prefix: `blocks.0.self_attn.q_proj.weight`,
  `llm_adapter.embed.weight`. A native single file puts `net.` in front of every key (NATIVE_PREFIX);
  ComfyUI also accepts `model.diffusion_model.` or no prefix. `split_anima_native` / `join_anima_native`
  handle the prefix and the DiT/adapter split of a whole file.
- diffusers keys are those of `CosmosTransformer3DModel`, `AnimaTextConditioner`, `transformers.Qwen3Model`
  and `AutoencoderKLQwenImage` state dicts.
- All conversions are pure renames (no tensor is reshaped or copied); unknown keys raise a KeyError that names
  the key, so a wrong file never loads half-way.

Sources of the facts (read, not copied): diffusers 0.42.1 `loaders/single_file_utils.py`
(`convert_cosmos_transformer_checkpoint_to_diffusers`, Cosmos-2.0 branch), diffusers
`scripts/convert_anima_to_diffusers.py` (`convert_qwen_image_vae_state_dict`), ComfyUI `comfy/ldm/wan/vae.py`
(`Encoder3d`/`Decoder3d`/`WanVAE` module layout), ComfyUI `comfy/model_detection.py` / `comfy/sd.py` (detection keys).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from anima_train.adapters.base import MODEL_ROLES

NATIVE_PREFIX = "net."  # every key of the released native Anima file starts with this
NATIVE_PREFIXES = ("net.", "model.diffusion_model.")  # both are accepted by ComfyUI's UNETLoader
ADAPTER_PREFIX = "llm_adapter."  # native sub-tree of the LLM adapter, after NATIVE_PREFIX

# ----------------------------------------------------------------------------------------------------------
# DiT: diffusers module path -> native module path. Complete for the Anima config (docs/model.md#dit-key-map).
# Module level (not tensor level) so LoRA export can map module names too; `.weight`/`.bias`/`.lora_A.weight`
# and anything else after the module path are carried over unchanged.

DIT_TOP_DIFFUSERS_TO_NATIVE = {
    "patch_embed.proj": "x_embedder.proj.1",
    "time_embed.t_embedder.linear_1": "t_embedder.1.linear_1",
    "time_embed.t_embedder.linear_2": "t_embedder.1.linear_2",
    "time_embed.norm": "t_embedding_norm",
    "norm_out.linear_1": "final_layer.adaln_modulation.1",
    "norm_out.linear_2": "final_layer.adaln_modulation.2",
    "proj_out": "final_layer.linear",
}

# inside one block: `transformer_blocks.N.<key>` <-> `blocks.N.<value>`
DIT_BLOCK_DIFFUSERS_TO_NATIVE = {
    "norm1.linear_1": "adaln_modulation_self_attn.1",
    "norm1.linear_2": "adaln_modulation_self_attn.2",
    "norm2.linear_1": "adaln_modulation_cross_attn.1",
    "norm2.linear_2": "adaln_modulation_cross_attn.2",
    "norm3.linear_1": "adaln_modulation_mlp.1",
    "norm3.linear_2": "adaln_modulation_mlp.2",
    **{
        f"{d_attn}.{d_leaf}": f"{n_attn}.{n_leaf}"
        for d_attn, n_attn in (("attn1", "self_attn"), ("attn2", "cross_attn"))
        for d_leaf, n_leaf in (
            ("to_q", "q_proj"),
            ("to_k", "k_proj"),
            ("to_v", "v_proj"),
            ("to_out.0", "output_proj"),
            ("norm_q", "q_norm"),
            ("norm_k", "k_norm"),
        )
    },
    "ff.net.0.proj": "mlp.layer1",
    "ff.net.2": "mlp.layer2",
}


def _invert(table: dict[str, str]) -> dict[str, str]:
    inverse = {v: k for k, v in table.items()}
    assert len(inverse) == len(table), "key map is not one-to-one"
    return inverse


# the native -> diffusers direction is the exact inverse, built here so the two can never drift apart
DIT_TOP_NATIVE_TO_DIFFUSERS = _invert(DIT_TOP_DIFFUSERS_TO_NATIVE)
DIT_BLOCK_NATIVE_TO_DIFFUSERS = _invert(DIT_BLOCK_DIFFUSERS_TO_NATIVE)

# Native-only tensors with no diffusers counterpart; dropped on import (diffusers drops the same ones).
# The released Anima file has none of them (685 tensors = 567 DiT + 118 adapter), Cosmos training checkpoints do.
DIT_NATIVE_ONLY = re.compile(
    r"^(accum_(video_sample_counter|image_sample_counter|iteration|train_in_hours)"
    r"|pos_embedder\.(seq|dim_spatial_range|dim_temporal_range))$|_extra_state"
)


def _rename_module(path: str, top: dict, block: dict, src_blocks: str, dst_blocks: str, what: str) -> str:
    m = re.match(rf"{src_blocks}\.(\d+)\.(.+)$", path)
    table, rest, prefix = (block, m.group(2), f"{dst_blocks}.{m.group(1)}.") if m else (top, path, "")
    # longest module name that ends on a dot boundary wins; the tail (".weight", ".lora_A.weight") is kept
    for module in sorted(table, key=len, reverse=True):
        if rest == module or rest.startswith(module + "."):
            return prefix + table[module] + rest[len(module):]
    raise KeyError(f"{what}: no Anima DiT mapping for {path!r}")


def dit_module_to_native(path: str) -> str:
    """`transformer_blocks.3.attn1.to_q` -> `blocks.3.self_attn.q_proj` (also works with a param tail)."""
    return _rename_module(path, DIT_TOP_DIFFUSERS_TO_NATIVE, DIT_BLOCK_DIFFUSERS_TO_NATIVE,
                          "transformer_blocks", "blocks", "diffusers -> native")


def dit_module_to_diffusers(path: str) -> str:
    """`blocks.3.self_attn.q_proj` -> `transformer_blocks.3.attn1.to_q` (no `net.` prefix)."""
    return _rename_module(path, DIT_TOP_NATIVE_TO_DIFFUSERS, DIT_BLOCK_NATIVE_TO_DIFFUSERS,
                          "blocks", "transformer_blocks", "native -> diffusers")


def strip_native_prefix(sd: Mapping) -> dict:
    """Remove the common `net.` / `model.diffusion_model.` prefix of a native file (if every key has it)."""
    for prefix in NATIVE_PREFIXES:
        if sd and all(k.startswith(prefix) for k in sd):
            return {k[len(prefix):]: v for k, v in sd.items()}
    return dict(sd)


def dit_native_to_diffusers(sd: Mapping) -> dict:
    """Native DiT state dict (with or without `net.`) -> `CosmosTransformer3DModel` keys.

    Drops the native-only buffers/counters (DIT_NATIVE_ONLY). Adapter keys are refused: use split_anima_native.
    """
    out = {}
    for key, value in strip_native_prefix(sd).items():
        if DIT_NATIVE_ONLY.search(key):
            continue
        if key.startswith(ADAPTER_PREFIX):
            raise KeyError(f"{key!r} belongs to the LLM adapter; split the file with split_anima_native() first")
        out[dit_module_to_diffusers(key)] = value
    return out


def dit_diffusers_to_native(sd: Mapping) -> dict:
    """`CosmosTransformer3DModel` keys -> native keys WITHOUT `net.` (join_anima_native adds it)."""
    return {dit_module_to_native(k): v for k, v in sd.items()}


# ----------------------------------------------------------------------------------------------------------
# LLM adapter: native `llm_adapter.<k>` <-> AnimaTextConditioner `<k>` (same names, ComfyUI's LLMAdapter).

def adapter_native_to_diffusers(sd: Mapping) -> dict:
    out = {}
    for key, value in strip_native_prefix(sd).items():
        if not key.startswith(ADAPTER_PREFIX):
            raise KeyError(f"{key!r} is not an LLM adapter key (expected {NATIVE_PREFIX}{ADAPTER_PREFIX}...)")
        out[key[len(ADAPTER_PREFIX):]] = value
    return out


def adapter_diffusers_to_native(sd: Mapping) -> dict:
    return {ADAPTER_PREFIX + k: v for k, v in sd.items()}


def split_anima_native(sd: Mapping) -> tuple[dict, dict]:
    """Native Anima single file (`net.*`, `model.diffusion_model.*` or bare) -> (transformer_sd, conditioner_sd)
    in diffusers names. Raises if the adapter is missing (a plain Cosmos-Predict2 DiT is not Anima)."""
    sd = strip_native_prefix(sd)
    adapter = {k: v for k, v in sd.items() if k.startswith(ADAPTER_PREFIX)}
    if not adapter:
        raise KeyError(f"no '{NATIVE_PREFIX}{ADAPTER_PREFIX}*' keys: this is not an Anima DiT file "
                       f"({describe_state_dict(sd)})")
    dit = {k: v for k, v in sd.items() if not k.startswith(ADAPTER_PREFIX)}
    return dit_native_to_diffusers(dit), adapter_native_to_diffusers(adapter)


def join_anima_native(transformer_sd: Mapping, conditioner_sd: Mapping, prefix: str = NATIVE_PREFIX) -> dict:
    """diffusers transformer + conditioner state dicts -> one native single-file dict (`net.` keys)."""
    native = {**dit_diffusers_to_native(transformer_sd), **adapter_diffusers_to_native(conditioner_sd)}
    return {prefix + k: v for k, v in native.items()}


# ----------------------------------------------------------------------------------------------------------
# Qwen3 text encoder: the native (ComfyUI `qwen_3_06b_base`) file is a Qwen3ForCausalLM-style dict with
# `model.` in front; Qwen3Model has no `model.` level and no LM head.

QWEN3_PREFIX = "model."
_QWEN3_MODEL_KEY = re.compile(r"^(embed_tokens\.|layers\.\d+\.|norm\.)")


def qwen3_native_to_diffusers(sd: Mapping) -> dict:
    out = {}
    for key, value in sd.items():
        if key.startswith("lm_head."):
            continue  # no slot in Qwen3Model
        inner = key[len(QWEN3_PREFIX):] if key.startswith(QWEN3_PREFIX) else key
        if not _QWEN3_MODEL_KEY.match(inner):
            raise KeyError(f"{key!r} is not a Qwen3 text-encoder key (expected model.embed_tokens / "
                           f"model.layers.N / model.norm)")
        out[inner] = value
    return out


def qwen3_diffusers_to_native(sd: Mapping) -> dict:
    return {QWEN3_PREFIX + k: v for k, v in sd.items()}


# ----------------------------------------------------------------------------------------------------------
# VAE: ComfyUI `WanVAE` (Wan2.1 / Qwen-Image VAE file) <-> diffusers `AutoencoderKLQwenImage`.
#
# Native layout (comfy/ldm/wan/vae.py): `encoder.downsamples` and `decoder.upsamples` are FLAT Sequentials.
# Encoder: per stage `num_res_blocks` ResidualBlocks then a Resample (not after the last stage); diffusers keeps the
# same flat list (`encoder.down_blocks.i`). Decoder: per stage `num_res_blocks + 1` ResidualBlocks then a Resample
# (not after the last stage); diffusers nests them: `decoder.up_blocks.<stage>.resnets.<k>` / `.upsamplers.0`.
# So with R = num_res_blocks, flat decoder index j is stage j // (R+2), position j % (R+2), and position R+1 is the
# upsampler (R=2: j = 3, 7, 11; docs/model.md#vae-key-map). attn_scales=[] is assumed (true for every Wan2.1 VAE).

_VAE_RESIDUAL_NATIVE_TO_DIFFUSERS = {
    "residual.0.": "norm1.",
    "residual.2.": "conv1.",
    "residual.3.": "norm2.",
    "residual.6.": "conv2.",
    "shortcut.": "conv_shortcut.",
}
_VAE_RESIDUAL_DIFFUSERS_TO_NATIVE = _invert(_VAE_RESIDUAL_NATIVE_TO_DIFFUSERS)
_VAE_SIMPLE_NATIVE_TO_DIFFUSERS = {  # whole-prefix renames (first level)
    "conv1.": "quant_conv.",
    "conv2.": "post_quant_conv.",
    "encoder.conv1.": "encoder.conv_in.",
    "decoder.conv1.": "decoder.conv_in.",
    "encoder.head.0.": "encoder.norm_out.",
    "encoder.head.2.": "encoder.conv_out.",
    "decoder.head.0.": "decoder.norm_out.",
    "decoder.head.2.": "decoder.conv_out.",
}
_VAE_SIMPLE_DIFFUSERS_TO_NATIVE = _invert(_VAE_SIMPLE_NATIVE_TO_DIFFUSERS)
_VAE_MIDDLE = {"0": "resnets.0.", "1": "attentions.0.", "2": "resnets.1."}
_VAE_MIDDLE_INV = _invert(_VAE_MIDDLE)


def _residual(rest: str, table: dict, key: str) -> str:
    for src, dst in table.items():
        if rest.startswith(src):
            return dst + rest[len(src):]
    # Resample (`resample.1.`, `time_conv.`) and attention (`norm.`, `to_qkv.`, `proj.`) names are shared
    if re.match(r"^(resample\.1|time_conv|norm|to_qkv|proj)\.(weight|bias|gamma)$", rest):
        return rest
    raise KeyError(f"no Wan VAE mapping for {key!r}")


def vae_native_key_to_diffusers(key: str, num_res_blocks: int = 2) -> str:
    for src, dst in _VAE_SIMPLE_NATIVE_TO_DIFFUSERS.items():
        if key.startswith(src):
            return dst + key[len(src):]
    if m := re.match(r"^(encoder|decoder)\.middle\.(\d)\.(.+)$", key):
        rest = _residual(m.group(3), _VAE_RESIDUAL_NATIVE_TO_DIFFUSERS, key)
        return f"{m.group(1)}.mid_block.{_VAE_MIDDLE[m.group(2)]}{rest}"
    if m := re.match(r"^encoder\.downsamples\.(\d+)\.(.+)$", key):
        return f"encoder.down_blocks.{m.group(1)}.{_residual(m.group(2), _VAE_RESIDUAL_NATIVE_TO_DIFFUSERS, key)}"
    if m := re.match(r"^decoder\.upsamples\.(\d+)\.(.+)$", key):
        stage, pos = divmod(int(m.group(1)), num_res_blocks + 2)
        if pos == num_res_blocks + 1:
            return f"decoder.up_blocks.{stage}.upsamplers.0.{_residual(m.group(2), {}, key)}"
        rest = _residual(m.group(2), _VAE_RESIDUAL_NATIVE_TO_DIFFUSERS, key)
        return f"decoder.up_blocks.{stage}.resnets.{pos}.{rest}"
    raise KeyError(f"no Wan VAE mapping for {key!r}")


def vae_diffusers_key_to_native(key: str, num_res_blocks: int = 2) -> str:
    for src, dst in _VAE_SIMPLE_DIFFUSERS_TO_NATIVE.items():
        if key.startswith(src):
            return dst + key[len(src):]
    if m := re.match(r"^(encoder|decoder)\.mid_block\.(resnets\.\d|attentions\.\d)\.(.+)$", key):
        middle = _VAE_MIDDLE_INV.get(m.group(2) + ".")
        if middle is None:
            raise KeyError(f"no Wan VAE mapping for {key!r}")
        return f"{m.group(1)}.middle.{middle}.{_residual(m.group(3), _VAE_RESIDUAL_DIFFUSERS_TO_NATIVE, key)}"
    if m := re.match(r"^encoder\.down_blocks\.(\d+)\.(.+)$", key):
        return f"encoder.downsamples.{m.group(1)}.{_residual(m.group(2), _VAE_RESIDUAL_DIFFUSERS_TO_NATIVE, key)}"
    if m := re.match(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)$", key):
        index = int(m.group(1)) * (num_res_blocks + 2) + num_res_blocks + 1
        return f"decoder.upsamples.{index}.{_residual(m.group(2), {}, key)}"
    if m := re.match(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)$", key):
        if int(m.group(2)) > num_res_blocks:
            raise KeyError(f"{key!r}: resnet index > num_res_blocks={num_res_blocks}")
        index = int(m.group(1)) * (num_res_blocks + 2) + int(m.group(2))
        return f"decoder.upsamples.{index}.{_residual(m.group(3), _VAE_RESIDUAL_DIFFUSERS_TO_NATIVE, key)}"
    raise KeyError(f"no Wan VAE mapping for {key!r}")


def vae_num_res_blocks(keys: Iterable[str]) -> int:
    """Infer num_res_blocks from either naming: the first decoder upsampler sits right after R+1 resnets."""
    keys = list(keys)
    native = [int(m.group(1)) for k in keys if (m := re.match(r"^decoder\.upsamples\.(\d+)\.resample\.", k))]
    if native:
        return min(native) - 1
    resnets = {int(m.group(1)) for k in keys if (m := re.match(r"^decoder\.up_blocks\.0\.resnets\.(\d+)\.", k))}
    if resnets:
        return max(resnets)
    raise KeyError("cannot infer the VAE's num_res_blocks: no decoder upsampler / up_blocks.0 keys "
                   "(is this a Wan2.1 / Qwen-Image VAE?)")


def vae_native_to_diffusers(sd: Mapping, num_res_blocks: int | None = None) -> dict:
    r = vae_num_res_blocks(sd) if num_res_blocks is None else num_res_blocks
    return {vae_native_key_to_diffusers(k, r): v for k, v in sd.items()}


def vae_diffusers_to_native(sd: Mapping, num_res_blocks: int | None = None) -> dict:
    r = vae_num_res_blocks(sd) if num_res_blocks is None else num_res_blocks
    return {vae_diffusers_key_to_native(k, r): v for k, v in sd.items()}


def wan_vae_native_layout(base_dim: int = 96, z_dim: int = 16, num_res_blocks: int = 2,
                          dim_mult=(1, 2, 4, 4), temperal_downsample=(False, True, True)) -> dict[str, tuple]:
    """Every tensor name and shape of ComfyUI's `WanVAE(dim=base_dim, z_dim=z_dim)`, enumerated from its module
    structure (comfy/ldm/wan/vae.py), independently of the prefix rules above; attn_scales=[] assumed.
    With the defaults this is the 194-tensor `qwen_image_vae.safetensors` layout."""
    out: dict[str, tuple] = {}

    def conv3d(name, cin, cout, k=(3, 3, 3)):
        out[f"{name}.weight"], out[f"{name}.bias"] = (cout, cin, *k), (cout,)

    def resblock(name, cin, cout):
        out[f"{name}.residual.0.gamma"] = (cin, 1, 1, 1)
        conv3d(f"{name}.residual.2", cin, cout)
        out[f"{name}.residual.3.gamma"] = (cout, 1, 1, 1)
        conv3d(f"{name}.residual.6", cout, cout)
        if cin != cout:
            conv3d(f"{name}.shortcut", cin, cout, (1, 1, 1))

    def attention(name, d):
        out[f"{name}.norm.gamma"] = (d, 1, 1)
        out[f"{name}.to_qkv.weight"], out[f"{name}.to_qkv.bias"] = (3 * d, d, 1, 1), (3 * d,)
        out[f"{name}.proj.weight"], out[f"{name}.proj.bias"] = (d, d, 1, 1), (d,)

    def middle(name, d):
        resblock(f"{name}.middle.0", d, d)
        attention(f"{name}.middle.1", d)
        resblock(f"{name}.middle.2", d, d)

    # encoder
    dims = [base_dim * u for u in (1, *dim_mult)]
    conv3d("encoder.conv1", 3, dims[0])
    i = 0
    for stage, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
        for _ in range(num_res_blocks):
            resblock(f"encoder.downsamples.{i}", cin, cout)
            cin, i = cout, i + 1
        if stage != len(dim_mult) - 1:
            out[f"encoder.downsamples.{i}.resample.1.weight"] = (cout, cout, 3, 3)
            out[f"encoder.downsamples.{i}.resample.1.bias"] = (cout,)
            if temperal_downsample[stage]:
                conv3d(f"encoder.downsamples.{i}.time_conv", cout, cout, (3, 1, 1))
            i += 1
    middle("encoder", dims[-1])
    out["encoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    conv3d("encoder.head.2", dims[-1], 2 * z_dim)
    conv3d("conv1", 2 * z_dim, 2 * z_dim, (1, 1, 1))
    conv3d("conv2", z_dim, z_dim, (1, 1, 1))
    # decoder (temporal upsampling is the reversed downsampling list)
    dims = [base_dim * u for u in (dim_mult[-1], *dim_mult[::-1])]
    temperal_upsample = tuple(temperal_downsample)[::-1]
    conv3d("decoder.conv1", z_dim, dims[0])
    middle("decoder", dims[0])
    i = 0
    for stage, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
        if stage in (1, 2, 3):
            cin //= 2  # the previous upsampler's conv halves the channels
        for _ in range(num_res_blocks + 1):
            resblock(f"decoder.upsamples.{i}", cin, cout)
            cin, i = cout, i + 1
        if stage != len(dim_mult) - 1:
            out[f"decoder.upsamples.{i}.resample.1.weight"] = (cout // 2, cout, 3, 3)
            out[f"decoder.upsamples.{i}.resample.1.bias"] = (cout // 2,)
            if temperal_upsample[stage]:
                conv3d(f"decoder.upsamples.{i}.time_conv", cout, 2 * cout, (3, 1, 1))
            i += 1
    out["decoder.head.0.gamma"] = (dims[-1], 1, 1, 1)
    conv3d("decoder.head.2", dims[-1], 3)
    return out


# The explicit table for the released 194-tensor VAE (dim 96, num_res_blocks 2): native key -> diffusers key.
# Built from the independent layout enumeration + the rules; tests check it against AutoencoderKLQwenImage()
# built on the meta device (every diffusers key covered exactly once, same shapes).
VAE_NATIVE_TO_DIFFUSERS = {k: vae_native_key_to_diffusers(k, 2) for k in wan_vae_native_layout()}


# ----------------------------------------------------------------------------------------------------------
# What is this file? Used to say e.g. "--vae got a file that looks like a Qwen3 text encoder".

def state_dict_kind(keys: Iterable[str]) -> str:
    """One of: lora, anima_dit, cosmos_dit, diffusers_transformer, diffusers_conditioner, qwen3, vae,
    diffusers_vae, unknown. Needs only key names (read them with safetensors.safe_open(...).keys())."""
    keys = set(keys)
    if any(re.search(r"(^|[._])(lora_(A|B|up|down|mid)|lokr_w[12]|hada_w[12]|oft_)", k) or k.startswith("lora_")
           for k in keys):
        return "lora"
    bare = set(strip_native_prefix(dict.fromkeys(keys)))
    if "blocks.0.mlp.layer1.weight" in bare:  # ComfyUI's Cosmos-Predict2 detection key
        return "anima_dit" if "llm_adapter.blocks.0.cross_attn.q_proj.weight" in bare else "cosmos_dit"
    if "transformer_blocks.0.attn1.to_q.weight" in keys:
        return "diffusers_transformer"
    if "blocks.0.cross_attn.q_proj.weight" in keys and "embed.weight" in keys:
        return "diffusers_conditioner"
    if any(re.match(r"^(model\.)?layers\.0\.self_attn\.q_norm\.weight$", k) for k in keys):
        return "qwen3"
    if "decoder.middle.0.residual.0.gamma" in keys:  # ComfyUI's Wan2.1 VAE detection key
        return "vae"
    if "decoder.mid_block.resnets.0.norm1.gamma" in keys:
        return "diffusers_vae"
    return "unknown"


_KIND_DESCRIPTIONS = {
    "lora": "looks like a LoRA/LoKr adapter file",
    "anima_dit": "looks like an Anima DiT single file (net.*, with llm_adapter)",
    "cosmos_dit": "looks like a Cosmos-Predict2 DiT without the Anima llm_adapter",
    "diffusers_transformer": "looks like a diffusers CosmosTransformer3DModel (transformer/) state dict",
    "diffusers_conditioner": "looks like a diffusers AnimaTextConditioner (text_conditioner/) state dict",
    "qwen3": "looks like a Qwen3 text encoder",
    "vae": "looks like a Wan/Qwen-Image VAE",
    "diffusers_vae": "looks like a diffusers AutoencoderKLQwenImage (vae/) state dict",
    "unknown": "unknown",
}


def describe_state_dict(keys: Iterable[str]) -> str:
    """Human sentence for state_dict_kind(), e.g. 'looks like a Qwen3 text encoder'."""
    return _KIND_DESCRIPTIONS[state_dict_kind(keys)]


# ----------------------------------------------------------------------------------------------------------
# Components

# Full finetune: the DiT sub-tree that owns a parameter decides its component (first match wins; else base).
_DIT_OWNERS = (
    ("self_attn", re.compile(r"transformer_blocks\.\d+\.attn1\.")),
    ("cross_attn", re.compile(r"transformer_blocks\.\d+\.attn2\.")),
    ("mlp", re.compile(r"transformer_blocks\.\d+\.ff\.")),
    ("adaln", re.compile(r"transformer_blocks\.\d+\.norm[123]\.|norm_out\.")),
)


def owner_component(param_name: str, model: str = "transformer") -> str:
    """The component a (non-adapter) parameter belongs to, for a full finetune's param groups and SDNQ's per-layer
    choices (adapters/inject.py's docstring lists which sub-tree goes where)."""
    if model == "text_conditioner":
        return "llm_adapter"
    if model == "text_encoder":
        return "text_encoder"
    if model != "transformer":
        raise ValueError(f"unknown model role {model!r}; expected one of {', '.join(MODEL_ROLES)}")
    for comp, pattern in _DIT_OWNERS:
        if pattern.match(param_name):
            return comp
    return "base"
