"""Node reports never cover another node, in the real frontend.

A report (the Check node's table, Audit's verdicts, Convert's and Cache's result texts, the Train node's result, the
anchor card) grows its node to show it: the Check node widened from ~218 to ~814 px after it ran and covered
"Anima: Audit dataset" placed beside it. tests/browser/reports.cjs places the six report nodes in two rows, each
beside and above another (20 px apart, the rows 100 px, at their sizes as added), runs Check and Audit for real and
gives the others their report as ComfyUI delivers it. The assertions are here: no two nodes overlap, every report
box lies inside its node, and a report with more text than the room shows scrolls inside its box.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests import comfy_browser

pytestmark = [pytest.mark.comfyui, pytest.mark.slow]

DRIVER = comfy_browser.BROWSER_DIR / "reports.cjs"
LONG_LINE = "tokenizers: copied from /a/folder/with/a/long/path/Anima-Base-v1.0-Diffusers/tokenizer into the repo"
TEXTS = {  # the shapes of the nodes' result texts: many lines, some longer than a node is wide
    "AnimaTrainConvert": "\n".join([LONG_LINE] + [f"transformer block {i}: 12 tensors" for i in range(40)]),
    "AnimaTrainCache": "\n".join(f"tier 1024: img_{i:04d}.png -> 1024x1024 (cached)" for i in range(60)),
    "AnimaTrainTrain": "\n".join([f"warning: {LONG_LINE}"] * 30),
}
CARD = {"display_name": "a test anchor", "kind": "multiband3", "n_sites": 10, "family": "cosmos_dit",
        "objective": "flow", "trunk": "anima", "recommended_strength": 1.0, "usage": "sampling " * 30,
        "caveats": [f"caveat {i}: " + "words " * 12 for i in range(12)], "license": "apache-2.0",
        "content_hash_v2": "f" * 64, "file": "/models/anchors/" + "a" * 80 + ".safetensors"}


def _overlap(a: dict, b: dict) -> bool:
    return (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
            and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])


def test_reports_grow_into_free_space_only(tmp_path_factory, tmp_path):
    from anima_train.model.tiny import make_synthetic_dataset

    tools = comfy_browser.browser_tools()
    base = comfy_browser.base_folder(tmp_path_factory.mktemp("comfy_base"))
    dataset = base / "input" / "dataset"
    make_synthetic_dataset(dataset, n=24, sizes=[(64, 64), (96, 64), (64, 128)])
    with comfy_browser.serve(base, "AnimaTrainEnvironmentCheck") as (url, _):
        cfg = {"url": url + "/", "chromium": tools["chromium"], "userDataDir": str(tmp_path / "chrome"),
               "outDir": str(tmp_path), "datasetDir": str(dataset), "texts": TEXTS, "card": CARD}
        run = subprocess.run([tools["node"], str(DRIVER), json.dumps(cfg)], cwd=comfy_browser.BROWSER_DIR,
                             capture_output=True, text=True, timeout=400)
        server_log = (base / "server.log").read_text()[-3000:]
    assert run.returncode == 0, f"{run.stderr[-3000:]}\n{server_log}"
    seen = json.loads((tmp_path / "result.json").read_text())
    assert seen["run"]["type"] == "execution_success", (seen["run"], server_log)
    assert seen["pageErrors"] == [], seen["pageErrors"]
    nodes = seen["nodes"]
    assert len(nodes) == 6 and all(n["report"] for n in nodes), nodes  # every node shows its report
    check = next(n for n in nodes if n["type"] == "AnimaTrainEnvironmentCheck")
    assert check["report"]["text"] > 300, check  # the Check really ran

    covered = [(a["type"], b["type"]) for i, a in enumerate(nodes) for b in nodes[i + 1:] if _overlap(a, b)]
    assert not covered, (covered, nodes)
    for node in nodes:
        report = node["report"]
        (left, top), (right, bottom) = report["topLeft"], report["bottomRight"]
        inside = node["x"] - 1 <= left and right <= node["x"] + node["w"] + 1 and bottom <= node["y"] + node["h"] + 1
        assert inside and top >= node["y"], node
    # more text than room (Convert: the anchor node below it; Cache: the height cap) scrolls inside its box
    for node in nodes:
        if node["type"] in ("AnimaTrainConvert", "AnimaTrainCache"):
            assert node["report"]["scrollHeight"] > node["report"]["clientHeight"] + 1, node
