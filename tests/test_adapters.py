"""Adapter injection (every method), full-finetune selection and per-component param groups on tiny random Anima
models; the method registry and its one-folder seam."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from anima_train import adapters
from anima_train.config import AdapterConfig, Config, iter_fields
from anima_train.errors import UserError

ROOT = Path(__file__).resolve().parents[1]

# the tiny configs of docs/model.md#tiny-models
TRANSFORMER_TINY = dict(in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=32, num_layers=2,
                        mlp_ratio=4.0, text_embed_dim=32, adaln_lora_dim=16, max_size=(128, 240, 240),
                        patch_size=(1, 2, 2), rope_scale=(1.0, 4.0, 4.0), concat_padding_mask=True,
                        extra_pos_embed_type=None)
CONDITIONER_TINY = dict(source_dim=32, target_dim=32, model_dim=32, num_layers=2, num_attention_heads=4,
                        mlp_ratio=4.0, target_vocab_size=110, use_self_attention=True, use_layer_norm=False,
                        min_sequence_length=64)
QWEN3_TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, attention_bias=False, tie_word_embeddings=False)


def tiny_models(seed: int = 0, dtype=torch.float32) -> dict:
    from diffusers import CosmosTransformer3DModel
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    models = dict(transformer=CosmosTransformer3DModel(**TRANSFORMER_TINY),
                  text_conditioner=AnimaTextConditioner(**CONDITIONER_TINY),
                  text_encoder=Qwen3Model(Qwen3Config(**QWEN3_TINY)))
    if dtype != torch.float32:
        models = {k: m.to(dtype) for k, m in models.items()}
    return {k: m.eval() for k, m in models.items()}


def tiny_batch(seed: int = 1, batch: int = 2, dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(ids=torch.randint(0, 300, (batch, 6), generator=g), t5=torch.randint(2, 110, (batch, 5), generator=g),
                x=torch.randn(batch, 16, 1, 8, 8, generator=g).to(dtype),
                sigma=torch.rand(batch, generator=g).to(dtype),
                target=torch.randn(batch, 16, 1, 8, 8, generator=g))


def tiny_forward(models: dict, b: dict) -> torch.Tensor:
    """Qwen3 -> conditioner -> DiT, as in docs/model.md#flow-matching (no VAE: latents are given)."""
    mask = torch.ones_like(b["ids"])
    h = models["text_encoder"](input_ids=b["ids"], attention_mask=mask).last_hidden_state
    ctx = models["text_conditioner"](source_hidden_states=h, target_input_ids=b["t5"],
                                     target_attention_mask=torch.ones_like(b["t5"]), source_attention_mask=mask)
    x = b["x"]
    return models["transformer"](x, timestep=b["sigma"], encoder_hidden_states=ctx,
                                 padding_mask=x.new_zeros(1, 1, 64, 64), return_dict=False)[0]


def tiny_loss(models: dict, b: dict) -> torch.Tensor:
    return torch.nn.functional.mse_loss(tiny_forward(models, b).float(), b["target"])


def make_cfg(**adapter) -> Config:
    cfg = Config()
    for k, v in adapter.items():
        setattr(cfg.adapter, k, v)
    return cfg


def inject(models: dict, cfg: Config) -> dict:
    return adapters.inject_adapters(models["transformer"], models["text_conditioner"], models["text_encoder"], cfg)


# ------------------------------------------------------------------------------------------------- components


