// Drives a real headless Chromium against a running ComfyUI for tests/test_browser_readable.py.
//   node readable.cjs '<json: {url, chromium, userDataDir, outDir, trainText, screenshot}>'
// Adds the Check node to an empty canvas and runs it (Run button code), and a Train node whose result text is
// delivered the way ComfyUI delivers a node's ui.text (onExecuted); then reports, for each node's text box, how
// much text it holds and how much it shows (scrollHeight vs clientHeight) and whether the box lies inside its node
// on screen. Optionally screenshots the Check node. Writes <outDir>/result.json; asserts nothing itself.
"use strict";
const fs = require("fs");
const path = require("path");
const { launch, openPage, waitForPack, newBlankWorkflow } = require("./comfy_page.cjs");

const cfg = JSON.parse(process.argv[2]);

async function main() {
  const result = { console: [], pageErrors: [] };
  const browser = await launch(cfg, { width: 1600, height: 1100 });
  try {
    const page = await openPage(browser, cfg, result);
    await waitForPack(page, "AnimaTrainEnvironmentCheck");
    await newBlankWorkflow(page);
    result.ids = await page.evaluate(() => {
      const app = window.comfyAPI.app.app;
      const check = window.LiteGraph.createNode("AnimaTrainEnvironmentCheck");
      const train = window.LiteGraph.createNode("AnimaTrainTrain");
      check.pos = [140, 150]; train.pos = [140, 650];
      app.graph.add(check); app.graph.add(train);
      app.canvas.ds.scale = 1; app.canvas.ds.offset = [0, 0];
      app.canvas.setDirty(true, true);
      return { check: check.id, train: train.id };
    });
    // the Check runs for real; the Train node gets a result text as ComfyUI delivers it
    result.run = await page.evaluate(async ({ trainText, ids }) => {
      const { app } = window.comfyAPI.app;
      const { api } = window.comfyAPI.api;
      const train = app.graph.getNodeById(ids.train);
      const done = new Promise((resolve) => {
        for (const type of ["execution_success", "execution_error"]) api.addEventListener(type, (e) => resolve(type));
      });
      await app.queuePrompt(0, 1);
      const end = await Promise.race([done, new Promise((r) => setTimeout(() => r("timeout"), 240000))]);
      train.onExecuted?.({ text: [trainText] }); // after the queue: queueing clears the text of the run before
      return end;
    }, { trainText: cfg.trainText, ids: result.ids });
    await page.waitForTimeout(1500); // the node grows after the text is laid out
    result.boxes = await page.evaluate((ids) => {
      const app = window.comfyAPI.app.app;
      const rect = app.canvas.canvas.getBoundingClientRect();
      const { scale, offset } = app.canvas.ds;
      const title = window.LiteGraph.NODE_TITLE_HEIGHT || 30;
      const out = {};
      for (const [name, id] of Object.entries(ids)) {
        const node = app.graph.getNodeById(id);
        const widget = node.widgets?.find((w) => w.name === "anima_text");
        const el = widget?.element;
        if (!el) { out[name] = null; continue; }
        const box = el.getBoundingClientRect();
        const top = rect.top + (node.pos[1] - title + offset[1]) * scale;
        const bottom = rect.top + (node.pos[1] + node.size[1] + offset[1]) * scale;
        const left = rect.left + (node.pos[0] + offset[0]) * scale;
        out[name] = { nodeLeft: left, nodeRight: left + node.size[0] * scale, text: el.textContent, lines: el.textContent.split("\n").length, scrollHeight: el.scrollHeight,
                      clientHeight: el.clientHeight, boxTop: box.top, boxBottom: box.bottom, nodeTop: top,
                      nodeBottom: bottom, nodeSize: [...node.size] };
      }
      return out;
    }, result.ids);
    if (cfg.screenshot) {
      const b = result.boxes.check;
      if (b) await page.screenshot({ path: cfg.screenshot, clip: { x: Math.max(0, b.nodeLeft - 20),
        y: Math.max(0, b.nodeTop - 20), width: b.nodeRight - b.nodeLeft + 40, height: b.nodeBottom - b.nodeTop + 40 } });
    }
    await page.screenshot({ path: path.join(cfg.outDir, "page.png") });
  } finally {
    await browser.close();
  }
  fs.writeFileSync(path.join(cfg.outDir, "result.json"), JSON.stringify(result, null, 1));
}

main().catch((err) => { console.error(err && err.stack ? err.stack : String(err)); process.exit(1); });
