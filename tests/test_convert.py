"""`anima-train convert` end to end on the tiny native files: identity round trip, refusals, tokenizer sources."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from anima_train import cli
from anima_train.model import convert, keymaps
from anima_train.model.components import check_repo, load_components
from tests import fixtures_tiny

WEIGHT_FILES = {"transformer": "diffusion_pytorch_model.safetensors",
                "text_conditioner": "diffusion_pytorch_model.safetensors",
                "text_encoder": "model.safetensors", "vae": "diffusion_pytorch_model.safetensors"}


def digest(path: Path) -> tuple:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def run_convert(tiny, out, *extra) -> int:
    return cli.main(["convert", "--anima", str(tiny.anima_file), "--qwen", str(tiny.qwen3_file),
                     "--vae", str(tiny.vae_file), "--out", str(out), *extra])


@pytest.fixture(scope="module")
def converted(tiny_anima, tmp_path_factory):
    """The tiny native files converted once (tokenizers from the tiny repo folder); read-only."""
    inputs = [tiny_anima.anima_file, tiny_anima.qwen3_file, tiny_anima.vae_file]
    before = [digest(p) for p in inputs]
    out = tmp_path_factory.mktemp("converted") / "repo"
    lines = []
    report = convert.convert(*inputs, out, tokenizers=str(tiny_anima.diffusers_dir), log=lines.append)
    assert [digest(p) for p in inputs] == before, "an input file was modified"
    return report, lines


def test_native_to_diffusers_to_native_is_the_identity(tiny_anima, converted):
    report, lines = converted
    out = report["out"]
    repo = {part: load_file(out / part / name) for part, name in WEIGHT_FILES.items()}
    reference = {part: load_file(tiny_anima.diffusers_dir / part / name) for part, name in WEIGHT_FILES.items()}
    for part in WEIGHT_FILES:  # same tensors as the diffusers repo the tiny builder saved with the real classes
        assert set(repo[part]) == set(reference[part]), part
        assert all(torch.equal(repo[part][k], reference[part][k]) for k in reference[part]), part

    back = {"anima": keymaps.join_anima_native(repo["transformer"], repo["text_conditioner"]),
            "qwen3": keymaps.qwen3_diffusers_to_native(repo["text_encoder"]),
            "vae": keymaps.vae_diffusers_to_native(repo["vae"])}
    for name, sd in back.items():
        original = load_file(tiny_anima.native_dir / f"{name}.safetensors")
        assert list(sd) and set(sd) == set(original), name
        for k, v in original.items():
            assert sd[k].dtype == v.dtype and torch.equal(sd[k], v), f"{name}: {k}"

    counts = report["counts"]
    assert counts["anima file"] == counts["transformer"] + counts["text_conditioner"] == 89
    assert counts["qwen file"] == counts["text_encoder"] and counts["vae file"] == counts["vae"]
    assert any("89 tensors -> transformer 47 + text_conditioner 42" in line for line in lines)


def test_converted_repo_layout_and_modular_index(tiny_anima, converted):
    out = converted[0]["out"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["transformer", "text_conditioner", "text_encoder", "vae", "scheduler", "tokenizer", "t5_tokenizer",
         "modular_model_index.json", convert.RECORD_NAME])
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "temp folder left behind"
    # the index equals the one AnimaModularPipeline.save_pretrained wrote for the tiny repo, modulo the path
    ours = json.loads((out / "modular_model_index.json").read_text())
    theirs = json.loads((tiny_anima.diffusers_dir / "modular_model_index.json").read_text()
                        .replace(str(tiny_anima.diffusers_dir), str(out)))
    assert ours == theirs
    scheduler = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "FlowMatchEulerDiscreteScheduler" and scheduler["shift"] == 3.0


def test_converted_repo_loads_and_runs_a_training_forward(converted):
    parts = load_components(converted[0]["out"], dtype="float32", device="cpu")
    assert parts._vae is None  # lazy
    images = torch.rand(2, 3, 64, 64) * 2 - 1
    loss = fixtures_tiny.training_loss(vars(parts) | {"vae": parts.vae}, images, ["red circle", "blue square"],
                                       generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and loss.item() > 0


def test_configs_inferred_from_full_size_shapes_are_the_real_ones():
    """On the meta device: the released files' shapes give exactly the configs of docs/model.md#configurations."""
    from accelerate import init_empty_weights

    from anima_train.model.tiny import CONFIGS
    from diffusers import AutoencoderKLQwenImage, CosmosTransformer3DModel
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    from transformers import Qwen3Config, Qwen3Model

    full = CONFIGS["full"]
    with init_empty_weights():
        dit = CosmosTransformer3DModel(**full["transformer"]).state_dict()
        cond = AnimaTextConditioner(**full["text_conditioner"]).state_dict()
        te = Qwen3Model(Qwen3Config(**full["text_encoder"])).state_dict()
        vae = AutoencoderKLQwenImage(**full["vae"]).state_dict()
    assert convert.transformer_config(dit) == full["transformer"]
    assert convert.conditioner_config(cond) == full["text_conditioner"]
    assert convert.qwen3_config(te) == full["text_encoder"]
    assert convert.vae_config(keymaps.vae_diffusers_to_native(vae), Path("vae")) == full["vae"]
    counts = (len(keymaps.join_anima_native(dit, cond)), len(keymaps.qwen3_diffusers_to_native(te)), len(vae))
    assert counts == (685, 310, 194)  # the released files


