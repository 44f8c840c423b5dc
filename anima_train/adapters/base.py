"""The interface every adapter method implements: `AdapterMethod` (facts and config rules, no torch) plus the
method's `model` module (peft injection and the exported tensors, torch). See the package docstring for the why.

No torch here: `anima_train.config` reads the kinds, their help and their rules from these objects at import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

ADAPTER_NAME = "default"  # the peft adapter name the trainer injects and the exporters read
MODEL_ROLES = ("transformer", "text_conditioner", "text_encoder")


class Rules(Protocol):
    """What a method's `check` may do with the [adapter] table being loaded (the config's problem collector, seen
    through [adapter] key names: "lokr_factor", not "adapter.lokr_factor")."""

    def ok(self, *keys: str) -> bool:
        """True if none of these keys already failed its own type/bounds check (then its value can be trusted)."""

    def error(self, message: str, key: str | None = None) -> None:
        """Refuse the config with `message` (which names the key and the fix); `key` is marked untrustworthy."""

    def toml(self, value: Any) -> str:
        """A value as TOML writes it, for messages ('"kohya"', 'true', '[1, 2]')."""

    def default(self, key: str) -> Any:
        """The default value of an [adapter] key."""


@dataclass(frozen=True)
class BaseFacts:
    """What a run does to the frozen base weights an adapter sits on: the facts a method's `base_rule` may refuse on
    (its `check` sees only [adapter]). Built by the config's rules from [train] and [quant]."""

    matmul: str = "bf16"  # [train] base_matmul: "fp8" replaces a block Linear's weight by FP8 copies and a meta one
    quant: str = "none"  # [quant] mode: "frozen" keeps the base as SDNQ-quantised weights
    swap_blocks: int = 0  # [train] swap_blocks as a count ("auto" asks base_rule with 1 and swaps none if refused)


class Runtime(Protocol):
    """The torch side of a method: `anima_train.adapters.<name>.model`. Every method provides `state_dict` and
    `save_checkpoint`; a method that injects an adapter (trains_base False) also provides `peft_config`."""

    def peft_config(self, adapter: Any, targets: list[str], rank: int, alpha: float) -> Any:
        """The peft config that puts this adapter on exactly `targets` (a fresh adapter must be an exact no-op)."""

    def state_dict(self, transformer: Any, text_conditioner: Any = None, *, fmt: str = "peft",
                   adapter_name: str = ADAPTER_NAME, dtype: Any = None) -> dict:
        """The tensors of the exported file, under the key names ComfyUI loads."""

    def save_checkpoint(self, path: Path, models: dict, cfg: Any, metadata: dict[str, str], dtype: Any) -> Path:
        """One checkpoint of a run at `path` (replacing a file of that name); returns what was written."""

    def delta(self, factors: dict, weight: Any) -> Any:
        """ΔW that ComfyUI's loader adds to `weight` at strength 1 for one module's tensors of this method's file
        (`factors`: the names after the module's key, as in AdapterMethod.factors). When the file does not fit the
        weight, a tensor of the file's own shape (the caller refuses a shape other than the weight's)."""


RUNTIME_FUNCTIONS = ("state_dict", "save_checkpoint")  # and peft_config and delta unless trains_base


def _no_rules(adapter: Any, rules: Rules) -> None:
    return None


def _no_base_rules(adapter: Any, base: BaseFacts, rules: Rules) -> None:
    return None


def lora_like_parameters(adapter: Any, in_features: int, out_features: int) -> int:
    """A LoRA's trainable parameters on one Linear: rank x (in + out)."""
    return adapter.rank * (in_features + out_features)


def _safetensors_name(stem: str, cfg: Any) -> str:
    return f"{stem}.safetensors"


@dataclass(frozen=True)
class AdapterMethod:
    """One value of `[adapter] kind`: what it means for the config, the models, the files and the nodes.

    A method lives in `anima_train/adapters/<name>/`: `__init__.py` defines `METHOD = AdapterMethod(...)` (this
    object; no torch), and `model.py` is its Runtime (torch, peft), loaded on first use by `runtime()`.
    """

    name: str  # the folder under anima_train/adapters/, and the `kind` of training_metadata ("full" for "none")
    kind: str  # the value of [adapter] kind
    title: str  # how the docs and messages name it: "LoRA"
    order: int  # its place in the choices (config docs, the Train node's menu); full finetune last
    summary: str  # what the kind's help says about it, e.g. "full finetune" (empty: just the kind)
    layout: str  # the file it writes, in words (used in messages): "LoKr files use ... lokr_* keys, ..."
    trains_base: bool = False  # True: nothing is injected, the models' own weights train (full finetune)
    dropout: str = ""  # what [adapter] dropout means for it ("" = not used)
    # Resume state: the [adapter] keys the trainable tensors' names and shapes depend on (besides kind, components,
    # train_llm_adapter, train_text_encoder and text_encoder_rank, which every method records).
    shape_keys: tuple[str, ...] = ()
    # [adapter] keys only this method reads, each with why another kind refuses a non-default value.
    exclusive: dict[str, str] = field(default_factory=dict)
    text_encoder: bool = True  # may the Qwen3 LoRA (train_text_encoder) train beside it
    check: Callable[[Any, Rules], None] = _no_rules  # its value rules, run on every config whatever the kind
    # its rules on the base model's facts, run when it is the chosen kind (e.g. DoRA needs the base weight)
    base_rule: Callable[[Any, BaseFacts, Rules], None] = _no_base_rules
    # trainable parameters on one adapted Linear (adapter, in_features, out_features): what `plan` counts
    parameters: Callable[[Any, int, int], int] = lora_like_parameters
    # the tensor names its file holds after a module's key ("lora_up.weight", "alpha", ...), and those of them that
    # only its file holds: `evaluate` reads a module's tensors as the method whose names include them all and who
    # needs none that are absent (LoRA and DoRA share lora_up/lora_down/alpha; dora_scale says DoRA)
    factors: tuple[str, ...] = ()
    required_factors: tuple[str, ...] = ()
    # safetensors metadata: sd-scripts' ss_network_module, the ModelSpec architecture suffix, default network args
    network_module: str | None = None
    architecture: str = ""
    network_args: dict[str, Any] = field(default_factory=dict)
    comfy_folder: str = "loras"  # the ComfyUI model folder whose stock loader reads its file
    output_name: Callable[[str, Any], str] = _safetensors_name  # (stem, cfg) -> checkpoint file/folder name

    def runtime(self) -> ModuleType:
        """The method's torch side, `anima_train.adapters.<name>.model` (imports torch and peft)."""
        module = importlib.import_module(f"{__package__}.{self.name}.model")
        wanted = RUNTIME_FUNCTIONS + (() if self.trains_base else ("peft_config", "delta"))
        missing = [f for f in wanted if not callable(getattr(module, f, None))]
        if missing:
            raise TypeError(f"{module.__name__} does not implement {', '.join(missing)} (adapters.base.Runtime)")
        return module

    def reads(self, names: Any) -> bool:
        """Are these the tensor names of one module in this method's file?"""
        names = set(names)
        return bool(self.factors) and names <= set(self.factors) and set(self.required_factors) <= names

    def describe(self, adapter: Any) -> dict[str, Any]:
        """What this method's trainable tensors depend on, as a resume state records it."""
        return {key: getattr(adapter, key) for key in self.shape_keys}
