"""anchor.modules: band law, relay/multiband3 math, inert fresh adapters, lesions, strength."""
import math

import pytest
import torch

from anchor import AnchorError
from anchor.modules import (MultibandAdapter, RelayAdapter, adapter_output, band_weights, build_adapter,
                            fresh_anchor)


# Expected values computed by hand from the band law (docs/anchor.md#band-gating):
#   ramp(x) = 0.5 - 0.5 cos(pi (clamp(x/0.06, -1, 1) + 1) / 2); up1 = ramp(s-0.35); up2 = ramp(s-0.75)
#   w = [1-up1, up1(1-up2), up1 up2]
# 0.32: x/0.06 = -0.5 -> ramp = 0.5 - 0.5 cos(pi/4) = 0.5 - 0.35355339 = 0.14644661
@pytest.mark.parametrize("s01, expected", [
    (0.0, [1.0, 0.0, 0.0]),
    (0.29, [1.0, 0.0, 0.0]),     # exactly one crossfade half-width below the first edge
    (0.32, [0.85355339, 0.14644661, 0.0]),
    (0.35, [0.5, 0.5, 0.0]),     # on the edge: cos(pi/2) = 0
    (0.41, [0.0, 1.0, 0.0]),     # one half-width above: fully MID
    (0.75, [0.0, 0.5, 0.5]),
    (1.0, [0.0, 0.0, 1.0]),
])
def test_band_weights_pinned_values(s01, expected):
    w = band_weights(s01)
    assert w.shape == (3,)
    assert w.tolist() == pytest.approx(expected, abs=1e-7)


def test_band_weights_sum_to_one_everywhere_and_batch():
    s = torch.linspace(-0.5, 1.5, 20001, dtype=torch.float64)
    w = band_weights(s)
    assert w.shape == (20001, 3)
    assert torch.allclose(w.sum(-1), torch.ones_like(s), atol=1e-12, rtol=0)
    assert (w >= 0).all()
    w32 = band_weights(torch.tensor([0.1, 0.5, 0.9]))
    assert w32.dtype == torch.float32 and w32.argmax(-1).tolist() == [0, 1, 2]


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def test_relay_forward_matches_closed_form():
    torch.manual_seed(0)
    relay = RelayAdapter(d=12, n_slots=3, K=5, hidden=7, tau=0.5)
    _randomize(relay, 1)
    x = torch.randn(2, 4, 12, dtype=torch.float64)
    relay = relay.double()
    # Direct formula (no stabilisation; tau = 0.5 keeps sinh/cosh small).
    A = torch.nn.functional.normalize(relay.addr.codebook, dim=-1)
    s = (x @ relay.proj.weight.T).view(2, 4, 3, 4)
    u = torch.nn.functional.normalize(s, dim=-1) @ A.T / 0.5
    m_hat = (torch.sinh(u) @ A) / torch.cosh(u).sum(-1, keepdim=True)
    h = m_hat.reshape(2, 4, 12) @ relay.consume[0].weight.T + relay.consume[0].bias
    h = torch.nn.functional.layer_norm(torch.relu(h) ** 2, (7,), relay.consume[2].weight, relay.consume[2].bias)
    h = h @ relay.consume[3].weight.T + relay.consume[3].bias
    expected = x + torch.sigmoid(relay.gate) * h
    assert torch.allclose(relay(x), expected, atol=1e-12)


def test_relay_soft_read_is_stable_at_small_tau():
    torch.manual_seed(0)
    relay = RelayAdapter(d=8, n_slots=2, K=64, hidden=5, tau=0.001)  # |u| up to 1000: exp would overflow
    out = relay.addr(torch.randn(3, 2, 4))
    assert torch.isfinite(out).all()


