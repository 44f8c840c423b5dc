// Anima Trainer pack: front-end extension.
// 1. ComfyUI delivers a node's `ui.text` but draws it only for its own text nodes; this shows it on ours.
// 2. The "Anima: Train" node gets a live loss chart fed by the `anima_train.progress` websocket events that the
//    node relays from the trainer (one per trainer event: start/status/step/message/warning/checkpoint/samples/
//    done/error), and under it the latest [sample] previews as a small grid of thumbnails ("samples" events).
//    A chart follows only the runs this page queued from the workflow on the canvas (js/run_follow.js says how).
// 3. Inputs declared advanced (the rarer Training config knobs) hide behind the node's "Show Advanced" toggle on the
//    LiteGraph canvas too, not only in Nodes 2.0 and the properties panel.
// 4. A text widget's label stays whole beside a long value (js/widget_labels.js).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { applyEvent, cancellingRun, drawChart, newRun, queuedRun, startedRun, statusLines } from "./loss_chart.js";
import { fitToContent } from "./fit_content.js";
import { PromptBook, chartRunKey, follows, runKey } from "./run_follow.js";
import { keepLabels } from "./widget_labels.js";

const PACK_NODE_PREFIXES = ["AnimaTrain", "AnimaLoad", "AnimaAnchor"];
const TRAIN_NODE = "AnimaTrainTrain";
const PROGRESS_EVENT = "anima_train.progress";
// nodes/nodes_train.py WORKER_AHEAD_ROUTE: the server starts the next run's worker, so that its imports are done
// by the time the user queues (asked when a Train node appears: a training workflow opened, added or reloaded)
const WORKER_AHEAD_ROUTE = "/anima_train/worker_ahead";
const WORKER_AHEAD_EVERY_MS = 30000; // a workflow with several Train nodes, or reopened, asks once
const CHART_WIDGET = "anima_loss_chart";
const MAX_RUNS = 32; // runs remembered per page (one per prompt and Train node id); old ones are dropped
const PREVIEW_HEIGHT = 120; // px: the thumbnail row under the chart
const TEXT_MAX_PX = 480; // a node's result text grows the node up to this height, then scrolls
const TEXT_MAX_WIDTH_PX = 820; // the Check node widens to its longest line up to this width, then wraps
const CHECK_NODE = "AnimaTrainEnvironmentCheck";

function isOurs(nodeData) {
  return PACK_NODE_PREFIXES.some((p) => (nodeData?.name || "").startsWith(p));
}

function clearText(node) {
  const widget = node.widgets?.find((w) => w.name === "anima_text");
  if (widget?.element && widget.element.textContent) {
    widget.element.textContent = "";
    node.setDirtyCanvas(true, true);
  }
}

function showText(node, text) {
  let widget = node.widgets?.find((w) => w.name === "anima_text");
  if (!widget) {
    const el = document.createElement("pre");
    el.className = "anima-train-text";
    el.style.cssText =
      "margin:0;padding:4px 6px;font:11px/1.35 monospace;white-space:pre-wrap;overflow-wrap:anywhere;overflow:auto;" +
      "background:var(--comfy-input-bg,#222);color:var(--input-text,#ddd);border-radius:4px;";
    widget = node.addDOMWidget("anima_text", "anima_text", el, { serialize: false });
    widget.serialize = false; // options.serialize keeps it out of the prompt, this out of the saved workflow
    widget.element = el;
  }
  widget.element.textContent = text;
  // the Check report is a table (wrapping its rows makes it unreadable): that node widens; the others wrap
  const maxWidth = node.comfyClass === CHECK_NODE ? TEXT_MAX_WIDTH_PX : 0;
  fitToContent(node, widget, { maxHeight: TEXT_MAX_PX, maxWidth });
}

// ---- live loss chart -------------------------------------------------------------------------------------

// Run state lives here, keyed by prompt id and the node id string the server sent (run_follow.runKey), not on the
// node: events for a node that is not (or not yet) on the canvas are kept, and a chart widget created later (a
// workflow tab shown again) draws them. Map order = update order (rememberRun moves a run to the end).
const runs = new Map();
const prompts = new PromptBook(sessionStorageOrNull());

