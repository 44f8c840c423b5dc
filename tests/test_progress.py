"""Progress lines, ETA anchoring and the JSON event stream."""

from __future__ import annotations

import io
import json

import pytest

from anima_train.outputs import progress as P


def _stats(step, mse=None, hf=None, **kw):
    base = dict(step=step, epoch=3, loss=0.0712, lrs=[2.71e-05], terms={"mse": mse, "hf": hf})
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
    assert recs[1]["loss"] == 0.0712 and recs[1]["terms"] == {"mse": 0.5, "hf": 0.1} and recs[1]["total"] == 10
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


def test_a_loss_term_is_reported_under_its_own_name_from_the_readout_to_tensorboard(tmp_path):
    """The loss's terms travel by name from the loss function on: a term it adds shows in the progress line, in the
    `step` event under its name and as TensorBoard's loss/<name>, with no slot to add anywhere on the way."""
    from types import SimpleNamespace

    import torch

    from anima_train.outputs import tracking
    from anima_train.training import readout

    totals = readout.StepTotals()  # two micro-batches of one optimizer step
    totals.add(torch.tensor(1.0), {"mse": torch.tensor(0.5), "edge": torch.tensor(0.25), "ot": 0.5})
    totals.add(torch.tensor(3.0), {"mse": torch.tensor(1.5), "edge": torch.tensor(0.75), "ot": 1.0})
    one = SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    stats, votes, peaks = readout.receive(readout.send(one, totals.names, totals.mean(), stop_vote=False), one)
    assert stats == {"loss": 2.0, "mse": 1.0, "edge": 0.5, "ot": 0.75} and votes == [] and peaks == []

    step = _stats(7, terms={"mse": stats["mse"], "edge": stats["edge"]}, ot=stats["ot"])
    assert P.describe_step(step).startswith("loss 0.0712 (mse 1.0000 + edge 0.5000)  ot 0.75")
    events = tmp_path / "ev.jsonl"
    prog = P.Progress("off", 10, stream=io.StringIO(), events=str(events))
    prog.step(step)
    prog.close()
    record = json.loads(events.read_text())
    assert (record["terms"], record["ot"]) == ({"mse": 1.0, "edge": 0.5}, 0.75)  # the terms by their own names

    logged = []
    tracker = tracking.Tracker.__new__(tracking.Tracker)
    tracker.on, tracker._last = True, None
    tracker.accelerator = SimpleNamespace(log=lambda values, step: logged.append(values))
    tracker.step(step, group_names=["lora"], images=4)
    assert {k: v for k, v in logged[0].items() if k.startswith("loss/")} == {"loss/total": 0.0712, "loss/mse": 1.0,
                                                                             "loss/edge": 0.5}
