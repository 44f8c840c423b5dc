"""A ComfyUI user's first run of the LoRA template, played in the real frontend from the Templates dialog.

tests/browser/first_run.cjs opens Templates -> Anima Trainer -> the LoRA template in headless Chromium, reports the
view it opens at, sets the widgets it is given, presses Run once and reports what the user then sees. Two users:

  * the newcomer sets only what is theirs: the dataset folder, the model file names that differ from the template's
    (here the text encoder the trainer converts: the tiny Qwen3), the tokenizers folder (offline), plus a smaller
    resolution and step counts so that a CPU finishes. The run succeeds at the first press: the LoRA file is written,
    both sample images are saved, and no node shows a shell command, a flag, a python path or an exception class.
  * the template queued as shipped: one error (the dataset folder, saying which widget to set) and nothing of the
    training branch runs: no conversion (the Convert node would download tokenizers and write the full model), no
    training; the base-model sample needs none of it and may run.

Both also check the view the template opens at: the canvas draws titles and widgets (no low-detail mode) and every
node is whole on the screen, and every node of the pack is named "Anima: ...".

Models: ComfyUI's loaders get the tiny ComfyUI-detectable Anima and VAE (anima_train.model.tiny size "comfy") under the
template's file names, and a random full-size Qwen3 under its text encoder's name (ComfyUI's CLIPLoader hard-codes
Qwen3-0.6B); the Convert node, which builds the trainer's model, gets the tiny Qwen3 and the tiny tokenizers.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from nodes.templates import DISPLAY_NAME
from tests import comfy_browser

pytestmark = [pytest.mark.comfyui, pytest.mark.slow]

ROOT = comfy_browser.ROOT
DRIVER = comfy_browser.BROWSER_DIR / "first_run.cjs"
RUN_TIMEOUT_S = 900  # convert + train + two samples on a loaded 2-core machine


def _train_template() -> tuple[str, dict]:
    """The example workflow that trains (the one holding the Train node): (its name, its JSON)."""
    for path in sorted((ROOT / "example_workflows").glob("*.json")):
        workflow = json.loads(path.read_text(encoding="utf-8"))
        if any(n["type"] == "AnimaTrainTrain" for n in workflow["nodes"]):
            return path.stem, workflow
    raise AssertionError("no example workflow holds an AnimaTrainTrain node")


def _widget_default(workflow: dict, node_type: str, index: int):
    return next(n for n in workflow["nodes"] if n["type"] == node_type)["widgets_values"][index]


# what a node's text must never ask of a ComfyUI user: a shell command, a flag, a python path, an exception class
SHELL_TEXT = {
    "a shell command": re.compile(r"python[\d.]*(\.exe)? -m |\banima-train (convert|cache|train|audit|check)\b"),
    "a flag": re.compile(r"(?<![\w-])--[a-z][a-z-]+"),
    "a python path": re.compile(r"[\\/](venv|python_embeded|bin|Scripts)[\\/]python", re.IGNORECASE),
    "an exception class": re.compile(r"\b(\w+\.)+\w*(Error|Exception)\b|Traceback"),
}


def _shell_text(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r} in {text[max(0, m.start() - 80):m.end() + 80]!r}"
            for what, rx in SHELL_TEXT.items() for m in rx.finditer(text)]


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    from anima_train.model.tiny import make_synthetic_dataset
    from tests import fixtures_tiny

    tools = comfy_browser.browser_tools()
    name, workflow = _train_template()
    tiny = fixtures_tiny.tiny_anima(tmp_path_factory, size="comfy")
    qwen3_full = fixtures_tiny.comfy_text_encoder(tmp_path_factory)
    base = comfy_browser.base_folder(tmp_path_factory.mktemp("comfy_base"))
    # the template's own file names for ComfyUI's loaders; the trainer's text encoder under a name of the user's
    anima, qwen, vae = (_widget_default(workflow, "AnimaTrainConvert", i) for i in range(3))
    for folder, file_name, src in [("diffusion_models", anima, tiny.anima_file), ("vae", vae, tiny.vae_file),
                                   ("text_encoders", qwen, qwen3_full),
                                   ("text_encoders", "my_qwen3_small.safetensors", tiny.qwen3_file)]:
        (base / "models" / folder).mkdir(parents=True, exist_ok=True)
        (base / "models" / folder / file_name).symlink_to(src)
    # the anchor template's file: listed only (nothing of that template runs here), so that no missing-model
    # warning covers the view
    (base / "models" / "anchors").mkdir(parents=True)
    (base / "models" / "anchors" / "your_anchor.safetensors").write_bytes(b"")
    # the user's images, in ComfyUI's input folder (the nodes read datasets from ComfyUI's folders)
    make_synthetic_dataset(base / "input" / "my_images", n=4, sizes=[(64, 64)])
    # the tiny tokenizers live outside ComfyUI's folders: allowed as a user would (README, "Folders the nodes use")
    allowed = {"ANIMA_TRAIN_ALLOWED_DIRS": str(tiny.diffusers_dir)}
    with comfy_browser.serve(base, "AnimaTrainConfig", env=allowed) as (url, _):
        info = json.loads(comfy_browser.get(f"{url}/object_info", timeout=60))
        yield {"url": url, "base": base, "info": info, "template": name, "workflow": workflow,
               "tokenizers": str(tiny.diffusers_dir), **tools}


def _play(comfy, tmp_path, set_widgets: dict | None, template: str | None = None, stop_at: tuple = ()) -> dict:
    """The driver's report; set_widgets None: open the template and report the view only (no Run); stop_at:
    interrupt the prompt once a node of one of these types runs."""
    return _report(comfy, tmp_path, _start_driver(comfy, tmp_path, set_widgets, template, stop_at))


def _start_driver(comfy, tmp_path, set_widgets: dict | None, template: str | None = None, stop_at: tuple = (),
                  reconnect_when: Path | None = None) -> subprocess.Popen:
    """The driver, started (_report waits for it); reconnect_when: see first_run.cjs."""
    # each test is a user's first visit: the frontend keeps its panels' state in ComfyUI's settings (an Errors panel
    # opened by an earlier test stays open, and the canvas beside it narrows)
    (comfy["base"] / comfy_browser.SETTINGS).write_text(json.dumps({"Comfy.TutorialCompleted": True}))
    cfg = {"url": comfy["url"] + "/", "chromium": comfy["chromium"], "userDataDir": str(tmp_path / "chrome"),
           "outDir": str(tmp_path), "category": DISPLAY_NAME, "template": template or comfy["template"],
           "set": set_widgets or {}, "run": set_widgets is not None, "stopAtType": list(stop_at) or None,
           "timeoutMs": RUN_TIMEOUT_S * 1000, "reconnectWhen": str(reconnect_when) if reconnect_when else None}
    return subprocess.Popen([comfy["node"], str(DRIVER), json.dumps(cfg)], cwd=comfy_browser.BROWSER_DIR,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _report(comfy, tmp_path, driver: subprocess.Popen) -> dict:
    try:
        stdout, stderr = driver.communicate(timeout=RUN_TIMEOUT_S + 240)
    finally:
        driver.kill()
    server_log = (comfy["base"] / "server.log").read_text()[-4000:]
    assert driver.returncode == 0, f"browser driver failed:\n{stdout[-2000:]}\n{stderr[-4000:]}\n{server_log}"
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["pageErrors"] == [], r["pageErrors"]
    assert r["categoryFound"], f"no {DISPLAY_NAME!r} in the Templates dialog"
    assert not [s for s in r.get("set", []) if s.get("missing")], r["set"]
    return r


def _check_view(comfy, r: dict) -> None:
    """The template opens at a zoom where the canvas draws every title and widget, with every node whole on the
    screen (its four corners on the canvas, under no panel), and the pack's nodes are named "Anima: ..."."""
    view = r["view"]
    assert not view["lowQuality"], \
        f"the template opens at {view['scale']:.0%} zoom, where the canvas draws no titles or widgets " \
        f"(viewport {view['viewport']})"
    cut = [(n["type"], n["title"], [round(v) for v in n["box"]], n["corners"]) for n in view["nodes"]
           if not all(n["corners"])]
    assert not cut, f"at {view['scale']:.0%} zoom in a {view['viewport']} window these nodes are cut: {cut}"
    ours = {t for t, spec in comfy["info"].items() if spec.get("python_module", "").startswith("custom_nodes")}
    names = {comfy["info"][n["type"]]["display_name"] for n in view["nodes"] if n["type"] in ours}
    assert names and all(name.startswith("Anima: ") for name in names), names


