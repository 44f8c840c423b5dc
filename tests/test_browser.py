"""The Train node's live loss chart in a real browser: headless ComfyUI on CPU + the system Chromium.

ComfyUI runs from COMFYUI_PATH with `--base-directory` pointing at a temp folder whose custom_nodes/ holds a
symlink to this pack, so the checkout is never written to. tests/browser/train_chart.cjs (playwright-core driving
/usr/bin/chromium; nothing downloads a browser) adds an "Anima: Train" node, replays a synthetic run as
`anima_train.progress` events through the frontend's api object, and reports pixels and status text; the
assertions are here. Both node renderers are covered: the LiteGraph canvas (default) and "Nodes 2.0" (Vue).

Set ANIMA_TRAIN_SCREENSHOT=docs/train_node.png to (re)write the README screenshot from the LiteGraph run (2x).
Setup once: `apt-get install chromium` and `npm install --prefix tests/browser` (playwright-core, pinned).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from anima_train.outputs.progress import format_duration
from tests import comfy_browser

pytestmark = [pytest.mark.comfyui, pytest.mark.slow]

ROOT = comfy_browser.ROOT
BROWSER_DIR = comfy_browser.BROWSER_DIR
DRIVER = BROWSER_DIR / "train_chart.cjs"
TRAIN_NODE = "AnimaTrainTrain"
# Test-only route, installed in the temp custom_nodes (never in the pack): relays a posted event exactly as the Train
# node does, PromptServer.send_sync("anima_train.progress", ...), so the real websocket path is exercised too.
RELAY = """
from aiohttp import web
from server import PromptServer

@PromptServer.instance.routes.post("/anima_train_test/relay")
async def relay(request):
    for event in await request.json():
        PromptServer.instance.send_sync("anima_train.progress", event)  # sid None: to every client
    return web.json_response({"sent": True})

