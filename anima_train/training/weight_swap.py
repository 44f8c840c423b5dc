"""Frozen-weight block swap (`[train] swap_blocks`): for a LoRA or LoKr on a card too small for the DiT's 3.98 GiB
of bf16 weights, the frozen weights of the first N DiT blocks live in host memory and visit the GPU one block at a
time.

A swapped block's frozen parameters and buffers (the base Linears, norms; not the adapter's trainable weights,
which stay on the GPU with their optimizer state) are kept as host copies (pinned on CUDA, so the copy in is
asynchronous). On the GPU each of them is an empty placeholder until the block is called: the call copies its
weights in, after dropping those of the block that visited before it (`slots` blocks are on the GPU at a time).
Nothing is ever written back: the weights are frozen, the host copy stays right.

Why this is exact, and when it would not be:
- a copy is bit-exact, so the block computes what it computes resident;
- a swapped block always recomputes in backward (recompute.BlockCheckpointing keeps the first N blocks under
  torch.utils.checkpoint), so its forward saves no weight for backward; the backward's recompute calls the block
  again, which copies the weights back in, and the recomputed graph holds its own references to them until that
  block's backward is done. Blocks run one after the other in backward too, so the block dropped is one whose
  backward has finished. Were a weight ever used while dropped, it is an empty tensor: a shape error, never a
  silent wrong number (tests/test_weight_swap.py runs the tiny model with one slot, where every block is dropped
  and copied in again each step, and compares with the resident run bit for bit);
- each block's weights travel as one copy per dtype (a flat pinned buffer; the parameters become views of its
  device copy, each starting on an aligned address) instead of one small copy per tensor;
- the copies run on the compute stream, in order, so the caching allocator may reuse a dropped block's memory only
  after every kernel that read it. A block of Anima is 0.129 GiB in bf16: 2.5 ms from pinned memory on an H200
  (55 GB/s), about 5 ms over PCIe 4.0 x16. A copy of the next block on a side stream, overlapping the running
  block, was built and measured on the H200 (bench/results/swap_2026-12-04): at batch 4 under 8 GiB no faster
  (0.1595 s/image against 0.158), at batch 1 under 6 GiB slower (host-bound: 0.67 s per profiled step against
  0.63), so the copies stay in order.

The block's class is replaced by a subclass whose __call__ copies the weights in and then calls nn.Module.__call__:
a regional torch.compile (`module.compile()`, compiling.compile_transformer) sits inside that call, so the swap
stays out of the compiled graph, and state-dict keys do not change. `restore()` puts the weights back for good.
"""

from __future__ import annotations

import torch


RESIDENT_SLOTS = 1  # swapped blocks on the GPU at once: the one running
# Where each tensor starts in its flat buffer: compiled kernels assume aligned inputs (Inductor copies, or guards
# on, an input whose address is not 16-byte aligned), as the allocator's own tensors are.
ALIGN_BYTES = 256


