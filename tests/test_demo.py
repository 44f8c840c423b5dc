"""The README's main job: `anima-train demo` end to end on the embedded default."""

from __future__ import annotations

import tomllib

import pytest
from safetensors import safe_open

from anima_train.cli import main
from tests.fixtures_tiny import anima_train_cli


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
    model = out.resolve() / "model" / "diffusers"  # kept for reuse, and said so
    assert f"tiny model (diffusers repo):   {model}" in text and (model / "transformer").is_dir()
    assert f'model_path at "{model}"' in text
    # every phase says what it does before it starts: nothing runs for seconds without a line (the base model's
    # eval loss took 18-34 s on a busy 2-core machine, silently)
    said = [line for line in text.splitlines() if line.startswith("demo: ")]
    assert [line.split(" ")[1] for line in said] == ["loading", "building", "caching", "measuring", "training",
                                                     "measuring"], said
    assert "base model's eval loss" in said[3] and "trained LoRA's eval loss" in said[5]


def test_demo_refuses_a_non_empty_folder(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["demo", "--out", str(tmp_path)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]




@pytest.mark.slow
def test_tiny_model_writes_a_model_path_and_a_config_that_trains_on_your_images(tmp_path):
    from anima_train.model.tiny import make_synthetic_dataset

    out = anima_train_cli("tiny-model", tmp_path / "tiny", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    model = (tmp_path / "tiny" / "diffusers").resolve()
    assert f"a config's model_path): {model}" in out.stdout
    # the printed config, with the user's own folder filled in, trains as printed
    printed = out.stdout[out.stdout.index("[train]"):]
    mine = tmp_path / "my images"
    make_synthetic_dataset(mine, n=3, seed=2, sizes=[(320, 256), (256, 256)])
    cfg = tmp_path / "mine.toml"
    cfg.write_text(printed.replace("/your/images", mine.as_posix()))
    assert anima_train_cli("config", cfg, cwd=tmp_path).returncode == 0
    run = anima_train_cli("train", cfg, "--dry-run", "--cpu", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "done: 1 step(s)" in run.stdout
    # and it trains the steps it says (3 images: one epoch is 3 steps, so epochs alone would stop it early)
    steps = tomllib.loads(printed)["train"]["max_steps"]
    run = anima_train_cli("train", cfg, "--cpu", "--no-save", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"done: {steps} step(s)" in run.stdout and "warning" not in run.stdout + run.stderr, run.stdout[-3000:]
    # it never writes into a folder that holds something
    again = anima_train_cli("tiny-model", tmp_path / "tiny", cwd=tmp_path)
    assert again.returncode == 2 and "not an empty folder" in again.stderr and "Traceback" not in again.stderr
