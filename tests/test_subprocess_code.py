"""Every piece of Python a test hands to another process (`python -c CODE`, a script it writes, a helper script of
tests/) imports what it names. A child that dies of ImportError at once looks, from outside, like a child that did
its job and ended: test_parent_watch's death-signal test measured "gone after 0.0 s" for months with a child that
imported a module the restructuring had moved.

The check is static (nothing is run or imported here but the packages' own spec lookup): every string of a test
module that parses as Python and holds an import (an f-string with its fields filled by a placeholder) is such code;
each of its imports must name a module that exists, and each `from M import N` a submodule of M or a name M binds
at its top level."""

from __future__ import annotations

import ast
import importlib.util
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
OWN = ("anima_train", "anchor", "nodes", "tests")  # packages of this repository: checked file by file
# Modules that exist only inside ComfyUI's own process: a string that imports one of them runs in ComfyUI, with its
# venv's packages and its own `nodes` (nodes.py, not this pack), so only its imports of this repository are checked.
# A module named `no_such_...` is missing on purpose (a test of the error a missing module gives).
COMFYUI_ONLY = ("comfy", "comfy_api", "comfy_extras", "comfy_execution", "folder_paths", "server", "execution",
                "main", "latent_preview", "node_helpers", "comfyui_version")


def _source(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(value.value)
            else:
                parts.append("None")  # a field: a value the code uses (a pid, a path, another code string)
        return "".join(parts)
    return None


def code_strings(path: Path) -> list[tuple[int, ast.Module]]:
    """(line, parsed code) of every string in `path` that parses as Python and imports something. Strings nested in
    an f-string are found as the f-string's own parts as well as on their own."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        text = _source(node)
        if not text or "import" not in text:
            continue
        try:
            code = ast.parse(text)
        except SyntaxError:
            try:
                code = ast.parse(textwrap.dedent(text))
            except SyntaxError:
                continue
        if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(code)):
            found.append((node.lineno, code))
    return found


def _own_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):  # platform branches, optional imports
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names.update((a.asname or a.name).split(".")[0] for a in sub.names)
                elif isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    names.add(sub.name)
                elif isinstance(sub, ast.Assign):
                    names.update(n.id for t in sub.targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def missing(module: str, name: str | None = None) -> str | None:
    """Why `import module` / `from module import name` would fail, or None."""
    top = module.split(".")[0]
    if top in OWN:
        path = _own_file(module)
        if path is None:
            return f"no module {module} in this repository"
        if name is None or name == "*" or _own_file(f"{module}.{name}") is not None:
            return None
        return None if name in _top_level_names(path) else f"{module} has no {name}"
    if importlib.util.find_spec(top) is None:
        return f"no module {top} installed"
    return None


def problems(code: ast.Module) -> list[str]:
    imports = [n for n in ast.walk(code) if isinstance(n, (ast.Import, ast.ImportFrom)) and
               not (isinstance(n, ast.ImportFrom) and n.level)]
    in_comfyui = any((a.name if isinstance(n, ast.Import) else n.module or "").split(".")[0] in COMFYUI_ONLY
                     for n in imports for a in n.names)
    found = []
    for node in imports:
        if isinstance(node, ast.Import):
            pairs = [(a.name, None) for a in node.names]
        else:
            pairs = [(node.module, a.name) for a in node.names]
        for module, name in pairs:
            top = module.split(".")[0]
            if "no_such" in module or (in_comfyui and (top not in OWN or top == "nodes")):
                continue  # a deliberately missing module; ComfyUI's own and its venv's packages
            why = missing(module, name)
            if why:
                found.append(why)
    return found


def test_the_check_sees_a_moved_module():
    """The case that went unseen: `from anima_train import parent_watch` after the module moved to system/."""
    code = ast.parse("import os; from anima_train import parent_watch; parent_watch.start(os.getppid())")
    assert problems(code) == ["anima_train has no parent_watch"]
    assert problems(ast.parse("from anima_train.system import parent_watch")) == []
    assert problems(ast.parse("import anima_train.parent_watch")) == ["no module anima_train.parent_watch in this "
                                                                       "repository"]
    assert problems(ast.parse("import os, unknown_package_here")) == ["no module unknown_package_here installed"]
    assert problems(ast.parse("import comfy.sd\nfrom anima_train import parent_watch")) == [
        "anima_train has no parent_watch"]  # code that runs in ComfyUI: still checked for this repository


@pytest.mark.parametrize("path", sorted(p for p in TESTS.glob("*.py") if p.name != Path(__file__).name),
                         ids=lambda p: p.name)  # this file's own examples are broken on purpose
def test_code_a_test_runs_elsewhere_imports_what_it_names(path):
    bad = [f"{path.name}:{line}: {why}" for line, code in code_strings(path) for why in problems(code)]
    assert not bad, "\n".join(bad)


def test_helper_scripts_import_what_they_name():
    """tests/ files that run as scripts in a child process (ddp_worker.py, fault_child.py, ...): their own imports."""
    bad = []
    for path in sorted(TESTS.glob("*.py")):
        if path.name.startswith("test_") or path.name == "conftest.py":
            continue
        bad += [f"{path.name}: {why}" for why in problems(ast.parse(path.read_text(encoding="utf-8")))]
    assert not bad, "\n".join(bad)
