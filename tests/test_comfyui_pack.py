"""The pack inside a real, headless ComfyUI: every node listed, the example workflow trains -> loads -> samples,
progress and loss reach the websocket, re-queueing re-uses the result, Cancel leaves no worker behind.

ComfyUI runs from COMFYUI_PATH with COMFYUI_PYTHON, on the CPU, with `--base-directory` pointing at a temp folder
that holds everything it reads or writes: models (the tiny ComfyUI-detectable Anima built here), custom_nodes/ (a
symlink to this repo), input/output/user. Nothing is written into the ComfyUI checkout. The pack's training
worker runs with ComfyUI's python (its torch), as in real use.

Conditioning: ComfyUI cannot load a tiny Qwen3 (its text encoder config is fixed at 0.6B), so the workflow encodes
prompts with the pack's `Anima: Encode prompt (trainer)` node — Qwen3 + tokenizers of the converted diffusers repo,
returned in the CONDITIONING layout ComfyUI's Anima model consumes; ComfyUI's own Anima code runs the LLM adapter.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
from PIL import Image

pytestmark = [pytest.mark.comfyui, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
PACK_NAME = "comfyui-anima-train"
PACK_NODES = {"AnimaTrainEnvironmentCheck", "AnimaTrainConvert", "AnimaTrainAudit", "AnimaTrainCache",
              "AnimaTrainConfig", "AnimaTrainTrain", "AnimaLoadTrainedLora", "AnimaTrainTextEncode",
              "AnimaAnchorLoader"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


# ----------------------------------------------------------------------------------------------------------
# A minimal websocket client (RFC 6455, client side): text frames in, ping answered. ComfyUI's venv has no
# websocket-client package, and this process must not depend on ComfyUI's aiohttp.


class WebSocket:
    def __init__(self, host: str, port: int, path: str):
        self.sock = socket.create_connection((host, port), timeout=10)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head
        self.sock.settimeout(None)

    def _exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("websocket closed")
            buf += chunk
        return buf

    def _send(self, opcode: int, payload: bytes) -> None:
        mask = os.urandom(4)
        header = bytes([0x80 | opcode])
        n = len(payload)
        header += bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def recv_text(self) -> str:
        parts, text = [], False
        while True:
            b0, b1 = self._exact(2)
            opcode, n = b0 & 0x0F, b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._exact(8))[0]
            payload = self._exact(n)
            if opcode == 8:
                raise ConnectionError("websocket closed by server")
            if opcode == 9:
                self._send(10, payload)
                continue
            if opcode in (1, 2):
                parts, text = [payload], opcode == 1
            elif opcode == 0:
                parts.append(payload)
            if b0 & 0x80 and parts:
                if text:
                    return b"".join(parts).decode()
                parts = []  # binary (preview images): not needed here

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


class Messages:
    """Every websocket message of one client, collected by a thread, with arrival times."""

    def __init__(self, port: int, client_id: str):
        self.items: list[tuple[float, dict]] = []
        self.ws = WebSocket("127.0.0.1", port, f"/ws?clientId={client_id}")
        self.lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        try:
            while True:
                msg = json.loads(self.ws.recv_text())
                with self.lock:
                    self.items.append((time.monotonic(), msg))
        except (ConnectionError, OSError, ValueError):
            pass

    def of(self, prompt_id: str | None = None, kind: str | None = None) -> list[dict]:
        with self.lock:
            items = list(self.items)
        out = []
        for _, m in items:
            data = m.get("data") or {}
            if kind and m.get("type") != kind:
                continue
            if prompt_id and data.get("prompt_id") not in (None, prompt_id):
                continue
            out.append(m)
        return out

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                items = list(self.items)
            for _, m in items:
                if predicate(m):
                    return m
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last messages: "
                             f"{[m.get('type') for _, m in items[-15:]]}")


# ----------------------------------------------------------------------------------------------------------
# Server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, timeout: float = 30):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return r.status, r.read()


def _post(port: int, path: str, data: dict, timeout: float = 30):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(data).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _checkout_state(comfy_root: str) -> str:
    out = subprocess.run(["git", "-C", comfy_root, "status", "--porcelain", "--ignored", "--untracked-files=all"],
                         capture_output=True, text=True)
    return out.stdout


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    from anima_train.model.tiny import make_synthetic_dataset
    from tests import fixtures_tiny

    comfy_root = os.environ["COMFYUI_PATH"]
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    before = _checkout_state(comfy_root)
    t0 = time.perf_counter()
    tiny = fixtures_tiny.tiny_anima(tmp_path_factory, size="comfy")
    t_build = time.perf_counter() - t0
    base = tmp_path_factory.mktemp("comfy_base")
    models = base / "models"
    # the template samples through ComfyUI's CLIPLoader, which loads only a full-size Qwen3: a random one
    for folder, name, src in [("diffusion_models", "anima_tiny.safetensors", tiny.anima_file),
                              ("text_encoders", "qwen3_tiny.safetensors", tiny.qwen3_file),
                              ("text_encoders", "qwen3_full.safetensors", fixtures_tiny.comfy_text_encoder(
                                  tmp_path_factory)),
                              ("vae", "vae_tiny.safetensors", tiny.vae_file)]:
        (models / folder).mkdir(parents=True, exist_ok=True)
        (models / folder / name).symlink_to(src)
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / PACK_NAME).symlink_to(ROOT, target_is_directory=True)
    dataset = base / "input" / "dataset"  # ComfyUI's input folder: readable by the nodes without being allowed
    make_synthetic_dataset(dataset, n=4, sizes=[(64, 64)])
    # the tokenizers of the tiny model live outside ComfyUI's folders: allowed as a user lists a folder
    env = {**os.environ, "ANIMA_TRAIN_ALLOWED_DIRS": str(tiny.diffusers_dir)}

    port = _free_port()
    log = open(base / "server.log", "w")
    t1 = time.perf_counter()
    server = subprocess.Popen([python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
                               "--base-directory", str(base), "--database-url", "sqlite:///:memory:",
                               "--disable-api-nodes"], cwd=comfy_root, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True, env=env)
    info = None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise AssertionError("ComfyUI exited:\n" + (base / "server.log").read_text()[-4000:])
            try:
                info = json.loads(_get(port, "/object_info", timeout=60)[1])
                break
            except OSError:
                time.sleep(0.5)
        assert info is not None, (base / "server.log").read_text()[-4000:]
        t_start = time.perf_counter() - t1
        yield dict(port=port, base=base, info=info, tiny=tiny, dataset=dataset, log=base / "server.log",
                   times={"tiny_build_s": t_build, "server_start_s": t_start})
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
        assert _checkout_state(comfy_root) == before, "the test left files in the ComfyUI checkout"


# ----------------------------------------------------------------------------------------------------------
# UI workflow -> API prompt (what the frontend does when it queues a workflow)


def to_api(workflow: dict, object_info: dict) -> dict:
    links = {ln[0]: ln for ln in workflow["links"]}
    prompt = {}
    for node in workflow["nodes"]:
        spec = object_info[node["type"]]
        names = spec["input_order"].get("required", []) + spec["input_order"].get("optional", [])
        every = {**spec["input"].get("required", {}), **spec["input"].get("optional", {})}
        linked = {i["name"]: links[i["link"]] for i in node.get("inputs", []) if i.get("link") is not None}
        values = list(node.get("widgets_values", []))
        inputs = {}
        for name in names:
            kind, opts = every[name][0], (every[name][1] if len(every[name]) > 1 else {})
            is_widget = isinstance(kind, list) or kind in WIDGET_TYPES
            if is_widget:
                inputs[name] = values.pop(0)
                if opts.get("control_after_generate"):
                    values.pop(0)  # "fixed" / "randomize": a frontend-only value
            if name in linked:
                _, src, slot, *_ = linked[name]
                inputs[name] = [str(src), slot]
        assert not values, f"node {node['id']} {node['type']}: {len(values)} widget value(s) left over"
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


# example_workflows/<name>.json: the file name is the title the Templates dialog shows
TRAIN_TEMPLATE = "Train a LoRA on your images, then sample with it"
ANCHOR_TEMPLATE = "Sample with an Anchor adapter"


def load_workflow(name: str) -> dict:
    return json.loads((ROOT / "example_workflows" / f"{name}.json").read_text())


def set_widgets(workflow: dict, object_info: dict, node_id: int, **values):
    """Change widget values by input name (the UI file stores them by position)."""
    node = next(n for n in workflow["nodes"] if n["id"] == node_id)
    spec = object_info[node["type"]]
    names = spec["input_order"].get("required", []) + spec["input_order"].get("optional", [])
    every = {**spec["input"].get("required", {}), **spec["input"].get("optional", {})}
    pos = 0
    for name in names:
        kind, opts = every[name][0], (every[name][1] if len(every[name]) > 1 else {})
        if isinstance(kind, list) or kind in WIDGET_TYPES:
            if name in values:
                node["widgets_values"][pos] = values.pop(name)
            pos += 1 + bool(opts.get("control_after_generate"))
    assert not values, f"no such widget(s) on node {node_id}: {sorted(values)}"


def tiny_train_workflow(comfy, run_name: str, **config) -> dict:
    info, tiny = comfy["info"], comfy["tiny"]
    wf = load_workflow(TRAIN_TEMPLATE)
    set_widgets(wf, info, 1, unet_name="anima_tiny.safetensors")
    set_widgets(wf, info, 2, vae_name="vae_tiny.safetensors")
    set_widgets(wf, info, 17, clip_name="qwen3_full.safetensors")
    set_widgets(wf, info, 3, anima="anima_tiny.safetensors", qwen="qwen3_tiny.safetensors", vae="vae_tiny.safetensors",
                out_dir="anima_repo", tokenizers=str(tiny.diffusers_dir))  # relative: in models/
    knobs = dict(dataset_path=str(comfy["dataset"]), run_name=run_name, epochs=2, max_steps=6, resolution=64,
                 rank=8, alpha=8.0, learning_rate=0.02, dtype="float32", source="encode", num_workers=0,
                 gradient_checkpointing=False, save_every_epochs=0)
    knobs.update(config)
    set_widgets(wf, info, 4, **knobs)
    set_widgets(wf, info, 8, text="red circle, white background")
    set_widgets(wf, info, 9, text="")
    set_widgets(wf, info, 10, width=64, height=64)
    for ks in (11, 14):
        set_widgets(wf, info, ks, steps=4, cfg=2.0, sampler_name="euler", scheduler="simple")
    return to_api(wf, info)


def queue(comfy, prompt: dict, messages: Messages, client_id: str) -> str:
    status, body = _post(comfy["port"], "/prompt", {"prompt": prompt, "client_id": client_id})
    assert status == 200, body
    return body["prompt_id"]


def finished(prompt_id):
    return lambda m: (m.get("type") in ("execution_success", "execution_error", "execution_interrupted")
                      and (m.get("data") or {}).get("prompt_id") == prompt_id)


def progress_events(messages: Messages, since: int = 0) -> list[dict]:
    with messages.lock:
        items = messages.items[since:]
    return [m["data"] for _, m in items if m.get("type") == "anima_train.progress"]


# ----------------------------------------------------------------------------------------------------------


def test_every_node_is_listed_and_the_workflows_are_templates(comfy):
    info = comfy["info"]
    assert PACK_NODES <= set(info), sorted(PACK_NODES - set(info))
    assert all(info[n]["category"] == "Anima Trainer" for n in PACK_NODES)
    assert info["AnimaTrainConfig"]["output"] == ["ANIMA_TRAIN_CONFIG"]
    assert info["AnimaTrainTrain"]["output_node"] is True
    templates = json.loads(_get(comfy["port"], "/workflow_templates")[1])
    assert sorted(templates[PACK_NAME]) == sorted([ANCHOR_TEMPLATE, TRAIN_TEMPLATE])
    status, body = _get(comfy["port"], f"/api/workflow_templates/{PACK_NAME}/{urllib.parse.quote(TRAIN_TEMPLATE)}.json")
    assert status == 200 and json.loads(body)["nodes"]
    # both templates map onto the live schemas: every widget value has its input, every link its socket
    for name in templates[PACK_NAME]:
        to_api(load_workflow(name), info)
        # the Templates browser shows <name>.jpg beside the file as the template's picture (frontend 1.47 asks for
        # exactly that URL); ours are screenshots of the loaded template in the real UI (test_browser_workflows)
        status, body = _get(comfy["port"], f"/api/workflow_templates/{PACK_NAME}/{urllib.parse.quote(name)}.jpg")
        assert status == 200 and body[:3] == b"\xff\xd8\xff", (name, status)
        with Image.open(io.BytesIO(body)) as picture:
            assert picture.format == "JPEG" and picture.width >= 400 and picture.height >= 250, picture.size
    # the browser's category label for them: the pack's name, in the i18n messages of every UI language
    # (nodes/templates.py; test_browser_templates reads it back from the Templates dialog)
    i18n = json.loads(_get(comfy["port"], "/i18n")[1])
    for lang in ("en", "zh", "ja"):
        label = i18n.get(lang, {}).get("templateWorkflows", {}).get("category", {}).get(PACK_NAME)
        assert label == "Anima Trainer", (lang, label)


def test_train_load_sample_streams_progress_and_changes_the_image(comfy):
    client = uuid.uuid4().hex
    messages = Messages(comfy["port"], client)
    prompt = tiny_train_workflow(comfy, "itest")
    t0 = time.perf_counter()
    prompt_id = queue(comfy, prompt, messages, client)
    end = messages.wait(finished(prompt_id), 600, "the train -> load -> sample prompt")
    seconds = time.perf_counter() - t0
    assert end["type"] == "execution_success", json.dumps(end)[:4000] + comfy["log"].read_text()[-4000:]

    events = progress_events(messages)
    kinds = [e["event"] for e in events]
    steps = [e for e in events if e["event"] == "step"]
    assert kinds[0] == "status" and "start" in kinds and kinds[-1] == "done", kinds
    assert [e["step"] for e in steps] == list(range(1, 7)) and all(e["node"] == "5" for e in events)
    assert all(e["prompt_id"] == prompt_id for e in events)  # the chart follows only this prompt (js/run_follow.js)
    assert (comfy["base"] / "models" / "anima_repo" / "transformer").is_dir()  # Convert's relative out_dir
    assert all(isinstance(e["loss"], float) and e["loss"] > 0 for e in steps) and steps[-1]["total"] == 6
    bar = [m["data"] for m in messages.of(prompt_id, "progress") if m["data"]["node"] == "5"]
    assert bar and bar[-1]["value"] == bar[-1]["max"] == 6
    executed = [m["data"] for m in messages.of(prompt_id, "executed") if m["data"]["node"] == "5"]
    assert "trained itest: 6 step(s)" in executed[0]["output"]["text"][0]

    history = json.loads(_get(comfy["port"], f"/history/{prompt_id}")[1])[prompt_id]
    lora_image = history["outputs"]["13"]["images"][0]
    base_image = history["outputs"]["16"]["images"][0]
    from PIL import Image
    import numpy as np

    out = comfy["base"] / "output"
    a = np.asarray(Image.open(out / lora_image["subfolder"] / lora_image["filename"]), dtype=np.int16)
    b = np.asarray(Image.open(out / base_image["subfolder"] / base_image["filename"]), dtype=np.int16)
    diff = np.abs(a - b)
    assert a.shape == b.shape == (64, 64, 3) and diff.max() > 0, "the trained LoRA did not change the image"
    published = comfy["base"] / "models" / "loras" / "anima_train" / "itest.safetensors"
    assert published.is_file()
    log = comfy["log"].read_text()
    assert "lora key not loaded" not in log and "NOT LOADED" not in log
    done = events[-1]
    print(f"\nMEASURED tiny build {comfy['times']['tiny_build_s']:.1f} s, server start "
          f"{comfy['times']['server_start_s']:.1f} s, prompt (convert + train + 2 samples) {seconds:.1f} s, "
          f"worker training {done.get('seconds', float('nan')):.1f} s for {done['step']} steps, losses "
          f"{[round(e['loss'], 4) for e in steps]}, image diff max {int(diff.max())} mean {diff.mean():.2f}")

    # Re-queue, same graph: ComfyUI's cache answers, no worker runs
    n = len(messages.items)
    again = queue(comfy, prompt, messages, client)
    assert messages.wait(finished(again), 120, "the re-queued prompt")["type"] == "execution_success"
    cached = messages.of(again, "execution_cached")[0]["data"]["nodes"]
    assert "5" in cached and not progress_events(messages, n)

    # After ComfyUI dropped its caches (/free), the node itself finds the finished run (manifest) and re-uses it
    assert _post(comfy["port"], "/free", {"free_memory": True})[0] == 200
    time.sleep(1.0)
    n = len(messages.items)
    t1 = time.perf_counter()
    third = queue(comfy, prompt, messages, client)
    assert messages.wait(finished(third), 300, "the prompt after /free")["type"] == "execution_success"
    reuse = progress_events(messages, n)
    assert [e["event"] for e in reuse] == ["done"] and reuse[0]["reused"] is True
    print(f"MEASURED re-run after /free (no training, manifest re-use) {time.perf_counter() - t1:.1f} s")
    messages.ws.close()


def _workers_alive(marker: str) -> list[int]:
    """The live anima_train processes of the run named `marker`: by its name in their command line, or, for a run in
    a worker started ahead (`-m anima_train.standby`, whose command line names no run), in their current folder."""
    alive = []
    for proc in psutil.process_iter():
        try:
            cmd = " ".join(proc.cmdline())
            if ("anima_train" in cmd and proc.status() != psutil.STATUS_ZOMBIE
                    and (marker in cmd or marker in proc.cwd())):
                alive.append(proc.pid)
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    return alive


def test_cancel_keeps_the_run_and_the_next_queue_resumes_it(comfy):
    """The default config (save_optimizer_state off): Cancel saves the weights and a resume state, ends every worker
    process, says on the node where it stopped and how to go on; queueing the same graph again resumes there."""
    client = uuid.uuid4().hex
    messages = Messages(comfy["port"], client)
    prompt = tiny_train_workflow(comfy, "itest_cancel", max_steps=40, epochs=200)
    prompt_id = queue(comfy, prompt, messages, client)
    messages.wait(lambda m: m.get("type") == "anima_train.progress" and m["data"]["event"] == "step"
                  and m["data"]["step"] >= 2, 600, "two training steps")
    assert _workers_alive("itest_cancel"), "the worker should be running now"
    t0 = time.perf_counter()
    assert _post(comfy["port"], "/interrupt", {})[0] == 200
    end = messages.wait(finished(prompt_id), 120, "the interrupted prompt")
    t_stop = time.perf_counter() - t0
    assert end["type"] == "execution_interrupted", end
    time.sleep(5.0)
    assert _workers_alive("itest_cancel") == [], "a worker process outlived Cancel"
    # the worker stopped gracefully: a step checkpoint with its resume state, and the node says so
    events = progress_events(messages)
    saved = [e for e in events if e["event"] == "checkpoint"]
    assert saved, "no checkpoint was saved on Cancel"
    ckpt, step = Path(saved[-1]["path"]), saved[-1]["step"]
    state = ckpt.with_name(ckpt.name.removesuffix(".safetensors") + "-state")
    assert ckpt.is_file() and (state / "state.json").is_file()
    (said,) = [e for e in events if e["event"] == "cancelled"]
    assert said["text"] == (f"cancelled at step {step} of 40: saved {ckpt} and its resume state; queue again "
                            f"(same inputs) to resume from step {step}"), said
    print(f"\nMEASURED Cancel -> execution_interrupted {t_stop:.1f} s (graceful save of step {step} with its "
          f"resume state)")

    since = len(messages.items)
    prompt_id = queue(comfy, prompt, messages, client)
    end = messages.wait(finished(prompt_id), 600, "the re-queued prompt")
    assert end["type"] == "execution_success", end
    events = progress_events(messages, since)
    (start,) = [e for e in events if e["event"] == "start"]
    assert start["resumed_step"] == step and start["run_dir"] == str(ckpt.parent), start
    done = [e for e in events if e["event"] == "done"][-1]
    assert done["step"] == 40 and done["final"] == str(ckpt.parent / "itest_cancel.safetensors"), done
    messages.ws.close()


def test_paths_outside_comfys_folders_are_refused(comfy, tmp_path_factory):
    """A graph posted to the server cannot make the nodes read or write outside ComfyUI's folders and the allowed
    ones: absolute paths, `..` and symlinks leading elsewhere are refused on the node, saying how to allow them."""
    client = uuid.uuid4().hex
    messages = Messages(comfy["port"], client)
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    (elsewhere / "data").mkdir()
    link = comfy["base"] / "input" / "linked_data"
    link.symlink_to(elsewhere / "data", target_is_directory=True)
    refusal = "outside the folders the Anima nodes may use"
    for knobs in ({"output_dir": str(elsewhere / "runs")}, {"output_dir": "../../" + elsewhere.name},
                  {"dataset_path": "linked_data"},
                  {"extra_toml": f'[train]\nresume_from = "{elsewhere}/x-state"\n'}):
        whole = tiny_train_workflow(comfy, "outside", **knobs)
        prompt = {i: whole[i] for i in ("4", "5")}  # Training config -> Train, on the (allowed) tiny repo
        prompt["4"]["inputs"]["model_path"] = str(comfy["tiny"].diffusers_dir)
        status, body = _post(comfy["port"], "/prompt", {"prompt": prompt, "client_id": client})
        errors = body.get("node_errors", {}).get("4", {}).get("errors", [])
        said = [" ".join(e["details"].split()) for e in errors]  # a long first line is broken for the popup
        assert status == 400 and any(refusal in d and "ANIMA_TRAIN_ALLOWED_DIRS" in d for d in said), (knobs, body)
    # Convert has no check before it runs: it refuses when executed, before its worker starts (it runs for a node
    # that takes its model_path: it is no output node)
    prompt = {"1": {"class_type": "AnimaTrainConvert", "inputs": {
        "anima": "anima_tiny.safetensors", "qwen": "qwen3_tiny.safetensors", "vae": "vae_tiny.safetensors",
        "out_dir": "../../" + elsewhere.name + "/repo", "tokenizers": "none"}},
        "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
    prompt_id = queue(comfy, prompt, messages, client)
    end = messages.wait(finished(prompt_id), 120, "the Convert prompt")
    assert end["type"] == "execution_error" and refusal in end["data"]["exception_message"], end
    assert sorted(p.name for p in elsewhere.iterdir()) == ["data"], "something was written outside"
    messages.ws.close()
