"""Native <-> diffusers key maps, checked against the real classes (full size on the meta device, and tiny)."""

from __future__ import annotations

import re

import pytest
import torch

from anima_train.model import keymaps as km
from anima_train.model.tiny import CONFIGS


@pytest.fixture(scope="module")
def full_meta():
    """Full-size Anima models on the meta device (no memory, no init): the real key sets and shapes."""
    from diffusers import AutoencoderKLQwenImage, CosmosTransformer3DModel
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    from transformers import Qwen3Config, Qwen3Model

    cfg = CONFIGS["full"]
    with torch.device("meta"):
        models = dict(
            transformer=CosmosTransformer3DModel(**cfg["transformer"]),
            text_conditioner=AnimaTextConditioner(**cfg["text_conditioner"]),
            text_encoder=Qwen3Model(Qwen3Config(**cfg["text_encoder"])),
            vae=AutoencoderKLQwenImage(**cfg["vae"]),
        )
    return {name: {k: tuple(v.shape) for k, v in m.state_dict().items()} for name, m in models.items()}


def test_full_size_native_tensor_counts_match_the_released_files(full_meta):
    # docs/model.md#key-maps: the released native files hold 685 (DiT + adapter) / 310 (Qwen3) / 194 (VAE) tensors.
    # The diffusers models have 567 + 118 / 310 / 194, so the released DiT file carries none of the native-only
    # keys (accum_*, pos_embedder.*, _extra_state) that km.DIT_NATIVE_ONLY would drop.
    native = km.join_anima_native(full_meta["transformer"], full_meta["text_conditioner"])
    assert (len(full_meta["transformer"]), len(full_meta["text_conditioner"])) == (567, 118)
    assert len(native) == 685 and all(k.startswith("net.") for k in native)
    assert len(km.qwen3_diffusers_to_native(full_meta["text_encoder"])) == 310
    assert len(km.vae_diffusers_to_native(full_meta["vae"])) == 194


def test_full_size_dit_round_trip_and_native_names(full_meta):
    dit = full_meta["transformer"]
    native = km.dit_diffusers_to_native(dit)
    assert len(native) == len(dit)  # one-to-one
    assert km.dit_native_to_diffusers(native) == dit  # exact inverse, shapes carried along
    assert km.dit_native_to_diffusers({"net." + k: v for k, v in native.items()}) == dit
    # names ComfyUI's MiniTrainDIT uses (docs/model.md#dit-key-map) with the shapes of docs/model.md#linear-groups
    assert native["x_embedder.proj.1.weight"] == (2048, 68)
    assert native["blocks.27.cross_attn.k_proj.weight"] == (2048, 1024)
    assert native["blocks.0.mlp.layer1.weight"] == (8192, 2048)
    assert native["blocks.5.adaln_modulation_mlp.2.weight"] == (6144, 256)
    assert native["final_layer.adaln_modulation.2.weight"] == (4096, 256)
    assert native["final_layer.linear.weight"] == (64, 2048)
    assert native["t_embedding_norm.weight"] == (2048,)
    modules = {k.rsplit(".", 1)[0] for k in native}
    expected_leaf = re.compile(
        r"^(x_embedder\.proj\.1|t_embedder\.1\.linear_[12]|t_embedding_norm|final_layer\.(linear|adaln_modulation\.[12])"
        r"|blocks\.(\d|1\d|2[0-7])\.((self|cross)_attn\.(q_proj|k_proj|v_proj|output_proj|q_norm|k_norm)"
        r"|mlp\.layer[12]|adaln_modulation_(self_attn|cross_attn|mlp)\.[12]))$")
    assert [m for m in modules if not expected_leaf.match(m)] == []
    assert len(modules) == 7 + 28 * 20


def test_dit_table_agrees_with_diffusers_own_converters(full_meta):
    # Independent references, so a consistent-but-wrong entry (e.g. k/v swapped both ways) cannot pass:
    # diffusers' single-file converter (native file -> diffusers) and its Anima LoRA converter (module names).
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_anima_lora_to_diffusers
    from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

    dit = full_meta["transformer"]
    native = {"net." + k: v for k, v in km.dit_diffusers_to_native(dit).items()}
    native["net.pos_embedder.dim_spatial_range"] = (3,)  # a native-only key both sides must drop
    assert convert_cosmos_transformer_checkpoint_to_diffusers(dict(native)) == dit
    # LoRA targets are the Linear layers (diffusers' LoRA renamer does not cover the q/k RMSNorms)
    modules = sorted({k.rsplit(".", 1)[0] for k in dit if not re.search(r"norm_[qk]|time_embed\.norm", k)})
    assert len(modules) == 6 + 28 * 16  # docs/model.md#linear-groups: 448 block Linears + 6 others
    lora = {f"diffusion_model.{km.dit_module_to_native(m)}.lora_A.weight": m for m in modules}
    converted = _convert_non_diffusers_anima_lora_to_diffusers(lora)
    assert converted == {f"transformer.{m}.lora_A.weight": m for m in modules}


