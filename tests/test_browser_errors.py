"""A bad Training config is one problem with one message in the real frontend, not one per widget.

ComfyUI files a message that `validate_inputs` returns once for every input the method receives; the Training config
receives all of its ~36 widgets, so one bad key showed as "37 errors found" and 36 identical entries in the Errors
panel ("Anima: Training config - adapter", "- alpha", …), each hiding the text behind an (i), and the console printed
it 36 times. tests/browser/config_error.cjs builds the graph a user starts with (Training config -> Train) in
headless Chromium, types a bad value into a widget, presses Run with the button's own code and reports the page; the
assertions are here: the overlay counts one error and shows the message with its key, the bad value and the fix; the
Errors panel lists one entry; the queue's answer holds one error for the node; the server's console prints it once.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests import comfy_browser

pytestmark = [pytest.mark.comfyui, pytest.mark.slow]

DRIVER = comfy_browser.BROWSER_DIR / "config_error.cjs"


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    tools = comfy_browser.browser_tools()
    base = comfy_browser.base_folder(tmp_path_factory.mktemp("comfy_base"))
    with comfy_browser.serve(base, "AnimaTrainConfig") as (url, _):
        yield {"url": url, "base": base, **tools}


CASES = {
    # a rule of the config (extra_toml, as a user types it: fixed there), and a path the nodes may not use (a widget);
    # each named as the user sets it (nodes/fixes.py), not as a TOML file spells it
    "lr": ({"extra_toml": "[optimizer]\nlr = 0\n"}, "extra_toml [optimizer] lr = 0.0: must be > 0.0"),
    "path": ({"dataset_path": "/nope/elsewhere"}, "dataset_path = '/nope/elsewhere' is outside the folders"),
    # numbers typed into widgets beyond their key's range: the frontend clamps a typed number to the widget's min/max
    # without a word, so with the key's range as the widget's limits a negative LR became 0 and a tag dropout of 1.5
    # trained as 1.0. The value typed must reach the gate and be refused by name.
    "typed_lr": ({"typed": {"learning_rate": -0.0001}}, "learning_rate = -0.0001: must be > 0.0"),
    "typed_dropout": ({"typed": {"tag_dropout": 1.5}}, "tag_dropout = 1.5: must be <= 1.0"),
    # two problems at once (a value and a dataset folder that is not there): one error, its first line whole in the
    # popup, both problems in its text
    "two": ({"dataset_path": "my_datset", "typed": {"learning_rate": -0.0001}},
            "learning_rate = -0.0001: must be > 0.0"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_config_error_is_reported_once_on_the_node(comfy, case, tmp_path):
    substitute, needle = dict(CASES[case][0]), CASES[case][1]
    log = comfy["base"] / "server.log"
    logged_before = log.read_text().count(needle)
    typed = substitute.pop("typed", {})
    cfg = {"url": comfy["url"], "chromium": comfy["chromium"], "userDataDir": str(tmp_path / "profile"),
           "outDir": str(tmp_path), "substitute": substitute, "typed": typed}
    run = subprocess.run([comfy["node"], str(DRIVER), json.dumps(cfg)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads((tmp_path / "result.json").read_text())
    assert seen["typed"] == typed, seen["typed"]  # the widget kept the number typed

    assert sorted(seen["run"]["graph"]) == ["AnimaTrainConfig", "AnimaTrainTrain"], seen["run"]["graph"]
    queued = json.dumps(seen["run"]["queued"])[-1500:]  # the server's answer, named in every message below
    # the overlay a user sees after Run: one error, its text shown (not hidden behind an (i))
    assert "1 error found" in seen["overlay"] or "couldn't validate" in seen["overlay"], \
        (seen["overlay"][-1500:], queued)
    assert "errors found" not in seen["overlay"], (seen["overlay"][-1500:], queued)
    assert seen["overlay"].count(needle) == 1, seen["overlay"][-1500:]
    # the Errors panel ("View details"): one node, one error
    assert "1 node — 1 error" in seen["afterDetails"], seen["afterDetails"][-2000:]
    assert "Training config - adapter" not in seen["afterDetails"]
    assert [n["type"] for n in seen["nodeErrors"]] == ["AnimaTrainConfig"]
    # the queue's answer: the node has exactly one error, and it carries the message
    response = seen["run"]["queued"][0]["response"]
    (errors,) = [e["errors"] for e in response["node_errors"].values()]
    assert len(errors) == 1 and needle in errors[0]["details"], errors
    first = errors[0]["details"].splitlines()[0]  # each problem's first line: within 120 characters, whole in the popup
    assert len(first) <= 120 and first in seen["overlay"], (first, seen["overlay"][-1500:])
    if case == "two":
        details = errors[0]["details"]
        assert "my_datset" in details and details.count("dataset folder not found") == 1, details
    assert "<config text>" not in errors[0]["details"]
    # ComfyUI's console: printed once
    assert log.read_text().count(needle) - logged_before == 1, log.read_text()[-3000:]


def test_a_data_verdict_of_the_train_node_leads_its_error(tiny_anima, tmp_path_factory, tmp_path):
    """A refusal of the Train node's worker (images without captions: the trainer's data verdict, after the config
    passed) as the frontend shows it: the verdict and its fix on the message's first line, in widgets (not "training
    X did not start" with the fix below it), and no python path for the exception (it was nodes.worker.WorkerError)."""
    from anima_train.model.tiny import make_synthetic_dataset

    tools = comfy_browser.browser_tools()
    base = comfy_browser.base_folder(tmp_path_factory.mktemp("comfy_base"))
    dataset = base / "input" / "uncaptioned"
    make_synthetic_dataset(dataset, n=3, sizes=[(64, 64)])
    for caption in dataset.glob("*.txt"):
        caption.unlink()
    substitute = {"model_path": str(tiny_anima.diffusers_dir), "dataset_path": str(dataset), "resolution": 64,
                  "source": "encode", "run_name": "cat", "num_workers": 0}
    allowed = {"ANIMA_TRAIN_ALLOWED_DIRS": str(tiny_anima.diffusers_dir)}
    with comfy_browser.serve(base, "AnimaTrainTrain", env=allowed) as (url, _):
        cfg = {"url": url, "chromium": tools["chromium"], "userDataDir": str(tmp_path / "profile"),
               "outDir": str(tmp_path), "substitute": substitute, "typed": {}, "waitFor": "execution_error",
               "waitMs": 240000}
        run = subprocess.run([tools["node"], str(DRIVER), json.dumps(cfg)], capture_output=True, text=True,
                             timeout=400)
    server_log = (base / "server.log").read_text()[-3000:]
    assert run.returncode == 0, (run.stderr[-3000:], server_log)
    seen = json.loads((tmp_path / "result.json").read_text())
    errors = [e["detail"] for e in seen["events"] if e["type"] == "execution_error"]
    assert len(errors) == 1, (seen["events"], seen["run"]["queued"], server_log)
    (error,) = errors
    assert error["node_type"] == "AnimaTrainTrain", error
    assert error["exception_type"] == "Anima trainer", error  # ComfyUI's name for the class: words
    first = error["exception_message"].splitlines()[0]
    assert first.startswith("3 image(s) have no caption file in dataset_path (Anima: Training config): write a "
                            "<stem>.txt"), error["exception_message"]
    assert len(first) <= 120, first
    assert "\ntraining cat did not start\n" in error["exception_message"], error["exception_message"]
    # what the page shows: the verdict, no class or command. The Errors panel's "ComfyUI Error Report" ends in
    # ComfyUI's stack trace of every failed node (its own frames, then the pack's): for a bug report, not read here.
    details, _, _ = seen["afterDetails"].partition("## Stack Trace")
    assert "Exception Type:** Anima trainer" in details or "Exception Type: Anima trainer" in details, details[-2000:]
    for text in (seen["overlay"], details):
        assert "have no caption file in dataset_path" in text, text[-2000:]
        for shell in ("WorkerError", "nodes.worker", "anima-train", "--allow"):
            assert shell not in text, (shell, text[-2000:])
