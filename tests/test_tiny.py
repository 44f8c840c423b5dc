"""Tiny Anima builder, tokenizers and synthetic dataset (anima_train/model/tiny.py)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from anima_train.model import keymaps as km
from anima_train.model import tiny
from tests import fixtures_tiny

SUBFOLDERS = ("transformer", "text_conditioner", "text_encoder", "tokenizer", "t5_tokenizer", "vae", "scheduler")


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory):
    return fixtures_tiny.tiny_anima(tmp_path_factory)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_build_layout_and_determinism(tmp_path):
    # (its time is in every test run's slowest-test list, not asserted here: a loaded machine is no bug)
    a = tiny.build_tiny_anima(tmp_path / "a", seed=0)
    b = tiny.build_tiny_anima(tmp_path / "b", seed=0)
    assert sorted(p.name for p in a.diffusers_dir.iterdir()) == sorted((*SUBFOLDERS, "modular_model_index.json"))
    assert sorted(p.name for p in a.native_dir.iterdir()) == ["anima.safetensors", "qwen3.safetensors",
                                                              "vae.safetensors"]
    assert sorted(p.name for p in a.root.iterdir()) == ["diffusers", "native"]  # no temp folders left behind
    index = json.loads((a.diffusers_dir / "modular_model_index.json").read_text())
    assert index["_class_name"] == "AnimaModularPipeline"
    for name in SUBFOLDERS:
        assert index[name][2]["subfolder"] == name
        assert index[name][2]["pretrained_model_name_or_path"] == str(a.diffusers_dir)

    c = tiny.build_tiny_anima(tmp_path / "c", seed=1)
    fa, fb, fc = _files(a.root), _files(b.root), _files(c.root)
    index_file = "diffusers/modular_model_index.json"  # holds the absolute repo path, nothing else differs
    assert {k: v for k, v in fa.items() if k != index_file} == {k: v for k, v in fb.items() if k != index_file}
    weights = [k for k in fa if k.endswith(".safetensors")]
    assert len(weights) == 7 and all(fa[k] != fc[k] for k in weights)  # the seed reaches every model
    assert all(fa[k] == fc[k] for k in fa if "tokenizer" in k)  # tokenizers do not depend on the seed

    with pytest.raises(FileExistsError, match="overwrite=True"):
        tiny.build_tiny_anima(tmp_path / "a", seed=0)
    tiny.build_tiny_anima(tmp_path / "a", seed=1, overwrite=True)
    assert _files(a.root)["native/anima.safetensors"] == fc["native/anima.safetensors"]
    with pytest.raises(ValueError, match="size"):
        tiny.build_tiny_anima(tmp_path / "d", size="huge")


def test_native_files_map_back_to_the_diffusers_tensors(tiny_repo):
    repo = tiny_repo.diffusers_dir
    diffusers_sd = {name: load_file(next((repo / name).glob("*.safetensors")))
                    for name in ("transformer", "text_conditioner", "text_encoder", "vae")}
    anima = load_file(tiny_repo.anima_file)
    assert all(k.startswith("net.") for k in anima)
    dit, adapter = km.split_anima_native(anima)
    mapped = dict(transformer=dit, text_conditioner=adapter,
                  text_encoder=km.qwen3_native_to_diffusers(load_file(tiny_repo.qwen3_file)),
                  vae=km.vae_native_to_diffusers(load_file(tiny_repo.vae_file)))
    vae_native = load_file(tiny_repo.vae_file)
    assert km.state_dict_kind(vae_native) == "vae" and km.vae_num_res_blocks(vae_native) == 1
    for name, sd in diffusers_sd.items():
        assert sorted(mapped[name]) == sorted(sd), name
        for key, value in sd.items():
            assert torch.equal(mapped[name][key], value), (name, key)
    assert km.state_dict_kind(anima) == "anima_dit"
    assert km.state_dict_kind(load_file(tiny_repo.qwen3_file)) == "qwen3"


def test_repo_loads_with_plain_from_pretrained_and_trains(tiny_repo, tmp_path):
    parts = fixtures_tiny.load_repo(tiny_repo.diffusers_dir)
    assert parts["scheduler"].config.shift == 3.0
    assert parts["transformer"].config.num_layers == tiny.CONFIGS["tiny"]["transformer"]["num_layers"]
    paths = tiny.make_synthetic_dataset(tmp_path, n=2, seed=3, sizes=[(64, 64)])
    images = torch.stack([torch.from_numpy(np.array(Image.open(p).convert("RGB"))).permute(2, 0, 1)
                          for p in paths]).float() / 127.5 - 1
    captions = [p.with_suffix(".txt").read_text().strip() for p in paths]
    for name in ("transformer", "text_conditioner"):
        parts[name].train()
    loss = fixtures_tiny.training_loss(parts, images, captions, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    for name in ("transformer", "text_conditioner"):
        grads = [p.grad for p in parts[name].parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads), name
        assert sum(g.abs().sum().item() for g in grads) > 0, name
    # VAE round trip keeps the pixel shape
    with torch.no_grad():
        z = parts["vae"].encode(images[:, :, None]).latent_dist.mode()
        assert z.shape == (2, 16, 1, 8, 8)
        assert parts["vae"].decode(z).sample.shape == (2, 3, 1, 64, 64)


def test_modular_pipeline_loads_the_repo_and_runs(tiny_repo):
    from diffusers.modular_pipelines import AnimaModularPipeline

    pipe = AnimaModularPipeline.from_pretrained(str(tiny_repo.diffusers_dir))
    pipe.load_components(dtype=torch.float32)
    out = pipe(prompt="red circle, white background", height=64, width=64, num_inference_steps=2,
               generator=torch.Generator().manual_seed(0), output_type="pt", max_sequence_length=32)
    image = out.get("images")
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()
    assert out.get("prompt_embeds").shape == (1, 64, 32)  # tiny adapter: min_sequence_length 64, width 32


def test_tokenizers_fit_the_models_and_behave_like_qwen_and_t5(tiny_repo):
    parts = fixtures_tiny.load_repo(tiny_repo.diffusers_dir)
    tok, t5 = parts["tokenizer"], parts["t5_tokenizer"]
    cfg = tiny.CONFIGS["tiny"]
    assert len(tok) <= cfg["text_encoder"]["vocab_size"]
    assert len(t5) <= cfg["text_conditioner"]["target_vocab_size"]
    # Qwen: no BOS/EOS added, pad = <|endoftext|> (last id, as in the real vocabulary), byte-level round trip
    caption = "red circle, white background"
    ids = tok(caption).input_ids
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == len(tok) - 1 and tok.pad_token_id not in ids
    assert tok.decode(ids) == caption and tok.decode(tok("日本 ✓").input_ids) == "日本 ✓"
    assert len(ids) < len(caption) / 2  # merges were learnt from the tag corpus
    # T5: </s> = 1 appended, pad = 0, unk = 2, "" -> [1]; every dataset caption word is a single piece
    assert (t5.pad_token_id, t5.eos_token_id, t5.unk_token_id) == (0, 1, 2)
    assert t5("").input_ids == [1]
    t5_ids = t5(caption).input_ids
    assert t5_ids[-1] == 1 and t5.unk_token_id not in t5_ids
    assert t5.convert_ids_to_tokens(t5_ids) == ["▁red", "▁circle", ",", "▁white", "▁background", "</s>"]
    from transformers import AutoTokenizer  # the saved configs name their classes, so AutoTokenizer works too
    auto_q = AutoTokenizer.from_pretrained(tiny_repo.diffusers_dir / "tokenizer")
    auto_t5 = AutoTokenizer.from_pretrained(tiny_repo.diffusers_dir / "t5_tokenizer")
    assert (type(auto_q).__name__, auto_q(caption).input_ids) == ("Qwen2Tokenizer", ids)
    assert auto_t5(caption).input_ids == t5_ids
    # building again gives the same vocabularies (the BPE trainer is deterministic, the Unigram one is not used)
    assert tiny.build_qwen_tokenizer().get_vocab() == tok.get_vocab()
    assert tiny.build_t5_tokenizer().get_vocab() == t5.get_vocab()


def test_synthetic_dataset(tmp_path):
    paths = tiny.make_synthetic_dataset(tmp_path / "a", n=12, seed=5)
    assert len(paths) == 12 and {p.suffix for p in paths} == {".png", ".jpg"}
    aspects = []
    for p in paths:
        img = Image.open(p).convert("RGB")
        w, h = img.size
        aspects.append(w / h)
        assert 16 <= min(w, h) and max(w, h) <= 256
        colour_shape, background = p.with_suffix(".txt").read_text().strip().split(", ")
        colour, shape = colour_shape.split(" ")
        assert shape in tiny.SHAPES and background.endswith(" background")
        px = np.asarray(img).reshape(-1, 3).astype(int)
        near = lambda rgb: (np.abs(px - np.array(rgb)).sum(1) < 40).mean()  # noqa: E731
        # the captioned colour is really there (a shape of >= 0.6 x the short side, so >= ~5 % of a 0.3:1 image)
        assert near(tiny.COLOURS[colour]) > 0.04, p
        assert near(tiny.BACKGROUNDS[background.split(" ")[0]]) > 0.2, p  # ...on the captioned background
        others = [c for c in tiny.COLOURS if c != colour]
        assert max(near(tiny.COLOURS[c]) for c in others) < 0.02, p  # and no other shape colour
    assert min(aspects) == pytest.approx(0.3, abs=0.03) and max(aspects) == pytest.approx(3.2, abs=0.1)
    assert len({round(a, 2) for a in aspects}) > 6  # varied
    again = tiny.make_synthetic_dataset(tmp_path / "b", n=12, seed=5)
    assert [p.read_bytes() for p in paths] == [p.read_bytes() for p in again]
    assert [p.read_bytes() for p in paths] != [p.read_bytes() for p in tiny.make_synthetic_dataset(
        tmp_path / "c", n=12, seed=6)]
    with pytest.raises(FileExistsError, match="img_0000"):
        tiny.make_synthetic_dataset(tmp_path / "a", n=1, seed=5)
    fixed = tiny.make_synthetic_dataset(tmp_path / "d", n=3, sizes=[(96, 32), (32, 100)], max_side=512)
    assert [Image.open(p).size for p in fixed] == [(96, 32), (32, 100), (96, 32)]
    big = tiny.make_synthetic_dataset(tmp_path / "e", n=2, min_side=600, max_side=800)
    assert all(600 <= max(Image.open(p).size) <= 800 for p in big)


@pytest.mark.slow  # ~3 s of CPU but writes ~640 MB and peaks at ~1.5 GB RSS; over 20 s on a busy 2-core box
def test_comfy_size_matches_comfyui_detection(tmp_path):
    """The 'comfy' size carries what ComfyUI's detection reads (docs/comfyui.md#model-detection): width from
    x_embedder, exactly 10 blocks and 16 heads for that width, a full-size llm_adapter, a Wan2.1 VAE with
    num_res_blocks 2 and a 1024-wide Qwen3 with q_norm. Whether ComfyUI really loads it is the comfyui-marked
    integration test's job."""
    t0 = time.perf_counter()
    built = tiny.build_tiny_anima(tmp_path, size="comfy")
    elapsed = time.perf_counter() - t0
    try:
        _check_comfy_files(built)
    finally:
        shutil.rmtree(built.root)  # ~640 MB; do not leave it in pytest's retained temp folders
    print(f"comfy build {elapsed:.1f} s")


