"""The pack's skeleton: ComfyUI entry point, CLI dispatch, `check`, packaging metadata, install script."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# An import of ComfyUI's own modules (`from .comfy import` — our boundary module — does not match).
COMFY_IMPORT = re.compile(r"^\s*(from|import)\s+(comfy_api|comfy_extras|comfy|folder_paths|server|execution)\b",
                          re.MULTILINE)


def _run_py(code: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, **kw)


def test_root_package_imports_fast_without_torch():
    # ComfyUI imports custom_nodes/<folder>/__init__.py as the module <folder>. Import it the same way, in a clean
    # interpreter, and make sure nothing heavy came along.
    code = f"""
import importlib, json, sys, time
sys.path.insert(0, {str(ROOT.parent)!r})
t = time.perf_counter()
m = importlib.import_module({ROOT.name!r})
dt = time.perf_counter() - t
heavy = sorted(n for n in ("torch", "diffusers", "transformers", "peft", "accelerate", "sdnq", "numpy", "PIL")
               if n in sys.modules)
print(json.dumps({{"seconds": dt, "heavy": heavy, "web": m.WEB_DIRECTORY,
                   "entry": callable(m.comfy_entrypoint), "v1": hasattr(m, "NODE_CLASS_MAPPINGS")}}))
"""
    out = _run_py(code)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["heavy"] == [], f"importing the pack pulled in {info['heavy']}"
    assert info["seconds"] < 1.0, f"pack import took {info['seconds']:.2f} s"
    assert info["web"] == "./js" and (ROOT / "js").is_dir() and list((ROOT / "js").glob("*.js"))
    # V1 mappings would win over comfy_entrypoint in ComfyUI's loader and hide every V3 node.
    assert info["entry"] and not info["v1"]


def test_entrypoint_registers_nodes_through_the_boundary(monkeypatch):
    from tests import comfy_double

    comfy_double.install(monkeypatch)
    import importlib

    monkeypatch.syspath_prepend(str(ROOT.parent))
    pack = importlib.import_module(ROOT.name)
    extension = asyncio.run(pack.comfy_entrypoint())
    nodes = asyncio.run(extension.get_node_list())
    ids = [n.define_schema().node_id for n in nodes]
    assert "AnimaTrainEnvironmentCheck" in ids
    assert len(ids) == len(set(ids)), "duplicate node ids"


def test_check_node_reports_environment(monkeypatch):
    from tests import comfy_double

    comfy_double.install(monkeypatch)
    from nodes.nodes_check import AnimaEnvironmentCheck

    schema = AnimaEnvironmentCheck.define_schema()
    assert schema.is_output_node and schema.outputs[0].kind == "STRING"
    out = AnimaEnvironmentCheck.execute()
    text = out.values[0]
    assert "torch" in text and "diffusers" in text and out.ui == {"text": [text]}
    assert "all required pieces work" in text


def test_only_nodes_comfy_imports_comfyui():
    # The boundary: every other file of the pack must be importable without ComfyUI.
    offenders = []
    for path in [*ROOT.glob("nodes/*.py"), *ROOT.glob("anima_train/**/*.py"), *ROOT.glob("anchor/**/*.py")]:
        if path.name == "comfy.py" and path.parent.name == "nodes":
            continue
        if COMFY_IMPORT.search(path.read_text()):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


# -- CLI ------------------------------------------------------------------------------------------------------


def test_cli_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "anima_train", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0
    for cmd in ("convert", "cache", "audit", "train", "demo", "check", "anchor-info", "anchor-convert"):
        assert f"  {cmd}" in out.stdout


def test_cli_unknown_command_is_an_error(capsys):
    from anima_train.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["trian"])
    assert exc.value.code == 2
    assert "invalid choice: 'trian'" in capsys.readouterr().err


def test_cli_missing_command_module_says_not_yet(monkeypatch, capsys):
    from anima_train import cli

    monkeypatch.setitem(cli.COMMANDS, "future", cli.Command("anima_train._no_such_module", "later"))
    assert cli.main(["future"]) == 2
    err = capsys.readouterr().err
    assert "`anima-train future` is not implemented yet" in err


def test_cli_missing_dependency_is_not_disguised_as_not_yet(monkeypatch, tmp_path, capsys):
    # A command module that exists but needs an absent package must fail loudly (an internal error naming the
    # module, exit 1; --debug raises it), not say "not yet".
    (tmp_path / "fake_cmd_mod.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from anima_train import cli

    monkeypatch.setitem(cli.COMMANDS, "fake", cli.Command("fake_cmd_mod", "x"))
    assert cli.main(["fake"]) == 1
    err = capsys.readouterr().err
    assert "no_such_dependency_xyz" in err and "internal error" in err and "not yet" not in err, err
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        cli.main(["--debug", "fake"])


def test_check_passes_here_and_fails_on_a_broken_required_module(monkeypatch, capsys):
    from anima_train.system import check

    assert check.run(type("A", (), {"quiet": False})()) == 0
    assert "all required pieces work" in capsys.readouterr().out
    monkeypatch.setattr(check, "REQUIRED", check.REQUIRED + [("no_such_module_abc", "no-such-dist", "test")])
    report = check.run_checks()
    assert not report.ok
    bad = [i for i in report.items if not i.ok and i.required]
    assert [i.name for i in bad] == ["no-such-dist"] and "ModuleNotFoundError" in bad[0].detail
    assert check.run(type("A", (), {"quiet": True})()) == 1


# -- packaging ------------------------------------------------------------------------------------------------


def test_pyproject_and_requirements():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["anima-train"] == "anima_train.cli:main"
    assert "dev" in meta["project"]["optional-dependencies"]
    comfy = meta["tool"]["comfy"]
    assert {"PublisherId", "DisplayName", "Icon"} <= set(comfy)
    # `nodes` must never be installed as a top-level package (it would shadow ComfyUI's nodes.py).
    assert "nodes" not in meta["tool"]["setuptools"]["packages"]
    reqs = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    reqs = [r for r in reqs if r]
    assert "sdnq==0.2.8" in reqs and "diffusers>=0.42.1" in reqs
    assert not [r for r in reqs if r.startswith(("torch", "torchvision"))], "ComfyUI owns torch: do not pin it"
    for name in ("peft", "accelerate", "transformers", "safetensors", "pillow", "numpy", "scipy", "tomlkit", "tqdm"):
        assert any(r.lower().startswith(name) for r in reqs), name
    # pyproject and requirements agree (one is what pip installs for us, the other what ComfyUI-Manager installs).
    assert sorted(meta["project"]["dependencies"]) == sorted(reqs)
    assert "GNU GENERAL PUBLIC LICENSE" in (ROOT / "LICENSE").read_text()[:200]
    assert meta["project"]["license"] == "GPL-3.0-or-later"


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = "bash install.sh && venv/bin/python -m pytest"
    assert command in readme and command in ci
    assert "bash install.sh && venv/bin/anima-train demo" in readme


@pytest.mark.slow
def test_install_script_second_run_changes_nothing():
    venv_python = ROOT / "venv" / "bin" / "python"
    if not venv_python.exists() or Path(sys.executable).resolve().parent != venv_python.resolve().parent:
        pytest.skip("runs only from the project's own venv (bash install.sh && venv/bin/python -m pytest)")
    stamp = ROOT / "venv" / ".anima-train-install"
    before = (stamp.stat().st_mtime_ns, _pip_freeze(venv_python))
    out = subprocess.run(["bash", str(ROOT / "install.sh")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PIP_NO_INDEX": "1"})  # would fail if it tried to install anything
    assert out.returncode == 0, out.stdout + out.stderr
    assert "dependencies up to date" in out.stdout and "torch already works" in out.stdout
    assert (stamp.stat().st_mtime_ns, _pip_freeze(venv_python)) == before


def test_the_install_takes_every_library_sub_package_and_never_nodes():
    # a wheel holds what setuptools finds: the sub-packages too (anima_train.adapters.<method>), never `nodes`
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    found = set(find_packages(str(ROOT), include=find["include"], exclude=find.get("exclude", ())))
    assert {"anima_train", "anima_train.adapters", "anima_train.adapters.lora", "anima_train.adapters.full",
            "anchor"} <= found
    assert {p.split(".")[0] for p in found} == {"anima_train", "anchor"}


def _pip_freeze(python: Path) -> str:
    return subprocess.run([str(python), "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout


def test_atomic_writes_get_normal_file_modes(tmp_path):
    # safetensors and mkstemp create 0600 files; outputs must be readable like any file the user writes
    import torch

    from anima_train.files import write_text
    from anima_train.adapters.export import write_safetensors

    old = os.umask(0o022)
    try:
        a = write_text(tmp_path / "a.toml", "x = 1\r\n")
        b = write_safetensors(tmp_path / "b.safetensors", {"w": torch.zeros(2)})
    finally:
        os.umask(old)
    assert a.read_bytes() == b"x = 1\r\n"
    assert (a.stat().st_mode & 0o777) == 0o644 and (b.stat().st_mode & 0o777) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.toml", "b.safetensors"]  # no temp files left
