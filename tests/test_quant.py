"""SDNQ quantization: skip rules, quantized-matmul auto rule, frozen int8 base under LoRA/LoKr (exact adapter
gradients), quantized full finetune with stochastic rounding, dequantized export. CPU, tiny random models."""

from __future__ import annotations

import copy

import pytest
import torch

from anima_train import adapters
from anima_train.model import quant
from anima_train.config import AdapterConfig, Config
from anima_train.training.optimizers import build_optimizer
from tests.test_adapters import make_cfg, tiny_models

SDNQ = quant.import_sdnq()  # module level: the import (env defaults) is part of what is tested
TINY = dict(min_numel=0, min_channels=0)  # tiny Linears are below SDNQ's size floor; quantize them all


def dit_batch(seed: int = 1, dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(2, 16, 1, 8, 8, generator=g).to(dtype), sigma=torch.rand(2, generator=g).to(dtype),
                qwen=torch.randn(2, 6, 32, generator=g).to(dtype), t5=torch.randint(2, 110, (2, 5), generator=g),
                target=torch.randn(2, 16, 1, 8, 8, generator=g))


def dit_loss(models: dict, b: dict) -> torch.Tensor:
    """Conditioner -> DiT on fixed Qwen3 hidden states (Qwen3 itself is not needed here)."""
    source_mask = torch.ones(b["qwen"].shape[:2], dtype=torch.long, device=b["qwen"].device)
    ctx = models["text_conditioner"](source_hidden_states=b["qwen"], target_input_ids=b["t5"],
                                     target_attention_mask=torch.ones_like(b["t5"]), source_attention_mask=source_mask)
    v = models["transformer"](b["x"], timestep=b["sigma"], encoder_hidden_states=ctx,
                              padding_mask=b["x"].new_zeros(1, 1, 64, 64), return_dict=False)[0]
    return torch.nn.functional.mse_loss(v.float(), b["target"])


def train_steps(models: dict, opt, b: dict, steps: int) -> list[float]:
    """`steps` optimizer steps on one fixed batch; the loss before each step."""
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = dit_loss(models, b)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def same_random_adapters(models: dict, reference: dict) -> None:
    """Non-zero adapter weights (a fresh LoRA's B = 0 would hide gradient errors), identical in both models."""
    for (_, _, p), (_, _, r) in zip(adapters.adapter_parameters(models["transformer"]),
                                    adapters.adapter_parameters(reference["transformer"])):
        p.data = 0.05 * torch.randn_like(p)
        r.data = p.data.clone()


def frozen_cfg(kind: str = "lora", **quant_options) -> Config:
    cfg = make_cfg(kind=kind, rank=4, alpha=4.0, components=["self_attn", "cross_attn", "mlp", "adaln"],
                   train_llm_adapter=True)
    cfg.component_lr.adaln = cfg.component_lr.llm_adapter = 1e-4
    cfg.train.gradient_checkpointing = False
    cfg.quant.mode = "frozen"
    cfg.quant.use_quantized_matmul = False
    for k, v in quant_options.items():
        setattr(cfg.quant, k, v)
    return cfg


def is_sdnq(t) -> bool:
    return type(t).__name__ == "SDNQTensor"


# ------------------------------------------------------------------------------------------------ rules


def test_skip_matches_full_name_component_or_glob_never_substring():
    name = "transformer_blocks.3.attn2.to_k"
    hits = [name, name + ".weight", "attn2", "to_k", "attn2.to_k", "3.attn2", ".transformer_blocks",
            ".transformer_blocks.3.attn2", "transformer_blocks.*.attn2.*", "*.to_[kv]", "*to_k.weight"]
    misses = ["attn", "to_", "transformer_blocks.3.attn", "attn2.to", "ks.3", ".attn2", "transformer_blocks.1.*",
              "*.to_q", "blocks", "", "transformer_blocks.3.attn2.to_k.bias"]
    assert [p for p in hits if not quant.skip_matches(name, p)] == []
    assert [p for p in misses if quant.skip_matches(name, p)] == []