class WeightSwap:
    """The frozen weights of `blocks` in host memory, on the device only while their block runs."""

    def __init__(self, blocks: list[torch.nn.Module], device: torch.device, slots: int = RESIDENT_SLOTS, *,
                 others: list[torch.nn.Module] = ()):
        self.device, self.slots = torch.device(device), max(1, slots)
        self.blocks = list(blocks)
        # The trunk's other blocks take the same class, and swap nothing: Dynamo guards on a block's type, and a
        # swapped block's class of its own compiled every graph of the block once more (~17 s cold at 1024² b1
        # on an H100, bench/results/first_step_2026-12-06).
        self.others = [(block, type(block)) for block in others]
        for block, cls in self.others:
            block.__class__ = _swapped_class(cls)
            block._weight_swap = None
        self.uploads = 0  # blocks copied in so far (the tests read it)
        self.resident: list[int] = []  # indices into self.blocks, the least recently called first
        # per block, per dtype: (host flat buffer, [(parameter or buffer, offset, shape)])
        self.layout: list[list[tuple[torch.Tensor, list[tuple[torch.Tensor, int, torch.Size]]]]] = []
        self.classes: list[type] = []
        pin = self.device.type == "cuda"
        for index, block in enumerate(self.blocks):
            frozen = [p for p in block.parameters() if not p.requires_grad] + list(block.buffers())
            self.layout.append(_flat_layout(frozen, pin))
            self.classes.append(type(block))
            block.__class__ = _swapped_class(type(block))
            block._weight_swap = (self, index)  # a plain attribute (not a module): no state-dict key
            self._drop(index)

    @property
    def host_bytes(self) -> int:
        return sum(host.numel() * host.element_size() for groups in self.layout for host, _ in groups)

    def held_elements(self, index: int) -> int:
        """Elements block `index`'s frozen tensors hold on the device now (0 while dropped)."""
        return sum(t.numel() for _, members in self.layout[index] for t, _, _ in members)

    def arrive(self, index: int) -> None:
        """Block `index` is about to run: its weights onto the device, dropping the least recently run block's."""
        if index in self.resident:
            self.resident.remove(index)
            self.resident.append(index)
            return
        while len(self.resident) >= self.slots:
            self._drop(self.resident.pop(0))  # first: the memory is free for the copy in
        flats = [host.to(self.device, non_blocking=True, copy=True) for host, _ in self.layout[index]]
        self._assign(index, flats)
        self.resident.append(index)
        self.uploads += 1

    def _assign(self, index: int, flats: list[torch.Tensor]) -> None:
        for flat, (_, members) in zip(flats, self.layout[index]):
            for t, offset, shape in members:
                t.data = flat[offset:offset + shape.numel()].view(shape)

    def _drop(self, index: int) -> None:
        for _, members in self.layout[index]:
            for t, _, _ in members:
                t.data = torch.empty(0, dtype=t.dtype, device=self.device)

    def restore(self) -> None:
        """Every block with its own class and its weights again (in-process callers get a normal model back): on
        the device when they fit there, else all of them in host memory (a card that needed the swap to train may
        not hold the whole model beside what the run still holds; the run's files are written by then)."""
        self.resident = []
        try:
            self._restore_to(self.device)
        except torch.OutOfMemoryError:
            self._restore_to(torch.device("cpu"))
        for index, block in enumerate(self.blocks):
            block.__class__ = self.classes[index]
            del block._weight_swap
        for block, cls in self.others:
            block.__class__ = cls
            del block._weight_swap

    def _restore_to(self, device: torch.device) -> None:
        for index, groups in enumerate(self.layout):
            self._assign(index, [host.to(device, copy=True) for host, _ in groups])


def _flat_layout(tensors: list[torch.Tensor],
                 pin: bool) -> list[tuple[torch.Tensor, list[tuple[torch.Tensor, int, torch.Size]]]]:
    """The tensors grouped by dtype, each group's values in one flat host buffer (pinned when `pin`): one copy per
    dtype moves a whole block, instead of one small copy per tensor."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    layout = []
    for dtype, members in groups.items():
        align = max(1, ALIGN_BYTES // dtype.itemsize)
        offsets, at = [], 0
        for t in members:
            offsets.append((t, at, t.shape))
            at += -(-t.numel() // align) * align
        host = torch.zeros(at, dtype=dtype)
        for t, offset, shape in offsets:
            host[offset:offset + t.numel()] = t.detach().reshape(-1).to("cpu")
        layout.append((host.pin_memory() if pin else host, offsets))
    return layout


_SWAPPED_CLASSES: dict[type, type] = {}


def _swapped_class(cls: type) -> type:
    """`cls` with a __call__ that brings the block's weights in first (one subclass per block class)."""
    if cls not in _SWAPPED_CLASSES:
        def __call__(self, *args, **kwargs):
            if self._weight_swap is not None:  # None: a resident block of a trunk that swaps (WeightSwap.others)
                swap, index = self._weight_swap
                swap.arrive(index)
            return torch.nn.Module.__call__(self, *args, **kwargs)

        _SWAPPED_CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _SWAPPED_CLASSES[cls]
