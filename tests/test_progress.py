"""Progress lines, ETA anchoring and the JSON event stream."""

from __future__ import annotations

import io
import json

import pytest

from anima_train.outputs import progress as P


def _stats(step, **kw):
    base = dict(step=step, epoch=3, loss=0.0712, lrs=[2.71e-05])
    base.update(kw)
    return P.StepStats(**base)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_plain_line_format(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(P.time, "perf_counter", clock)
    out = io.StringIO()
    prog = P.Progress("plain", 3000, stream=out, start_step=1408)  # t0 = 0
    clock.now = 10.0
    prog.step(_stats(1409))  # anchor at 10.0
    clock.now = 11.8
    prog.step(_stats(1410, mse=0.0650, hf=0.0062, ot=0.83, peak_gb=[8.1]))  # 1.80 s/step since the anchor
    lines = out.getvalue().splitlines()
    assert lines[-1] == ("e3 step 1410/3000 (47%)  loss 0.0712 (mse 0.0650 + hf 0.0062)  ot 0.83  lr 2.71e-05  "
                         "1.80s/it  peak 8.1GB  eta 47m42s")


def test_eta_is_cumulative_mean_after_first_step(monkeypatch):
    # first step is slow (compile); later steps alternate 1 s / 3 s (bucket mix) → mean 2 s/step
    clock = Clock()
    monkeypatch.setattr(P.time, "perf_counter", clock)
    prog = P.Progress("off", 100, stream=io.StringIO())
    clock.now = 60.0
    prog.step(_stats(1))  # anchor at 60 (first step's 60 s excluded)
    assert prog.eta_seconds(1) is None
    for now, step, expected in [(61.0, 2, 1.0 * 98), (64.0, 3, 2.0 * 97), (65.0, 4, 5 / 3 * 96), (68.0, 5, 2.0 * 95)]:
        clock.now = now
        assert prog.eta_seconds(step) == pytest.approx(expected)


def test_lrs_slash_joined_only_when_different():
    assert "lr 1.00e-05/2.00e-05" in P.describe_step(_stats(1, lrs=[1e-5, 2e-5, 1e-5]))
    assert P.describe_step(_stats(1, lrs=[1e-5, 1e-5])).endswith("lr 1.00e-05")
    assert "hf" not in P.describe_step(_stats(1)) and "ot" not in P.describe_step(_stats(1))


def test_events_stream_and_off_mode(tmp_path):
    events = tmp_path / "ev.jsonl"
    out = io.StringIO()
    prog = P.Progress("off", 10, stream=out, events=str(events))
    prog.event("start", total=10)
    prog.step(_stats(1, mse=0.5, hf=0.1))
    prog.message("saved x")
    prog.close()
    recs = [json.loads(line) for line in events.read_text().splitlines()]
    assert [r["event"] for r in recs] == ["start", "step", "message"]
    assert recs[1]["loss"] == 0.0712 and recs[1]["hf"] == 0.1 and recs[1]["total"] == 10
    assert out.getvalue() == "saved x\n"  # off: no step line, messages still print


def test_disabled_on_other_ranks(tmp_path):
    events = tmp_path / "ev.jsonl"
    out = io.StringIO()
    prog = P.Progress("plain", 10, stream=out, events=str(events), enabled=False)
    prog.step(_stats(1))
    prog.message("x")
    prog.event("done")
    prog.close()
    assert out.getvalue() == "" and not events.exists()


def test_auto_picks_plain_for_a_pipe_and_bar_draws():
    assert P.Progress("auto", 5, stream=io.StringIO()).mode == "plain"
    out = io.StringIO()
    prog = P.Progress("bar", 5, stream=out)
    prog.step(_stats(1))
    prog.step(_stats(2))
    prog.close()
    text = out.getvalue()
    assert "e3 " in text and "2/5" in text and "loss 0.0712" in text and "s/step" in text
    with pytest.raises(ValueError, match="use one of"):
        P.Progress("fancy", 5)


def test_format_duration():
    assert P.format_duration(2854) == "47m34s"
    assert P.format_duration(3723) == "1h02m03s"
    assert P.format_duration(9.4) == "9s"


def test_bar_total_can_be_set_after_start():
    out = io.StringIO()
    prog = P.Progress("bar", 1, stream=out)
    prog.set_total(10, start_step=4)
    prog.step(_stats(5))
    prog.close()
    assert "5/10" in out.getvalue()
