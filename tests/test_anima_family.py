"""The Anima family as users have it (issue 43): Anima-2.9B is the 2B deepened from 28 to 40 blocks, same widths. A
40-block single file at tiny width, in the 2.9B's key layout with its derived RoPE buffer (`pos_embedder.seq`, stored
with a shape of its own), goes through `convert`, trains every adapter method and a full finetune, and comes out
as files in ComfyUI's key space for blocks 0-39 whose metadata names the model trained. Settings that count blocks
count the model's, and an anchor made for 28 sites is refused on the 40-block trunk by its width signature.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from anchor import SiteMismatch
from anchor.attach import attach
from anchor.modules import fresh_anchor
from anima_train import adapters
from anima_train.model.tiny import build_models, build_tiny_anima
from anima_train.training.train import train
from tests.fixtures_tiny import anima_train_cli
from tests.test_train import make_cfg

BLOCKS = 40
NAME = "anima-2.9b-tiny.safetensors"
# ComfyUI's naming rule for a LoRA on the Anima DiT: `diffusion_model.` + the native module path (comfy/lora.py
# model_lora_keys_unet maps every weight of the diffusion model this way), one entry per Linear an adapter wraps
COMFY_MODULE = re.compile(r"diffusion_model\.blocks\.(\d+)\.(self_attn\.(q|k|v|output)_proj|"
                          r"cross_attn\.(q|k|v|output)_proj|mlp\.layer[12])")


def deep_file(tmp_path_factory) -> tuple[Path, object]:
    """The tiny 40-block model's native single file, as the 2.9B's is laid out: `net.` keys for 40 blocks and the
    LLM adapter, plus `net.pos_embedder.seq` (a derived RoPE table, here of a length no model of ours builds)."""
    built = build_tiny_anima(tmp_path_factory.mktemp("anima_2_9b"), blocks=BLOCKS)
    tensors = load_file(str(built.anima_file))
    tensors["net.pos_embedder.seq"] = torch.arange(2 * 384, dtype=torch.float32).reshape(384, 2)
    path = built.root / NAME
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, built


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    path, built = deep_file(tmp_path_factory)
    out = built.root / "converted"
    done = anima_train_cli("convert", "--anima", path, "--qwen", built.qwen3_file, "--vae", built.vae_file,
                           "--out", out, "--tokenizers", built.diffusers_dir, cwd=built.root)
    assert done.returncode == 0, done.stderr[-3000:]
    return path, built, out


def test_convert_takes_a_40_block_single_file(deep):
    path, _, repo = deep
    config = json.loads((repo / "transformer" / "config.json").read_text())
    assert config["num_layers"] == BLOCKS and config["attention_head_dim"] * config["num_attention_heads"] == 64
    with safe_open(str(next((repo / "transformer").glob("*.safetensors"))), "pt") as f:
        keys = set(f.keys())
    assert {int(k.split(".")[1]) for k in keys if k.startswith("transformer_blocks.")} == set(range(BLOCKS))
    assert not any("pos_embedder" in k for k in keys)  # derived at run time from the config: never loaded
    record = json.loads((repo / "anima-convert.json").read_text())
    assert record["model"] == {"file": NAME, "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                               "blocks": BLOCKS}


def _damaged(tmp_path, built, edit) -> str:
    tensors = {k: v.clone() for k, v in load_file(str(built.anima_file)).items()}
    edit(tensors)
    tmp_path.mkdir()
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad))
    done = anima_train_cli("convert", "--anima", bad, "--qwen", built.qwen3_file, "--vae", built.vae_file,
                           "--out", tmp_path / "out", "--tokenizers", "none", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "out").exists()
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_file_whose_blocks_do_not_match_is_refused_naming_the_block(deep, tmp_path):
    _, built, _ = deep

    def narrow(t):  # block 33's query projection from another model
        t["net.blocks.33.self_attn.q_proj.weight"] = t["net.blocks.33.self_attn.q_proj.weight"][:32]

    line = _damaged(tmp_path / "a", built, narrow)
    assert "block 33 does not match" in line
    assert "net.blocks.33.self_attn.q_proj.weight has shape [32, 64], block 0's is [64, 64]" in line

    def gap(t):  # block 28 dropped: blocks 0-27 and 29-39 (a loader that merged two files wrongly)
        for key in [k for k in t if k.startswith("net.blocks.28.")]:
            del t[key]

    assert "block 28 is missing" in _damaged(tmp_path / "b", built, gap)

    def lacking(t):
        del t["net.blocks.39.mlp.layer2.weight"]

    assert "block 39 does not match" in _damaged(tmp_path / "c", built, lacking)


@pytest.mark.parametrize("kind", adapters.kinds())
def test_a_40_block_model_trains_every_method_into_comfyui_keys(deep, latents_dir, tmp_path, kind):
    path, _, repo = deep
    result = train(make_cfg(repo, latents_dir, tmp_path / "out", f'kind = "{kind}"\n', max_steps=2, batch_size=2),
                   cpu=True)
    assert len(result.losses) == 2 and all(torch.isfinite(torch.tensor(result.losses)))
    with safe_open(str(result.final), "pt") as f:
        keys, md = list(f.keys()), f.metadata()
    if kind == "none":  # a full finetune: the native single file ComfyUI's UNETLoader reads
        assert {int(k.split(".")[2]) for k in keys if k.startswith("net.blocks.")} == set(range(BLOCKS))
        assert md["modelspec.architecture"] == "anima-40-blocks"
    else:
        factors = "|".join(re.escape(f) for f in adapters.method(kind).factors)
        modules = {re.sub(rf"\.({factors})$", "", k) for k in keys}
        assert all(COMFY_MODULE.fullmatch(m) for m in modules), sorted(modules)[:5]
        assert {int(COMFY_MODULE.fullmatch(m).group(1)) for m in modules} == set(range(BLOCKS))
        assert len(modules) == 10 * BLOCKS  # q, k, v, out of both attentions and the MLP's two, in every block
        assert md["modelspec.architecture"] == f"anima-40-blocks{adapters.method(kind).architecture}"
    # the base model trained, as its files name it: the single file convert read and its sha256
    assert md["ss_sd_model_name"] == NAME
    assert md["ss_new_sd_model_hash"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert md["ss_base_model_version"] == "anima"  # what ComfyUI reads as a LoRA's base model


def test_block_counting_settings_count_the_models_blocks(deep, latents_dir, tmp_path):
    """swap_blocks and checkpoint_blocks count the 40 blocks: the run says "of 40"; beyond 40 is one message."""
    _, _, repo = deep
    cfg = make_cfg(repo, latents_dir, tmp_path / "out", max_steps=1, batch_size=2, gradient_checkpointing="true",
                   swap_blocks=30, checkpoint_blocks=35)
    config = tmp_path / "swap.toml"
    config.write_text(cfg.source_text)
    done = anima_train_cli("train", config, "--cpu", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "30 of 40 DiT blocks swapped" in done.stdout and "checkpointing 35 of 40 blocks" in done.stdout
    config.write_text(cfg.source_text.replace("swap_blocks = 30", "swap_blocks = 41")
                      .replace("checkpoint_blocks = 35", "checkpoint_blocks = 44")
                      .replace('run_name = "tiny"', 'run_name = "beyond"'))
    done = anima_train_cli("train", config, "--cpu", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    text = done.stderr
    assert text.count("the model has 40 DiT blocks") == 2 and "2 paths cannot be used" in text, text
    assert "[train] swap_blocks = 41; set swap_blocks to at most 40" in text
    assert "[train] checkpoint_blocks = 44; set checkpoint_blocks to at most 40" in text


def test_a_28_site_anchor_is_refused_on_a_40_block_trunk_by_its_signature():
    """An anchor made for the 2B's 28 blocks is neither a full nor a half stack of the 2.9B's 40: the loader refuses
    it with both width signatures and the first differing index (the anchor format's loader checklist, step 3)."""
    trunk = build_models("tiny", blocks=BLOCKS)["transformer"]
    file = fresh_anchor("relay", [64] * 28, family="cosmos_dit", objective="flow", n_slots=2, K=8, hidden=6, rank=2)
    with pytest.raises(SiteMismatch) as refused:
        attach(trunk, file)
    text = str(refused.value)
    assert "cosmos_dit: the file has 28 sites but the trunk has 40 blocks" in text
    assert "first differing index 28" in text
    assert f"file widths: [{','.join(['64'] * 28)}]" in text and f"host widths: [{','.join(['64'] * 40)}]" in text
    assert refused.value.differing == list(range(28, 40))
    with attach(trunk, fresh_anchor("relay", [64] * 20, family="cosmos_dit", objective="flow", n_slots=2, K=8,
                                    hidden=6, rank=2)) as half:  # the 2.9B's own half stack attaches
        assert half.site_names[-1] == "transformer_blocks.38"
