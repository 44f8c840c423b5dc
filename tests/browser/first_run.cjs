// Drives a real headless Chromium against a running ComfyUI for tests/test_browser_first_run.py.
//   node first_run.cjs '<json: {url, chromium, userDataDir, outDir, category, template, set, run, stopAtType,
//                               timeoutMs, reconnectWhen}>'
// Plays a user's first run: opens the Templates dialog with the side bar's button, picks the `category` item of its
// Extensions group and clicks the `template` card; reports the view it opens at (zoom, whether the canvas draws
// titles and widgets, every node's box on the screen and whether its corners are visible); sets the `set` widget
// values ({node type: {widget name: value}}, as a user types them), presses Run once (the Run button's command) and
// waits for the prompt (run = false: it stops after the view; stopAtType: it interrupts the prompt once a node of
// one of these types runs), noting the output nodes ComfyUI queued it with. Then it reports what the user sees: the
// error overlay and Errors panel text, the nodes marked as failing, the nodes the server ran, and the text every
// node shows. reconnectWhen (a file): after the view, once the file exists, the page's connection drops and the
// frontend reconnects (`reconnected`: whether it did). Writes <outDir>/result.json and page.png; it asserts nothing
// itself.
"use strict";
const fs = require("fs");
const path = require("path");
const { launch, openPage, waitForPack } = require("./comfy_page.cjs");

const cfg = JSON.parse(process.argv[2]);

