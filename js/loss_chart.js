// Anima Trainer pack: the live loss chart of the "Anima: Train" node — state and drawing, no ComfyUI imports.
//
// The Train node relays every trainer event (anima_train/outputs/progress.py) as the websocket message
// `anima_train.progress` = {node, prompt_id, event, ...}; js/anima_train.js feeds them to applyEvent() and draws the
// result with drawChart() and statusLines(). Plain <canvas> 2D, no libraries. Every string that comes from the server
// (paths, messages) is only ever put into textContent or fillText, never into markup.
//
// ComfyUI loads every .js in js/ as an extension module; this one only exports, so loading it does nothing.

export const EMA_BETA = 0.95; // = anima_train/outputs/plot.py LOSS_EMA_BETA (one definition; tests/test_plot.py holds them equal)
const MAX_POINTS = 200000; // beyond this, every second point is dropped (the chart is a few hundred px wide)

const COLOURS = {
  background: "#161a1f",
  grid: "rgba(255,255,255,0.08)",
  axis: "rgba(255,255,255,0.45)",
  loss: "rgba(120,170,255,0.85)",
  ema: "#ffa63d",
  validation: "#f2e34c", // yellow: apart from the EMA orange and the loss blue on the dark chart
};

// The colours of the loss's terms, in the order a run first reports them. The terms come by name in the `step`
// event's "terms" (the loss function's names, anima_train/training/flow.py LOSS_TERMS), only when the loss has two or
// more: the chart draws whatever terms a run reports, so a new term needs nothing here.
const TERM_COLOURS = ["rgba(90,205,130,0.6)", "rgba(215,110,225,0.85)", "rgba(90,200,220,0.75)", "rgba(230,120,110,0.8)"];

export function newRun() {
  return {
    phase: "idle", // idle | queued | preparing | running | cancelling | done | cancelled | error
    steps: [], loss: [], ema: [],
    parts: {}, // a series per loss term, by name, in the order the run first reported them (one value per step)
    emaAcc: 0, emaCount: 0,
    valSteps: [], valLoss: [], valMargin: [], // [validation]: the held-out loss and caption margin ("validation")
    total: null, epochs: null, stepsPerEpoch: null, processes: null, resumedStep: 0, chartFrom: null, device: "",
    last: null, // the latest step event
    note: "", // latest status / message / checkpoint line
    runNote: "", // what the node says of the run as a whole (the "-2" run name, a resume): shown all along
    warnings: [], // the trainer's dataset warnings ("warning" events), shown until the next run
    samples: null, // the latest preview set: {step, images: [data URL], prompts: [text]} ("samples" events)
    done: null, error: null, cancelled: null,
  };
}

// One loss point (a step event: its loss and its terms by name), with the bias-corrected EMA (no ramp up from 0)
function addPoint(run, ev) {
  run.emaAcc = EMA_BETA * run.emaAcc + (1 - EMA_BETA) * ev.loss;
  run.emaCount += 1;
  run.steps.push(ev.step);
  run.loss.push(ev.loss);
  run.ema.push(run.emaAcc / (1 - Math.pow(EMA_BETA, run.emaCount)));
  const terms = termsOf(ev);
  for (const name of Object.keys(terms)) { // a term first seen now: NaN for the steps before it
    if (!run.parts[name]) run.parts[name] = new Array(run.steps.length - 1).fill(NaN);
  }
  for (const [name, series] of Object.entries(run.parts)) series.push(finite(terms[name]) ? terms[name] : NaN);
  if (run.steps.length > MAX_POINTS) {
    const half = (series) => series.filter((_, i) => i % 2 === 1);
    for (const k of ["steps", "loss", "ema"]) run[k] = half(run[k]);
    for (const name of Object.keys(run.parts)) run.parts[name] = half(run.parts[name]);
  }
}

// A step event's loss terms, {name: value}, the finite ones only
function termsOf(ev) {
  const terms = ev && typeof ev.terms === "object" && ev.terms !== null ? ev.terms : {};
  return Object.fromEntries(Object.entries(terms).filter(([, value]) => finite(value)));
}

