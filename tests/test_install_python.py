"""Which Python install.sh builds a venv from: the README's 3.13 recipe (`ANIMA_PYTHON=3.13`) works where pyenv
installed 3.13 but nothing put `python3.13` on PATH."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("ls", "sort", "dirname")  # what install.sh runs before it needs a Python


def _fake_pyenv(root: Path, *versions: str) -> None:
    for version in versions:
        binary = root / "versions" / version / "bin" / f"python{version.rsplit('.', 1)[0]}"
        binary.parent.mkdir(parents=True)
        binary.write_text(f"#!/bin/sh\necho {version.rsplit('.', 1)[0]}\n")  # answers install.sh's version probe
        binary.chmod(0o755)


def _which(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """`bash install.sh --which-python` on a PATH with no Python and no pyenv shims."""
    bare = tmp_path / "bin"
    if not bare.is_dir():
        bare.mkdir()
        for tool in TOOLS:
            (bare / tool).symlink_to(shutil.which(tool))
    return subprocess.run([shutil.which("bash"), str(ROOT / "install.sh"), "--which-python"], capture_output=True,
                          text=True, cwd=tmp_path, env={"HOME": str(tmp_path), "PATH": str(bare), **env}, timeout=60)


def test_a_version_finds_pyenvs_newest_of_it_without_pyenv_on_path(tmp_path):
    _fake_pyenv(tmp_path / ".pyenv", "3.13.0", "3.13.10", "3.12.4")
    out = _which(tmp_path, ANIMA_PYTHON="3.13")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / ".pyenv" / "versions" / "3.13.10" / "bin" / "python3.13")
    # PYENV_ROOT wins over ~/.pyenv; with no version asked, 3.11 before 3.12 before 3.13
    _fake_pyenv(tmp_path / "elsewhere", "3.11.9")
    out = _which(tmp_path, PYENV_ROOT=str(tmp_path / "elsewhere"))
    assert out.stdout.strip() == str(tmp_path / "elsewhere" / "versions" / "3.11.9" / "bin" / "python3.11")


def test_no_such_python_is_one_line_naming_where_it_looked(tmp_path):
    out = _which(tmp_path, ANIMA_PYTHON="3.13")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip() == "install.sh: no Python 3.13 found (PATH, or pyenv's versions/)"