def test_non_empty_out_is_refused_and_left_alone(tiny_anima, tmp_path, capsys):
    out = tmp_path / "repo"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert run_convert(tiny_anima, out, "--tokenizers", "none") == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    # an empty folder is fine
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.warns(convert.TokenizersMissingWarning, match=r"skipped \(--tokenizers none\)"):
        assert run_convert(tiny_anima, empty, "--tokenizers", "none", "--no-modular-index") == 0
    assert (empty / "transformer" / "config.json").is_file() and not (empty / "modular_model_index.json").exists()


def test_file_in_the_wrong_slot_says_what_it_looks_like(tiny_anima, tmp_path):
    with pytest.raises(convert.ConvertError, match=r"--qwen .*vae\.safetensors looks like a Wan/Qwen-Image VAE, "
                                                   r"not a Qwen3-0.6B text encoder.*did you mean --vae\?"):
        convert.convert(tiny_anima.anima_file, tiny_anima.vae_file, tiny_anima.qwen3_file, tmp_path / "o",
                        tokenizers="none")
    with pytest.raises(convert.ConvertError, match=r"--anima .*already in diffusers layout"):
        convert.convert(tiny_anima.diffusers_dir / "transformer" / WEIGHT_FILES["transformer"],
                        tiny_anima.qwen3_file, tiny_anima.vae_file, tmp_path / "o", tokenizers="none")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_input_names_the_file(tiny_anima, tmp_path, damage):
    bad = tmp_path / "vae.safetensors"
    data = tiny_anima.vae_file.read_bytes()
    bad.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x07not a safetensors file" * 10)
    out = tmp_path / "out"
    with pytest.raises(convert.ConvertError,
                       match=rf"--vae {re.escape(str(bad))}: cannot read it as safetensors.*truncated or corrupt"):
        convert.convert(tiny_anima.anima_file, tiny_anima.qwen3_file, bad, out, tokenizers="none")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vae.safetensors"]


def test_unknown_tensor_is_named(tiny_anima, tmp_path):
    sd = load_file(tiny_anima.anima_file)
    sd["net.blocks.0.extra_gate.weight"] = torch.zeros(2)
    bad = tmp_path / "anima.safetensors"
    save_file(sd, str(bad))
    with pytest.raises(convert.ConvertError, match=r"--anima .*anima\.safetensors: .*blocks\.0\.extra_gate\.weight"):
        convert.convert(bad, tiny_anima.qwen3_file, tiny_anima.vae_file, tmp_path / "out", tokenizers="none")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["anima.safetensors"]


