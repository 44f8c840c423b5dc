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
- the copies run on the compute stream, in order, so the caching allocator may reuse a dropped block's memory only
  after every kernel that read it. The cost: the copy does not overlap compute (a block of Anima is 0.14 GiB in
  bf16, about 6 ms over PCIe 4.0 x16, twice per step with its recompute).

The block's class is replaced by a subclass whose __call__ copies the weights in and then calls nn.Module.__call__:
a regional torch.compile (`module.compile()`, compiling.compile_transformer) sits inside that call, so the swap
stays out of the compiled graph, and state-dict keys do not change. `restore()` puts the weights back for good.
"""

from __future__ import annotations

import torch

from anima_train.training.memory import host_copy

RESIDENT_SLOTS = 1  # swapped blocks on the GPU at once: the one running (the copy does not overlap compute)


class WeightSwap:
    """The frozen weights of `blocks` in host memory, on the device only while their block runs."""

    def __init__(self, blocks: list[torch.nn.Module], device: torch.device, slots: int = RESIDENT_SLOTS):
        self.device, self.slots = torch.device(device), max(1, slots)
        self.blocks = list(blocks)
        self.uploads = 0  # blocks copied in so far (the tests read it)
        self.resident: list[int] = []  # indices into self.blocks, the least recently called first
        self.tensors: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per block: (parameter or buffer, host copy)
        self.classes: list[type] = []
        pin = self.device.type == "cuda"
        for index, block in enumerate(self.blocks):
            frozen = [p for p in block.parameters() if not p.requires_grad] + list(block.buffers())
            self.tensors.append([(t, host_copy(t, pin)) for t in frozen])
            self.classes.append(type(block))
            block.__class__ = _swapped_class(type(block))
            block._weight_swap = (self, index)  # a plain attribute (not a module): no state-dict key
            self._drop(index)

    @property
    def host_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for pairs in self.tensors for _, h in pairs)

    def arrive(self, index: int) -> None:
        """Block `index` is about to run: its weights onto the device, dropping the least recently run block's."""
        if index in self.resident:
            self.resident.remove(index)
            self.resident.append(index)
            return
        while len(self.resident) >= self.slots:
            self._drop(self.resident.pop(0))  # first: the memory is free for the copy in
        for t, host in self.tensors[index]:
            t.data = host.to(self.device, non_blocking=True)
        self.resident.append(index)
        self.uploads += 1

    def _drop(self, index: int) -> None:
        for t, _ in self.tensors[index]:
            t.data = torch.empty(0, dtype=t.dtype, device=self.device)

    def restore(self) -> None:
        """Every block resident again, with its own class (in-process callers get a normal model back)."""
        for index, block in enumerate(self.blocks):
            for t, host in self.tensors[index]:
                t.data = host.to(self.device)
            block.__class__ = self.classes[index]
            del block._weight_swap
        self.resident = []


_SWAPPED_CLASSES: dict[type, type] = {}


def _swapped_class(cls: type) -> type:
    """`cls` with a __call__ that brings the block's weights in first (one subclass per block class)."""
    if cls not in _SWAPPED_CLASSES:
        def __call__(self, *args, **kwargs):
            swap, index = self._weight_swap
            swap.arrive(index)
            return torch.nn.Module.__call__(self, *args, **kwargs)

        _SWAPPED_CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _SWAPPED_CLASSES[cls]
