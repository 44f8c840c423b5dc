"""The Training config node's common path is short in the real frontend; the rest is one toggle away.

The node has ~35 knobs. Those a first LoRA needs are plain widgets; the others are declared `advanced` (nodes_train
KNOBS). ComfyUI's frontend (1.47) hides advanced inputs in Nodes 2.0 and the properties panel, and its LiteGraph
canvas has a "Show Advanced" node-menu toggle, which js/anima_train.js makes work for this pack's nodes.
tests/browser/advanced.cjs drives headless Chromium; the assertions are here:

  * a new Training config node draws only the common knobs and the TOML box, and is correspondingly short;
  * the node menu's "Show Advanced" (right-click, as a user does) draws every knob, values unchanged;
  * the example workflow loads short too, and the queued prompt carries the advanced values whether shown or not;
  * the toggle is saved with the workflow and comes back on load;
  * a workflow saved before the widgets added last (after extra_toml) loads with each value on its own widget.

Set ANIMA_CONFIG_SCREENSHOT=docs/config_node.png to (re)write the README image of the new node.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import comfy_browser

pytestmark = [pytest.mark.comfyui, pytest.mark.slow]

ROOT = comfy_browser.ROOT
DRIVER = comfy_browser.BROWSER_DIR / "advanced.cjs"
NODE = "AnimaTrainConfig"
WORKFLOW = "Train a LoRA on your images, then sample with it"
EXTRA_TOML = "extra_toml"


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    tools = comfy_browser.browser_tools()
    base = comfy_browser.base_folder(tmp_path_factory.mktemp("comfy_base"))
    with comfy_browser.serve(base, NODE) as (url, info):
        yield {"url": url, "base": base, "info": info, **tools}


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def _drawn(node: dict) -> list[str]:
    return [w["name"] for w in node["widgets"] if w["drawn"]]


def test_training_config_shows_common_knobs_and_hides_the_rest_behind_the_toggle(comfy, tmp_path):
    # the backend schema the frontend builds the node from: input order and the `advanced` flags (nodes_train KNOBS)
    spec = comfy["info"]
    inputs = spec["input"]["required"]
    common = [n for n in spec["input_order"]["required"] if not inputs[n][1].get("advanced")]
    advanced = [n for n in spec["input_order"]["required"] if inputs[n][1].get("advanced")]
    assert common[-1] == EXTRA_TOML and len(advanced) >= 15
    order = spec["input_order"]["required"]
    late = order[order.index(EXTRA_TOML) + 1:]  # widgets added after workflows were saved (nodes_train.LATE_KNOBS)
    assert late == ["swap_blocks", "base_matmul", "cache_text_encoder_outputs"], late
    file_node = next(n for n in json.loads((ROOT / "example_workflows" / f"{WORKFLOW}.json").read_text())["nodes"]
                     if n["type"] == NODE)
    screenshot = os.environ.get("ANIMA_CONFIG_SCREENSHOT")
    shot = tmp_path / "config_node.png"
    cfg = {"url": comfy["url"] + "/", "chromium": comfy["chromium"], "userDataDir": str(tmp_path / "chrome"),
           "outDir": str(tmp_path), "module": comfy_browser.PACK_NAME, "workflow": WORKFLOW, "node": NODE,
           "screenshot": str(shot), "deviceScaleFactor": 2 if screenshot else 1, "late": len(late)}
    run = subprocess.run([comfy["node"], str(DRIVER), json.dumps(cfg)], cwd=comfy_browser.BROWSER_DIR,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"browser driver failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["pageErrors"] == [], r["pageErrors"]

    # 1. a new node: the dozen-odd knobs of a first LoRA and the TOML box, nothing else; as short as that
    fresh = r["fresh"]
    assert _drawn(fresh) == common, f"a new node draws {_drawn(fresh)}"
    assert len(common) <= 15 and len(fresh["widgets"]) == len(common) + len(advanced)
    assert "Show Advanced" in fresh["menu"], fresh["menu"]
    assert r.get("error") is None, r["error"]  # the rest needs the menu item
    shown = r["freshShown"]
    assert shown["showAdvanced"] and _drawn(shown) == [w["name"] for w in fresh["widgets"]]
    assert [w["value"] for w in shown["widgets"]] == [w["value"] for w in fresh["widgets"]]
    assert fresh["height"] < 0.55 * shown["height"], (fresh["height"], shown["height"])

    # 2. the example workflow: loads short, every value as in the file, advanced ones included
    loaded = r["workflow"]
    assert not loaded["showAdvanced"] and _drawn(loaded) == common
    assert loaded["height"] <= fresh["height"] + 20, "the workflow's node keeps space for hidden widgets"
    values = {w["name"]: w["value"] for w in loaded["widgets"]}
    file_values = dict(zip([w["name"] for w in loaded["widgets"]], file_node["widgets_values"]))
    assert all(_same(values[k], file_values[k]) for k in file_values), (values, file_values)
    # hidden is not dropped: the prompt carries every advanced value, and showing them changes nothing in it
    prompt = r["workflowPrompt"]
    assert all(_same(prompt[k], file_values[k]) for k in advanced), \
        {k: (prompt.get(k), file_values[k]) for k in advanced}
    assert r["workflowShownPrompt"] == prompt
    assert _drawn(r["workflowShown"]) == list(values)

    # 3. the toggle is part of the saved workflow
    reloaded = r["reloaded"]
    assert reloaded["savedShowAdvanced"] is True and reloaded["showAdvanced"] and reloaded["drawn"] == len(values)
    assert all(_same(a, b) for a, b in zip(reloaded["values"], file_node["widgets_values"]))

    # 4. a workflow saved before the late widgets existed: every older widget keeps the value it saved (extra_toml
    #    included: values are stored by position), the late ones take their defaults, and the prompt carries both
    older = r["older"]
    names = [w["name"] for w in older["widgets"]]
    held = {w["name"]: w["value"] for w in older["widgets"]}
    assert len(older["fileValues"]) == len(names) - len(late) and names[-len(late):] == late
    assert all(_same(held[n], v) for n, v in zip(names, older["fileValues"])), (held, older["fileValues"])
    defaults = {n: inputs[n][1]["default"] for n in late}
    assert {n: held[n] for n in late} == defaults == {n: older["prompt"][n] for n in late}
    assert older["prompt"][EXTRA_TOML] == older["fileValues"][names.index(EXTRA_TOML)]

    assert shot.stat().st_size > 10_000
    if screenshot:
        target = Path(screenshot) if Path(screenshot).is_absolute() else ROOT / screenshot
        tmp = target.with_suffix(".tmp.png")
        shutil.copyfile(shot, tmp)
        os.replace(tmp, target)