def test_adapter_and_qwen3_round_trip(full_meta):
    cond, qwen = full_meta["text_conditioner"], full_meta["text_encoder"]
    native = km.join_anima_native(full_meta["transformer"], cond)
    dit, adapter = km.split_anima_native(native)
    assert dit == full_meta["transformer"] and adapter == cond
    assert "net.llm_adapter.blocks.5.cross_attn.q_proj.weight" in native
    # ComfyUI's other accepted prefix and the bare form split the same way
    for prefix in ("model.diffusion_model.", ""):
        assert km.split_anima_native({prefix + k[4:]: v for k, v in native.items()}) == (dit, adapter)
    qn = km.qwen3_diffusers_to_native(qwen)
    assert all(k.startswith("model.") for k in qn)
    assert km.qwen3_native_to_diffusers({**qn, "lm_head.weight": (151936, 1024)}) == qwen  # LM head dropped


def test_vae_explicit_table_covers_the_real_diffusers_vae_once(full_meta):
    vae = full_meta["vae"]
    table = km.VAE_NATIVE_TO_DIFFUSERS
    assert len(table) == 194 and sorted(table.values()) == sorted(vae)  # every diffusers key exactly once
    layout = km.wan_vae_native_layout()  # ComfyUI WanVAE(dim=96, z_dim=16) names + shapes
    assert {table[k]: s for k, s in layout.items()} == vae  # same shape in each mapped slot
    # spot checks straight from docs/model.md#vae-key-map
    assert table["conv1.weight"] == "quant_conv.weight" and table["conv2.bias"] == "post_quant_conv.bias"
    assert table["decoder.upsamples.3.time_conv.weight"] == "decoder.up_blocks.0.upsamplers.0.time_conv.weight"
    assert table["decoder.upsamples.11.resample.1.bias"] == "decoder.up_blocks.2.upsamplers.0.resample.1.bias"
    assert table["decoder.upsamples.14.residual.6.weight"] == "decoder.up_blocks.3.resnets.2.conv2.weight"
    assert table["decoder.upsamples.4.shortcut.weight"] == "decoder.up_blocks.1.resnets.0.conv_shortcut.weight"
    assert table["encoder.middle.1.to_qkv.weight"] == "encoder.mid_block.attentions.0.to_qkv.weight"
    assert table["decoder.head.0.gamma"] == "decoder.norm_out.gamma"
    # the rule-based reverse direction reproduces the explicit table exactly
    assert {km.vae_diffusers_key_to_native(k, 2): k for k in vae} == table
    assert km.vae_native_to_diffusers(km.vae_diffusers_to_native(vae)) == vae


@pytest.mark.parametrize("base_dim,num_res_blocks", [(8, 1), (16, 2), (8, 3)])
def test_vae_rules_for_other_layouts(base_dim, num_res_blocks):
    from diffusers import AutoencoderKLQwenImage

    with torch.device("meta"):
        vae = AutoencoderKLQwenImage(base_dim=base_dim, num_res_blocks=num_res_blocks)
    sd = {k: tuple(v.shape) for k, v in vae.state_dict().items()}
    layout = km.wan_vae_native_layout(base_dim=base_dim, num_res_blocks=num_res_blocks)
    assert km.vae_num_res_blocks(layout) == km.vae_num_res_blocks(sd) == num_res_blocks
    assert km.vae_native_to_diffusers(layout) == sd  # R inferred from the keys
    assert km.vae_diffusers_to_native(sd) == layout
    if num_res_blocks != 2:  # the R=2 arithmetic must not silently apply to other layouts: it fails loudly
        with pytest.raises(KeyError, match="decoder.upsamples"):
            km.vae_native_to_diffusers(layout, num_res_blocks=2)


def test_module_paths_for_lora_export():
    assert km.dit_module_to_native("transformer_blocks.3.attn1.to_q") == "blocks.3.self_attn.q_proj"
    assert km.dit_module_to_native("transformer_blocks.12.attn2.to_out.0") == "blocks.12.cross_attn.output_proj"
    assert km.dit_module_to_native("transformer_blocks.0.ff.net.0.proj.lora_A.weight") == \
        "blocks.0.mlp.layer1.lora_A.weight"
    assert km.dit_module_to_native("patch_embed.proj") == "x_embedder.proj.1"
    assert km.dit_module_to_diffusers("blocks.3.adaln_modulation_cross_attn.1") == "transformer_blocks.3.norm2.linear_1"
    assert km.dit_module_to_diffusers("final_layer.linear") == "proj_out"
    for table in (km.DIT_BLOCK_DIFFUSERS_TO_NATIVE, km.DIT_TOP_DIFFUSERS_TO_NATIVE):
        for d in table:
            path = f"transformer_blocks.7.{d}" if table is km.DIT_BLOCK_DIFFUSERS_TO_NATIVE else d
            assert km.dit_module_to_diffusers(km.dit_module_to_native(path)) == path
    with pytest.raises(KeyError, match="transformer_blocks.3.attn1.to_qq"):
        km.dit_module_to_native("transformer_blocks.3.attn1.to_qq")
    with pytest.raises(KeyError, match="llm_adapter"):
        km.dit_native_to_diffusers({"net.llm_adapter.embed.weight": 0})


