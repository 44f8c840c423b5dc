"""A headless ComfyUI and a headless Chromium for the browser tests (tests/test_browser*.py); a plain module.

ComfyUI runs from COMFYUI_PATH with COMFYUI_PYTHON on the CPU, with `--base-directory` pointing at a temp folder
(models, custom_nodes, input, output, user), so the ComfyUI checkout is never written to. The browser is the system
Chromium driven by playwright-core from tests/browser/node_modules (`npm install --prefix tests/browser`), which
never downloads a browser of its own.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BROWSER_DIR = ROOT / "tests" / "browser"
PACK_NAME = "comfyui-anima-train"
SERVER_START_TIMEOUT = 180  # s; the first start compiles .pyc files and imports torch on 2 cores


def chromium() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _playwright_ok(node: str) -> bool:
    probe = subprocess.run([node, "-e", "require.resolve('playwright-core')"], cwd=BROWSER_DIR,
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def browser_tools() -> dict:
    """{chromium, node} or a skip that says what to install."""
    browser = chromium()
    if browser is None:
        pytest.skip("needs Chromium: apt-get install chromium (or set CHROMIUM to its binary)")
    node = shutil.which("node")
    if node is None:
        pytest.skip("needs Node.js (node) to run the tests/browser drivers")
    if not _playwright_ok(node):
        pytest.skip("needs playwright-core: npm install --prefix tests/browser")
    return {"chromium": browser, "node": node}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


SETTINGS = Path("user") / "default" / "comfy.settings.json"  # the frontend's settings, under the base folder


def base_folder(base: Path, folder: str = PACK_NAME) -> Path:
    """A ComfyUI base directory whose custom_nodes/<folder> holds this pack (a symlink to the checkout), with the
    frontend's settings saying the tutorial was done (no first-run templates dialog over the canvas)."""
    (base / "custom_nodes").mkdir(parents=True, exist_ok=True)
    (base / "custom_nodes" / folder).symlink_to(ROOT, target_is_directory=True)
    (base / SETTINGS).parent.mkdir(parents=True, exist_ok=True)
    (base / SETTINGS).write_text(json.dumps({"Comfy.TutorialCompleted": True}))
    return base


@contextmanager
def serve(base: Path, ready_node: str, env: dict | None = None):
    """Run ComfyUI on `base` until the block ends; yields (url, /object_info/<ready_node>). `env`: extra environment
    variables for the server (e.g. ANIMA_TRAIN_ALLOWED_DIRS for test files outside ComfyUI's folders)."""
    comfy_root = Path(os.environ["COMFYUI_PATH"])
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    port = free_port()
    log_path = base / "server.log"
    log = open(log_path, "w")
    server = subprocess.Popen(
        [python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--base-directory", str(base),
         "--database-url", "sqlite:///:memory:", "--disable-auto-launch", "--disable-api-nodes"],
        cwd=comfy_root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if server.poll() is not None:
                pytest.fail(f"ComfyUI exited with {server.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                info = json.loads(get(f"{url}/object_info/{ready_node}"))
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    pytest.fail(f"ComfyUI did not answer in {SERVER_START_TIMEOUT}s:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.5)
        assert ready_node in info, (f"/object_info has no {ready_node}: the pack did not register it; server log:\n"
                                    f"{log_path.read_text()[-3000:]}")
        yield url, info[ready_node]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
