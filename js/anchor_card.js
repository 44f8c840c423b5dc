// Anima Trainer pack: the usage card of an anchor file, drawn on the "Anima: Load anchor" node after it runs.
// The node sends its card as `ui.anchor_card = [card]` (nodes/nodes_anchor.py). Every value comes from the file's
// metadata, so it is set with textContent only, never parsed as HTML: a file cannot inject markup into the page.
import { app } from "../../scripts/app.js";
import { fitToContent } from "./fit_content.js";

const CARD_MAX_PX = 480; // beyond this the card scrolls

const NODE_ID = "AnimaAnchorLoader";

function el(tag, text, style) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (style) e.style.cssText = style;
  return e;
}

function row(label, value) {
  if (value === undefined || value === null || value === "") return null;
  const line = el("div", null, "margin:1px 0;");
  line.append(el("span", label + ": ", "opacity:0.65;"), el("span", value));
  return line;
}

function list(label, items) {
  if (!Array.isArray(items) || !items.length) return null;
  const box = el("div", null, "margin:3px 0;");
  box.append(el("div", label, "opacity:0.65;"));
  const ul = el("ul", null, "margin:0;padding-left:16px;");
  for (const item of items) ul.append(el("li", item));
  box.append(ul);
  return box;
}

function badge(text, colour) {
  return el("span", text,
    `display:inline-block;margin-left:6px;padding:0 5px;border-radius:3px;font-size:10px;font-weight:bold;` +
    `color:#fff;background:${colour};vertical-align:middle;`);
}

function renderCard(card) {
  const root = el("div", null,
    // a hash or a path has no space to wrap at: overflow-wrap breaks it inside the card, not past the node's edge
    "padding:5px 7px;font:11px/1.35 sans-serif;overflow:auto;height:100%;box-sizing:border-box;border-radius:4px;" +
    "overflow-wrap:anywhere;" +
    "background:var(--comfy-input-bg,#222);color:var(--input-text,#ddd);");
  const title = el("div", null, "font-weight:bold;font-size:12px;margin-bottom:3px;");
  title.append(el("span", card.display_name || "unnamed"));
  if (card.nc) title.append(badge("NON-COMMERCIAL", "#b3261e"));
  if (card.attachable === false) title.append(badge("LOAD-ONLY", "#7a5d00"));
  root.append(title);
  const rows = [
    row("kind", `${card.kind} · ${card.n_sites} sites · ${card.family} · ${card.objective}`),
    row("trunk", card.trunk),
    row("strength", card.strength !== undefined
      ? `${card.strength} (recommended ${card.recommended_strength})` : card.recommended_strength),
    row("usage", card.usage),
    row("evidence", card.evidence),
    list("bands (LOW → HIGH noise)", card.band_roles),
    list("caveats", card.caveats),
    row("license", (card.license || "unknown") + (card.nc ? " (non-commercial)" : "")),
    row("widths", card.widths),
    row("imported from", card.imported_from),
    row("hash", card.content_hash_v2),
    row("file", card.file),
  ];
  for (const r of rows) if (r) root.append(r);
  return root;
}

function showCard(node, card) {
  let widget = node.widgets?.find((w) => w.name === "anchor_card");
  if (!widget) {
    const holder = el("div");
    widget = node.addDOMWidget("anchor_card", "anchor_card", holder, { serialize: false });
    widget.element = holder;
  }
  widget.element.replaceChildren(renderCard(card));
  widget.element.style.height = "100%";
  fitToContent(node, widget, { maxHeight: CARD_MAX_PX });
}

app.registerExtension({
  name: "anima_train.anchor_card",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== NODE_ID) return;
    const previous = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      previous?.apply(this, arguments);
      const cards = message?.anchor_card;
      if (Array.isArray(cards) && cards.length && cards[0]) showCard(this, cards[0]);
    };
  },
});
