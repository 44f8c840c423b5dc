// Drives a real headless Chromium against a running ComfyUI for tests/test_browser_reports.py.
//   node reports.cjs '<json: {url, chromium, userDataDir, outDir, datasetDir, texts, card}>'
// Places the pack's report nodes side by side in two rows on an empty canvas, each at its size as added, 20 px
// apart, the rows 100 px: Check, Audit, Convert above; Cache, Train, Load anchor below. Check and Audit run for
// real (Run button code); the others get their report the way ComfyUI delivers a node's ui output (onExecuted:
// `texts` by node type, `card` for the anchor). Then reports every node's rectangle and its report box. Writes
// <outDir>/result.json.
"use strict";
const fs = require("fs");
const path = require("path");
const { launch, openPage, waitForPack, newBlankWorkflow } = require("./comfy_page.cjs");

const cfg = JSON.parse(process.argv[2]);
const ROWS = [["AnimaTrainEnvironmentCheck", "AnimaTrainAudit", "AnimaTrainConvert"],
  ["AnimaTrainCache", "AnimaTrainTrain", "AnimaAnchorLoader"]];

async function main() {
  const result = { console: [], pageErrors: [] };
  const browser = await launch(cfg, { width: 1600, height: 1100 });
  try {
    const page = await openPage(browser, cfg, result);
    await waitForPack(page, "AnimaTrainEnvironmentCheck");
    await newBlankWorkflow(page);
    result.before = await page.evaluate(({ rows, datasetDir }) => {
      const app = window.comfyAPI.app.app;
      const title = window.LiteGraph.NODE_TITLE_HEIGHT || 30;
      let y = 40;
      const placed = [];
      for (const row of rows) {
        let x = 20, bottom = y;
        for (const type of row) {
          const node = window.LiteGraph.createNode(type);
          app.graph.add(node);
          node.pos = [x, y + title];
          x += node.size[0] + 20;
          bottom = Math.max(bottom, y + title + node.size[1]);
          placed.push({ id: node.id, type, size: [...node.size] });
        }
        y = bottom + 100; // room for three lines of a report under the row above
      }
      const audit = app.graph.nodes.find((n) => n.type === "AnimaTrainAudit");
      const dir = audit.widgets.find((w) => w.name === "dataset_dir");
      dir.value = datasetDir;
      dir.callback?.(datasetDir);
      app.canvas.ds.scale = 0.9; app.canvas.ds.offset = [10, 10];
      app.canvas.setDirty(true, true);
      return placed;
    }, { rows: ROWS, datasetDir: cfg.datasetDir });

    // Check and Audit run: the prompt holds only output nodes whose inputs are all widgets (Check, Audit)
    result.run = await page.evaluate(async ({ texts, card }) => {
      const { app } = window.comfyAPI.app;
      const { api } = window.comfyAPI.api;
      for (const node of app.graph.nodes) {
        if (texts[node.type]) node.onExecuted?.({ text: [texts[node.type]] });
        if (node.type === "AnimaAnchorLoader") node.onExecuted?.({ anchor_card: [card] });
      }
      const keep = new Set(["AnimaTrainEnvironmentCheck", "AnimaTrainAudit"]);
      const others = app.graph.nodes.filter((n) => !keep.has(n.type));
      for (const node of others) node.mode = 2; // muted (not in the prompt): their inputs are not linked here
      const done = new Promise((resolve) => {
        for (const type of ["execution_success", "execution_error"]) {
          api.addEventListener(type, (e) => resolve({ type, detail: e.detail }));
        }
      });
      await app.queuePrompt(0, 1);
      const end = await Promise.race([done, new Promise((r) => setTimeout(() => r({ type: "timeout" }), 240000))]);
      for (const node of others) node.mode = 0;
      return end;
    }, { texts: cfg.texts, card: cfg.card });
    await page.waitForTimeout(1500); // grown after the text is laid out (two animation frames, then a redraw)
    result.nodes = await page.evaluate(() => {
      const app = window.comfyAPI.app.app;
      const title = window.LiteGraph.NODE_TITLE_HEIGHT || 30;
      const { scale, offset } = app.canvas.ds;
      const rect = app.canvas.canvas.getBoundingClientRect();
      return app.graph.nodes.map((n) => {
        const widget = n.widgets?.find((w) => ["anima_text", "anchor_card"].includes(w.name));
        const el = widget?.element;
        const box = el?.getBoundingClientRect();
        const toGraph = (px, py) => [(px - rect.left) / scale - offset[0], (py - rect.top) / scale - offset[1]];
        return {
          id: n.id, type: n.type, x: n.pos[0], y: n.pos[1] - title, w: n.size[0], h: n.size[1] + title,
          report: el ? { text: el.textContent.length, scrollHeight: el.scrollHeight, clientHeight: el.clientHeight,
                         topLeft: toGraph(box.left, box.top), bottomRight: toGraph(box.right, box.bottom) } : null,
        };
      });
    });
    await page.screenshot({ path: path.join(cfg.outDir, "page.png") });
  } finally {
    await browser.close();
  }
  fs.writeFileSync(path.join(cfg.outDir, "result.json"), JSON.stringify(result, null, 1));
}

main().catch((err) => { console.error(err && err.stack ? err.stack : String(err)); process.exit(1); });