function sessionStorageOrNull() {
  try {
    return window.sessionStorage ?? null;
  } catch {
    return null;
  }
}

// The Train node text follows the queue, not only the trainer's events (those come seconds after the node starts):
// queued -> its text and the run before it are gone; the node starts -> "loading"; Cancel -> "cancelled at step N"
// at once. `change(run)` returns the new state of each run of `promptId` (every prompt when it is undefined).
function updateRuns(promptId, change, nodeIds = null) {
  for (const [key, run] of [...runs]) {
    const [prompt, node] = [key.slice(0, key.indexOf("|")), key.slice(key.indexOf("|") + 1)];
    if ((promptId !== undefined && prompt !== String(promptId)) || (nodeIds && !nodeIds.includes(node))) continue;
    const next = change(run);
    if (next === null) runs.delete(key);
    else if (next !== run || next.phase !== run.phase) rememberRun(key, next);
  }
  for (const node of trainNodesOnCanvas()) scheduleDraw(node);
}

function onQueued(promptId, output) {
  for (const [id, spec] of Object.entries(output ?? {})) {
    if (spec?.class_type !== TRAIN_NODE) continue;
    // events may come first; the node may have started before the queue request returned
    const key = runKey(promptId, id);
    if (!runs.has(key)) rememberRun(key, id === executingNode ? startedRun(queuedRun()) : queuedRun());
    const node = findNode(id);
    if (node) {
      node.animaTextRun = key;
      clearText(node);
    }
  }
}

let executingNode = null; // the node the server runs now ("executing"), as a string; null between prompts

function onQueueEvent(type, detail) {
  if (type === "executing") { // detail: the node id alone (the frontend drops the prompt id of this message)
    const id = detail !== null && typeof detail === "object" ? detail.node : detail;
    executingNode = id === null || id === undefined ? null : String(id);
    if (executingNode === null) return;
    // prompts run in queue order: the node's earliest queued run is the one starting
    const key = [...runs.keys()].find((k) => k.endsWith(`|${id}`) && runs.get(k).phase === "queued");
    if (key) {
      rememberRun(key, startedRun(runs.get(key)));
      for (const node of trainNodesOnCanvas()) scheduleDraw(node);
    }
    return;
  }
  const promptId = detail?.prompt_id;
  if (promptId === undefined || promptId === null) return;
  if (type === "execution_cached") { // not run again: the node shows the run it re-uses
    updateRuns(promptId, (run) => (run.phase === "queued" ? null : run), (detail.nodes ?? []).map(String));
  } else if (["execution_success", "execution_error", "execution_interrupted"].includes(type)) {
    updateRuns(promptId, (run) => {
      if (run.phase === "cancelling") return Object.assign(run, { phase: "cancelled", cancelled: { text: run.note } });
      if (run.phase !== "queued") return run; // the node's own events said how it ended
      return Object.assign(newRun(), { phase: "cancelled",
        cancelled: { text: "not run: the prompt ended before this node (see the node marked red)" } });
    });
  }
}

// The id of the workflow on the canvas: LiteGraph's graph id, saved in the workflow (run_follow.js).
function currentGraphId() {
  return String((app.rootGraph ?? app.graph)?.id ?? "");
}

function rememberRun(id, run) {
  runs.delete(id);
  runs.set(id, run);
  if (runs.size > MAX_RUNS) runs.delete(runs.keys().next().value);
}

// The server sends the executing node's unique id: "12" for a node of the root graph, "5:12" for a node inside
// subgraph node 5. Walks the path; returns null when the node is not on the canvas (another tab's workflow).
function findNode(id) {
  const graph = app.rootGraph ?? app.graph;
  if (!graph) return null;
  const parts = String(id).split(":");
  let current = graph, node = null;
  for (const part of parts) {
    if (!current?.getNodeById) return null;
    node = current.getNodeById(/^\d+$/.test(part) ? Number(part) : part);
    if (!node) return null;
    current = node.subgraph;
  }
  return node;
}