def test_component_targets_are_exact():
    m = tiny_models()
    dit = m["transformer"]
    blocks = [f"transformer_blocks.{i}" for i in range(2)]
    expected = {
        "self_attn": {f"{b}.attn1.{x}" for b in blocks for x in ("to_q", "to_k", "to_v", "to_out.0")},
        "cross_attn": {f"{b}.attn2.{x}" for b in blocks for x in ("to_q", "to_k", "to_v", "to_out.0")},
        "mlp": {f"{b}.ff.net.{x}" for b in blocks for x in ("0.proj", "2")},
        "adaln": {f"{b}.norm{i}.linear_{j}" for b in blocks for i in (1, 2, 3) for j in (1, 2)}
                 | {"norm_out.linear_1", "norm_out.linear_2"},
        "base": {"patch_embed.proj", "time_embed.t_embedder.linear_1", "time_embed.t_embedder.linear_2", "proj_out"},
    }
    for comp, names in expected.items():
        assert set(adapters.target_modules(dit, [comp])) == names, comp
    linears = {n for n, mod in dit.named_modules() if isinstance(mod, torch.nn.Linear)}
    assert set().union(*expected.values()) == linears  # every DiT Linear is in exactly one component
    # non-target modules and near-miss names are no component
    for name in ("transformer_blocks.0.attn1.norm_q", "time_embed.norm", "transformer_blocks.0.attn1.to_out",
                 "transformer_blocks.0.attn1.to_qx", "transformer_blocks.0.attn3.to_q", "proj_out.lora_A"):
        assert adapters.component_of(name) is None, name
    cond_linears = {n for n, mod in m["text_conditioner"].named_modules() if isinstance(mod, torch.nn.Linear)}
    assert set(adapters.target_modules(m["text_conditioner"], ["llm_adapter"], "text_conditioner")) == cond_linears
    assert len(cond_linears) == 21
    te = adapters.target_modules(m["text_encoder"], ["text_encoder"], "text_encoder")
    assert len(te) == 14 and all(re.search(r"(q|k|v|o|gate|up|down)_proj$", n) for n in te)
    # names are per model: the conditioner's `norm` is not a DiT component, a DiT name is not the conditioner's
    assert adapters.component_of("out_proj", "text_conditioner") == "llm_adapter"
    assert adapters.component_of("out_proj") is None
    assert adapters.component_of("blocks.0.self_attn.q_proj", "text_encoder") is None
    with pytest.raises(ValueError, match="unknown model role"):
        adapters.component_of("proj_out", "vae")


