"""`anima-train check`: can this environment train Anima?

Imports every dependency (a package that is installed but broken — e.g. a torchvision built for another torch —
only shows up on import), prints versions and device facts, and says which optional pieces work. Exit status is
non-zero when a required piece fails, so install.sh and CI stop there instead of at the first training step.

Triton (SDNQ's fast kernels, `[train] compile` on CUDA) is judged by running it: on a CUDA machine the check compiles
and runs the same tiny function the trainer probes before a run (system/compile_probe.py, probe_compile), so a
Triton that imports but cannot build a kernel is reported as broken. On Windows triton is the `triton-windows` wheel
(upstream publishes none for Windows), which the pack never installs (other packs in a ComfyUI depend on theirs): the
check names the exact pin for the torch it finds, the pip command for the python it runs in (ComfyUI portable's
python_embeded included, with `-s`), what an embedded Python lacks for it (include/Python.h, libs/python3XX.lib), and
that multi-GPU runs are refused on Windows. Everything else (nodes, single-GPU training, caching, export) is the
same on both.
"""

from __future__ import annotations

import importlib
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from importlib.metadata import requires

IS_WINDOWS = os.name == "nt"
SUPPORTED_PYTHONS = ((3, 11), (3, 12), (3, 13))


@dataclass
class Item:
    name: str
    ok: bool
    detail: str
    required: bool = True


@dataclass
class Report:
    items: list[Item] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(i.ok for i in self.items if i.required)

    def text(self) -> str:
        width = max(len(i.name) for i in self.items)
        lines = []
        for i in self.items:
            mark = "ok  " if i.ok else ("FAIL" if i.required else "--  ")
            lines.append(f"  {mark} {i.name:<{width}}  {i.detail}")
        verdict = "all required pieces work" if self.ok else "a REQUIRED piece failed (see FAIL above)"
        return "\n".join(lines + [f"anima-train check: {verdict}"])


# (import name, distribution label, why we need it). Order = the order printed.
REQUIRED = [
    ("torch", "torch", "tensors, autograd"),
    ("torchvision", "torchvision", "needed by diffusers' Cosmos DiT forward (padding-mask resize)"),
    ("diffusers", "diffusers", "Anima DiT, LLM adapter, VAE, scheduler"),
    ("transformers", "transformers", "Qwen3 text encoder, tokenizers"),
    ("tokenizers", "tokenizers", "fast tokenizers"),
    ("peft", "peft", "the adapter layers of every [adapter] kind"),
    ("accelerate", "accelerate", "single/multi-GPU training loop"),
    ("safetensors", "safetensors", "every file we read and write"),
    ("sdnq", "sdnq", "int8 quantization and quantized optimizers"),
    ("huggingface_hub", "huggingface_hub", "tokenizer download during convert"),
    ("tomlkit", "tomlkit", "config files (comments kept)"),
    ("numpy", "numpy", "arrays"),
    ("PIL", "pillow", "image loading"),
    ("tqdm", "tqdm", "progress bars"),
]


def _import(name: str) -> tuple[object | None, str]:
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # a broken install raises all sorts of things, not only ImportError
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return module, getattr(module, "__version__", "installed")


def run_checks() -> Report:
    report = Report()
    report.items.append(python_item(sys.version_info[:3]))
    modules = {}
    for name, label, why in REQUIRED:
        module, detail = _import(name)
        modules[name] = module
        report.items.append(Item(label, module is not None, detail if module is None else f"{detail}  ({why})"))

    # The Anima classes exist only in recent diffusers; an old release imports fine and then fails at model load.
    if modules["diffusers"] is not None:
        missing = []
        for cls in ("CosmosTransformer3DModel", "AutoencoderKLQwenImage", "FlowMatchEulerDiscreteScheduler"):
            if not hasattr(modules["diffusers"], cls):
                missing.append(cls)
        try:
            importlib.import_module("diffusers.models.condition_embedders.condition_embedder_anima")
        except Exception:
            missing.append("AnimaTextConditioner")
        report.items.append(Item("diffusers Anima classes", not missing,
                                 "present" if not missing else
                                 f"missing {', '.join(missing)}: install diffusers>=0.42.1"))

    torch = modules["torch"]
    if torch is not None:
        report.items.extend(_device_items(torch))

    # Optional pieces: their absence changes what can be configured, not whether we can train.
    scipy, detail = _import("scipy.optimize")
    report.items.append(Item("scipy (flow.use_ot)", scipy is not None,
                             ("usable: optimal-transport noise pairing available" if scipy is not None
                              else f"unavailable ({detail}): flow.use_ot cannot be enabled"), required=False))
    report.items.append(_triton_windows_item(torch) if IS_WINDOWS else _triton_item(torch))
    if IS_WINDOWS:
        report.items.append(Item("multi-GPU (gpus >= 2)", False, "refused on Windows: NCCL, which the multi-GPU "
                                 "runs use, is Linux-only; train on one GPU (everything else works)", required=False))
    return report


