"""Memory of the training step: how many DiT blocks recompute their activations (planned after the first step under
checkpoint_blocks = "auto" by training/memory_plan.py; the mechanism is training/recompute.py), the CUDA allocator's
expandable segments, the frozen Qwen3 parked in host memory between steps, and host<->device copies that do not stall
the GPU. Whether to torch.compile is training/compiling.py.

A host sync (`.item()`, `.tolist()`, `bool(tensor)`, or a copy from pageable host memory, which waits for every
kernel queued before it) empties the GPU's queue; the GPU then idles until Python has launched new work. An H200
profile of a compiled LoRA b8 step counted 13 of them and 108 ms of idle GPU per 853 ms step (bench/results/
profile_2026-12-01b). The step now has one: the report's read of the loss, made after the backward is queued and
waiting only for the forward (HostCopy)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING

import torch

from anima_train.outputs.progress import PLAN_PREFIX
from anima_train.training import recompute
from anima_train.training.memory_plan import GIB, Budget, StepMemory, plan_memory

if TYPE_CHECKING:
    from anima_train.config.schema import Config


def parks_qwen3(cfg: Config, device: torch.device, train_text_encoder: bool) -> bool:
    """Qwen3 waits in host memory between uses (ParkedWeights): a frozen, unquantized Qwen3 of a CUDA run (on the
    CPU there is no device memory to spare)."""
    return device.type == "cuda" and not train_text_encoder and not cfg.quant.quantize_text_encoder


class ParkedWeights:
    """A frozen module whose parameters live in pinned host memory and visit the GPU only while in use.

    The copy in is asynchronous from pinned memory (~50 ms for Qwen3-0.6B); going back costs nothing, since the
    host copy never changes: the GPU copy is simply dropped."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.device = device
        self.resident = False  # stay_on_device() was called: on_device() no longer parks
        self.params = [p for p in module.parameters()]
        pin = torch.cuda.is_available()
        self.host = [host_copy(p, pin) for p in self.params]
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


def qwen_for_encode(parked: ParkedWeights | None, cached) -> contextlib.AbstractContextManager:
    """Around an encode of captions: the parked Qwen3 on the device, unless nothing parks or the run's cached outputs
    (`cached`, prompts.QwenOutputs) bring it in themselves, and only for a caption they have not seen."""
    return parked.on_device() if parked is not None and cached is None else contextlib.nullcontext()


def host_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of `tensor` that shares no storage with it, in pinned memory when `pin` (copies in from there
    are asynchronous)."""
    host = tensor.detach().to("cpu")
    return host.pin_memory() if pin else host.clone()


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


def plan_checkpointing(block_ckpt, largest_tokens: int, parked, device, say) -> None:
    """checkpoint_blocks = "auto", after the first optimizer step: the memory plan (training/memory_plan.py) of what
    that step measured, applied: the parked Qwen3 stays on the GPU if the plan says so (`parked` becomes resident,
    for every holder of it), and the blocks beyond the kept ones recompute.

    Qwen3 gets the room first. That order was chosen when a parked Qwen3's 1.1 GiB were copied in before every
    step's encode, on the GPU's critical path (about 20-45 ms over PCIe), while one more kept block saves only its
    recompute (about 3-12 ms at batch 2-8, 1024x1024, H200) for 0.7-2.8 GiB. Parked, it now comes in once per
    encode_ahead.AHEAD micro-batches (2-3 ms a step), so blocks first could gain a block at some caps (not measured:
    at 24 GiB b8 and 12 GiB b4 the 1.1 GiB would not have kept one more)."""
    measure, block_ckpt.measure = block_ckpt.measure, None
    n = len(block_ckpt.blocks)
    steady, peak, budget = recompute.memory_now(device)
    step = StepMemory(act=measure.act, peak=peak, steady=steady, start=measure.start,
                      backward_peak=measure.backward_peak, scale=max(1.0, largest_tokens / max(measure.tokens, 1)),
                      in_graph=measure.in_graph, kept_peak=measure.kept_peak)
    host = sum(h.numel() * h.element_size() for h in parked.host) if parked is not None else 0
    plan = plan_memory(step, Budget(budget, expandable_segments_on()), n_blocks=n - block_ckpt.floor,
                       parked_bytes=host, in_graph=block_ckpt.in_graph is not None)  # the swapped blocks recompute
    keep = plan.keep
    block_ckpt.set_recomputed(n - keep)
    where = ""
    if block_ckpt.in_graph is not None:
        if plan.in_graph:
            where = " inside the compiled graph"
        else:  # its backward holds more than whole-block recompute, and only that fits
            block_ckpt.in_graph = None
            where = ' whole (recompute = "graph" would not fit)'
    if plan.resident:
        parked.stay_on_device()  # the previewer holds the same object: it must not park it again
    block_ckpt.retries = alloc_retries(device)  # from now on a step that makes the allocator retry relieves it
    say(f"{PLAN_PREFIX} {n - keep} of {n} blocks recompute{where if keep < n else ''} (a block keeps "
        f"{step.per_block / GIB:.2f} GiB at the largest batch; predicted peak {plan.predicted / GIB:.1f} of "
        f"{budget / GIB:.1f} GiB)" + ("; Qwen3 stays on the GPU" if plan.resident else ""))


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
        say(f"{PLAN_PREFIX} the allocator ran out of room; Qwen3 goes back to host memory between steps")
    elif block_ckpt.recomputed < n:
        block_ckpt.set_recomputed(block_ckpt.recomputed + 1)
        say(f"{PLAN_PREFIX} the allocator ran out of room; now {block_ckpt.recomputed} of {n} blocks recompute")


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
