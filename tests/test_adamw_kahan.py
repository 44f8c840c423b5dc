"""AdamWKahan (`[optimizer] kind = "adamw"`, `use_kahan = true`): torch AdamW's arithmetic on bf16 weights with bf16
moments and a Kahan residual instead of fp32 copies. Checked against torch.optim.AdamW in fp32, the reference.

Each test fails on the thing it guards: plain bf16 AdamW (the weight rounded each step, no residual) realises about a
third of the fp32 update (`test_..._realises_the_fp32_update`); moments rounded to nearest freeze v at beta2 = 0.999
(`test_the_second_moment_keeps_moving_at_beta2_0999`); a residual or moment left out of the state breaks resume.
"""

from __future__ import annotations

import copy

import pytest
import torch

from anima_train.config import OptimizerConfig
from anima_train.training.adamw_kahan import AdamWKahan
from anima_train.training.optimizers import build_optimizer
from anima_train.training.train import train as run_training
from tests.test_train import make_cfg

SHAPES = [(64, 32), (32,), (128, 64)]


def weights(dtype) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    start = [(torch.randn(s) * 0.02).to(torch.bfloat16) for s in SHAPES]  # the same start for every run
    return [torch.nn.Parameter(w.to(dtype)) for w in start]


def steps(optimizer, params, n: int, scale: float = 1e-3) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        for p, s in zip(params, SHAPES):
            p.grad = (torch.randn(s, generator=g) * scale).to(p.dtype)
        optimizer.step()


def held(optimizer, p) -> torch.Tensor:
    """What the optimizer holds for `p` in fp32: the weight plus its residual."""
    residual = optimizer.state[p].get("residual")
    return p.detach().float() + (residual.float() if residual is not None else 0)


def test_fp32_tensors_step_as_torch_adamw():
    ref, ours = weights(torch.float32), weights(torch.float32)
    options = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    a, b = torch.optim.AdamW(ref, foreach=False, **options), AdamWKahan(ours, **options)
    steps(a, ref, 20)
    steps(b, ours, 20)
    for p, q in zip(ref, ours):
        assert "residual" not in b.state[q]
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-8)  # the same arithmetic, up to the order of roundings
        torch.testing.assert_close(b.state[q]["exp_avg_sq"], a.state[p]["exp_avg_sq"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.9, 0.999)])
def test_bf16_weights_with_the_residual_realise_the_fp32_update(betas):
    # lr 1e-5 on weights of ~0.02: each update is far below half a bf16 ulp (~6e-5 there)
    options = dict(lr=1e-5, betas=betas, weight_decay=0.01)
    ref, ours, plain = weights(torch.float32), weights(torch.bfloat16), weights(torch.bfloat16)
    start = [p.detach().float().clone() for p in ref]
    a, b, c = torch.optim.AdamW(ref, **options), AdamWKahan(ours, **options), torch.optim.AdamW(plain, **options)
    for opt, params in ((a, ref), (b, ours), (c, plain)):
        steps(opt, params, 60)
    d_ref = torch.cat([(p.detach() - s).flatten() for p, s in zip(ref, start)])
    d_ours = torch.cat([(held(b, p) - s).flatten() for p, s in zip(ours, start)])
    d_plain = torch.cat([(p.detach().float() - s).flatten() for p, s in zip(plain, start)])
    assert 0.98 < (d_ours.norm() / d_ref.norm()).item() < 1.02
    assert torch.nn.functional.cosine_similarity(d_ours, d_ref, dim=0).item() > 0.999
    assert (d_plain.norm() / d_ref.norm()).item() < 0.6  # what a bf16 AdamW without the residual keeps
    # the weight the model computes with is the held value rounded: the residual stays within half an ulp
    for p in ours:
        assert ((held(b, p) - p.detach().float()).abs() <= p.detach().float().abs() * 2**-8 + 1e-30).all()


def test_the_second_moment_keeps_moving_at_beta2_0999():
    # v's change per step is 0.1 % of v: below bf16's half ulp (0.2 %), so round-to-nearest would keep v at its
    # first value; stochastic rounding keeps it on the fp32 track on average
    options = dict(lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0)
    ref, ours = weights(torch.float32), weights(torch.bfloat16)
    a, b = torch.optim.AdamW(ref, **options), AdamWKahan(ours, **options)
    g = torch.Generator().manual_seed(2)
    for n in range(400):  # gradients that shrink 10x over the run: v must follow them down
        scale = 1e-3 * 10 ** (-n / 400)
        for p, q, s in zip(ref, ours, SHAPES):
            grad = torch.randn(s, generator=g) * scale
            p.grad, q.grad = grad, grad.to(torch.bfloat16)
        a.step()
        b.step()
    for p, q in zip(ref, ours):
        v_ref, v_ours = a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"].float()
        assert abs(v_ours.mean().item() / v_ref.mean().item() - 1) < 0.03


