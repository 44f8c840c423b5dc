// What every browser driver here starts with: a headless Chromium on a fresh profile, and the test's ComfyUI page
// with its console and page errors collected into the driver's `result`.
"use strict";
const { chromium } = require("playwright-core");

const FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
  "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"];

// a persistent context is how Playwright takes a fresh --user-data-dir (the test passes an empty temp folder)
function launch(cfg, viewport) {
  return chromium.launchPersistentContext(cfg.userDataDir, {
    executablePath: cfg.chromium, headless: true, args: FLAGS, viewport, deviceScaleFactor: cfg.deviceScaleFactor ?? 1,
  });
}

async function openPage(browser, cfg, result) {
  const page = browser.pages()[0] ?? await browser.newPage();
  page.on("console", (m) => result.console.push(`${m.type()}: ${m.text()}`));
  page.on("pageerror", (e) => result.pageErrors.push(String(e)));
  await page.goto(cfg.url, { waitUntil: "domcontentloaded", timeout: 90000 });
  return page;
}

// the app is up: its Vue layer and canvas, the pack's `nodeType` registered, and the start-up workflow on the canvas
// (loading or building a graph earlier races the app's own start-up load)
async function waitForPack(page, nodeType) {
  await page.waitForFunction((type) => {
    const app = window.comfyAPI?.app?.app;
    return app?.vueAppReady && app.canvas && window.LiteGraph?.registered_node_types?.[type] &&
      app.graph?.nodes?.length > 0;
  }, nodeType, { timeout: 90000, polling: 250 });
}

// A new blank workflow (the workflow tabs' "+"), as a user starts one, with the first-run dialogs closed. Clearing the
// start-up workflow's canvas instead keeps that workflow's model list (ComfyUI's default graph), and the frontend's
// missing-model check, re-run later, counted its two models among the errors ("3 errors found", CI under load).
async function newBlankWorkflow(page) {
  await page.evaluate(async () => {
    document.querySelectorAll(".p-dialog-mask, .p-dialog").forEach((e) => e.remove());
    await window.comfyAPI.app.app.extensionManager.command.execute("Comfy.NewBlankWorkflow");
  });
  await page.waitForFunction(() => window.comfyAPI.app.app.graph?.nodes?.length === 0, null,
    { timeout: 30000, polling: 100 });
}

module.exports = { launch, openPage, waitForPack, newBlankWorkflow };
