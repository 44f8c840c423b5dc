"""Which weights train: adapter injection (peft, the method's config), full-finetune selection, and one param group
per component.

    inject_adapters(transformer, conditioner, text_encoder, cfg)      # in place; freezes everything else
    groups, table = build_param_groups({"transformer": t, "text_conditioner": c, "text_encoder": q}, cfg)
    print(table)                                                      # the startup report
    optimizer = optimizers.build_optimizer(groups, cfg.optimizer)

Components (docs/model.md#linear-groups, diffusers module names):

    self_attn   transformer_blocks.N.attn1.{to_q,to_k,to_v,to_out.0}
    cross_attn  transformer_blocks.N.attn2.{to_q,to_k,to_v,to_out.0}
    mlp         transformer_blocks.N.ff.net.0.proj, transformer_blocks.N.ff.net.2
    adaln       transformer_blocks.N.norm{1,2,3}.linear_{1,2}, norm_out.linear_{1,2}
    base        patch_embed.proj, time_embed.t_embedder.linear_{1,2}, proj_out
    llm_adapter the Linears of AnimaTextConditioner (blocks.N.{self,cross}_attn.{q,k,v,o}_proj, blocks.N.mlp.{0,2},
                out_proj)
    text_encoder  the Qwen3 projections layers.N.self_attn.{q,k,v,o}_proj, layers.N.mlp.{gate,up,down}_proj

Adapters are injected with peft under the adapter name "default" (ADAPTER_NAME), with the peft config of the
[adapter] kind's method (`<method>/model.py: peft_config`): through the diffusers PEFT mixin (`add_adapter`) for the
DiT and the conditioner, and `peft.inject_adapter_in_model` for Qwen3 (transformers 5.24's own `add_adapter` refuses
peft < 0.22). Module names stay the diffusers ones with peft's usual inner names (`<module>.lora_A.default.weight`,
`<module>.lokr_w1.default`, base weight at `<module>.base_layer.weight`).
The Qwen3 adapter is always a LoRA (rank = text_encoder_rank or rank, same alpha/rank scale as the DiT adapter).

Full finetune (a method with trains_base, kind = "none"): nothing is injected; every parameter of the DiT and the
conditioner is a candidate, grouped by the component of the sub-tree that owns it: the q/k RMSNorms of attn1/attn2
go with self_attn/cross_attn, everything under ff with mlp, norm1/2/3 and norm_out with adaln, and the rest of the
DiT (patch_embed, time_embed incl. its RMSNorm, proj_out) with base. Every conditioner parameter (embedding and
norms too) is llm_adapter. Qwen3 and the VAE never full-finetune.

A component whose [component_lr] is 0.0 is frozen: requires_grad False, in no param group, no optimizer state.
Adapters are still injected into a frozen component listed in [adapter] components (a fresh adapter is an exact
no-op), so the component shows up in the report as frozen.

Adapter dtype: the training dtype (train.dtype), as peft's own injection does, so peft never up-casts a layer's
input; the optimizer keeps fp32 masters of bf16/fp16 adapters (optimizers.FP32MasterWeights), so small updates
are not rounded away.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer

from anima_train import adapters
from anima_train.adapters.base import ADAPTER_NAME, MODEL_ROLES
from anima_train.config import COMPONENT_LR_KEYS, Config
from anima_train.model.keymaps import owner_component

# Linear targets per component; full matches on diffusers module names.
_DIT_TARGETS = {
    "self_attn": re.compile(r"transformer_blocks\.\d+\.attn1\.(to_q|to_k|to_v|to_out\.0)"),
    "cross_attn": re.compile(r"transformer_blocks\.\d+\.attn2\.(to_q|to_k|to_v|to_out\.0)"),
    "mlp": re.compile(r"transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)"),
    "adaln": re.compile(r"(transformer_blocks\.\d+\.norm[123]|norm_out)\.linear_[12]"),
    "base": re.compile(r"patch_embed\.proj|time_embed\.t_embedder\.linear_[12]|proj_out"),
}
_CONDITIONER_TARGETS = re.compile(r"blocks\.\d+\.(self_attn|cross_attn)\.[qkvo]_proj|blocks\.\d+\.mlp\.[02]|out_proj")
_TEXT_ENCODER_TARGETS = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)")

def component_of(module_name: str, model: str = "transformer") -> str | None:
    """The component of an adapter-target Linear, from its diffusers module name; None for any other module.

    `model` is the role of the model the name belongs to ("transformer", "text_conditioner", "text_encoder"): the
    three models share leaf names (`norm`, `self_attn.q_proj`), so a bare name is not enough.
    """
    if model == "transformer":
        for comp, pattern in _DIT_TARGETS.items():
            if pattern.fullmatch(module_name):
                return comp
        return None
    if model == "text_conditioner":
        return "llm_adapter" if _CONDITIONER_TARGETS.fullmatch(module_name) else None
    if model == "text_encoder":
        return "text_encoder" if _TEXT_ENCODER_TARGETS.fullmatch(module_name) else None
    raise ValueError(f"unknown model role {model!r}; expected one of {', '.join(MODEL_ROLES)}")


def target_modules(model: torch.nn.Module, components, role: str = "transformer") -> list[str]:
    """Exact names of the Linear modules of `model` that belong to `components` (sorted as in the model)."""
    wanted = set(components)
    out = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and component_of(name, role) in wanted:
            out.append(name)
    return out


def tuner_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)}


def adapter_parameters(model: torch.nn.Module) -> list[tuple[str, str, torch.nn.Parameter]]:
    """(wrapped module name, parameter name, parameter) of every peft adapter tensor in `model`."""
    out = []
    for mod_name, layer in tuner_layers(model).items():
        for attr in dict.fromkeys(layer.adapter_layer_names):  # peft's DoRA appends its magnitude's name again
            sub = getattr(layer, attr, None)
            if sub is None:
                continue
            for pname, p in sub.named_parameters():
                out.append((mod_name, f"{mod_name}.{attr}.{pname}", p))
    return out


def _set_adapter_dtype(model: torch.nn.Module, dtype: torch.dtype | None) -> None:
    if dtype is None:  # the model's own dtype (peft may have made fp32 adapters on a bf16 model)
        dtype = next(p.dtype for n, p in model.named_parameters()
                     if p.is_floating_point() and ".base_layer." in n)
    for _, _, p in adapter_parameters(model):
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def inject_adapters(transformer: torch.nn.Module, conditioner: torch.nn.Module | None,
                    text_encoder: torch.nn.Module | None, cfg: Config,
                    adapter_dtype: torch.dtype | None | str = "auto") -> dict[str, list[str]]:
    """Prepare the models for training in place; returns the injected module names per model role.

    An adapter method (LoRA, LoKr, ...): every base weight is frozen and the method's adapter goes onto exactly
    the Linears of `cfg.adapter.components` (+ the conditioner's Linears if train_llm_adapter). Full finetune
    (trains_base): the DiT and conditioner weights are made trainable (build_param_groups then freezes the
    components whose LR is 0). In both modes Qwen3 is frozen and gets a LoRA on its q/k/v/o/gate/up/down
    projections if train_text_encoder.

    adapter_dtype: "auto" = the model's (training) dtype; None = the model's dtype;
    or an explicit torch dtype.
    """
    a = cfg.adapter
    method = adapters.method(a.kind)
    if adapter_dtype == "auto":
        # The training dtype, as peft's own injection does: fp32 adapters on a bf16 trunk make peft cast every
        # adapted layer's input to fp32 (measured on an H200, LoRA r32 b8 1024²: +42% step time, +3.7 GiB peak).
        adapter_dtype = None
    for m in (transformer, conditioner, text_encoder):
        if m is not None:
            m.requires_grad_(False)
            if tuner_layers(m):
                raise ValueError(f"{type(m).__name__} already holds peft adapters; inject_adapters expects "
                                 "freshly loaded models (inject once, before building the optimizer)")
    injected: dict[str, list[str]] = {}
    if method.trains_base:
        transformer.requires_grad_(True)
        if conditioner is not None:
            conditioner.requires_grad_(True)
    else:
        peft_config = method.runtime().peft_config

        def add(module, targets: list[str], role: str) -> None:
            module.add_adapter(peft_config(a, targets, a.rank, a.alpha), adapter_name=ADAPTER_NAME)
            _set_adapter_dtype(module, adapter_dtype)
            injected[role] = targets

        targets = target_modules(transformer, a.components, "transformer")
        if targets:
            add(transformer, targets, "transformer")
        if a.train_llm_adapter:
            if conditioner is None:
                raise ValueError("[adapter] train_llm_adapter = true but no text conditioner was passed")
            add(conditioner, target_modules(conditioner, ["llm_adapter"], "text_conditioner"), "text_conditioner")
    if a.train_text_encoder:
        if text_encoder is None:
            raise ValueError("[adapter] train_text_encoder = true but no text encoder (Qwen3) was passed")
        rank, alpha = text_encoder_rank_alpha(cfg)
        targets = target_modules(text_encoder, ["text_encoder"], "text_encoder")
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=a.dropout,
                            target_modules=targets, init_lora_weights=True)
        inject_adapter_in_model(config, text_encoder, adapter_name=ADAPTER_NAME)
        _set_adapter_dtype(text_encoder, adapter_dtype)
        injected["text_encoder"] = targets
    return injected


def text_encoder_rank_alpha(cfg: Config) -> tuple[int, float]:
    """Rank and alpha of the Qwen3 LoRA: text_encoder_rank (or rank), with the DiT adapter's alpha/rank scale kept,
    so the LR means the same at a different rank."""
    a = cfg.adapter
    rank = a.text_encoder_rank or a.rank
    return rank, a.alpha * rank / a.rank


def _candidates(role: str, model: torch.nn.Module, cfg: Config) -> list[tuple[str, str, torch.nn.Parameter]]:
    """(component, parameter name, parameter) of every tensor that may train in this model."""
    tensors = adapter_parameters(model)
    if tensors:
        out = []
        for mod_name, pname, p in tensors:
            comp = component_of(mod_name, role)
            if comp is None:
                raise ValueError(f"{role}: adapter on {mod_name!r}, which belongs to no component; inject with "
                                 "anima_train.adapters.inject_adapters")
            out.append((comp, pname, p))
        return out
    if adapters.method(cfg.adapter.kind).trains_base and role in ("transformer", "text_conditioner"):
        return [(owner_component(n, role), n, p) for n, p in model.named_parameters()]
    return []


def _format_row(comp: str, trainable: int, frozen: int, lr: float | None) -> str:
    rate = "FROZEN" if not lr else f"lr={lr:.2e}"
    return f"  {comp:<15}{trainable / 1e6:6.2f}M trainable {frozen / 1e6:9.2f}M frozen  {rate}"


def build_param_groups(models: Mapping[str, torch.nn.Module | None], cfg: Config) -> tuple[list[dict], str]:
    """One optimizer param group per trainable component, and the startup report.

    models: {"transformer": ..., "text_conditioner": ..., "text_encoder": ...} (missing or None = not loaded),
    prepared by inject_adapters. Every group is {"name": component, "params": [...], "lr": peak LR,
    "weight_decay": optimizer.weight_decay}. Tensors of a component with LR 0.0, and every non-candidate tensor,
    get requires_grad False. Raises ValueError if nothing trains.
    """
    unknown = set(models) - set(MODEL_ROLES)
    if unknown:
        raise ValueError(f"build_param_groups: unknown model role(s) {sorted(unknown)}; use {', '.join(MODEL_ROLES)}")
    lrs = cfg.component_learning_rates()
    by_comp: dict[str, list[torch.nn.Parameter]] = {c: [] for c in COMPONENT_LR_KEYS}
    frozen = dict.fromkeys(COMPONENT_LR_KEYS, 0)
    seen: set[int] = set()
    for role in MODEL_ROLES:
        model = models.get(role)
        if model is None:
            continue
        model.requires_grad_(False)
        for comp, pname, p in _candidates(role, model, cfg):
            if id(p) in seen:  # tied weights: count and train once
                continue
            seen.add(id(p))
            if comp not in lrs:
                raise ValueError(f"{role}: {pname} belongs to {comp}, which [adapter] does not train "
                                 f"(trainable components: {', '.join(lrs)}); the models and the config disagree")
            if lrs[comp] > 0:
                p.requires_grad_(True)
                by_comp[comp].append(p)
            else:
                frozen[comp] += p.numel()
    groups = [{"name": c, "params": by_comp[c], "lr": lrs[c], "weight_decay": cfg.optimizer.weight_decay}
              for c in COMPONENT_LR_KEYS if by_comp[c]]
    rows = []
    for comp in COMPONENT_LR_KEYS:
        if comp in lrs:
            n_train = sum(p.numel() for p in by_comp[comp])
            rows.append(_format_row(comp, n_train, frozen[comp], lrs[comp] if n_train else 0.0))
    total_train = sum(p.numel() for g in groups for p in g["params"])
    rows.append(f"  {'total':<15}{total_train / 1e6:6.2f}M trainable {sum(frozen.values()) / 1e6:9.2f}M frozen")
    table = "\n".join(rows)
    if not groups:
        raise ValueError("nothing to train: every component is frozen or has no parameters "
                         f"([adapter] kind = {cfg.adapter.kind!r}, components = {cfg.adapter.components}); "
                         "give a component a non-zero [component_lr]\n" + table)
    return groups, table
