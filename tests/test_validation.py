"""`[validation]` (#28): the validation loss and text-conditioning margin on held-out images, on the tiny model.

What the user gets is checked: the lines printed, the events, loss.png, the summary and its verdicts; and what the
evaluation must not do: change the training (the losses of a run without validation, bit for bit).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from anima_train import adapters
from anima_train.cli import main
from anima_train.data.dataset import build_training_data
from anima_train.data.synthetic import make_synthetic_latents
from anima_train.training.train import train
from tests.test_train import make_cfg



@pytest.fixture(scope="module")
def held_out_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("held_out")
    make_synthetic_latents(out, n=3, seed=1)
    return out


def _points(result):
    return [(p.step, p.loss, p.shuffled, p.margin) for p in result.validation]


def test_validation_does_not_change_training_and_gives_the_same_numbers_twice(tiny_anima, latents_dir, held_out_dir,
                                                                             tmp_path, capsys):
    model = tiny_anima.diffusers_dir
    extra = "dropout = 0.1\n[optimizer]\nlr = 1e-3\n"  # [adapter] dropout: LoRA dropout draws from the global RNG
    plain = train(make_cfg(model, latents_dir, tmp_path / "a", extra, max_steps=5), cpu=True)
    capsys.readouterr()
    val = extra + f'[validation]\nfolder = "{held_out_dir}"\nevery_n_steps = 2\n'
    runs = []
    for name in ("b", "c"):
        events = tmp_path / f"{name}.jsonl"
        runs.append(train(make_cfg(model, latents_dir, tmp_path / name, val, max_steps=5), cpu=True,
                          events=str(events)))
    first, second = runs
    # a run with validation trains exactly as one without: same losses, same weights, bit for bit
    assert first.losses == plain.losses and first.trainable_digest == plain.trainable_digest
    # before the first step, every 2 steps, and at the end; the same numbers when run again
    assert [p[0] for p in _points(first)] == [0, 2, 4, 5]
    assert _points(first) == _points(second)
    assert _points(first)[0][1] != _points(first)[-1][1]  # ... and they measure the model, which changed
    out = capsys.readouterr().out
    assert "validation: 3 image(s) from " + str(held_out_dir) in out
    assert "validation step 0: loss " in out and "3 image(s) x 9 timestep(s) x 2 in " in out  # its cost
    p0, p5 = first.validation[0], first.validation[-1]
    assert f"validation loss {p0.loss:.3f} → {p5.loss:.3f}, margin {p0.margin:.3f} → {p5.margin:.3f}" in out
    events = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    got = [(e["step"], e["loss"], e["shuffled"], e["margin"]) for e in events if e["event"] == "validation"]
    assert got == _points(second) and all(e["seconds"] > 0 for e in events if e["event"] == "validation")
    assert (tmp_path / "b" / "tiny" / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_a_fraction_is_held_out_by_its_seed_and_never_trained_on(tiny_anima, latents_dir, tmp_path, capsys):
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, "[validation]\nfraction = 0.25\nseed = 3\n",
                   max_steps=2, batch_size=1)
    result = train(cfg, cpu=True, no_save=True)
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "held out (fraction 0.25, seed 3), never trained on:" in ln)
    held = line.rsplit(": ", 1)[1].split(", ")
    assert len(held) == 3 and len(set(held)) == 3  # round(0.25 x 12)
    assert "samples  9 per epoch" in out  # the 9 others train
    data = build_training_data(cfg, cfg.train.model_path)
    assert sorted(it.stem.name for it in data.held_out) == sorted(held)
    assert not {it.stem.name for it in data.dataset.items} & set(held)  # never in a training batch
    # the same folder and seed hold out the same images; another seed, others
    again = train(cfg, cpu=True, no_save=True)
    assert again.validation and [p.loss for p in again.validation] == [p.loss for p in result.validation]
    capsys.readouterr()
    other = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, "[validation]\nfraction = 0.25\nseed = 4\n",
                     max_steps=1)
    train(other, cpu=True, no_save=True, dry_run=True)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "never trained on:" in ln)
    assert line.rsplit(": ", 1)[1].split(", ") != held


def test_a_fraction_that_leaves_nothing_to_train_on_is_refused(tiny_anima, tmp_path):
    data = tmp_path / "two"
    make_synthetic_latents(data, n=2, seed=0)
    cfg = make_cfg(tiny_anima.diffusers_dir, data, tmp_path, "[validation]\nfraction = 0.1\n", max_steps=1)
    with pytest.raises(Exception) as exc:
        train(cfg, cpu=True, no_save=True)
    assert "[validation] fraction = 0.1 holds out 2 of the dataset's 2 image(s)" in str(exc.value)


@pytest.fixture(scope="module")
def split_sets(tmp_path_factory):
    """16 latents of one concept mapping (the same colour and background directions): 12 to train on, 4 held out in
    their own folder; and the same two folders with every caption "a picture" (captions that carry no signal)."""
    root = tmp_path_factory.mktemp("split")
    make_synthetic_latents(root / "all", n=16, seed=0)
    out = {}
    for signal in (True, False):
        train_dir, held = root / f"train_{signal}", root / f"held_{signal}"
        train_dir.mkdir(), held.mkdir()
        for f in (root / "all").iterdir():
            shutil.copy(f, (held if int(f.name[4:8]) >= 12 else train_dir) / f.name)
            if not signal and f.suffix == ".txt":
                ((held if int(f.name[4:8]) >= 12 else train_dir) / f.name).write_text("a picture")
        out[signal] = train_dir, held
    return out


@pytest.mark.slow
@pytest.mark.parametrize("signal", [True, False], ids=["captions carry the signal", "captions carry none"])
def test_the_margin_verdict(tiny_anima, split_sets, tmp_path, capsys, signal):
    data, held = split_sets[signal]
    cfg = make_cfg(tiny_anima.diffusers_dir, data, tmp_path, "[optimizer]\nlr = 1e-2\n"
                   f'[validation]\nfolder = "{held}"\nevery_n_steps = 50\n', max_steps=150)
    result = train(cfg, cpu=True, no_save=True)
    out = capsys.readouterr().out
    first, last = result.validation[0], result.validation[-1]
    assert last.loss < 0.8 * first.loss  # it learned the images either way...
    summary = out.split("validation loss ")[-1]
    if signal:  # ... and, on images it never saw, from the captions only when they say something
        assert last.margin > first.margin + 0.005, result.validation
        assert "warning:" not in summary
    else:
        assert first.margin == last.margin == 0.0  # one caption for every image: shuffling changes nothing
        assert "warning: the text-conditioning margin did not grow (0.0000 → 0.0000)" in summary


def test_the_overfitting_verdict():
    from anima_train.training.validation import Point, summary

    falling = [1.0 - 0.01 * i for i in range(40)]
    rose = [Point(0, 0.50, 0.50, 0.0, 1), Point(20, 0.40, 0.42, 0.02, 1), Point(40, 0.45, 0.48, 0.03, 1)]
    lines = summary(rose, falling)
    assert lines[0] == "validation loss 0.500 → 0.450, margin 0.000 → 0.030 (steps 0 → 40)"
    assert lines[1:] == ["warning: validation loss rose 0.400 (step 20) → 0.450 (step 40) while the training loss "
                         "fell 0.955 → 0.655: overfitting; compare the checkpoints with anima-train evaluate"]
    # still falling, or training loss not falling: no verdict
    assert len(summary([rose[0], rose[1]], falling)) == 1
    assert len(summary(rose, list(reversed(falling)))) == 1


# -- anima-train evaluate ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", adapters.kinds())
def test_evaluate_prints_the_numbers_training_printed_for_a_checkpoint(tiny_anima, latents_dir, held_out_dir,
                                                                      tmp_path, capsys, kind):
    extra = (f'kind = "{kind}"\n[optimizer]\nlr = {1e-4 if kind == "none" else 1e-2}\n'
             f'[validation]\nfolder = "{held_out_dir}"\n')
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "out", extra, max_steps=3)
    config = tmp_path / "run.toml"
    config.write_text(cfg.source_text)
    result = train(cfg, cpu=True)
    capsys.readouterr()
    base, trained = result.validation[0], result.validation[-1]
    assert base.loss != trained.loss
    assert main(["evaluate", str(config), "--cpu"]) == 0
    out = capsys.readouterr().out
    assert f"the base model: loss {base.loss:.4f}, margin {base.margin:+.4f}" in out
    assert main(["evaluate", str(config), "--cpu", "--checkpoint", str(result.final)]) == 0
    out = capsys.readouterr().out
    method = adapters.method(kind)
    what = "full finetune" if method.trains_base else f"{method.title} file"
    assert f"{what} {result.final.name}: loss {trained.loss:.4f}, margin {trained.margin:+.4f}" in out


def test_evaluate_refuses_a_checkpoint_made_for_another_model(tiny_anima, latents_dir, held_out_dir, tmp_path,
                                                              capsys):
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "out",
                   f'[validation]\nfolder = "{held_out_dir}"\n', max_steps=1)
    config = tmp_path / "run.toml"
    config.write_text(cfg.source_text)
    lora = load_file(str(train(cfg, cpu=True, no_save=False).final))
    # a LoRA of a wider model: every factor one row/column larger; and one for a module this model lacks
    wider = {k: torch.zeros(v.shape[0] + ("lora_B" in k), v.shape[1] + ("lora_A" in k)) for k, v in lora.items()}
    deeper = {k.replace("blocks.0.", "blocks.99."): v for k, v in lora.items()}
    not_adapter = {"some.other.weight": torch.zeros(2, 2)}
    for name, tensors, says in (("wider", wider, "made for another model: diffusion_model.blocks."),
                                ("deeper", deeper, "made for another model: it adapts diffusion_model.blocks.99."),
                                ("other", not_adapter, "tensor 'some.other.weight' is not an adapter factor")):
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path))
        capsys.readouterr()
        assert main(["evaluate", str(config), "--cpu", "--checkpoint", str(path)]) == 2
        err = capsys.readouterr().err
        assert f"anima-train evaluate: error: --checkpoint {path}: " in err and says in err, err
        assert "Traceback" not in err and sum("error" in line for line in err.splitlines()) == 1


def test_evaluate_without_a_validation_set_says_how_to_add_one(tiny_anima, latents_dir, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "out").source_text)
    assert main(["evaluate", str(config), "--cpu"]) == 2
    assert "no [validation] set to evaluate on: add [validation] folder" in capsys.readouterr().err


def test_a_held_out_image_without_a_caption_is_refused_before_the_model_loads(tiny_anima, latents_dir, tmp_path,
                                                                              monkeypatch):
    from anima_train.training import models

    held = tmp_path / "held_out"
    make_synthetic_latents(held, n=2, seed=1)
    (held / "lat_0001.txt").unlink()
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "out", f'[validation]\nfolder = "{held}"\n',
                   max_steps=1)
    loaded = []
    monkeypatch.setattr(models, "load_components", lambda *a, **k: loaded.append(1))
    with pytest.raises(Exception) as exc:
        train(cfg, cpu=True, dry_run=True)
    assert str(held / "lat_0001.txt") in str(exc.value) and not loaded


def test_the_validation_numbers_go_to_tensorboard(tiny_anima, latents_dir, held_out_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, "[logging]\ntensorboard = true\n"
                   f'[validation]\nfolder = "{held_out_dir}"\nevery_n_steps = 1\n', max_steps=2)
    result = train(cfg, cpu=True)
    folder, = (tmp_path / "tiny" / "logs").iterdir()
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    for tag, attr in (("validation/loss", "loss"), ("validation/margin", "margin")):
        logged = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert logged == [(p.step, pytest.approx(getattr(p, attr), rel=1e-6, abs=1e-7)) for p in result.validation]
    assert [p.step for p in result.validation] == [0, 1, 2]


def test_every_n_epochs_evaluates_at_the_epoch_ends(tiny_anima, latents_dir, held_out_dir, tmp_path, capsys):
    # 12 latents, batch 4: 3 steps an epoch; every 2nd epoch's end, before the first step and at the end
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, f'[validation]\nfolder = "{held_out_dir}"\n'
                   "every_n_epochs = 2\n", epochs=5)
    result = train(cfg, cpu=True, no_save=True)
    assert [p.step for p in result.validation] == [0, 6, 12, 15]
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("validation step ")] == [
        "validation step 0", "validation step 6", "validation step 12", "validation step 15"]
