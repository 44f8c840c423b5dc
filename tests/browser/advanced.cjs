// Drives a real headless Chromium against a running ComfyUI for tests/test_browser_advanced.py.
//   node advanced.cjs '<json: {url, chromium, userDataDir, outDir, module, workflow, node, screenshot, late}>'
// 1. adds a fresh <node> (the Training config) to an empty canvas and reports which widgets the canvas draws, its
//    height and its node menu; optionally screenshots it (the README image);
// 2. right-clicks it and picks the menu's "Show Advanced", as a user does, and reports the same again;
// 3. loads <workflow> the way the Templates menu does, reports the node there, builds the prompt with the advanced
//    inputs hidden, then shows them (the same menu) and builds it again, and saves + reloads the workflow;
// 4. loads <workflow> as saved before the node's last <late> widgets existed (that many values fewer).
// Writes what it saw to <outDir>/result.json; it asserts nothing itself: the Python test judges.
"use strict";
const fs = require("fs");
const path = require("path");
const { launch, openPage, waitForPack, newBlankWorkflow } = require("./comfy_page.cjs");

const cfg = JSON.parse(process.argv[2]);

async function main() {
  const result = { console: [], pageErrors: [] };
  const browser = await launch(cfg, { width: 1280, height: 1100 });
  try {
    const page = await openPage(browser, cfg, result);
    await waitForPack(page, cfg.node);
    const frames = () => page.evaluate(() => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r))));

    // the node as the canvas holds it: widgets with their value and whether the canvas draws them
    const report = (id) => page.evaluate((id) => {
      const app = window.comfyAPI.app.app;
      const node = app.graph.getNodeById(id);
      return {
        id: node.id, height: node.size[1], showAdvanced: !!node.showAdvanced,
        menu: (app.canvas.getNodeMenuOptions(node) ?? []).filter(Boolean).map((o) => o.content),
        widgets: node.widgets.map((w) => ({ name: w.name, value: w.value, advanced: !!w.options?.advanced,
                                            drawn: node.isWidgetVisible(w) })),
      };
    }, id);
    // right-click the node's title bar and pick "Show Advanced" / "Hide Advanced" from the menu that opens
    const toggleFromMenu = async (id, label) => {
      const at = await page.evaluate((id) => {
        const app = window.comfyAPI.app.app;
        const node = app.graph.getNodeById(id);
        const rect = app.canvas.canvas.getBoundingClientRect();
        const { scale, offset } = app.canvas.ds;
        const title = window.LiteGraph.NODE_TITLE_HEIGHT || 30;
        return { x: rect.left + (node.pos[0] + 40 + offset[0]) * scale, y: rect.top + (node.pos[1] - title / 2 + offset[1]) * scale };
      }, id);
      await page.waitForTimeout(500); // the canvas settles after a pan / a load
      await page.mouse.click(at.x, at.y, { button: "right" });
      const item = page.getByText(label, { exact: true }).first();
      await item.waitFor({ state: "visible", timeout: 10000 });
      await item.click();
      await frames();
    };

    // 1. a fresh node in a new blank workflow, at 100% zoom, top left of the canvas
    await newBlankWorkflow(page);
    const id = await page.evaluate((type) => {
      const app = window.comfyAPI.app.app;
      const node = window.LiteGraph.createNode(type);
      app.graph.add(node);
      node.pos = [0, 0];
      app.canvas.ds.scale = 1;
      app.canvas.ds.offset = [360, 140]; // clear of the top-left menu and the top-right panels
      app.graph.setDirtyCanvas(true, true);
      return node.id;
    }, cfg.node);
    await frames();
    result.fresh = await report(id);
    if (cfg.screenshot) {
      await page.waitForTimeout(500); // fonts and the pack badge
      const box = await page.evaluate((id) => {
        const app = window.comfyAPI.app.app;
        const node = app.graph.getNodeById(id);
        const rect = app.canvas.canvas.getBoundingClientRect();
        const { scale, offset } = app.canvas.ds;
        const title = window.LiteGraph.NODE_TITLE_HEIGHT || 30;
        return { x: rect.left + (node.pos[0] + offset[0]) * scale - 12,
                 y: rect.top + (node.pos[1] - title + offset[1]) * scale - 36,
                 width: node.size[0] * scale + 24, height: (node.size[1] + title) * scale + 48 };
      }, id);
      await page.screenshot({ path: cfg.screenshot, clip: box });
    }
    // 2. the user shows the advanced inputs
    await toggleFromMenu(id, "Show Advanced");
    result.freshShown = await report(id);

    // 3. the example workflow, loaded as the Templates menu does
    result.loaded = await page.evaluate(async ({ module, name }) => {
      const app = window.comfyAPI.app.app;
      const response = await fetch(`/api/workflow_templates/${module}/${name}.json`);
      if (!response.ok) return { status: response.status };
      await app.loadGraphData(await response.json(), true, true, name, { openSource: "template" });
      return { status: response.status, nodes: app.graph.nodes.length };
    }, { module: cfg.module, name: cfg.workflow });
    await frames();
    const wid = await page.evaluate((type) => window.comfyAPI.app.app.graph.nodes.find((n) => n.type === type).id,
                                    cfg.node);
    const prompt = () => page.evaluate(async (wid) =>
      (await window.comfyAPI.app.app.graphToPrompt()).output[String(wid)].inputs, wid);
    result.workflow = await report(wid);
    result.workflowPrompt = await prompt();
    await page.evaluate((wid) => { // bring it to the top left so its title bar can be right-clicked
      const app = window.comfyAPI.app.app;
      const node = app.graph.getNodeById(wid);
      app.canvas.ds.scale = 1;
      app.canvas.ds.offset = [360 - node.pos[0], 140 - node.pos[1]];
      app.graph.setDirtyCanvas(true, true);
    }, wid);
    await frames();
    await toggleFromMenu(wid, "Show Advanced");
    result.workflowShown = await report(wid);
    result.workflowShownPrompt = await prompt();
    // saved with the toggle on and loaded again: the toggle and every value come back
    result.reloaded = await page.evaluate(async (wid) => {
      const app = window.comfyAPI.app.app;
      const saved = structuredClone((await app.graphToPrompt()).workflow); // what Save writes
      await app.loadGraphData(saved, true, true, "reloaded");
      const node = app.graph.getNodeById(wid);
      return { savedShowAdvanced: saved.nodes.find((n) => String(n.id) === String(wid))?.showAdvanced ?? null,
               showAdvanced: !!node.showAdvanced, drawn: node.widgets.filter((w) => node.isWidgetVisible(w)).length,
               values: node.widgets.map((w) => w.value) };
    }, wid);
    // 4. a workflow saved before the node's last `late` widgets existed (its <node> holds that many values fewer),
    //    loaded as the Templates menu does: the widgets it gives, and the prompt it queues
    result.older = await page.evaluate(async ({ module, name, type, late }) => {
      const app = window.comfyAPI.app.app;
      const workflow = await (await fetch(`/api/workflow_templates/${module}/${name}.json`)).json();
      const file = workflow.nodes.find((n) => n.type === type);
      file.widgets_values = file.widgets_values.slice(0, file.widgets_values.length - late);
      const fileValues = structuredClone(file.widgets_values);
      await app.loadGraphData(workflow, true, true, "older", { openSource: "template" });
      const node = app.graph.nodes.find((n) => n.type === type);
      return { fileValues, widgets: node.widgets.map((w) => ({ name: w.name, value: w.value })),
               prompt: (await app.graphToPrompt()).output[String(node.id)].inputs };
    }, { module: cfg.module, name: cfg.workflow, type: cfg.node, late: cfg.late ?? 0 });
  } catch (err) {
    result.error = err && err.stack ? err.stack : String(err); // the test shows it with what was measured so far
  } finally {
    await browser.pages()[0]?.screenshot({ path: path.join(cfg.outDir, "page.png") }).catch(() => {});
    await browser.close();
  }
  fs.writeFileSync(path.join(cfg.outDir, "result.json"), JSON.stringify(result, null, 1));
}

main().catch((err) => {
  console.error(err && err.stack ? err.stack : String(err));
  process.exit(1);
});
