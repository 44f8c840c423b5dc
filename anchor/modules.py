"""The two attachable adapter kinds and the multiband band law (docs/anchor.md#adapter-kinds, #band-gating).

Both read a block's output hidden states x[..., d] (feature axis last) and return x + delta:
    relay       delta = sigmoid(gate) · consume(m̂(proj(x) viewed as [..., n_slots, 4]))
    multiband3  delta = Σ_b sigmoid(gates[b]) · w_b(s01) · up_b(down_b(x))
A fresh adapter is exactly inert (the last layer is zero), so x + delta == x bit for bit.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ATTACHABLE_KINDS, BAND_EDGES, N_BANDS, XFADE, AnchorError
from .format import AnchorFile

RELAY_DEFAULTS = {"n_slots": 16, "K": 64, "tau": 0.1, "hidden": 178}  # the research line's RelayPatch2D defaults
MULTIBAND_DEFAULT_RANK = 16


def band_weights(s01):
    """[LOW, MID, HIGH] band weights for a normalised noise level s01 (float or tensor [...]) -> tensor [..., 3].

    Cosine crossfades of half-width XFADE around BAND_EDGES; the three weights always sum to 1.
    A python float gives a float64 tensor of shape [3]."""
    s = torch.as_tensor(s01, dtype=torch.float64 if isinstance(s01, (int, float)) else None)
    if not s.is_floating_point():
        s = s.double()

    def ramp(x):  # 0 below -XFADE, 1 above +XFADE, half-cosine in between
        return 0.5 - 0.5 * torch.cos(math.pi * ((x / XFADE).clamp(-1, 1) + 1) / 2)

    up1, up2 = ramp(s - BAND_EDGES[0]), ramp(s - BAND_EDGES[1])
    return torch.stack([1 - up1, up1 * (1 - up2), up1 * up2], dim=-1)


class SquaredReLU(nn.Module):
    def forward(self, x):
        return F.relu(x) ** 2


class AlephAddress(nn.Module):
    """Closed-form soft read over the 2K half-axes ±A of a unit codebook A:
    m̂(s) = Σ_k sinh(u_k) A_k / Σ_k cosh(u_k),  u = (normalize(s) · Aᵀ) / tau."""

    def __init__(self, K, tau):
        super().__init__()
        self.tau = tau
        self.codebook = nn.Parameter(F.normalize(torch.randn(K, 4), dim=-1))
        self.register_buffer("home", self.codebook.detach().clone())  # init snapshot: the drift gauge

    def forward(self, s):
        A = F.normalize(self.codebook, dim=-1)
        u = (F.normalize(s, dim=-1) @ A.T) / self.tau
        top = u.abs().amax(dim=-1, keepdim=True)  # sinh/cosh share exp(-top): overflow-free, ratio unchanged
        e_pos, e_neg = torch.exp(u - top), torch.exp(-u - top)
        return ((e_pos - e_neg) @ A) / (e_pos + e_neg).sum(dim=-1, keepdim=True)


class RelayAdapter(nn.Module):
    kind = "relay"

    def __init__(self, d, n_slots=16, K=64, hidden=178, tau=0.1):
        super().__init__()
        self.d, self.n_slots = d, n_slots
        self.proj = nn.Linear(d, 4 * n_slots, bias=False)
        nn.init.orthogonal_(self.proj.weight)
        self.addr = AlephAddress(K, tau)
        self.consume = nn.Sequential(nn.Linear(4 * n_slots, hidden), SquaredReLU(), nn.LayerNorm(hidden),
                                     nn.Linear(hidden, d))
        nn.init.zeros_(self.consume[3].weight)  # zero last layer: a fresh relay is exactly inert
        nn.init.zeros_(self.consume[3].bias)
        self.gate = nn.Parameter(torch.tensor(-3.0))

    @classmethod
    def from_state_dict(cls, sd, tau=0.1):
        """Dimensions come from the tensors; tau is not stored as a tensor (meta.adapter.tau)."""
        m = cls(d=sd["proj.weight"].shape[1], n_slots=sd["proj.weight"].shape[0] // 4,
                K=sd["addr.codebook"].shape[0], hidden=sd["consume.0.weight"].shape[0], tau=tau)
        m.load_state_dict(sd, strict=True)
        return m

    def delta(self, x, w=None):
        lead = x.shape[:-1]
        slots = self.proj(x).view(*lead, self.n_slots, 4)
        read = self.addr(slots).reshape(*lead, 4 * self.n_slots)
        return torch.sigmoid(self.gate) * self.consume(read)

    def forward(self, x, w=None):
        return x + self.delta(x)


class MultibandAdapter(nn.Module):
    kind = "multiband3"

    def __init__(self, d, rank=MULTIBAND_DEFAULT_RANK):
        super().__init__()
        self.d, self.rank = d, rank
        self.down = nn.ModuleList(nn.Linear(d, rank, bias=False) for _ in range(N_BANDS))
        self.up = nn.ModuleList(nn.Linear(rank, d) for _ in range(N_BANDS))
        for down, up in zip(self.down, self.up):
            nn.init.orthogonal_(down.weight)
            nn.init.zeros_(up.weight)  # zero up-projections: a fresh multiband is exactly inert
            nn.init.zeros_(up.bias)
        self.gates = nn.Parameter(torch.full((N_BANDS,), -3.0))
        self.band_enabled = [True] * N_BANDS  # a lesioned band is skipped, not renormalised

    @classmethod
    def from_state_dict(cls, sd, **_):
        m = cls(d=sd["down.0.weight"].shape[1], rank=sd["down.0.weight"].shape[0])
        m.load_state_dict(sd, strict=True)
        return m

    def delta(self, x, w):
        """w: band weights [3] (one noise level) or [B', 3] per batch element (B' divides x's batch: a CFG batch
        that stacks cond/uncond copies repeats the per-sample weights)."""
        if w is None:
            raise AnchorError("multiband3 needs the current noise level: call set_noise_level(s01) for this "
                              "sampling step (or pass band weights)")
        w = w.to(device=x.device, dtype=x.dtype)
        if w.ndim == 2:
            if x.shape[0] % w.shape[0]:
                raise AnchorError(f"band weights for {w.shape[0]} samples do not divide a batch of {x.shape[0]}")
            w = w.repeat(x.shape[0] // w.shape[0], 1).view(x.shape[0], *([1] * (x.ndim - 2)), N_BANDS)
        g = torch.sigmoid(self.gates)
        out = None
        for b in range(N_BANDS):
            if not self.band_enabled[b]:
                continue
            term = g[b] * w[..., b:b + 1] * self.up[b](self.down[b](x))
            out = term if out is None else out + term
        return out  # None when every band is lesioned

    def forward(self, x, w=None):
        d = self.delta(x, w)
        return x if d is None else x + d


_CLASSES = {"relay": RelayAdapter, "multiband3": MultibandAdapter}


def build_adapter(kind, site_state, tau=0.1, where="anchor"):
    if kind not in _CLASSES:
        raise AnchorError(f"{where}: kind {kind!r} does not attach (only {ATTACHABLE_KINDS})")
    try:
        return _CLASSES[kind].from_state_dict(site_state, tau=tau)
    except (KeyError, RuntimeError) as e:
        raise AnchorError(f"{where}: tensors do not fit the {kind} layout ({e})") from e


def build_adapters(anchor, dtype=None, device=None):
    """One adapter module per site of an attachable AnchorFile, cast to the trunk's declared dtype."""
    if not anchor.attachable:
        raise AnchorError(f"{anchor.path or 'anchor'}: {anchor.refusal()}")
    tau = float(anchor.meta.get("adapter", {}).get("tau", RELAY_DEFAULTS["tau"]))
    mods = nn.ModuleList(build_adapter(anchor.kind, anchor.per_site(i), tau, f"{anchor.path or 'anchor'} site {i}")
                         for i in range(anchor.n_sites))
    return mods.to(device=device, dtype=dtype)


