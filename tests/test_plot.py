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
