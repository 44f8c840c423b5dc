"""[dataset] cache_text_encoder_outputs: Qwen3 runs once per caption, then never again; the run trains as the uncached
one does (to the last bits of Qwen3's padded batches), resumes to its own bits, and is refused where captions change."""

from __future__ import annotations

import pytest
import torch
import transformers

from anima_train.model.prompts import QwenOutputs, encode_prompts
from anima_train.model.tiny import build_models, build_qwen_tokenizer, build_t5_tokenizer
from anima_train.training import plan, train as train_module
from anima_train.training.memory_plan import GIB
from anima_train.training.train import train
from tests.fixtures_tiny import anima_train_cli
from tests.test_plan import config_for, full_size_models  # noqa: F401 (the plan's model configs)
from tests.test_train import make_cfg

CACHE = "\n[dataset]\ncache_text_encoder_outputs = true\n"


def cached_cfg(model, data, out, cache: bool, **keys):
    cfg = make_cfg(model, data, out, "[optimizer]\nlr = 1e-3\n", **keys)
    cfg.dataset.cache_text_encoder_outputs = cache
    return cfg


def qwen3_calls(monkeypatch) -> list[int]:
    """The micro-batch (0, 1, ...) in which each Qwen3 forward ran."""
    micro, calls = [0], []
    loss, forward = train_module._flow_matching_loss, transformers.Qwen3Model.forward

    def counted_loss(*args, **kwargs):
        out = loss(*args, **kwargs)
        micro[0] += 1
        return out

    def counted_forward(self, *args, **kwargs):
        calls.append(micro[0])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(train_module, "_flow_matching_loss", counted_loss)
    monkeypatch.setattr(transformers.Qwen3Model, "forward", counted_forward)
    return calls


def test_qwen3_runs_once_per_caption_and_the_run_trains_as_the_uncached_one(tiny_anima, latents_dir, tmp_path,
                                                                            monkeypatch):
    """Without the cache Qwen3 runs in every micro-batch; with it, once per caption in the first epoch (12 latents,
    batch 4: 3 micro-batches an epoch) and never after. Fails without the key (the config refuses it)."""
    calls = qwen3_calls(monkeypatch)
    plain = train(cached_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "a", False, max_steps=9), cpu=True)
    assert calls == list(range(9))
    calls.clear()
    cached = train(cached_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "b", True, max_steps=9), cpu=True)
    captions = {p.read_text(encoding="utf-8").strip() for p in latents_dir.glob("*.txt")}
    # one micro-batch counter for both runs: the cached run's first epoch is micro-batches 9, 10 and 11
    assert len(calls) == len(captions) > 1 and set(calls) <= {9, 10, 11}, calls
    # the same captions, Qwen3's outputs to the last bits of its padded batches
    assert len(cached.losses) == len(plain.losses) == 9
    assert max(abs(a - b) for a, b in zip(plain.losses, cached.losses)) < 1e-4, (plain.losses, cached.losses)


def test_a_cached_run_resumes_to_its_own_bits(tiny_anima, latents_dir, tmp_path):
    """A resumed run starts with an empty cache; each caption is encoded alone, so it gets the same outputs."""
    keys = dict(max_steps=7, save_every_steps=2, save_optimizer_state="true")
    full = train(cached_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "a", True, **keys), cpu=True)
    start = tmp_path / "a" / "tiny" / "tiny-step000004.safetensors"
    resumed = train(cached_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "b", True,
                               resume_from=f'"{start}"', **keys), cpu=True)
    assert resumed.losses == full.losses[4:]
    assert resumed.trainable_digest == full.trainable_digest


def test_each_caption_is_encoded_alone_and_placed_where_the_batch_mask_has_its_tokens():
    models = build_models("tiny", dtype=torch.float32)
    te, tok, t5 = models["text_encoder"], build_qwen_tokenizer(), build_t5_tokenizer()
    captions = ["red circle, blue background", "", "green square, white background, extra, tags, more"]
    cache = QwenOutputs(te, tok, "cpu")
    with torch.no_grad():
        together = encode_prompts(captions, tokenizer=tok, t5_tokenizer=t5, text_encoder=te,
                                  conditioner=models["text_conditioner"], device="cpu")
        cached = encode_prompts(captions, tokenizer=tok, t5_tokenizer=t5, text_encoder=te,
                                conditioner=models["text_conditioner"], device="cpu", cached=cache)
        alone = [encode_prompts([c], tokenizer=tok, t5_tokenizer=t5, text_encoder=te,
                                conditioner=models["text_conditioner"], device="cpu") for c in captions]
    assert set(cache.outputs) == set(captions) and cache.outputs[""].shape[0] == 0
    assert (together - cached).abs().max() < 1e-5  # padding moves only the last bits
    with torch.no_grad():  # a caption's cached output is its own encode's
        again = [encode_prompts([c], tokenizer=tok, t5_tokenizer=t5, text_encoder=te,
                                conditioner=models["text_conditioner"], device="cpu", cached=cache) for c in captions]
    assert all(torch.equal(a, b) for a, b in zip(alone, again))


