"""The Train node's chart follows only its own run (js/run_follow.js): js/anima_train.js itself runs under node, in a
copy of the pack's js/ beside stand-ins for the two frontend modules it imports (app, api) and the few DOM calls the
chart makes. A "page" queues prompts through the wrapped api.queuePrompt, receives `anima_train.progress` events as
the websocket delivers them, and switches workflow tabs (the frontend then rebuilds the nodes); the test reads what
each Train node's chart shows (its root element's data-step / data-phase, as the browser test does)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NODE = shutil.which("node")

APP = """
export const app = {
  extensions: [], rootGraph: null,
  registerExtension(ext) { this.extensions.push(ext); },
};
"""

API = """
export const api = new EventTarget();
api.queued = [];
api.queuePrompt = async function (number, data) {  // the server's answer to POST /prompt
  api.queued.push(data);
  await new Promise((r) => setTimeout(r, 0));
  return { prompt_id: globalThis.nextPromptId, number: api.queued.length, node_errors: {} };
};
api.fetched = [];
api.fetchApi = async function (route, options) {  // the pack's own routes
  api.fetched.push([route, options?.method ?? "GET"]);
  return { ok: true, status: 200, json: async () => ({}) };
};
"""

# The page: DOM stand-ins, a graph per workflow tab, and a script of steps given as JSON.
PAGE = r"""
const element = () => {
  const el = { style: {}, dataset: {}, children: [], textContent: "", clientWidth: 400, clientHeight: 200,
               width: 0, height: 0 };
  el.append = (...c) => el.children.push(...c);
  el.replaceChildren = (...c) => { el.children = c; };
  const ctx = new Proxy({}, { get: (t, k) => (k === "measureText" ? () => ({ width: 10 }) : k in t ? t[k] : () => {}),
                              set: (t, k, v) => { t[k] = v; return true; } });
  el.getContext = () => ctx;
  return el;
};
let frames = [];
globalThis.window = { devicePixelRatio: 1, sessionStorage: globalThis.storage };
globalThis.document = { createElement: element };
globalThis.requestAnimationFrame = (f) => { frames.push(f); return frames.length; };
const flush = () => { const f = frames; frames = []; f.forEach((x) => x()); };

const { app } = await import("./scripts/app.js");
const { api } = await import("./scripts/api.js");
await import("./pack/js/anima_train.js");
const ext = app.extensions[0];
class TrainNode {
  constructor(id) { this.id = id; this.widgets = []; this.comfyClass = "AnimaTrainTrain"; this.size = [400, 300]; }
  computeSize() { return [400, 300]; }
  setSize(size) { this.size = size; }
  addDOMWidget(name, type, el, opts) {
    const w = { name, type, element: el, options: opts };
    this.widgets.push(w);
    return w;
  }
  setDirtyCanvas() {}
}
await ext.beforeRegisterNodeDef(TrainNode, { name: "AnimaTrainTrain" });
ext.setup();

// A workflow tab shown on the canvas: the frontend configures the graph and creates fresh node objects.
function show(graphId, nodeIds) {
  const nodes = nodeIds.map((id) => { const n = new TrainNode(id); n.onNodeCreated(); return n; });
  app.rootGraph = { id: graphId, nodes, getNodeById: (id) => nodes.find((n) => String(n.id) === String(id)) ?? null };
  flush();
}
const shown = () => Object.fromEntries(app.rootGraph.nodes.map((n) => {
  const root = n.widgets.find((w) => w.name === "anima_loss_chart").chart.root;
  return [n.id, `${root.dataset.phase}:${root.dataset.step}`];
}));

