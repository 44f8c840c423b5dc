// Drives a real headless Chromium against a running ComfyUI for tests/test_browser_workflows.py.
//   node workflows.cjs '<json: {url, chromium, userDataDir, outDir, module, name, substitute, timeoutMs}>'
// Loads one example workflow the way the Templates menu does (GET /api/workflow_templates/<module>/<name>.json, then
// app.loadGraphData(json, true, true, name)), reads back every widget of every node as the UI holds it and the
// workflow the UI would save, sets the `substitute` widget values ({node type: {widget name: value}}: tiny models,
// small sizes), queues with the Queue button's own code (app.queuePrompt) and waits for the prompt to finish.
// Writes what it saw to <outDir>/result.json; it asserts nothing itself: the Python test judges.
"use strict";
const fs = require("fs");
const path = require("path");
const { launch, openPage } = require("./comfy_page.cjs");

const cfg = JSON.parse(process.argv[2]);

async function main() {
  const result = { console: [], pageErrors: [] };
  const browser = await launch(cfg, { width: 1600, height: 1000 });
  try {
    const page = await openPage(browser, cfg, result);
    // ready: the pack's nodes and extension are registered and the start-up workflow is on the canvas (loading
    // one earlier races the app's own start-up load, and the canvas store is not set yet)
    await page.waitForFunction(() => {
      const app = window.comfyAPI?.app?.app;
      return app?.vueAppReady && app.canvas && window.LiteGraph?.registered_node_types?.AnimaTrainConfig &&
        window.comfyAPI.api.api._registered?.has("anima_train.progress") && app.graph?.nodes?.length > 0;
    }, null, { timeout: 90000, polling: 250 });

    // what the UI shows: every widget of every node, in order. inWorkflow: saved in widgets_values (display-only
    // widgets are not); inPrompt: sent to the server (a "control after generate" value is saved but not sent)
    const readBack = () => page.evaluate(() => window.comfyAPI.app.app.graph.nodes.map((node) => ({
      id: node.id, type: node.type,
      widgets: (node.widgets ?? []).map((w) => ({
        name: w.name, type: w.type, value: w.value,
        inWorkflow: w.serialize !== false, inPrompt: w.options?.serialize !== false,
      })),
    })));

    result.loaded = await page.evaluate(async ({ module, name }) => {
      document.querySelectorAll(".p-dialog-mask, .p-dialog").forEach((e) => e.remove()); // first-run dialogs
      const app = window.comfyAPI.app.app;
      const response = await fetch(`/api/workflow_templates/${module}/${name}.json`);
      if (!response.ok) return { status: response.status };
      const json = await response.json();
      await app.loadGraphData(json, true, true, name, { openSource: "template" });
      return { status: response.status, nodes: app.graph.nodes.length };
    }, { module: cfg.module, name: cfg.name });
    await page.evaluate(() => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r))));
    result.shown = await readBack();
    if (cfg.thumbnail) {
      // the Templates browser's picture of this template: the whole graph as loaded, framed clear of the side bar,
      // the tabs and the minimap, and cut out of the page
      const clip = await page.evaluate(() => {
        document.querySelectorAll(".p-dialog-mask, .p-dialog").forEach((e) => e.remove());
        const app = window.comfyAPI.app.app;
        const nodes = app.graph.nodes;
        const title = window.LiteGraph.NODE_TITLE_HEIGHT || 30;
        const x0 = Math.min(...nodes.map((n) => n.pos[0])), y0 = Math.min(...nodes.map((n) => n.pos[1] - title));
        const x1 = Math.max(...nodes.map((n) => n.pos[0] + n.size[0]));
        const y1 = Math.max(...nodes.map((n) => n.pos[1] + n.size[1]));
        const rect = app.canvas.canvas.getBoundingClientRect();
        const at = { x: 90, y: 130 }; // screen point of the graph's top left
        const scale = Math.min((rect.width - at.x - 340) / (x1 - x0), (rect.height - at.y - 40) / (y1 - y0), 1);
        app.canvas.ds.scale = scale;
        app.canvas.ds.offset = [(at.x - rect.left) / scale - x0, (at.y - rect.top) / scale - y0];
        app.canvas.min_font_size_for_lod = 0; // draw the titles and widgets at this zoom too (no low-detail mode)
        app.canvas.setDirty(true, true);
        return { x: at.x - 16, y: at.y - 16, width: (x1 - x0) * scale + 32, height: (y1 - y0) * scale + 32 };
      });
      await page.waitForTimeout(800);
      await page.screenshot({ path: cfg.thumbnail, type: "jpeg", quality: 85, clip });
    }
    // the workflow the UI would save right now (Save / export): must be the file it loaded
    result.saved = await page.evaluate(() => window.comfyAPI.app.app.graph.serialize().nodes
      .map((n) => ({ id: n.id, type: n.type, widgets_values: n.widgets_values ?? null })));

    // tiny models and small sizes, set on the widgets as a user would type them
    result.substituted = await page.evaluate((substitute) => {
      const done = [];
      for (const node of window.comfyAPI.app.app.graph.nodes) {
        for (const [name, value] of Object.entries(substitute[node.type] ?? {})) {
          const widget = node.widgets?.find((w) => w.name === name);
          if (!widget) { done.push({ id: node.id, type: node.type, name, missing: true }); continue; }
          widget.value = value;
          widget.callback?.(widget.value);
          done.push({ id: node.id, type: node.type, name, value: widget.value });
        }
      }
      return done;
    }, cfg.substitute ?? {});

    // queue with the Queue button's code path; the prompt id comes back from the api call it makes
    result.run = await page.evaluate(async (timeoutMs) => {
      const { app } = window.comfyAPI.app;
      const { api } = window.comfyAPI.api;
      const events = [];
      for (const type of ["execution_start", "execution_success", "execution_error", "execution_interrupted",
        "executed", "execution_cached"]) {
        api.addEventListener(type, (e) => events.push({ type, detail: e.detail }));
      }
      const queued = [];
      const original = api.queuePrompt.bind(api);
      api.queuePrompt = async (...args) => {
        try {
          const response = await original(...args);
          queued.push({ response, prompt: args[1].output });
          return response;
        } catch (e) {
          queued.push({ error: String(e), response: e.response ?? null, prompt: args[1].output });
          throw e;
        }
      };
      const t0 = performance.now();
      await app.queuePrompt(0, 1);
      const promptId = queued[0]?.response?.prompt_id;
      if (!promptId) return { queued, events, seconds: (performance.now() - t0) / 1000 };
      const ends = ["execution_success", "execution_error", "execution_interrupted"];
      const end = await new Promise((resolve) => {
        const started = performance.now();
        const poll = () => {
          const hit = events.find((e) => ends.includes(e.type) && e.detail?.prompt_id === promptId);
          if (hit) resolve(hit);
          else if (performance.now() - started > timeoutMs) resolve({ type: "timeout" });
          else setTimeout(poll, 200);
        };
        poll();
      });
      return { promptId, queued, end, seconds: (performance.now() - t0) / 1000,
               events: events.filter((e) => e.detail?.prompt_id === promptId) };
    }, cfg.timeoutMs ?? 600000);
    await page.waitForTimeout(1000); // a node that grew to its new content (a usage card) is laid out again
    // where every node and every text/card widget of ours lies on the canvas after the run (graph coordinates)
    result.layout = await page.evaluate(() => window.comfyAPI.app.app.graph.nodes.map((n) => {
      const title = window.LiteGraph.NODE_TITLE_HEIGHT || 30;
      const ours = (n.widgets ?? []).filter((w) => ["anchor_card", "anima_text"].includes(w.name))
        .map((w) => ({ name: w.name, y: n.pos[1] + (w.last_y ?? w.y ?? 0), height: w.computedHeight ?? null,
                       scrolls: w.element ? w.element.scrollHeight > w.element.clientHeight + 1 : null,
                       // a line wider than its box (a hash, a path): cut at the node's right edge
                       cutRight: w.element ? [w.element, ...w.element.querySelectorAll("*")]
                         .some((e) => e.scrollWidth > e.clientWidth + 1 && e.clientWidth > 0) : null }));
      return { id: n.id, type: n.type, typeTitle: window.LiteGraph.registered_node_types[n.type]?.title ?? null, x: n.pos[0], y: n.pos[1] - title, w: n.size[0], h: n.size[1] + title,
               widgets: ours };
    }));
    // every text widget of the pack drawn with its whole label: the frontend cuts the label ("tok…") when label and
    // value do not fit (its drawTruncatingText: label + gap + value <= width - 2 margins - paddings), so this asks
    // that question of each widget as it is drawn
    result.labels = await page.evaluate(async () => {
      const app = window.comfyAPI.app.app;
      const seen = [];
      for (const node of app.graph.nodes.filter((n) => n.type.startsWith("Anima"))) {
        for (const widget of node.widgets ?? []) {
          if (widget.type !== "text" || widget.element || typeof widget.drawTruncatingText !== "function") continue;
          const draw = widget.drawTruncatingText;
          widget.drawTruncatingText = function (args) {
            const { ctx, width, leftPadding = 5, rightPadding = 20 } = args;
            const label = String(this.displayName ?? this.name), value = String(this._displayValue ?? "");
            const room = width - (2 * 15 + leftPadding) - 2 * 15 - rightPadding;
            seen.push({ node: node.type, widget: this.name, label, value,
                        fits: ctx.measureText(label).width + 5 + ctx.measureText(value).width <= room });
            widget.drawTruncatingText = draw;
            return draw.call(this, args);
          };
        }
      }
      app.canvas.min_font_size_for_lod = 0; // widgets drawn in full at any zoom
      app.canvas.setDirty(true, true);
      await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(() => setTimeout(r, 300))));
      return seen;
    });
    if (cfg.screenshot) {
      // the README's "First run in ComfyUI" picture: the finished run, the whole graph framed as the thumbnail is
      const clip = await page.evaluate(() => {
        document.querySelectorAll(".p-dialog-mask, .p-dialog").forEach((e) => e.remove());
        const app = window.comfyAPI.app.app;
        const nodes = app.graph.nodes;
        const title = window.LiteGraph.NODE_TITLE_HEIGHT || 30;
        const x0 = Math.min(...nodes.map((n) => n.pos[0])), y0 = Math.min(...nodes.map((n) => n.pos[1] - title));
        const x1 = Math.max(...nodes.map((n) => n.pos[0] + n.size[0]));
        const y1 = Math.max(...nodes.map((n) => n.pos[1] + n.size[1]));
        const rect = app.canvas.canvas.getBoundingClientRect();
        const at = { x: 70, y: 110 };
        const scale = Math.min((rect.width - at.x - 60) / (x1 - x0), (rect.height - at.y - 20) / (y1 - y0), 1);
        app.canvas.ds.scale = scale;
        app.canvas.ds.offset = [(at.x - rect.left) / scale - x0, (at.y - rect.top) / scale - y0];
        app.canvas.min_font_size_for_lod = 0;
        app.canvas.setDirty(true, true);
        return { x: at.x - 12, y: at.y - 12, width: (x1 - x0) * scale + 24, height: (y1 - y0) * scale + 24 };
      });
      // the frontend's "Job completed" banner lies over the graph's top right corner for a few seconds
      await page.waitForFunction(() => !document.body.innerText.includes("Job completed"), null,
        { timeout: 30000, polling: 250 }).catch(() => null);
      await page.waitForTimeout(1000);
      await page.screenshot({ path: cfg.screenshot, clip });
    }
    await page.screenshot({ path: path.join(cfg.outDir, "page.png") });
  } finally {
    await browser.close();
  }
  fs.writeFileSync(path.join(cfg.outDir, "result.json"), JSON.stringify(result, null, 1));
}

main().catch((err) => {
  console.error(err && err.stack ? err.stack : String(err));
  process.exit(1);
});
