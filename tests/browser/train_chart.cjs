// Drives a real headless Chromium against a running ComfyUI for tests/test_browser.py.
//   node train_chart.cjs '<json: {url, chromium, userDataDir, outDir, screenshot}>'
// Adds an "Anima: Train" node, replays a synthetic training run as `anima_train.progress` events through the
// frontend's own api object (the same dispatch the websocket handler does for a registered custom message type),
// and writes what it measured to <outDir>/result.json. It asserts nothing itself: the Python test judges.
// playwright-core only drives the browser it is given; it never downloads one.
"use strict";
const fs = require("fs");
const path = require("path");
const { launch, openPage, waitForPack, newBlankWorkflow } = require("./comfy_page.cjs");

const cfg = JSON.parse(process.argv[2]);

// in the page: the synthetic run. Loss decays with noise; its terms (the step event's "terms") are mse and `second`
// (the hf term unless named otherwise: a term the chart has no word of), or none when `second` is null.
function syntheticSteps(total, upto, second = "hf") {
  const withHf = second !== null;
  const events = [];
  let seed = 7;
  const rand = () => ((seed = (seed * 16807) % 2147483647) / 2147483647);
  for (let step = 1; step <= upto; step++) {
    const mse = 0.09 + 0.25 * Math.exp(-step / 40) + 0.05 * (rand() - 0.5);
    const hf = withHf ? 0.012 + 0.02 * Math.exp(-step / 60) + 0.004 * (rand() - 0.5) : null;
    events.push({
      event: "step", step, total, epoch: 1 + Math.floor((step - 1) / 40), loss: mse + (hf ?? 0),
      terms: withHf ? { mse, [second]: hf } : {}, ot: null, lr: [1e-4 * Math.min(1, step / 20), 1e-4 * Math.min(1, step / 20), 5e-5],
      s_per_step: 1.84, eta_s: 1.84 * (total - step), peak_gb: [11.6, 11.4],
    });
  }
  return events;
}

// [validation] as the trainer reports it: before the first step and every 20 steps (held-out loss, caption margin)
function syntheticValidation(from, to) {
  const events = [];
  for (let step = from; step <= to; step++) {
    if (step % 20) continue;
    events.push({ event: "validation", step, loss: 0.12 + 0.27 * Math.exp(-step / 50), shuffled: null,
                  margin: 0.001 + 0.0002 * step, seconds: 3.1 });
  }
  return events;
}

