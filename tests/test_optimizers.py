"""build_optimizer: torch AdamW and SDNQ's optimizers on a small deterministic regression (CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch

from anima_train.config import SDNQ_OPTIMIZERS, OptimizerConfig
from anima_train.training.optimizers import build_optimizer, optimizer_state_bytes


def tiny_mlp(seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    # 128x128 = 16384 elements: just at SDNQ's floor for quantized optimizer state; LayerNorm + biases are 1-D
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                               torch.nn.LayerNorm(128), torch.nn.Linear(128, 16)).to(dtype)


def regression(seed: int = 1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 32, generator=g)
    teacher = torch.randn(32, 16, generator=g) / 32 ** 0.5
    return x.to(dtype), torch.tanh(x @ teacher)


def two_groups(model: torch.nn.Module, lr: float) -> list[dict]:
    # the shape build_param_groups produces: named groups with their own LR and weight decay
    params = list(model.parameters())
    return [{"name": "mlp", "params": params[:4], "lr": lr, "weight_decay": 0.01},
            {"name": "base", "params": params[4:], "lr": lr / 2, "weight_decay": 0.0}]


def train(kind: str, steps: int = 8, lr: float = 3e-3, dtype=torch.float32, **options):
    model = tiny_mlp(dtype=dtype)
    x, y = regression(dtype=dtype)
    betas = [0.9, 0.999, 0.9999] if kind == "came" else [0.9, 0.95]
    cfg = OptimizerConfig(kind=kind, lr=lr, betas=betas, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SDNQ warns about kernels it cannot use on a CPU
        opt = build_optimizer(two_groups(model, lr), cfg)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return opt, losses


@pytest.mark.parametrize("kind", ("adamw",) + SDNQ_OPTIMIZERS)
def test_every_kind_lowers_the_loss(kind):
    opt, losses = train(kind)
    assert losses[-1] < losses[0] * 0.97, losses
    # our group names and per-group LRs survive SDNQ's strict group keys (muon splits each group in two)
    assert {g["name"] for g in opt.param_groups} == {"mlp", "base"}
    assert {g["lr"] for g in opt.param_groups} == {3e-3, 1.5e-3}
    if kind != "adamw":
        assert any(c.__module__.startswith("sdnq.optim") for c in type(opt).__mro__)


def test_muon_gives_matrices_muon_and_vectors_adamw():
    opt, _ = train("muon", steps=1)
    for g in opt.param_groups:
        assert all((p.ndim >= 2) == g["use_muon"] for p in g["params"])
    assert sum(len(g["params"]) for g in opt.param_groups) == 8  # every tensor once; empty halves dropped


def test_betas_arity_errors_name_the_key():
    params = two_groups(tiny_mlp(), 1e-3)
    with pytest.raises(ValueError, match=r'betas = \[0.9, 0.95\]: kind = "came" needs 3 betas.*0.9999'):
        build_optimizer(params, OptimizerConfig(kind="came", betas=[0.9, 0.95]))
    for kind in ("adamw", "adamw8bit", "lion", "muon", "adafactor"):
        with pytest.raises(ValueError, match=f'kind = "{kind}" needs 2 betas'):
            build_optimizer(params, OptimizerConfig(kind=kind, betas=[0.9, 0.999, 0.9999]))


def test_quantize_state_shrinks_the_state():
    plain, losses_plain = train("adamw8bit", steps=3)
    small, losses_small = train("adamw8bit", steps=3, quantize_state=True)
    big_plain, big_small = optimizer_state_bytes(plain), optimizer_state_bytes(small)
    assert big_small < big_plain * 0.75, (big_plain, big_small)
    # the 128x128 weight has uint8 state; the smaller tensors keep dense state (SDNQ's 16384-element floor)
    w_plain, w_small = plain.param_groups[0]["params"][2], small.param_groups[0]["params"][2]
    assert w_small.shape == (128, 128)
    assert type(small.state[w_small]["exp_avg"]).__name__ == "SDNQTensor"
    assert type(plain.state[w_plain]["exp_avg"]).__name__ == "Tensor"
    assert losses_small[-1] < losses_small[0]


def test_kahan_and_offload_run_on_bf16():
    opt, losses = train("adamw8bit", dtype=torch.bfloat16, use_kahan=True, offload_state=True)
    assert losses[-1] < losses[0]
    assert all("kahan_buffer" in s for s in opt.state.values())
    assert all(s["kahan_buffer"].device.type == "cpu" for s in opt.state.values())


def test_bf16_tensors_get_fp32_masters_that_resume_exactly():
    # every kind but SDNQ-with-Kahan steps fp32 masters of bf16 tensors, rounded into the model after each step
    for kind, options, masters in (("adamw", {}, True), ("lion", {}, True), ("adamw8bit", {"use_kahan": True}, False),
                                   ("adamw", {"use_kahan": True}, False)):
        opt, _ = train(kind, steps=2, dtype=torch.bfloat16, **options)
        pairs = getattr(opt, "master_pairs", [])
        assert bool(pairs) == masters, kind
        for p, m in pairs:
            assert p.dtype == torch.bfloat16 and m.dtype == torch.float32 and torch.equal(p, m.to(torch.bfloat16))
        assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"]) == masters
    # the masters travel in the state dict (torch.load(weights_only=True) reads them), so a resume is exact
    opt, _ = train("adamw", steps=2, dtype=torch.bfloat16)
    state = opt.state_dict()
    fresh = build_optimizer(two_groups(tiny_mlp(dtype=torch.bfloat16), 3e-3), OptimizerConfig(kind="adamw"))
    fresh.load_state_dict(state)
    assert all(torch.equal(m, n) for (_, m), (_, n) in zip(opt.master_pairs, fresh.master_pairs))
    fp32 = build_optimizer(two_groups(tiny_mlp(), 3e-3), OptimizerConfig(kind="adamw"))
    with pytest.raises(ValueError, match="fp32 master tensor"):
        fp32.load_state_dict(state)


def test_torch_adamw_refuses_sdnq_weights():
    from anima_train.model.quant import import_sdnq
    sdnq = import_sdnq()
    model = tiny_mlp()
    sdnq.training.sdnq_training_post_load_quant(model, weights_dtype="int8", group_size=-1, add_skip_keys=False,
                                                minimum_allowed_numel=0, minimum_allowed_channel_size=0,
                                                use_grad_ckpt=False)
    with pytest.raises(ValueError, match="cannot update SDNQ-quantized weights"):
        build_optimizer(two_groups(model, 1e-3), OptimizerConfig())
    with pytest.raises(ValueError, match="no parameters"):
        build_optimizer([{"params": [], "lr": 1e-3}], OptimizerConfig(kind="lion"))


def test_gradients_reach_the_masters_exactly_in_any_chunking(monkeypatch):
    # the bf16 gradients are up-cast onto the masters in foreach chunks (fewer launches than one .to() per tensor);
    # chunk boundaries inside the parameter list (1 element: every tensor its own chunk; 200: mixed) change nothing,
    # and the result is the fp32 AdamW step on exactly the up-cast gradients
    from anima_train.training.optimizers import FP32MasterWeights

    _, whole = train("adamw", dtype=torch.bfloat16)
    for chunk in (1, 200):
        monkeypatch.setattr(FP32MasterWeights, "GRAD_CHUNK", chunk)
        opt, losses = train("adamw", dtype=torch.bfloat16)
        assert losses == whole, chunk
    model = tiny_mlp(dtype=torch.bfloat16)
    reference = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = build_optimizer([{"params": list(model.parameters()), "lr": 1e-2}], OptimizerConfig(kind="adamw", lr=1e-2))
    ref_opt = torch.optim.AdamW(reference, lr=1e-2, betas=(0.9, 0.999),
                                weight_decay=opt.param_groups[0]["weight_decay"])
    for p, r in zip(model.parameters(), reference):
        p.grad = torch.randn_like(p)
        r.grad = p.grad.float()
    opt.step()
    ref_opt.step()
    assert all(torch.equal(p, r.to(torch.bfloat16)) for p, r in zip(model.parameters(), reference))
    assert all(p.grad is None for p in model.parameters())