const out = [];
for (const step of JSON.parse(process.argv[2])) {
  if (step.show) show(step.show, step.nodes);
  if (step.reconnect) api.dispatchEvent(new CustomEvent("reconnected"));
  if (step.queue) {  // the Run button: app.queuePrompt -> api.queuePrompt(number, {output, workflow})
    globalThis.nextPromptId = step.queue;
    await api.queuePrompt(0, { output: {}, workflow: { id: app.rootGraph.id, nodes: [] } });
  }
  for (const ev of step.events ?? []) api.dispatchEvent(new CustomEvent("anima_train.progress", { detail: ev }));
  // the node's result as ComfyUI delivers it when the prompt ends (ui.text)
  if (step.executed) app.rootGraph.getNodeById(step.executed.node).onExecuted({ text: [step.executed.text] });
  flush();
  if (step.read) out.push(shown());
  if (step.readText) out.push(Object.fromEntries(app.rootGraph.nodes.map((n) => [n.id,
    n.widgets.find((w) => w.name === "anima_text")?.element.textContent ?? null])));
}
console.log(JSON.stringify({ out, storage: Object.fromEntries(globalThis.storage.entries()), fetched: api.fetched }));
"""


def run_page(tmp_path: Path, steps: list[dict], storage: dict | None = None) -> dict:
    page = tmp_path / "page"
    if page.exists():
        shutil.rmtree(page)
    (page / "scripts").mkdir(parents=True)
    shutil.copytree(ROOT / "js", page / "pack" / "js")  # ../../scripts/app.js from pack/js/ = page/scripts/app.js
    (page / "scripts" / "app.js").write_text(APP)
    (page / "scripts" / "api.js").write_text(API)
    # sessionStorage: a Map with the Storage methods the extension uses, filled with what a previous page left
    prelude = ("const s = new Map(Object.entries(%s)); s.getItem = (k) => (s.has(k) ? s.get(k) : null); "
               "s.setItem = (k, v) => s.set(k, String(v)); globalThis.storage = s;\n" % json.dumps(storage or {}))
    (page / "page.mjs").write_text(prelude + PAGE)
    result = subprocess.run([NODE, str(page / "page.mjs"), json.dumps(steps)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def steps(prompt, node, *numbers):
    events = [{"node": node, "prompt_id": prompt, "event": "start", "total": 10}]
    return events + [{"node": node, "prompt_id": prompt, "event": "step", "step": n, "total": 10, "loss": 1.0 / n}
                     for n in numbers]


@pytest.mark.skipif(NODE is None, reason="needs node (js/anima_train.js runs as an ES module)")
def test_a_chart_follows_only_the_run_its_page_queued_from_its_workflow(tmp_path):
    result = run_page(tmp_path, [
        {"show": "wf-A", "nodes": [5], "queue": "P1", "events": steps("P1", "5", 1, 2, 3), "read": True},
        # another workflow tab with a Train node of the same id: P1 is not its run
        {"show": "wf-B", "nodes": [5], "read": True},
        {"events": steps("P1", "5", 4)[1:], "read": True},  # still running while B is shown
        # a prompt this page did not queue (a script's, sent to every page): drawn nowhere
        {"events": steps("P9", "5", 7), "read": True},
        {"show": "wf-A", "nodes": [5], "read": True},  # back on A: its run, with the step B did not draw
        {"events": steps("P9", "5", 8), "read": True},
        # the server may send a prompt's first events before the queue request has returned
        {"events": steps("P2", "5", 1), "queue": "P2", "read": True},
    ])
    out = result["out"]
    assert out[0] == {"5": "running:3"}
    assert out[1] == {"5": "idle:"} and out[2] == {"5": "idle:"} and out[3] == {"5": "idle:"}
    assert out[4] == {"5": "running:4"} and out[5] == {"5": "running:4"}
    assert out[6] == {"5": "running:1"}  # the newer run of this workflow

    # a reload mid-run (same tab: sessionStorage kept) still follows P2, and still not P9
    again = run_page(tmp_path, [{"show": "wf-A", "nodes": [5], "events": steps("P2", "5", 2), "read": True},
                                {"events": steps("P9", "5", 9), "read": True},
                                {"show": "wf-B", "nodes": [5], "events": steps("P2", "5", 3), "read": True}],
                     storage=result["storage"])["out"]
    assert again == [{"5": "running:2"}, {"5": "running:2"}, {"5": "idle:"}]


@pytest.mark.skipif(NODE is None, reason="needs node (js/anima_train.js runs as an ES module)")
def test_events_without_a_prompt_id_are_followed_by_node_id_as_before(tmp_path):
    legacy = [{k: v for k, v in e.items() if k != "prompt_id"} for e in steps("x", "5", 1, 2)]
    out = run_page(tmp_path, [{"show": "wf-A", "nodes": [5, 6], "events": legacy, "read": True}])["out"]
    assert out == [{"5": "running:2", "6": "idle:"}]


@pytest.mark.skipif(NODE is None, reason="needs node (js/anima_train.js runs as an ES module)")
def test_a_new_run_clears_the_last_runs_result_text_and_a_cancel_is_shown(tmp_path):
    # the result text of run p1 ("trained …") stayed on the node while p2 ran; and a Cancel showed as "done"
    cancelled = {"node": "5", "prompt_id": "p2", "event": "cancelled", "step": 2, "total": 10,
                 "text": "cancelled at step 2 of 10: saved x.safetensors and its resume state; queue again"}
    page = run_page(tmp_path, [
        {"show": "g1", "nodes": ["5"], "queue": "p1", "events": steps("p1", "5", 1, 2, 3),
         "executed": {"node": "5", "text": "trained run: 3 step(s)"}, "readText": True},
        {"queue": "p2", "events": [{"node": "5", "prompt_id": "p2", "event": "status", "message": "scanning"}],
         "readText": True},
        {"events": steps("p2", "5", 1, 2) + [cancelled], "read": True},
    ])
    first, during, end = page["out"]
    assert first == {"5": "trained run: 3 step(s)"}
    assert during == {"5": ""}  # cleared by the new run's first event
    assert end == {"5": "cancelled:2"}


@pytest.mark.skipif(NODE is None, reason="needs node (js/loss_chart.js is a plain ES module)")
def test_a_reused_run_draws_its_recorded_losses():
    # the node re-uses a finished run (nothing trained now) and sends its recorded losses: the chart was empty
    script = f"""
    import {{ applyEvent }} from {json.dumps((ROOT / "js" / "loss_chart.js").as_uri())};
    const run = applyEvent(null, {{ event: "done", step: 3, total: 3, reused: true, losses: [1.0, 0.5, 0.25] }});
    console.log(JSON.stringify({{ phase: run.phase, steps: run.steps, loss: run.loss, ema: run.ema.length }}));
    """
    result = subprocess.run([NODE, "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"phase": "done", "steps": [1, 2, 3], "loss": [1.0, 0.5, 0.25], "ema": 3}


@pytest.mark.skipif(NODE is None, reason="needs node (js/anima_train.js runs as an ES module)")
def test_a_train_node_on_the_canvas_asks_once_for_the_next_runs_worker(tmp_path):
    """Opening a training workflow (its Train nodes created) posts to the pack's route once, however many Train
    nodes appear in the next 30 s (nodes_train.start_worker_ahead starts the worker). Fails without the request."""
    result = run_page(tmp_path, [{"show": "wf-A", "nodes": [5, 6]}, {"show": "wf-B", "nodes": [5], "read": True}])
    # nodes_train.WORKER_AHEAD_ROUTE (test_nodes_train.py checks that the page holds the same path)
    assert result["fetched"] == [["/anima_train/worker_ahead", "POST"]]
    assert result["out"] == [{"5": "idle:"}]  # the chart is drawn as before (no run yet)


@pytest.mark.skipif(NODE is None, reason="needs node (js/anima_train.js runs as an ES module)")
def test_a_page_that_reconnects_to_a_restarted_comfyui_asks_again_for_the_worker(tmp_path):
    """A restart of ComfyUI with the page open: the page reconnects (the frontend's `reconnected` event) without
    creating its nodes again, so without this the first run after the restart found no worker waiting. Asks at once
    (the last request went to the old server), and only while a Train node is on the canvas. Fails without the
    listener: one request."""
    result = run_page(tmp_path, [{"show": "wf-A", "nodes": [5]}, {"reconnect": True},
                                 {"show": "wf-B", "nodes": []}, {"reconnect": True}])
    assert result["fetched"] == [["/anima_train/worker_ahead", "POST"]] * 2
