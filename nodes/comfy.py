"""The thin boundary to ComfyUI: every ComfyUI import of the pack goes through this module.

Unit tests replace this module in `sys.modules` with a double (tests/comfy_double.py) to exercise node logic
without a ComfyUI checkout. `comfy_api.latest` is ComfyUI's current V3 API.
"""

from comfy_api.latest import ComfyExtension, io  # noqa: F401  (re-exported)

CATEGORY = "Anima Trainer"