NODE_CLASS_MAPPINGS = {}
"""


@pytest.fixture(scope="module")
def browser_tools():
    return comfy_browser.browser_tools()


@pytest.fixture(scope="module")
def comfy_server(browser_tools, tmp_path_factory):
    base = comfy_browser.base_folder(tmp_path_factory.mktemp("comfy_base"))
    relay = base / "custom_nodes" / "zz_anima_train_test_relay"
    relay.mkdir()
    (relay / "__init__.py").write_text(RELAY)
    settings = base / comfy_browser.SETTINGS
    with comfy_browser.serve(base, TRAIN_NODE) as (url, info):
        yield {"url": url, "base": base, "settings": settings, "info": info, **browser_tools}


@pytest.fixture(scope="module")
def preview_events(tiny_anima, tmp_path_factory):
    """Two `samples` events as the Train node relays them: previews rendered by the trainer's sampler on the tiny
    model (step 0 = the base model, then with a LoRA), written as the trainer writes them, thumbnails inline."""
    import torch
    from peft import LoraConfig

    from anima_train.training import previews as sampling
    from anima_train.model.components import load_components
    from nodes.previews import with_thumbnails

    parts = load_components(tiny_anima.diffusers_dir, dtype="float32")
    prompts = ["red circle, white background", "blue square, black background", "yellow triangle, gray background"]
    out = tmp_path_factory.mktemp("samples")
    events = []
    for step in (0, 120):
        if step:
            torch.manual_seed(0)
            parts.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4.0, target_modules=["to_q", "to_v"],
                                                     init_lora_weights=False))
        images = sampling.render(prompts, "", width=128, height=128, steps=6, cfg_scale=4.0, seed=3, shift=3.0,
                                 transformer=parts.transformer, conditioner=parts.text_conditioner,
                                 text_encoder=parts.text_encoder, tokenizer=parts.tokenizer,
                                 t5_tokenizer=parts.t5_tokenizer, vae=parts.vae, device="cpu", dtype=torch.float32)
        paths = []
        for i, image in enumerate(images):
            paths.append(sampling.sample_path(out, step, i))
            sampling.to_pil(image).save(paths[-1])
        events.append(with_thumbnails({"event": "samples", "step": step, "paths": [str(p) for p in paths],
                                       "prompts": prompts, "seconds": 0.5}))
    return events


@pytest.mark.parametrize("renderer, dpr", [("litegraph", 2), ("vue", 1)])
def test_train_node_loss_chart(comfy_server, renderer, dpr, tmp_path, preview_events):
    # a fresh user: no first-run templates dialog over the canvas; the renderer is a user setting
    comfy_server["settings"].write_text(json.dumps(
        {"Comfy.TutorialCompleted": True, "Comfy.VueNodes.Enabled": renderer == "vue"}))
    screenshot = os.environ.get("ANIMA_TRAIN_SCREENSHOT") if renderer == "litegraph" else None
    shot_path = tmp_path / "train_node.png"
    cfg = {"url": comfy_server["url"] + "/", "chromium": comfy_server["chromium"],
           "userDataDir": str(tmp_path / "chrome"), "outDir": str(tmp_path), "screenshot": str(shot_path),
           "relay": "/anima_train_test/relay", "deviceScaleFactor": dpr, "samples": preview_events}
    t0 = time.perf_counter()
    run = subprocess.run([comfy_server["node"], str(DRIVER), json.dumps(cfg)], cwd=BROWSER_DIR, capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, f"browser driver failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    r = json.loads((tmp_path / "result.json").read_text())
    print(f"\n[{renderer}] browser session {time.perf_counter() - t0:.1f}s; mid-run chart {r['midRun']}")

    # the pack's scripts were served and both of its extensions registered side by side
    assert {"/extensions/comfyui-anima-train/anima_train.js", "/extensions/comfyui-anima-train/loss_chart.js",
            "/extensions/comfyui-anima-train/anchor_card.js"} <= set(r["extensionUrls"])
    assert {"anima_train.ui", "anima_train.anchor_card"} <= set(r["extensionNames"])
    assert r["pageErrors"] == [], r["pageErrors"]
    ours = [line for line in r["console"] if "anima_train" in line]
    assert ours == [], ours

    # the chart is display only: not a value in the saved workflow, not an input of the queued prompt
    saved = r["saved"]
    assert saved["widgets"][-1] == "anima_loss_chart", saved
    assert len(saved["widgetsValues"]) == len(saved["widgets"]) - 1, saved
    assert "anima_loss_chart" not in saved["promptInputs"] and saved["promptInputs"], saved
    empty = r["empty"]
    assert empty["visible"] and empty["cssWidth"] > 200 and empty["cssHeight"] > 80, empty
    assert (empty["width"], empty["height"]) == (round(empty["cssWidth"] * dpr), round(empty["cssHeight"] * dpr)), \
        "canvas backing store not sized to its box x devicePixelRatio (ResizeObserver path)"
    assert empty["phase"] == "idle" and "no run yet" in empty["status"] and empty["orange"] == 0

    # events for a node id that is not on the canvas change nothing and raise nothing
    foreign = r["foreign"]
    assert (foreign["phase"], foreign["status"], foreign["differs"]) == ("idle", empty["status"], empty["differs"])

    # the first events came through the server's websocket (send_sync, as the Train node relays them)
    assert r["preparing"]["phase"] == "preparing" and "loading model" in r["preparing"]["status"]
    relayed = r["relayed"]
    assert "training step 60 of 300" in relayed["status"] and relayed["orange"] > 50 and relayed["blue"] > 50, relayed

    mid, last = r["midRun"], r["lastStep"]
    assert mid["phase"] == "running" and mid["step"] == str(last["step"])
    assert (mid["cssWidth"], mid["cssHeight"]) == (empty["cssWidth"], empty["cssHeight"]), "the chart box changed size"
    # drawn: raw loss (blue), its EMA (orange, 2 px), and the mse / hf parts (green / magenta)
    assert mid["differs"] > 10 * empty["differs"], mid
    assert mid["orange"] > 150 and mid["blue"] > 150 and mid["green"] > 150 and mid["magenta"] > 50, mid
    assert mid["yellow"] > 100, mid  # [validation]: the held-out loss, a second line with a dot per evaluation
    status = mid["status"]
    for part in (f"training step {last['step']} of {last['total']}", f"epoch {last['epoch']}/8",
                 f"loss {last['loss']:.4f}", f"mse {last['terms']['mse']:.4f} + hf {last['terms']['hf']:.4f}", "EMA ",
                 "LR 1.00e-4/5.00e-5", f"{last['s_per_step']:.2f} s/it", f"ETA {format_duration(last['eta_s'])}",
                 "peak VRAM 11.6/11.4 GB", "saved step 100: /runs/x/anima-step00100.safetensors"):
        assert part in status, f"{part!r} not in status {status!r}"

    # the latest preview set, under the chart: every thumbnail loaded, the prompt as its tooltip; the chart stays
    previews = r["previews"]
    assert previews["step"] == "120" and len(previews["titles"]) == 3, previews
    assert previews["titles"][1] == "step 120: blue square, black background", previews
    assert previews["natural"] == [[128, 128]] * 3, previews
    assert all(90 <= h <= 130 and w == h for w, h in previews["shown"]), previews
    assert previews["canvasHeight"] > 80 and r["withPreviews"]["orange"] > 150, (previews, r["withPreviews"])

    done = r["done"]
    assert done["phase"] == "done" and "done: 300/300 steps in 9m12s → /runs/x/anima.safetensors" in done["status"]
    assert done["orange"] == r["withPreviews"]["orange"]  # the finished chart stays up (previews under it)

    reset = r["reset"]  # a new "start" clears the chart
    assert (reset["phase"] == "running" and reset["orange"] == 0 and reset["blue"] == 0
            and "step " not in reset["status"])

    no_hf = r["noHf"]  # hf null: loss + EMA only
    assert no_hf["orange"] > 150 and no_hf["blue"] > 100 and no_hf["green"] == 0 and no_hf["magenta"] == 0, no_hf
    assert no_hf["yellow"] == 0  # no [validation]: no second line
    assert "training step 30 of 50" in no_hf["status"] and "(mse" not in no_hf["status"]

    new_term = r["newTerm"]  # a term named only by the step events: its own line and its name (issue 44)
    assert new_term["green"] > 150 and new_term["magenta"] > 50, new_term
    assert "(mse " in new_term["status"] and " + edge " in new_term["status"], new_term

    error = r["error"]
    assert error["phase"] == "error" and "error: RuntimeError: CUDA out of memory" in error["status"]

    reused = r["reused"]  # the node re-used a finished run: no curve, just the result
    assert reused["phase"] == "done" and reused["orange"] == 0 and reused["blue"] == 0
    assert "re-used the finished run: 50/50 steps → /runs/y/anima.safetensors" in reused["status"], reused

    sub = r["subgraph"]  # a Train node inside a subgraph, addressed by its execution id path
    assert sub["promptIds"] == [f"{sub['outerId']}:{sub['innerId']}"], sub
    assert sub["step"] == "3" and "training step 3 of 10" in sub["status"], sub

    assert shot_path.stat().st_size > 10_000
    if screenshot:
        target = Path(screenshot) if Path(screenshot).is_absolute() else ROOT / screenshot
        tmp = target.with_suffix(".tmp.png")
        shutil.copyfile(shot_path, tmp)
        os.replace(tmp, target)
