// Anima Trainer pack: a text widget's label stays readable when its value is long. The frontend (1.47) draws a text
// widget as "label ........ value" and, when both do not fit, cuts the label first: Convert's `tokenizers` would
// read "tok…" beside a repo id, and a user could not tell which input it is. On the pack's nodes the value is cut
// in the middle instead (its start and its end stay: a path's folder and file name), so the label is always whole.
//
// ComfyUI loads every .js in js/ as an extension module; this one only exports, so loading it does nothing.

const PADDING_PX = 85; // what the frontend's text widget keeps free of text: margins, arrows, label-value gap
const ELLIPSIS = "…";

// `value` shortened in the middle to at most `room` px as `measure` measures text; the whole value when it fits.
export function middleEllipsis(value, room, measure) {
  if (measure(value) <= room) return value;
  let lo = 0, hi = value.length; // the number of characters kept, a third from the start, the rest from the end
  while (lo < hi) {
    const mid = Math.ceil((lo + hi) / 2);
    if (measure(cut(value, mid)) <= room) lo = mid;
    else hi = mid - 1;
  }
  return cut(value, lo);
}

function cut(value, keep) {
  const head = Math.floor(keep / 3);
  return value.slice(0, head) + ELLIPSIS + value.slice(value.length - (keep - head));
}

// Give the node's text widgets a display value that leaves room for their label. `context()` returns the canvas's
// 2D context: read while the frontend draws the widget, it carries the font the widget is drawn in.
export function keepLabels(node, context) {
  for (const widget of node.widgets ?? []) {
    if (widget.type !== "text" || widget.element || Object.hasOwn(widget, "_displayValue")) continue;
    Object.defineProperty(widget, "_displayValue", {
      configurable: true,
      get() {
        if (this.computedDisabled) return ""; // linked: the frontend shows no value
        const value = String(this.value ?? "");
        try {
          const ctx = context();
          const width = this.width ?? node.size?.[0];
          if (!ctx || !width) return value;
          const label = ctx.measureText(String(this.displayName ?? this.label ?? this.name ?? "")).width;
          return middleEllipsis(value, width - PADDING_PX - label, (t) => ctx.measureText(t).width);
        } catch {
          return value;
        }
      },
    });
  }
}
