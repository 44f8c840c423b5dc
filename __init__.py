"""ComfyUI entry point of the Anima trainer pack.

ComfyUI imports this file as the package `<folder name>` from `custom_nodes/`. Importing it must stay cheap and must
not fail when optional extras are missing: nothing heavy is imported here. ComfyUI calls `comfy_entrypoint()` (node
API V3) afterwards; only then are the node modules, and through them ComfyUI's `comfy_api`, imported.
"""

import os
import sys

WEB_DIRECTORY = "./js"

_PACK_DIR = os.path.dirname(os.path.abspath(__file__))
# The node modules import our libraries as top-level `anima_train` / `anchor` (the same names the CLI and the
# training worker use). ComfyUI does not put a pack's folder on sys.path, so do it here — appended, never
# prepended, so that nothing in this folder (e.g. `nodes/`) can shadow ComfyUI's own modules.
if _PACK_DIR not in sys.path:
    sys.path.append(_PACK_DIR)


async def comfy_entrypoint():
    # lazy: the pack root stays torch-free and fast (tests/test_package.py): the nodes import torch and ComfyUI
    from .nodes import AnimaTrainExtension
    from .nodes.templates import name_template_category

    # the Templates browser lists example_workflows/ under the pack's name, not the folder's (nodes/templates.py)
    name_template_category(_PACK_DIR)
    return AnimaTrainExtension()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
