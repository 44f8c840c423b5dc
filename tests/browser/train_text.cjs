// Drives a real headless Chromium against a running ComfyUI for tests/test_browser_train_text.py.
//   node train_text.cjs '<json: {url, chromium, userDataDir, outDir, widgets, changed}>'
// Adds "Anima: Training config" -> "Anima: Train" to an empty canvas as a user does, sets the `widgets`, and plays
// three queues with the Run button's code (app.queuePrompt) and the Cancel button's command (Comfy.Interrupt):
//   1. queue, Cancel after a few steps;  2. queue the same graph again (it resumes), Cancel after its first step;
//   3. change the `changed` widgets (another run: its folder is run_name-2), queue, Cancel while it still loads.
// All along, every change of the Train node's status text is logged with the queue events and toasts seen.
// Writes <outDir>/result.json; it asserts nothing itself: the Python test judges.
"use strict";
const fs = require("fs");
const path = require("path");
const { launch, openPage, waitForPack, newBlankWorkflow } = require("./comfy_page.cjs");

const cfg = JSON.parse(process.argv[2]);
const STEP_WAIT_MS = 300000;

async function main() {
  const result = { console: [], pageErrors: [], queues: [] };
  const browser = await launch(cfg, { width: 1400, height: 1000 });
  try {
    const page = await openPage(browser, cfg, result);
    await waitForPack(page, "AnimaTrainTrain");
    await newBlankWorkflow(page);
    result.ids = await page.evaluate((widgets) => {
      const app = window.comfyAPI.app.app;
      const config = window.LiteGraph.createNode("AnimaTrainConfig");
      const train = window.LiteGraph.createNode("AnimaTrainTrain");
      config.pos = [20, 20]; train.pos = [440, 20];
      app.graph.add(config); app.graph.add(train);
      config.connect(0, train, 0);
      for (const [name, value] of Object.entries(widgets)) {
        const widget = config.widgets.find((w) => w.name === name);
        widget.value = value;
        widget.callback?.(value);
      }
      app.canvas.ds.scale = 1; app.canvas.ds.offset = [0, 0];
      app.canvas.setDirty(true, true);
      // the log: each change of the Train node's status text, and what the page got from the queue and toasts
      const log = (window.__animaLog = []);
      const t0 = (window.__animaT0 = performance.now());
      const { api } = window.comfyAPI.api;
      for (const type of ["execution_start", "execution_success", "execution_error", "execution_interrupted"]) {
        api.addEventListener(type, (e) => log.push({ t: performance.now() - t0, queue: type,
                                                     prompt: e.detail?.prompt_id }));
      }
      let last = "";
      setInterval(() => {
        const root = document.querySelector(".anima-train-chart");
        const lines = [...(root?.querySelectorAll(".anima-train-chart-status > div") ?? [])]
          .map((d) => ({ text: d.textContent, kind: d.className.replace("anima-train-status-", "") }));
        const toasts = [...document.querySelectorAll(".p-toast-message")].map((e) => e.innerText.trim());
        const failed = document.body.innerText.includes("Job failed");
        const state = JSON.stringify([lines, root?.dataset.phase, root?.dataset.firstStep, toasts, failed]);
        if (state === last) return;
        last = state;
        log.push({ t: performance.now() - t0, phase: root?.dataset.phase, step: root?.dataset.step,
                   firstStep: root?.dataset.firstStep, lines, toasts, failed });
      }, 40);
      return { config: config.id, train: train.id };
    }, cfg.widgets);

    const mark = (what) => page.evaluate(
      (w) => window.__animaLog.push({ mark: w, t: performance.now() - window.__animaT0 }), what);
    const queue = async (name) => {
      await mark(`queue ${name}`);
      const id = await page.evaluate(async () => {
        const { api } = window.comfyAPI.api;
        const original = api.queuePrompt;
        let promptId = null;
        api.queuePrompt = async function (...args) {
          const response = await original.apply(this, args);
          promptId = response?.prompt_id ?? null;
          return response;
        };
        try {
          await window.comfyAPI.app.app.queuePrompt(0, 1);
        } finally {
          api.queuePrompt = original;
        }
        return promptId;
      });
      result.queues.push({ name, promptId: id });
      return id;
    };
    const waitFor = (fn, arg, timeout = STEP_WAIT_MS) =>
      page.waitForFunction(fn, arg, { timeout, polling: 40 });
    const status = () => page.evaluate(() => {
      const root = document.querySelector(".anima-train-chart");
      return { phase: root?.dataset.phase, text: root?.querySelector(".anima-train-chart-status")?.innerText ?? "" };
    });
    const cancel = async (name) => {
      await page.evaluate((w) => { // the mark in the same task as the press: its time is the press's
        window.__animaLog.push({ mark: w, t: performance.now() - window.__animaT0 });
        return window.comfyAPI.app.app.extensionManager.command.execute("Comfy.Interrupt");
      }, `cancel ${name}`);
      await page.waitForTimeout(250);
      result[`afterCancel_${name}`] = await status();
    };
    const ended = (promptId) => waitFor((id) => window.__animaLog.some((e) => e.prompt === id &&
      ["execution_success", "execution_error", "execution_interrupted"].includes(e.queue)), promptId);
    const settled = () => waitFor(() => document.querySelector(".anima-train-chart")?.dataset.phase !== "cancelling",
      null, 120000);

    // 1. a run, cancelled after a few steps
    const first = await queue("first");
    await waitFor(() => Number(document.querySelector(".anima-train-chart")?.dataset.step || 0) >= 3);
    result.beforeCancel_first = await status();
    await cancel("first");
    await ended(first);
    await settled();
    await page.waitForTimeout(1500);
    result.end_first = await status();

    // 2. the same graph again: it resumes the cancelled run
    const second = await queue("second");
    await waitFor(() => document.querySelector(".anima-train-chart")?.dataset.phase === "running" &&
      Number(document.querySelector(".anima-train-chart")?.dataset.step || 0) > 0);
    result.resumed = await status();
    result.resumedChart = await page.evaluate(() => ({ ...document.querySelector(".anima-train-chart").dataset }));
    await cancel("second");
    await ended(second);
    await settled();
    result.end_second = await status();

    // 3. other inputs, same run_name: a new folder (run_name-2), cancelled while the model loads
    await page.evaluate(({ ids, changed }) => {
      const node = window.comfyAPI.app.app.graph.getNodeById(ids.config);
      for (const [name, value] of Object.entries(changed)) {
        const widget = node.widgets.find((w) => w.name === name);
        widget.value = value;
        widget.callback?.(value);
      }
    }, { ids: result.ids, changed: cfg.changed });
    const third = await queue("third");
    await waitFor(() => /so this one is/.test(document.querySelector(".anima-train-chart-status")?.innerText ?? ""));
    result.noted = await status();
    await cancel("third");
    await ended(third);
    await settled();
    await page.waitForTimeout(1500);
    result.end_third = await status();
  } finally {
    const page = browser.pages()[0];
    result.log = await page?.evaluate(() => window.__animaLog).catch(() => null);
    await page?.screenshot({ path: path.join(cfg.outDir, "page.png") }).catch(() => null);
    await browser.close();
    fs.writeFileSync(path.join(cfg.outDir, "result.json"), JSON.stringify(result, null, 1));
  }
}

main().catch((err) => { console.error(err && err.stack ? err.stack : String(err)); process.exit(1); });
