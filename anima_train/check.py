"""`anima-train check`: can this environment train Anima?

Imports every dependency (a package that is installed but broken — e.g. a torchvision built for another torch —
only shows up on import), prints versions and device facts, and says which optional pieces work. Exit status is
non-zero when a required piece fails, so install.sh and CI stop there instead of at the first training step.

On Windows triton is the `triton-windows` wheel (upstream publishes none for Windows), which must match torch's Triton
series: the check names the pip command for the python it runs in (ComfyUI portable's python_embeded included), and
says that multi-GPU runs (NCCL) are Linux-only. Everything else (nodes, single-GPU training, caching, export) is the
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

IS_WINDOWS = os.name == "nt"


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
    ("peft", "peft", "LoRA / LoKr adapters"),
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
    report.items.append(Item("python", sys.version_info[:2] in ((3, 11), (3, 12)),
                             f"{platform.python_version()} ({sys.executable})"))
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
        report.items.append(Item("multi-GPU (gpus >= 2)", False, "unavailable on Windows: NCCL, which the multi-GPU "
                                 "runs use, is Linux-only; train on one GPU (everything else works)", required=False))
    return report


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


def _triton_item(torch) -> Item:
    triton, detail = _import("triton")
    if triton is None:
        return Item("triton (SDNQ kernels)", False,
                    f"unavailable ({detail}): SDNQ falls back to slower torch kernels", required=False)
    if torch is None or not torch.cuda.is_available():
        return Item("triton (SDNQ kernels)", False,
                    f"triton {detail} installed but no CUDA device: SDNQ kernels inactive", required=False)
    return Item("triton (SDNQ kernels)", True, f"usable (triton {detail})", required=False)


# The Triton series of each torch release, as triton-windows documents the pairing (torch's own metadata says it too,
# where its wheel lists triton; this table covers wheels that do not).
TRITON_FOR_TORCH = {(2, 6): (3, 2), (2, 7): (3, 3), (2, 8): (3, 4), (2, 9): (3, 5), (2, 10): (3, 6)}


def _version_pair(text: str) -> tuple[int, int] | None:
    m = re.match(r"\s*(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _torch_requires() -> list[str]:
    try:
        from importlib.metadata import requires

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


def triton_windows_install(series: tuple[int, int] | None) -> str:
    """The Command Prompt line that installs triton-windows of `series` into this Python (quoted: `<` redirects)."""
    spec = f"triton-windows<{series[0]}.{series[1] + 1}" if series else "triton-windows"
    return f'"{sys.executable}" -m pip install -U "{spec}"'


def _triton_windows_item(torch) -> Item:
    name = "triton-windows (SDNQ kernels, compile)"
    torch_version = str(getattr(torch, "__version__", "")) if torch is not None else ""
    want = triton_series(torch_version)
    triton, detail = _import("triton")
    if triton is None:
        return Item(name, False, f"not installed ({detail}): SDNQ falls back to slower torch kernels and [train] "
                                 f"compile cannot be used; training works without it. To add it: "
                                 f"{triton_windows_install(want)}", required=False)
    have = _version_pair(detail)
    if want and have and have != want:
        return Item(name, False, f"triton {detail} does not match torch {torch_version} (built against Triton "
                                 f"{want[0]}.{want[1]}): kernels may fail to compile. Fix: "
                                 f"{triton_windows_install(want)}", required=False)
    if torch is None or not torch.cuda.is_available():
        return Item(name, False, f"triton {detail} installed but no CUDA device: SDNQ kernels inactive",
                    required=False)
    note = ""
    folder = os.path.dirname(sys.executable)
    try:
        embedded = any(f.endswith("._pth") for f in os.listdir(folder))  # python_embeded (nodes/worker.py)
    except OSError:
        embedded = False
    if embedded and not os.path.isfile(os.path.join(folder, "include", "Python.h")):
        note = (f"; if kernels fail to compile, copy the include and libs folders of a full Python "
                f"{platform.python_version()} into {folder} (see the README, Windows)")
    return Item(name, True, f"usable (triton {detail} for torch {torch_version}){note}", required=False)


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
