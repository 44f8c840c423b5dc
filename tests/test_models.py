"""load_components: what it returns, and that a bad repo is refused before a single weight is read."""

from __future__ import annotations

import shutil

import pytest
import torch

from anima_train.model import components


@pytest.fixture()
def no_weight_loading(monkeypatch):
    """Any from_pretrained of a model class fails the test: refusals must come first."""
    from diffusers import AutoencoderKLQwenImage, CosmosTransformer3DModel
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    from transformers import Qwen3Model

    for cls in (CosmosTransformer3DModel, AnimaTextConditioner, Qwen3Model, AutoencoderKLQwenImage):
        monkeypatch.setattr(cls, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("weights were loaded")))


def test_load_components_returns_every_part_in_the_dtype(tiny_anima):
    parts = components.load_components(tiny_anima.diffusers_dir, dtype="bfloat16", device="cpu")
    for name in ("transformer", "text_conditioner", "text_encoder"):
        model = getattr(parts, name)
        assert not model.training and next(model.parameters()).dtype == torch.bfloat16, name
        assert not any(p.requires_grad for p in model.parameters()), name
    assert type(parts.transformer).__name__ == "CosmosTransformer3DModel"
    assert type(parts.text_encoder).__name__ == "Qwen3Model"
    assert parts.tokenizer("red circle").input_ids and parts.t5_tokenizer("red circle").input_ids[-1] == 1
    assert parts.scheduler.config.shift == 3.0
    assert parts._vae is None
    vae = parts.vae
    assert type(vae).__name__ == "AutoencoderKLQwenImage" and parts.vae is vae
    parts.release_vae()
    assert parts._vae is None


def test_repo_without_tokenizers_is_refused_before_loading_weights(tiny_anima, tmp_path, no_weight_loading):
    repo = tmp_path / "repo"
    shutil.copytree(tiny_anima.diffusers_dir, repo, ignore=shutil.ignore_patterns("tokenizer", "t5_tokenizer"))
    with pytest.raises(components.ModelRepoError, match=r"no tokenizer/ and no t5_tokenizer/.*--tokenizers") as info:
        components.load_components(repo)
    assert "hf download" in str(info.value) and str(repo) in str(info.value)
    shutil.copytree(tiny_anima.diffusers_dir / "tokenizer", repo / "tokenizer")
    with pytest.raises(components.ModelRepoError, match=r"no t5_tokenizer/ folder"):
        components.load_components(repo)


def test_not_a_repo_is_refused_with_the_convert_command(tiny_anima, tmp_path, no_weight_loading):
    with pytest.raises(components.ModelRepoError, match="anima-train convert"):
        components.load_components(tmp_path / "missing")
    with pytest.raises(components.ModelRepoError, match="anima-train convert"):
        components.load_components(tiny_anima.native_dir)  # the single files, not a repo
    repo = tmp_path / "repo"
    shutil.copytree(tiny_anima.diffusers_dir, repo, ignore=shutil.ignore_patterns("text_encoder"))
    with pytest.raises(components.ModelRepoError, match=r"missing text_encoder/"):
        components.load_components(repo)


def test_resolve_dtype():
    assert (components.resolve_dtype("float16") is torch.float16
            and components.resolve_dtype(torch.float32) is torch.float32)
    with pytest.raises(ValueError, match="bfloat16, float16, float32"):
        components.resolve_dtype("int8")
