"""The import rule (docs/architecture.md, "Imports"): imports at the top of the module, unless a measured start-up
cost, an optional or platform-only dependency, or an import cycle says otherwise; such a function-local import
carries a `# lazy: <why>` comment on its line or in the comment lines right above its block of imports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "# lazy:"


def source_files() -> list[Path]:
    return sorted([*ROOT.glob("anima_train/**/*.py"), *ROOT.glob("anchor/**/*.py"), *ROOT.glob("nodes/**/*.py"),
                   ROOT / "__init__.py"])


def function_local_imports(path: Path) -> list[ast.stmt]:
    found: dict[int, ast.stmt] = {}  # by id: a nested function's imports are walked from its parent too
    for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.update((id(n), n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return sorted(found.values(), key=lambda n: n.lineno)


def justified(lines: list[str], node: ast.stmt, import_lines: set[int]) -> bool:
    """A `# lazy:` comment on the import's own lines, or above it: walking up over the other imports of the same
    block and over comment lines, stopping at the first other line."""
    if any(MARKER in line for line in lines[node.lineno - 1:node.end_lineno]):
        return True
    number = node.lineno - 1  # 1-based number of the line above
    while number >= 1:
        text = lines[number - 1].strip()
        if MARKER in text:
            return True
        if not (text.startswith("#") or number in import_lines):
            return False
        number -= 1
    return False


def unjustified_imports() -> list[str]:
    out = []
    for path in source_files():
        lines = path.read_text(encoding="utf-8").splitlines()
        nodes = function_local_imports(path)
        import_lines = {i for n in nodes for i in range(n.lineno, n.end_lineno + 1)}
        out += [f"{path.relative_to(ROOT)}:{n.lineno}: {lines[n.lineno - 1].strip()}"
                for n in nodes if not justified(lines, n, import_lines)]
    return out


def test_every_function_local_import_says_why():
    bad = unjustified_imports()
    assert not bad, ("function-local imports without a `# lazy: <why>` comment (move them to the module top, or say "
                     "why they stay; docs/architecture.md, Imports):\n  " + "\n  ".join(bad))


def test_the_rule_itself(tmp_path):
    lines = ["def f():", "    # lazy: torch (4.6 s)", "    import torch", "    from PIL import Image", "",
             "    import json", "def g():", "    import os  # lazy: a reason"]
    nodes = function_local_imports(_write(tmp_path, lines))
    import_lines = {n.lineno for n in nodes}
    assert [justified(lines, n, import_lines) for n in nodes] == [True, True, False, True]


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "m.py"
    path.write_text("\n".join(lines) + "\n")
    return path