def python_item(version: tuple) -> Item:
    supported = tuple(version[:2]) in SUPPORTED_PYTHONS
    text = ".".join(str(v) for v in version[:3])
    return Item("python", supported, f"{text} ({sys.executable})"
                + ("" if supported else ": not supported; use Python 3.11, 3.12 or 3.13"))


def _device_items(torch) -> list[Item]:
    items = []
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            items.append(Item(f"cuda:{i}", True,
                              f"{p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, "
                              f"bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}", required=False))
        items.append(Item("device", True, f"CUDA {torch.version.cuda}, {n} GPU(s)", required=False))
    else:
        built = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
        items.append(Item("device", True, f"no CUDA device visible ({built}); training runs on CPU (slow)",
                          required=False))
    return items


def _probe_device(torch):
    """Where the check runs the compile probe: the first CUDA device (the CPU is never compiled for by compile =
    "auto"), else None."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else None


def _probe(torch) -> str | None:
    """The trainer's own compile probe on the probe device (speed imports torch: imported only when torch works)."""
    # lazy: compile_probe imports torch: `check` imports torch only once it knows torch works
    from anima_train.system.compile_probe import probe_compile

    return probe_compile(_probe_device(torch))


def _triton_item(torch) -> Item:
    name = "triton (SDNQ kernels, compile)"
    triton, detail = _import("triton")
    if triton is None:
        return Item(name, False,
                    f"unavailable ({detail}): SDNQ falls back to slower torch kernels", required=False)
    if torch is None or _probe_device(torch) is None:
        return Item(name, False,
                    f"triton {detail} installed but no CUDA device: SDNQ kernels inactive", required=False)
    cause = _probe(torch)
    if cause is not None:
        return Item(name, False, f"broken: triton {detail} imports but a compiled kernel failed on "
                                 f"{_probe_device(torch)} ({cause}); training runs eagerly. Fix: "
                                 f"{toolchain_fix(_probe_device(torch).type)}", required=False)
    return Item(name, True, f"usable: a compiled kernel ran on {_probe_device(torch)} (triton {detail})",
                required=False)


# The Triton series of each torch release, as triton-windows documents the pairing (torch's own metadata says it too,
# where its wheel lists triton; this table covers wheels that do not).
TRITON_FOR_TORCH = {(2, 6): (3, 2), (2, 7): (3, 3), (2, 8): (3, 4), (2, 9): (3, 5), (2, 10): (3, 6), (2, 11): (3, 6),
                    (2, 12): (3, 7), (2, 13): (3, 7), (2, 14): (3, 8), (2, 15): (3, 9)}


