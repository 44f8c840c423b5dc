"""The layers of `anima_train/` (docs/architecture.md, "Layers"): a module imports only from its own layer or the
layers below it, and no two modules import each other, directly or through others. Every import counts: at the top
of a module and inside a function (a function-local import is still a dependency, only a later one)."""

from __future__ import annotations

import ast
from pathlib import Path

import anima_train.adapters

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "anima_train"

# Bottom to top; the same order as docs/architecture.md's table (test_the_doc_names_these_layers checks it).
LAYERS = ("base", "system", "methods", "config", "model", "data", "adapters", "outputs", "training", "commands")
_BASE = {"anima_train", "anima_train.errors", "anima_train.fixes", "anima_train.files"}
_COMMANDS = {"anima_train.cli", "anima_train.__main__", "anima_train.standby", "anima_train.demo"}
# The torch side of the adapters package; the rest of it (the registry, base.py and each method's __init__.py: facts,
# no torch) is the "methods" layer below config, which reads the kinds, their help and their rules.
_ADAPTERS_RUNTIME = {"anima_train.adapters.inject", "anima_train.adapters.export"}


def layer_of(module: str) -> str | None:
    """The layer of an `anima_train` module; None for a module outside the package."""
    if module in _BASE:
        return "base"
    if module in _COMMANDS:
        return "commands"
    parts = module.split(".")
    if parts[0] != "anima_train" or len(parts) < 2:
        return None
    if parts[1] == "adapters":
        runtime = module in _ADAPTERS_RUNTIME or (len(parts) >= 4 and parts[3] == "model")
        return "adapters" if runtime else "methods"
    if parts[1] in LAYERS:
        return parts[1]
    raise AssertionError(f"{module}: no layer; give it one in tests/test_layers.py and docs/architecture.md")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(module: str, path: Path, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The `anima_train` modules one import statement reaches: `from a.b import c` is module a.b.c when that is a
    module, else a name of a.b. A name the adapters package resolves on first access (its torch side) counts as the
    module that defines it."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "anima_train"]
    if node.level:
        base = module.split(".")
        if path.name != "__init__.py":
            base = base[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != "anima_train":
        return []
    out = []
    for alias in node.names:
        full = f"{source}.{alias.name}"
        if full in known:
            out.append(full)
        elif source == "anima_train.adapters" and alias.name in anima_train.adapters._TORCH_NAMES:
            out.append(f"anima_train.adapters.{anima_train.adapters._TORCH_NAMES[alias.name]}")
        else:
            out.append(source)
    return out


def import_edges() -> list[tuple[str, int, str]]:
    """(importing module, line, imported module) for every import of an anima_train module inside the package."""
    found = modules()
    known = set(found)
    edges = []
    for module, path in found.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges += [(module, node.lineno, target) for target in dict.fromkeys(imported(module, path, node, known))
                          if target != module]
    return edges


def upward_imports(edges) -> list[str]:
    bad = []
    for module, line, target in edges:
        low, high = layer_of(target), layer_of(module)
        if low is not None and LAYERS.index(low) > LAYERS.index(high):
            path = modules().get(module)
            where = path.relative_to(ROOT) if path else module
            bad.append(f"{where}:{line}: imports {target}: layer {high!r} may not import layer {low!r} "
                       f"(above it)")
    return bad


def cycles(edges) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for module, _, target in edges:
        graph.setdefault(module, set()).add(target)
        graph.setdefault(target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_a_layer_above_its_own():
    bad = upward_imports(import_edges())
    assert not bad, ("imports against the layers (docs/architecture.md, Layers: move the helper down, or the "
                     "command up):\n  " + "\n  ".join(bad))


def test_no_module_cycle():
    found = cycles(import_edges())
    assert not found, "modules that import each other (directly or through others):\n  " + "\n  ".join(
        " <-> ".join(group) for group in found)


def test_every_module_has_a_layer():
    assert all(layer_of(m) in LAYERS for m in modules())


def test_the_doc_names_these_layers():
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].strip().strip("`") for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| layer") and not line.startswith("|---")]
    assert tuple(rows) == LAYERS


def test_the_checks_themselves():
    edges = [("anima_train.config.rules", 3, "anima_train.data.captions"),
             ("anima_train.training.train", 4, "anima_train.data.dataset"),
             ("anima_train.model.quant", 5, "anima_train.adapters.inject"),
             ("anima_train.config.schema", 6, "anima_train.adapters"),
             ("anima_train.outputs.progress", 7, "anima_train.errors")]
    bad = upward_imports(edges)
    assert len(bad) == 2 and "config/rules.py:3" in bad[0] and "'config' may not import layer 'data'" in bad[0]
    assert "model/quant.py:5" in bad[1] and "layer 'adapters'" in bad[1]
    assert cycles([("a", 1, "b"), ("b", 1, "c"), ("c", 1, "a"), ("c", 2, "d")]) == [["a", "b", "c"]]
    assert cycles([("a", 1, "b")]) == []


def test_no_module_is_over_600_lines():
    """Issue #44: no module of the trainer, the anchor format or the pack over 600 lines (a module that grows past it
    splits along a seam, as config/normalise.py left config/rules.py)."""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for folder in ("anima_train", "anchor", "nodes") for p in sorted((ROOT / folder).rglob("*.py"))}
    assert {name: n for name, n in sizes.items() if n > 600} == {}