def _history(url: str, prompt_id: str) -> dict:
    with urllib.request.urlopen(f"{url}/history/{prompt_id}", timeout=30) as r:
        return json.loads(r.read())[prompt_id]


def test_the_template_as_shipped_gives_one_error_and_runs_nothing_of_the_training(comfy, tmp_path):
    converted = comfy["base"] / "models" / "anima_diffusers"
    before = sorted(p.name for p in converted.iterdir()) if converted.is_dir() else []
    # the base-model sample would run at the template's 1024 px and 30 steps (minutes a step on a CPU): the prompt is
    # interrupted once it encodes the prompts (this test runs first: nothing is cached yet); which nodes it was queued
    # to run is read from ComfyUI's queue
    r = _play(comfy, tmp_path, {}, stop_at=("CLIPTextEncode", "KSampler"))
    ids = {n["type"]: str(n["id"]) for n in comfy["workflow"]["nodes"]}
    training = {ids[t] for t in ("AnimaTrainConvert", "AnimaTrainConfig", "AnimaTrainTrain", "AnimaLoadTrainedLora")}

    # one error: the dataset folder, on the Training config, saying to set its widget
    errors = r["lastNodeErrors"] or {}
    messages = [(nid, e.get("message", ""), e.get("details", "")) for nid, node in errors.items()
                for e in node.get("errors", [])]
    assert len(messages) == 1, f"{len(messages)} errors: {messages}"
    nid, message, details = messages[0]
    assert nid == ids["AnimaTrainConfig"], messages
    said = f"{message}\n{details}"
    assert "dataset_path" in said and "Anima: Training config" in said, said
    assert "anima_train_paths.txt" not in said, said
    # the overlay a user sees after Run: that one error, its text shown once (ComfyUI's "Job failed" toast after it
    # is the interrupt this test sends)
    overlay = r["overlay"]
    assert "errors found" not in overlay and overlay.count("set the dataset_path widget") == 1, overlay[-2000:]
    assert not _shell_text(said), _shell_text(said)

    # nothing of the training branch ran or was to run: no conversion (nothing written), no training
    ran = set(r["run"]["ran"])
    assert ran, "nothing ran: the base-model sample needs nothing the error is about"
    assert not ran & training, f"nodes of the training branch ran: {sorted(ran & training)}"
    assert r["run"]["outputs"] is not None, "the prompt was not seen in ComfyUI's queue"
    links = {(str(link[3])): [] for link in comfy["workflow"]["links"]}
    for link in comfy["workflow"]["links"]:
        links[str(link[3])].append(str(link[1]))
    to_run, todo = set(), list(r["run"]["outputs"])
    while todo:  # the queued outputs and everything they need
        node = todo.pop()
        if node not in to_run:
            to_run.add(node)
            todo += links.get(node, [])
    assert not to_run & training, f"queued to run: {sorted(to_run & training)} (outputs {r['run']['outputs']})"
    after = sorted(p.name for p in converted.iterdir()) if converted.is_dir() else []
    assert after == before, f"a conversion wrote {sorted(set(after) - set(before))} under {converted}"
    texts = "\n".join(t for n in r["nodes"] for t in n["texts"])
    assert not _shell_text(texts), _shell_text(texts)
    _check_view(comfy, r)