def test_multiband_forward_matches_formula_and_lesions():
    torch.manual_seed(0)
    mb = MultibandAdapter(d=6, rank=2).double()
    _randomize(mb, 2)
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    w = band_weights(torch.tensor([0.2, 0.74], dtype=torch.float64))  # per-sample levels
    g = torch.sigmoid(mb.gates)
    terms = [g[b] * w[:, b].view(2, 1, 1) * mb.up[b](mb.down[b](x)) for b in range(3)]
    assert torch.allclose(mb(x, w), x + terms[0] + terms[1] + terms[2], atol=1e-12)
    mb.band_enabled[1] = False  # lesion: skipped, the other bands are NOT renormalised
    assert torch.allclose(mb(x, w), x + terms[0] + terms[2], atol=1e-12)
    mb.band_enabled = [False, False, False]
    assert torch.equal(mb(x, w), x)
    with pytest.raises(AnchorError, match="set_noise_level"):
        MultibandAdapter(4, 2)(torch.randn(1, 4))


@pytest.mark.parametrize("kind", ["relay", "multiband3"])
def test_fresh_adapters_are_exactly_inert(kind):
    anchor = fresh_anchor(kind, [16, 24], family="cosmos_dit", n_slots=2, K=8, hidden=6, rank=4)
    x = torch.randn(2, 5, 16) * 100
    mod = build_adapter(kind, anchor.per_site(0))
    assert torch.equal(adapter_output(mod, x, s01=0.5), x)
    assert torch.equal(mod(x, band_weights(0.5).float()), x)
    assert mod.state_dict()["gate" if kind == "relay" else "gates"].eq(-3.0).all()


def test_fresh_anchor_is_seeded_and_keeps_global_rng():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = fresh_anchor("relay", [8], seed=7, n_slots=2, K=4, hidden=3)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = fresh_anchor("relay", [8], seed=7, n_slots=2, K=4, hidden=3)
    c = fresh_anchor("relay", [8], seed=8, n_slots=2, K=4, hidden=3)
    assert torch.equal(a.adapters["0.proj.weight"], b.adapters["0.proj.weight"])
    assert not torch.equal(a.adapters["0.proj.weight"], c.adapters["0.proj.weight"])
    assert torch.equal(a.adapters["0.addr.home"], a.adapters["0.addr.codebook"])


def test_adapter_output_strength_channel_axis_and_cfg_batch():
    torch.manual_seed(0)
    mb = MultibandAdapter(d=8, rank=3)
    _randomize(mb, 3)
    x5 = torch.randn(4, 1, 2, 2, 8)  # Cosmos native [B, T, H, W, D]; batch = cond + uncond of 2 samples
    s01 = torch.tensor([0.1, 0.9])
    full = adapter_output(mb, x5, s01, strength=1.0)
    half = adapter_output(mb, x5, s01, strength=0.5)
    assert torch.allclose(half - x5, 0.5 * (full - x5), atol=1e-6)
    assert adapter_output(mb, x5, s01, strength=0.0) is x5  # bit-exact: the very same tensor
    w = band_weights(s01).repeat(2, 1).view(4, 1, 1, 1, 3)
    assert torch.allclose(full, x5 + mb.delta(x5, band_weights(s01).repeat(2, 1)), atol=1e-6)
    assert torch.allclose(full, x5 + sum(torch.sigmoid(mb.gates)[b] * w[..., b:b + 1] * mb.up[b](mb.down[b](x5))
                                         for b in range(3)), atol=1e-6)
    fmap = x5.reshape(4, 2, 2, 8).permute(0, 3, 1, 2)  # [B, C, H, W] feature map: channel axis 1
    out = adapter_output(mb, fmap, s01, channel_axis=1)
    assert torch.allclose(out.permute(0, 2, 3, 1), full.reshape(4, 2, 2, 8), atol=1e-6)
    with pytest.raises(AnchorError, match="divide"):
        adapter_output(mb, torch.randn(3, 8), s01)


def test_build_adapter_rejects_foreign_tensors():
    with pytest.raises(AnchorError, match="relay layout"):
        build_adapter("relay", {"proj.weight": torch.zeros(8, 4)}, where="x.pt site 0")
    with pytest.raises(AnchorError, match="does not attach"):
        build_adapter("mono", {})


def test_no_torch_at_package_import():
    import subprocess
    import sys
    code = "import sys, anchor, anchor.sites; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert math.isclose(__import__("anchor").XFADE, 0.06)
