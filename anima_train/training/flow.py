"""Flow-matching math: timestep sampling (incl. curriculum ranges), noising, OT noise pairing, the loss with the
optional high-frequency token term (docs/training.md#flow-matching-and-timesteps, #curriculum and
#ot-noise-pairing).

    t = sample_timesteps(B, cfg.flow, gen, latent_hw=(h, w), phase=active_phase(cfg.curriculum, progress))
    noise, moved = ot_pair_noise(x0, noise) if cfg.flow.use_ot else (noise, 0.0)
    x_t = noisy_latents(x0, noise, t)
    pred = transformer(x_t, timestep=t, ...)
    loss, parts = flow_loss(pred, x0, noise, x_t, t, cfg.flow.hf_scale, cfg.flow.hf_exponent, mask)

Latents are 5-D [B, 16, 1, h, w] (docs/model.md#tensors-and-shapes); 4-D [B, C, h, w] works too. t is [B] in
[0, 1], t = 1 is noise.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from anima_train.config import CurriculumPhase, FlowConfig
from anima_train.config.schema import active_phase as active_phase  # the phase is the config's; named here too

PATCH = 2  # the DiT's spatial patch (patch_size = (1, 2, 2)): one token = 2x2 latent pixels
HF_EPS = 1e-6  # keeps a flat target's weights finite (0/0 otherwise)
TRUNCATE_ROUNDS = 64  # rejection rounds of 4*B draws before a truncated range is declared (almost) empty
# flux_shift: mu is linear in the token count between these two points
# (docs/training.md#flow-matching-and-timesteps).
FLUX_TOKENS = (256, 4096)
FLUX_MU = (0.5, 1.15)


# ------------------------------------------------------------------------------------------------ timesteps


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """Static shift t' = t·s / (1 + (s−1)·t): s > 1 moves mass toward noise (3.0 = Anima's inference shift)."""
    return t * shift / (1.0 + (shift - 1.0) * t)


def flux_shift_mu(latent_h: int, latent_w: int) -> float:
    """μ of the resolution-dependent shift: linear in tokens (h/2)·(w/2), (256, 0.5) → (4096, 1.15)."""
    tokens = (latent_h / PATCH) * (latent_w / PATCH)
    (x0, x1), (y0, y1) = FLUX_TOKENS, FLUX_MU
    return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


def flux_shift_timesteps(t: torch.Tensor, mu: float) -> torch.Tensor:
    """t' = e^μ / (e^μ + (1/t − 1)): the static shift with s = e^μ (t = 0 stays 0 via 1/0 = inf)."""
    return math.exp(mu) / (math.exp(mu) + (1.0 / t - 1.0))


def _draw(n: int, cfg: FlowConfig, generator: torch.Generator, latent_hw: tuple[int, int] | None) -> torch.Tensor:
    """n timesteps from the base distribution, shifted. Only `generator` is drawn from."""
    device = generator.device
    if cfg.timestep_sample_method == "uniform":
        t = torch.rand(n, generator=generator, device=device)
    else:  # "logit_normal" (the FlowConfig checked its choice when it was built)
        t = torch.sigmoid(cfg.sigmoid_scale * torch.randn(n, generator=generator, device=device))
    if cfg.flux_shift:
        if latent_hw is None:
            raise ValueError("flow.flux_shift needs the batch's latent size: pass latent_hw=(h, w)")
        t = flux_shift_timesteps(t, flux_shift_mu(*latent_hw))
    elif cfg.shift is not None:
        t = shift_timesteps(t, cfg.shift)
    return t


def _phase_range(phase: CurriculumPhase | Sequence[float] | None) -> tuple[float, float]:
    if phase is None:
        return 0.0, 1.0
    lo, hi = phase.t_range if hasattr(phase, "t_range") else phase
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"curriculum t_range = [{lo}, {hi}] needs 0 <= lo < hi <= 1 (continuous timesteps; "
                         "divide discrete ones by 1000)")
    return float(lo), float(hi)