// The loss terms this run reports (those with a value), in the order it first reported them: [name, colour, series]
function reportedParts(run) {
  return Object.entries(run.parts).map(([name, series], i) => [name, TERM_COLOURS[i % TERM_COLOURS.length], series])
    .filter(([, , series]) => series.some(finite));
}

const SHOWN_WARNINGS = 5; // more are summarised in one line (the node's result text and the log list them all)

const finite = (v) => typeof v === "number" && Number.isFinite(v);

// A run queued by this page, before the server says anything of it: the node's text of the run before no longer
// describes it (js/anima_train.js makes one per Train node of a queued prompt).
export function queuedRun() {
  return Object.assign(newRun(), { phase: "queued", note: "queued: waiting for the nodes before it" });
}

// The node started: its worker is being started and loads the data and model before the first step.
export function startedRun(run) {
  if (run && run.phase !== "queued" && run.phase !== "idle") return run;
  return Object.assign(run ?? newRun(), { phase: "preparing", note: "loading: starting the training worker…" });
}

// Cancel pressed (js/anima_train.js wraps the frontend's interrupt): said at once; the worker finishes its step and
// saves, then the node's "cancelled" event gives the final text. Steps and a "done" after this keep the phase.
export function cancellingRun(run) {
  if (!run || !["queued", "preparing", "running"].includes(run.phase)) return run;
  run.phase = "cancelling";
  const step = run.last?.step;
  run.note = finite(step) ? `cancelled at step ${step} of ${run.total ?? "?"}: saving the weights so far…`
    : "cancelled before the first step: nothing is trained or saved";
  return run;
}

