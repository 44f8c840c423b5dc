"""Speed and memory of the training step: torch.compile, how many DiT blocks recompute their activations (decided
after the first step under checkpoint_blocks = "auto", see training/recompute.py), the frozen Qwen3 parked in host
memory between steps, and host<->device copies that do not stall the GPU.

A host sync (`.item()`, `.tolist()`, `bool(tensor)`, or a copy from pageable host memory, which waits for every
kernel queued before it) empties the GPU's queue; the GPU then idles until Python has launched new work. An H200
profile of a compiled LoRA b8 step counted 13 of them and 108 ms of idle GPU per 853 ms step (bench/results/
profile_2026-12-01b). The step now has one: the report's read of the loss, made after the backward is queued and
waiting only for the forward (HostCopy)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from anima_train import errors
from anima_train.training import recompute
from anima_train.system.check import toolchain_fix
from anima_train.model.quant import import_sdnq

if TYPE_CHECKING:
    from anima_train.config import Config


class ParkedWeights:
    """A frozen module whose parameters live in pinned host memory and visit the GPU only while in use.

    The copy in is asynchronous from pinned memory (~50 ms for Qwen3-0.6B); going back costs nothing, since the
    host copy never changes: the GPU copy is simply dropped."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.device = device
        self.resident = False  # stay_on_device() was called: on_device() no longer parks
        self.params = [p for p in module.parameters()]
        pin = torch.cuda.is_available()
        self.host = [p.detach().to("cpu").pin_memory() if pin else p.detach().to("cpu").clone() for p in self.params]
        self.park()

    def park(self) -> None:
        for p, h in zip(self.params, self.host):
            p.data = h

    def restore(self) -> None:
        for p, h in zip(self.params, self.host):
            p.data = h.to(self.device, non_blocking=True)

    def stay_on_device(self) -> None:
        """From now on the weights live on the device (there is room): every holder's on_device() keeps them."""
        self.restore()
        self.resident = True

    def leave_device(self) -> None:
        """Back to waiting in host memory between uses (the auto plan found no room after all)."""
        self.resident = False
        self.park()

    @contextlib.contextmanager
    def on_device(self):
        if self.resident:
            yield
            return
        self.restore()
        try:
            yield
        finally:
            self.park()


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on the device without a host sync: from pinned memory the copy is queued behind the running
    kernels; from pageable memory CUDA would first wait for all of them."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values on their way to the host. `read()` waits only for the kernels queued before the copy
    (a CUDA event), not for everything queued since, as `.tolist()` on the device tensor would: read after queueing
    the backward, it costs no idle GPU."""

    def __init__(self, tensor: torch.Tensor):
        tensor = tensor.detach()
        self.event = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor.to("cpu", copy=True)

    def read(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


COMPILE_MIN_STEPS = 200  # compile = "auto": a shorter run would spend longer compiling (~1.5 min cold) than it saves


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


def plan_checkpointing(block_ckpt, largest_tokens: int, parked, device, say) -> None:
    """checkpoint_blocks = "auto", after the first optimizer step: first keep the frozen Qwen3 on the GPU if it fits
    beside the all-checkpointed step (`parked` becomes resident, for every holder of it), then keep the activations
    of as many blocks as the rest holds.

    Qwen3 gets the room first: parked, its 1.1 GiB of weights are copied in before every step's encode, on the GPU's
    critical path (about 20-45 ms over PCIe), while one more kept block saves only its recompute (about 3-12 ms at
    batch 2-8, 1024x1024, H200) for 0.7-2.8 GiB. Measured under an 8 GiB cap at batch 2: Qwen3 parked with 2
    blocks kept ran 0.1985 s/image, the seed with Qwen3 resident and every block recomputed 0.1742."""
    measure, block_ckpt.measure = block_ckpt.measure, None
    n = len(block_ckpt.blocks)
    steady, peak, budget = recompute.memory_now(device)
    scale = max(1.0, largest_tokens / max(measure.tokens, 1))
    host = sum(h.numel() * h.element_size() for h in parked.host) if parked is not None else 0
    expandable = expandable_segments_on()
    start = measure.start  # the growth of the first step is charged from here (recompute.step_base)
    resident = parked is not None and recompute.fits(peak=peak + host, steady=steady + host, scale=scale,
                                                         budget=budget, expandable=expandable,
                                                         start=None if start is None else start + host)
    if resident:
        steady, peak = steady + host, peak + host
        start = None if start is None else start + host
    keep, predicted = recompute.plan_unchecked(n_blocks=n, act=measure.act, peak=peak, steady=steady,
                                                   scale=scale, budget=budget, expandable=expandable, start=start)
    block_ckpt.set_recomputed(n - keep)
    if resident:
        parked.stay_on_device()  # the previewer holds the same object: it must not park it again
    block_ckpt.retries = alloc_retries(device)  # from now on a step that makes the allocator retry relieves it
    gib = recompute.GIB
    say(f"checkpointing auto: {n - keep} of {n} blocks recompute (a block keeps {measure.act * scale / gib:.2f} GiB "
        f"at the largest batch; predicted peak {predicted / gib:.1f} of {budget / gib:.1f} GiB)"
        + ("; Qwen3 stays on the GPU" if resident else ""))


def alloc_retries(device) -> int:
    """How often the caching allocator found no room, freed every cached block and tried again (each time a device
    sync and a stall): a host-side counter, no sync."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def relieve(block_ckpt, parked, device, say) -> None:
    """After the auto plan: if the last step made the allocator retry (the plan sits too close to the card's limit
    and would stall every step), give memory back: park Qwen3 again if the plan kept it, else recompute one more
    block. Exact either way: where the weights wait and which blocks recompute change no number."""
    retries = alloc_retries(device)
    if retries <= block_ckpt.retries:
        return
    block_ckpt.retries = retries
    n = len(block_ckpt.blocks)
    if parked is not None and parked.resident:
        parked.leave_device()
        say("checkpointing auto: the allocator ran out of room; Qwen3 goes back to host memory between steps")
    elif block_ckpt.recomputed < n:
        block_ckpt.set_recomputed(block_ckpt.recomputed + 1)
        say(f"checkpointing auto: the allocator ran out of room; now {block_ckpt.recomputed} of {n} blocks recompute")


