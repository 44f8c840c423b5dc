"""An in-test double of the part of ComfyUI's V3 API (`comfy_api.latest`) that `nodes/comfy.py` re-exports.

It records what a node declares and returns, which is all a unit test of node logic needs. Install it with
`install()` before importing `nodes.*`; integration tests use the real ComfyUI instead.
"""

from __future__ import annotations

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
