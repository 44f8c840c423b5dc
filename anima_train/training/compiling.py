"""torch.compile for the training step: whether to use it (decided by running it: a probe before the model loads)
and how (regional, dynamic).

Whether torch.compile works is a property of the machine (a C++ compiler for the CPU; for CUDA a Triton of torch's
series that can build its driver: on Windows triton-windows needs Python.h and libs/python3XX.lib, which ComfyUI
portable's embedded Python lacks). Finding the module proves nothing, so the decision runs a tiny compiled function
(forward and backward) on the run's device before the model loads, and, when SDNQ would use its Triton matmul, one
SDNQ Triton kernel.
"""

from __future__ import annotations

import getpass
import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from anima_train import errors
from anima_train.model.quant import import_sdnq
from anima_train.system.check import toolchain_fix
from anima_train.system.compile_probe import failure_cause, probe_compile

if TYPE_CHECKING:
    from anima_train.config import Config


COMPILE_MIN_STEPS = 200  # compile = "auto": a shorter run would spend longer compiling (~1.5 min cold) than it saves
CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def compile_cache_dir(environ: dict | None = None) -> str:
    """Where compiled kernels are kept between runs, set for this process unless the user chose a folder.

    torch's default is the temp folder (/tmp/torchinductor_<user>; %TEMP% on Windows), which a reboot (tmpfs, Storage
    Sense) empties: every run after it pays the cold compile (a minute or two at 1024²) again. A per-user cache folder
    survives restarts of ComfyUI and of the machine: %LOCALAPPDATA%\\anima-train\\torch-compile on Windows,
    $XDG_CACHE_HOME (or ~/.cache)/anima-train/torch-compile elsewhere. Triton's kernels go under it too (torch puts
    them in <this>/triton unless TRITON_CACHE_DIR is set). Read lazily by torch, so setting it before the first compile
    is enough.

    torch sets TORCHINDUCTOR_CACHE_DIR itself, to its temp-folder default, as soon as torch._dynamo is imported (which
    diffusers and peft do, before a run decides to compile), and a child process inherits it (ComfyUI's Train worker
    from ComfyUI): that value is torch's, not the user's choice, and is replaced like an unset one."""
    environ = os.environ if environ is None else environ
    chosen = environ.get(CACHE_DIR_ENV)
    if chosen and os.path.abspath(chosen) != os.path.abspath(torch_default_cache_dir()):
        return chosen
    if sys.platform == "win32" and environ.get("LOCALAPPDATA"):
        root = os.path.join(environ["LOCALAPPDATA"], "anima-train")
    else:
        root = os.path.join(environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "anima-train")
    environ[CACHE_DIR_ENV] = os.path.join(root, "torch-compile")
    return environ[CACHE_DIR_ENV]


def torch_default_cache_dir() -> str:
    """The folder torch compiles into when nobody chose one (the temp folder's torchinductor_<user>)."""
    try:
        # lazy: torch._inductor (0.7 s on top of torch), only a compiling run asks; private, so it may move between
        # torch versions: then the same rule, written out
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    return default_cache_dir()


def resolve_compile(setting: str, device: torch.device, total_steps: int) -> str | None:
    """The torch.compile mode to use, or None for eager. "auto" compiles on CUDA (Triton present) when the run is
    long enough to repay the compile; "off" never compiles."""
    if setting == "off":
        return None
    if setting != "auto":
        return setting
    if device.type != "cuda" or importlib.util.find_spec("triton") is None or total_steps < COMPILE_MIN_STEPS:
        return None
    return "default"