def test_skip_policies_select_the_documented_layers():
    dit = tiny_models()["transformer"]
    cfg = Config()
    io = {"patch_embed.proj", "time_embed.t_embedder.linear_1", "time_embed.t_embedder.linear_2", "proj_out",
          "norm_out.linear_1", "norm_out.linear_2"}
    adaln = {b: {f"transformer_blocks.{b}.norm{i}.linear_{j}" for i in (1, 2, 3) for j in (1, 2)} for b in (0, 1)}
    want = {"default": io | adaln[0], "first_block_adaln": io | adaln[0], "all_adaln": io | adaln[0] | adaln[1],
            "anima_int8_mm": io | adaln[0] | adaln[1],
            "mlp_down": io | adaln[0] | {"transformer_blocks.0.ff.net.2", "transformer_blocks.1.ff.net.2"}}
    assert set(want) == set(quant.SKIP_POLICIES)
    linears = {n for n, m in dit.named_modules() if isinstance(m, torch.nn.Linear)}
    for policy, skipped in want.items():
        cfg.quant.skip_policy = policy
        chosen, skip = quant.select_linears("transformer", dit, cfg, **TINY)
        assert set(skip) == skipped, policy
        assert set(chosen) == linears - skipped, policy
    # "default" is exactly what SDNQ's own CosmosTransformer3DModel list (its matching rules) keeps out
    from sdnq.common import module_skip_keys_dict
    from sdnq.utils import check_param_name_in
    sdnq_keys = module_skip_keys_dict["CosmosTransformer3DModel"][0]
    assert {n for n in linears if check_param_name_in(n + ".weight", sdnq_keys)} == want["default"]
    # extra_skip adds to the policy; the size floor is SDNQ's (16384 elements, 32 inputs) unless lowered
    cfg.quant.skip_policy = "default"
    cfg.quant.extra_skip = ["attn2.to_k", "transformer_blocks.1.ff.*"]
    _, skip = quant.select_linears("transformer", dit, cfg, **TINY)
    assert set(skip) - want["default"] == {"transformer_blocks.0.attn2.to_k", "transformer_blocks.1.attn2.to_k",
                                           "transformer_blocks.1.ff.net.0.proj", "transformer_blocks.1.ff.net.2"}
    assert skip["transformer_blocks.0.attn2.to_k"] == "extra_skip 'attn2.to_k'"
    chosen, _ = quant.select_linears("transformer", dit, Config())
    assert set(chosen) == {"transformer_blocks.1.ff.net.0.proj", "transformer_blocks.1.ff.net.2",
                           "transformer_blocks.0.ff.net.0.proj", "transformer_blocks.0.ff.net.2"}  # 256x64 only


def test_quantized_matmul_auto_rule():
    q = Config().quant
    assert quant.dit_tokens(1024, 1024) == 4096 and quant.dit_tokens(768, 768) == 2304
    assert quant.dit_tokens(1216, 832) == 76 * 52
    q.mode = "frozen"
    assert quant.resolve_quantized_matmul(q, [4096] * 3) is True
    assert quant.resolve_quantized_matmul(q, [2304] * 3) is False
    # token-weighted: mean length 2560 < 2900, but Σt²/Σt = 3481 >= 2900
    assert quant.token_weighted_mean([4096, 1024]) == pytest.approx((4096 ** 2 + 1024 ** 2) / 5120)
    assert quant.resolve_quantized_matmul(q, [4096, 1024]) is True
    assert quant.resolve_quantized_matmul(q, [2900]) is True and quant.resolve_quantized_matmul(q, [2899]) is False
    with pytest.raises(ValueError, match="needs the DiT token counts"):
        quant.resolve_quantized_matmul(q)
    q.use_quantized_matmul = False
    assert quant.resolve_quantized_matmul(q, [4096]) is False
    q.mode, q.use_quantized_matmul = "training", "auto"
    assert quant.resolve_quantized_matmul(q, [4096] * 3) is False
    q.use_quantized_matmul = True
    with pytest.warns(UserWarning, match="does not apply"):
        assert quant.resolve_quantized_matmul(q, [4096]) is False
    assert quant.sdnq_group_size(0) == -1 and quant.sdnq_group_size(32) == 32
    with pytest.raises(ValueError, match="group_size = -3"):
        quant.sdnq_group_size(-3)


# ------------------------------------------------------------------------------------------------ frozen


@pytest.mark.parametrize("kind", [m.kind for m in adapters.METHODS.values() if not m.trains_base and not adapters.
                                  base_refusals(AdapterConfig(kind=m.kind), adapters.BaseFacts(quant="frozen"))])
