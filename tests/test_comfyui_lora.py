"""Integration: ComfyUI's own loader applies our exported files exactly as peft computes them.

Runs only with COMFYUI_PATH (a ComfyUI checkout with Anima support) and COMFYUI_PYTHON (its venv's python; our venv's
torch differs from ComfyUI's, so ComfyUI code runs in a subprocess). Here we build the smallest Anima ComfyUI detects
(model/tiny.py size "comfy": width 256, 10 blocks, full-size llm_adapter), attach peft adapters with alpha != rank,
export every format, and compute the expected patched weights W + strength·ΔW from the peft parameters. The subprocess
loads the DiT with `comfy.sd.load_diffusion_model` (our full-finetune native file), applies each file with
`comfy.sd.load_lora_for_models`, and returns the weights ComfyUI patches (`patch_weight_to_device`). The Qwen3 LoRA
goes through `comfy.lora.model_lora_keys_clip` of ComfyUI's real Anima text-encoder class (built on the meta device:
ComfyUI hard-codes the 0.6B config) and `comfy.lora.calculate_weight` on tiny Qwen3 weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from peft import LoHaConfig, LoKrConfig, LoraConfig, inject_adapter_in_model
from safetensors.torch import load_file, save_file

from anima_train import adapters
from anima_train.model import keymaps
from anima_train.adapters import export as lora_export
from anima_train.adapters.full import model as full
from anima_train.model.tiny import CONFIGS, build_models

pytestmark = [pytest.mark.comfyui, pytest.mark.slow]

COMFY_SCRIPT = textwrap.dedent(r'''
    import json, logging, sys
    comfy_path, job_file = sys.argv[1], sys.argv[2]
    sys.path.insert(0, comfy_path)
    from comfy.cli_args import args
    args.cpu = True  # before anything imports comfy.model_management
    import torch
    from safetensors.torch import load_file, save_file
    import comfy.lora, comfy.sd, comfy.utils
    import comfy.text_encoders.anima as anima_te

    log = []
    class Keep(logging.Handler):
        def emit(self, record):
            log.append(record.getMessage())
    logging.getLogger().addHandler(Keep())
    logging.getLogger().setLevel(logging.INFO)

    jobs = json.load(open(job_file))
    report = {}
    model = comfy.sd.load_diffusion_model(jobs["dit"], model_options={"dtype": torch.float32})
    report["model_class"] = type(model.model).__name__
    report["unet_config"] = {k: v for k, v in model.model.model_config.unet_config.items() if k in
                             ("image_model", "model_channels", "num_blocks", "num_heads")}
    # the full-finetune file: every tensor ComfyUI loaded equals the file's (bf16 file -> fp32 model)
    file_sd = {k.removeprefix("net."): v for k, v in load_file(jobs["dit"]).items()}
    loaded = model.model.diffusion_model.state_dict()
    report["full_missing"] = sorted(set(file_sd) - set(loaded))
    report["full_mismatch"] = sorted(k for k in file_sd if k in loaded and not torch.equal(loaded[k], file_sd[k].float()))
    report["full_loaded"] = len(file_sd)

    for job in jobs["unet"]:
        lora = comfy.utils.load_torch_file(job["lora"], safe_load=True)
        start = len(log)
        patched, _ = comfy.sd.load_lora_for_models(model, None, lora, job["strength"], 0.0)
        out = {}
        for key in patched.patches:
            out[key] = patched.patch_weight_to_device(key, return_weight=True).detach().float().contiguous()
        save_file(out, job["out"])
        report[job["name"]] = {"log": log[start:], "patched": len(out)}

    # text encoder: ComfyUI's own Anima TE class gives the key names; weights are the tiny Qwen3's
    with torch.device("meta"):
        te = anima_te.AnimaTEModel(device="meta", dtype=torch.float32)
    key_map = comfy.lora.model_lora_keys_clip(te, {})
    te_job = jobs["te"]
    start = len(log)
    patches = comfy.lora.load_lora(comfy.utils.load_torch_file(te_job["lora"], safe_load=True), key_map)
    weights = load_file(te_job["weights"])
    out = {}
    for key, adapter in patches.items():
        w = weights[key].clone()
        out[key] = comfy.lora.calculate_weight([(te_job["strength"], adapter, 1.0, None, None)], w, key).contiguous()
    save_file(out, te_job["out"])
    report["te"] = {"log": log[start:], "patched": len(out)}
    json.dump(report, open(jobs["report"], "w"))
''')  # noqa: E501 (a line of the script above: wrapping it would change the string)

DIT_LORA = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "norm1.linear_1", "norm3.linear_2",
            "proj_out", "time_embed.t_embedder.linear_1"]
ADAPTER_LORA = ["q_proj", "k_proj", "v_proj", "o_proj", "mlp.0", "mlp.2", "out_proj"]
QWEN_LORA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_delta(m, adapter="default"):
    return (m.lora_B[adapter].weight @ m.lora_A[adapter].weight * (m.lora_alpha[adapter] / m.r[adapter])).detach()


def lokr_delta(m, alpha, adapter="default"):
    w1 = m.lokr_w1[adapter] if adapter in m.lokr_w1 else m.lokr_w1_a[adapter] @ m.lokr_w1_b[adapter]
    w2 = m.lokr_w2[adapter] if adapter in m.lokr_w2 else m.lokr_w2_a[adapter] @ m.lokr_w2_b[adapter]
    return (torch.kron(w1, w2) * (alpha / m.r[adapter])).detach()


def forward_weight(m) -> torch.Tensor:
    """The weight a layer's own forward multiplies by (its output on the identity, less the bias)."""
    base = m.get_base_layer()
    with torch.no_grad():
        out = m(torch.eye(base.in_features)) - (base.bias if base.bias is not None else 0)
    return out.T.contiguous()


