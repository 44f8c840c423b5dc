"""Compile is decided by running it: a probe compiles a tiny function on the run's device before the model loads.

What runs for real here: Inductor's C++ build on the CPU, made to fail like an embedded Python without Python.h (a
compiler wrapper that reports the missing header). What is simulated: a CUDA device and a broken Triton (the probes
are stand-ins that fail the way triton-windows does on a stock ComfyUI portable).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from anima_train import errors
from anima_train.system import check
from anima_train.training import compiling
from anima_train.config import parse_config
from anima_train.data.synthetic import make_synthetic_latents
from anima_train.training.train import train
from tests.fixtures_tiny import forget_inductor_cpu_checks, small_run_toml

NO_HEADER_CXX = ('#!/bin/sh\n# a C++ compiler that cannot find Python.h (an embedded Python without include/)\n'
                 'case "$*" in *--version*|*-dumpversion*) exec g++ "$@";; esac\n'
                 'echo "fatal error: Python.h: No such file or directory" >&2\necho "compilation terminated." >&2\n'
                 'exit 1\n')


@pytest.fixture
def no_header_cxx(tmp_path):
    cxx = tmp_path / "bin" / "g++"
    cxx.parent.mkdir()
    cxx.write_text(NO_HEADER_CXX)
    cxx.chmod(0o755)
    yield cxx
    forget_inductor_cpu_checks()  # what Inductor concluded from the failing compiler must not outlive the test


@pytest.fixture
def latents(tmp_path):
    make_synthetic_latents(tmp_path / "data", n=8)
    return tmp_path / "data"


def _toml(tiny_anima, latents, out, compile_setting: str, extra: str = "") -> str:
    return small_run_toml(tiny_anima.diffusers_dir, latents, out,
                          train=f'run_name = "c"\nmax_steps = 4\nbatch_size = 2\ncompile = "{compile_setting}"\n'
                                f'seed = 3\n{extra}')


def test_an_asked_compile_that_cannot_build_is_refused_before_the_model_loads(tiny_anima, latents, tmp_path,
                                                                              no_header_cxx):
    """Before: the run loaded the model and crashed at its first compiled step (an internal error, exit 1)."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(_toml(tiny_anima, latents, tmp_path / "out", "default"))
    env = {**os.environ, "CXX": str(no_header_cxx), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    res = subprocess.run([sys.executable, "-m", "anima_train", "train", str(cfg), "--cpu", "--events", "-"],
                         capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert res.returncode == errors.USER_ERROR_EXIT, res.stderr[-3000:]
    errors_said = [ln for ln in res.stderr.splitlines() if ln.startswith("anima-train train: error:")]
    assert len(errors_said) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    line = errors_said[0]
    assert line.startswith('anima-train train: error: [train] compile = "default": torch.compile does not work on '
                           'cpu here (InductorError: CppCompileError: C++ compile error: fatal error: Python.h: No '
                           'such file or directory). Fix: a working C++ compiler'), line
    assert line.endswith('or set compile = "auto" (trains eagerly when compiling fails) or "off"')
    statuses = [json.loads(ln)["message"] for ln in res.stdout.splitlines() if '"status"' in ln]
    assert "loading model" not in statuses  # refused before the model loaded
    assert not list((tmp_path / "out").rglob("*.safetensors"))


def test_auto_compile_that_cannot_build_trains_eagerly_with_one_warning_and_the_eager_numbers(
        monkeypatch, tiny_anima, latents, tmp_path, no_header_cxx):
    """The compile failure is real (Inductor's C++ build); that compile = "auto" wants to compile on this CPU run is
    simulated (it does so on CUDA for 200+ steps)."""
    import torch._inductor.config as inductor_config

    real = compiling.resolve_compile
    monkeypatch.setattr(compiling, "resolve_compile",
                        lambda setting, device, total: "default" if setting == "auto" else real(setting, device, total))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    events = tmp_path / "events.jsonl"
    with inductor_config.patch({"cpp.cxx": (None, str(no_header_cxx))}):
        auto = train(parse_config(_toml(tiny_anima, latents, tmp_path / "a", "auto")), cpu=True, events=str(events))
    eager = train(parse_config(_toml(tiny_anima, latents, tmp_path / "b", "off")), cpu=True)
    said = list(map(json.loads, events.read_text().splitlines()))
    warnings = [e["text"] for e in said if e["event"] == "warning" and "torch.compile" in e["text"]]
    assert not [e for e in said if "torch.compile" in e.get("text", "") and e["event"] != "warning"]
    assert len(warnings) == 1 and len(warnings[0].splitlines()) == 1, warnings
    assert warnings[0].startswith('torch.compile (compile = "auto") does not work on cpu here (InductorError: '
                                  'CppCompileError: C++ compile error: fatal error: Python.h: No such file or '
                                  'directory): training eagerly. To enable: a working C++ compiler'), warnings[0]
    assert auto.losses == eager.losses and auto.trainable_digest == eager.trainable_digest  # eager, same numbers
    assert len(auto.losses) == 4


@pytest.fixture
def portable(monkeypatch, tmp_path):
    """system/check.py looks at a ComfyUI portable's python_embeded: a `._pth` beside python.exe,
    no include/ or libs/."""
    folder = tmp_path / "ComfyUI_windows_portable" / "python_embeded"
    folder.mkdir(parents=True)
    (folder / f"python{sys.version_info[0]}{sys.version_info[1]}._pth").write_text("../ComfyUI\nimport site\n")
    monkeypatch.setattr(check.sys, "executable", str(folder / "python.exe"))
    monkeypatch.setattr(check, "IS_WINDOWS", True)
    return folder


def _quantized_cfg(setting: str):
    return parse_config(f'[train]\nmodel_path = "m"\ncompile = "{setting}"\n[dataset]\npath = "d"\n'
                       f'[quant]\nmode = "frozen"\n')


def test_a_broken_triton_on_windows_cuda_is_one_warning_naming_the_pin_and_the_missing_headers(monkeypatch,
                                                                                              portable):
    """Simulated: a CUDA device, a triton-windows of the wrong series, and both probes failing as triton-windows does
    without Python.h. The decision: eager, SDNQ's torch kernels, one line that says how to enable both."""
    pytest.importorskip("triton")  # SDNQ's Triton path is considered only where triton imports
    real_import = check._import
    monkeypatch.setattr(check, "_import", lambda name: (types.SimpleNamespace(__version__="3.7.0"), "3.7.0")
                        if name == "triton" else real_import(name))
    monkeypatch.setattr(check, "_torch_requires", lambda: [])
    monkeypatch.setattr(torch, "__version__", "2.14.1+cu130")
    monkeypatch.setenv("SDNQ_USE_TRITON_MM", "1")
    cause = "RuntimeError: fatal error C1083: Cannot open include file: 'Python.h'"
    probed = []
    decision = compiling.decide_compile(_quantized_cfg("auto"), torch.device("cuda"), 10**6,
                                    probe=lambda d: probed.append("compile") or cause,
                                    probe_sdnq=lambda d: probed.append("sdnq") or cause)
    assert probed == ["compile", "sdnq"] and decision.mode is None and decision.sdnq_triton_off
    assert os.environ["SDNQ_USE_TRITON_MM"] == "0"  # SDNQ reads it at import: its torch kernels from now on
    lib = f"python{sys.version_info[0]}{sys.version_info[1]}.lib"
    assert decision.warning == (
        f'torch.compile (compile = "auto") does not work on cuda here ({cause}); nor do SDNQ\'s Triton kernels: '
        f'training eagerly with SDNQ\'s torch kernels. To enable: "{portable / "python.exe"}" -s -m pip install '
        f'"triton-windows==3.8.*"; copy the include and libs folders of a full Python '
        f'{".".join(map(str, sys.version_info[:3]))} into {portable} (it lacks {os.path.join("include", "Python.h")} '
        f'and {os.path.join("libs", lib)})')
    # asked for by name, the same failure is a refusal before the model loads, with the same fix
    with pytest.raises(errors.UserError, match=r'^\[train\] compile = "max-autotune": torch.compile does not work '
                                               r'on cuda here .* -s -m pip install "triton-windows==3\.8\.\*"'):
        compiling.decide_compile(_quantized_cfg("max-autotune"), torch.device("cuda"), 10**6,
                             probe=lambda d: cause, probe_sdnq=lambda d: None)


def test_compile_and_sdnq_triton_that_work_change_nothing(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("SDNQ_USE_TRITON_MM", "1")
    decision = compiling.decide_compile(_quantized_cfg("auto"), torch.device("cuda"), 10**6, probe=lambda d: None,
                                    probe_sdnq=lambda d: None)
    assert decision.mode == "default" and decision.warning is None and not decision.sdnq_triton_off
    assert decision.probes == ["torch.compile", "SDNQ Triton matmul"]
    assert os.environ["SDNQ_USE_TRITON_MM"] == "1"
    # nothing is probed where nothing would compile: eager by choice costs no probe
    off = compiling.decide_compile(parse_config('[train]\nmodel_path = "m"\ncompile = "off"\n[dataset]\npath = "d"\n'),
                               torch.device("cuda"), 10**6, probe=pytest.fail, probe_sdnq=pytest.fail)
    assert off.mode is None and off.probes == []


def test_compiled_kernels_are_kept_in_a_per_user_cache_folder_unless_the_user_chose_one(monkeypatch):
    """torch's default is the temp folder, which a reboot empties (every run after it compiles cold again)."""
    home = {"HOME": "/home/u"}
    monkeypatch.setattr(os.path, "expanduser", lambda p: p.replace("~", home["HOME"]))
    env = {}
    assert compiling.compile_cache_dir(env) == "/home/u/.cache/anima-train/torch-compile"
    assert env == {compiling.CACHE_DIR_ENV: "/home/u/.cache/anima-train/torch-compile"}  # what torch reads
    env = {"XDG_CACHE_HOME": "/x"}
    assert compiling.compile_cache_dir(env) == "/x/anima-train/torch-compile"
    env = {compiling.CACHE_DIR_ENV: "/mine"}  # the user's choice stands
    assert compiling.compile_cache_dir(env) == "/mine" and env == {compiling.CACHE_DIR_ENV: "/mine"}
    env = {compiling.CACHE_DIR_ENV: compiling.torch_default_cache_dir()}  # torch's own, inherited: not a choice
    assert compiling.compile_cache_dir(env) == "/home/u/.cache/anima-train/torch-compile"
    monkeypatch.setattr(sys, "platform", "win32")
    env = {"LOCALAPPDATA": r"C:\Users\u\AppData\Local"}
    assert compiling.compile_cache_dir(env).startswith(r"C:\Users\u\AppData\Local")
    assert compiling.compile_cache_dir(env).replace("\\", "/").endswith("anima-train/torch-compile")


def test_a_compiling_run_sets_the_cache_folder_before_its_probe_and_says_where(monkeypatch, tmp_path):
    monkeypatch.delenv(compiling.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    seen = {}

    def probe(device):  # a probe that works, noting the folder its compile would use
        seen["at_probe"] = os.environ.get(compiling.CACHE_DIR_ENV)

    decision = compiling.decide_compile(_quantized_cfg("default"), torch.device("cuda"), 10, probe=probe,
                                        probe_sdnq=lambda d: None)
    assert decision.mode == "default"
    assert seen["at_probe"] == decision.cache_dir == str(tmp_path / "anima-train" / "torch-compile")
    monkeypatch.delenv(compiling.CACHE_DIR_ENV)
    eager = compiling.decide_compile(_quantized_cfg("off"), torch.device("cuda"), 10, probe=pytest.fail,
                                     probe_sdnq=lambda d: None)
    assert eager.cache_dir is None and compiling.CACHE_DIR_ENV not in os.environ  # an eager run sets nothing


def test_a_run_keeps_its_kernels_in_the_per_user_folder_though_torch_set_its_own_first(tmp_path):
    """Importing torch._dynamo (diffusers, peft and accelerate do, before a run decides to compile) sets
    TORCHINDUCTOR_CACHE_DIR to torch's temp-folder default, and compile_cache_dir took that for the user's choice: every
    compiled run kept its kernels in the temp folder, which a reboot empties. A child process, as a run imports the
    trainer; fails before the fix (the temp folder)."""
    code = (
        "import os, anima_train.training.train\n"
        "from anima_train.training import compiling\n"
        "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
        "print('torch set:', os.environ.get(compiling.CACHE_DIR_ENV))\n"
        "print('kept in:', compiling.compile_cache_dir())\n"
        "print('torch compiles into:', cache_dir())\n")
    env = {k: v for k, v in os.environ.items() if k != compiling.CACHE_DIR_ENV}
    env.update(XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert done.returncode == 0 and set(lines) == {"torch set", "kept in", "torch compiles into"}, done.stderr[-3000:]
    assert lines["torch set"] == compiling.torch_default_cache_dir()  # the child got as far as torch's setting
    ours = str(tmp_path / "anima-train" / "torch-compile")
    assert lines["kept in"] == lines["torch compiles into"] == ours, lines


def test_a_compiled_block_needs_no_cpp_on_the_host(monkeypatch, request, tmp_path):
    """A compiled CUDA run built C++ on the host, and the first build of a process runs Inductor's CPU vector-ISA
    check: ~28 s before the first step on the H100 machines, a warm cache too (bench/results/caps_2026-12-06, where
    the trace found both causes), and MSVC on Windows. The tiny DiT with a LoRA, its blocks compiled the trainer's way
    (compile_transformer: dynamic shapes), on the CPU, where a CPU tensor fed to the graph stands for what a CUDA run
    would convert in a C++ kernel. Before the fix: the norms' eps and the LoRA scalings came in as float64 CPU scalars,
    and with the C++ shape guards some torch releases build by default (switched on here) a guard was compiled."""
    import torch._dynamo
    import torch._dynamo.config as dynamo_config
    from peft import LoraConfig
    from torch._inductor import codecache

    from anima_train.model.tiny import build_models

    # torch's own patch (pytest's monkeypatch deletes a config key on undo): both restored after the test
    switches = {"specialize_float": dynamo_config.specialize_float}
    if hasattr(dynamo_config, "enable_cpp_symbolic_shape_guards"):
        switches["enable_cpp_symbolic_shape_guards"] = True  # on, as the releases that build them have it
    patch = dynamo_config.patch(switches)
    patch.__enter__()
    request.addfinalizer(lambda: patch.__exit__(None, None, None))
    guards_built = []
    load = codecache.CppCodeCache.load.__func__
    monkeypatch.setattr(codecache.CppCodeCache, "load",
                        classmethod(lambda cls, source, *a, **kw: (guards_built.append("guard(int64_t" in source),
                                                                   load(cls, source, *a, **kw))[1]))
    fed_scalars = []

    def backend(graph, inputs):  # what the graph is fed besides the model's own tensors
        fed_scalars.extend(f"{i.dtype} on {i.device}" for i in inputs if isinstance(i, torch.Tensor) and i.dim() == 0)
        return graph.forward

    cfg = parse_config(f'[train]\nmodel_path = "{tmp_path}"\n[dataset]\npath = "{tmp_path}"\n')
    assert cfg.train.compile_dynamic  # the default: dynamic shapes, where both come from
    transformer = build_models("tiny", dtype=torch.float32)["transformer"]
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v", "ff.net.2"]))
    for block in transformer.transformer_blocks:
        monkeypatch.setattr(block, "compile", lambda block=block, **kw: torch.nn.Module.compile(
            block, **{k: v for k, v in kw.items() if k != "mode"}, backend=backend))
    torch._dynamo.reset()
    compiling.compile_transformer(transformer, cfg, "default")
    x = torch.randn(2, 16, 1, 16, 16)
    pred = transformer(x, timestep=torch.rand(2), encoder_hidden_states=torch.randn(2, 512, 32),
                       padding_mask=x.new_zeros(1, 1, 128, 128), return_dict=False)[0]
    pred.square().mean().backward()
    torch._dynamo.reset()
    assert fed_scalars == [], f"the graph is fed CPU scalars: {fed_scalars[:3]}"
    assert not any(guards_built), "a C++ shape guard was compiled"