def sample_timesteps(batch: int, cfg: FlowConfig, generator: torch.Generator,
                     latent_hw: tuple[int, int] | None = None,
                     phase: CurriculumPhase | Sequence[float] | None = None) -> torch.Tensor:
    """[batch] float32 timesteps on the generator's device.

    Draw (uniform, or σ(sigmoid_scale·N(0,1))), then shift or flux_shift (latent_hw = latent (h, w)), THEN the
    phase's t_range (docs/training.md#curriculum: the order matters, shift is nonlinear). `rescale` maps
    t·(hi−lo)+lo, keeping every quantile's shape; `truncate` keeps the pretraining density by rejection in rounds of
    4·batch draws and raises after TRUNCATE_ROUNDS rather than hang. A full [0, 1] range (or no phase) draws exactly
    as without a curriculum."""
    lo, hi = _phase_range(phase)
    if (lo, hi) == (0.0, 1.0):
        return _draw(batch, cfg, generator, latent_hw)
    if cfg.phase_mapping == "rescale":
        return _draw(batch, cfg, generator, latent_hw) * (hi - lo) + lo
    kept, count = [], 0
    for _ in range(TRUNCATE_ROUNDS):
        t = _draw(4 * batch, cfg, generator, latent_hw)
        t = t[(t >= lo) & (t <= hi)]
        kept.append(t)
        count += t.numel()
        if count >= batch:
            return torch.cat(kept)[:batch]
    raise ValueError(f"curriculum t_range = [{lo}, {hi}] holds almost no probability under "
                     f"flow.timestep_sample_method = {cfg.timestep_sample_method!r} (shift {cfg.shift}, "
                     f"flux_shift {cfg.flux_shift}): {count} of {TRUNCATE_ROUNDS * 4 * batch} draws landed in it. "
                     "Widen the range or use flow.phase_mapping = \"rescale\"")


def phase_summary(phases: Sequence[CurriculumPhase], phase: CurriculumPhase | None) -> dict | None:
    """The active phase as the progress report shows it: {"index": 1-based in `at` order, "count", "mode",
    "t_range", "lr_mul"}; None without a curriculum."""
    if phase is None or not phases:
        return None
    ordered = sorted(phases, key=lambda p: p.at)
    index = next(i for i, p in enumerate(ordered) if p is phase) + 1
    return {"index": index, "count": len(ordered), "mode": phase.mode, "t_range": list(phase.t_range),
            "lr_mul": phase.lr_mul}


# ------------------------------------------------------------------------------------------------ noising


def _per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """t [B] as float32 [B, 1, 1, ...] broadcasting over `like`."""
    return t.to(device=like.device, dtype=torch.float32).view(-1, *([1] * (like.dim() - 1)))


def noisy_latents(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 − t)·x0 + t·noise, computed in float32, returned in x0's dtype."""
    tb = _per_sample(t, x0)
    return ((1.0 - tb) * x0.float() + tb * noise.float()).to(x0.dtype)


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The flow-matching target v = noise − x0 (dx_t/dt)."""
    return noise - x0


def ot_pair_noise(latents: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Pair each latent with its most cosine-similar noise row within this micro-batch
    (docs/training.md#ot-noise-pairing).

    Cost = −cosine(latent_i, noise_j) of the flattened rows, solved by scipy.optimize.linear_sum_assignment;
    the noise rows are permuted. B = 1 or no scipy → the identity, i.e. exactly no OT. Returns the (possibly
    permuted) noise and the fraction of rows that moved (the log's `ot`)."""
    if latents.shape != noise.shape:
        raise ValueError(f"ot_pair_noise: latents {tuple(latents.shape)} and noise {tuple(noise.shape)} differ")
    batch = latents.shape[0]
    if batch < 2:
        return noise, 0.0
    try:
        # lazy: scipy.optimize (~0.5 s measured): only OT pairing uses it; tests/test_flow.py removes it (fallback)
        from scipy.optimize import linear_sum_assignment
    except ImportError:
        return noise, 0.0
    a = F.normalize(latents.detach().reshape(batch, -1).float(), dim=1)
    b = F.normalize(noise.detach().reshape(batch, -1).float(), dim=1)
    cost = -(a @ b.T)
    _, cols = linear_sum_assignment(cost.cpu().numpy())
    perm = torch.as_tensor(cols, dtype=torch.long, device=noise.device)
    moved = (perm != torch.arange(batch, device=noise.device)).float().mean().item()
    return noise[perm], moved


# ------------------------------------------------------------------------------------------------ loss


