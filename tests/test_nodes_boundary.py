"""Only nodes/comfy.py imports ComfyUI: every other module of the pack reaches ComfyUI's API and its modules
(folder_paths, comfy.*, server) through it, so the tests' double (tests/comfy_double.py) stands in for all of
ComfyUI at one place, and the pack's import order never matters."""

from __future__ import annotations

import ast
from pathlib import Path

NODES = Path(__file__).resolve().parents[1] / "nodes"
COMFYUI_MODULES = {"comfy", "comfy_api", "comfy_extras", "comfy_execution", "folder_paths", "server", "execution",
                   "latent_preview", "node_helpers"}


def _comfyui_names(tree: ast.AST) -> list[str]:
    """ComfyUI modules a module imports: import statements (not relative ones) and literal module names handed to
    a function that imports by name (importlib.import_module, __import__, a helper named like them)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in COMFYUI_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [node.module] if node.module.split(".")[0] in COMFYUI_MODULES else []
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if "import" in func or "module" in func:
                found += [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                          and a.value.split(".")[0] in COMFYUI_MODULES]
    return found


def test_only_comfy_py_imports_comfyui():
    offenders = {p.name: names for p in sorted(NODES.glob("*.py")) if p.name != "comfy.py"
                 if (names := _comfyui_names(ast.parse(p.read_text(encoding="utf-8"))))}
    assert not offenders, f"import ComfyUI through nodes/comfy.py: {offenders}"
