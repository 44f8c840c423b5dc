"""Flow-matching math (docs/training.md#flow-matching-and-timesteps, #curriculum, #ot-noise-pairing): timestep
distributions against the measured tables,
shift/curriculum order, truncation that cannot hang, OT pairing, the hf token loss and its off-switch."""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch
import torch.nn.functional as F

from anima_train.training import flow
from anima_train.config import CurriculumPhase, FlowConfig
from anima_train.training.flow import (active_phase, flow_loss, flux_shift_mu, hf_token_weights, noisy_latents,
    ot_pair_noise, sample_timesteps, velocity_target)

N = 20_000  # the draw count of the measured tables

# Tolerance for the measured tables: those numbers are single 20k-draw samples, so each carries its own sampling
# error. The standard error of a p10/p90 quantile is sqrt(0.09/N)/φ(1.2816) ≈ 0.012 in z, i.e. ≤ 0.003 in t
# (dt/dz = scale·t(1−t) ≤ 0.25·scale); of a mean ≈ 0.0017. Two independent samples then differ by up to ~4 SE
# ≈ 0.01 without anything being wrong, while a wrong scale/shift/mapping moves these numbers by ≥ 0.03.
TOL = 0.01


def _quantiles(t, qs):
    return torch.quantile(t.double(), torch.tensor(qs, dtype=torch.float64)).tolist()


def _gen(seed=1234):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------ timesteps


@pytest.mark.parametrize("scale,p10,p90", [(0.5, 0.343, 0.653), (1.0, 0.214, 0.780), (2.0, 0.069, 0.926)])
def test_sigmoid_scale_percentiles(scale, p10, p90):
    t = sample_timesteps(N, FlowConfig(sigmoid_scale=scale), _gen())
    got10, got90 = _quantiles(t, [0.1, 0.9])
    assert got10 == pytest.approx(p10, abs=TOL) and got90 == pytest.approx(p90, abs=TOL)
    assert t.mean().item() == pytest.approx(0.5, abs=TOL)  # "mean roughly unchanged"
    assert t.dtype == torch.float32 and t.shape == (N,)


def test_uniform_and_generator_only():
    state = torch.get_rng_state()
    a = sample_timesteps(N, FlowConfig(timestep_sample_method="uniform"), _gen(7))
    b = sample_timesteps(N, FlowConfig(timestep_sample_method="uniform"), _gen(7))
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is never touched
    assert torch.equal(a, b)
    assert 0.0 <= a.min() and a.max() < 1.0
    assert _quantiles(a, [0.1, 0.5, 0.9]) == pytest.approx([0.1, 0.5, 0.9], abs=TOL)


def test_static_shift_formula():
    raw = torch.sigmoid(torch.randn(64, generator=_gen(3)))
    got = sample_timesteps(64, FlowConfig(shift=3.0), _gen(3))
    torch.testing.assert_close(got, 3 * raw / (1 + 2 * raw))


# docs/training.md#curriculum's table: on [0, 0.6], logit_normal with sigmoid_scale 1.3 -> mean, p50, p90.
CURRICULUM_TABLE = {"full": (0.499, 0.499, 0.840), "rescale": (0.300, 0.299, 0.504),
                    "truncate": (0.338, 0.344, 0.548)}


@pytest.mark.parametrize("mapping", list(CURRICULUM_TABLE))
def test_curriculum_table(mapping):
    cfg = FlowConfig(sigmoid_scale=1.3, phase_mapping="rescale" if mapping == "full" else mapping)
    phase = None if mapping == "full" else CurriculumPhase(at=0.15, t_range=[0.0, 0.6])
    t = sample_timesteps(N, cfg, _gen(), phase=phase)
    mean, p50, p90 = CURRICULUM_TABLE[mapping]
    assert t.mean().item() == pytest.approx(mean, abs=TOL)
    assert _quantiles(t, [0.5, 0.9]) == pytest.approx([p50, p90], abs=TOL)
    assert t.shape == (N,) and 0.0 <= t.min() and t.max() <= (1.0 if phase is None else 0.6)


