// Drives a real headless Chromium against a running ComfyUI for tests/test_browser_errors.py.
//   node config_error.cjs '<json: {url, chromium, userDataDir, outDir, substitute, typed, waitFor, waitMs}>'
// Builds the graph a user starts with (Training config -> Train), sets the config's `substitute` widget values (a
// bad config), queues it with the Run button's own code (app.queuePrompt) and reports what a user then sees: the
// page's text with the error overlay, the page's text after its "View details" (the Errors panel), the nodes the
// canvas marks as failing, the queue's response and the server's events (`events`). Writes <outDir>/result.json
// and page.png; asserts nothing.
"use strict";
const fs = require("fs");
const path = require("path");
const { launch, openPage, waitForPack, newBlankWorkflow } = require("./comfy_page.cjs");

const cfg = JSON.parse(process.argv[2]);

async function main() {
  const result = { console: [], pageErrors: [] };
  const browser = await launch(cfg, { width: 1600, height: 1000 });
  try {
    const page = await openPage(browser, cfg, result);
    await waitForPack(page, "AnimaTrainConfig");
    await newBlankWorkflow(page);
    // the two nodes a user adds first: Training config -> Train
    result.loaded = await page.evaluate(() => {
      const app = window.comfyAPI.app.app;
      const config = window.LiteGraph.createNode("AnimaTrainConfig");
      const train = window.LiteGraph.createNode("AnimaTrainTrain");
      config.pos = [100, 100]; train.pos = [600, 100];
      app.graph.add(config); app.graph.add(train);
      config.connect(0, train, 0);
      app.canvas.setDirty(true, true);
      return { nodes: app.graph.nodes.length };
    });
    // `substitute` sets values as a loaded workflow does; `typed` enters them as a user typing into a number widget
    // does: the value prompt hands the number to the widget's own setValue (which applies the widget's min/max)
    result.typed = await page.evaluate(({ substitute, typed }) => {
      const app = window.comfyAPI.app.app;
      const seen = {};
      for (const node of app.graph.nodes) {
        for (const [name, value] of Object.entries(substitute[node.type] ?? {})) {
          const widget = node.widgets?.find((w) => w.name === name);
          if (widget) { widget.value = value; widget.callback?.(widget.value); }
        }
        for (const [name, value] of Object.entries(typed[node.type] ?? {})) {
          const widget = node.widgets?.find((w) => w.name === name);
          if (!widget) continue;
          widget.setValue(value, { e: undefined, node, canvas: app.canvas });
          seen[name] = widget.value;
        }
      }
      return seen;
    }, { substitute: { AnimaTrainConfig: cfg.substitute ?? {} }, typed: { AnimaTrainConfig: cfg.typed ?? {} } });
    result.run = await page.evaluate(async (waitMs) => {
      const { app } = window.comfyAPI.app;
      const { api } = window.comfyAPI.api;
      const events = [];
      window.__animaEvents = events;  // read again below: an execution error comes after the queue's answer
      for (const type of ["execution_start", "execution_error"]) {
        api.addEventListener(type, (e) => events.push({ type, detail: e.detail }));
      }
      const queued = [];
      const original = api.queuePrompt.bind(api);
      api.queuePrompt = async (...args) => {
        try { const r = await original(...args); queued.push({ response: r }); return r; }
        catch (e) { queued.push({ error: String(e), response: e.response ?? null }); throw e; }
      };
      const graph = app.graph.nodes.map((n) => n.type);  // what is queued: the two nodes built above, nothing else
      try { await app.queuePrompt(0, 1); } catch (e) { queued.push({ thrown: String(e) }); }
      return { queued, events, graph };
    });
    // `waitFor`: an event the server sends while the graph runs (execution_error: a node that failed running)
    if (cfg.waitFor) {
      await page.waitForFunction((type) => window.__animaEvents.some((e) => e.type === type), cfg.waitFor,
        { timeout: cfg.waitMs ?? 20000, polling: 250 }).catch(() => {});
      await page.waitForTimeout(1500);
    }
    result.events = await page.evaluate(() => window.__animaEvents);
    // the overlay that counts the errors ("1 error found" / "N errors found"), or what is there after waitMs
    await page.waitForFunction(() => /errors? found/.test(document.body.innerText), null,
      { timeout: cfg.waitMs ?? 20000, polling: 250 }).catch(() => {});
    await page.waitForTimeout(500);
    result.overlay = await page.evaluate(() => document.body.innerText);
    const details = page.getByText("View details");
    if (await details.count()) { await details.first().click(); await page.waitForTimeout(1500); }
    result.afterDetails = await page.evaluate(() => document.body.innerText);
    result.nodeErrors = await page.evaluate(() => {
      const app = window.comfyAPI.app.app;
      return app.graph.nodes.filter((n) => n.has_errors).map((n) => ({ id: n.id, type: n.type }));
    });
    await page.screenshot({ path: path.join(cfg.outDir, "page.png") });
  } finally {
    await browser.close();
  }
  fs.writeFileSync(path.join(cfg.outDir, "result.json"), JSON.stringify(result, null, 1));
}

main().catch((err) => { console.error(err && err.stack ? err.stack : String(err)); process.exit(1); });
