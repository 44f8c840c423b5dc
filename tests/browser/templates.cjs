// Drives a real headless Chromium against a running ComfyUI for tests/test_browser_templates.py.
//   node templates.cjs '<json: {url, chromium, userDataDir, outDir, shot, extensionsTitle}>'
// Opens the Templates browser as a user does (the side bar's Templates button), reads the labels of the group titled
// `extensionsTitle` ("Extensions" in English) of its left panel, clicks each, and reads the page title and every
// template card shown (title, description, whether its picture loaded). Writes what it saw to <outDir>/result.json,
// the dialog to <outDir>/templates-<i>.png (the first also to `shot` when set); it asserts nothing itself.
"use strict";
const fs = require("fs");
const path = require("path");
const { launch, openPage, waitForPack } = require("./comfy_page.cjs");

const cfg = JSON.parse(process.argv[2]);

async function main() {
  const result = { console: [], pageErrors: [], extensions: [] };
  const browser = await launch(cfg, { width: 1600, height: 1000 });
  try {
    const page = await openPage(browser, cfg, result);
    await waitForPack(page, "AnimaTrainConfig");
    await page.evaluate(() => document.querySelectorAll(".p-dialog-mask, .p-dialog").forEach((e) => e.remove()));
    await page.click(".templates-tab-button");
    await page.waitForSelector('[data-testid^="template-workflow-"]', { timeout: 60000 });

    // the left panel's group titled "Extensions" in the UI's language (NavTitle's <h3>) and its items (NavItem: role=button)
    const groupItems = () => page.evaluate((name) => {
      const title = [...document.querySelectorAll("h3")].find((h) => h.textContent.trim() === name);
      const group = title?.parentElement?.parentElement;
      return group ? [...group.querySelectorAll('[role="button"]')].map((b) => b.textContent.trim()) : null;
    }, cfg.extensionsTitle);
    result.extensionLabels = await groupItems();
    for (const [i, label] of (result.extensionLabels ?? []).entries()) {
      await page.evaluate(([name, index]) => {
        const title = [...document.querySelectorAll("h3")].find((h) => h.textContent.trim() === name);
        title.parentElement.parentElement.querySelectorAll('[role="button"]')[index].click();
      }, [cfg.extensionsTitle, i]);
      await page.waitForTimeout(500);
      await page.waitForFunction(() => [...document.querySelectorAll('[data-testid^="template-workflow-"] img')]
        .every((img) => img.complete), null, { timeout: 30000 });
      const shown = await page.evaluate(() => ({
        pageTitle: [...document.querySelectorAll("div.text-2xl > span")].map((s) => s.textContent.trim()),
        cards: [...document.querySelectorAll('[data-testid^="template-workflow-"]')].map((card) => ({
          name: card.dataset.testid.replace("template-workflow-", ""),
          title: card.querySelector("h3")?.textContent.trim() ?? null,
          description: card.querySelector("p")?.textContent.trim() ?? null,
          pictures: [...card.querySelectorAll("img")].map((img) => ({
            src: img.getAttribute("src"), width: img.naturalWidth, height: img.naturalHeight,
          })),
        })),
      }));
      result.extensions.push({ label, ...shown });
      const shot = path.join(cfg.outDir, `templates-${i}.png`);
      await page.screenshot({ path: shot });
      if (cfg.shot && i === 0) fs.copyFileSync(shot, cfg.shot);
    }
  } finally {
    await browser.close();
  }
  fs.writeFileSync(path.join(cfg.outDir, "result.json"), JSON.stringify(result, null, 1));
}

main().catch((err) => {
  console.error(err && err.stack ? err.stack : String(err));
  process.exit(1);
});