@pytest.mark.parametrize("mapping", ["rescale", "truncate"])
def test_full_range_phase_is_bit_identical_to_no_curriculum(mapping):
    cfg = FlowConfig(shift=3.0, phase_mapping=mapping)
    a = sample_timesteps(33, cfg, _gen(5))
    b = sample_timesteps(33, cfg, _gen(5), phase=CurriculumPhase(t_range=[0.0, 1.0]))
    assert torch.equal(a, b)


def test_shift_is_applied_before_the_range_map():
    lo, hi = 0.2, 0.6
    t = sample_timesteps(256, FlowConfig(shift=3.0), _gen(9), phase=CurriculumPhase(t_range=[lo, hi]))
    u = torch.sigmoid(torch.randn(256, generator=_gen(9)))
    shift_then_map = (3 * u / (1 + 2 * u)) * (hi - lo) + lo
    mapped = u * (hi - lo) + lo
    map_then_shift = 3 * mapped / (1 + 2 * mapped)
    torch.testing.assert_close(t, shift_then_map)
    assert (t - map_then_shift).abs().max() > 0.05  # the two orders really differ


def test_truncate_keeps_density_and_draw_order():
    t = sample_timesteps(50, FlowConfig(phase_mapping="truncate"), _gen(11), phase=(0.3, 0.7))
    pool = torch.sigmoid(torch.randn(200, generator=_gen(11)))  # round one: 4 x B candidates
    want = pool[(pool >= 0.3) & (pool <= 0.7)][:50]
    assert len(want) == 50  # (~60% land in range; this seed fills the batch in one round)
    torch.testing.assert_close(t, want)


def test_truncate_raises_instead_of_hanging():
    cfg = FlowConfig(phase_mapping="truncate", shift=3.0)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"t_range = \[0.0, 1e-09\].*rescale"):
        sample_timesteps(8, cfg, _gen(), phase=CurriculumPhase(t_range=[0.0, 1e-9]))
    assert time.perf_counter() - start < 5.0


def test_bad_phase_range_is_named():
    with pytest.raises(ValueError, match="divide discrete ones by 1000"):
        sample_timesteps(4, FlowConfig(), _gen(), phase=(0, 600))


def test_flux_shift_crosses_static_shift_3_near_1024px():
    def shifted(px):
        h = w = px // 8
        return sample_timesteps(512, FlowConfig(flux_shift=True), _gen(2), latent_hw=(h, w))

    static = sample_timesteps(512, FlowConfig(shift=3.0), _gen(2))
    interior = (static > 0.01) & (static < 0.99)
    assert (shifted(960) < static)[interior].all()
    assert (shifted(1024) > static)[interior].all()
    # Exact crossing: e^mu = 3 -> tokens = 256 + (ln 3 - 0.5)/0.65 * 3840; side = 16 px per token side.
    side_px = 16 * math.sqrt(256 + (math.log(3) - 0.5) / 0.65 * 3840)
    assert 950 < side_px < 1024
    assert math.exp(flux_shift_mu(side_px / 8, side_px / 8)) == pytest.approx(3.0)
    assert flux_shift_mu(32, 32) == pytest.approx(0.5) and flux_shift_mu(128, 128) == pytest.approx(1.15)
    # Endpoints stay put: t = 0 -> 0, t = 1 -> 1.
    torch.testing.assert_close(flow.flux_shift_timesteps(torch.tensor([0.0, 1.0]), 1.0), torch.tensor([0.0, 1.0]))


def test_flux_shift_needs_the_latent_size_and_excludes_shift():
    with pytest.raises(ValueError, match="latent_hw"):
        sample_timesteps(4, FlowConfig(flux_shift=True), _gen())
    with pytest.raises(ValueError, match="exclusive"):
        sample_timesteps(4, FlowConfig(flux_shift=True, shift=3.0), _gen(), latent_hw=(64, 64))


def test_active_phase():
    phases = [CurriculumPhase(at=0.5, t_range=[0.0, 0.6]), CurriculumPhase(at=0.0),
              CurriculumPhase(at=0.15, t_range=[0.2, 0.8])]
    assert active_phase([], 0.3) is None
    assert active_phase(phases, 0.0).at == 0.0
    assert active_phase(phases, 0.1499).at == 0.0
    assert active_phase(phases, 0.15).at == 0.15
    assert active_phase(phases, 0.9).at == 0.5
    assert active_phase(phases, 1.7).at == 0.5