def _token_mean(x: torch.Tensor, patch: int) -> torch.Tensor:
    """Mean over channels and each patch×patch block: [B,C,T,h,w] → [B,T,h/p,w/p], [B,C,h,w] → [B,h/p,w/p]."""
    if x.dim() not in (4, 5):
        raise ValueError(f"latents must be [B,C,h,w] or [B,C,T,h,w], got shape {tuple(x.shape)}")
    h, w = x.shape[-2:]
    if h % patch or w % patch:
        raise ValueError(f"latent size {h}x{w} is not divisible by the patch size {patch}")
    if x.dim() == 4:
        return F.avg_pool2d(x, patch).mean(1)
    b, c, frames = x.shape[:3]
    pooled = F.avg_pool2d(x.transpose(1, 2).reshape(b * frames, c, h, w), patch).mean(1)
    return pooled.view(b, frames, h // patch, w // patch)


def _laplacian_energy(x: torch.Tensor) -> torch.Tensor:
    """Squared 4-neighbour Laplacian per latent pixel, replicate padding (so borders of flat areas stay 0)."""
    spatial = x.reshape(-1, 1, *x.shape[-2:])
    p = F.pad(spatial, (1, 1, 1, 1), mode="replicate")
    lap = p[..., :-2, 1:-1] + p[..., 2:, 1:-1] + p[..., 1:-1, :-2] + p[..., 1:-1, 2:] - 4.0 * spatial
    return lap.square().view(x.shape)


def hf_token_weights(x0: torch.Tensor, patch: int = PATCH, exponent: float = 1.0,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token detail weights from the CLEAN target only, shaped like `_token_mean` output (the hf term of
    docs/training.md#flow-matching-and-timesteps).

    d = token mean of the squared Laplacian; w = ((d+ε)/(mean d+ε))^exponent, renormalised to per-sample mean 1.
    With a mask (broadcastable to x0, 1 = supervised) it is pooled per token (m) and the weights are scaled so
    that Σ w·m = Σ m per sample, i.e. the mean weight over the supervised area is 1."""
    with torch.no_grad():
        x = x0.detach().float()
        d = _token_mean(_laplacian_energy(x), patch)
        flat = d.flatten(1)
        w = ((flat + HF_EPS) / (flat.mean(1, keepdim=True) + HF_EPS)).pow(exponent)
        w = w / w.mean(1, keepdim=True)
        if mask is not None:
            m = _token_mean(torch.broadcast_to(mask.float(), x.shape), patch).flatten(1)
            covered = (w * m).sum(1, keepdim=True)
            w = w * torch.where(covered > 0, m.sum(1, keepdim=True) / covered, torch.zeros_like(covered))
        return w.view(d.shape)


# The loss's named terms, as flow_loss returns them: every report says each term under its name (the progress line,
# the `step` event's key, TensorBoard's loss/<name>, the node's chart), and only when there are two or more (a single
# term is the loss). A new term is computed in flow_loss and named here; the chart gives it a colour
# (js/loss_chart.js LOSS_PARTS).
LOSS_TERMS = ("mse", "hf")


def flow_loss(pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
              hf_scale: float = 0.0, hf_exponent: float = 1.0, mask: torch.Tensor | None = None,
              patch: int = PATCH) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Velocity MSE (+ hf_scale · hf term). Returns (total, parts): parts["mse"], and parts["hf"] only when
    hf_scale > 0 (log: `loss X (mse Y + hf Z)`).

    mse: mean of (pred − (noise − x0))² in float32, over the mask when given (mask broadcastable to pred, values
    in [0, 1]). hf: mean over tokens of w · e, e = the token's mean squared error of x̂0 = x_t − t·pred against
    x0 (per element, like the mse, so hf_scale is a relative weight), w = hf_token_weights(x0) (normalised by
    Σ w·m with a mask). hf_scale = 0 is gated here: no extra ops, allocations or RNG draws."""
    target = velocity_target(x0, noise)
    if mask is None:
        mse = F.mse_loss(pred.float(), target.float())
    else:
        m = torch.broadcast_to(mask.float(), pred.shape)
        mse = ((pred.float() - target.float()).square() * m).sum() / m.sum().clamp_min(1e-12)
    parts = {"mse": mse.detach()}
    if hf_scale == 0:
        return mse, parts
    x0_hat = x_t.float() - _per_sample(t, pred) * pred.float()
    err = _token_mean((x0_hat - x0.float()).square(), patch)
    w = hf_token_weights(x0, patch, hf_exponent, mask)
    if mask is None:
        hf = (w * err).mean()
    else:
        m_tok = _token_mean(torch.broadcast_to(mask.float(), x0.shape), patch)
        hf = (w * m_tok * err).sum() / m_tok.sum().clamp_min(1e-12)
    parts["hf"] = hf.detach()
    return mse + hf_scale * hf, parts