def compile_transformer(transformer, cfg: Config, mode: str) -> None:
    """torch.compile, lazily (each new shape compiles on first use). Regional: each of the identical DiT blocks is
    compiled (one graph, reused 28 times) instead of the whole trunk, which takes minutes to compile. Dynamic shapes
    keep mixed buckets and per-tier batch sizes from exhausting dynamo's recompile limit (raised 8 -> 32)."""
    # lazy: torch._dynamo (4.5 s measured on top of torch): only a compiled run pays it
    import torch._dynamo

    dynamo_config = torch._dynamo.config
    for limit in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
        if hasattr(dynamo_config, limit):
            setattr(dynamo_config, limit, max(32, getattr(dynamo_config, limit)))
    no_host_cpp(dynamo_config)
    round_like_eager()
    targets = list(transformer.transformer_blocks) if cfg.train.compile_regional else [transformer]
    for module in targets:
        module.compile(mode=mode, dynamic=cfg.train.compile_dynamic)


def no_host_cpp(dynamo_config) -> None:
    """Keep the host's C++ compiler out of a compiled CUDA run. Two defaults of Dynamo put it there, and the first
    C++ build of a process runs Inductor's CPU vector-ISA check (test programs through the compiler): ~28 s on the
    H100 machines before the first step, a warm cache too (bench/results/caps_2026-12-06), and MSVC on Windows.
    - Floats: with dynamic shapes a module's Python floats (a norm's eps, a LoRA's scaling) become float64 CPU
      scalars fed to the graph, which converts them in a C++ kernel. Specialized, they are constants in the GPU
      kernels; a block whose float differed from another's would compile its own graph, as a new shape does.
    - Shape guards: some torch releases build a dynamic graph's shape guards into a C++ function. In Python they are
      a few integer comparisons per block call.
    Process-wide, like the compile settings above (`dynamo_config`: torch._dynamo.config); a torch without a switch
    does neither."""
    for name, value in (("specialize_float", True), ("enable_cpp_symbolic_shape_guards", False)):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, value)


def round_like_eager() -> None:
    """Inductor's fused kernels keep a bf16 op's result in fp32 up to where the kernel writes it out, so where a
    graph is cut (which tensors it saves for the backward) moves the bf16 roundings: the in-graph recompute's graph
    (recompute = "graph", `recompute.py`) and the kept blocks' graph trained to other bits (an H200, LoRA b2 under
    8 GiB: losses 0.0002-0.0012 apart). Emulating eager's casts rounds every bf16 result where eager rounds it,
    fused or not, and the two are one plan again: bit-equal on the tiny model (`tests/test_checkpointing.py`), on
    the H200 losses within 6e-5, at 1 % more kernel time (bench/results/profile_caps_2026-12-04). The user's own
    TORCHINDUCTOR_EMULATE_PRECISION_CASTS wins. A process-wide setting: it holds for every graph compiled after."""
    import torch._inductor.config as inductor_config  # lazy: torch._inductor, only a compiled run pays it (as above)

    if "TORCHINDUCTOR_EMULATE_PRECISION_CASTS" not in os.environ:
        inductor_config.emulate_precision_casts = True


# -- deciding compile by running it --------------------------------------------------------------------------------

_SDNQ_TRITON_OFF = {"0", "false", "no"}


@dataclass
class CompileDecision:
    mode: str | None  # the torch.compile mode to use; None = eager
    warning: str | None = None  # one line: what was wanted, why it does not work here, what would enable it
    sdnq_triton_off: bool = False  # SDNQ's Triton kernels failed the probe: its torch kernels are used instead
    probes: list[str] = field(default_factory=list)  # what ran (for the log)
    cache_dir: str | None = None  # where compiled kernels are kept between runs (compile_cache_dir), when compiling


def sdnq_triton_wanted(cfg: Config, device: torch.device) -> bool:
    """Would SDNQ run its Triton matmul kernels in this run? (quantized, on CUDA, triton importable, not turned
    off through SDNQ_USE_TRITON_MM.)"""
    return (device.type == "cuda" and cfg.quant.mode != "none" and importlib.util.find_spec("triton") is not None
            and os.environ.get("SDNQ_USE_TRITON_MM", "1").lower() not in _SDNQ_TRITON_OFF)


