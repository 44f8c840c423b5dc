"""Speed and memory of the training step: torch.compile, how many DiT blocks recompute their activations (decided
after the first step under checkpoint_blocks = "auto", see checkpointing.py), the frozen Qwen3 parked in host
memory between steps, and host<->device copies that do not stall the GPU.

A host sync (`.item()`, `.tolist()`, `bool(tensor)`, or a copy from pageable host memory, which waits for every
kernel queued before it) empties the GPU's queue; the GPU then idles until Python has launched new work. An H200
profile of a compiled LoRA b8 step counted 13 of them and 108 ms of idle GPU per 853 ms step (bench/results/
profile_2026-12-01b). The step now has one: the report's read of the loss, made after the backward is queued and
waiting only for the forward (HostCopy)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from anima_train import checkpointing

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
    import importlib.util

    if setting == "off":
        return None
    if setting != "auto":
        return setting
    if device.type != "cuda" or importlib.util.find_spec("triton") is None or total_steps < COMPILE_MIN_STEPS:
        return None
    return "default"


def plan_checkpointing(block_ckpt, largest_tokens: int, parked, device, say) -> None:
    """checkpoint_blocks = "auto", after the first optimizer step: keep the activations of as many blocks as fit;
    with every block kept and room to spare, keep the frozen Qwen3 on the GPU too (no copy-in per step: `parked`
    becomes resident, for every holder of it)."""
    measure, block_ckpt.measure = block_ckpt.measure, None
    n = len(block_ckpt.blocks)
    steady, peak, budget = checkpointing.memory_now(device)
    scale = max(1.0, largest_tokens / max(measure.tokens, 1))
    keep, predicted = checkpointing.plan_unchecked(n_blocks=n, act=measure.act, peak=peak, steady=steady,
                                                   scale=scale, budget=budget)
    block_ckpt.set_recomputed(n - keep)
    kept_text_encoder = ""
    if parked is not None and keep == n:
        host = sum(h.numel() * h.element_size() for h in parked.host)
        if checkpointing.plan_unchecked(n_blocks=n, act=measure.act, peak=peak + host, steady=steady + host,
                                        scale=scale, budget=budget)[0] == n:
            parked.stay_on_device()  # the previewer holds the same object: it must not park it again
            kept_text_encoder = "; Qwen3 stays on the GPU"
    gib = checkpointing.GIB
    say(f"checkpointing auto: {n - keep} of {n} blocks recompute (a block keeps {measure.act * scale / gib:.2f} GiB "
        f"at the largest batch; predicted peak {predicted / gib:.1f} of {budget / gib:.1f} GiB){kept_text_encoder}")


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
