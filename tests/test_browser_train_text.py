"""The Train node's text says what is happening now, in the real frontend with real training runs (tiny model, CPU).

tests/browser/train_text.cjs builds Training config -> Train on an empty canvas as a user does, and plays three
queues with the Run button's code and the Cancel button's command: a run cancelled after a few steps, the same graph
queued again (it resumes), and other inputs under the same run name (a new folder `my_run-2`) cancelled while the
model loads. It logs every change of the node's status text; the assertions are here:

  * at queue the text of the run before is gone at once ("queued", then "loading …"), never "no run yet";
  * while training: "training step N of M", the epochs the steps reach (max_steps ends the run long before
    `epochs`), and that it trains on the CPU;
  * Cancel: "cancelled at step N" at once, never a green "done" and no ETA after it; the final text says what was
    saved;
  * after a resume the chart starts at step 1 (the whole run);
  * the "-2" run-name note is on show; a Cancel during load leaves no `my_run-2` folder.

ComfyUI itself reports an interrupted prompt as a failed job ("Job failed"): the README says why the node cannot
prevent that; the test records whether it showed, it does not judge it.
"""
from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests import comfy_browser

pytestmark = [pytest.mark.comfyui, pytest.mark.slow]

DRIVER = comfy_browser.BROWSER_DIR / "train_text.cjs"
EPOCHS, MAX_STEPS, IMAGES = 1000, 2000, 4  # 4 steps an epoch: max_steps ends the run in epoch 500


def _after(log: list, mark: str, until: str | None = None) -> list:
    """The status entries between the `mark` entry and the `until` mark (or the end)."""
    start = next(i for i, e in enumerate(log) if e.get("mark") == mark)
    out = []
    for entry in log[start + 1:]:
        if until and entry.get("mark") == until:
            break
        if "lines" in entry:
            out.append(entry)
    return out


def _texts(entry: dict) -> list[str]:
    return [line["text"] for line in entry["lines"]]


def test_train_node_text_follows_queue_run_and_cancel(tiny_anima, tmp_path_factory, tmp_path):
    from anima_train.model.tiny import make_synthetic_dataset

    tools = comfy_browser.browser_tools()
    base = comfy_browser.base_folder(tmp_path_factory.mktemp("comfy_base"))
    dataset = base / "input" / "dataset"
    make_synthetic_dataset(dataset, n=IMAGES, sizes=[(64, 64)])
    widgets = {"model_path": str(tiny_anima.diffusers_dir), "dataset_path": str(dataset), "run_name": "my_run",
               "rank": 4, "alpha": 4.0, "epochs": EPOCHS, "max_steps": MAX_STEPS, "resolution": 64,
               "batch_size": 1, "dtype": "float32", "source": "encode", "num_workers": 0,
               "gradient_checkpointing": False, "save_every_epochs": 0}
    allowed = {"ANIMA_TRAIN_ALLOWED_DIRS": str(tiny_anima.diffusers_dir)}
    t0 = time.perf_counter()
    with comfy_browser.serve(base, "AnimaTrainTrain", env=allowed) as (url, _):
        cfg = {"url": url + "/", "chromium": tools["chromium"], "userDataDir": str(tmp_path / "chrome"),
               "outDir": str(tmp_path), "widgets": widgets, "changed": {"learning_rate": 2e-4}}
        run = subprocess.run([tools["node"], str(DRIVER), json.dumps(cfg)], cwd=comfy_browser.BROWSER_DIR,
                             capture_output=True, text=True, timeout=900)
    server_log = (base / "server.log").read_text()[-4000:]
    r = json.loads((tmp_path / "result.json").read_text()) if (tmp_path / "result.json").is_file() else {}
    assert run.returncode == 0, (f"browser driver failed:\n{run.stderr[-3000:]}\n{server_log}\n"
                                 f"{json.dumps(r.get('log'))[-4000:]}")
    assert r["pageErrors"] == [], r["pageErrors"]
    print(f"\nbrowser session {time.perf_counter() - t0:.1f} s")
    check_what_the_node_said(r, base / "output" / "anima_train")


def check_what_the_node_said(r: dict, runs) -> None:
    log = r["log"]
    failed = any(e.get("failed") for e in _after(log, "cancel first"))
    print(f"'Job failed' (ComfyUI's own) shown after Cancel: {failed}")

    # 1. queued: "loading …" before the first step, never "no run yet"; then "training step N of M", the real epochs
    first = _after(log, "queue first", "cancel first")
    first = first[next(i for i, e in enumerate(first) if e["phase"] != "idle"):]  # the queue request has returned
    assert first and not any("no run yet" in t for e in first for t in _texts(e)), first[:5]
    assert any(t.startswith("loading") for e in first if not e["step"] for t in _texts(e)), first[:8]
    running = [e for e in first if e["phase"] == "running" and e["step"]]
    main = next(t for t in _texts(running[-1]) if t.startswith("training step"))
    assert f" of {MAX_STEPS} " in main and f"/{MAX_STEPS // IMAGES} " in main, main
    assert any("on the CPU" in t for t in _texts(running[-1])), running[-1]

    # Cancel: said at once; no green "done", no ETA after it; the end says what was saved
    assert "cancelled at step" in r["afterCancel_first"]["text"], r["afterCancel_first"]
    cancelled = _after(log, "cancel first", "queue second")
    cancelled = cancelled[next(i for i, e in enumerate(cancelled) if e["phase"] != "running"):]  # pressed
    pressed_at = next(e["t"] for e in log if e.get("mark") == "cancel first")
    # at once: the next frames, not after the worker's save (seconds; ~7 s here)
    assert cancelled[0]["phase"] == "cancelling" and cancelled[0]["t"] - pressed_at < 2000, cancelled[0]
    for entry in cancelled:
        assert not any(line["kind"] == "done" for line in entry["lines"]), entry
        assert not any("ETA" in t for t in _texts(entry)), entry
    assert r["end_first"]["phase"] == "cancelled" and "saved" in r["end_first"]["text"], r["end_first"]

    # 2. queued again: the cancelled text is gone at once; the resumed run's chart starts at step 1
    second = _after(log, "queue second", "cancel second")
    queued_at = next(e["t"] for e in log if e.get("mark") == "queue second")
    assert second[0]["t"] - queued_at < 2000, second[:2]
    assert _texts(second[0])[-1].startswith(("queued", "loading")), second[:2]
    before_run = [e for e in second if e["phase"] != "running"]
    assert before_run and not any(line["kind"] == "warning" for e in before_run for line in e["lines"]), before_run[:3]
    assert "resuming the run cancelled at step" in _texts(before_run[-1])[0], before_run[-1]  # the note says why
    assert r["resumedChart"]["firstStep"] == "1" and "resumed at step" in r["resumed"]["text"], r["resumedChart"]

    # 3. the run-name note is on show; a Cancel while loading leaves no folder
    assert "so this one is 'my_run-2'" in r["noted"]["text"], r["noted"]
    assert "cancelled before the first step" in r["end_third"]["text"], r["end_third"]
    assert (runs / "my_run").is_dir() and not (runs / "my_run-2").exists(), sorted(p.name for p in runs.iterdir())
