"""The ComfyUI node pack (V3 node API).

One module per node family (`nodes_*.py`), each a thin wrapper over library code in `anima_train` / `anchor`. The
only place ComfyUI's API is imported is `nodes/comfy.py`, so everything else stays unit-testable without ComfyUI.
"""

from __future__ import annotations

import importlib

# Node families, in the order they appear in ComfyUI's menu. Each module exports NODES: list[type[io.ComfyNode]].
NODE_MODULES = ["nodes_check", "nodes_dataset", "nodes_train", "nodes_anchor"]


def node_classes() -> list:
    classes = []
    for name in NODE_MODULES:
        classes.extend(importlib.import_module(f"{__name__}.{name}").NODES)
    return classes


def __getattr__(name: str):
    # Lazy: `AnimaTrainExtension` needs comfy_api, which exists only inside ComfyUI.
    if name == "AnimaTrainExtension":
        # lazy: comfy_api exists only inside ComfyUI; `import nodes` works without it
        from .comfy import ComfyExtension

        class AnimaTrainExtension(ComfyExtension):
            async def on_load(self):
                from . import comfy, nodes_train  # lazy: the node modules import torch; `import nodes` stays light

                # js/anima_train.js asks for it when a Train node appears on the canvas (nodes_train.py says why)
                comfy.add_post_route(nodes_train.WORKER_AHEAD_ROUTE, nodes_train.start_worker_ahead)

            async def get_node_list(self):
                return node_classes()

        return AnimaTrainExtension
    raise AttributeError(name)