def test_state_dict_round_trip_continues_bit_exactly():
    options = dict(lr=1e-4, betas=(0.9, 0.999))
    first = weights(torch.bfloat16)
    a = AdamWKahan(first, **options)
    steps(a, first, 3)
    state = copy.deepcopy(a.state_dict())  # a state_dict holds the live tensors: a's next steps would change it
    assert {k for k in state["state"][0]} == {"step", "exp_avg", "exp_avg_sq", "residual"}
    # nothing beside the tensors that follow their parameters: accelerate moves every tensor of a state_dict to
    # the device and loads it back when it prepares the optimizer, and a torch.Generator's state moved to CUDA is
    # refused ("RNG state must be a torch.ByteTensor": the first full-size run of the generator-seeded version)
    assert set(state) == {"state", "param_groups"}
    assert all(v.dtype == torch.bfloat16 for s in state["state"].values() for k, v in s.items() if k != "step")
    second = [torch.nn.Parameter(p.detach().clone()) for p in first]
    b = AdamWKahan(second, **options)
    b.load_state_dict(state)
    torch.manual_seed(123)  # the global generator plays no part: the rounding noise is a hash (step, place)
    steps(a, first, 2)
    steps(b, second, 2)
    for p, q in zip(first, second):
        assert torch.equal(p, q) and torch.equal(a.state[p]["residual"], b.state[q]["residual"])


def test_the_compiled_step_matches_the_eager_one():
    # the trainer compiles the step on CUDA; here Inductor's CPU backend compiles the same functions. The tensors
    # make buckets that are cut into every chunk length (21 alike: 16 + 4 + 1; two shapes of one length among
    # them), an fp32 tensor takes the other function. Fused, the fp32 roundings may differ in order: the held
    # weight (weight + residual) the same to fp32 precision, the moments within a bf16 ulp (rounded
    # stochastically from values a rounding apart)
    shapes = [(8, 16)] * 11 + [(16, 8)] * 10 + [(32,), (64, 32)]
    torch.manual_seed(0)
    start = [(torch.randn(s) * 0.02).to(torch.bfloat16) for s in shapes] + [torch.randn(24) * 0.02]
    options = dict(lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    runs = []
    for compiled in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in start]
        optimizer = AdamWKahan(params, compiled=compiled, **options)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in params:
                p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)
            optimizer.step()
        runs.append((optimizer, params))
    # bf16: three chunk lengths of rank 2, one of rank 1; fp32: one. Past dynamo's recompile limit (8 per
    # function) it would step eagerly, and a graph per tensor (as before the buckets held their rank) gets there
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 5
    (a, eager), (b, fused) = runs
    for p, q in zip(eager, fused):
        # atol: 0.03 % of the ~3e-4 each element moved in 3 steps
        torch.testing.assert_close(held(b, q), held(a, p), rtol=1e-5, atol=1e-7)
        for key, atol in (("exp_avg", 1e-9), ("exp_avg_sq", 1e-14)):  # atol: m and v near zero (~2e-4, ~3e-9 here)
            torch.testing.assert_close(b.state[q][key], a.state[p][key], rtol=2**-7, atol=atol)


def test_a_state_without_the_residual_is_refused():
    params = weights(torch.bfloat16)
    other = torch.optim.AdamW(params, lr=1e-4)
    steps(other, params, 1)
    with pytest.raises(ValueError, match="no Kahan residual"):
        AdamWKahan(params, lr=1e-4).load_state_dict(other.state_dict())


def test_fp16_is_refused():
    with pytest.raises(ValueError, match="bfloat16 and float32"):
        build_optimizer([{"params": [torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))], "lr": 1e-3}],
                        OptimizerConfig(kind="adamw", use_kahan=True))


def test_a_bf16_full_finetune_resumes_bit_exactly(tiny_anima, latents_dir, tmp_path):
    extra = 'kind = "none"\n[optimizer]\nlr = 1e-4\nuse_kahan = true\n'
    keys = dict(max_steps=5, save_every_steps=2, save_optimizer_state="true", dtype='"bfloat16"')
    full = run_training(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "a", extra, **keys), cpu=True)
    resumed = run_training(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "b", extra, **keys,
                                    resume_from=f'"{tmp_path / "a" / "tiny" / "tiny-step000002.safetensors"}"'),
                           cpu=True)
    assert resumed.losses == full.losses[2:]
    assert resumed.trainable_digest == full.trainable_digest