// One trainer event in, the run state out. A new run (a "start", or a "status" after a finished run) starts
// from a fresh state so the chart resets; anything unknown is ignored, so a newer trainer cannot break the page.
export function applyEvent(run, ev) {
  if (!ev || typeof ev !== "object") return run;
  run = run || newRun();
  const finished = run.phase === "done" || run.phase === "error" || run.phase === "cancelled";
  const fresh = () => Object.assign(newRun(), { runNote: run.runNote }); // the note was said before the run began
  switch (ev.event) {
    case "run_note": // run_picking.pick_run: which folder this run trains in, and why (said before the worker starts)
      run = startedRun(finished ? newRun() : run);
      run.runNote = String(ev.text ?? "");
      break;
    case "status":
      if (finished) run = newRun();
      if (run.phase === "idle" || run.phase === "queued") run.phase = "preparing";
      if (run.phase !== "cancelling") run.note = String(ev.message ?? "");
      break;
    case "start": {
      const warnings = finished ? [] : run.warnings; // sent while the data was scanned, before "start"
      const cancelling = run.phase === "cancelling" ? run.note : "";
      run = finished ? newRun() : fresh();
      run.warnings = warnings;
      run.phase = cancelling ? "cancelling" : "running";
      run.device = String(ev.device ?? "");
      run.total = finite(ev.total) ? ev.total : null;
      run.epochs = finite(ev.epochs) ? ev.epochs : null;
      run.stepsPerEpoch = finite(ev.steps_per_epoch) ? ev.steps_per_epoch : null;
      run.processes = finite(ev.processes) ? ev.processes : null;
      run.resumedStep = finite(ev.resumed_step) ? ev.resumed_step : 0;
      run.note = cancelling || (run.resumedStep ? `resumed at step ${run.resumedStep}` : "started");
      // a resumed run's losses before it: the chart draws the whole run, not only what this worker trains
      const earlier = Array.isArray(ev.losses) ? ev.losses : [];
      const first = finite(ev.first_loss_step) ? ev.first_loss_step : run.resumedStep + 1;
      earlier.forEach((loss, i) => { if (finite(loss)) addPoint(run, { step: first + i, loss }); });
      if (earlier.length) run.chartFrom = first - 1;
      break;
    }
    case "step": {
      if (finished) run = newRun();
      if (run.phase !== "cancelling") run.phase = "running"; // the step in progress at Cancel still arrives
      if (finite(ev.total)) run.total = ev.total;
      if (!finite(ev.step) || !finite(ev.loss)) { run.last = ev; break; }
      // a page opened mid-run gets its first point here; a step that goes back means a restarted run
      const lastStep = run.steps.length ? run.steps[run.steps.length - 1] : -Infinity;
      if (ev.step <= lastStep) {
        const keep = { total: run.total, epochs: run.epochs, processes: run.processes, device: run.device,
                       runNote: run.runNote, phase: run.phase };
        run = Object.assign(newRun(), keep, { resumedStep: ev.step - 1 });
      }
      addPoint(run, ev);
      run.last = ev;
      break;
    }
    case "message":
      if (run.phase !== "cancelling") run.note = String(ev.text ?? "");
      break;
    case "warning":
      if (finished) run = newRun();
      if (run.phase === "idle") run.phase = "preparing";
      run.warnings.push(String(ev.text ?? ""));
      break;
    case "checkpoint":
      if (run.phase !== "cancelling") run.note = `saved step ${ev.step}: ${ev.path}`;
      break;
    case "validation": // the fixed evaluation on held-out images (anima_train/training/validation.py)
      if (finite(ev.step) && finite(ev.loss)) {
        if (run.valSteps.length && ev.step <= run.valSteps[run.valSteps.length - 1]) break; // already shown
        run.valSteps.push(ev.step);
        run.valLoss.push(ev.loss);
        run.valMargin.push(finite(ev.margin) ? ev.margin : NaN);
      }
      break;
    case "samples": {
      // only inline images the node made (data:image/jpeg|png;base64): nothing else ever becomes an <img> source
      const images = Array.isArray(ev.images) ? ev.images.map((u) => (isImageDataUrl(u) ? u : null)) : [];
      const prompts = Array.isArray(ev.prompts) ? ev.prompts.map((t) => String(t ?? "")) : [];
      if (images.some((u) => u)) run.samples = { step: finite(ev.step) ? ev.step : null, images, prompts };
      break;
    }
    case "done":
      if (ev.reused) {
        // the node re-used a finished run: nothing was trained now; its recorded losses are the curve
        run = newRun();
        const losses = Array.isArray(ev.losses) ? ev.losses : [];
        losses.forEach((loss, i) => { if (finite(loss)) addPoint(run, { step: i + 1, loss }); });
        const points = Array.isArray(ev.validation) ? ev.validation : []; // [step, loss, margin]
        for (const p of points) {
          if (Array.isArray(p) && finite(p[0]) && finite(p[1])) {
            run.valSteps.push(p[0]); run.valLoss.push(p[1]); run.valMargin.push(finite(p[2]) ? p[2] : NaN);
          }
        }
      }
      if (ev.stopped) { // a stop (Cancel, a stop file): not a finished run; the node's "cancelled" event follows
        if (run.phase !== "cancelling") {
          run.phase = "cancelling";
          run.note = `stopped at step ${ev.step ?? "?"} of ${ev.total ?? "?"}`;
        }
        break;
      }
      run.phase = "done";
      run.done = ev;
      break;
    case "cancelled": // Cancel: where the run stopped, what was saved and how it goes on (train_outcome.after_cancel)
      run.phase = "cancelled";
      run.cancelled = ev;
      break;
    case "error":
      run.phase = "error";
      run.error = ev;
      break;
    default:
      break;
  }
  return run;
}

export function isImageDataUrl(value) {
  return typeof value === "string" && /^data:image\/(jpeg|png);base64,[A-Za-z0-9+/]+=*$/.test(value);
}

export function formatDuration(seconds) {
  if (!finite(seconds)) return "?";
  let s = Math.round(seconds);
  const h = Math.floor(s / 3600);
  s -= h * 3600;
  const m = Math.floor(s / 60);
  s -= m * 60;
  const pad = (n) => String(n).padStart(2, "0");
  if (h) return `${h}h${pad(m)}m${pad(s)}s`;
  if (m) return `${m}m${pad(s)}s`;
  return `${s}s`;
}

