"""Every node's identity as saved workflows and the templates hold it: node id, widget and socket names, their kinds
and order, the outputs. A saved workflow keeps widget values by position and links by socket, so any change here
breaks the workflows users have; this file says it in one place (a deliberate change updates the record:
`python tests/test_node_schemas.py --write`)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

RECORD = Path(__file__).parent / "data" / "node_schemas.json"


def identities() -> dict:
    import nodes

    out = {}
    for name in nodes.NODE_MODULES:
        for cls in importlib.import_module(f"nodes.{name}").NODES:
            s = cls.define_schema()
            out[s.node_id] = {
                "module": name, "display_name": s.display_name, "category": s.category,
                "output_node": bool(s.is_output_node), "hidden": [str(h) for h in s.hidden],
                "inputs": [[p.id, p.kind, bool(p.options.get("optional"))] for p in s.inputs],
                "outputs": [[p.kind, p.options.get("display_name")] for p in s.outputs],
            }
    return out


def test_no_node_id_widget_or_socket_changed(monkeypatch):
    from tests import comfy_double

    comfy_double.install(monkeypatch)
    assert identities() == json.loads(RECORD.read_text())


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import pytest

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests import comfy_double

    comfy_double.install(pytest.MonkeyPatch())
    RECORD.write_text(json.dumps(identities(), indent=1) + "\n")
