"""An in-test double of the part of ComfyUI's V3 API (`comfy_api.latest`) that `nodes/comfy.py` re-exports.

It records what a node declares and returns, which is all a unit test of node logic needs. Install it with
`install()` before importing `nodes.*`; integration tests use the real ComfyUI instead.
"""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Schema:
    node_id: str
    display_name: str = ""
    category: str = ""
    description: str = ""
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    hidden: list = field(default_factory=list)
    is_output_node: bool = False
    not_idempotent: bool = False


@dataclass
class Port:
    kind: str
    direction: str
    id: str | None = None
    options: dict = field(default_factory=dict)


class _Type:
    def __init__(self, kind: str):
        self.kind = kind

    def Input(self, id, **options):  # noqa: N802 (ComfyUI's spelling)
        return Port(self.kind, "in", id, options)

    def Output(self, id=None, **options):  # noqa: N802
        return Port(self.kind, "out", id, options)


class NodeOutput:
    def __init__(self, *values: Any, ui: Any = None):
        self.values = values
        self.ui = ui


class ComfyNode:
    @classmethod
    def define_schema(cls) -> Schema:
        raise NotImplementedError


class ComfyExtension:
    async def on_load(self) -> None:
        return None


def _make_io() -> types.SimpleNamespace:
    kinds = ["String", "Int", "Float", "Boolean", "Combo", "Model", "Clip", "Vae", "Latent", "Image", "Conditioning",
             "AnyType", "LoraModel"]
    ns = types.SimpleNamespace(**{k: _Type(k.upper()) for k in kinds})
    ns.Schema, ns.NodeOutput, ns.ComfyNode = Schema, NodeOutput, ComfyNode
    ns.Custom = _Type  # io.Custom("MY_TYPE") -> a type with Input/Output, like the real one
    ns.Hidden = types.SimpleNamespace(unique_id="UNIQUE_ID", prompt="PROMPT")
    return ns


def install(monkeypatch) -> types.ModuleType:
    """Make `nodes.comfy` importable without ComfyUI by faking `comfy_api.latest`."""
    latest = types.ModuleType("comfy_api.latest")
    latest.io = _make_io()
    latest.ComfyExtension = ComfyExtension
    pkg = types.ModuleType("comfy_api")
    pkg.latest = latest
    monkeypatch.setitem(sys.modules, "comfy_api", pkg)
    monkeypatch.setitem(sys.modules, "comfy_api.latest", latest)
    for name in [m for m in sys.modules if m == "nodes" or m.startswith("nodes.")]:
        monkeypatch.delitem(sys.modules, name)
    return latest


# -- comfy.model_sampling ----------------------------------------------------------------------------------------
# The class names and inheritance of ComfyUI's prediction types and schedules (comfy/model_sampling.py), which
# nodes/comfy.py tells apart with isinstance. ComfyUI builds a model's sampling object as
# `class ModelSampling(<schedule>, <prediction>)`; `model_sampling()` does the same. The timestep maps are
# stand-ins with the right ranges (flow: sigma * multiplier; discrete: an index in 0..999), not ComfyUI's curves.


class EPS:
    pass


class V_PREDICTION(EPS):  # noqa: N801 (ComfyUI's spelling)
    pass


class EDM(V_PREDICTION):
    pass


class X0(EPS):
    pass


class CONST:
    pass


class ModelSamplingDiscrete:
    def timestep(self, sigma):
        return (sigma * 68.0).clamp(0, 999).round()


class ModelSamplingDiscreteEDM(ModelSamplingDiscrete):
    def timestep(self, sigma):
        return 0.25 * sigma.log()


class ModelSamplingContinuousEDM:
    def timestep(self, sigma):
        return 0.25 * sigma.log()


class ModelSamplingDiscreteFlow:
    multiplier = 1000.0

    def timestep(self, sigma):
        return sigma * self.multiplier


def model_sampling(schedule, prediction, **attributes):
    """An object like ComfyUI's model_sampling: an instance of `class ModelSampling(schedule, prediction)`."""
    obj = type("ModelSampling", (schedule, prediction), {})()
    obj.__dict__.update(attributes)
    return obj


def anima_sampling():
    """Anima's: flow (CONST) on ModelSamplingDiscreteFlow with multiplier 1, so timestep(sigma) == sigma."""
    return model_sampling(ModelSamplingDiscreteFlow, CONST, multiplier=1.0, shift=3.0)


def install_model_sampling(monkeypatch) -> types.ModuleType:
    """Make `comfy.model_sampling` importable (only that module) with the classes above."""
    module = types.ModuleType("comfy.model_sampling")
    for cls in (EPS, V_PREDICTION, EDM, X0, CONST, ModelSamplingDiscrete, ModelSamplingDiscreteEDM,
                ModelSamplingContinuousEDM, ModelSamplingDiscreteFlow):
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, "comfy.model_sampling", module)
    return module


# -- ComfyUI's folders, for the path policy (nodes/paths.py) ------------------------------------------------------


def install_folders(monkeypatch, comfy, root, allowed=()) -> dict:
    """ComfyUI's folders under `root`, as `comfy.comfy_folders()` (and output_directory / models_directory) report
    them: input = root itself (so a test's dataset folder in tmp_path is inside it), output/, temp/, models/ and
    custom_nodes/. `allowed`: the folders the user lists (ANIMA_TRAIN_ALLOWED_DIRS). The pack's own settings file
    is replaced by root/anima_train_paths.txt (absent unless a test writes it), so a developer's file never changes
    a test."""
    from pathlib import Path

    import nodes.paths as paths

    root = Path(root)
    folders = {"output": [str(root / "output")], "input": [str(root)], "temp": [str(root / "temp")],
               "models": [str(root / "models")], "custom_nodes": [str(root / "custom_nodes")]}
    monkeypatch.setattr(comfy, "comfy_folders", lambda: folders)
    monkeypatch.setattr(comfy, "output_directory", lambda: folders["output"][0])
    monkeypatch.setattr(comfy, "models_directory", lambda: folders["models"][0])
    monkeypatch.setattr(paths, "settings_file", lambda: root / paths.SETTINGS_NAME)
    monkeypatch.setenv(paths.ALLOWED_DIRS_ENV, os.pathsep.join(str(a) for a in allowed))
    return folders
