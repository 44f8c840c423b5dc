"""The loss chart PNG: round y ticks (1.3, 1.4, 1.5 — not 1.285, 1.42, 1.555) and labelled axes."""

from __future__ import annotations

import pytest
from PIL import Image

from anima_train.outputs.plot import nice_ticks, plot_losses


@pytest.mark.parametrize("lo, hi, ticks, decimals", [
    (1.2645, 1.5755, [1.3, 1.4, 1.5], 1),
    (0.0012, 0.0031, [0.0015, 0.002, 0.0025, 0.003], 4),
    (0.05, 0.9, [0.25, 0.5, 0.75], 2),
    (10, 37, [10, 20, 30], 0),
])
def test_ticks_are_round_numbers_printed_exactly(lo, hi, ticks, decimals):
    got, dec = nice_ticks(lo, hi)
    assert got == pytest.approx(ticks) and dec == decimals
    assert all(lo <= t <= hi for t in got)


def test_plot_writes_a_png_of_the_requested_size(tmp_path):
    path = plot_losses([1.5 - 0.01 * i for i in range(30)], tmp_path / "loss.png", first_step=101)
    image = Image.open(path)
    assert image.format == "PNG" and image.size == (800, 450)


def test_png_and_live_chart_draw_the_same_loss_ema(tmp_path):
    # One EMA definition: the PNG's line must be the node's live chart line (js/loss_chart.js, run under node)
    import json
    import shutil
    import subprocess
    from pathlib import Path

    from anima_train.outputs.plot import ema

    node = shutil.which("node")
    if node is None:
        pytest.skip("needs node to run the chart's js")
    losses = [1.0, 0.2, 0.9, 0.4, 0.7, 0.1, 0.8, 0.3]
    chart = Path(__file__).resolve().parents[1] / "js" / "loss_chart.js"
    script = (f"import {{ newRun, applyEvent }} from {json.dumps(chart.as_uri())};\n"
              "let run = newRun();\n"
              f"for (const [i, loss] of {json.dumps(losses)}.entries()) "
              "run = applyEvent(run, { event: 'step', step: i + 1, total: 8, loss }) ?? run;\n"
              "console.log(JSON.stringify(run.ema));\n")
    (tmp_path / "ema.mjs").write_text(script)
    out = subprocess.run([node, str(tmp_path / "ema.mjs")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert ema(losses) == pytest.approx(json.loads(out.stdout))


def test_the_validation_loss_is_a_second_line_on_the_png(tmp_path):
    orange = (230, 120, 20)
    losses = [1.5 - 0.01 * i for i in range(30)]
    def orange_columns(image):
        pixels = image.convert("RGB").load()
        return {x for x in range(800) for y in range(450) if pixels[x, y] == orange}

    assert not orange_columns(Image.open(plot_losses(losses, tmp_path / "plain.png")))
    xs = orange_columns(Image.open(plot_losses(losses, tmp_path / "val.png",
                                               validation=[(0, 1.6), (15, 1.45), (30, 1.3)])))
    assert min(xs) < 90 and max(xs) > 760  # from before the first step to the last one


def test_the_live_chart_keeps_the_validation_points_and_shows_the_latest(tmp_path):
    import json
    import shutil
    import subprocess
    from pathlib import Path

    node = shutil.which("node")
    if node is None:
        pytest.skip("needs node to run the chart's js")
    chart = Path(__file__).resolve().parents[1] / "js" / "loss_chart.js"
    events = [{"event": "start", "total": 4}, {"event": "validation", "step": 0, "loss": 1.25, "margin": 0.001},
              *({"event": "step", "step": s, "total": 4, "loss": 1.0} for s in range(1, 5)),
              {"event": "validation", "step": 4, "loss": 1.125, "margin": 0.0125}]
    script = (f"import {{ newRun, applyEvent, validationText }} from {json.dumps(chart.as_uri())};\n"
              "let run = newRun();\n"
              f"for (const ev of {json.dumps(events)}) run = applyEvent(run, ev);\n"
              "const shown = [run.valSteps, run.valLoss, validationText(run)];\n"
              "run = applyEvent(run, { event: 'done', reused: true, losses: [1, 0.9], "
              "validation: [[0, 1.2, 0], [2, 1.1, 0.01]] });\n"  # a re-used run's chart (nodes_train.py)
              "console.log(JSON.stringify([...shown, run.valSteps]));\n")
    (tmp_path / "val.mjs").write_text(script)
    out = subprocess.run([node, str(tmp_path / "val.mjs")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    steps, values, line, reused = json.loads(out.stdout)
    assert reused == [0, 2]
    assert steps == [0, 4] and values == [1.25, 1.125]
    assert line == "validation 1.1250 (margin 0.0125)"  # the line's legend on the chart