const fmtLoss = (v) => (finite(v) ? v.toFixed(4) : "?");
const fmtLr = (v) => (finite(v) ? v.toExponential(2) : "?");

// The text under the chart: [{text, kind}] with kind "main" | "info" | "done" | "error" | "warning", one entry per
// line; the warnings come last and stay through the whole run.
export function statusLines(run) {
  const lines = mainStatusLines(run);
  const warnings = run?.warnings ?? [];
  for (const text of warnings.slice(0, SHOWN_WARNINGS)) lines.push({ text: `warning: ${text}`, kind: "warning" });
  if (warnings.length > SHOWN_WARNINGS) {
    lines.push({ text: `… and ${warnings.length - SHOWN_WARNINGS} more warning(s) in the log`, kind: "warning" });
  }
  return lines;
}

// The curriculum phase of a step event (anima_train/training/flow.py phase_summary), e.g. "phase 2/3 texture (t 0–0.6, LR
// ×0.5)"; "" without a curriculum.
function phaseText(phase) {
  if (!phase || typeof phase !== "object" || !finite(phase.index)) return "";
  let text = `phase ${phase.index}/${finite(phase.count) ? phase.count : "?"} ${String(phase.mode ?? "")}`.trim();
  const extra = [];
  const range = Array.isArray(phase.t_range) ? phase.t_range : [];
  if (range.length === 2 && finite(range[0]) && finite(range[1]) && (range[0] !== 0 || range[1] !== 1)) {
    extra.push(`t ${range[0]}–${range[1]}`);
  }
  if (finite(phase.lr_mul) && phase.lr_mul !== 1) extra.push(`LR ×${phase.lr_mul}`);
  return extra.length ? `${text} (${extra.join(", ")})` : text;
}

// The validation line's legend: its latest value and caption margin, e.g. "validation 1.1250 (margin 0.0125)" (on the
// chart, not in the status: the status keeps its three lines, so the chart never changes size mid-run)
export function validationText(run) {
  const n = run?.valLoss?.length ?? 0;
  if (!n) return "";
  const m = run.valMargin[n - 1];
  return `validation ${fmtLoss(run.valLoss[n - 1])}` + (finite(m) ? ` (margin ${m.toFixed(4)})` : "");
}

// where the run trains: the start event's torch device type ("cpu", "cuda", ...)
const deviceText = (device) => (device === "cpu" ? "on the CPU" : "on the GPU");

