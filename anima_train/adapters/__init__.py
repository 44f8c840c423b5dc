"""Adapter methods: what `[adapter] kind` selects, one folder per method, found by a registry.

    anima_train/adapters/
      base.py        AdapterMethod (the interface) and the Runtime protocol of its torch side; no torch
      inject.py      components, target Linears, inject_adapters, build_param_groups (torch)
      export.py      metadata, safetensors writing, the Qwen3 `_te` LoRA, adapter_state_dict / save_adapter (torch)
      <method>/      one folder per method: lora/, lokr/, loha/, dora/, full/ (kind "none"), ...
        __init__.py  METHOD = AdapterMethod(...): kind, help, config rules (also on the base: BaseFacts), metadata,
                     resume keys, trainable parameters per Linear, the file's tensor names (no torch)
        model.py     peft_config, state_dict (ComfyUI's keys), save_checkpoint, delta (ComfyUI's ΔW of a file's
                     tensors) (torch, peft)

    m = adapters.method(cfg.adapter.kind)        # unknown kind: a UserError naming [adapter] kind and the choices
    m.kind, m.title, m.trains_base, m.describe(cfg.adapter)
    m.runtime().state_dict(transformer, conditioner)

The registry (`METHODS`, kind -> method, in menu order) is built at import by finding every sub-package here that
defines `METHOD`: adding a method is one new folder. Everything that differs between methods reads it: the config's
`kind` choices and help (and so docs/config.md and the Train node's menu), the [adapter] rules (`check_config`) and
the rules on what the run does to the base weights (`check_base`, from config/rules.py), injection (`inject.py`
asks the method for its peft config), the checkpoint file and its metadata (`export.py`, `train.write_checkpoint`),
the resume-state description (`checkpoints.describe_adapter`), the folder the node publishes to, `evaluate`'s
reading of a file (`reading`, the method's `delta`), `plan`'s trainable parameters (`parameters`), the help texts
that name the methods (`titles`) and the tests that run every method (they iterate METHODS).

Why a frozen dataclass plus a module, not an ABC: a method has no state, only facts (strings, flags, key lists)
and a few functions; a dataclass makes each of them a named field with a default where one exists, so a new
method fills in what differs and reads like a table row, and nothing is inherited by accident. Why two files per
method: the config, the CLI's `--help` and ComfyUI's start-up must not import torch (5 s here) or peft (11 s;
measured on the 2-core build machine), yet they need the kinds, their help and their rules. So the facts live in
the torch-free `__init__.py`, the tensor work in `model.py`, loaded by `AdapterMethod.runtime()` on first use: the
same split peft makes between `tuners/<method>/config.py` and `layer.py`/`model.py`. For the same reason the
torch-side names of this package (`inject_adapters`, `build_param_groups`, ...) are resolved on first access
(module `__getattr__` below) rather than imported here.

Scale conventions of the files each method writes are in its `model.py` (docs/model.md#scale-conventions); ComfyUI's
loader reads `alpha / rank` with the rank taken from a factor's shape, so each exporter writes the alpha that reproduces
peft's own scaling.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from typing import Any

from anima_train.adapters.base import ADAPTER_NAME, MODEL_ROLES, AdapterMethod, BaseFacts, Rules
from anima_train.errors import UserError

__all__ = ["ADAPTER_NAME", "METHODS", "MODEL_ROLES", "AdapterMethod", "BaseFacts", "Rules", "base_refusals", "by_name",
           "check_base", "check_config", "dropout_help", "kind_help", "kinds", "method", "reading", "table_help",
           "titles"]


def _discover() -> dict[str, AdapterMethod]:
    found: list[AdapterMethod] = []
    for info in pkgutil.iter_modules(__path__, f"{__name__}."):
        if not info.ispkg:
            continue
        module = importlib.import_module(info.name)
        m = getattr(module, "METHOD", None)
        if not isinstance(m, AdapterMethod):
            raise TypeError(f"{info.name} defines no METHOD = AdapterMethod(...); every sub-package of "
                            f"{__name__} is an adapter method")
        if m.name != info.name.rpartition(".")[2]:
            raise TypeError(f"{info.name}: METHOD.name is {m.name!r}; it must be the folder's name")
        found.append(m)
    found.sort(key=lambda m: (m.order, m.kind))
    out: dict[str, AdapterMethod] = {}
    for m in found:
        if m.kind in out:
            raise TypeError(f"adapter kind {m.kind!r} is defined twice ({out[m.kind].name}, {m.name})")
        out[m.kind] = m
    return out


METHODS: dict[str, AdapterMethod] = _discover()


def kinds() -> tuple[str, ...]:
    """The values of [adapter] kind, in menu order."""
    return tuple(METHODS)


def method(kind: str) -> AdapterMethod:
    """The method of an [adapter] kind."""
    try:
        return METHODS[kind]
    except (KeyError, TypeError):
        raise UserError(f"[adapter] kind = {kind!r} is not an adapter method; use one of "
                        f"{', '.join(repr(k) for k in METHODS)}") from None


def by_name(name: str) -> AdapterMethod:
    """The method whose folder is `name` ("full" for kind "none")."""
    for m in METHODS.values():
        if m.name == name:
            return m
    raise ValueError(f"no adapter method named {name!r}; the methods are {', '.join(m.name for m in METHODS.values())}")


def kind_help() -> str:
    """The help of [adapter] kind, e.g. "lora, lokr, or none (= full finetune)"."""
    names = [m.kind + (f" (= {m.summary})" if m.summary else "") for m in METHODS.values()]
    return ", ".join(names[:-1]) + ", or " + names[-1] if len(names) > 1 else names[0]


def dropout_help() -> str:
    """The help of [adapter] dropout: what it means for each method that uses it."""
    by_meaning: dict[str, list[str]] = {}
    for m in METHODS.values():
        if m.dropout:
            by_meaning.setdefault(m.dropout, []).append(m.title)
    return "dropout probability; " + "; ".join(f"{', '.join(titles)}: {meaning}"
                                             for meaning, titles in by_meaning.items())


def table_help() -> str:
    """The one-line description of the [adapter] table, e.g. "LoRA / LoKr / full finetune"."""
    return " / ".join(m.title for m in METHODS.values())


def titles(adapters_only: bool = False, sep: str = " / ") -> str:
    """The methods' titles for a help text, e.g. "LoRA / LoKr / LoHa" (adapters_only: without the full finetune)."""
    return sep.join(m.title for m in METHODS.values() if not (adapters_only and m.trains_base))


