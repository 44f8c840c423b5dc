"""The suite's marker gating skips by marker, not by the names of the folders a checkout happens to live in."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SAMPLE = '''
import pytest


def test_plain():
    pass


@pytest.mark.comfyui
def test_needs_comfyui():
    pass
'''


def test_checkout_in_folders_named_gpu_and_comfyui_still_runs_its_tests(tmp_path):
    # Before the fix, conftest asked `"gpu" in item.keywords`; keywords include every parent folder's name, so in
    # .../gpu/comfyui/tests every test was skipped as "needs a CUDA device" or "needs ComfyUI".
    checkout = tmp_path / "gpu" / "comfyui"
    tests = checkout / "tests"
    tests.mkdir(parents=True)
    shutil.copy(TESTS / "conftest.py", tests / "conftest.py")
    (tests / "test_sample.py").write_text(SAMPLE)
    (checkout / "pytest.ini").write_text("[pytest]\nmarkers =\n    comfyui: x\n    gpu: x\n    slow: x\n")
    env = {k: v for k, v in os.environ.items() if k not in ("COMFYUI_PATH", "PYTEST_ADDOPTS")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests"],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 passed, 1 skipped" in out, out
    assert "needs ComfyUI" in out, out
