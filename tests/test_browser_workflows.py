"""Every example workflow, loaded in the real ComfyUI frontend as a user loads it, shows what the file intends and runs.

tests/browser/workflows.cjs (playwright-core driving the system Chromium) loads each `example_workflows/*.json` the
way the Templates menu does, reports every widget as the UI holds it and the workflow the UI would save, then sets
the few widgets that make it run here (tiny models, a synthetic dataset, 64 px, 4 sampling steps) and queues it with
the Queue button's own code. The assertions are here:

  * intent: each node's widgets, read back from the UI, are the file's `widgets_values` mapped onto the node's
    backend schema (/object_info: input order, and a "control after generate" value only where the schema asks for
    one) — names in order and values; so a widget the frontend adds on its own shifts everything after it and fails;
  * the workflow the UI would save is the file (loading and saving changes nothing);
  * the queued prompt carries the substitutions, and ends in execution_success with the images saved.

Models: the file names the workflows use are served by the temp base's models folders with tiny ComfyUI-detectable
files (anima_train.model.tiny size "comfy"), except the CLIPLoader's text encoder: ComfyUI hard-codes Qwen3-0.6B, so
that one is a random full-size file (fixtures_tiny.comfy_text_encoder). The Convert node gets the
tiny Qwen3 and tokenizers.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests import comfy_browser

pytestmark = [pytest.mark.comfyui, pytest.mark.slow]

ROOT = comfy_browser.ROOT
DRIVER = comfy_browser.BROWSER_DIR / "workflows.cjs"
WORKFLOWS = sorted(p.stem for p in (ROOT / "example_workflows").glob("*.json"))
LORA_TEMPLATE = "Train a LoRA on your images, then sample with it"  # the screenshot of README's first run
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
CONTROL_WIDGET = "control_after_generate"  # the name the frontend gives the "control after generate" widget
RUN_TIMEOUT_S = 900  # one workflow: convert + train + two samples on a loaded 2-core machine


def _anchor_file(path: Path) -> Path:
    from anchor.format import save
    from anchor.modules import fresh_anchor

    width, blocks = 256, 10  # the tiny ComfyUI-detectable Anima (anima_train.model.tiny "comfy")
    save(fresh_anchor("multiband3", [width] * blocks, family="cosmos_dit", objective="flow", rank=4), path)
    return path


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    from anima_train.model.tiny import make_synthetic_dataset
    from tests import fixtures_tiny

    tools = comfy_browser.browser_tools()
    t0 = time.perf_counter()
    tiny = fixtures_tiny.tiny_anima(tmp_path_factory, size="comfy")
    qwen3_full = fixtures_tiny.comfy_text_encoder(tmp_path_factory)
    base = comfy_browser.base_folder(tmp_path_factory.mktemp("comfy_base"))
    anchors = base / "models" / "anchors"
    anchors.mkdir(parents=True)
    _anchor_file(anchors / "your_anchor.safetensors")
    # the names the example workflows ask for, served by tiny files
    for folder, name, src in [("diffusion_models", "anima-base-v1.0.safetensors", tiny.anima_file),
                              ("vae", "qwen_image_vae.safetensors", tiny.vae_file),
                              ("text_encoders", "qwen_3_06b_base.safetensors", qwen3_full),
                              ("text_encoders", "qwen3_tiny.safetensors", tiny.qwen3_file)]:
        (base / "models" / folder).mkdir(parents=True, exist_ok=True)
        (base / "models" / folder / name).symlink_to(src)
    dataset = base / "input" / "dataset"  # the nodes read datasets from ComfyUI's folders (nodes/paths.py)
    make_synthetic_dataset(dataset, n=4, sizes=[(64, 64)])
    t_models = time.perf_counter() - t0
    # the tiny tokenizers live outside ComfyUI's folders: listed as a user would (README, "Folders the nodes use")
    allowed = {"ANIMA_TRAIN_ALLOWED_DIRS": str(tiny.diffusers_dir)}
    with comfy_browser.serve(base, "AnimaTrainConfig", env=allowed) as (url, _):
        info = json.loads(comfy_browser.get(f"{url}/object_info", timeout=60))
        substitute = {
            "AnimaTrainConvert": {"qwen": "qwen3_tiny.safetensors", "tokenizers": str(tiny.diffusers_dir)},
            "AnimaTrainConfig": {"dataset_path": str(dataset), "epochs": 2, "max_steps": 4, "resolution": 64,
                                 "rank": 8, "dtype": "float32", "source": "encode", "num_workers": 0,
                                 "gradient_checkpointing": False, "save_every_epochs": 0},
            "EmptyLatentImage": {"width": 64, "height": 64},
            "KSampler": {"steps": 4},
        }
        yield {"url": url, "base": base, "info": info, "substitute": substitute, "models_s": t_models, **tools}


def intended_widgets(node: dict, spec: dict) -> list[tuple[str, object]]:
    """(widget name, value) in the order the frontend builds the widgets from the backend schema, valued from the
    file's positional widgets_values; a "control after generate" value follows only an input that declares one."""
    names = spec["input_order"].get("required", []) + spec["input_order"].get("optional", [])
    every = {**spec["input"].get("required", {}), **spec["input"].get("optional", {})}
    values = list(node.get("widgets_values") or [])
    out = []
    for name in names:
        kind, opts = every[name][0], (every[name][1] if len(every[name]) > 1 else {})
        if not (isinstance(kind, list) or kind in WIDGET_TYPES) or opts.get("forceInput"):
            continue
        assert values, f"node {node['id']} {node['type']}: the file has no value for widget {name!r}"
        out.append((name, values.pop(0)))
        if opts.get("control_after_generate"):
            assert values, f"node {node['id']} {node['type']}: the file has no control value after {name!r}"
            out.append((CONTROL_WIDGET, values.pop(0)))
    assert not values, f"node {node['id']} {node['type']}: {len(values)} widget value(s) beyond its schema: {values}"
    return out


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return (isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool)
                and not isinstance(b, bool) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12))
    return type(a) is type(b) and a == b


