"""Exporters: every format's file, read back by its consumer, patches W to W + ΔW, with ΔW computed here from the
peft adapter's own parameters (B·A·alpha/r, kron(w1, w2)·alpha/r) rather than from the exporter's output.

diffusers (AnimaLoraLoaderMixin / load_lora_adapter) runs here; ComfyUI's loader runs in test_comfyui_lora.py."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoHaConfig, LoKrConfig, LoraConfig, inject_adapter_in_model
from safetensors import safe_open
from safetensors.torch import load_file

from anima_train.model import keymaps
from anima_train.adapters import export as lora_export
from anima_train.adapters.full import model as full
from anima_train.model.tiny import build_models

DIT_TARGETS = ["to_q", "to_k", "to_out.0", "ff.net.0.proj", "norm1.linear_1", "proj_out"]
ADAPTER_TARGETS = ["q_proj", "o_proj", "mlp.0"]


def tiny_parts(seed: int = 0):
    m = build_models("tiny", seed=seed)
    return m["transformer"], m["text_conditioner"], m["text_encoder"]


def with_lora(rank=4, alpha=8.0, cond_rank=2, cond_alpha=3.0):
    """Tiny DiT + conditioner with random (non-zero B) LoRA, alpha != rank on purpose."""
    transformer, conditioner, _ = tiny_parts()
    torch.manual_seed(1)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=DIT_TARGETS,
                                       init_lora_weights=False), adapter_name="default")
    conditioner.add_adapter(LoraConfig(r=cond_rank, lora_alpha=cond_alpha, target_modules=ADAPTER_TARGETS,
                                       init_lora_weights=False), adapter_name="default")
    return transformer, conditioner


def expected_lora(model, rank, alpha, adapter="default"):
    """{diffusers module path: W + B@A * alpha/rank} from the peft parameters."""
    from peft.tuners.lora import LoraLayer

    return {name: (m.base_layer.weight + m.lora_B[adapter].weight @ m.lora_A[adapter].weight * (alpha / rank)).detach()
            for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def patched_by_peft(model, adapter):
    """What a peft-loaded consumer applies: base weight + the layer's own delta."""
    from peft.tuners.lokr.layer import LoKrLayer
    from peft.tuners.lora import LoraLayer

    return {name: (m.base_layer.weight + m.get_delta_weight(adapter)).detach()
            for name, m in model.named_modules() if isinstance(m, (LoraLayer, LoKrLayer))}


def assert_same_patches(expected: dict, got: dict, atol=1e-5):
    assert set(got) == set(expected), f"adapted modules differ: {sorted(set(got) ^ set(expected))[:5]}"
    for name in expected:
        diff = (expected[name] - got[name]).abs().max().item()
        assert diff < atol, f"{name}: max |Δ| {diff}"