def _version_pair(text: str) -> tuple[int, int] | None:
    m = re.match(r"\s*(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _torch_requires() -> list[str]:
    try:
        return requires("torch") or []
    except Exception:  # noqa: BLE001 (no metadata: an unusual install; fall back to the table)
        return []


def triton_series(torch_version: str, torch_requires: list[str] | None = None) -> tuple[int, int] | None:
    """(major, minor) of the Triton release `torch_version` is built against: from torch's metadata (its wheels
    require `triton~=X.Y` for Linux), else TRITON_FOR_TORCH; None when neither knows."""
    for req in _torch_requires() if torch_requires is None else torch_requires:
        m = re.match(r"triton\s*(?:~=|==|>=)\s*(\d+)\.(\d+)", req)
        if m:
            return int(m.group(1)), int(m.group(2))
    return TRITON_FOR_TORCH.get(_version_pair(torch_version))


def pip_command(spec: str) -> str:
    """The Command Prompt line that pip-installs `spec` into this Python: quoted (`<`, `>` and `*` are special),
    with `-s` (ComfyUI portable's python_embeded must not see, nor install next to, the user's site-packages)."""
    return f'"{sys.executable}" -s -m pip install "{spec}"'


def triton_windows_install(series: tuple[int, int] | None, torch_version: str = "") -> str:
    """The pip line for the triton-windows of `series` (the exact pin), or the unpinned name with what to match."""
    if series is None:
        return (pip_command("triton-windows") + f" (its series must match torch {torch_version or '?'}: see "
                                                f"triton-windows' README)")
    return pip_command(f"triton-windows=={series[0]}.{series[1]}.*")


def embedded_missing(executable: str | None = None) -> list[str]:
    """What an embedded Python (a `._pth` file beside it, as ComfyUI portable's python_embeded) lacks for Triton to
    build its driver: include/Python.h and libs/python3XX.lib. [] for a full Python or a venv."""
    folder = os.path.dirname(executable or sys.executable)
    try:
        embedded = any(f.endswith("._pth") for f in os.listdir(folder))  # nodes/worker.py: ignores_environment
    except OSError:
        return []
    if not embedded:
        return []
    lib = f"python{sys.version_info[0]}{sys.version_info[1]}.lib"
    wanted = [os.path.join("include", "Python.h"), os.path.join("libs", lib)]
    return [w for w in wanted if not os.path.isfile(os.path.join(folder, w))]


def toolchain_fix(device_type: str = "cuda") -> str:
    """What would make compiled kernels work here, in one phrase: on Windows (CUDA) the triton-windows pin for this
    torch and the embedded Python's missing pieces; elsewhere a Triton matching torch (CUDA) or a C++ compiler with
    Python's headers (CPU: Inductor builds C++)."""
    if device_type != "cuda":
        return ("a working C++ compiler that finds Python's headers (Inductor builds C++ for the CPU; set CXX to "
                "choose it)" + (", e.g. MSVC's cl" if IS_WINDOWS else "")
                + (f"; copy the include and libs folders of a full Python {platform.python_version()} into "
                   f"{os.path.dirname(sys.executable)}" if embedded_missing() else ""))
    if not IS_WINDOWS:
        return "the Triton that matches torch (torch's own Linux wheel brings it)"
    fixes = []
    torch_version = ""
    try:
        # lazy: torch may be broken: `check` must report it, not fail to import
        import torch

        torch_version = str(torch.__version__)
    except Exception:  # noqa: BLE001 (the check reports torch itself)
        pass
    want = triton_series(torch_version)
    triton, detail = _import("triton")
    have = _version_pair(detail) if triton is not None else None
    if triton is None or (want and have and have != want):
        fixes.append(triton_windows_install(want, torch_version))
    missing = embedded_missing()
    if missing:
        fixes.append(f"copy the include and libs folders of a full Python {platform.python_version()} into "
                     f"{os.path.dirname(sys.executable)} (it lacks {' and '.join(missing)})")
    if not fixes:
        fixes.append(f"reinstall the matching triton-windows: {triton_windows_install(want, torch_version)}, and "
                     f"see the README (Windows and ComfyUI portable)")
    return "; ".join(fixes)


def _triton_windows_item(torch) -> Item:
    name = "triton-windows (SDNQ kernels, compile)"
    torch_version = str(getattr(torch, "__version__", "")) if torch is not None else ""
    want = triton_series(torch_version)
    missing = embedded_missing()
    headers = (f"; this embedded Python also lacks {' and '.join(missing)}, which Triton needs: copy the include "
               f"and libs folders of a full Python {platform.python_version()} into "
               f"{os.path.dirname(sys.executable)}") if missing else ""
    triton, detail = _import("triton")
    if triton is None:
        return Item(name, False, f"not installed ({detail}): SDNQ falls back to slower torch kernels and [train] "
                                 f"compile trains eagerly; training works without it. To add it (the pack never "
                                 f"installs it): {triton_windows_install(want, torch_version)}{headers}",
                    required=False)
    have = _version_pair(detail)
    if want and have and have != want:
        return Item(name, False, f"triton {detail} does not match torch {torch_version} (built against Triton "
                                 f"{want[0]}.{want[1]}): kernels fail to compile. Fix: "
                                 f"{triton_windows_install(want, torch_version)}{headers}", required=False)
    if torch is None or _probe_device(torch) is None:
        return Item(name, False, f"triton {detail} installed but no CUDA device: SDNQ kernels inactive{headers}",
                    required=False)
    cause = _probe(torch)
    if cause is not None:
        return Item(name, False, f"broken: triton {detail} imports but a compiled kernel failed on "
                                 f"{_probe_device(torch)} ({cause}); training runs eagerly. Fix: "
                                 f"{toolchain_fix(_probe_device(torch).type)}",
                    required=False)
    return Item(name, True, f"usable: a compiled kernel ran on {_probe_device(torch)} (triton {detail} for torch "
                            f"{torch_version})", required=False)


def add_arguments(parser) -> None:
    parser.add_argument("--quiet", action="store_true", help="print only failures and the verdict")


def run(args) -> int:
    t0 = time.perf_counter()
    report = run_checks()
    text = report.text()
    if getattr(args, "quiet", False):
        text = "\n".join(line for line in text.splitlines() if "FAIL" in line or line.startswith("anima-train"))
    print(text)
    print(f"  (checked in {time.perf_counter() - t0:.1f} s)")
    return 0 if report.ok else 1