def _check_comfy_files(built):
    assert built.dtype == "torch.bfloat16"
    with safe_open(built.anima_file, "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert f.get_slice("net.blocks.0.mlp.layer1.weight").get_dtype() == "BF16"
    width, in_ch = shapes["net.x_embedder.proj.1.weight"]
    assert (width, in_ch // 4 - 1) == (256, 16)
    assert {int(k.split(".")[2]) for k in shapes if k.startswith("net.blocks.")} == set(range(10))
    assert shapes["net.blocks.0.self_attn.q_norm.weight"] == (width // 16,)  # 16 heads
    assert shapes["net.blocks.0.cross_attn.k_proj.weight"] == (256, 1024)  # ComfyUI's cross-attn 1024
    assert shapes["net.blocks.0.adaln_modulation_mlp.1.weight"] == (256, 256)  # AdaLN-LoRA rank 256
    assert "net.llm_adapter.blocks.0.cross_attn.q_proj.weight" in shapes
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    with torch.device("meta"):
        full_adapter = AnimaTextConditioner(**tiny.CONFIGS["full"]["text_conditioner"]).state_dict()
    assert {k[len("net.llm_adapter."):]: s for k, s in shapes.items() if "llm_adapter" in k} == \
        {k: tuple(v.shape) for k, v in full_adapter.items()}
    with safe_open(built.vae_file, "pt") as f:
        vae = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert vae == km.wan_vae_native_layout(base_dim=16) and vae["decoder.head.0.gamma"][0] == 16
    with safe_open(built.qwen3_file, "pt") as f:
        qwen = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert qwen["model.layers.0.post_attention_layernorm.weight"] == (1024,)
    assert "model.layers.0.self_attn.q_norm.weight" in qwen
    parts = fixtures_tiny.load_repo(built.diffusers_dir)
    assert parts["text_conditioner"].config.source_dim == parts["text_encoder"].config.hidden_size == 1024