# ------------------------------------------------------------------------------------------------ noising, OT


def test_noising_and_target():
    x0, noise = torch.randn(3, 16, 1, 4, 6), torch.randn(3, 16, 1, 4, 6)
    t = torch.tensor([0.0, 0.25, 1.0])
    x_t = noisy_latents(x0, noise, t)
    torch.testing.assert_close(x_t[0], x0[0])
    torch.testing.assert_close(x_t[2], noise[2])
    torch.testing.assert_close(x_t[1], 0.75 * x0[1] + 0.25 * noise[1])
    torch.testing.assert_close(velocity_target(x0, noise), noise - x0)
    assert noisy_latents(x0.bfloat16(), noise.bfloat16(), t).dtype == torch.bfloat16


def _cost(latents, noise):
    a = F.normalize(latents.flatten(1), dim=1)
    b = F.normalize(noise.flatten(1), dim=1)
    return -(a * b).sum(1).sum().item()  # total -cosine of the chosen pairs


def test_ot_identity_for_batch_one():
    x, n = torch.randn(1, 16, 1, 4, 4), torch.randn(1, 16, 1, 4, 4)
    out, moved = ot_pair_noise(x, n)
    assert out is n and moved == 0.0


def test_ot_finds_the_optimal_permutation():
    g = _gen(4)
    x = torch.randn(5, 16, 1, 4, 4, generator=g)
    n = torch.randn(5, 16, 1, 4, 4, generator=g)
    out, moved = ot_pair_noise(x, n)
    brute = min(_cost(x, n[list(p)]) for p in itertools.permutations(range(5)))
    assert _cost(x, out) == pytest.approx(brute, abs=1e-5)
    assert _cost(x, out) <= _cost(x, n) + 1e-6
    # out is a row permutation of n; `moved` counts the rows not in place.
    rows = [next(j for j in range(5) if torch.equal(out[i], n[j])) for i in range(5)]
    assert sorted(rows) == list(range(5))
    assert moved == pytest.approx(sum(r != i for i, r in enumerate(rows)) / 5)


def test_ot_recovers_a_planted_pairing():
    g = _gen(8)
    x = torch.randn(6, 16, 1, 8, 8, generator=g)
    perm = torch.tensor([3, 0, 1, 5, 4, 2])  # row 4 stays
    noise = (x + 0.3 * torch.randn(x.shape, generator=g))[perm]
    out, moved = ot_pair_noise(x, noise)
    assert torch.equal(out, noise[torch.argsort(perm)])  # every latent got its own planted noise row back
    assert _cost(x, out) < _cost(x, noise) - 1.0
    assert moved == pytest.approx(5 / 6)