_EXPANDABLE = {"set": False}  # use_expandable_segments() turned them on in this process


def expandable_segments_on() -> bool:
    """The CUDA allocator grows segments in place: set here, or by the user's PYTORCH_CUDA_ALLOC_CONF."""
    conf = (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or "").replace(" ", "")
    return _EXPANDABLE["set"] or ("expandable_segments:true" in conf.lower() and sys.platform.startswith("linux"))


def use_expandable_segments(device) -> bool:
    """Let the CUDA caching allocator grow its segments in place instead of carving fixed ones: with a step's
    tensors of many sizes the fixed segments fragment (measured on an H200 capped at 8 GiB, LoRA batch 2: 7.85 GiB
    reserved for a 6.6 GiB peak; expandable: 6.94 GiB). The seed trainer sets the same. A user's own
    PYTORCH_CUDA_ALLOC_CONF wins; the setting changes where tensors live, never a number. Linux only: elsewhere
    PyTorch ignores the setting (with a warning), and the planner must keep the fixed segments' margin."""
    if device.type != "cuda" or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") \
            or not sys.platform.startswith("linux"):
        return False
    # private calls whose name moved (torch 2.11 deprecates the second): the first that takes the setting wins
    for setter in (getattr(torch._C, "_accelerator_setAllocatorSettings", None),
                   getattr(torch.cuda.memory, "_set_allocator_settings", None)):
        if setter is None:
            continue
        try:
            setter("expandable_segments:True")
        except (RuntimeError, TypeError, ValueError):
            continue
        _EXPANDABLE["set"] = True
        return True
    return False


def compile_transformer(transformer, cfg: Config, mode: str) -> None:
    """torch.compile, lazily (each new shape compiles on first use). Regional: each of the identical DiT blocks is
    compiled (one graph, reused 28 times) instead of the whole trunk, which takes minutes to compile. Dynamic shapes
    keep mixed buckets and per-tier batch sizes from exhausting dynamo's recompile limit (raised 8 -> 32)."""
    import torch._dynamo

    dynamo_config = torch._dynamo.config
    for limit in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
        if hasattr(dynamo_config, limit):
            setattr(dynamo_config, limit, max(32, getattr(dynamo_config, limit)))
    targets = list(transformer.transformer_blocks) if cfg.train.compile_regional else [transformer]
    for module in targets:
        module.compile(mode=mode, dynamic=cfg.train.compile_dynamic)


