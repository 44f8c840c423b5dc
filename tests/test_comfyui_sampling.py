"""A preview predicts what ComfyUI shows: our sampler (anima_train.training.previews) against ComfyUI's own KSampler.

On the tiny ComfyUI-detectable Anima (model/tiny.py size "comfy", fp32) with a LoRA attached: we render a prompt with
the trainer's sampler (the adapter active, our text path, our VAE decode). ComfyUI, in its own python, loads the same
DiT from the native file with UNETLoader's loader, applies the exported LoRA file, samples with `comfy.sample.sample`
(what KSampler runs: euler, simple, same seed/steps/cfg, an empty latent), and decodes with the native VAE file
through `comfy.sd.VAE`. The conditioning is the trainer's Qwen3 output in ComfyUI's layout (as nodes_train's
encode_conditioning builds it: ComfyUI's fixed-size Qwen3 cannot load the tiny one), so both sides run the LLM adapter
on the same input. Both images must agree to a small tolerance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = [pytest.mark.comfyui, pytest.mark.slow]

SCRIPT = textwrap.dedent(r'''
    import json, sys
    comfy_root, job = sys.argv[1], json.load(open(sys.argv[2]))
    sys.path.insert(0, comfy_root)
    from comfy.cli_args import args
    args.cpu = True  # before anything imports comfy.model_management
    import torch
    from safetensors.torch import load_file, save_file
    import comfy.sample, comfy.sd, comfy.utils

    torch.inference_mode().__enter__()  # as ComfyUI runs nodes
    model = comfy.sd.load_diffusion_model(job["dit"], model_options={"dtype": torch.float32})
    lora = comfy.utils.load_torch_file(job["lora"], safe_load=True)
    model, _ = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0.0)
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(job["vae"]))
    conds = load_file(job["conds"])
    def cond(side):
        ids = conds[side + "_t5_ids"]
        return [[conds[side + "_cross_attn"], {"t5xxl_ids": ids, "t5xxl_weights": torch.ones(ids.shape[0])}]]
    latent = torch.zeros(1, 16, 1, job["height"] // 8, job["width"] // 8)  # an empty Anima latent
    noise = comfy.sample.prepare_noise(latent, job["seed"])
    samples = comfy.sample.sample(model, noise, job["steps"], job["cfg"], "euler", "simple", cond("pos"),
                                  cond("neg"), latent, denoise=1.0, seed=job["seed"])
    image = vae.decode(samples)  # [B, (T,) H, W, 3] in 0..1
    save_file({"image": image.reshape(-1, *image.shape[-3:]).float().contiguous(),
               "samples": samples.float().contiguous()}, job["out"])
''')


def test_preview_equals_comfyui_ksampler(tmp_path):
    from peft import LoraConfig

    from anima_train.training import previews
    from anima_train.adapters import export as lora_export
    from anima_train.model.components import load_components
    from anima_train.model.tiny import build_tiny_anima
    from anima_train.model.prompts import encode_qwen, tokenize

    comfy_path, comfy_python = os.environ["COMFYUI_PATH"], os.environ.get("COMFYUI_PYTHON", sys.executable)
    tiny = build_tiny_anima(tmp_path / "tiny", seed=0, size="comfy", dtype=torch.float32)
    parts = load_components(tiny.diffusers_dir, dtype="float32")
    torch.manual_seed(1)  # a LoRA with non-zero B: the preview must include it, and so must ComfyUI
    parts.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4.0, target_modules=["to_q", "to_v", "ff.net.2"],
                                             init_lora_weights=False))
    for name, p in parts.transformer.named_parameters():
        if "lora_B" in name:
            p.data.mul_(0.3)
    lora_file = lora_export.save_adapter(tmp_path / "preview_lora.safetensors", parts.transformer, None,
                                         lora_export.training_metadata(kind="lora", title="t", rank=4, alpha=4.0),
                                         dtype=torch.float32)
    prompt, negative = "red circle, white background", "blue square"
    job = dict(width=64, height=48, steps=4, cfg=3.5, seed=123)

    images = previews.render([prompt], negative, width=job["width"], height=job["height"], steps=job["steps"],
                             cfg_scale=job["cfg"], seed=job["seed"], shift=3.0, transformer=parts.transformer,
                             conditioner=parts.text_conditioner, text_encoder=parts.text_encoder,
                             tokenizer=parts.tokenizer, t5_tokenizer=parts.t5_tokenizer, vae=parts.vae, device="cpu",
                             dtype=torch.float32)
    ours = images[0].permute(1, 2, 0)  # [H, W, 3] in 0..1

    conds = {}
    for side, text in (("pos", prompt), ("neg", negative)):  # the layout of nodes_train.encode_conditioning
        tok = tokenize([text], parts.tokenizer, parts.t5_tokenizer)
        with torch.no_grad():
            conds[f"{side}_cross_attn"] = encode_qwen(parts.text_encoder, tok["qwen_ids"], tok["qwen_mask"]).float()
        conds[f"{side}_t5_ids"] = tok["t5_ids"][0].to(torch.int32).contiguous()
    save_file(conds, str(tmp_path / "conds.safetensors"))
    job.update(dit=str(tiny.anima_file), vae=str(tiny.vae_file), lora=str(lora_file),
               conds=str(tmp_path / "conds.safetensors"), out=str(tmp_path / "comfy.safetensors"))
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "ksampler.py").write_text(SCRIPT)
    proc = subprocess.run([comfy_python, str(tmp_path / "ksampler.py"), comfy_path, str(tmp_path / "job.json")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = load_file(str(tmp_path / "comfy.safetensors"))["image"][0]

    assert theirs.shape == ours.shape == (48, 64, 3)
    diff = (theirs - ours).abs()
    print(f"preview vs ComfyUI KSampler: max |diff| {diff.max():.2e}, mean {diff.mean():.2e} (0..1 scale); "
          f"image std {ours.std():.3f}")
    assert ours.std() > 0.02  # a real picture, not a flat one that would match anything flat
    assert diff.max().item() < 2e-3 and diff.mean().item() < 2e-4

    # and the LoRA mattered: without it the picture is clearly different
    parts.transformer.disable_adapters()
    plain = previews.render([prompt], negative, width=job["width"], height=job["height"], steps=job["steps"],
                            cfg_scale=job["cfg"], seed=job["seed"], shift=3.0, transformer=parts.transformer,
                            conditioner=parts.text_conditioner, text_encoder=parts.text_encoder,
                            tokenizer=parts.tokenizer, t5_tokenizer=parts.t5_tokenizer, vae=parts.vae, device="cpu",
                            dtype=torch.float32)[0].permute(1, 2, 0)
    assert (plain - theirs).abs().mean() > 20 * diff.mean()