def _workers_ahead(base: Path) -> list[int]:
    """Live processes of the Train node's waiting worker (`python -P -u -X utf8 -m anima_train.standby`) whose
    parent is the ComfyUI serving `base` (other suites' ComfyUIs and workers may run beside this one)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if ("anima_train.standby" in proc.cmdline() and proc.status() != psutil.STATUS_ZOMBIE
                    and str(base) in " ".join(proc.parent().cmdline())):
                found.append(proc.pid)
        except (psutil.Error, AttributeError):  # gone meanwhile, or no parent
            continue
    return found


def _within(seconds: float, done):
    """done()'s answer once it is true, or at the end of `seconds`."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.25)
    return done()


def _end_workers_ahead(base: Path) -> None:
    """No worker waits for this ComfyUI (as after its restart, or one an earlier test left)."""
    for pid in _workers_ahead(base):
        os.kill(pid, signal.SIGKILL)
    assert _within(10, lambda: not _workers_ahead(base))


def test_opening_the_training_template_starts_the_first_runs_worker_ahead(comfy, tmp_path):
    """The Train node on the canvas asks ComfyUI to start the next run's worker (its imports take most of a warm
    start's wait), so the first run after opening the workflow starts in it. Fails without that: until a run has
    ended in this ComfyUI no worker waits."""
    base = comfy["base"]
    _end_workers_ahead(base)  # the page must start its own
    _play(comfy, tmp_path, None)  # opened from the Templates dialog, nothing queued
    assert _within(30, lambda: _workers_ahead(base)), "opening the training workflow started no worker ahead"