def reading(names) -> AdapterMethod | None:
    """The adapter method whose file holds exactly these tensor names after one module's key (None: no method)."""
    found = [m for m in METHODS.values() if m.reads(names)]
    return found[0] if len(found) == 1 else None


def check_config(adapter: Any, rules: Rules) -> None:
    """The [adapter] rules of every method: each method's own value checks (a bad value is refused whatever the
    kind, like a bound), then what the chosen kind refuses: another method's exclusive key set to a non-default
    value, or a Qwen3 LoRA beside a method that does not allow one."""
    for m in METHODS.values():
        m.check(adapter, rules)
    if not rules.ok("kind") or adapter.kind not in METHODS:
        return
    chosen = METHODS[adapter.kind]
    for owner in METHODS.values():
        if owner is chosen:
            continue
        for key, why in owner.exclusive.items():
            value, default = getattr(adapter, key), rules.default(key)
            if rules.ok(key) and value != default:
                rules.error(f"[adapter] {key} = {rules.toml(value)} applies to kind = {rules.toml(owner.kind)}, "
                            f"but kind = {rules.toml(chosen.kind)}: {why}; {chosen.layout}; remove {key} or set it "
                            f"to {rules.toml(default)}", key)
    if rules.ok("train_text_encoder") and adapter.train_text_encoder and not chosen.text_encoder:
        allowed = " or ".join(f"kind = {rules.toml(m.kind)}" for m in METHODS.values()
                              if m.text_encoder and not m.trains_base)
        rules.error(f"[adapter] train_text_encoder = true is not supported with kind = {rules.toml(chosen.kind)} "
                    f"(the Qwen3 adapter is a LoRA); use {allowed} or set train_text_encoder = false")


def check_base(adapter: Any, base: BaseFacts, rules: Rules) -> None:
    """The chosen method's rules on what the run does to the base weights (base_matmul, quant, swap)."""
    if rules.ok("kind") and adapter.kind in METHODS:
        METHODS[adapter.kind].base_rule(adapter, base, rules)


class _Refusals:
    """A Rules that only collects: what a method's base_rule says of facts a run might choose (plan's swap search)."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def ok(self, *keys: str) -> bool:
        return True

    def error(self, message: str, key: str | None = None) -> None:
        self.messages.append(message)

    @staticmethod
    def toml(value: Any) -> str:
        return json.dumps(value)

    def default(self, key: str) -> Any:
        raise KeyError(key)


def base_refusals(adapter: Any, base: BaseFacts) -> list[str]:
    """What the [adapter] kind's method refuses of these base facts (empty: it trains on such a base)."""
    rules = _Refusals()
    METHODS[adapter.kind].base_rule(adapter, base, rules)
    return rules.messages


# The torch side of the package, under the names `anima_train.adapters` has always offered. Resolved on first access
# so that importing the registry (config, CLI --help, ComfyUI start-up) never imports torch.
_TORCH_NAMES = {name: "inject" for name in (
    "adapter_parameters", "build_param_groups", "component_of", "inject_adapters", "owner_component",
    "target_modules", "text_encoder_rank_alpha", "tuner_layers")}


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_TORCH_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