def test_frozen_int8_base_gives_exact_adapter_gradients(kind):
    """Adapters over the int8 training-format base get the same gradients as the same adapters over a plain
    Linear holding the dequantized weight (the inference format fails this: docs/sdnq.md#training-format-only)."""
    models = tiny_models()
    cfg = frozen_cfg(kind, quantize_text_conditioner=True)
    reference = {k: copy.deepcopy(v) for k, v in models.items()}
    report = quant.quantize_models(models, cfg, **TINY)
    assert len(report.quantized["transformer"]) == 26 and len(report.quantized["text_conditioner"]) == 21
    assert "text_encoder" not in report.quantized
    for role, names in report.quantized.items():
        assert set(names.values()) == {"int8"}
        for name in names:
            w = models[role].get_submodule(name).weight
            assert is_sdnq(w) and not w.requires_grad and w.sdnq_dequantizer.weights_dtype == "int8"
            reference[role].get_submodule(name).weight.data = w.dequantize(dtype=torch.float32)
    plain = reference["transformer"].get_submodule("transformer_blocks.1.ff.net.2").weight
    assert not torch.equal(plain, tiny_models()["transformer"].get_submodule("transformer_blocks.1.ff.net.2").weight)
    for m in (models, reference):
        adapters.inject_adapters(m["transformer"], m["text_conditioner"], m["text_encoder"], cfg)
    g = torch.Generator().manual_seed(3)
    pairs = []
    for role in ("transformer", "text_conditioner"):
        ours, theirs = adapters.adapter_parameters(models[role]), adapters.adapter_parameters(reference[role])
        assert [n for _, n, _ in ours] == [n for _, n, _ in theirs] and ours
        for (_, _, p), (_, _, r) in zip(ours, theirs):
            p.data = 0.05 * torch.randn(p.shape, generator=g)  # every factor non-zero: every one gets a gradient
            r.data = p.data.clone()
            pairs.append((p, r))
    b = dit_batch()
    loss, ref_loss = dit_loss(models, b), dit_loss(reference, b)
    loss.backward()
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for p, r in pairs:
        assert r.grad.abs().sum() > 0
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-7)
    # and it trains
    groups, _ = adapters.build_param_groups(models, cfg)
    opt = build_optimizer(groups, cfg.optimizer)
    losses = train_steps(models, opt, b, 3)
    assert losses[-1] < losses[0]
    assert all(is_sdnq(models["transformer"].get_submodule(n).base_layer.weight)
               for n in report.quantized["transformer"] if adapters.component_of(n) in cfg.adapter.components)


def test_frozen_quantized_matmul_runs_on_cpu_with_close_gradients():
    """use_quantized_matmul = true: int8 activations x int8 weights (CPU: torch._int_mm), so the gradients are
    approximate; >= 32 rows per matmul (SDNQ's floor), here 2 x 16 image tokens."""
    models = tiny_models()
    cfg = frozen_cfg("lora", use_quantized_matmul=True)
    cfg.adapter.train_llm_adapter = False
    reference = {k: copy.deepcopy(v) for k, v in models.items()}
    report = quant.quantize_models(models, cfg, **TINY)
    assert report.use_quantized_matmul
    layer = models["transformer"].get_submodule("transformer_blocks.1.attn1.to_q")
    assert "matmul" in layer.forward_func.__name__
    for name in report.quantized["transformer"]:
        reference["transformer"].get_submodule(name).weight.data = \
            models["transformer"].get_submodule(name).weight.dequantize(dtype=torch.float32)
    for m in (models, reference):
        adapters.inject_adapters(m["transformer"], m["text_conditioner"], m["text_encoder"], cfg)
    same_random_adapters(models, reference)
    b = dit_batch()
    dit_loss(models, b).backward()
    dit_loss(reference, b).backward()
    errors = [((p.grad - r.grad).norm() / r.grad.norm()).item()
              for (_, _, p), (_, _, r) in zip(adapters.adapter_parameters(models["transformer"]),
                                              adapters.adapter_parameters(reference["transformer"]))]
    assert 0 < max(errors) < 0.1, errors  # not exact (int8 activations), but close