def test_failure_mid_conversion_leaves_no_half_repo(tiny_anima, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(convert, "vae_config", boom)  # after transformer/ and text_encoder/ were written
    with pytest.raises(RuntimeError, match="disk full"):
        convert.convert(tiny_anima.anima_file, tiny_anima.qwen3_file, tiny_anima.vae_file, tmp_path / "out",
                        tokenizers="none")
    assert list(tmp_path.iterdir()) == []


def test_tokenizers_from_a_repo_id_fetch_only_the_two_folders(tiny_anima, tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None, **kwargs):
        calls.append((repo_id, allow_patterns))
        return str(tiny_anima.diffusers_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    report = convert.convert(tiny_anima.anima_file, tiny_anima.qwen3_file, tiny_anima.vae_file, tmp_path / "out",
                             log=lambda *_: None)
    assert calls == [(convert.DEFAULT_TOKENIZER_REPO, ["tokenizer/*", "t5_tokenizer/*"])]
    assert convert.DEFAULT_TOKENIZER_REPO == "circlestone-labs/Anima-Base-v1.0-Diffusers"
    assert report["tokenizers"] == tiny_anima.diffusers_dir
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").is_file()


def test_unreachable_tokenizer_repo_refuses_before_reading_a_weight_and_writes_nothing(tiny_anima, tmp_path,
                                                                                       monkeypatch, capsys):
    # the trap this closes: offline, the repo was written without tokenizers ("success" with a warning), training
    # then failed, and a Convert with the tokenizers fixed refused the non-empty folder
    import huggingface_hub

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.setattr(convert, "load_tensors", lambda *a: pytest.fail("weights were read"))
    assert run_convert(tiny_anima, tmp_path / "out", "--tokenizers", "someone/anima-tokenizers") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(r"anima-train convert: (error: )?--tokenizers someone/anima-tokenizers: could "
                                      r"not fetch tokenizer/ and t5_tokenizer/ \(ConnectionError: no network\); "
                                      r"nothing was written\.", err[0]), err
    assert "a local folder holding tokenizer/ and t5_tokenizer/" in err[0] and "`none`" in err[0]
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_converting_again_with_the_tokenizers_completes_the_repo_it_wrote(tiny_anima, tmp_path, capsys):
    out = tmp_path / "repo"
    with pytest.warns(convert.TokenizersMissingWarning, match=r"same `anima-train convert`.*same files"):
        assert run_convert(tiny_anima, out, "--tokenizers", "none") == 0
    weights = {p: digest(p) for p in out.rglob("*.safetensors")}
    assert weights and not (out / "tokenizer").exists()
    capsys.readouterr()
    # the same files, the same folder, the tokenizers now given: completed, the weights left as they were
    assert run_convert(tiny_anima, out, "--tokenizers", str(tiny_anima.diffusers_dir)) == 0
    said = capsys.readouterr().out
    assert f"{out} was converted from these same files" in said and "added tokenizer/ and t5_tokenizer/" in said
    assert {p: digest(p) for p in out.rglob("*.safetensors")} == weights
    check_repo(out)  # trainable now
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp folder left
    # once more: up to date, nothing written
    before = sorted((str(p), p.stat().st_mtime_ns) for p in out.rglob("*"))
    assert run_convert(tiny_anima, out, "--tokenizers", str(tiny_anima.diffusers_dir)) == 0
    assert "is complete: up to date, nothing written" in capsys.readouterr().out
    assert sorted((str(p), p.stat().st_mtime_ns) for p in out.rglob("*")) == before
    # other input files (here: the same file touched since) are another conversion: refused, repo untouched
    import os

    os.utime(tiny_anima.vae_file, ns=(tiny_anima.vae_file.stat().st_atime_ns,
                                      tiny_anima.vae_file.stat().st_mtime_ns + 1))
    try:
        assert run_convert(tiny_anima, out, "--tokenizers", "none") == 2
        assert "not an empty folder" in capsys.readouterr().err
    finally:
        os.utime(tiny_anima.vae_file, ns=(tiny_anima.vae_file.stat().st_atime_ns,
                                          tiny_anima.vae_file.stat().st_mtime_ns - 1))
    assert sorted((str(p), p.stat().st_mtime_ns) for p in out.rglob("*")) == before


def test_bad_tokenizer_source_is_refused_before_reading_weights(tiny_anima, tmp_path, monkeypatch):
    monkeypatch.setattr(convert, "load_tensors", lambda *a: pytest.fail("weights were read"))
    with pytest.raises(convert.ConvertError, match="neither an existing folder nor a Hugging Face repo id"):
        convert.convert(tiny_anima.anima_file, tiny_anima.qwen3_file, tiny_anima.vae_file, tmp_path / "o",
                        tokenizers="./no/such/folder")
    half = tmp_path / "half"
    shutil.copytree(tiny_anima.diffusers_dir / "tokenizer", half / "tokenizer")
    with pytest.raises(convert.ConvertError, match="has no t5_tokenizer/"):
        convert.convert(tiny_anima.anima_file, tiny_anima.qwen3_file, tiny_anima.vae_file, tmp_path / "o",
                        tokenizers=str(half))