def test_lora_injects_exact_targets_and_is_a_noop():
    m = tiny_models()
    b = tiny_batch()
    with torch.no_grad():
        before = tiny_forward(m, b)
    cfg = make_cfg()  # default: rank 32 LoRA on self_attn, cross_attn, mlp
    injected = inject(m, cfg)
    want = set(adapters.target_modules(tiny_models()["transformer"], ["self_attn", "cross_attn", "mlp"]))
    assert set(injected) == {"transformer"} and set(injected["transformer"]) == want
    wrapped = {name for name, _, _ in adapters.adapter_parameters(m["transformer"])}
    assert wrapped == want
    with torch.no_grad():
        after = tiny_forward(m, b)
    assert torch.equal(before, after)  # B = 0: a fresh LoRA changes nothing, bit for bit
    trainable = {n for n, p in m["transformer"].named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert not any(p.requires_grad for k in ("text_conditioner", "text_encoder") for p in m[k].parameters())
    lora_b = [p for n, p in m["transformer"].named_parameters() if ".lora_B." in n]
    assert all(torch.count_nonzero(p) == 0 for p in lora_b)
    with pytest.raises(ValueError, match="already holds peft adapters"):
        inject(m, cfg)


def test_param_groups_lrs_freezing_and_table():
    m = tiny_models()
    cfg = make_cfg(rank=4, alpha=4.0, components=["self_attn", "cross_attn", "mlp", "adaln", "base"])
    cfg.component_lr.self_attn, cfg.component_lr.cross_attn, cfg.component_lr.mlp = 3e-5, 1.5e-5, 0.0
    cfg.component_lr.adaln, cfg.component_lr.base = 1e-4, 0.0
    cfg.optimizer.weight_decay = 0.05
    inject(m, cfg)
    groups, table = adapters.build_param_groups(m, cfg)
    assert [(g["name"], g["lr"], g["weight_decay"]) for g in groups] == [
        ("self_attn", 3e-5, 0.05), ("cross_attn", 1.5e-5, 0.05), ("adaln", 1e-4, 0.05)]
    in_groups = {id(p) for g in groups for p in g["params"]}
    per_comp = {}
    for mod, name, p in adapters.adapter_parameters(m["transformer"]):
        comp = adapters.component_of(mod)
        per_comp[comp] = per_comp.get(comp, 0) + p.numel()
        assert p.requires_grad == (comp in ("self_attn", "cross_attn", "adaln")), name
        assert (id(p) in in_groups) == p.requires_grad, name
    # rank-4 sizes from the shapes: r * (in + out) per wrapped Linear
    dit = tiny_models()["transformer"]
    for comp in ("self_attn", "mlp", "base"):
        want = sum(4 * (dit.get_submodule(n).in_features + dit.get_submodule(n).out_features)
                   for n in adapters.target_modules(dit, [comp]))
        assert per_comp[comp] == want, comp
    rows = {line.split()[0]: line for line in table.splitlines()}
    self_attn_m = per_comp["self_attn"] / 1e6
    assert rows["self_attn"] == f"  self_attn      {self_attn_m:6.2f}M trainable      0.00M frozen  lr=3.00e-05"
    assert rows["mlp"].endswith("M frozen  FROZEN") and f"{per_comp['mlp'] / 1e6:.2f}M frozen" in rows["mlp"]
    assert "lr=1.00e-04" in rows["adaln"] and rows["base"].endswith("FROZEN")
    assert list(rows) == ["self_attn", "cross_attn", "mlp", "adaln", "base", "total"]

    # a frozen component gets no gradient and no optimizer state
    opt = torch.optim.AdamW(groups)
    tiny_loss(m, tiny_batch()).backward()
    opt.step()
    for mod, name, p in adapters.adapter_parameters(m["transformer"]):
        comp = adapters.component_of(mod)
        if comp in ("mlp", "base"):
            assert p.grad is None and p not in opt.state, name
        elif ".lora_A." in name:  # B was 0, so only B has a gradient after one step; A got state all the same
            assert p in opt.state
    assert any(torch.count_nonzero(p.grad) > 0 for g in groups for p in g["params"] if p.grad is not None)


def test_everything_frozen_is_an_error():
    m = tiny_models()
    cfg = make_cfg(rank=2, alpha=2.0, components=["adaln"])  # adaln defaults to 0.0
    inject(m, cfg)
    with pytest.raises(ValueError, match="nothing to train") as exc:
        adapters.build_param_groups(m, cfg)
    assert "adaln" in str(exc.value) and "FROZEN" in str(exc.value)


def test_full_finetune_groups_every_parameter_by_owner():
    m = tiny_models()
    cfg = make_cfg(kind="none")
    cfg.component_lr.self_attn, cfg.component_lr.base = 2e-5, 1e-6  # cross_attn, mlp inherit optimizer.lr
    injected = inject(m, cfg)
    assert injected == {} and not adapters.adapter_parameters(m["transformer"])
    groups, table = adapters.build_param_groups(m, cfg)
    names = {g["name"]: g for g in groups}
    assert list(names) == ["self_attn", "cross_attn", "mlp", "base"]  # adaln 0.0 and llm_adapter 0.0 frozen
    assert names["mlp"]["lr"] == cfg.optimizer.lr and names["base"]["lr"] == 1e-6
    dit = m["transformer"]
    comp_of = {id(p): g["name"] for g in groups for p in g["params"]}
    params = dict(dit.named_parameters())
    assert comp_of[id(params["transformer_blocks.1.attn1.norm_q.weight"])] == "self_attn"
    assert comp_of[id(params["transformer_blocks.0.attn2.norm_k.weight"])] == "cross_attn"
    assert comp_of[id(params["time_embed.norm.weight"])] == "base"
    assert comp_of[id(params["proj_out.weight"])] == "base"
    adaln_owner = re.compile(r"(transformer_blocks\.\d+\.norm[123]|norm_out)\.")
    for n, p in params.items():
        is_adaln = adaln_owner.match(n) is not None
        assert p.requires_grad != is_adaln, n
        assert (id(p) in comp_of) != is_adaln, n
    n_dit = sum(p.numel() for p in dit.parameters())
    n_cond = sum(p.numel() for p in m["text_conditioner"].parameters())
    n_groups = sum(p.numel() for g in groups for p in g["params"])
    n_adaln = sum(p.numel() for n, p in params.items() if adaln_owner.match(n))
    assert n_groups == n_dit - n_adaln
    assert f"{(n_adaln + n_cond) / 1e6:9.2f}M frozen" in table.splitlines()[-1]
    assert not any(p.requires_grad for p in m["text_conditioner"].parameters())
    assert not any(p.requires_grad for p in m["text_encoder"].parameters())


def _train(models, groups, batch, steps=4, opt_cls=torch.optim.AdamW, **kw):
    opt = opt_cls(groups, **kw)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = tiny_loss(models, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_lokr_injects_and_trains():
    m = tiny_models()
    b = tiny_batch()
    with torch.no_grad():
        before = tiny_forward(m, b)
    cfg = make_cfg(kind="lokr", rank=4, alpha=4.0, components=["self_attn", "mlp"], train_llm_adapter=True)
    cfg.component_lr.llm_adapter = 1e-3
    cfg.optimizer.lr = 1e-3
    injected = inject(m, cfg)
    assert set(injected) == {"transformer", "text_conditioner"}
    names = [n for _, n, _ in adapters.adapter_parameters(m["transformer"])]
    assert names and all(re.search(r"\.lokr_w(1|2|1_a|1_b|2_a|2_b)\.default$", n) for n in names)
    with torch.no_grad():
        assert torch.equal(tiny_forward(m, b), before)  # fresh LoKr is a no-op too
    groups, _ = adapters.build_param_groups(m, cfg)
    assert [g["name"] for g in groups] == ["self_attn", "mlp", "llm_adapter"]
    loss = tiny_loss(m, b)
    loss.backward()
    grads = [p.grad for g in groups for p in g["params"] if p.grad is not None]
    assert grads and sum(g.abs().sum().item() for g in grads) > 0
    losses = _train(m, groups, b, steps=4)
    assert losses[-1] < losses[0]
    with torch.no_grad():
        assert not torch.allclose(tiny_forward(m, b), before)


def test_loha_injects_and_trains():
    m = tiny_models()
    b = tiny_batch()
    with torch.no_grad():
        before = tiny_forward(m, b)
    cfg = make_cfg(kind="loha", rank=4, alpha=2.0, components=["cross_attn", "mlp"], train_llm_adapter=True)
    cfg.component_lr.llm_adapter = 1e-3
    cfg.optimizer.lr = 1e-3
    injected = inject(m, cfg)
    assert set(injected) == {"transformer", "text_conditioner"}
    assert set(injected["transformer"]) == set(adapters.target_modules(tiny_models()["transformer"],
                                                                       ["cross_attn", "mlp"]))
    names = [n for _, n, _ in adapters.adapter_parameters(m["transformer"])]
    assert names and all(re.search(r"\.hada_w[12]_[ab]\.default$", n) for n in names)
    to_k = m["transformer"].transformer_blocks[0].attn2.to_k
    assert to_k.hada_w1_a["default"].shape == (64, 4) and to_k.hada_w1_b["default"].shape == (4, 32)
    assert to_k.scaling["default"] == pytest.approx(2.0 / 4)
    assert torch.count_nonzero(to_k.hada_w2_b["default"]) == 0  # peft's init: w2_b = 0
    with torch.no_grad():
        assert torch.equal(tiny_forward(m, b), before)  # a fresh LoHa is a no-op, bit for bit
    groups, _ = adapters.build_param_groups(m, cfg)
    assert [g["name"] for g in groups] == ["cross_attn", "mlp", "llm_adapter"]
    losses = _train(m, groups, b, steps=4)
    assert losses[-1] < losses[0]
    with torch.no_grad():
        assert not torch.allclose(tiny_forward(m, b), before)
        assert torch.count_nonzero(to_k.hada_w2_b["default"]) > 0


def test_dora_injects_and_trains():
    m = tiny_models()
    b = tiny_batch()
    with torch.no_grad():
        before = tiny_forward(m, b)
    cfg = make_cfg(kind="dora", rank=4, alpha=2.0, components=["cross_attn", "mlp"], train_llm_adapter=True)
    cfg.component_lr.llm_adapter = 1e-3
    cfg.optimizer.lr = 1e-2
    injected = inject(m, cfg)
    assert set(injected) == {"transformer", "text_conditioner"}
    names = [n for _, n, _ in adapters.adapter_parameters(m["transformer"])]
    assert len(names) == len(set(names)) == 3 * len(injected["transformer"])  # A, B and the magnitude, once each
    assert all(re.search(r"\.(lora_[AB]|lora_magnitude_vector)\.default\.weight$", n) for n in names)
    to_k = m["transformer"].transformer_blocks[0].attn2.to_k
    magnitude = to_k.lora_magnitude_vector["default"].weight
    assert magnitude.shape == (64,) and torch.allclose(magnitude, to_k.base_layer.weight.norm(dim=1))  # m = ‖W‖
    with torch.no_grad():
        assert torch.equal(tiny_forward(m, b), before)  # a fresh DoRA is a no-op, bit for bit
    groups, _ = adapters.build_param_groups(m, cfg)
    assert [g["name"] for g in groups] == ["cross_attn", "mlp", "llm_adapter"]
    start = magnitude.detach().clone()
    losses = _train(m, groups, b, steps=4)
    assert losses[-1] < losses[0]
    with torch.no_grad():
        assert not torch.allclose(tiny_forward(m, b), before)
        assert not torch.equal(magnitude, start)  # the magnitude trains


@pytest.mark.parametrize("kind", [m.kind for m in adapters.METHODS.values() if not m.trains_base])
def test_plan_counts_each_methods_trainable_parameters_as_peft_makes_them(kind):
    """`plan` asks the method what one adapted Linear trains (AdapterMethod.parameters): equal to the parameters
    peft makes on the tiny model, for a rank that leaves some LoKr factors whole and decomposes others."""
    from anima_train.model.shape import shape_of
    from anima_train.model.tiny import build_models
    from anima_train.training import plan

    models = build_models("tiny", seed=0)
    for rank, extra in ((4, {}), (16, {}), (4, {"lokr_decompose_both": True, "lokr_factor": 4})):
        cfg = make_cfg(kind=kind, rank=rank, **(extra if kind == "lokr" else {}))
        fresh = build_models("tiny", seed=0)
        inject(fresh, cfg)
        made = sum(p.numel() for _, _, p in adapters.adapter_parameters(fresh["transformer"]))
        assert plan.predict_inputs(cfg, shape_of(models)).trainable == made, (kind, rank, extra)


def test_text_encoder_lora_rank_scale_and_gradients():
    m = tiny_models()
    cfg = make_cfg(rank=4, alpha=8.0, components=["cross_attn"], train_text_encoder=True, text_encoder_rank=2)
    cfg.component_lr.text_encoder = 5e-6
    injected = inject(m, cfg)
    assert len(injected["text_encoder"]) == 14
    q_proj = m["text_encoder"].layers[0].self_attn.q_proj
    assert q_proj.lora_A["default"].weight.shape == (2, 32)
    assert q_proj.scaling["default"] == pytest.approx(8.0 / 4)  # alpha/rank of the DiT adapter kept
    groups, table = adapters.build_param_groups(m, cfg)
    assert [(g["name"], g["lr"]) for g in groups] == [("cross_attn", cfg.optimizer.lr), ("text_encoder", 5e-6)]
    assert "text_encoder" in table
    for p in groups[1]["params"]:
        torch.nn.init.normal_(p, std=0.1)  # non-zero B so that A gets a gradient as well
    tiny_loss(m, tiny_batch()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in groups[1]["params"])
    assert not any(p.requires_grad for n, p in m["text_encoder"].named_parameters() if "lora_" not in n)


def test_adapters_use_the_training_dtype():
    # peft's own injection puts adapters in the base layer's dtype; fp32 adapters on a bf16 trunk would make peft
    # cast every adapted layer's input to fp32 (slower and heavier, measured on the GPU)
    for kind in ("adamw", "adamw8bit"):
        m = tiny_models(dtype=torch.bfloat16)
        cfg = make_cfg(rank=2, alpha=2.0, components=["mlp"])
        cfg.optimizer.kind = kind
        inject(m, cfg)
        assert {p.dtype for _, _, p in adapters.adapter_parameters(m["transformer"])} == {torch.bfloat16}
        assert tiny_forward(m, tiny_batch(dtype=torch.bfloat16)).dtype == torch.bfloat16
    m = tiny_models(dtype=torch.bfloat16)
    adapters.inject_adapters(m["transformer"], m["text_conditioner"], m["text_encoder"],
                             make_cfg(rank=2, alpha=2.0, components=["mlp"]), adapter_dtype=torch.float32)
    assert {p.dtype for _, _, p in adapters.adapter_parameters(m["transformer"])} == {torch.float32}

# ------------------------------------------------------------------------------------------------- the registry


def test_every_method_in_the_registry_is_complete_and_drives_the_config():
    kind = next(f for f in iter_fields("adapter") if f.name == "kind")
    assert kind.choices == adapters.kinds() and kind.choices[:2] == ("lora", "lokr") and kind.choices[-1] == "none"
    assert all(k in kind.help for k in adapters.kinds())
    keys = {f.name for f in dataclasses.fields(AdapterConfig)}
    for m in adapters.METHODS.values():
        assert adapters.method(m.kind) is m and adapters.by_name(m.name) is m
        assert set(m.shape_keys) <= keys and set(m.exclusive) <= keys, m.name
        runtime = m.runtime()  # the torch side loads and implements the Runtime protocol
        assert callable(runtime.state_dict) and callable(runtime.save_checkpoint)
        assert m.trains_base or (callable(runtime.peft_config) and callable(runtime.delta) and m.factors), m.name
        assert m.trains_base or adapters.reading(m.factors[:1] + m.required_factors) is m, m.name
    assert adapters.method("none").trains_base and adapters.method("none").comfy_folder == "diffusion_models"
    with pytest.raises(UserError, match=r"\[adapter\] kind = 'glora' is not an adapter method; use one of 'lora'"):
        adapters.method("glora")


DEMO_METHOD = '''
from anima_train.adapters.base import AdapterMethod


def check(adapter, rules):
    if adapter.kind == "demo" and rules.ok("rank") and adapter.rank > 8:
        rules.error(f"[adapter] rank = {adapter.rank}: kind = \\"demo\\" takes rank <= 8", "rank")


def base_rule(adapter, base, rules):
    if base.matmul == "fp8":
        rules.error("[adapter] kind = \\"demo\\" needs the base weight; set [train] base_matmul = \\"bf16\\"", "kind")


METHOD = AdapterMethod(name="demo", kind="demo", title="Demo", order=5, summary="a test method",
                       layout="Demo files use demo_* keys", dropout="rank dropout", shape_keys=("rank", "alpha"),
                       text_encoder=False, check=check, base_rule=base_rule, network_module="demo.net",
                       architecture="/demo", parameters=lambda adapter, i, o: 7, factors=("demo_w", "alpha"),
                       required_factors=("demo_w",))
'''

DEMO_RUNTIME = ("from anima_train.adapters.lora.model import delta, peft_config, save_checkpoint, state_dict  "
                "# noqa: F401\n")

DEMO_CHECK = textwrap.dedent('''
    from anima_train import adapters
    from anima_train.adapters import export
    from anima_train.config import ConfigError, iter_fields, parse_config
    from anima_train.config.reference import reference_markdown
    from anima_train.outputs import resume_state

    kind = next(f for f in iter_fields("adapter") if f.name == "kind")
    assert kind.choices[-2:] == ("demo", "none"), kind.choices
    assert "demo (= a test method)" in kind.help and "Demo: rank dropout" in reference_markdown()
    base = '[dataset]\\npath = "data"\\n[adapter]\\nkind = "demo"\\n'
    cfg = parse_config(base + "rank = 4\\n")
    assert cfg.injected_components() == ["self_attn", "cross_attn", "mlp"]
    assert resume_state.describe_adapter(cfg)["alpha"] == 32.0
    for extra, wanted in (("rank = 16\\n", 'kind = "demo" takes rank <= 8'),
                          ('output_format = "kohya"\\n', "but kind = \\"demo\\": the kohya lora_unet_* layout defines "
                                                       "LoRA only (lora_down/lora_up/alpha); Demo files use demo_*"),
                          ("train_text_encoder = true\\n", 'not supported with kind = "demo"'),
                          ('[train]\\nbase_matmul = "fp8"\\n', 'kind = "demo" needs the base weight')):
        try:
            parse_config(base + extra)
        except ConfigError as e:
            assert wanted in str(e), str(e)
        else:
            raise AssertionError(extra)
    md = export.training_metadata(kind="demo", title="t", rank=4, alpha=4.0)
    assert md["ss_network_module"] == "demo.net" and md["modelspec.architecture"].endswith("/demo")
    assert adapters.method("demo").runtime().peft_config(cfg.adapter, ["to_q"], 4, 4.0).r == 4
    assert adapters.reading({"demo_w", "alpha"}) is adapters.method("demo")  # evaluate reads its files
    assert "Demo" in adapters.titles(adapters_only=True)  # the help texts name it
    print("demo ok")
''')


def test_a_new_adapter_method_is_one_folder(tmp_path):
    """A copy of the package plus one folder, anima_train/adapters/demo/, is a new [adapter] kind everywhere: the
    config's choices and help, docs/config.md, the rules (its own check, another method's exclusive key, the Qwen3
    LoRA refusal), the resume-state keys, the file metadata and the injection's peft config."""
    for package in ("anima_train", "anchor"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    demo = tmp_path / "anima_train" / "adapters" / "demo"
    demo.mkdir()
    (demo / "__init__.py").write_text(DEMO_METHOD)
    (demo / "model.py").write_text(DEMO_RUNTIME)
    (tmp_path / "data").mkdir()
    out = subprocess.run([sys.executable, "-c", DEMO_CHECK], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=300)
    assert out.returncode == 0 and "demo ok" in out.stdout, out.stderr[-3000:]