async function main() {
  const result = { console: [], pageErrors: [] };
  const browser = await launch(cfg, { width: 1600, height: 1000 });
  try {
    const page = await openPage(browser, cfg, result);
    await waitForPack(page, "AnimaTrainConfig");
    await page.evaluate(() => document.querySelectorAll(".p-dialog-mask, .p-dialog").forEach((e) => e.remove()));

    // Templates -> Extensions -> <category> -> the template's card
    await page.click(".templates-tab-button");
    await page.waitForSelector('[data-testid^="template-workflow-"]', { timeout: 60000 });
    result.categoryFound = await page.evaluate((label) => {
      const item = [...document.querySelectorAll('[role="button"]')].find((b) => b.textContent.trim() === label);
      if (item) item.click();
      return !!item;
    }, cfg.category);
    const card = `[data-testid="template-workflow-${cfg.template}"]`;
    await page.waitForSelector(card, { timeout: 30000 });
    await page.click(card);
    await page.waitForFunction((name) => {
      const app = window.comfyAPI.app.app;
      return app.graph?.nodes?.length > 0 && app.extensionManager.workflow.activeWorkflow?.filename === name &&
        !document.querySelector('[data-testid^="template-workflow-"]');
    }, cfg.template, { timeout: 60000, polling: 250 }).catch(async (e) => {
      await page.screenshot({ path: path.join(cfg.outDir, "not-opened.png") });
      throw e;
    });
    await page.waitForTimeout(1500); // the view is fitted in an animation frame; nodes grow to their widgets

    // the view as it opens: zoom, low-detail mode, and every node's box in CSS pixels with its corners' visibility
    result.view = await page.evaluate(() => {
      const app = window.comfyAPI.app.app;
      const canvas = app.canvas;
      const rect = canvas.canvas.getBoundingClientRect();
      const title = window.LiteGraph.NODE_TITLE_HEIGHT || 30;
      const toScreen = (x, y) => [(x + canvas.ds.offset[0]) * canvas.ds.scale + rect.left,
        (y + canvas.ds.offset[1]) * canvas.ds.scale + rect.top];
      const visible = (x, y) => {
        if (x < 0 || y < 0 || x >= window.innerWidth || y >= window.innerHeight) return false;
        const el = document.elementFromPoint(x, y);
        return el === canvas.canvas || !!el?.closest?.(".dom-widget, .lg-node, .graph-canvas-container canvas");
      };
      return {
        scale: canvas.ds.scale, lowQuality: canvas.low_quality, threshold: canvas.low_quality_zoom_threshold ?? null,
        viewport: [window.innerWidth, window.innerHeight], canvasRect: [rect.left, rect.top, rect.width, rect.height],
        nodes: app.graph.nodes.map((n) => {
          const [x0, y0] = toScreen(n.pos[0], n.pos[1] - title);
          const [x1, y1] = toScreen(n.pos[0] + n.size[0], n.pos[1] + n.size[1]);
          const inset = 3;
          const corners = [[x0 + inset, y0 + inset], [x1 - inset, y0 + inset], [x0 + inset, y1 - inset],
            [x1 - inset, y1 - inset]].map(([x, y]) => visible(x, y));
          return { id: n.id, type: n.type, title: n.title, box: [x0, y0, x1, y1], corners };
        }),
      };
    });
    await page.screenshot({ path: path.join(cfg.outDir, "opened.png") });
    if (cfg.reconnectWhen) { // once that file exists: the connection drops and the frontend reconnects, as a restart
      const deadline = Date.now() + 120000; // of ComfyUI with the page open makes it
      while (!fs.existsSync(cfg.reconnectWhen) && Date.now() < deadline) await page.waitForTimeout(200);
      result.reconnected = await page.evaluate(() => new Promise((resolve) => {
        const { api } = window.comfyAPI.api;
        api.addEventListener("reconnected", () => resolve(true), { once: true });
        setTimeout(() => resolve(false), 30000);
        api.socket.close();
      }));
    }
    if (cfg.run === false) { // the view only
      fs.writeFileSync(path.join(cfg.outDir, "result.json"), JSON.stringify(result, null, 1));
      return;
    }

    result.set = await page.evaluate((set) => {
      const done = [];
      for (const node of window.comfyAPI.app.app.graph.nodes) {
        for (const [name, value] of Object.entries(set[node.type] ?? {})) {
          const widget = node.widgets?.find((w) => w.name === name);
          if (!widget) { done.push({ id: node.id, type: node.type, name, missing: true }); continue; }
          widget.value = value;
          widget.callback?.(widget.value);
          done.push({ id: node.id, type: node.type, name, value: widget.value });
        }
      }
      return done;
    }, cfg.set ?? {});

    // Run, once: the Run button's command; the queue's answer and the prompt's events are recorded
    result.run = await page.evaluate(async ([timeoutMs, stopAtType]) => {
      const { app } = window.comfyAPI.app;
      const { api } = window.comfyAPI.api;
      const events = [];
      for (const type of ["execution_start", "execution_success", "execution_error", "execution_interrupted",
        "executing", "executed", "execution_cached"]) {
        api.addEventListener(type, (e) => events.push({ type, detail: e.detail }));
      }
      const queued = [];
      const original = api.queuePrompt.bind(api);
      api.queuePrompt = async (...args) => {
        try { const r = await original(...args); queued.push({ response: r }); return r; }
        catch (e) { queued.push({ error: String(e), response: e.response ?? null }); throw e; }
      };
      const t0 = performance.now();
      try { await app.extensionManager.command.execute("Comfy.QueuePrompt"); }
      catch (e) { queued.push({ thrown: String(e) }); }
      const deadline = performance.now() + 30000;
      while (!queued.length && performance.now() < deadline) await new Promise((r) => setTimeout(r, 100));
      const promptId = queued[0]?.response?.prompt_id;
      let end = null;
      let outputs = null; // the output nodes ComfyUI runs for the prompt (its queue entry's last element)
      for (let i = 0; promptId && outputs === null && i < 200; i++) {
        const q = await (await fetch("/api/queue")).json();
        const entry = [...q.queue_running, ...q.queue_pending].find((e) => e[1] === promptId);
        if (entry) outputs = entry[4].map(String);
        else if (events.some((e) => e.detail?.prompt_id === promptId && e.type.startsWith("execution_") &&
          e.type !== "execution_start" && e.type !== "execution_cached")) break;
        else await new Promise((r) => setTimeout(r, 100));
      }
      if (promptId && stopAtType) {
        // stop once a node of that type runs: what runs before it is what the test is about
        const started = performance.now();
        const types = Object.fromEntries(app.graph.nodes.map((n) => [String(n.id), n.type]));
        while (performance.now() - started < timeoutMs && !events.some((e) => e.type === "executing" &&
          stopAtType.includes(types[String(e.detail)]))) await new Promise((r) => setTimeout(r, 250));
        await api.interrupt(promptId);
      }
      if (promptId) {
        const ends = ["execution_success", "execution_error", "execution_interrupted"];
        end = await new Promise((resolve) => {
          const started = performance.now();
          const poll = () => {
            const hit = events.find((e) => ends.includes(e.type) && e.detail?.prompt_id === promptId);
            if (hit) resolve(hit);
            else if (performance.now() - started > timeoutMs) resolve({ type: "timeout" });
            else setTimeout(poll, 250);
          };
          poll();
        });
      }
      // the api hands an "executing" event on as the node's id alone (null at the end); one prompt runs here
      const ran = [...new Set(events.filter((e) => e.type === "executing" && e.detail != null)
        .map((e) => String(e.detail)))];
      return { queued, promptId, outputs, end, ran, seconds: (performance.now() - t0) / 1000 };
    }, [cfg.timeoutMs ?? 900000, cfg.stopAtType ?? null]);
    await page.waitForTimeout(1500);

    // what the user reads: the overlay ("N errors found"), the Errors panel behind "View details", each node's text
    result.overlay = await page.evaluate(() => document.body.innerText);
    const details = page.getByText("View details");
    if (await details.count()) { await details.first().click(); await page.waitForTimeout(1500); }
    result.afterDetails = await page.evaluate(() => document.body.innerText);
    result.nodes = await page.evaluate(() => window.comfyAPI.app.app.graph.nodes.map((n) => ({
      id: n.id, type: n.type, title: n.title, hasErrors: !!n.has_errors,
      texts: (n.widgets ?? []).filter((w) => w.element && w.options?.serialize === false || w.name === "anima_text")
        .map((w) => w.element?.innerText ?? String(w.value ?? "")),
    })));
    result.lastNodeErrors = await page.evaluate(() => window.comfyAPI.app.app.lastNodeErrors ?? null);
    await page.screenshot({ path: path.join(cfg.outDir, "page.png") });
  } finally {
    await browser.close();
  }
  fs.writeFileSync(path.join(cfg.outDir, "result.json"), JSON.stringify(result, null, 1));
}

main().catch((err) => { console.error(err && err.stack ? err.stack : String(err)); process.exit(1); });
