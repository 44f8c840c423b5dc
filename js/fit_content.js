// Anima Trainer pack: a DOM widget that grows its node to show all of its content (a report, a result text, a
// usage card), up to a cap beyond which it scrolls. ComfyUI lays a DOM widget out at its minimum height (about
// three lines of text by default) and keeps the node as narrow as its title, so the Check node's 20-line report
// showed 2 lines, each wrapped many times, until the user resized the node.
//
// ComfyUI loads every .js in js/ as an extension module; this one only exports, so loading it does nothing.

const LINE_PX = 15; // 11px text at line-height 1.35, rounded up
const CHAR_PX = 6.7; // one character of 11px monospace
const PADDING_PX = 16;

// The height `widget.element` needs at its current width: its rendered content (or that of the one box inside it
// that scrolls), or, not laid out yet (e.g. off screen), the text's lines.
function neededHeight(element) {
  const lines = String(element.textContent ?? "").split("\n").length;
  const inner = element.firstElementChild?.scrollHeight || 0;
  return Math.max(element.scrollHeight || 0, inner, lines * LINE_PX + PADDING_PX);
}

// Call after the widget's content changed. `maxWidth` (px, 0 = keep the width): the node widens to the longest
// line of a monospace text, at most this; then the widget's minimum height follows the content (at most
// `maxHeight`) and the node grows to hold it. A node never shrinks: a user's larger size stays.
export function fitToContent(node, widget, { maxHeight, maxWidth = 0 }) {
  widget.options ??= {};
  // the frontend places the element inside the widget's height less its margin above and below
  widget.options.getMinHeight = () => (widget.contentHeight ?? 50) + 2 * (widget.margin ?? 10);
  if (maxWidth) {
    const longest = Math.max(...String(widget.element.textContent ?? "").split("\n").map((l) => l.length));
    const wide = Math.min(maxWidth, Math.ceil(longest * CHAR_PX) + PADDING_PX + 2 * (widget.margin ?? 10));
    if (wide > node.size[0]) node.setSize([wide, node.size[1]]);
  }
  const fit = () => {
    widget.contentHeight = Math.min(maxHeight, neededHeight(widget.element));
    const want = node.computeSize();
    node.setSize([Math.max(node.size[0], want[0]), Math.max(node.size[1], want[1])]);
    node.setDirtyCanvas(true, true);
  };
  fit();
  // again once the browser has laid the new content out at the new width (scrollHeight is then the real one)
  if (typeof requestAnimationFrame === "function") requestAnimationFrame(() => requestAnimationFrame(fit));
}
