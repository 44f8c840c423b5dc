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

const GAP_PX = 10; // kept free between a grown node and its neighbour
const MIN_CONTENT_PX = 3 * LINE_PX + PADDING_PX; // a report squeezed by a neighbour still shows three lines

// The room a node may grow into without covering another node of its graph: {width, height} from its top left
// (graph units, title bar excluded), Infinity where nothing stands in the way. A node to the right (beside its
// rows) caps the width, one below its top edge (within its columns at `width`) the height: below the top, not the
// bottom, so that a node grown as far as its neighbour still counts it on the next fit.
export function roomAround(node, width) {
  if (!node.pos || !node.size) return { width: Infinity, height: Infinity }; // not placed on a canvas yet
  const title = globalThis.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
  const [x, y] = node.pos, [w, h] = node.size;
  let right = Infinity, below = Infinity;
  for (const other of node.graph?._nodes ?? node.graph?.nodes ?? []) {
    if (other === node || !other.pos || !other.size) continue;
    const left = other.pos[0], top = other.pos[1] - title;
    const otherRight = left + other.size[0], otherBottom = other.pos[1] + other.size[1];
    const besideRows = top < y + h && otherBottom > y - title;
    if (left >= x + w && besideRows) right = Math.min(right, left - GAP_PX - x);
    const underColumns = left < x + Math.max(w, width) && otherRight > x;
    if (top > y - title && underColumns) below = Math.min(below, top - GAP_PX - y);
  }
  return { width: right, height: below };
}

// Call after the widget's content changed. `maxWidth` (px, 0 = keep the width): the node widens to the longest
// line of a monospace text, at most this; then the widget's minimum height follows the content (at most
// `maxHeight`) and the node grows to hold it. A node grows only into free space: a neighbour to the right or below
// caps it, and the content scrolls inside. A node never shrinks: a user's larger size stays.
export function fitToContent(node, widget, { maxHeight, maxWidth = 0 }) {
  widget.options ??= {};
  // the frontend places the element inside the widget's height less its margin above and below
  widget.options.getMinHeight = () => (widget.contentHeight ?? 50) + 2 * (widget.margin ?? 10);
  if (maxWidth) {
    const longest = Math.max(...String(widget.element.textContent ?? "").split("\n").map((l) => l.length));
    const wide = Math.min(maxWidth, Math.ceil(longest * CHAR_PX) + PADDING_PX + 2 * (widget.margin ?? 10),
                          roomAround(node, 0).width);
    if (wide > node.size[0]) node.setSize([wide, node.size[1]]);
  }
  const fit = () => {
    widget.contentHeight = Math.min(maxHeight, neededHeight(widget.element));
    const room = roomAround(node, node.size[0]);
    const over = node.computeSize()[1] - Math.max(node.size[1], room.height);
    if (over > 0) widget.contentHeight = Math.max(MIN_CONTENT_PX, widget.contentHeight - over); // it scrolls
    const want = node.computeSize();
    node.setSize([Math.max(node.size[0], want[0]), Math.max(node.size[1], want[1])]);
    node.setDirtyCanvas(true, true);
  };
  fit();
  // again once the browser has laid the new content out at the new width (scrollHeight is then the real one)
  if (typeof requestAnimationFrame === "function") requestAnimationFrame(() => requestAnimationFrame(fit));
}