function mainStatusLines(run) {
  const lines = [];
  const ev = run?.last;
  if (!run || run.phase === "idle") return [{ text: "no run yet — queue the prompt to train", kind: "info" }];
  if (run.runNote) lines.push({ text: run.runNote, kind: "info" });
  const stopped = ["cancelling", "cancelled", "error"].includes(run.phase); // no ETA for a run that is not going on
  if (ev) {
    const total = finite(ev.total) ? ev.total : run.total;
    const pct = finite(total) && total > 0 ? ` (${Math.floor((100 * ev.step) / total)}%)` : "";
    const parts = [`training step ${ev.step} of ${finite(total) ? total : "?"}${pct}`];
    if (finite(ev.epoch)) parts.push(`epoch ${ev.epoch}${finite(run.epochs) ? "/" + run.epochs : ""}`);
    let loss = `loss ${fmtLoss(ev.loss)}`;
    const terms = Object.entries(termsOf(ev)).map(([name, value]) => `${name} ${fmtLoss(value)}`);
    if (terms.length) loss += ` (${terms.join(" + ")})`;
    parts.push(loss);
    if (run.ema.length) parts.push(`EMA ${fmtLoss(run.ema[run.ema.length - 1])}`);
    if (finite(ev.ot)) parts.push(`ot ${ev.ot.toFixed(2)}`);
    const phase = phaseText(ev.phase);
    if (phase) parts.push(phase);
    lines.push({ text: parts.join(" · "), kind: "main" });

    const rate = run.device ? [deviceText(run.device)] : [];
    const lrs = Array.isArray(ev.lr) ? ev.lr : finite(ev.lr) ? [ev.lr] : [];
    const distinct = [...new Set(lrs.map(fmtLr))];
    if (distinct.length) rate.push(`LR ${distinct.join("/")}`);
    if (finite(ev.s_per_step)) rate.push(`${ev.s_per_step.toFixed(2)} s/it`);
    if (!stopped) rate.push(`ETA ${finite(ev.eta_s) ? formatDuration(ev.eta_s) : "?"}`);
    const peaks = Array.isArray(ev.peak_gb) ? ev.peak_gb.filter(finite) : [];
    if (peaks.length) rate.push(`peak VRAM ${peaks.map((g) => g.toFixed(1)).join("/")} GB`);
    lines.push({ text: rate.join(" · "), kind: "info" });
  }
  if (run.phase === "done") {
    const d = run.done || {};
    const took = finite(d.seconds) ? ` in ${formatDuration(d.seconds)}` : "";
    const what = d.reused ? "re-used the finished run" : "done";
    lines.push({ text: `${what}: ${d.step ?? "?"}/${d.total ?? "?"} steps${took}` + (d.final ? ` → ${d.final}` : ""),
                 kind: "done" });
  } else if (run.phase === "cancelled") {
    lines.push({ text: String(run.cancelled?.text ?? "cancelled"), kind: "warning" });
  } else if (run.phase === "cancelling") {
    lines.push({ text: run.note, kind: "warning" });
  } else if (run.phase === "error") {
    lines.push({ text: `error: ${run.error?.message ?? "unknown"}`, kind: "error" });
  } else if (run.note) {
    lines.push({ text: run.note, kind: "info" });
  }
  if (!ev && run.device && run.phase === "running") lines.push({ text: deviceText(run.device), kind: "info" });
  return lines;
}

function niceTicks(lo, hi, count) {
  const span = hi - lo;
  if (!(span > 0)) return [lo];
  const raw = span / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((f) => f * mag).find((s) => s >= raw) || 10 * mag;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + 1e-12 * span; t += step) ticks.push(t);
  return ticks;
}

function quantile(values, q) {
  const v = values.filter(finite).sort((a, b) => a - b);
  if (!v.length) return NaN;
  return v[Math.min(v.length - 1, Math.max(0, Math.round(q * (v.length - 1))))];
}

// One series as a polyline; when there are more points than pixels, each pixel column is drawn as its min..max
// range (the noise envelope), so zooming out never hides a spike or aliases the curve.
function drawSeries(ctx, xs, ys, toX, toY, colour, width) {
  ctx.strokeStyle = colour;
  ctx.lineWidth = width;
  ctx.beginPath();
  let column = null, lo = 0, hi = 0, started = false;
  const flush = () => {
    if (column === null) return;
    const yLo = toY(lo), yHi = toY(hi);
    if (!started) { ctx.moveTo(column, yLo); started = true; } else ctx.lineTo(column, yLo);
    if (yHi !== yLo) ctx.lineTo(column, yHi);
  };
  for (let i = 0; i < xs.length; i++) {
    const y = ys[i];
    if (!finite(y)) continue;
    const px = Math.round(toX(xs[i]));
    if (px !== column) { flush(); column = px; lo = hi = y; } else { lo = Math.min(lo, y); hi = Math.max(hi, y); }
  }
  flush();
  ctx.stroke();
}

