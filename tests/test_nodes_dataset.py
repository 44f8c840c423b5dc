"""Convert / Audit / Cache nodes without ComfyUI; ComfyUI's helpers (model folders, progress bar, interrupts) are
recorders. Fast tests run a fake CLI script (args, tqdm progress parsing, errors, re-use); the slow ones run the
real `anima-train` subcommands as workers on the tiny model and a 4-image dataset."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

FAKE_CLI = textwrap.dedent(r'''
    import json, os, sys, time
    args = sys.argv[1:]
    json.dump(args, open(os.environ["FAKE_ARGS"], "w"))
    if args[0] == "cache":
        print("images   3 in 1 folder(s)", flush=True)
        for i in range(4):  # tqdm on a pipe: carriage-return redraws
            sys.stdout.write(f"\rcaching:  {25 * i}%|##   | {i}/3 [00:00<00:00, 9.1img/s]")
            sys.stdout.flush()
            time.sleep(0.02)
        print("\nwrote    3 cache file(s) in 0.1 s", flush=True)
    elif args[0] == "convert":
        if "--fail" in os.environ.get("FAKE_MODE", ""):
            print("anima-train convert: \u27e6flag convert --vae\u27e7 x.safetensors holds a Qwen3 text encoder, not a VAE", file=sys.stderr)
            sys.exit(2)
        out = args[args.index("--out") + 1]
        for sub, name in [("transformer", "config.json"), ("text_conditioner", "config.json"),
                          ("text_encoder", "config.json"), ("vae", "config.json"),
                          ("scheduler", "scheduler_config.json"), ("tokenizer", "tokenizer.json"),
                          ("t5_tokenizer", "tokenizer.json")]:
            os.makedirs(os.path.join(out, sub), exist_ok=True)
            open(os.path.join(out, sub, name), "w").write("{}")
        print(f"wrote {out}", flush=True)
''')  # noqa: E501 (a line of the script above: wrapping it would change the string)


@pytest.fixture
def env(monkeypatch, tmp_path, tiny_anima):
    from tests import comfy_double

    comfy_double.install(monkeypatch)
    import nodes.comfy as comfy
    import nodes.nodes_dataset as nd

    log = []
    native = {"diffusion_models": tiny_anima.anima_file, "text_encoders": tiny_anima.qwen3_file,
              "vae": tiny_anima.vae_file}

    class Bar:
        def __init__(self, total, node_id=None):
            log.append(("bar", total, node_id))

        def update_absolute(self, value, total=None):
            log.append(("update", value, total))

    def model_path(kind, name):
        if name != Path(native[kind]).name:
            raise FileNotFoundError(f"{name} not in {kind}")
        return str(native[kind])

    comfy_double.install_folders(monkeypatch, comfy, tmp_path, allowed=[tiny_anima.diffusers_dir])
    monkeypatch.setattr(comfy, "model_path", model_path)
    monkeypatch.setattr(comfy, "models_directory", lambda: str(tmp_path / "models"))
    monkeypatch.setattr(comfy, "output_directory", lambda: str(tmp_path / "output"))
    monkeypatch.setattr(comfy, "progress_bar", Bar)
    monkeypatch.setattr(comfy, "free_vram", lambda: log.append(("free_vram",)))
    monkeypatch.setattr(comfy, "throw_if_interrupted", lambda: None)
    return type("Env", (), dict(nd=nd, comfy=comfy, log=log, tmp=tmp_path, names=dict(
        anima=tiny_anima.anima_file.name, qwen=tiny_anima.qwen3_file.name, vae=tiny_anima.vae_file.name)))


@pytest.fixture
def fake_cli(env, monkeypatch, tmp_path):
    """Replace `python -m anima_train ...` by FAKE_CLI; returns a function giving the args it was called with."""
    import json

    script = tmp_path / "fake_cli.py"
    script.write_text(FAKE_CLI)
    monkeypatch.setenv("FAKE_ARGS", str(tmp_path / "args.json"))
    monkeypatch.setattr(env.nd.worker, "anima_train_command", lambda args, processes=1: [sys.executable, "-u",
                                                                                         str(script), *args])
    return lambda: json.loads((tmp_path / "args.json").read_text())


@pytest.fixture
def images(tmp_path):
    from anima_train.model.tiny import make_synthetic_dataset

    folder = tmp_path / "data"
    make_synthetic_dataset(folder, n=4, sizes=[(64, 64)])
    return folder


def test_parse_resolutions_and_dataset_args(env, images):
    nd = env.nd
    assert nd.parse_resolutions("1024") == [1024]
    assert nd.parse_resolutions(" 1024, 768 768") == [768, 1024]
    assert nd.parse_resolutions("") == []
    with pytest.raises(ValueError, match="whole numbers"):
        nd.parse_resolutions("1024px")
    models = env.tmp / "models"
    assert nd.dataset_args(str(images), "64", "m", None) == [str(images), "--resolution", "64", "--model",
                                                            str(models / "m")]  # relative: in the models folder
    with pytest.raises(FileNotFoundError, match="nope"):
        nd.dataset_args(str(images / "nope"), "64", "", None)
    with pytest.raises(ValueError, match="no dataset"):
        nd.dataset_args("", "64", "", None)


def test_cache_node_builds_the_cli_call_and_feeds_the_progress_bar(env, fake_cli, images):
    nd = env.nd
    nd.AnimaTrainCache.hidden = type("H", (), {"unique_id": "7"})()
    try:
        out = nd.AnimaTrainCache.execute(dataset_dir=str(images), resolutions="1024, 768", model_path="repo",
                                         dry_run=False, batch_size=2, allow_missing_captions=True)
    finally:
        del nd.AnimaTrainCache.hidden
    assert fake_cli() == ["cache", str(images), "--resolution", "768", "1024", "--model",
                          str(env.tmp / "models" / "repo"), "--batch-size", "2", "--allow-missing-captions"]
    assert env.log[0] == ("free_vram",)  # before the worker's VAE wants the GPU
    assert ("bar", 3, "7") in env.log and env.log[-1] == ("update", 3, 3)
    assert out.values[0] == "images   3 in 1 folder(s)\nwrote    3 cache file(s) in 0.1 s"  # redraws filtered out
    dry = nd.AnimaTrainCache.execute(dataset_dir=str(images), resolutions="64", dry_run=True)
    assert "--dry-run" in fake_cli() and dry.ui == {"text": [dry.values[0]]}
    assert env.log.count(("free_vram",)) == 1  # a dry run does not touch ComfyUI's models


def test_a_connected_config_is_passed_as_a_file(env, fake_cli, images):
    config = {"toml": f'[dataset]\npath = "{images}"\nresolution = 512\n', "digest": "x"}
    env.nd.AnimaTrainAudit.execute(dataset_dir="", resolutions="", config=config)
    args = fake_cli()
    assert args[:2] == ["audit", "--config"] and not Path(args[2]).exists()  # temp file removed afterwards


def test_cli_errors_reach_the_node(env, fake_cli, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "--fail")
    with pytest.raises(RuntimeError) as exc:
        env.nd.AnimaTrainConvert.execute(**env.names, out_dir=str(env.tmp / "repo"), tokenizers="none")
    msg = str(exc.value)
    assert msg.startswith("vae x.safetensors holds a Qwen3 text encoder"), msg  # the worker's message leads
    assert "\nconversion did not start\n" in msg, msg


def test_convert_runs_once_then_reuses_the_repo(env, fake_cli, tiny_anima, monkeypatch):
    nd = env.nd
    out = nd.AnimaTrainConvert.execute(**env.names, out_dir="", tokenizers="org/repo")
    repo = Path(out.values[0])
    assert repo == env.tmp / "models" / "anima_diffusers" / "anima"
    args = fake_cli()
    assert args[args.index("--anima") + 1] == str(tiny_anima.anima_file)
    assert args[args.index("--vae") + 1] == str(tiny_anima.vae_file) and args[-2:] == ["--tokenizers", "org/repo"]
    spawned = []
    monkeypatch.setattr(nd.worker, "run_job", lambda *a, **k: spawned.append(a))
    again = nd.AnimaTrainConvert.execute(**env.names, out_dir="", tokenizers="org/repo")
    assert again.values[0] == str(repo) and "re-used" in again.ui["text"][0] and not spawned
    with pytest.raises(FileNotFoundError, match="not in diffusion_models"):
        nd.AnimaTrainConvert.execute(anima="missing.safetensors", qwen=env.names["qwen"], vae=env.names["vae"])


@pytest.mark.slow
def test_real_cli_convert_cache_and_audit(env, images, tiny_anima, tmp_path):
    """The real subcommands end to end: convert the native files, audit (NOT SAFE), cache, audit (SAFE)."""
    nd = env.nd
    repo = nd.AnimaTrainConvert.execute(**env.names, out_dir=str(tmp_path / "repo"),
                                        tokenizers=str(tiny_anima.diffusers_dir)).values[0]
    from anima_train.model.components import check_repo

    check_repo(repo)
    report, safe = nd.AnimaTrainAudit.execute(dataset_dir=str(images), resolutions="64", model_path=repo).values
    assert safe is False and "NOT SAFE" in report
    out = nd.AnimaTrainCache.execute(dataset_dir=str(images), resolutions="64", model_path=repo, dry_run=False,
                                     batch_size=2)
    assert len(list(images.glob("*_anima.safetensors"))) == 4 and "wrote    4 cache file(s)" in out.values[0]
    assert ("bar", 4, None) in env.log and env.log[-1] == ("update", 4, 4)
    report, safe = nd.AnimaTrainAudit.execute(dataset_dir=str(images), resolutions="64", model_path=repo).values
    assert safe is True and "verdict  SAFE" in report
