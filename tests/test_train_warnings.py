"""The dataset warnings as a user of `anima-train train` and of the ComfyUI Train node sees them: printed lines and
`warning` events from the real trainer, and the lines the node's chart widget (js/loss_chart.js) shows for them.
The Train node's relay of the events is tested with its fake worker in tests/test_nodes_train.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from anima_train import cli
from anima_train.model.tiny import make_synthetic_dataset

ROOT = Path(__file__).resolve().parents[1]


def test_train_prints_the_dataset_warnings_and_sends_them_as_events(tiny_anima, tmp_path, capsys):
    data = tmp_path / "images"
    make_synthetic_dataset(data, n=4, sizes=[(128, 128), (64, 64)])
    Image.new("RGB", (16, 16), "white").save(data / "tiny.png")  # below min_source_area: dropped
    (data / "tiny.txt").write_text("white square")
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[train]\nmodel_path = "{tiny_anima.diffusers_dir}"\noutput_dir = "{tmp_path / "out"}"\n'
                   f'dtype = "float32"\nnum_workers = 0\nprogress = "plain"\ngradient_checkpointing = false\n'
                   f'batch_size = 2\n[dataset]\npath = "{data}"\nresolutions = [64, 128]\nsource = "encode"\n'
                   f"min_source_area = 0.5\n[adapter]\nrank = 4\n", encoding="utf-8")
    events = tmp_path / "events.jsonl"
    assert cli.main(["train", str(cfg), "--dry-run", "--cpu", "--events", str(events)]) == 0
    out = capsys.readouterr().out
    collapse = "tier 128: 2/4 sources (50.0%) are smaller than this tier and repeat a lower tier's bucket"
    dropped = "min_source_area = 0.5: dropped 1 source(s) smaller than 0.5 x 64^2 px (e.g. tiny)"
    lines = out.splitlines()
    assert any(line.startswith(f"warning: {collapse}") for line in lines), out
    assert f"warning: {dropped}" in lines, out
    sent = [json.loads(line) for line in events.read_text().splitlines()]
    warned = [e["text"] for e in sent if e["event"] == "warning"]
    assert any(w.startswith(collapse) for w in warned) and dropped in warned, warned
    # sent before the run starts, so the node has them from its first "start" on
    kinds = [e["event"] for e in sent]
    assert max(i for i, k in enumerate(kinds) if k == "warning") < kinds.index("start")


NODE = shutil.which("node")


@pytest.mark.skipif(NODE is None, reason="needs node (js/loss_chart.js is a plain ES module)")
def test_the_train_nodes_chart_lists_the_warnings():
    # the events a run sends, replayed through the chart widget's own state code
    script = f"""
    import {{ applyEvent, statusLines }} from {json.dumps((ROOT / "js" / "loss_chart.js").as_uri())};
    const events = [
      {{ event: "status", message: "scanning dataset" }},
      {{ event: "warning", text: "tier 128: 2/4 sources (50.0%) are smaller than this tier" }},
      {{ event: "warning", text: "min_source_area = 0.5: dropped 1 source(s)" }},
      {{ event: "start", total: 3, epochs: 1 }},
      {{ event: "step", step: 1, total: 3, epoch: 1, loss: 0.5, lr: [1e-4] }},
    ];
    let run = null;
    const shown = [];
    for (const ev of events) {{ run = applyEvent(run, ev); shown.push(statusLines(run)); }}
    run = applyEvent(run, {{ event: "done", step: 3, total: 3 }});
    shown.push(statusLines(run));
    for (let i = 0; i < 7; i++) run = applyEvent(run, {{ event: "warning", text: `w${{i}}` }});
    shown.push(statusLines(run));
    console.log(JSON.stringify(shown));
    """
    result = subprocess.run([NODE, "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    warning = lambda lines: [(line["text"], line["kind"]) for line in lines if line["kind"] == "warning"]  # noqa: E731
    both = [("warning: tier 128: 2/4 sources (50.0%) are smaller than this tier", "warning"),
            ("warning: min_source_area = 0.5: dropped 1 source(s)", "warning")]
    assert warning(shown[2]) == both  # while preparing
    assert warning(shown[4]) == both and shown[4][0]["kind"] == "main"  # through the run, under the step line
    assert warning(shown[5]) == both and any(line["kind"] == "done" for line in shown[5])  # and after it
    # a later run starts clean; beyond five the rest is counted, not listed
    assert [t for t, _ in warning(shown[6])] == [f"warning: w{i}" for i in range(5)] + \
        ["… and 2 more warning(s) in the log"]


def test_settings_the_run_cannot_follow_are_said_once_before_it_starts(tiny_anima, tmp_path, capsys):
    # 3 images of one size: batch_size 16 cannot be filled; 1 epoch of 1 step cannot reach max_steps 10
    data = tmp_path / "images"
    make_synthetic_dataset(data, n=3, sizes=[(64, 64)])
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[train]\nmodel_path = "{tiny_anima.diffusers_dir}"\noutput_dir = "{tmp_path / "out"}"\n'
                   f'dtype = "float32"\nnum_workers = 0\nprogress = "plain"\ngradient_checkpointing = false\n'
                   f'batch_size = 16\nepochs = 1\nmax_steps = 10\n[dataset]\npath = "{data}"\nresolution = 64\n'
                   f'source = "encode"\n[adapter]\nrank = 4\n', encoding="utf-8")
    events = tmp_path / "events.jsonl"
    assert cli.main(["train", str(cfg), "--dry-run", "--cpu", "--events", str(events)]) == 0
    out = capsys.readouterr().out
    batch = ("[train] batch_size = 16: no bucket holds that many images (the largest holds 3; a batch never mixes "
             "buckets), so every batch is smaller; lower batch_size or add images")
    steps = ("[train] max_steps = 10 is more than epochs = 1 give (1 step(s) each, 1 in all): the run stops at "
             "step 1; raise epochs to train 10 steps")
    assert out.splitlines().count(f"warning: {batch}") == 1, out
    assert out.splitlines().count(f"warning: {steps}") == 1, out
    sent = [json.loads(line) for line in events.read_text().splitlines()]
    kinds = [e["event"] for e in sent]
    warned = [(i, e["text"]) for i, e in enumerate(sent) if e["event"] == "warning"]
    assert [t for _, t in warned].count(batch) == 1 and [t for _, t in warned].count(steps) == 1
    assert max(i for i, _ in warned) < kinds.index("start")  # on the node before the run starts
    # `config` checks what `train` will: the same two lines
    assert cli.main(["config", str(cfg)]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said.count(f"warning: {batch}") == 1 and said.count(f"warning: {steps}") == 1, said