// The Train nodes of the workflow on the canvas, inside subgraphs too.
function trainNodesOnCanvas(graph = app.rootGraph ?? app.graph, found = []) {
  for (const node of graph?.nodes ?? graph?._nodes ?? []) {
    if (node.comfyClass === TRAIN_NODE) found.push(node);
    if (node.subgraph && node.subgraph !== graph) trainNodesOnCanvas(node.subgraph, found);
  }
  return found;
}

function chartWidget(node) {
  return node.widgets?.find((w) => w.name === CHART_WIDGET);
}

function addChartWidget(node) {
  if (chartWidget(node)) return chartWidget(node);
  const root = document.createElement("div");
  root.className = "anima-train-chart";
  root.style.cssText =
    "display:flex;flex-direction:column;gap:3px;width:100%;height:100%;box-sizing:border-box;padding:2px;" +
    "font:11px/1.35 sans-serif;color:var(--input-text,#ddd);";
  const canvas = document.createElement("canvas");
  canvas.className = "anima-train-chart-canvas";
  // basis 0: the box, never the backing store's pixel size (2x on HiDPI), decides the height — no resize loop
  canvas.style.cssText = "flex:1 1 0;min-height:90px;width:100%;border-radius:4px;display:block;";
  const status = document.createElement("div");
  status.className = "anima-train-chart-status";
  // room for three lines from the start, so the canvas does not shrink when the first step arrives
  status.style.cssText = "flex:0 0 auto;min-height:4.1em;white-space:pre-wrap;overflow-wrap:anywhere;";
  const previews = document.createElement("div");
  previews.className = "anima-train-previews";
  previews.style.cssText = `flex:0 0 auto;display:none;gap:3px;height:${PREVIEW_HEIGHT}px;overflow:hidden;`;
  root.append(canvas, previews, status);

  const widget = node.addDOMWidget(CHART_WIDGET, "anima_loss_chart", root, {
    serialize: false,
    hideOnZoom: false,
    getMinHeight: () => 210 + (widget.chart?.previewsShown ? PREVIEW_HEIGHT + 3 : 0),
  });
  widget.serialize = false; // not part of the saved workflow's widgets_values (options.serialize: not in the prompt)
  // key: the id the server uses for this node, set by the first event — "5:12" inside subgraph node 5; until then
  // the node's own id (not known yet here: onNodeCreated runs before graph.add assigns it)
  widget.chart = { root, canvas, status, previews, frame: 0, key: null, previewsKey: "", previewsShown: false };
  // redraw on any size change (node resized, first layout); the 2D canvas needs its pixel size set explicitly
  if (typeof ResizeObserver !== "undefined") {
    const observer = new ResizeObserver(() => scheduleDraw(node));
    observer.observe(canvas);
    const previousRemove = widget.onRemove;
    widget.onRemove = function () {
      observer.disconnect();
      return previousRemove?.apply(this, arguments);
    };
  }
  scheduleDraw(node);
  return widget;
}

function scheduleDraw(node) {
  const widget = chartWidget(node);
  if (!widget?.chart || widget.chart.frame) return;
  // coalesce bursts of events (a fast tiny run, a page catching up) into one draw per animation frame
  widget.chart.frame = requestAnimationFrame(() => {
    widget.chart.frame = 0;
    try {
      renderChart(node, widget.chart);
    } catch (err) {
      console.warn("[anima_train] loss chart draw failed", err);
    }
  });
}