def _overlap(a: dict, b: dict) -> bool:
    """Two nodes' boxes (graph coordinates, title bar included) share some area."""
    return (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
            and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])


def _history(url: str, prompt_id: str) -> dict:
    with urllib.request.urlopen(f"{url}/history/{prompt_id}", timeout=30) as r:
        return json.loads(r.read())[prompt_id]


@pytest.mark.parametrize("name", WORKFLOWS)
def test_example_workflow_loads_as_intended_and_runs(comfy, name, tmp_path):
    workflow = json.loads((ROOT / "example_workflows" / f"{name}.json").read_text())
    cfg = {"url": comfy["url"] + "/", "chromium": comfy["chromium"], "userDataDir": str(tmp_path / "chrome"),
           "outDir": str(tmp_path), "module": comfy_browser.PACK_NAME, "name": name,
           "substitute": comfy["substitute"], "timeoutMs": RUN_TIMEOUT_S * 1000,
           # ANIMA_TEMPLATE_THUMBNAILS=1: (re)write example_workflows/<name>.jpg, the Templates browser's picture
           "thumbnail": str(ROOT / "example_workflows" / f"{name}.jpg") if os.environ.get(
               "ANIMA_TEMPLATE_THUMBNAILS") else None,
           # ANIMA_FIRST_RUN_SCREENSHOT=docs/first_run.png: (re)write the README's picture of the finished LoRA run
           "screenshot": os.environ.get("ANIMA_FIRST_RUN_SCREENSHOT") if name == LORA_TEMPLATE else None}
    t0 = time.perf_counter()
    run = subprocess.run([comfy["node"], str(DRIVER), json.dumps(cfg)], cwd=comfy_browser.BROWSER_DIR,
                         capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 180)
    server_log = (comfy["base"] / "server.log").read_text()[-4000:]
    assert run.returncode == 0, f"browser driver failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}\n{server_log}"
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["loaded"]["status"] == 200 and r["loaded"]["nodes"] == len(workflow["nodes"]), r["loaded"]
    assert r["pageErrors"] == [], r["pageErrors"]

    # 1. every widget shows the value the file intends
    shown = {str(n["id"]): n for n in r["shown"]}
    problems = []
    for node in workflow["nodes"]:
        want = intended_widgets(node, comfy["info"][node["type"]])
        got = [(w["name"], w["value"]) for w in shown[str(node["id"])]["widgets"] if w["inWorkflow"]]
        where = f"node {node['id']} {node['type']}"
        if [n for n, _ in got] != [n for n, _ in want]:
            problems.append(f"{where}: the UI has widgets {[n for n, _ in got]}, the schema {[n for n, _ in want]}")
        intended = dict(want)
        for widget, value in got:
            if widget in intended and not _same(value, intended[widget]):
                problems.append(f"{where}: {widget} shows {value!r}, the file intends {intended[widget]!r}")
    assert not problems, "the workflow loads differently from the file:\n" + "\n".join(problems)

    # 2. saving it right away gives the file back
    saved = {str(n["id"]): n["widgets_values"] for n in r["saved"]}
    for node in workflow["nodes"]:
        file_values = node.get("widgets_values") or []
        assert len(saved[str(node["id"])] or []) == len(file_values) and all(
            _same(a, b) for a, b in zip(saved[str(node["id"])] or [], file_values)), \
            f"node {node['id']} {node['type']} saves {saved[node['id']]}, the file has {file_values}"

    # 3. the substitutions reached the queued prompt
    assert not [s for s in r["substituted"] if s.get("missing")], r["substituted"]
    run_info = r["run"]
    assert run_info.get("queued") and "error" not in run_info["queued"][0], \
        f"queueing was refused: {json.dumps(run_info.get('queued'))[:4000]}"
    prompt = run_info["queued"][0]["prompt"]
    for s in r["substituted"]:
        assert _same(prompt[str(s["id"])]["inputs"][s["name"]], s["value"]), (s, prompt[str(s["id"])])

    # 4. it ran to the end
    end = run_info["end"]
    assert end["type"] == "execution_success", f"{json.dumps(end)[:4000]}\n{server_log}"
    history = _history(comfy["url"], run_info["promptId"])
    saved_images = {nid: out["images"] for nid, out in history["outputs"].items() if out.get("images")}
    savers = [str(n["id"]) for n in workflow["nodes"] if n["type"] == "SaveImage"]
    assert savers and all(saved_images.get(nid) for nid in savers), history["outputs"]
    for nid in savers:
        image = saved_images[nid][0]
        assert (comfy["base"] / "output" / image["subfolder"] / image["filename"]).is_file()
    # 5. what a node shows after the run (the anchor's usage card) is whole and covered by no other node
    nodes = r["layout"]
    for node in nodes:
        if node["type"].startswith("Anima"):  # the pack's nodes read as one family in the graph and the menus
            assert node["typeTitle"].startswith("Anima: "), node  # its name in the menus (a title is the user's)
        for widget in node["widgets"]:
            assert widget["scrolls"] is False and widget["cutRight"] is False, (node["type"], widget)
        if node["widgets"]:
            others = [o for o in nodes if o["id"] != node["id"] and _overlap(node, o)]
            assert not others, f"{node['type']} {node['id']} is covered by {[o['type'] for o in others]}: {node}"
    # 6. every text widget of the pack shows its whole label (a long value is cut in the middle instead)
    assert all(label["fits"] for label in r["labels"]), [label for label in r["labels"] if not label["fits"]]
    assert name != LORA_TEMPLATE or "tokenizers" in [label["widget"] for label in r["labels"]], r["labels"]
    print(f"\nMEASURED {name}: browser session {time.perf_counter() - t0:.1f} s, prompt {run_info['seconds']:.1f} s "
          f"(models built in {comfy['models_s']:.1f} s)")


def test_the_first_run_screenshot_names_a_template_that_exists():
    assert LORA_TEMPLATE in WORKFLOWS, WORKFLOWS  # else the screenshot and the tokenizers label go unchecked