// Draws the run into a canvas of cssWidth x cssHeight CSS pixels (the caller sizes canvas.width/height by dpr).
export function drawChart(canvas, run, cssWidth, cssHeight, dpr = 1) {
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.fillStyle = COLOURS.background;
  ctx.fillRect(0, 0, cssWidth, cssHeight);
  ctx.font = "10px sans-serif";
  const pad = { left: 46, right: 8, top: 16, bottom: 16 };
  const w = cssWidth - pad.left - pad.right, h = cssHeight - pad.top - pad.bottom;
  if (w < 20 || h < 20) return;
  if (!run || !run.steps.length) {
    ctx.fillStyle = COLOURS.axis;
    ctx.textAlign = "center";
    ctx.fillText(run && ["queued", "preparing"].includes(run.phase) ? "waiting for the first step…" : "loss chart",
                 pad.left + w / 2, pad.top + h / 2);
    return;
  }
  const x0 = Math.max(0, run.chartFrom ?? (run.resumedStep || 0), run.steps[0] - 1);
  const x1 = Math.max(finite(run.total) ? run.total : 0, run.steps[run.steps.length - 1], x0 + 1);
  const parts = reportedParts(run);
  // y range: the bulk of the raw loss plus the whole EMA; rare spikes are clipped at the top edge
  const pool = run.loss.concat(run.ema, run.valLoss, ...parts.map(([, , series]) => series)).filter(finite);
  let lo = pool.reduce((a, b) => Math.min(a, b), Infinity);
  let hi = Math.max(quantile(run.loss, 0.99), run.ema.concat(run.valLoss).reduce((a, b) => Math.max(a, b), -Infinity));
  if (!(hi > lo)) { hi = lo + Math.max(Math.abs(lo) * 0.1, 1e-3); lo -= Math.max(Math.abs(lo) * 0.1, 1e-3); }
  const margin = (hi - lo) * 0.06;
  lo = lo >= 0 ? Math.max(0, lo - margin) : lo - margin; // a loss is >= 0: never show negative space
  hi += margin;
  const toX = (s) => pad.left + ((s - x0) / (x1 - x0)) * w;
  const toY = (v) => pad.top + (1 - (Math.min(Math.max(v, lo), hi) - lo) / (hi - lo)) * h;

  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const t of niceTicks(lo, hi, 4)) {
    const y = Math.round(toY(t)) + 0.5;
    ctx.strokeStyle = COLOURS.grid;
    ctx.beginPath(); ctx.moveTo(pad.left, y); ctx.lineTo(pad.left + w, y); ctx.stroke();
    ctx.fillStyle = COLOURS.axis;
    ctx.fillText(Number(t.toPrecision(3)).toString(), pad.left - 4, y);
  }
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  ctx.fillText(String(Math.round(x0)), pad.left, pad.top + h + 3);
  ctx.textAlign = "right";
  ctx.fillText(`${Math.round(x1)} steps`, pad.left + w, pad.top + h + 3);

  ctx.save();
  ctx.beginPath(); ctx.rect(pad.left, pad.top - 1, w, h + 2); ctx.clip();
  ctx.lineJoin = "round";
  for (const [, colour, series] of parts) { // the terms under the total they add up to
    drawSeries(ctx, run.steps, series, toX, toY, colour, 1);
  }
  drawSeries(ctx, run.steps, run.loss, toX, toY, COLOURS.loss, 1);
  drawSeries(ctx, run.steps, run.ema, toX, toY, COLOURS.ema, 2);
  if (run.valSteps.length) { // the second line: validation loss, a dot per evaluation
    drawSeries(ctx, run.valSteps, run.valLoss, toX, toY, COLOURS.validation, 2);
    ctx.fillStyle = COLOURS.validation;
    run.valSteps.forEach((s, i) => {
      ctx.beginPath(); ctx.arc(toX(s), toY(run.valLoss[i]), 3, 0, 2 * Math.PI); ctx.fill();
    });
  }
  ctx.restore();

  // legend along the top edge
  const legend = [["loss", COLOURS.loss], ["EMA", COLOURS.ema]];
  for (const [name, colour] of parts) legend.push([name, colour]);
  if (run.valSteps.length) legend.push([validationText(run), COLOURS.validation]);
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  let lx = pad.left + 2;
  for (const [label, colour] of legend) {
    ctx.fillStyle = colour;
    ctx.fillRect(lx, 6, 10, 3);
    ctx.fillStyle = COLOURS.axis;
    ctx.fillText(label, lx + 13, 8);
    lx += 20 + ctx.measureText(label).width;
  }
}