@pytest.mark.parametrize("caption_keys, named", [
    ("shuffle_tags = true", "[dataset.caption] shuffle_tags = true makes a new caption every epoch"),
    ("tag_dropout_percent = 0.1\nnl_shuffle_sentences = true",
     "[dataset.caption] nl_shuffle_sentences = true and [dataset.caption] tag_dropout_percent = 0.1 make a new "
     "caption every epoch"),
])
def test_captions_that_change_are_refused_in_one_line(tiny_anima, latents_dir, tmp_path, caption_keys, named):
    toml = tmp_path / "run.toml"
    toml.write_text(f'[train]\nmodel_path = "{tiny_anima.diffusers_dir.as_posix()}"\n[dataset]\npath = '
                    f'"{latents_dir.as_posix()}"\ncache_text_encoder_outputs = true\n[dataset.caption]\n'
                    f'{caption_keys}\n', encoding="utf-8")
    done = anima_train_cli("config", toml, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    said = done.stderr.strip()
    assert "[dataset] cache_text_encoder_outputs = true keeps one Qwen3 output per caption" in said, said
    assert named in said and "set [dataset] cache_text_encoder_outputs = false, or turn those off" in said, said
    assert "Traceback" not in said and said.count("cache_text_encoder_outputs = true keeps") == 1, said


def test_caption_dropout_and_mixed_variants_may_stay(tiny_anima, latents_dir, tmp_path):
    cfg = cached_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, True)
    cfg.dataset.caption.caption_dropout_percent = 0.2
    cfg.dataset.caption.caption_mode = "mixed"
    from anima_train.config.validate import validate

    validate(cfg)


def test_the_plan_keeps_qwen3_in_host_memory_and_gives_its_room_to_the_blocks():
    """At 12 GiB b4 the plan puts Qwen3 on the GPU to save its copy-in; with the outputs cached no step needs it."""
    plain = plan.make_plan(config_for(4, "graph"), 12 * GIB, expandable=True)
    cfg = config_for(4, "graph")
    cfg.dataset.cache_text_encoder_outputs = True
    cached = plan.make_plan(cfg, 12 * GIB, expandable=True)
    assert plain.resident and not cached.resident
    assert cached.recomputed <= plain.recomputed
    text = plan.render(cached, "run.toml")
    assert "Qwen3 text encoder: in host memory, copied to the GPU only to encode a caption the first time" in text


def test_validation_reads_the_cache_and_gives_the_uncached_numbers(tiny_anima, latents_dir, tmp_path, monkeypatch):
    """Validation encodes each caption alone, as the cache does: its numbers are the uncached run's to the bit, and a
    later validation (or one whose shuffled captions the true ones already filled in) runs no Qwen3. Batch 1, so
    that training too encodes each caption alone either way and the two runs reach each validation with the same
    weights (in a padded batch a caption's Qwen3 output differs in the last bits: QwenOutputs says why)."""
    from anima_train.data.synthetic import make_synthetic_latents

    held_out = tmp_path / "held_out"
    make_synthetic_latents(held_out, n=3, seed=1)
    val = f'[optimizer]\nlr = 1e-3\n[validation]\nfolder = "{held_out}"\nevery_n_steps = 2\n'

    def run(name: str, cache: bool):
        cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / name, val, max_steps=4, batch_size=1)
        cfg.dataset.cache_text_encoder_outputs = cache
        return train(cfg, cpu=True)

    plain = run("a", False)
    encoded = []
    alone = QwenOutputs._encode_alone
    monkeypatch.setattr(QwenOutputs, "_encode_alone", lambda self, c: encoded.append(c) or alone(self, c))
    cached = run("b", True)
    assert [(p.step, p.loss, p.shuffled) for p in cached.validation] == \
        [(p.step, p.loss, p.shuffled) for p in plain.validation]
    held = {p.read_text(encoding="utf-8").strip() for p in held_out.glob("*.txt")}
    assert held <= set(encoded) and len(encoded) == len(set(encoded))  # each caption once, validation's included