def adapter_output(adapter, hidden, s01=None, strength=1.0, channel_axis=-1):
    """hidden + strength · delta for one site: the whole per-site computation, for hosts that patch blocks
    themselves (a ComfyUI node). s01: the normalised noise level (float or [B] tensor), needed by multiband3.
    strength 0 (or every band lesioned) returns `hidden` itself, bit-exact. channel_axis: where the feature
    axis is (-1 for [B, tokens, d] and Cosmos [B, T, H, W, d]; 1 for a [B, C, H, W] feature map)."""
    if strength == 0:
        return hidden
    x = hidden if channel_axis in (-1, hidden.ndim - 1) else hidden.movedim(channel_axis, -1)
    w = band_weights(s01) if (isinstance(adapter, MultibandAdapter) and s01 is not None) else None
    d = adapter.delta(x.to(adapter_dtype(adapter)), w)
    if d is None:
        return hidden
    d = d.to(hidden.dtype)
    if x is not hidden:
        d = d.movedim(-1, channel_axis)
    return hidden + (d if strength == 1 else strength * d)


def adapter_dtype(adapter):
    return next(adapter.parameters()).dtype


def fresh_anchor(kind, widths, family=None, objective=None, seed=0, site_names=None, **spec):
    """A freshly initialised (exactly inert) stack as an AnchorFile: the trainer's starting point, test fixtures.
    spec: relay n_slots/K/hidden/tau, multiband3 rank."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        adapters = {}
        for i, d in enumerate(widths):
            if kind == "relay":
                cfg = {**RELAY_DEFAULTS, **spec}
                m = RelayAdapter(d, cfg["n_slots"], cfg["K"], cfg["hidden"], cfg["tau"])
            elif kind == "multiband3":
                cfg = {"rank": spec.get("rank", MULTIBAND_DEFAULT_RANK)}
                m = MultibandAdapter(d, cfg["rank"])
            else:
                raise AnchorError(f"fresh_anchor makes relay or multiband3 stacks, not {kind!r}")
            adapters.update({f"{i}.{k}": v.detach().clone() for k, v in m.state_dict().items()})
    finally:
        torch.random.set_rng_state(gen_state)
    substrate = {"n_sites": len(widths), "widths": list(widths)}
    if family:
        substrate["family"] = family
    if site_names:
        substrate["site_names"] = list(site_names)
    meta = {"format": "amoe.diffusion.anchor", "version": 1, "adapter": {"kind": kind, **cfg},
            "substrate": substrate, "seed": seed, "dtype": "float32"}
    if objective:
        meta["objective"] = {"kind": objective}
    return AnchorFile(adapters, meta)