def test_a_page_left_open_through_a_restart_of_comfyui_asks_the_new_server_for_the_worker(comfy, tmp_path):
    """A restart of ComfyUI with the page open (the Manager's Restart): the frontend reconnects without creating its
    nodes again, and the worker the page asked for went with the old server. Played on the real page: the waiting
    worker is ended (as a restart ends it), then the page's connection drops and the frontend's own reconnection
    runs (what a restart makes it do; the server here stays up). Fails without the page's `reconnected` listener:
    no worker until a run ends."""
    base, drop = comfy["base"], tmp_path / "drop-the-connection"
    driver = _start_driver(comfy, tmp_path, None, reconnect_when=drop)
    try:
        assert _within(120, lambda: _workers_ahead(base)), "opening the training workflow started no worker ahead"
        _end_workers_ahead(base)
        drop.touch()
    except BaseException:
        driver.kill()
        raise
    assert _report(comfy, tmp_path, driver)["reconnected"], "the frontend did not reconnect"
    assert _within(30, lambda: _workers_ahead(base)), "the page reconnected and asked for no worker"


def test_the_newcomer_sets_only_their_widgets_and_the_first_run_trains_loads_and_samples(comfy, tmp_path):
    dataset = comfy["base"] / "input" / "my_images"
    t0 = time.perf_counter()
    r = _play(comfy, tmp_path, {
        # what is the user's own
        "AnimaTrainConfig": {"dataset_path": str(dataset),
                             # smaller, so that a CPU finishes
                             "resolution": 64, "max_steps": 4},
        "AnimaTrainConvert": {"qwen": "my_qwen3_small.safetensors", "tokenizers": comfy["tokenizers"]},
        "EmptyLatentImage": {"width": 64, "height": 64},
        "KSampler": {"steps": 4},
    })
    run = r["run"]
    assert run["promptId"], f"Run was refused: {json.dumps(run['queued'])[:3000]}"
    texts = "\n".join(t for n in r["nodes"] for t in n["texts"])
    server_log = (comfy["base"] / "server.log").read_text()[-6000:]
    assert run["end"]["type"] == "execution_success", \
        f"the first run ended with {json.dumps(run['end'])[:3000]}\nnode texts:\n{texts[-3000:]}\n{server_log}"
    history = _history(comfy["url"], run["promptId"])
    savers = [str(n["id"]) for n in comfy["workflow"]["nodes"] if n["type"] == "SaveImage"]
    assert len(savers) == 2
    for nid in savers:
        images = history["outputs"].get(nid, {}).get("images")
        assert images, (nid, history["outputs"])
        assert (comfy["base"] / "output" / images[0]["subfolder"] / images[0]["filename"]).is_file()
    loras = sorted((comfy["base"] / "output").rglob("*.safetensors"))
    assert loras, "no LoRA file under ComfyUI's output folder"
    assert not _shell_text(texts), _shell_text(texts)
    _check_view(comfy, r)
    print(f"\nMEASURED first run: {run['seconds']:.1f} s queue to end, browser session "
          f"{time.perf_counter() - t0:.1f} s; opened at {r['view']['scale']:.0%}")


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "example_workflows").glob("*.json")))
def test_every_template_opens_readable_from_the_templates_dialog(comfy, name, tmp_path):
    r = _play(comfy, tmp_path, None, template=name)
    print(f"\nMEASURED {name!r} opens at {r['view']['scale']:.0%} in a {r['view']['viewport']} window")
    _check_view(comfy, r)