def test_ot_without_scipy_is_identity(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # makes `from scipy.optimize import ...` fail
    x, n = torch.randn(4, 16, 1, 4, 4), torch.randn(4, 16, 1, 4, 4)
    out, moved = ot_pair_noise(x, n)
    assert out is n and moved == 0.0


# ------------------------------------------------------------------------------------------------ hf loss


def ref_weights(x0, gamma, eps=1e-6):
    """Written independently: Laplacian by conv2d on a replicate-padded plane, tokens by reshape."""
    b, c, f, h, w = x0.shape
    planes = x0.float().reshape(b * c * f, 1, h, w)
    kernel = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]]).view(1, 1, 3, 3)
    lap = F.conv2d(F.pad(planes, (1, 1, 1, 1), mode="replicate"), kernel).reshape(b, c, f, h, w)
    d = lap.square().reshape(b, c, f, h // 2, 2, w // 2, 2).mean(dim=(1, 4, 6))  # [b, f, h/2, w/2]
    mean_d = d.reshape(b, -1).mean(1).view(b, 1, 1, 1)
    wts = ((d + eps) / (mean_d + eps)) ** gamma
    return wts / wts.reshape(b, -1).mean(1).view(b, 1, 1, 1)


def _latents(b=3, h=8, w=12, seed=0):
    g = _gen(seed)
    x0 = torch.randn(b, 16, 1, h, w, generator=g)
    x0[:, :, :, :, : w // 2] *= 0.05  # a flat half and a detailed half
    return x0, torch.randn(b, 16, 1, h, w, generator=g), torch.rand(b, generator=g)


@pytest.mark.parametrize("gamma", [0.5, 1.0, 3.0])
def test_hf_weights_match_reference_and_mean_one(gamma):
    x0, _, _ = _latents()
    w = hf_token_weights(x0, 2, gamma)
    assert w.shape == (3, 1, 4, 6)
    torch.testing.assert_close(w, ref_weights(x0, gamma), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.flatten(1).mean(1), torch.ones(3), rtol=0, atol=1e-6)
    assert w[..., 3:].mean() > w[..., :3].mean()  # detail gets the weight


def test_hf_exponent_concentrates():
    x0, _, _ = _latents(h=16, w=16)
    shares = []
    for gamma in (0.5, 1.0, 2.0, 3.0):
        w = hf_token_weights(x0, 2, gamma).flatten(1)
        top = w.topk(w.shape[1] // 10, dim=1).values.sum(1) / w.sum(1)
        shares.append(top.mean().item())
    assert shares == sorted(shares) and shares[-1] > shares[0] + 0.1


def test_hf_weights_flat_target_and_padding():
    # Constant planes: the replicate-padded Laplacian is 0 everywhere (zero padding would light up the border),
    # and eps keeps 0/0 finite -> every weight exactly 1.
    x0 = torch.full((2, 16, 1, 6, 6), 3.0)
    w = hf_token_weights(x0, 2, 1.5)
    assert torch.isfinite(w).all()
    torch.testing.assert_close(w, torch.ones_like(w))
    torch.testing.assert_close(hf_token_weights(torch.zeros(1, 16, 1, 4, 4)), torch.ones(1, 1, 2, 2))


def test_hf_weights_with_mask_normalise_over_the_mask():
    x0, _, _ = _latents()
    mask = torch.zeros(3, 1, 1, 8, 12)
    mask[:, :, :, 2:8, 3:11] = 1.0
    mask[2] = 0.0  # a sample with nothing supervised
    w = hf_token_weights(x0, 2, 1.0, mask)
    m = mask.reshape(3, 1, 1, 4, 2, 6, 2).mean(dim=(4, 6)).reshape(3, 1, 4, 6)
    torch.testing.assert_close((w * m).flatten(1).sum(1)[:2], m.flatten(1).sum(1)[:2])
    assert torch.isfinite(w).all() and (w[2] == 0).all()


def test_flow_loss_hf_term_matches_reference_and_uses_the_target():
    x0, noise, t = _latents()
    x_t = noisy_latents(x0, noise, t)
    pred = torch.randn(x0.shape, generator=_gen(99))
    total, parts = flow_loss(pred, x0, noise, x_t, t, hf_scale=0.25, hf_exponent=1.0)

    mse = ((pred - (noise - x0)) ** 2).mean()
    x0_hat = x_t - t.view(-1, 1, 1, 1, 1) * pred
    err = ((x0_hat - x0) ** 2).reshape(3, 16, 1, 4, 2, 6, 2).mean(dim=(1, 4, 6))
    hf = (ref_weights(x0, 1.0) * err).mean()
    torch.testing.assert_close(parts["mse"], mse)
    torch.testing.assert_close(parts["hf"], hf)
    torch.testing.assert_close(total, mse + 0.25 * hf)
    # Negative control: weights taken from the prediction's x0 estimate give a different loss.
    wrong = (ref_weights(x0_hat, 1.0) * err).mean()
    assert (wrong - hf).abs() > 1e-3 * hf
    # The weights do not follow the prediction: a different prediction changes only the error term.
    pred2 = pred * 0.5
    _, parts2 = flow_loss(pred2, x0, noise, x_t, t, hf_scale=0.25, hf_exponent=1.0)
    err2 = ((x_t - t.view(-1, 1, 1, 1, 1) * pred2 - x0) ** 2).reshape(3, 16, 1, 4, 2, 6, 2).mean(dim=(1, 4, 6))
    torch.testing.assert_close(parts2["hf"], (ref_weights(x0, 1.0) * err2).mean())


def test_flow_loss_hf_gradient_flows_to_pred():
    x0, noise, t = _latents()
    pred = torch.randn(x0.shape, requires_grad=True)
    total, _ = flow_loss(pred, x0, noise, noisy_latents(x0, noise, t), t, hf_scale=1.0, hf_exponent=1.0)
    total.backward()
    assert pred.grad is not None and torch.isfinite(pred.grad).all()


def test_hf_scale_zero_is_plain_mse_with_nothing_else(monkeypatch):
    x0, noise, t = _latents()
    x_t = noisy_latents(x0, noise, t)
    pred = torch.randn(x0.shape, generator=_gen(5)).bfloat16()

    def boom(*args, **kwargs):
        raise AssertionError("hf path entered with hf_scale = 0")

    monkeypatch.setattr(flow, "hf_token_weights", boom)
    monkeypatch.setattr(flow, "_token_mean", boom)
    gen = _gen(21)
    gen_state, rng_state = gen.get_state(), torch.get_rng_state()
    total, parts = flow_loss(pred, x0, noise, x_t, t, hf_scale=0.0, hf_exponent=2.0)
    assert torch.equal(gen.get_state(), gen_state) and torch.equal(torch.get_rng_state(), rng_state)
    plain = F.mse_loss(pred.float(), (noise - x0).float())  # the training loss of docs/model.md#flow-matching
    assert torch.equal(total, plain) and set(parts) == {"mse"}


def test_masked_mse():
    x0, noise, t = _latents()
    pred = torch.randn(x0.shape, generator=_gen(6))
    mask = torch.zeros(3, 1, 1, 8, 12)
    mask[:, :, :, 1:7, 2:9] = 1.0
    total, parts = flow_loss(pred, x0, noise, noisy_latents(x0, noise, t), t, mask=mask)
    se = (pred - (noise - x0)) ** 2
    want = se[mask.expand_as(se).bool()].mean()
    torch.testing.assert_close(total, want)
    assert (total - F.mse_loss(pred, noise - x0)).abs() > 1e-4  # the mask matters
    # A soft (feathered) mask is a weighted mean: scaling every weight changes nothing, down-weighting a region does.
    total2, _ = flow_loss(pred, x0, noise, noisy_latents(x0, noise, t), t, mask=mask * 2)
    torch.testing.assert_close(total2, total)
    soft = mask.clone()
    soft[..., 1:3, :] *= 0.5
    total3, _ = flow_loss(pred, x0, noise, noisy_latents(x0, noise, t), t, mask=soft)
    m = soft.expand_as(se)
    torch.testing.assert_close(total3, (se * m).sum() / m.sum())
    assert (total3 - total).abs() > 1e-6


def test_masked_hf_term_ignores_unsupervised_tokens():
    x0, noise, t = _latents()
    x_t = noisy_latents(x0, noise, t)
    pred = torch.randn(x0.shape, generator=_gen(7))
    mask = torch.zeros(3, 1, 1, 8, 12)
    mask[:, :, :, :, 4:] = 1.0
    _, parts = flow_loss(pred, x0, noise, x_t, t, hf_scale=1.0, hf_exponent=1.0, mask=mask)
    pred2 = pred.clone()
    pred2[..., :4] += 10.0  # change the prediction only where the mask is 0
    _, parts2 = flow_loss(pred2, x0, noise, x_t, t, hf_scale=1.0, hf_exponent=1.0, mask=mask)
    torch.testing.assert_close(parts2["hf"], parts["hf"])
    torch.testing.assert_close(parts2["mse"], parts["mse"])


def test_four_d_latents_work_too():
    x0 = torch.randn(2, 16, 8, 8)
    assert hf_token_weights(x0).shape == (2, 4, 4)
    with pytest.raises(ValueError, match="divisible by the patch"):
        hf_token_weights(torch.randn(1, 16, 1, 5, 8))