# -- deciding compile by running it --------------------------------------------------------------------------------
# Whether torch.compile works is a property of the machine (a C++ compiler for the CPU; for CUDA a Triton of torch's
# series that can build its driver: on Windows triton-windows needs Python.h and libs/python3XX.lib, which ComfyUI
# portable's embedded Python lacks). Finding the module proves nothing, so the decision runs a tiny compiled function
# (forward and backward) on the run's device before the model loads, and, when SDNQ would use its Triton matmul,
# one SDNQ Triton kernel.

_SDNQ_TRITON_OFF = {"0", "false", "no"}


@dataclass
class CompileDecision:
    mode: str | None  # the torch.compile mode to use; None = eager
    warning: str | None = None  # one line: what was wanted, why it does not work here, what would enable it
    sdnq_triton_off: bool = False  # SDNQ's Triton kernels failed the probe: its torch kernels are used instead
    probes: list[str] = field(default_factory=list)  # what ran (for the log)


def failure_cause(exc: BaseException) -> str:
    """One line out of a compiler failure: the exception's first line, plus the compiler's own line that names the
    error (`fatal error: Python.h: No such file or directory`) when there is one."""
    lines = [ln.strip() for ln in f"{exc}".splitlines() if ln.strip()]
    head = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    detail = None
    for pattern in (r"fatal error", r"No such file|not found|cannot find|cannot open", r"^error:|\berror:"):
        detail = next((ln for ln in lines[1:] if re.search(pattern, ln, re.IGNORECASE)), None)
        if detail:
            break
    cause = f"{head}: {detail}" if detail and detail not in head else head
    return cause if len(cause) <= 300 else cause[:297] + "..."


def _probe_function(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.sin(x) * w + x * x).sum()


_probes = [0]


def probe_compile(device: torch.device | str) -> str | None:
    """Compile and run a tiny function (forward and backward) on `device` with Inductor; None when it works and
    gives the eager numbers, else the cause in one line. Each probe compiles anew: a fresh code object (dynamo
    caches by code object) and no FX graph cache, so an earlier success cannot answer for this machine now."""
    import torch._inductor.config as inductor_config  # heavy: only when a probe runs

    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, generator=gen).to(device)
    w_eager = torch.randn(64, generator=gen).to(device).requires_grad_(True)
    w = w_eager.detach().clone().requires_grad_(True)
    _probes[0] += 1
    code = _probe_function.__code__.replace(co_name=f"anima_compile_probe_{_probes[0]}")
    fn = types.FunctionType(code, _probe_function.__globals__)
    try:
        with inductor_config.patch(fx_graph_cache=False):
            out = torch.compile(fn, dynamic=False, fullgraph=True)(x, w)
            out.backward()
        ref = _probe_function(x, w_eager)
        ref.backward()
        if not (torch.allclose(out.detach(), ref.detach(), rtol=1e-4, atol=1e-4)
                and torch.allclose(w.grad, w_eager.grad, rtol=1e-4, atol=1e-4)):
            return "the compiled probe gave different numbers from eager"
    except Exception as exc:  # noqa: BLE001 (any failure of the toolchain means: do not compile)
        return failure_cause(exc)
    return None


def sdnq_triton_wanted(cfg: Config, device: torch.device) -> bool:
    """Would SDNQ run its Triton matmul kernels in this run? (quantized, on CUDA, triton importable, not turned
    off through SDNQ_USE_TRITON_MM.)"""
    return (device.type == "cuda" and cfg.quant.mode != "none" and importlib.util.find_spec("triton") is not None
            and os.environ.get("SDNQ_USE_TRITON_MM", "1").lower() not in _SDNQ_TRITON_OFF)


def probe_sdnq_triton(device: torch.device) -> str | None:
    """Run one SDNQ Triton kernel (its int8 matmul) on `device`; None when it works and matches the exact product."""
    try:
        import_sdnq()
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