def test_peft_lora_round_trips_through_diffusers_anima_loader(tmp_path):
    from diffusers.modular_pipelines import AnimaAutoBlocks

    transformer, conditioner = with_lora()
    meta = lora_export.training_metadata(kind="lora", title="t", rank=4, alpha=8.0)
    path = lora_export.save_adapter(tmp_path / "l.safetensors", transformer, conditioner, meta, fmt="peft")
    keys = list(load_file(path))
    assert all(k.startswith("diffusion_model.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    assert any(k.startswith("diffusion_model.llm_adapter.blocks.0.self_attn.q_proj.") for k in keys)
    assert "diffusion_model.blocks.1.self_attn.output_proj.lora_B.weight" in keys  # native names

    fresh_t, fresh_c, _ = tiny_parts()  # same seed -> same base weights
    pipe = AnimaAutoBlocks().init_pipeline()
    pipe.update_components(transformer=fresh_t, text_conditioner=fresh_c)
    pipe.load_lora_weights(str(tmp_path), weight_name="l.safetensors", adapter_name="loaded")
    assert_same_patches(expected_lora(transformer, 4, 8.0), patched_by_peft(fresh_t, "loaded"))
    assert_same_patches(expected_lora(conditioner, 2, 3.0), patched_by_peft(fresh_c, "loaded"))


def test_kohya_lora_keys_and_alpha_give_the_same_update():
    transformer, conditioner = with_lora()
    sd = lora_export.adapter_state_dict(transformer, conditioner, fmt="kohya")
    assert all(k.startswith("lora_unet_") for k in sd)
    expected = {**{keymaps.dit_module_to_native(k): v for k, v in expected_lora(transformer, 4, 8.0).items()},
                **{"llm_adapter." + k: v for k, v in expected_lora(conditioner, 2, 3.0).items()}}
    base = {**keymaps.dit_diffusers_to_native(tiny_parts()[0].state_dict()),
            **keymaps.adapter_diffusers_to_native(tiny_parts()[1].state_dict())}
    for native, want in expected.items():
        stem = "lora_unet_" + native.replace(".", "_")
        down, up, alpha = sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"], sd[f"{stem}.alpha"]
        assert alpha.ndim == 0
        # ComfyUI / sd-scripts rule: W + (alpha / rank) · up @ down, rank = lora_down.shape[0]
        got = base[native + ".weight"] + (alpha.item() / down.shape[0]) * up @ down
        assert torch.allclose(got, want, atol=1e-5), native
    assert len(sd) == 3 * len(expected)


def with_lokr(**config):
    transformer, conditioner, _ = tiny_parts()
    torch.manual_seed(2)
    transformer.add_adapter(LoKrConfig(target_modules=["attn1.to_q", "attn2.to_v", "ff.net.0.proj"],
                                       init_weights=False, **config), adapter_name="default")
    return transformer, conditioner


def expected_lokr(model, rank, alpha, adapter="default"):
    from peft.tuners.lokr.layer import LoKrLayer

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoKrLayer):
            w1 = m.lokr_w1[adapter] if adapter in m.lokr_w1 else m.lokr_w1_a[adapter] @ m.lokr_w1_b[adapter]
            w2 = m.lokr_w2[adapter] if adapter in m.lokr_w2 else m.lokr_w2_a[adapter] @ m.lokr_w2_b[adapter]
            out[name] = (m.base_layer.weight + torch.kron(w1, w2) * (alpha / rank)).detach()
    return out


def lokr_for_diffusers(sd: dict) -> dict:
    """What a diffusers user does with our ComfyUI LoKr file: diffusers names, and the alpha/dim that ComfyUI applies
    to decomposed modules baked into w1 (diffusers' loader assumes scale 1)."""
    modules = {k.rsplit(".", 1)[0] for k in sd}
    out = {}
    for module in modules:
        f = {k.rsplit(".", 1)[1]: v for k, v in sd.items() if k.rsplit(".", 1)[0] == module}
        if "alpha" in f:
            dim = f["lokr_w2_b"].shape[0] if "lokr_w2_b" in f else f["lokr_w1_b"].shape[0]
            scale = f.pop("alpha").item() / dim
            w1 = "lokr_w1" if "lokr_w1" in f else "lokr_w1_a"
            f[w1] = f[w1] * scale
        name = keymaps.dit_module_to_diffusers(module.removeprefix("diffusion_model."))
        out.update({f"{name}.{k}": v for k, v in f.items()})
    return out


@pytest.mark.parametrize("config, factors", [
    # r=4: 64x64 layers keep a full w2 (peft: r >= max(8, 8)/2), 64->256 decomposes w2
    (dict(r=4, alpha=6.0), {"lokr_w1", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "alpha"}),
    (dict(r=2, alpha=3.0, decompose_both=True), {"lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "alpha"}),
])
def test_lokr_keys_are_what_comfyui_reads_and_diffusers_applies_the_same_update(tmp_path, config, factors):
    transformer, conditioner = with_lokr(**config)
    path = lora_export.save_adapter(tmp_path / "k.safetensors", transformer, conditioner,
                                    lora_export.training_metadata(kind="lokr", title="k", rank=config["r"],
                                                                  alpha=config["alpha"]), kind="lokr")
    sd = load_file(path)
    assert not any("default" in k for k in sd)
    assert {k.rsplit(".", 1)[1] for k in sd} == factors
    for module in {k.rsplit(".", 1)[0] for k in sd}:
        present = {k.rsplit(".", 1)[1] for k in sd if k.rsplit(".", 1)[0] == module}
        decomposed = bool(present & {"lokr_w1_a", "lokr_w2_a"})
        assert ("alpha" in present) == decomposed, module  # alpha only where ComfyUI reads it
    loaded = tiny_parts()[0]
    loaded.load_lora_adapter(lokr_for_diffusers(sd), prefix=None, adapter_name="loaded")
    assert_same_patches(expected_lokr(transformer, config["r"], config["alpha"]), patched_by_peft(loaded, "loaded"))


def test_lokr_in_kohya_format_is_refused(tmp_path):
    transformer, conditioner = with_lokr(r=4, alpha=4.0)
    with pytest.raises(ValueError, match="kohya"):
        lora_export.save_adapter(tmp_path / "k.safetensors", transformer, conditioner, kind="lokr", fmt="kohya")
    assert not list(tmp_path.iterdir())


def test_loha_keys_and_alpha_give_peft_update_under_comfyuis_rule(tmp_path):
    """ComfyUI's LoHa rule (comfy/weight_adapter/loha.py): W + alpha / hada_w1_b.shape[0] · (w1_a·w1_b) ⊙
    (w2_a·w2_b), compared with peft's own ΔW of the layer; a per-module rank and alpha (rank_pattern) keep
    alpha != rank."""
    transformer, conditioner, _ = tiny_parts()
    torch.manual_seed(4)
    transformer.add_adapter(LoHaConfig(r=4, alpha=6.0, target_modules=["attn1.to_q", "attn2.to_v", "ff.net.0.proj"],
                                       rank_pattern={"ff.net.0.proj": 2}, alpha_pattern={"ff.net.0.proj": 5.0},
                                       init_weights=False), adapter_name="default")
    conditioner.add_adapter(LoHaConfig(r=2, alpha=3.0, target_modules=ADAPTER_TARGETS, init_weights=False),
                            adapter_name="default")
    meta = lora_export.training_metadata(kind="loha", title="h", rank=4, alpha=6.0)
    path = lora_export.save_adapter(tmp_path / "h.safetensors", transformer, conditioner, meta, kind="loha")
    sd = load_file(path)
    assert all(k.startswith("diffusion_model.") and "default" not in k for k in sd)
    assert {k.rsplit(".", 1)[1] for k in sd} == {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"}
    assert "diffusion_model.blocks.0.mlp.layer1.hada_w1_b" in sd  # native names (ff.net.0.proj -> mlp.layer1)
    assert any(k.startswith("diffusion_model.llm_adapter.blocks.0.self_attn.q_proj.") for k in sd)
    assert sd["diffusion_model.blocks.0.mlp.layer1.hada_w1_b"].shape[0] == 2
    base = {**keymaps.dit_diffusers_to_native(tiny_parts()[0].state_dict()),
            **keymaps.adapter_diffusers_to_native(tiny_parts()[1].state_dict())}
    from peft.tuners.loha.layer import LoHaLayer

    expected = {}
    for part, model, native_of in (("t", transformer, keymaps.dit_module_to_native),
                                   ("c", conditioner, lambda n: "llm_adapter." + n)):
        for name, m in model.named_modules():
            if isinstance(m, LoHaLayer):
                expected[native_of(name)] = (m.base_layer.weight + m.get_delta_weight("default")).detach()
    # 3 DiT Linears x 2 blocks, 5 conditioner Linears x 2 blocks; 4 factors + alpha each
    assert len(expected) == 6 + 10 and len(sd) == 5 * len(expected)
    for native, want in expected.items():
        f = {n: sd[f"diffusion_model.{native}.{n}"] for n in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")}
        alpha = sd[f"diffusion_model.{native}.alpha"]
        assert alpha.ndim == 0 and alpha.dtype == torch.float32
        got = base[native + ".weight"] + (alpha.item() / f["hada_w1_b"].shape[0]) * (
            (f["hada_w1_a"] @ f["hada_w1_b"]) * (f["hada_w2_a"] @ f["hada_w2_b"]))
        assert torch.allclose(got, want, atol=1e-6), native
    with safe_open(str(path), "pt") as handle:
        md = handle.metadata()
    assert md["ss_network_module"] == "lycoris.kohya" and json.loads(md["ss_network_args"]) == {"algo": "loha"}
    assert md["modelspec.architecture"] == "anima/lycoris" and md["ss_network_dim"] == "4"
    half = lora_export.adapter_state_dict(transformer, conditioner, kind="loha", dtype=torch.bfloat16)
    assert {v.dtype for k, v in half.items() if not k.endswith(".alpha")} == {torch.bfloat16}
    assert {v.dtype for k, v in half.items() if k.endswith(".alpha")} == {torch.float32}
    with pytest.raises(ValueError, match="kohya lora_unet_\\* layout only defines LoRA"):
        lora_export.save_adapter(tmp_path / "k.safetensors", transformer, conditioner, kind="loha", fmt="kohya")
    with pytest.raises(ValueError, match="no peft LoHa adapter named 'other'"):
        lora_export.adapter_state_dict(transformer, kind="loha", adapter_name="other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.safetensors"]


def test_text_encoder_lora_uses_comfyui_single_te_keys(tmp_path):
    _, _, te = tiny_parts()
    base = {k: v.clone() for k, v in te.state_dict().items()}
    torch.manual_seed(3)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    # transformers 5.24's add_adapter wants peft >= 0.22; peft's own injection works with 0.21 and is what the
    # trainer can use on Qwen3Model
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=2.0, target_modules=targets, init_lora_weights=False), te,
                            adapter_name="default")
    main = tmp_path / "run-step000010.safetensors"
    path = lora_export.save_text_encoder_lora(lora_export.text_encoder_lora_path(main), te,
                                              lora_export.training_metadata(kind="te_lora", title="run", rank=4,
                                                                            alpha=2.0))
    assert path.name == "run-step000010_te.safetensors"
    sd = load_file(path)
    expected = expected_lora(te, 4, 2.0)
    assert len(expected) == 2 * len(targets) and len(sd) == 3 * len(expected)
    for name, want in expected.items():
        stem = "lora_te_" + name.replace(".", "_")  # e.g. lora_te_layers_0_self_attn_q_proj
        down, up = sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"]
        got = base[name + ".weight"] + sd[f"{stem}.alpha"].item() / down.shape[0] * up @ down
        assert torch.allclose(got, want, atol=1e-5), name


def test_full_native_has_the_input_checkpoints_names_and_tensors(tmp_path, tiny_anima):
    from diffusers import CosmosTransformer3DModel
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner

    repo = tiny_anima.diffusers_dir
    transformer = CosmosTransformer3DModel.from_pretrained(repo, subfolder="transformer")
    conditioner = AnimaTextConditioner.from_pretrained(repo, subfolder="text_conditioner")
    meta = lora_export.training_metadata(kind="full", title="ft", steps=7, resolution=[512, 768])
    path = full.save_native(tmp_path / "ft.safetensors", transformer, conditioner, meta)
    original, written = load_file(tiny_anima.anima_file), load_file(path)
    assert set(written) == set(original) and len(written) == len(original)
    assert any(k.startswith("net.llm_adapter.") for k in written)
    for k in original:
        assert written[k].dtype == original[k].dtype and torch.equal(written[k], original[k]), k
    with safe_open(str(path), "pt") as f:
        md = f.metadata()
    assert md["ss_steps"] == "7" and md["modelspec.resolution"] == "768x768" and "ss_network_dim" not in md

    # diffusers folders: each loads back with from_pretrained, same weights, metadata in the file
    folder = full.save_diffusers(tmp_path / "ft", transformer, conditioner, meta)
    again = CosmosTransformer3DModel.from_pretrained(folder, subfolder="transformer")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), transformer.state_dict().values()))
    with safe_open(str(folder / "text_conditioner" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert f.metadata()["modelspec.implementation"] == "diffusers"

    transformer.add_adapter(LoraConfig(r=2, target_modules=["to_q"]))
    with pytest.raises(ValueError, match="peft adapter"):
        full.save_native(tmp_path / "ft2.safetensors", transformer, conditioner)


def test_metadata_keys_and_atomic_no_overwrite(tmp_path):
    transformer, conditioner = with_lora()
    config = {"adapter": {"kind": "lora", "rank": 4}, "train": {"epochs": 3}}
    tags = {"data/1_cat": {"cat": 10, "solo": 4}}
    meta = lora_export.training_metadata(kind="lora", title="my-run", rank=4, alpha=8.0, resolution=1024, steps=120,
                                         epoch=2, num_epochs=3, tag_frequency=tags, training_config=config)
    path = lora_export.save_adapter(tmp_path / "my-run.safetensors", transformer, conditioner, meta, fmt="kohya")
    with safe_open(str(path), "pt") as f:
        md = f.metadata()
    assert md["ss_network_dim"] == "4" and md["ss_network_alpha"] == "8.0"
    assert md["ss_network_module"] == "networks.lora" and md["ss_base_model_version"] == "anima"
    assert md["ss_steps"] == "120" and md["ss_epoch"] == "2" and md["ss_num_epochs"] == "3"
    assert md["ss_resolution"] == "(1024, 1024)" and md["modelspec.resolution"] == "1024x1024"
    assert json.loads(md["ss_tag_frequency"]) == tags and json.loads(md["ss_training_config"]) == config
    assert md["modelspec.sai_model_spec"] == "1.0.1" and md["modelspec.architecture"] == "anima/lora"
    assert md["modelspec.title"] == "my-run" and md["modelspec.implementation"].startswith("https://")
    assert md[lora_export.STEP_KEY] == "120"

    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        lora_export.save_adapter(path, transformer, conditioner, meta)
    assert path.read_bytes() == before
    lora_export.save_adapter(path, transformer, conditioner, meta, fmt="peft", overwrite=True)
    assert path.read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-run.safetensors"]  # no temp files left

    lokr_meta = lora_export.training_metadata(kind="lokr", title="k", rank=8, alpha=8,
                                              network_args={"factor": -1, "decompose_both": False})
    assert json.loads(lokr_meta["ss_network_args"])["algo"] == "lokr"
    assert lokr_meta["ss_network_module"] == "lycoris.kohya"


def test_no_adapter_and_bad_format_are_refused():
    transformer, conditioner, _ = tiny_parts()
    with pytest.raises(ValueError, match="no peft LoRA adapter named 'default'"):
        lora_export.adapter_state_dict(transformer, conditioner)
    transformer.add_adapter(LoraConfig(r=2, target_modules=["to_q"]), adapter_name="default")
    with pytest.raises(ValueError, match="fmt must be one of"):
        lora_export.adapter_state_dict(transformer, fmt="diffusers")
    with pytest.raises(ValueError, match="named 'other'"):
        lora_export.adapter_state_dict(transformer, adapter_name="other")


def test_compiled_blocks_export_the_same_keys():
    """Regional torch.compile wraps blocks in `_orig_mod`; the exported names must not change."""
    transformer, conditioner = with_lora()
    plain = lora_export.adapter_state_dict(transformer, conditioner)
    transformer.transformer_blocks[0] = torch.compile(transformer.transformer_blocks[0])  # wraps, compiles lazily
    assert any("_orig_mod" in n for n, _ in transformer.named_modules())
    compiled = lora_export.adapter_state_dict(transformer, conditioner)
    assert compiled.keys() == plain.keys() and all(torch.equal(compiled[k], plain[k]) for k in plain)


def comfyui_dora(weight, up, down, alpha, dora_scale):
    """ComfyUI's DoRA at strength 1 (comfy/weight_adapter/base.py weight_decompose, fp32), written from its formula:
    a dora_scale per output row scales W + alpha/r·up·down by dora_scale / (‖W‖ + eps), the norm of each row of the
    base weight."""
    updated = weight + (alpha / down.shape[0]) * (up @ down)
    assert dora_scale.shape[0] == weight.shape[0]  # the output axis, the one peft normalises
    norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True) + torch.finfo(weight.dtype).eps
    return updated * (dora_scale / norm)


def test_dora_file_under_comfyuis_rule_gives_the_trained_modules_forward(tmp_path):
    """A DoRA (peft use_dora, trained away from its init: B, A and the magnitude all non-trivial, alpha != rank and a
    per-module rank and alpha) written as lora_up/lora_down/alpha/dora_scale: ComfyUI's weight decomposition of the
    file's tensors gives the weight whose product is the module's own forward, in fp32."""
    from peft.tuners.lora import LoraLayer

    transformer, conditioner, _ = tiny_parts()
    torch.manual_seed(5)
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=6.0, target_modules=["attn1.to_q", "attn2.to_v", "ff.net.2"],
                                       rank_pattern={"ff.net.2": 2}, alpha_pattern={"ff.net.2": 5.0},
                                       init_lora_weights=False, use_dora=True), adapter_name="default")
    conditioner.add_adapter(LoraConfig(r=2, lora_alpha=3.0, target_modules=ADAPTER_TARGETS, init_lora_weights=False,
                                       use_dora=True), adapter_name="default")
    layers = {}
    for part, model, native_of in (("t", transformer, keymaps.dit_module_to_native),
                                   ("c", conditioner, lambda n: "llm_adapter." + n)):
        for name, m in model.named_modules():
            if isinstance(m, LoraLayer):
                layers[native_of(name)] = m
                with torch.no_grad():  # a trained magnitude: no longer the base weight's row norms
                    m.lora_magnitude_vector["default"].weight.mul_(1 + 0.2 * torch.rand_like(
                        m.lora_magnitude_vector["default"].weight))
    meta = lora_export.training_metadata(kind="dora", title="d", rank=4, alpha=6.0)
    path = lora_export.save_adapter(tmp_path / "d.safetensors", transformer, conditioner, meta, kind="dora")
    sd = load_file(path)
    assert {k.rsplit(".", 1)[1] if not k.endswith(".weight") else k.rsplit(".", 2)[1] + ".weight" for k in sd} == \
        {"lora_up.weight", "lora_down.weight", "alpha", "dora_scale"}
    assert len(layers) == 6 + 10 and len(sd) == 4 * len(layers)
    assert sd["diffusion_model.blocks.0.mlp.layer2.lora_down.weight"].shape[0] == 2
    x = torch.randn(5, max(m.get_base_layer().in_features for m in layers.values()),
                    generator=torch.Generator().manual_seed(0))
    for native, m in layers.items():
        f = {n: sd[f"diffusion_model.{native}.{n}"] for n in ("lora_up.weight", "lora_down.weight", "dora_scale")}
        alpha = sd[f"diffusion_model.{native}.alpha"]
        base = m.get_base_layer()
        merged = comfyui_dora(base.weight.detach(), f["lora_up.weight"], f["lora_down.weight"], alpha.item(),
                              f["dora_scale"])
        inputs = x[:, :base.in_features]
        with torch.no_grad():
            want = m(inputs)
        got = inputs @ merged.T + (base.bias if base.bias is not None else 0)
        assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (native, (got - want).abs().max())
        assert not torch.allclose(merged, base.weight)  # the file changes the weight
        # our own decoder (anima-train evaluate) applies the same weight
        from anima_train import adapters
        decoded = base.weight + adapters.method("dora").runtime().delta({**f, "alpha": alpha}, base.weight.detach())
        assert torch.allclose(decoded, merged, atol=1e-6)
    with safe_open(str(path), "pt") as handle:
        md = handle.metadata()
    assert md["ss_network_module"] == "lycoris.kohya"
    assert json.loads(md["ss_network_args"]) == {"algo": "lora", "dora_wd": True}
    with pytest.raises(ValueError, match="kohya lora_unet_\\* layout only defines LoRA"):
        lora_export.save_adapter(tmp_path / "k.safetensors", transformer, conditioner, kind="dora", fmt="kohya")
    with pytest.raises(ValueError, match="DoRA / lora_bias adapters cannot be exported as plain LoRA files"):
        lora_export.adapter_state_dict(transformer, kind="lora")  # a LoRA file would drop the magnitude
    plain, _ = with_lora()
    with pytest.raises(ValueError, match="without DoRA's magnitude"):
        lora_export.adapter_state_dict(plain, kind="dora")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors"]
