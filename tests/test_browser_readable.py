"""The text a node shows is readable without resizing it, in the real frontend.

ComfyUI lays a DOM widget out at its minimum height, about three lines: the Check node's report showed 2 of its lines
and the Train node's result 3, the rest behind a scroll bar until the user dragged the node larger. js/fit_content.js
grows the node to its text. tests/browser/readable.cjs runs the Check node for real and gives a Train node a result
text the way ComfyUI delivers it; the assertions are here: every line is shown (the box scrolls not at all) and the
box lies inside its node on screen.

Set ANIMA_CHECK_SCREENSHOT=docs/check_node.png to (re)write the README image of the Check node.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests import comfy_browser

pytestmark = [pytest.mark.comfyui, pytest.mark.slow]

DRIVER = comfy_browser.BROWSER_DIR / "readable.cjs"
TRAIN_TEXT = "\n".join([  # the shape of nodes_train._summary for a finished run with a note and a warning
    "run name 'my_lora': output/anima_train/my_lora holds an earlier run or a running job, so this one is 'my_lora-2'",
    "trained my_lora-2: 1200 step(s) in 2710 s",
    "file     output/anima_train/my_lora-2/my_lora-2.safetensors",
    "copy     models/loras/anima_train/my_lora-2.safetensors (listed by the stock loaders)",
    "warning: tier 1024: 3/40 sources (7.5%) are smaller than this tier and repeat a lower tier's bucket",
    "loss     0.4123 → 0.3561 (EMA)",
])


def test_the_check_report_and_the_train_result_are_readable_without_resizing(tmp_path_factory, tmp_path):
    tools = comfy_browser.browser_tools()
    base = comfy_browser.base_folder(tmp_path_factory.mktemp("comfy_base"))
    with comfy_browser.serve(base, "AnimaTrainEnvironmentCheck") as (url, _):
        cfg = {"url": url, "chromium": tools["chromium"], "userDataDir": str(tmp_path / "profile"),
               "outDir": str(tmp_path), "trainText": TRAIN_TEXT,
               "screenshot": os.environ.get("ANIMA_CHECK_SCREENSHOT")}
        run = subprocess.run([tools["node"], str(DRIVER), json.dumps(cfg)], capture_output=True, text=True,
                             timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads((tmp_path / "result.json").read_text())
    assert seen["run"] == "execution_success", seen["run"]
    for name, min_lines in (("check", 10), ("train", len(TRAIN_TEXT.splitlines()))):
        box = seen["boxes"][name]
        assert box is not None and box["lines"] >= min_lines, (name, box)
        assert box["scrollHeight"] <= box["clientHeight"] + 1, (name, box)  # every line shown, no scrolling
        assert box["nodeTop"] <= box["boxTop"] and box["boxBottom"] <= box["nodeBottom"] + 1, (name, box)
