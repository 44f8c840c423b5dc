"""The README's main job: `anima-train demo` end to end on the embedded default."""

from __future__ import annotations

from safetensors import safe_open

from anima_train.cli import main


def test_demo_writes_lora_config_and_plot(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--steps", "12", "--cpu"]) == 0
    text = capsys.readouterr().out
    run = out / "output" / "demo"
    lora, toml, plot = run / "demo.safetensors", run / "demo.toml", run / "loss.png"
    assert lora.is_file() and toml.is_file() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with safe_open(str(lora), "pt") as f:
        keys = list(f.keys())
        assert f.metadata()["ss_network_dim"] == "8"
    assert keys and all(k.startswith("diffusion_model.blocks.") for k in keys)
    assert "% lower)" in text and str(lora) in text
    assert toml.read_text() == (out / "demo.toml").read_text()  # the run's copy is the verbatim config


def test_demo_refuses_a_non_empty_folder(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["demo", "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
