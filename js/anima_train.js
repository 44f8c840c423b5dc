// Anima Trainer pack: front-end extension.
// ComfyUI delivers a node's `ui.text` but draws it only for its own text nodes; this shows it on ours.
import { app } from "../../scripts/app.js";

const PACK_NODE_PREFIXES = ["AnimaTrain", "AnimaLoad", "AnimaAnchor"];

function isOurs(nodeData) {
  return PACK_NODE_PREFIXES.some((p) => (nodeData?.name || "").startsWith(p));
}

function showText(node, text) {
  let widget = node.widgets?.find((w) => w.name === "anima_text");
  if (!widget) {
    const el = document.createElement("pre");
    el.className = "anima-train-text";
    el.style.cssText =
      "margin:0;padding:4px 6px;font:11px/1.35 monospace;white-space:pre-wrap;overflow:auto;" +
      "max-height:320px;background:var(--comfy-input-bg,#222);color:var(--input-text,#ddd);border-radius:4px;";
    widget = node.addDOMWidget("anima_text", "anima_text", el, { serialize: false });
    widget.element = el;
  }
  widget.element.textContent = text;
  node.setDirtyCanvas(true, true);
}

app.registerExtension({
  name: "anima_train.ui",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!isOurs(nodeData)) return;
    const previous = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      previous?.apply(this, arguments);
      const text = message?.text;
      if (text && text.length) showText(this, Array.isArray(text) ? text.join("\n") : String(text));
    };
  },
});