def deltas(model, native_of, kind, alpha=None):
    from peft.tuners.loha.layer import LoHaLayer
    from peft.tuners.lokr.layer import LoKrLayer
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, m in model.named_modules():
        if kind == "lora" and isinstance(m, LoraLayer):
            out[native_of(name)] = lora_delta(m)
        elif kind == "lokr" and isinstance(m, LoKrLayer):
            out[native_of(name)] = lokr_delta(m, alpha)
        elif kind == "loha" and isinstance(m, LoHaLayer):
            out[native_of(name)] = m.get_delta_weight("default").detach()  # the peft model's own fp32 ΔW
        elif kind == "dora" and isinstance(m, LoraLayer):  # the trained module's forward less its base weight
            out[native_of(name)] = forward_weight(m) - m.get_base_layer().weight.detach()
    return out


def test_comfyui_applies_every_exported_format_like_peft(tmp_path):
    comfy_path, comfy_python = os.environ["COMFYUI_PATH"], os.environ.get("COMFYUI_PYTHON", sys.executable)
    models = build_models("comfy", seed=0, dtype=torch.float32)
    transformer, conditioner = models["transformer"], models["text_conditioner"]
    dit_state = {k: v.clone() for k, v in transformer.state_dict().items()}

    # the base DiT is our own full-finetune export (bf16, like the released file)
    dit_file = full.save_native(tmp_path / "anima_comfy.safetensors", transformer, conditioner,
                                lora_export.training_metadata(kind="full", title="base"), dtype=torch.bfloat16)
    base = {"diffusion_model." + k.removeprefix("net."): v.float() for k, v in load_file(dit_file).items()}
    dit_native = keymaps.dit_module_to_native
    torch.manual_seed(0)
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=8.0, target_modules=DIT_LORA, init_lora_weights=False))
    conditioner.add_adapter(LoraConfig(r=2, lora_alpha=3.0, target_modules=ADAPTER_LORA, init_lora_weights=False))
    lora_deltas = {**deltas(transformer, dit_native, "lora"),
                   **deltas(conditioner, lambda n: "llm_adapter." + n, "lora")}
    meta = lora_export.training_metadata(kind="lora", title="t", rank=4, alpha=8.0)
    files = {"peft": lora_export.save_adapter(tmp_path / "peft.safetensors", transformer, conditioner, meta),
             "kohya": lora_export.save_adapter(tmp_path / "kohya.safetensors", transformer, conditioner, meta,
                                               fmt="kohya")}
    strengths = {"peft": 1.0, "kohya": 0.5, "lokr": 0.75, "loha": 0.6, "dora": 0.8}
    expected = {name: lora_deltas for name in ("peft", "kohya")}
    del conditioner, models

    # LoKr on a fresh DiT: r=4 decomposes w2 of 256x256 layers (alpha written); rank 16 on norm1.linear_1 keeps
    # both factors full (alpha folded into w1, since ComfyUI ignores alpha there)
    from diffusers import CosmosTransformer3DModel

    lokr_dit = CosmosTransformer3DModel(**CONFIGS["comfy"]["transformer"])
    lokr_dit.load_state_dict(dit_state)
    lokr_dit.add_adapter(LoKrConfig(r=4, alpha=6.0, target_modules=["attn1.to_q", "attn2.to_k", "ff.net.2",
                                                                     "norm1.linear_1"],
                                    rank_pattern={"norm1.linear_1": 16}, alpha_pattern={"norm1.linear_1": 6.0},
                                    init_weights=False))
    files["lokr"] = lora_export.save_adapter(tmp_path / "lokr.safetensors", lokr_dit, None,
                                             lora_export.training_metadata(kind="lokr", title="k", rank=4, alpha=6.0),
                                             kind="lokr")
    expected["lokr"] = deltas(lokr_dit, dit_native, "lokr", alpha=6.0)
    lokr_keys = load_file(files["lokr"])
    assert any(k.endswith(".lokr_w2_b") for k in lokr_keys) and any(k.endswith(".lokr_w2") for k in lokr_keys)

    # LoHa on a fresh DiT: alpha != rank, and its own rank and alpha on norm1.linear_1 (ComfyUI takes the rank from
    # hada_w1_b's shape, so each module's `.alpha` must carry its own scale)
    loha_dit = CosmosTransformer3DModel(**CONFIGS["comfy"]["transformer"])
    loha_dit.load_state_dict(dit_state)
    loha_dit.add_adapter(LoHaConfig(r=4, alpha=6.0, target_modules=["attn1.to_q", "attn2.to_k", "ff.net.2",
                                                                     "norm1.linear_1"],
                                    rank_pattern={"norm1.linear_1": 2}, alpha_pattern={"norm1.linear_1": 5.0},
                                    init_weights=False))
    files["loha"] = lora_export.save_adapter(tmp_path / "loha.safetensors", loha_dit, None,
                                             lora_export.training_metadata(kind="loha", title="h", rank=4, alpha=6.0),
                                             kind="loha")
    expected["loha"] = deltas(loha_dit, dit_native, "loha")
    loha_keys = load_file(files["loha"])
    assert {k.rsplit(".", 1)[1] for k in loha_keys} == {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"}
    assert {v.shape[0] for k, v in loha_keys.items() if k.endswith(".hada_w1_b")} == {2, 4}

    # DoRA on a DiT with the file's bf16 weights (its dora_scale is made from the base weight ComfyUI patches), alpha
    # != rank and its own rank and alpha on norm1.linear_1, the magnitude moved off its init (as training moves it)
    dora_dit = CosmosTransformer3DModel(**CONFIGS["comfy"]["transformer"])
    dora_dit.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in dit_state.items()})
    dora_dit.add_adapter(LoraConfig(r=4, lora_alpha=6.0, target_modules=["attn1.to_q", "attn2.to_k", "ff.net.2",
                                                                         "norm1.linear_1"],
                                    rank_pattern={"norm1.linear_1": 2}, alpha_pattern={"norm1.linear_1": 5.0},
                                    init_lora_weights=False, use_dora=True))
    with torch.no_grad():
        for name, p in dora_dit.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.rand_like(p))
    files["dora"] = lora_export.save_adapter(tmp_path / "dora.safetensors", dora_dit, None,
                                             lora_export.training_metadata(kind="dora", title="d", rank=4, alpha=6.0),
                                             kind="dora")
    expected["dora"] = deltas(dora_dit, dit_native, "dora")
    dora_keys = load_file(files["dora"])
    assert {k.removesuffix(".weight").rsplit(".", 1)[1] for k in dora_keys} == {"lora_up", "lora_down", "alpha",
                                                                                "dora_scale"}

    # every adapter method of the registry has its file here (a new method without a round trip fails)
    assert {{"peft": "lora", "kohya": "lora"}.get(n, n) for n in files} == \
        {m.name for m in adapters.METHODS.values() if not m.trains_base}

    # Qwen3 LoRA on the tiny text encoder, base weights handed over under ComfyUI's TE key names
    te = build_models("tiny", seed=0)["text_encoder"]
    te_prefix = "qwen3_06b.transformer.model."
    te_base = {te_prefix + k: v.clone() for k, v in te.state_dict().items()}
    save_file(te_base, str(tmp_path / "te_base.safetensors"))
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=2.0, target_modules=QWEN_LORA, init_lora_weights=False), te)
    te_file = lora_export.save_text_encoder_lora(lora_export.text_encoder_lora_path(tmp_path / "peft.safetensors"),
                                                 te, lora_export.training_metadata(kind="te_lora", title="t"))
    te_deltas = deltas(te, lambda n: n, "lora")

    jobs = {"dit": str(dit_file), "report": str(tmp_path / "report.json"),
            "unet": [{"name": n, "lora": str(files[n]), "strength": strengths[n], "out": str(tmp_path / f"got_{n}.st")}
                     for n in files],
            "te": {"lora": str(te_file), "weights": str(tmp_path / "te_base.safetensors"), "strength": 0.5,
                   "out": str(tmp_path / "got_te.st")}}
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    (tmp_path / "comfy_apply.py").write_text(COMFY_SCRIPT)
    proc = subprocess.run([comfy_python, str(tmp_path / "comfy_apply.py"), comfy_path, str(tmp_path / "jobs.json")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    print(json.dumps({k: (v if k in ("model_class", "unet_config", "full_loaded") else
                          {kk: vv for kk, vv in v.items() if kk != "log"} if isinstance(v, dict) else len(v))
                      for k, v in report.items()}))

    assert report["model_class"] == "Anima" and report["unet_config"]["image_model"] == "anima"
    assert report["full_missing"] == [] and report["full_mismatch"] == [] and report["full_loaded"] == 325
    for name in files:
        got = load_file(tmp_path / f"got_{name}.st")
        want = {f"diffusion_model.{k}.weight": base[f"diffusion_model.{k}.weight"] + strengths[name] * d
                for k, d in expected[name].items()}
        assert set(got) == set(want), name  # every adapted module patched, nothing else
        worst = max((got[k] - w).abs().max().item() for k, w in want.items())
        print(f"{name}: {len(got)} weights patched by ComfyUI, max |Δ| vs peft = {worst:.2e}")
        assert worst < 1e-5, name
        noise = [line for line in report[name]["log"] if "not loaded" in line.lower() or "ERROR" in line]
        assert noise == [], noise

    got = load_file(tmp_path / "got_te.st")
    want = {te_prefix + k + ".weight": te_base[te_prefix + k + ".weight"] + 0.5 * d for k, d in te_deltas.items()}
    assert set(got) == set(want) and len(want) == 2 * len(QWEN_LORA)
    worst = max((got[k] - w).abs().max().item() for k, w in want.items())
    print(f"te: {len(got)} weights patched by ComfyUI, max |Δ| vs peft = {worst:.2e}")
    assert worst < 1e-5
    assert not [line for line in report["te"]["log"] if "not loaded" in line.lower()], report["te"]["log"]


KEY_MAP_SCRIPT = textwrap.dedent(r'''
    import json, sys
    comfy_path, shapes_file, out = sys.argv[1:4]
    sys.path.insert(0, comfy_path)
    from comfy.cli_args import args
    args.cpu = True
    import torch
    import comfy.lora, comfy.model_detection

    # a native Anima file's keys and shapes as meta tensors: ComfyUI detects and builds the model from them alone
    sd = {k: torch.empty(v, device="meta") for k, v in json.load(open(shapes_file)).items()}
    config = comfy.model_detection.model_config_from_unet(sd, "net.")
    model = config.get_model(sd, "net.", device=torch.device("meta"))
    json.dump({"image_model": config.unet_config.get("image_model"), "blocks": config.unet_config.get("num_blocks"),
               "keys": sorted(comfy.lora.model_lora_keys_unet(model, {}))}, open(out, "w"))
''')


def dit_lora_keys(blocks: int):
    """The full-size DiT with `blocks` blocks on the meta device, and our LoRA key stem for each of its Linears."""
    from diffusers import CosmosTransformer3DModel
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner

    with torch.device("meta"):
        transformer = CosmosTransformer3DModel(**dict(CONFIGS["full"]["transformer"], num_layers=blocks))
        conditioner = AnimaTextConditioner(**CONFIGS["full"]["text_conditioner"])
    keys = {lora_export.native_key("transformer", name) for name, m in transformer.named_modules()
            if isinstance(m, torch.nn.Linear)}
    return transformer, conditioner, keys


def in_block(keys, index: int) -> set:
    prefix = f"diffusion_model.blocks.{index}."
    return {k.removeprefix(prefix) for k in keys if k.startswith(prefix)}


def test_the_key_map_is_comfyuis_for_28_blocks_and_its_rule_for_40(tmp_path):
    """issue 43: the full-size 2B's LoRA keys are module names of the model ComfyUI builds from a 2B file (0.29 here:
    28 blocks for any 2048-wide Anima, so a 2.9B loads only from 0.33.1, which counts the blocks). A 40-block model's
    keys follow the same rule: block i's are block 0's with its index, for every i to 39."""
    comfy_path, comfy_python = os.environ["COMFYUI_PATH"], os.environ.get("COMFYUI_PYTHON", sys.executable)
    transformer, conditioner, ours = dit_lora_keys(28)
    native = keymaps.join_anima_native(transformer.state_dict(), conditioner.state_dict())
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({k: list(v.shape) for k, v in native.items()}))
    script, out = tmp_path / "key_map.py", tmp_path / "key_map.json"
    script.write_text(KEY_MAP_SCRIPT)
    done = subprocess.run([comfy_python, str(script), comfy_path, str(shapes), str(out)], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["image_model"] == "anima" and report["blocks"] == 28
    comfy = set(report["keys"])
    assert ours <= comfy, sorted(ours - comfy)[:5]  # every Linear of the DiT, named as ComfyUI's LoRA loader names it
    assert {int(k.split(".")[2]) for k in ours if k.startswith("diffusion_model.blocks.")} == set(range(28))

    _, _, deep = dit_lora_keys(40)
    per_block = in_block(ours, 0)
    assert per_block and per_block <= in_block(comfy, 0)
    assert all(in_block(deep, i) == per_block for i in range(40))
    assert {k for k in deep if not k.startswith("diffusion_model.blocks.")} == \
        {k for k in ours if not k.startswith("diffusion_model.blocks.")}
    assert len(deep) == len(ours) + 12 * len(per_block)