def probe_sdnq_triton(device: torch.device) -> str | None:
    """Run one SDNQ Triton kernel (its int8 matmul) on `device`; None when it works and matches the exact product."""
    try:
        import_sdnq()
        # lazy: imports triton: only where its kernels would run
        from sdnq.kernels.triton_mm import sdnq_triton_mm  # imports triton: only where its kernels would run

        gen = torch.Generator().manual_seed(0)
        a = torch.randint(-8, 8, (64, 64), generator=gen, dtype=torch.int8).to(device)
        b = torch.randint(-8, 8, (64, 64), generator=gen, dtype=torch.int8).to(device)
        out = sdnq_triton_mm(a, b)
        if not torch.equal(out.to(torch.int64).cpu(), a.cpu().to(torch.int64) @ b.cpu().to(torch.int64)):
            return "SDNQ's Triton matmul gave a wrong product"
    except Exception as exc:  # noqa: BLE001
        return failure_cause(exc)
    return None


def disable_sdnq_triton() -> None:
    """SDNQ falls back to its torch kernels: its wrappers look the Triton kernels up at each call."""
    os.environ["SDNQ_USE_TRITON_MM"] = "0"  # for an sdnq imported later (read at its import)
    wrappers = sys.modules.get("sdnq.kernel_wrappers")
    if wrappers is not None:
        for name, value in (("sdnq_triton_mm", None), ("sdnq_scaled_mm", None), ("use_triton_mm", False),
                            ("use_triton_scaled_mm", False)):
            if hasattr(wrappers, name):
                setattr(wrappers, name, value)


def enable_hint(device: torch.device) -> str:
    """What would make compiled kernels work on this machine (system/check.py knows the Triton pin and the embedded
    Python's missing pieces)."""
    return toolchain_fix(device.type)


def decide_compile(cfg: Config, device: torch.device, total_steps: int, *, probe=probe_compile,
                   probe_sdnq=probe_sdnq_triton) -> CompileDecision:
    """The compile mode this run uses, decided by running it (see above). compile = "auto" falls back to eager with
    one warning line; an explicitly asked mode that cannot work here is refused (UserError) before the model loads.
    SDNQ's Triton kernels, when it would use them, are probed too and turned off (with the same warning) when they
    fail."""
    setting = cfg.train.compile
    mode = resolve_compile(setting, device, total_steps)
    decision = CompileDecision(mode)
    compile_cause = None
    if mode is not None:
        decision.cache_dir = compile_cache_dir()  # before the probe: it compiles too, and is cached like the run
        decision.probes.append("torch.compile")
        compile_cause = probe(device)
    sdnq_cause = None
    if sdnq_triton_wanted(cfg, device):
        decision.probes.append("SDNQ Triton matmul")
        sdnq_cause = probe_sdnq(device)
        if sdnq_cause is not None:
            disable_sdnq_triton()
            decision.sdnq_triton_off = True
    if compile_cause is not None and setting != "auto":
        raise errors.UserError(
            f'[train] compile = "{setting}": torch.compile does not work on {device.type} here ({compile_cause}). '
            f'Fix: {enable_hint(device)}; or set compile = "auto" (trains eagerly when compiling fails) or "off"')
    if compile_cause is None and sdnq_cause is None:
        return decision
    failed = []
    if compile_cause is not None:
        decision.mode = None
        failed.append(f'torch.compile (compile = "auto") does not work on {device.type} here ({compile_cause})')
    if sdnq_cause is not None:
        failed.append(f"SDNQ's Triton kernels do not work here ({sdnq_cause})"
                      if compile_cause is None or sdnq_cause != compile_cause else "nor do SDNQ's Triton kernels")
    fallback = ("training eagerly" + (" with SDNQ's torch kernels" if sdnq_cause is not None else "")
                if compile_cause is not None else "SDNQ uses its torch kernels")
    decision.warning = f"{'; '.join(failed)}: {fallback}. To enable: {enable_hint(device)}"
    return decision
