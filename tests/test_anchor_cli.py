"""`anima-train anchor-info FILE` and `anima-train anchor-convert IN OUT.safetensors` (wired to anchor/cli.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from anchor.format import content_hash_v2, load, save
from anchor.modules import fresh_anchor
from anima_train.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(n_slots=2, K=8, hidden=6)


def carded(anchor):
    anchor.meta.update(display_name="CLI Test Anchor", recommended_strength=0.7, nc=True, license="CC-BY-NC-4.0",
                       evidence="unit-test fixture, no training", band_roles=["low", "mid", "high"],
                       caveats=["made for a test"])
    anchor.meta["substrate"]["base_model_id"] = "circlestone-labs/Anima"
    return anchor


@pytest.fixture
def multiband_file(tmp_path):
    anchor = carded(fresh_anchor("multiband3", [16, 16, 32], family="cosmos_dit", objective="flow", rank=2))
    path = tmp_path / "mb.safetensors"
    save(anchor, path)
    return path


def test_anchor_info_runs_from_the_installed_entry_point(multiband_file):
    out = subprocess.run([sys.executable, "-m", "anima_train", "anchor-info", str(multiband_file)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("CLI Test Anchor   [NON-COMMERCIAL]")
    for piece in ("kind: multiband3 · sites: 3 · family: cosmos_dit · objective: flow",
                  "trunk: circlestone-labs/Anima", "evidence: unit-test fixture, no training",
                  "recommended strength: 0.7", "band 2: high", "caveat: made for a test",
                  "license: CC-BY-NC-4.0 (non-commercial)",
                  "width signature (3 sites, training order): [16,16,32]",
                  "hash check: verified (content_hash_v2 matches the tensors)"):
        assert piece in text, piece


def test_anchor_info_json(multiband_file, capsys):
    assert main(["anchor-info", "--json", str(multiband_file)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["widths"] == [16, 16, 32]
    assert info["card"]["kind"] == "multiband3" and info["card"]["nc"] is True
    assert info["card"]["recommended_strength"] == 0.7
    assert info["card"]["content_hash_v2"].startswith("sha256v2:")


def test_anchor_info_refuses_a_lora_and_an_edited_file(tmp_path, capsys):
    lora = tmp_path / "lora.safetensors"
    save_file({"diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 16)}, str(lora))
    assert main(["anchor-info", str(lora)]) == 2
    assert "not an anchor (a LoRA or a checkpoint?)" in capsys.readouterr().err

    anchor = fresh_anchor("multiband3", [16], family="cosmos_dit", rank=2)
    pt = tmp_path / "edited.pt"
    save(anchor, pt)
    blob = torch.load(pt, weights_only=True)
    blob["adapters"]["0.gates"] = blob["adapters"]["0.gates"] + 1  # tampered after writing
    torch.save(blob, pt)
    assert main(["anchor-info", str(pt)]) == 2
    assert "content hash mismatch" in capsys.readouterr().err


def test_anchor_convert_pt_to_safetensors_and_refuses_to_overwrite(tmp_path, capsys):
    src = carded(fresh_anchor("relay", [16, 24], family="cosmos_dit", objective="flow", **SMALL))
    g = torch.Generator().manual_seed(0)
    src.adapters["1.consume.3.weight"] = torch.randn(24, 6, generator=g)  # not all-zero: a real conversion
    pt, out = tmp_path / "relay.pt", tmp_path / "relay.safetensors"
    chash = save(src, pt)

    assert main(["anchor-convert", str(pt), str(out)]) == 0
    assert f"wrote {out} (relay, 2 sites, {chash})" in capsys.readouterr().out
    with open(out, "rb") as f:
        assert f.read(9)[8:9] == b"{"  # a safetensors container
    with safe_open(str(out), "pt") as f:
        md = f.metadata()
        assert md["format"] == "amoe.diffusion.anchor" and md["adapter_kind"] == "relay"
        assert md["content_hash_v2"] == chash and "blocks.1.consume.3.weight" in set(f.keys())
    back = load(out)
    assert content_hash_v2(back.adapters) == chash and back.widths == [16, 24]
    assert all(torch.equal(back.adapters[k], src.adapters[k]) for k in src.adapters)
    assert back.card()["display_name"] == "CLI Test Anchor" and back.card()["nc"] is True

    before = out.read_bytes()
    assert main(["anchor-convert", str(pt), str(out)]) == 2  # bad input (README's exit table), not a bug
    assert "already exists; give a new output name" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["relay.pt", "relay.safetensors"]  # no temp file left


def test_anchor_convert_legacy_stack_and_wrong_output_name(tmp_path, capsys):
    stack = fresh_anchor("multiband3", [16, 16], rank=2)
    legacy = tmp_path / "old.pt"
    torch.save({"mods": [stack.per_site(0), stack.per_site(1)]}, legacy)
    out = tmp_path / "old.safetensors"
    assert main(["anchor-convert", str(legacy), str(out)]) == 0
    back = load(out)
    assert back.kind == "multiband3" and back.card()["imported_from"] == "legacy_mods"

    assert main(["anchor-convert", str(legacy), str(tmp_path / "x.pt")]) == 2
    assert "must end in .safetensors" in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()
