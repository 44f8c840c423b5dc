"""bf16 training must train like fp32 training (issue: silent wrong results).

A bf16 tensor drops every update below half an ulp, so a bf16 run whose optimizer wrote straight into the weights
kept ~2/3 of a LoRA's and ~3 % of a full finetune's updates (measured before the fix). Here the same seed and data
train once in fp32 and once in bf16, and we compare what the optimizer really holds at the end (its fp32 masters, or
SDNQ's weight + Kahan residual) against the fp32 run: the bf16 run must change >= 90 % as many elements, with an
update norm within 0.8-1.25x.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from anima_train import adapters
from anima_train.training import optimizers
from anima_train.config import SDNQ_OPTIMIZERS
from anima_train.training.train import train
from tests.test_adapters import inject, make_cfg as adapter_cfg, tiny_batch, tiny_loss, tiny_models
from tests.test_train import make_cfg as run_cfg

STEPS = 60
MODES = {"lora": ('kind = "lora"', 1e-4), "lokr": ('kind = "lokr"', 1e-4), "full": ('kind = "none"', 1e-5)}


def held_values(opt, params) -> list[torch.Tensor]:
    """fp32 view of what the optimizer holds for each trained tensor, in `params` order."""
    masters = {id(p): m for p, m in getattr(opt, "master_pairs", [])}
    out = []
    for p in params:
        value = masters.get(id(p), p).detach().float()
        state = opt.state.get(p, {})
        kahan = state.get("kahan_buffer", state.get("residual"))
        if kahan is not None:  # SDNQ's or AdamWKahan's residual: what the bf16 cast left out of the realised update
            value = value + kahan.float()
        out.append(value)
    return out


def compare(start32, end32, start16, end16) -> tuple[float, float]:
    d32 = torch.cat([(e - s).flatten() for s, e in zip(start32, end32)])
    d16 = torch.cat([(e - s).flatten() for s, e in zip(start16, end16)])
    changed = (d16 != 0).sum().item() / max((d32 != 0).sum().item(), 1)
    return changed, (d16.norm() / d32.norm()).item()


def assert_trains_like_fp32(changed: float, norm_ratio: float, what: str) -> None:
    assert changed >= 0.9, f"{what}: the bf16 run changed only {changed:.1%} as many elements as the fp32 run"
    assert 0.8 <= norm_ratio <= 1.25, f"{what}: bf16/fp32 update norm {norm_ratio:.3f}"


def run_captured(cfg, monkeypatch):
    """Train through the real trainer; capture the optimizer it builds, and the trained tensors before step 1."""
    seen = {}
    build = optimizers.build_optimizer

    def capture(groups, ocfg, **options):
        params = [p for g in groups for p in g["params"]]
        seen["params"], seen["start"] = params, [p.detach().float().clone() for p in params]
        seen["opt"] = build(groups, ocfg, **options)
        return seen["opt"]

    monkeypatch.setattr(optimizers, "build_optimizer", capture)
    train(cfg, cpu=True, no_save=True)
    return seen["start"], held_values(seen["opt"], seen["params"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_the_trainer_in_bf16_trains_like_fp32(mode, tiny_anima, latents_dir, tmp_path, monkeypatch):
    kind, lr = MODES[mode]
    extra = f'{kind}\ncomponents = ["self_attn", "cross_attn", "mlp"]\n[optimizer]\nlr = {lr}\n'
    runs = {}
    for dtype in ("float32", "bfloat16"):
        cfg = run_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / dtype, extra, max_steps=STEPS,
                      dtype=f'"{dtype}"')
        runs[dtype] = run_captured(cfg, monkeypatch)
    changed, ratio = compare(*runs["float32"], *runs["bfloat16"])
    assert_trains_like_fp32(changed, ratio, f"trainer, {mode}")



def optimizer_run(mode: str, kind: str, dtype, use_kahan: bool = False):
    """STEPS optimizer steps on fresh batches, on the tiny models directly (fast enough for every kind)."""
    adapter_kind = {"lora": "lora", "lokr": "lokr", "full": "none"}[mode]
    models = tiny_models(dtype=dtype)
    cfg = adapter_cfg(kind=adapter_kind, rank=8, alpha=8.0, components=["self_attn", "cross_attn", "mlp"])
    cfg.optimizer.kind, cfg.optimizer.lr, cfg.optimizer.use_kahan = kind, MODES[mode][1], use_kahan
    if kind == "came":
        cfg.optimizer.betas = [0.9, 0.999, 0.9999]
    inject(models, cfg)
    groups, _ = adapters.build_param_groups(models, cfg)
    params = [p for g in groups for p in g["params"]]
    start = [p.detach().float().clone() for p in params]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = optimizers.build_optimizer(groups, cfg.optimizer)
    for step in range(STEPS):
        opt.zero_grad()
        tiny_loss(models, tiny_batch(seed=100 + step, dtype=dtype)).backward()
        opt.step()
    return start, held_values(opt, params)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lora", "full"])
@pytest.mark.parametrize("kind", ("adamw",) + SDNQ_OPTIMIZERS)
def test_every_optimizer_kind_in_bf16_trains_like_fp32(kind, mode):
    changed, ratio = compare(*optimizer_run(mode, kind, torch.float32), *optimizer_run(mode, kind, torch.bfloat16))
    assert_trains_like_fp32(changed, ratio, f"{kind}, {mode}")


@pytest.mark.parametrize("kind", ["adamw8bit", "came", "adamw"])
def test_kahan_instead_of_masters(kind):
    # use_kahan = true: no fp32 copies (the lean full-finetune choice); weight + residual still track fp32
    start, held = optimizer_run("full", kind, torch.bfloat16, use_kahan=True)
    ref_start, ref_held = optimizer_run("full", kind, torch.float32)
    assert_trains_like_fp32(*compare(ref_start, ref_held, start, held), f"{kind} + Kahan, full")