function renderChart(node, chart) {
  const key = chartRunKey(prompts, runs, chart.key ?? String(node.id), currentGraphId());
  const run = (key !== null && runs.get(key)) || newRun();
  const dpr = window.devicePixelRatio || 1;
  const cssWidth = Math.max(1, chart.canvas.clientWidth), cssHeight = Math.max(1, chart.canvas.clientHeight);
  const pixelWidth = Math.round(cssWidth * dpr), pixelHeight = Math.round(cssHeight * dpr);
  if (chart.canvas.width !== pixelWidth) chart.canvas.width = pixelWidth;
  if (chart.canvas.height !== pixelHeight) chart.canvas.height = pixelHeight;
  drawChart(chart.canvas, run, cssWidth, cssHeight, dpr);

  const colours = { main: "", info: "opacity:0.75;", done: "color:#7fd88f;", error: "color:#ff7b72;",
                    warning: "color:#e3b341;" };
  const lines = statusLines(run).map(({ text, kind }) => {
    const line = document.createElement("div");
    line.className = `anima-train-status-${kind}`;
    line.style.cssText = colours[kind] ?? "";
    line.textContent = text;
    return line;
  });
  chart.status.replaceChildren(...lines);
  renderPreviews(node, chart, run.samples);
  chart.status.title = run.phase === "error" ? String(run.error?.traceback ?? "") : "";
  chart.root.dataset.phase = run.phase;
  chart.root.dataset.step = run.last?.step ?? "";
  chart.root.dataset.firstStep = run.steps[0] ?? ""; // 1 after a resume too: the chart shows the whole run
  node.setDirtyCanvas(true, false);
}

// The latest preview set as a row of thumbnails (rebuilt only when a new set arrives); the prompt is the tooltip.
function renderPreviews(node, chart, samples) {
  const key = samples ? `${samples.step}|${samples.images.length}|${samples.images.map((u) => u?.length ?? 0)}` : "";
  if (key === chart.previewsKey) return;
  chart.previewsKey = key;
  const cells = (samples?.images ?? []).map((url, i) => {
    const img = document.createElement("img");
    img.className = "anima-train-preview";
    img.style.cssText = "height:100%;flex:0 1 auto;min-width:0;object-fit:contain;border-radius:3px;";
    if (url) img.src = url; // a data: URL checked by applyEvent, never a path or a remote address
    img.title = `step ${samples.step}: ${samples.prompts[i] ?? ""}`;
    img.alt = img.title;
    return img;
  });
  chart.previews.replaceChildren(...cells);
  chart.previews.style.display = cells.length ? "flex" : "none";
  chart.root.dataset.previewStep = samples?.step ?? "";
  const shown = cells.length > 0;
  if (shown !== chart.previewsShown) {
    chart.previewsShown = shown;
    if (shown && node.computeSize) node.setSize([node.size[0], Math.max(node.size[1], node.computeSize()[1])]);
  }
}

function onProgress(detail) {
  if (!detail || detail.node === undefined || detail.node === null) return;
  const id = String(detail.node);
  const key = runKey(detail.prompt_id, id);
  rememberRun(key, applyEvent(runs.get(key), detail));
  // another workflow's run, or a prompt this page did not queue (yet: its id may arrive after its first events)
  if (!follows(prompts, detail.prompt_id, currentGraphId())) return;
  const node = findNode(id);
  if (!node || node.comfyClass !== TRAIN_NODE) return; // not on this canvas: the state waits in `runs`
  const widget = chartWidget(node) ?? addChartWidget(node);
  widget.chart.key = id;
  // a new run: the result text of the one before (e.g. "trained …" or "re-used …") no longer describes the node
  if (node.animaTextRun !== key) {
    node.animaTextRun = key;
    clearText(node);
  }
  scheduleDraw(node);
}

// The frontend (1.47) copies an input's `advanced` flag to widget.options.advanced, which Nodes 2.0 and the
// properties panel honour; the LiteGraph canvas (the default renderer) has the rest of the toggle (the node menu's
// "Show Advanced", node.showAdvanced saved with the workflow, isWidgetVisible) but reads widget.advanced, which
// nothing sets, and still lays out space for a hidden widget (getLayoutWidgets skips only `hidden`). This sets the
// flag and leaves hidden advanced widgets out of the layout, so the frontend's own toggle works on the canvas too.
function markAdvanced(node) {
  for (const widget of node.widgets ?? []) widget.advanced ??= !!widget.options?.advanced;
  if (node.hasAdvancedWidgets?.()) fitHeight(node);
}

function fitHeight(node) {
  node.setSize([node.size[0], node.computeSize()[1]]);
}

