"""A parked Qwen3 comes in once per window of micro-batches, not once per micro-batch (training/encode_ahead.py), and
the run trains to the bits of the run whose Qwen3 stays put. On the CPU, with Qwen3 parked as on a small card."""

from __future__ import annotations

from anima_train.training import encode_ahead, memory, models
from anima_train.training.train import train
from tests.test_text_cache import qwen3_calls
from tests.test_train import make_cfg


def _run(tiny_anima, latents_dir, out, **keys):
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, out, "[optimizer]\nlr = 1e-3\n", **keys)
    return train(cfg, cpu=True, no_save=True)


def test_a_parked_qwen3_comes_in_once_per_window_and_the_run_trains_to_the_resident_runs_bits(
        tiny_anima, latents_dir, tmp_path, monkeypatch):
    """12 latents, batch 2: 6 micro-batches an epoch, 18 micro-batches over 3 epochs; windows of 4. Qwen3 parked
    came in for every micro-batch before the window (18 visits); now per window, and never ahead of an epoch's last
    batch: 4 + 1 + 1 per epoch. With gradient accumulation 4 (an epoch's 6 micro-batches: one step of 4 and one of 2,
    the loader's end closing it) the steps are the resident run's too: a window that took the last batch early would
    have ended each epoch's steps early (24 Qwen3 calls instead of 18). Fails before encode_ahead (18 visits)."""
    steps = {1: 18, 4: 6}  # by accumulation
    resident = {acc: _run(tiny_anima, latents_dir, tmp_path / f"resident{acc}", batch_size=2, max_steps=steps[acc],
                          gradient_accumulation_steps=acc) for acc in steps}
    visits = []
    on_device = memory.ParkedWeights.on_device

    def counted(self):
        visits.append(len(calls))
        return on_device(self)

    monkeypatch.setattr(memory.ParkedWeights, "on_device", counted)
    monkeypatch.setattr(models, "parks_qwen3", lambda cfg, device, train_text_encoder: True)
    monkeypatch.setattr(encode_ahead, "AHEAD", 4)
    calls = qwen3_calls(monkeypatch)
    for acc in steps:
        visits.clear()
        calls.clear()
        parked = _run(tiny_anima, latents_dir, tmp_path / f"parked{acc}", batch_size=2, max_steps=steps[acc],
                      gradient_accumulation_steps=acc)
        assert len(calls) == 18  # Qwen3 ran once per micro-batch, as before
        assert len(visits) == 9, visits  # 3 epochs x (a window of 4, one of 1, the last batch alone)
        assert len(parked.losses) == steps[acc] and parked.trainable_digest
        assert (parked.losses, parked.trainable_digest) == (resident[acc].losses, resident[acc].trainable_digest)


def test_a_parked_run_resumed_mid_epoch_trains_to_the_bits_of_the_uninterrupted_resident_run(
        tiny_anima, latents_dir, tmp_path, monkeypatch):
    """A resumed epoch's loader skips the batches done (accelerate's skip_first_batches) and the windows count only
    what is left, so with accumulation 4 the epoch's short last step still comes where the loader ends. Resumed from
    step 3 (epoch 2, 4 of its 6 micro-batches done); the reference is the run whose Qwen3 stays put. Fails with a
    window that fetches the epoch's last batch early (the steps end early, in the resumed run and the whole one)."""
    keys = dict(batch_size=2, gradient_accumulation_steps=4, max_steps=6, save_every_steps=1,
                save_optimizer_state="true")

    def run(out, **more):
        return train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / out, "[optimizer]\nlr = 1e-3\n",
                              **keys, **more), cpu=True)

    resident = run("resident")
    monkeypatch.setattr(models, "parks_qwen3", lambda cfg, device, train_text_encoder: True)
    monkeypatch.setattr(encode_ahead, "AHEAD", 4)
    run("a")
    resumed = run("b", resume_from=f'"{tmp_path / "a" / "tiny" / "tiny-step000003.safetensors"}"')
    assert len(resident.losses) == 6 and resumed.losses == resident.losses[3:]
    assert resumed.trainable_digest == resident.trainable_digest