async function main() {
  const result = { console: [], pageErrors: [] };
  const browser = await launch(cfg, { width: 1280, height: 900 });
  try {
    const page = await openPage(browser, cfg, result);
    // ready: the app is set up and our extension has registered (it listens for the progress message)
    // the app and its start-up workflow (newBlankWorkflow must come after that load), and the pack's progress event
    await waitForPack(page, "AnimaTrainTrain");
    await page.waitForFunction(() => window.comfyAPI.api.api._registered?.has("anima_train.progress"), null,
      { timeout: 90000, polling: 250 });
    result.extensionUrls = await page.evaluate(async () => (await (await fetch("/extensions")).json())
      .filter((u) => !u.includes("/core/")));
    result.extensionNames = await page.evaluate(() => window.comfyAPI.app.app.extensions.map((e) => e.name)
      .filter((n) => n.startsWith("anima_train")));

    // one Train node on an otherwise empty graph, at 100% zoom in the middle of the screen
    await newBlankWorkflow(page);
    result.nodeId = await page.evaluate(() => {
      const app = window.comfyAPI.app.app;
      const node = window.LiteGraph.createNode("AnimaTrainTrain");
      app.graph.add(node);
      node.pos = [0, 0];
      node.size = [520, Math.max(node.size[1], 380)];
      app.canvas.ds.scale = 1;
      const rect = app.canvas.canvas.getBoundingClientRect();
      app.canvas.ds.offset = [120, 150]; // clear of the top-right panels (an unconnected input is flagged there)
      app.graph.setDirtyCanvas(true, true);
      return node.id;
    });
    await page.waitForSelector(".anima-train-chart canvas", { timeout: 20000 });
    // the chart must stay out of the saved workflow and out of the prompt sent to the server
    result.saved = await page.evaluate(async () => {
      const app = window.comfyAPI.app.app;
      const node = app.graph.nodes[0];
      const prompt = await app.graphToPrompt();
      return { widgets: node.widgets.map((w) => w.name), widgetsValues: node.serialize().widgets_values,
               promptInputs: Object.keys(prompt.output[String(node.id)]?.inputs ?? {}) };
    });

    const send = (events) => page.evaluate((evs) => {
      for (const ev of evs) window.comfyAPI.api.api.dispatchCustomEvent("anima_train.progress", ev);
    }, events);
    const settle = () => page.evaluate(() => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r))));
    // pixels of the chart canvas: how many differ from its background, and how many are EMA-orange / loss-blue
    const measure = () => page.evaluate(() => {
      const root = document.querySelector(".anima-train-chart");
      const canvas = root.querySelector("canvas");
      const { data } = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height);
      const bg = [data[0], data[1], data[2]];
      let differs = 0, orange = 0, blue = 0, green = 0, magenta = 0, yellow = 0;
      for (let i = 0; i < data.length; i += 4) {
        const [r, g, b] = [data[i], data[i + 1], data[i + 2]];
        if (Math.abs(r - bg[0]) + Math.abs(g - bg[1]) + Math.abs(b - bg[2]) > 24) differs++;
        if (r > 200 && g > 130 && g < 190 && b < 100) orange++;
        if (b > 110 && b - r > 40 && b - g > 20) blue++;
        if (g > 100 && g - r > 40 && g - b > 20) green++;
        if (r > 110 && b > 110 && r - g > 50 && b - g > 50) magenta++;
        if (r > 200 && g > 200 && b < 130) yellow++;
      }
      const status = root.querySelector(".anima-train-chart-status");
      const rect = canvas.getBoundingClientRect();
      return { width: canvas.width, height: canvas.height, cssWidth: rect.width, cssHeight: rect.height,
               visible: rect.width > 0 && rect.height > 0 && getComputedStyle(root).display !== "none",
               background: bg, differs, orange, blue, green, magenta, yellow,
               status: status.innerText, phase: root.dataset.phase, step: root.dataset.step };
    });

    // 0. the first screen, and an event for a node that is not on the canvas: must be ignored without errors
    result.empty = await measure();
    await send([{ node: "987654", event: "start", total: 10 }, { node: "3:987654", event: "step", step: 1, loss: 1 }]);
    await settle();
    result.foreign = await measure();

    // 1. a run with the hf loss: status, start, 120 of 300 steps, a checkpoint
    const id = String(result.nodeId);
    const total = 300;
    const steps = syntheticSteps(total, 120).map((e) => ({ node: id, ...e }));
    // the first part goes the real way: the server's send_sync -> websocket -> api -> our listener
    const relay = (events) => page.evaluate(async ({ url, evs }) => {
      const r = await fetch(url, { method: "POST", body: JSON.stringify(evs) });
      if (!r.ok) throw new Error(`relay ${r.status}`);
    }, { url: cfg.relay, evs: events });
    const waitPhase = (phase, step) => page.waitForFunction(([p, s]) => {
      const root = document.querySelector(".anima-train-chart");
      return root.dataset.phase === p && root.dataset.step === s;
    }, [phase, step], { timeout: 20000, polling: 50 });
    await relay([{ node: id, event: "status", message: "loading model" }]);
    await waitPhase("preparing", "");
    await settle();
    result.preparing = await measure();
    await relay([{ node: id, event: "start", total, steps_per_epoch: 40, epochs: 8, processes: 2,
                   run_dir: "/runs/x", resumed_step: 0 }].concat(steps.slice(0, 60)));
    await waitPhase("running", "60");
    result.relayed = await measure();
    const vals = (from, to) => syntheticValidation(from, to).map((e) => ({ node: id, ...e }));
    await send(vals(0, 60));
    await send(steps.slice(60, 100));
    await send(vals(61, 100));
    await send([{ node: id, event: "checkpoint", path: "/runs/x/anima-step00100.safetensors", step: 100 }]);
    await send(steps.slice(100));
    await send(vals(101, 120));
    await settle();
    result.midRun = await measure();
    result.lastStep = steps[steps.length - 1];
    if (cfg.samples) {
      // [sample] previews as the Train node relays them (thumbnails inline), through the server's websocket
      await relay(cfg.samples.map((e) => ({ node: id, ...e })));
      await page.waitForFunction((n) => {
        const imgs = [...document.querySelectorAll(".anima-train-chart .anima-train-preview")];
        return imgs.length === n && imgs.every((i) => i.complete && i.naturalWidth > 0);
      }, cfg.samples[cfg.samples.length - 1].images.length, { timeout: 20000, polling: 50 });
      await settle();
      result.previews = await page.evaluate(() => {
        const root = document.querySelector(".anima-train-chart");
        const imgs = [...root.querySelectorAll(".anima-train-preview")];
        const canvas = root.querySelector("canvas").getBoundingClientRect();
        return { step: root.dataset.previewStep, titles: imgs.map((i) => i.title),
                 natural: imgs.map((i) => [i.naturalWidth, i.naturalHeight]),
                 shown: imgs.map((i) => { const r = i.getBoundingClientRect(); return [r.width, r.height]; }),
                 canvasHeight: canvas.height };
      });
      result.withPreviews = await measure();
    }
    if (cfg.screenshot) {
      const box = await page.evaluate(() => {
        const app = window.comfyAPI.app.app;
        const node = app.graph.nodes[0];
        const rect = app.canvas.canvas.getBoundingClientRect();
        const { scale, offset } = app.canvas.ds;
        const title = window.LiteGraph.NODE_TITLE_HEIGHT || 30;
        // the node, its title bar and the pack badge above it, with a margin
        return { x: rect.left + (node.pos[0] + offset[0]) * scale - 12,
                 y: rect.top + (node.pos[1] - title + offset[1]) * scale - 36,
                 width: node.size[0] * scale + 24, height: (node.size[1] + title) * scale + 48 };
      });
      await page.screenshot({ path: cfg.screenshot, clip: box });
      await page.screenshot({ path: path.join(cfg.outDir, "page.png") });
    }

    // 2. done
    await send([{ node: id, event: "done", step: total, total, final: "/runs/x/anima.safetensors", seconds: 552.1 }]);
    await settle();
    result.done = await measure();

    // 3. a new run resets the chart; this one has no hf loss (hf null): no mse/hf lines
    await send([{ node: id, event: "start", total: 50, steps_per_epoch: 50, epochs: 1, processes: 1, run_dir: "/runs/y",
                  resumed_step: 0 }]);
    await settle();
    result.reset = await measure();
    await send(syntheticSteps(50, 30, null).map((e) => ({ node: id, ...e })));
    await settle();
    result.noHf = await measure();

    // 3b. a loss with a term the chart was never told of ("edge"): drawn and named as the event names it
    await send([{ node: id, event: "start", total: 50, steps_per_epoch: 50, epochs: 1, processes: 1, run_dir: "/runs/z",
                  resumed_step: 0 }]);
    await send(syntheticSteps(50, 30, "edge").map((e) => ({ node: id, ...e })));
    await settle();
    result.newTerm = await measure();

    // 4. an error
    await send([{ node: id, event: "error", message: "RuntimeError: CUDA out of memory", traceback: "Traceback ..." }]);
    await settle();
    result.error = await measure();

    // 5. a finished run re-used by the node (no training): only a "done" with reused: true
    await send([{ node: id, event: "done", step: 50, total: 50, final: "/runs/y/anima.safetensors", reused: true }]);
    await settle();
    result.reused = await measure();

    // 6. a Train node inside a subgraph: the server names it by its path ("<subgraph node>:<inner node>", the id
    //    graphToPrompt gives it); its chart follows that id although the node is not on the visible canvas
    result.subgraph = await page.evaluate(async () => {
      const app = window.comfyAPI.app.app;
      const api = window.comfyAPI.api.api;
      app.graph.clear();
      app.graph.add(window.LiteGraph.createNode("AnimaTrainTrain"));
      app.graph.convertToSubgraph(new Set(app.graph.nodes));
      const outer = app.graph.nodes[0];
      const inner = outer.subgraph.nodes.find((n) => n.comfyClass === "AnimaTrainTrain");
      const promptIds = Object.keys((await app.graphToPrompt()).output);
      const id = promptIds.find((k) => k.includes(":")) ?? `${outer.id}:${inner.id}`;
      api.dispatchCustomEvent("anima_train.progress", { node: id, event: "start", total: 10, epochs: 1 });
      api.dispatchCustomEvent("anima_train.progress", { node: id, event: "step", step: 3, total: 10, epoch: 1,
                                                         loss: 0.5, lr: [1e-4] });
      await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
      const chart = inner.widgets.find((w) => w.name === "anima_loss_chart")?.chart;
      return { promptIds, id, innerId: inner.id, outerId: outer.id, step: chart?.root.dataset.step ?? null,
               status: chart?.status.innerText ?? null };
    });
  } finally {
    await browser.close();
  }
  fs.writeFileSync(path.join(cfg.outDir, "result.json"), JSON.stringify(result, null, 1));
}

main().catch((err) => {
  console.error(err && err.stack ? err.stack : String(err));
  process.exit(1);
});
