"""The config reference: docs/config.md is generated from the config dataclasses and kept up to date."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from anima_train.config import TABLES, iter_fields
from anima_train.config.aliases import ALIASES
from anima_train.config.reference import reference_markdown

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "config.md"


def test_docs_config_md_is_up_to_date():
    assert DOC.read_text(encoding="utf-8") == reference_markdown(), (
        "docs/config.md is out of date: run `anima-train config --reference --out docs/config.md`")


def test_the_reference_lists_every_key_with_its_default_and_help():
    text = reference_markdown()
    for table in TABLES:
        section = text.split(f"## `[{table}]`")[-1] if f"## `[{table}]`" in text else text.split(f"## `[[{table}]]`")[1]
        section = section.split("\n## ")[0]
        for info in iter_fields(table):
            row = next((ln for ln in section.splitlines() if ln.startswith(f"| `{info.name}` |")), None)
            assert row is not None, f"[{table}] {info.name} missing"
            assert info.help.split(" ")[0].replace("<", "\\<") in row
    assert "`[optimizer] lr` |" in text and "| `learning_rate` |" in text
    assert all(f"| `{name}` |" in text for name in ALIASES)


def test_config_reference_command_prints_the_doc_and_the_readme_points_to_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "ANIMA_MODEL": "/somewhere/else"}  # the documented default must not depend on the environment
    out = subprocess.run([sys.executable, "-m", "anima_train", "config", "--reference"], capture_output=True,
                         text=True, encoding="utf-8", env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == DOC.read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/config.md" in readme  # tests/test_docs.py: no citation of notes outside the repository