def test_native_only_keys_are_dropped_and_unknown_keys_refused():
    sd = {"net.blocks.0.mlp.layer1.weight": 1, "net.accum_iteration": 2, "net.pos_embedder.seq": 3,
          "net.pos_embedder.dim_spatial_range": 4, "net.blocks.0.self_attn.q_proj._extra_state": 5}
    assert km.dit_native_to_diffusers(sd) == {"transformer_blocks.0.ff.net.0.proj.weight": 1}
    with pytest.raises(KeyError, match="net.blocks.0.foo.weight|blocks.0.foo.weight"):
        km.dit_native_to_diffusers({"net.blocks.0.foo.weight": 1})
    with pytest.raises(KeyError, match="model.visual.x"):
        km.qwen3_native_to_diffusers({"model.visual.x": 1})
    with pytest.raises(KeyError, match="decoder.upsamples.3.bogus.weight"):
        km.vae_native_key_to_diffusers("decoder.upsamples.3.bogus.weight")
    with pytest.raises(KeyError, match="not an Anima DiT"):
        km.split_anima_native({"net.blocks.0.mlp.layer1.weight": 1})


def test_describe_state_dict(full_meta):
    native = km.join_anima_native(full_meta["transformer"], full_meta["text_conditioner"])
    cases = {
        "looks like an Anima DiT single file (net.*, with llm_adapter)": native,
        "looks like a Cosmos-Predict2 DiT without the Anima llm_adapter":
            {k: v for k, v in native.items() if "llm_adapter" not in k},
        "looks like a Qwen3 text encoder": km.qwen3_diffusers_to_native(full_meta["text_encoder"]),
        "looks like a Wan/Qwen-Image VAE": km.wan_vae_native_layout(),
        "looks like a diffusers AutoencoderKLQwenImage (vae/) state dict": full_meta["vae"],
        "looks like a diffusers CosmosTransformer3DModel (transformer/) state dict": full_meta["transformer"],
        "looks like a diffusers AnimaTextConditioner (text_conditioner/) state dict": full_meta["text_conditioner"],
        "looks like a LoRA/LoKr adapter file": {"diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight": 0,
                                                "diffusion_model.blocks.0.self_attn.q_proj.lora_B.weight": 0},
        "unknown": {"foo.weight": 0},
    }
    for expected, sd in cases.items():
        assert km.describe_state_dict(sd.keys()) == expected
    assert km.state_dict_kind(["lora_unet_blocks_0_self_attn_q_proj.lora_down.weight"]) == "lora"
    assert km.state_dict_kind(["diffusion_model.blocks.0.mlp.layer1.lokr_w1"]) == "lora"
    assert km.state_dict_kind(km.qwen3_diffusers_to_native(full_meta["text_encoder"])) == "qwen3"
    assert km.state_dict_kind(full_meta["text_encoder"]) == "qwen3"  # bare Qwen3Model keys too


@pytest.mark.parametrize("size", ["tiny", "comfy"])
def test_small_sizes_round_trip(size):
    """native -> diffusers -> native identity for the tiny/comfy configs (the layouts the tests build)."""
    from diffusers import AutoencoderKLQwenImage, CosmosTransformer3DModel
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    from transformers import Qwen3Config, Qwen3Model

    cfg = CONFIGS[size]
    with torch.device("meta"):
        dit = CosmosTransformer3DModel(**cfg["transformer"]).state_dict()
        cond = AnimaTextConditioner(**cfg["text_conditioner"]).state_dict()
        qwen = Qwen3Model(Qwen3Config(**cfg["text_encoder"])).state_dict()
        vae = AutoencoderKLQwenImage(**cfg["vae"]).state_dict()
    native = km.join_anima_native(dit, cond)
    assert len(native) == len(dit) + len(cond)
    d2, c2 = km.split_anima_native(native)
    assert km.join_anima_native(d2, c2) == native and d2.keys() == dit.keys() and c2.keys() == cond.keys()
    qn = km.qwen3_diffusers_to_native(qwen)
    assert km.qwen3_diffusers_to_native(km.qwen3_native_to_diffusers(qn)) == qn
    vn = km.vae_diffusers_to_native(vae)
    assert km.vae_diffusers_to_native(km.vae_native_to_diffusers(vn)) == vn
    assert {k: tuple(v.shape) for k, v in vn.items()} == km.wan_vae_native_layout(
        base_dim=cfg["vae"]["base_dim"], num_res_blocks=cfg["vae"]["num_res_blocks"])