def test_quantize_text_encoder_and_order_errors():
    models = tiny_models()
    cfg = frozen_cfg("lora", quantize_text_encoder=True, extra_skip=["down_proj"])
    cfg.adapter.train_llm_adapter = False
    report = quant.quantize_models(models, cfg, **TINY)
    assert set(report.quantized) == {"transformer", "text_encoder"}
    assert len(report.quantized["text_encoder"]) == 12  # 14 projections - 2 down_proj (extra_skip)
    assert set(report.skipped["text_encoder"]) == {"layers.0.mlp.down_proj", "layers.1.mlp.down_proj"}
    assert not quant.is_quantized(models["text_conditioner"])
    ids = torch.randint(0, 300, (1, 5))
    out = models["text_encoder"](input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    assert torch.isfinite(out).all()
    assert "text_encoder" in report.summary() and "12 Linears quantized (int8)" in report.summary()
    with pytest.raises(ValueError, match="already quantized"):
        quant.quantize_models(models, cfg, **TINY)
    fresh = tiny_models()
    adapters.inject_adapters(fresh["transformer"], fresh["text_conditioner"], fresh["text_encoder"], cfg)
    with pytest.raises(ValueError, match="must run before inject_adapters"):
        quant.quantize_models(fresh, cfg, **TINY)


def test_dynamic_loss_threshold_picks_bits_per_layer():
    models = tiny_models()
    cfg = frozen_cfg("lora", weights_dtype="int4", dynamic_loss_threshold=1e-4)  # ~8-bit error budget
    cfg.quant.extra_skip = ["transformer_blocks.1"]  # keep the test short
    report = quant.quantize_models({"transformer": models["transformer"]}, cfg, **TINY)
    bits = {n: SDNQ.common.dtype_dict[d]["num_bits"] for n, d in report.quantized["transformer"].items()}
    assert bits and min(bits.values()) > 4  # int4 misses 1e-4 on random weights: the search climbs
    loose = tiny_models()["transformer"]
    cfg.quant.dynamic_loss_threshold = 0.5
    report = quant.quantize_models({"transformer": loose}, cfg, **TINY)
    assert set(report.quantized["transformer"].values()) == {"int4"}
    b = dit_batch()
    v = loose(b["x"], timestep=b["sigma"], encoder_hidden_states=torch.randn(2, 64, 32),
              padding_mask=b["x"].new_zeros(1, 1, 64, 64), return_dict=False)[0]
    assert torch.isfinite(v).all()


# ------------------------------------------------------------------------------------------------ training


def test_training_mode_full_finetune_with_stochastic_rounding_and_export(tmp_path):
    dtype = torch.bfloat16  # cast to the training dtype before quantizing (docs/sdnq.md#no-autocast)
    models = tiny_models(dtype=dtype)
    originals = {k: v.detach().clone() for k, v in models["transformer"].state_dict().items()}
    cfg = make_cfg(kind="none")
    cfg.train.dtype, cfg.train.gradient_checkpointing = "bfloat16", False
    cfg.component_lr.adaln = 0.0  # frozen: quantized without stochastic rounding, never updated
    cfg.optimizer.kind, cfg.optimizer.lr, cfg.optimizer.quantize_state = "adamw8bit", 1e-3, True
    cfg.quant.mode, cfg.quant.weights_dtype, cfg.quant.skip_policy = "training", "int8", "default"
    cfg.quant.group_size = 32  # groups of 32 inputs (SDNQ's own training default)
    report = quant.quantize_models(models, cfg, **TINY)
    assert not report.use_quantized_matmul  # always off in training mode
    dit = models["transformer"]
    to_q = dit.get_submodule("transformer_blocks.1.attn1.to_q").weight
    adaln = dit.get_submodule("transformer_blocks.1.norm1.linear_1").weight
    assert to_q.sdnq_dequantizer.use_stochastic_rounding and not adaln.sdnq_dequantizer.use_stochastic_rounding
    assert to_q.sdnq_dequantizer.group_size == 32 and to_q.scale.numel() == 64 * 2  # 64 rows x 2 groups of 32
    adapters.inject_adapters(dit, models["text_conditioner"], models["text_encoder"], cfg)
    groups, _ = adapters.build_param_groups(models, cfg)
    assert to_q.requires_grad and not adaln.requires_grad
    opt = build_optimizer(groups, cfg.optimizer)
    codes_before = to_q.weight.clone()
    adaln_before = adaln.dequantize().clone()
    b = dit_batch(dtype=dtype)
    losses = train_steps(models, opt, b, 5)
    assert losses[-1] < losses[0], losses
    assert is_sdnq(to_q) and to_q.weight.dtype == torch.int8  # still int8 codes after the updates
    assert (to_q.weight != codes_before).float().mean() > 0.05
    assert torch.equal(adaln.dequantize(), adaln_before)

    export = quant.dequantized_state_dict(dit, dtype)
    assert set(export) == set(originals)
    assert all(type(t) is torch.Tensor and t.dtype == dtype for t in export.values())
    torch.testing.assert_close(export["transformer_blocks.1.attn1.to_q.weight"], to_q.dequantize(dtype=dtype))
    unquantized = "transformer_blocks.0.norm1.linear_1.weight"  # skip_policy default: plain bf16, untouched
    assert torch.equal(export[unquantized], originals[unquantized])
    from safetensors.torch import load_file, save_file
    save_file(export, tmp_path / "dit.safetensors")
    assert load_file(tmp_path / "dit.safetensors").keys() == export.keys()


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_gpu_frozen_lora_on_int8_base_with_quantized_matmul():
    """CUDA: bf16 DiT, int8 frozen base with SDNQ's quantized matmul (Triton on GPU), LoRA gradients close to the
    dequantized reference and a few training steps."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    models = {k: v.to(dev) for k, v in tiny_models(dtype=dtype).items()}
    cfg = frozen_cfg("lora", use_quantized_matmul=True)
    cfg.adapter.train_llm_adapter = False
    cfg.optimizer.kind, cfg.optimizer.lr = "adamw8bit", 1e-3
    reference = {k: copy.deepcopy(v) for k, v in models.items()}
    report = quant.quantize_models(models, cfg, **TINY)
    assert report.use_quantized_matmul
    for name in report.quantized["transformer"]:
        w = models["transformer"].get_submodule(name).weight
        assert w.device.type == "cuda"
        reference["transformer"].get_submodule(name).weight.data = w.dequantize(dtype=dtype)
    for m in (models, reference):
        adapters.inject_adapters(m["transformer"], m["text_conditioner"], m["text_encoder"], cfg)
    same_random_adapters(models, reference)
    b = {k: v.to(dev) for k, v in dit_batch(dtype=dtype).items()}
    b["x"] = b["x"].repeat(8, 1, 1, 1, 1)  # 16 x 16 tokens: enough rows for the quantized kernels
    b["sigma"], b["qwen"], b["t5"], b["target"] = (b[k].repeat(8, *[1] * (b[k].ndim - 1))
                                                    for k in ("sigma", "qwen", "t5", "target"))
    loss = dit_loss(models, b)
    ref_loss = dit_loss(reference, b)
    loss.backward()
    ref_loss.backward()
    errors = [((p.grad.float() - r.grad.float()).norm() / r.grad.float().norm()).item()
              for (_, _, p), (_, _, r) in zip(adapters.adapter_parameters(models["transformer"]),
                                              adapters.adapter_parameters(reference["transformer"]))]
    assert max(errors) < 0.15, errors
    groups, _ = adapters.build_param_groups(models, cfg)
    opt = build_optimizer(groups, cfg.optimizer)
    losses = train_steps(models, opt, b, 4)
    assert losses[-1] < losses[0], losses


@pytest.mark.gpu
def test_gpu_training_mode_full_finetune():
    dev, dtype = torch.device("cuda"), torch.bfloat16
    models = {k: v.to(dev) for k, v in tiny_models(dtype=dtype).items()}
    cfg = make_cfg(kind="none")
    cfg.train.gradient_checkpointing = False
    cfg.optimizer.kind, cfg.optimizer.lr = "adamw8bit", 1e-3
    cfg.optimizer.quantize_state = cfg.optimizer.use_kahan = True
    cfg.quant.mode = "training"
    quant.quantize_models(models, cfg, **TINY)
    adapters.inject_adapters(models["transformer"], models["text_conditioner"], models["text_encoder"], cfg)
    groups, _ = adapters.build_param_groups(models, cfg)
    opt = build_optimizer(groups, cfg.optimizer)
    b = {k: v.to(dev) for k, v in dit_batch(dtype=dtype).items()}
    losses = train_steps(models, opt, b, 5)
    assert losses[-1] < losses[0], losses
    assert is_sdnq(models["transformer"].get_submodule("transformer_blocks.1.ff.net.2").weight)

