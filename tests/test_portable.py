"""ComfyUI's Windows portable, simulated on Linux under Python 3.13 (the portable's Python).

The layout is the portable's: `python_embeded/` holds the interpreter beside a `._pth` file that lists the standard
library, `../ComfyUI` and `import site` (as ComfyUI's release workflow writes it), and its own site-packages with
every dependency but not the pack (ComfyUI-Manager installs requirements.txt, never the pack itself). A `._pth` file
makes CPython ignore PYTHONPATH and the current folder on Linux as on Windows, and `import site` adds the user's
site-packages *before* the portable's own, as on Windows (%APPDATA%\\Python\\Python313): here PYTHONUSERBASE points
at one holding a `safetensors` that fails on import, the way a stale user-site package breaks a portable.

Through nodes/worker.py's command builder (what the nodes run), the worker bootstrap, `anima-train check` and a tiny
training run in that interpreter. What differs from Windows: CPython on Linux reads the `._pth` named after the
executable (`python._pth`; on Windows `python313._pth` beside python313.dll), and the interpreter is a symlink to this
one. Runs only under Python 3.13: `.ci/run` runs the suite a second time in venv313/ for it.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from anima_train.data.synthetic import make_synthetic_latents
from nodes import worker
from tests.fixtures_tiny import small_run_toml

pytestmark = pytest.mark.skipif(sys.version_info[:2] != (3, 13),
                                reason="the simulated portable runs under Python 3.13 (.ci/run's venv313 suite)")

SHADOW = "the user-site safetensors shadowed the portable's own"


def _is_the_pack(name: str) -> bool:
    """site-packages entries of this project's own (editable) install: the portable never has them."""
    return name.startswith(("__editable__", "comfyui_anima_train"))


@pytest.fixture
def portable(tmp_path):
    root = tmp_path / "ComfyUI_windows_portable"
    embedded = root / "python_embeded"
    packages = embedded / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    packages.mkdir(parents=True)
    (root / "ComfyUI" / "custom_nodes").mkdir(parents=True)
    (root / "ComfyUI" / "custom_nodes" / "anima-trainer").symlink_to(worker.pack_dir())
    exe = embedded / "python"
    exe.symlink_to(os.path.realpath(sys.executable))
    stdlib = sysconfig.get_paths()["stdlib"]
    zipped = [p for p in sys.path if p.endswith(".zip")]
    (embedded / "python._pth").write_text("\n".join([*zipped, stdlib, os.path.join(stdlib, "lib-dynload"),
                                                     "../ComfyUI", "import site"]) + "\n")
    # the portable's site-packages: this environment's, less the pack (site finds it beside the interpreter)
    for source in site.getsitepackages():
        for entry in Path(source).iterdir() if os.path.isdir(source) else ():
            target = packages / entry.name
            if not _is_the_pack(entry.name) and not target.exists():
                target.symlink_to(entry)
    user_base = tmp_path / "user-base"  # %APPDATA%\Python on Windows
    shadow = user_base / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages" / "safetensors"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(f"raise ImportError({SHADOW!r})\n")
    env = {**os.environ, "PYTHONUSERBASE": str(user_base),
           "SDNQ_USE_TORCH_COMPILE": "0"}  # sdnq's import-time compile test: ~20 s, not what is tested here
    env.pop("PYTHONPATH", None)
    return exe, env


def test_check_and_a_tiny_training_run_in_the_portable_through_the_node_command(portable, tiny_anima, tmp_path,
                                                                                   monkeypatch):
    from tests import comfy_double

    comfy_double.install(monkeypatch)
    import nodes.nodes_train as nodes_train

    exe, env = portable
    # the premises: a user-site package shadows the portable's own without -s; the pack is not installed there
    plain = subprocess.run([str(exe), "-c", "import safetensors"], env=env, capture_output=True, text=True,
                           timeout=120, cwd=tmp_path)
    assert plain.returncode != 0 and SHADOW in plain.stderr
    isolated = subprocess.run([str(exe), "-s", "-c", "import sys, safetensors, torch; print(sys.version_info[:2]);"
                               "print(safetensors.__file__); import anima_train"], env=env, capture_output=True,
                              text=True, timeout=300, cwd=worker.pack_dir())
    assert "(3, 13)" in isolated.stdout and str(exe.parent) in isolated.stdout, isolated.stderr[-2000:]
    assert isolated.returncode != 0 and "No module named 'anima_train'" in isolated.stderr
    assert worker.ignores_environment(exe)
    env = worker.worker_env(base=env)

    # the Check node's view, as a worker: Python 3.13 supported, every dependency the portable's own
    check_cmd = worker.anima_train_command(["check"], python=str(exe))
    res = worker.run_job(check_cmd, log_path=tmp_path / "check.log", env=env, cwd=tmp_path)
    out = "\n".join(res.lines)
    assert res.returncode == 0, worker.failure_message(res, "check") + "\n" + out
    assert "ok   python" in out and " 3.13." in out and "anima-train check: all required pieces work" in out
    assert "ok   safetensors" in out and SHADOW not in out
    assert check_cmd[:5] == [str(exe), "-u", "-X", "utf8", "-s"]

    # a tiny run, started exactly as the Train node starts it
    data = tmp_path / "data"
    make_synthetic_latents(data, n=4)
    run_dir = tmp_path / "out" / "portable"
    run_dir.mkdir(parents=True)
    job = run_dir / "job.toml"
    job.write_text(small_run_toml(tiny_anima.diffusers_dir, data, tmp_path / "out",
                                  train='run_name = "portable"\nmax_steps = 2\nbatch_size = 2'))
    stop = worker.job_stop_file(run_dir)
    with monkeypatch.context() as m:
        m.setattr(sys, "executable", str(exe))  # ComfyUI's interpreter is the embedded one
        cmd = nodes_train.train_command(job, stop, 1)
    assert cmd[0] == str(exe) and "-s" in cmd[:cmd.index("-c")]
    res = worker.run_job(cmd, log_path=run_dir / worker.LOG_NAME, env=env, cwd=run_dir, stop_file=stop)
    assert res.returncode == 0, worker.failure_message(res, "training")
    done = res.last("done")
    assert done["step"] == 2 and Path(done["final"]).is_file()
    assert [e["step"] for e in res.events if e["event"] == "step"] == [1, 2]

    # the next run, in the worker the Train node starts ahead (anima_train/standby.py) through the same bootstrap
    run_dir2 = tmp_path / "out" / "portable2"
    run_dir2.mkdir(parents=True)
    job2 = run_dir2 / "job.toml"
    job2.write_text(job.read_text().replace('run_name = "portable"', 'run_name = "portable2"'))
    stop2 = worker.job_stop_file(run_dir2)
    try:
        with monkeypatch.context() as m:
            m.setattr(sys, "executable", str(exe))
            worker.start_standby(env)
            waiting = worker._standby["proc"]
            assert waiting.args[:6] == [str(exe), "-P", "-u", "-X", "utf8", "-s"]
            assert "anima_train.standby" in waiting.args[7]
            res = worker.run_job(nodes_train.train_command(job2, stop2, 1), log_path=run_dir2 / worker.LOG_NAME,
                                 env=env, cwd=run_dir2, stop_file=stop2, standby=True)
        assert res.pid == waiting.pid, "the run did not use the waiting worker"
        assert res.returncode == 0, worker.failure_message(res, "training")
        assert res.last("done")["step"] == 2 and Path(res.last("done")["final"]).is_file()
    finally:
        worker.stop_standby()
