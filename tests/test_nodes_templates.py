"""nodes/templates.py: the Templates browser's category for the example workflows is named for the pack, whatever
folder the pack was installed as (the browser test, tests/test_browser_templates.py, reads it back from the UI)."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

from nodes import templates

ROOT = Path(__file__).resolve().parents[1]


def test_the_label_is_the_packs_display_name():
    comfy = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["comfy"]
    assert templates.DISPLAY_NAME == comfy["DisplayName"]


def test_the_key_is_the_folder_name_as_the_frontend_spells_it(tmp_path):
    pack = tmp_path / "My.Clone-of the trainer"
    pack.mkdir()
    paths = templates.name_template_category(pack)
    # every UI language of the frontend (it looks a key up in the UI's language only)
    assert sorted(paths) == sorted(pack / "locales" / lang / "main.json" for lang in templates.LOCALES)
    assert {p.parent.name for p in (pack / "locales").glob("*/main.json")} >= {"en", "zh", "ja", "pt-BR"}
    # the frontend looks up templateWorkflows.category.<folder name with "." -> "_">
    for path in paths:
        assert json.loads(path.read_text()) == {
            "templateWorkflows": {"category": {"My_Clone-of the trainer": "Anima Trainer"}}}


def test_other_messages_and_other_folders_are_kept(tmp_path):
    pack = tmp_path / "anima"
    (pack / "locales" / "en").mkdir(parents=True)
    main = pack / "locales" / "en" / "main.json"
    main.write_text(json.dumps({"nodeDefs": {"X": {"display_name": "x"}},
                                "templateWorkflows": {"category": {"old-name": "Anima Trainer"}}}))
    templates.name_template_category(pack)
    assert json.loads(main.read_text()) == {
        "nodeDefs": {"X": {"display_name": "x"}},
        "templateWorkflows": {"category": {"old-name": "Anima Trainer", "anima": "Anima Trainer"}}}
    before = main.stat().st_mtime_ns
    templates.name_template_category(pack)  # nothing to change: not rewritten
    assert main.stat().st_mtime_ns == before


def test_a_broken_file_is_replaced(tmp_path):
    pack = tmp_path / "anima"
    (pack / "locales" / "en").mkdir(parents=True)
    (pack / "locales" / "en" / "main.json").write_text("{not json")
    templates.name_template_category(pack)
    main = pack / "locales" / "en" / "main.json"
    assert json.loads(main.read_text())["templateWorkflows"]["category"] == {"anima": "Anima Trainer"}


def test_a_read_only_install_keeps_loading(tmp_path, caplog, monkeypatch):
    pack = tmp_path / "anima"
    pack.mkdir()

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)  # as a read-only folder answers (a root test run can write anywhere)
    assert templates.name_template_category(pack) is None
    assert "folder name 'anima'" in caplog.text
    assert not (pack / "locales").exists()


def test_no_template_is_called_index():
    # frontend PRs propose example_workflows/index.json for titles and descriptions; ComfyUI 0.29 would list such a
    # file as one more template ("index"), so none may be shipped until a ComfyUI reads it
    assert not (ROOT / "example_workflows" / "index.json").exists()