function hideAdvancedOnCanvas(nodeType) {
  const layout = nodeType.prototype.getLayoutWidgets;
  if (layout) {
    nodeType.prototype.getLayoutWidgets = function () {
      return layout.apply(this, arguments).filter((w) => !(w.advanced && !this.showAdvanced));
    };
  }
  const toggle = nodeType.prototype.toggleAdvanced;
  if (toggle) {
    nodeType.prototype.toggleAdvanced = function () {
      const result = toggle.apply(this, arguments);
      if (!this.showAdvanced) fitHeight(this); // the frontend grows the node to show them, never shrinks it back
      return result;
    };
  }
}

let workerAskedAt = -Infinity;

async function askForWorkerAhead() {
  const now = Date.now();
  if (now - workerAskedAt < WORKER_AHEAD_EVERY_MS) return;
  workerAskedAt = now;
  try {
    await api.fetchApi(WORKER_AHEAD_ROUTE, { method: "POST" });
  } catch (err) {
    // never the node's concern: the run then starts its own worker, as without this
    console.warn("[anima_train] the next run's worker was not started ahead", err);
  }
}

app.registerExtension({
  name: "anima_train.ui",
  setup() {
    // Remember which workflow each prompt this page queues came from (run_follow.js). The frontend builds the
    // prompt from the graph on the canvas and passes that graph, serialized, as `workflow`.
    const queuePrompt = api.queuePrompt;
    if (typeof queuePrompt === "function") {
      api.queuePrompt = async function (number, data, ...rest) {
        const graphId = String(data?.workflow?.id ?? currentGraphId());
        const response = await queuePrompt.call(this, number, data, ...rest);
        try {
          if (response?.prompt_id) {
            prompts.remember(response.prompt_id, graphId);
            onQueued(response.prompt_id, data?.output);
            for (const node of trainNodesOnCanvas()) scheduleDraw(node); // its first events may be here already
          }
        } catch (err) {
          console.warn("[anima_train] queued prompt not recorded", err);
        }
        return response;
      };
    }
    // Cancel: the Interrupt command and the queue panel's cancel reach the server through these two
    for (const method of ["interrupt", "cancelJob"]) {
      const original = api[method];
      if (typeof original !== "function") continue;
      api[method] = function (promptId, ...rest) {
        try {
          updateRuns(promptId ?? undefined, cancellingRun);
        } catch (err) {
          console.warn("[anima_train] cancel not shown", err);
        }
        return original.call(this, promptId, ...rest);
      };
    }
    for (const type of ["executing", "execution_cached", "execution_success", "execution_error",
      "execution_interrupted"]) {
      api.addEventListener(type, ({ detail }) => {
        try {
          onQueueEvent(type, detail);
        } catch (err) {
          console.warn("[anima_train] queue event ignored", err, detail);
        }
      });
    }
    // A restart of ComfyUI with this page left open (the Manager's Restart, a console restart): the page reconnects
    // without creating its nodes again, and the worker asked for went with the old server.
    api.addEventListener("reconnected", () => {
      if (!trainNodesOnCanvas().length) return;
      workerAskedAt = -Infinity;
      askForWorkerAhead();
    });
    api.addEventListener(PROGRESS_EVENT, ({ detail }) => {
      try {
        onProgress(detail);
      } catch (err) {
        console.warn("[anima_train] progress event ignored", err, detail);
      }
    });
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!isOurs(nodeData)) return;
    const made = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = made?.apply(this, arguments);
      keepLabels(this, () => app.canvas?.ctx ?? null);
      return result;
    };
    const previous = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      previous?.apply(this, arguments);
      const text = message?.text;
      if (text && text.length) showText(this, Array.isArray(text) ? text.join("\n") : String(text));
    };
    if (Object.values({ ...nodeData.input?.required, ...nodeData.input?.optional }).some((s) => s?.[1]?.advanced)) {
      hideAdvancedOnCanvas(nodeType);
      const created = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const result = created?.apply(this, arguments);
        markAdvanced(this);
        return result;
      };
    }
    if (nodeData.name === TRAIN_NODE) {
      const created = nodeType.prototype.onNodeCreated;
      nodeType.prototype.onNodeCreated = function () {
        const result = created?.apply(this, arguments);
        addChartWidget(this);
        askForWorkerAhead();
        return result;
      };
    }
  },
});
