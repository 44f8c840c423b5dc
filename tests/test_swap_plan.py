"""`[train] swap_blocks = "auto"` in a run (training/swap_plan.py), the default (issue 45: every card trains the
default config without edits): the count is decided before the model loads, from the static plan and the card's
memory, and it changes no number.

No GPU here: the card is the budget `swap_plan.card_budget` reports (the run itself trains on the CPU, where the
swap works as on CUDA: tests/test_weight_swap.py)."""

from __future__ import annotations

import json

import pytest

from anima_train.training import memory, plan, swap_plan, weight_swap
from anima_train.training.train import train
from tests.test_train import make_cfg

GIB = plan.GIB
STEPS = 3


@pytest.fixture
def fixed_segments(monkeypatch):
    """The allocator the planner assumes: fixed segments (their margin) whatever this machine's environment says."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setitem(memory._EXPANDABLE, "set", False)


def _watch_swaps(monkeypatch) -> list:
    made = []
    init = weight_swap.WeightSwap.__init__

    def watching(self, blocks, *args, **kwargs):
        init(self, blocks, *args, **kwargs)
        made.append(len(self.blocks))

    monkeypatch.setattr(weight_swap.WeightSwap, "__init__", watching)
    return made


def _run(tiny_anima, latents_dir, out, events=None, **keys):
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, out, max_steps=STEPS, gradient_checkpointing="true",
                   **keys)
    return train(cfg, cpu=True, no_save=True, events=str(events) if events else None), cfg


def _said(events) -> list[str]:
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    return [e["text"] for e in lines if e.get("event") in ("message", "warning")
            and e["text"].startswith(("swap auto:", "the step is predicted"))]


def test_swap_auto_swaps_before_the_model_loads_and_trains_to_the_resident_bits(tiny_anima, latents_dir, tmp_path,
                                                                               monkeypatch, fixed_segments):
    """A card large enough: no block swaps, and the run says so. A card where only the all-swapped step fits (the
    tiny DiT has 2 blocks, one on the device at a time: swapping one saves nothing): both blocks swap, decided
    before the model loads, and the run trains to the bits of the resident run."""
    asked = []
    make_plan = plan.make_plan

    def recording(cfg, budget, *args, **kwargs):
        asked.append(kwargs.get("largest"))
        return make_plan(cfg, budget, *args, **kwargs)

    monkeypatch.setattr(plan, "make_plan", recording)
    made = _watch_swaps(monkeypatch)
    monkeypatch.setattr(swap_plan, "card_budget", lambda device: 80 * GIB)
    resident, cfg = _run(tiny_anima, latents_dir, tmp_path / "resident", events=tmp_path / "resident.jsonl")
    assert cfg.train.swap_blocks == "auto" and made == []
    said = _said(tmp_path / "resident.jsonl")
    assert len(said) == 1 and said[0].startswith("swap auto: none: the model fits on the GPU (predicted peak ")
    assert "of 80.0 GiB, with 6.4 GiB kept free" in said[0]
    largest = asked[0]  # what the run planned with: the dataset's largest batch

    def swapped(budget: int) -> tuple[int, bool]:
        chosen = make_plan(cfg, budget, False, largest=largest, whole_trunk_compiled=False)
        return chosen.inputs.swapped, chosen.fits

    low, high = GIB, 2 * GIB  # the smallest card on which the step fits (the margin alone is 1 GiB there)
    assert swapped(low) == (2, False) and swapped(high) == (0, True)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if not swapped(middle)[1] else (low, middle)
    assert swapped(high) == (2, True)

    monkeypatch.setattr(swap_plan, "card_budget", lambda device: high)
    small, _ = _run(tiny_anima, latents_dir, tmp_path / "small", events=tmp_path / "small.jsonl")
    assert made == [2]
    said = _said(tmp_path / "small.jsonl")
    assert len(said) == 1 and said[0].startswith("swap auto: 2 of 2 blocks swapped, the fewest with which the step "
                                                 "fits (")
    assert small.losses == resident.losses and len(small.losses) == STEPS
    assert small.trainable_digest == resident.trainable_digest

    # a card where not even that fits: every block swaps (the most the run can save), and a warning says so
    monkeypatch.setattr(swap_plan, "card_budget", lambda device: high - 1)
    cramped, _ = _run(tiny_anima, latents_dir, tmp_path / "cramped", events=tmp_path / "cramped.jsonl")
    assert made == [2, 2] and cramped.trainable_digest == resident.trainable_digest
    said = _said(tmp_path / "cramped.jsonl")
    assert said[0].startswith("swap auto: every block swapped (2), and still predicted peak ")
    assert said[1].startswith("the step is predicted not to fit this card (predicted peak ") and "too much" in said[1]


def test_swap_auto_swaps_nothing_off_cuda_or_where_blocks_cannot_swap(tiny_anima, latents_dir, tmp_path,
                                                                      monkeypatch, fixed_segments):
    made = _watch_swaps(monkeypatch)
    _run(tiny_anima, latents_dir, tmp_path / "cpu", events=tmp_path / "cpu.jsonl")  # off CUDA: nothing to fit
    assert made == [] and _said(tmp_path / "cpu.jsonl") == []
    monkeypatch.setattr(swap_plan, "card_budget", lambda device: GIB)  # nothing fits, but nothing can swap
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "eager", max_steps=1,
                   gradient_checkpointing="false")
    train(cfg, cpu=True, no_save=True, events=str(tmp_path / "eager.jsonl"))
    assert made == []
    said = _said(tmp_path / "eager.jsonl")
    assert said == ["swap auto: none (no block can swap: gradient_checkpointing = false (a swapped block recomputes))"]


def test_an_explicit_count_is_kept(tiny_anima, latents_dir, tmp_path, monkeypatch, fixed_segments):
    """A number in the config is the run's, whatever the card: no plan is made and nothing is said."""
    made = _watch_swaps(monkeypatch)
    monkeypatch.setattr(swap_plan, "card_budget", lambda device: 80 * GIB)
    _run(tiny_anima, latents_dir, tmp_path / "one", events=tmp_path / "one.jsonl", swap_blocks=1)
    _run(tiny_anima, latents_dir, tmp_path / "none", events=tmp_path / "none.jsonl", swap_blocks=0)
    assert made == [1]
    assert _said(tmp_path / "one.jsonl") == [] and _said(tmp_path / "none.jsonl") == []
