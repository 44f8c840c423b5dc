"""The memory plan: how many DiT blocks keep their activations, whether the parked Qwen3 stays on the GPU, and the
step's predicted peak, from what one all-checkpointed step holds.

One object for its two users: the run, after its first optimizer step measured that step (`memory.plan_checkpointing`,
checkpoint_blocks = "auto"), and `anima-train plan`, before any step, from the static prediction of the same
quantities (training/plan.py). Both give a `StepMemory` and a `Budget` to `plan_memory`; the arithmetic lives here
only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

GIB = 2**30
# Left free under the budget: allocator fragmentation, cuDNN/cuBLAS workspaces, the loss and the output tensors.
MARGIN_FRACTION = 0.08
MARGIN_BYTES = 1 * GIB
# With expandable segments the allocator reserved 0.36-0.46 GiB over the allocated peak (H200, LoRA b2/b4 under
# 8 and 12 GiB caps; fixed segments: 1.25 GiB): a smaller margin holds.
EXPANDABLE_MARGIN_FRACTION = 0.05
EXPANDABLE_MARGIN_BYTES = GIB // 2
# recompute = "graph": what its backward holds while it recomputes beyond whole-block recompute, in blocks'
# activations (H200, LoRA r32, every block or all but one recomputed: +0.27 GiB at b2 for 0.706 per block, +0.63 at
# b4 for 1.41, caps_2026-12-02b C1 and C2; +1.14 at b8 for 2.82, recompute_graph_2026-12-04 B2). Never on top of
# the kept blocks': the kept ones are the last, and their backward frees theirs before the first in-graph block
# recomputes (B1, three kept at 24 GiB b8: 19.29 GiB = the all-recomputed step + 2 blocks, no extra).
IN_GRAPH_EXTRA = 0.5


def margin(budget: int, expandable: bool) -> int:
    """Bytes left free under the budget."""
    if expandable:
        return max(int(budget * EXPANDABLE_MARGIN_FRACTION), EXPANDABLE_MARGIN_BYTES)
    return max(int(budget * MARGIN_FRACTION), MARGIN_BYTES)


@dataclass(frozen=True)
class Budget:
    """What the process may use (bytes: the card, its per-process fraction, what others leave free) and whether the
    allocator grows its segments in place (memory.expandable_segments_on), which sets the margin kept free."""
    total: int
    expandable: bool = False

    @property
    def usable(self) -> int:
        return self.total - margin(self.total, self.expandable)


@dataclass(frozen=True)
class StepMemory:
    """What the first step held with every block recomputed but the last (which adds nothing to its peak), in
    bytes: `act` = the activations one block keeps for its backward, `start` = allocated before the step, `peak` =
    its peak, `backward_peak` = its peak before the optimizer step, `steady` = allocated after it; `scale` = the
    largest batch's tokens x batch over the measured step's (activations and the step's growth scale with it).
    `start` and `backward_peak` are None off CUDA. `in_graph`: that step recomputed inside the compiled graph, so
    its peak holds what that backward holds beyond whole-block recompute; `kept_peak`: its peak before the first
    block recomputed there (the forward and the kept block's backward: the part of the step that more kept blocks
    grow), None where not measured."""
    act: int
    peak: int
    steady: int
    start: int | None = None
    backward_peak: int | None = None
    scale: float = 1.0
    in_graph: bool = False
    kept_peak: int | None = None

    @property
    def per_block(self) -> int:
        """One kept block's activations at the largest batch."""
        return max(int(self.act * self.scale), 1)

    def plus(self, held: int) -> StepMemory:
        """The same step with `held` more bytes alive throughout (the parked Qwen3 kept on the GPU)."""
        more = {name: getattr(self, name) + held for name in ("start", "backward_peak", "kept_peak")
                if getattr(self, name) is not None}
        return replace(self, peak=self.peak + held, steady=self.steady + held, **more)

    def base(self) -> int:
        """The peak of a later step with every block recomputed, at the largest batch.

        The first step grew from `start` to `peak`; it ends at `steady`, which holds what that step allocated for
        good after its peak (AdamW's state: 0.34 GiB for a LoRA r32, made by the first optimizer step). Every later
        step starts from `steady` and grows as much, so its peak is steady + (peak - start), not the first step's
        peak: at 8 GiB b2 on the H200 the first step peaked at 6.27 GiB (4.15 before it, 4.56 after) and the next
        ones at 6.6-6.68. The growth is activations and gradients: it scales with tokens x batch. Without a start
        the steady memory stands in for it.

        That holds while the peak is in the backward (a LoRA: its optimizer state is small). A full finetune's first
        step peaks in its optimizer step instead, where the new optimizer state and the gradients are alive
        together; the state is then in `steady` as well, so steady + (peak - start) counts it twice (an H200 under
        24 GiB, full finetune b4 with 8-bit state: predicted 22.8 GiB with 27 of 28 blocks recomputed, measured
        17.24). Given the peak before the optimizer step (`backward_peak`, lower than `peak` then), a later step
        peaks at the larger of its backward, steady + (backward_peak - start) scaled, and its optimizer step, which
        holds what the first one held (the state, now old, the gradients, the same temporaries: none of it grows
        with tokens)."""
        return self._later(self.peak if self._peaked_in_backward else self.backward_peak)

    @property
    def _peaked_in_backward(self) -> bool:
        return self.backward_peak is None or self.backward_peak >= self.peak

    def kept_base(self) -> int:
        """base() for the part of a later step that kept blocks grow: up to the first in-graph recompute, whose
        extra the measured peak holds (`kept_peak`). Without that reading, base()."""
        return self.base() if self.kept_peak is None else min(self._later(self.kept_peak), self.base())

    def _later(self, backward: int) -> int:
        """A later step's peak, where the measured step's forward and backward peaked at `backward` (base())."""
        start = self.steady if self.start is None else self.start
        grown = self.steady + int(max(backward - start, 0) * self.scale)
        return grown if self._peaked_in_backward else max(grown, self.peak)

    def in_graph_extra(self) -> int:
        """recompute = "graph": bytes its recomputing backward holds at the step's peak beyond whole-block
        recompute, where the measured peak lacks them. A step measured in the graph holds them already; a whole-block
        plan made from it keeps that measured peak as its floor, since what whole blocks would save is an estimate
        and the measured peak is not."""
        return 0 if self.in_graph else int(IN_GRAPH_EXTRA * self.per_block)

    def peak_keeping(self, keep: int, in_graph: bool = False) -> int:
        """The step's peak with the last `keep` blocks keeping their activations. The all-checkpointed peak comes in
        the backward of the last block, while its recomputed activations are alive, so keeping that block's
        activations (the kept blocks are the last ones) adds nothing to it; each further kept block adds its
        activations (all kept ones are alive when backward starts). `in_graph`: some block recomputes inside the
        compiled graph, whose backward holds in_graph_extra() more, but only after the kept blocks' backward has
        freed theirs: the peak is the larger of the two, not their sum."""
        return max(self.kept_base() + max(keep - 1, 0) * self.per_block, self.recomputing_peak(in_graph))

    def recomputing_peak(self, in_graph: bool = False) -> int:
        """The peak while the recomputed blocks run their backward: the all-recomputed step's, plus the in-graph
        backward's extra where they recompute in the graph."""
        return self.base() + (self.in_graph_extra() if in_graph else 0)

    def fits(self, budget: Budget, extra: int = 0) -> bool:
        """The all-checkpointed step, plus `extra` bytes at its peak, fits under the budget (with the margin)."""
        return self.base() + extra <= budget.usable

    def most_kept(self, n_blocks: int, budget: Budget, in_graph: bool = False) -> int:
        """How many of `n_blocks` may keep their activations: the most whose peak fits (0 when none does).
        Measured on an H200, 1024x1024 LoRA r32 (tests/test_checkpointing.py, H200_RUNS): with the first step's
        growth charged, the predicted peak is 0.05-0.13 GiB above every measured one. `in_graph` (recompute =
        "graph"): while any block recomputes, the in-graph blocks' backward must fit too (peak_keeping); with every
        block kept nothing recomputes."""
        kept = self.kept_base()
        keep = min(n_blocks, 1 + math.floor((budget.usable - kept) / self.per_block)) if kept <= budget.usable else 0
        if keep < n_blocks and self.recomputing_peak(in_graph) > budget.usable:
            return 0  # the recomputing blocks' backward does not fit
        return keep


@dataclass(frozen=True)
class MemoryPlan:
    """The plan: `keep` blocks keep their activations (the rest recompute), the parked Qwen3 stays on the GPU
    (`resident`), recompute = "graph" stays in the compiled graph (`in_graph`), and the step's predicted peak."""
    keep: int
    predicted: int
    resident: bool
    in_graph: bool
    usable: int

    @property
    def fits(self) -> bool:
        return self.predicted <= self.usable


def plan_memory(step: StepMemory, budget: Budget, *, n_blocks: int, parked_bytes: int = 0, in_graph: bool = False,
                keep: int | None = None) -> MemoryPlan:
    """The plan for `n_blocks` blocks that may keep their activations (the swapped ones are not among them: they
    always recompute whole). `keep` None: decide ("auto"); a number: that many keep (a fixed checkpoint_blocks,
    for which the runtime makes no plan and Qwen3 stays parked). `parked_bytes`: the parked Qwen3's weights (0:
    nothing parks); `in_graph`: recompute = "graph" is on.

    Deciding, the in-graph recompute comes first: it is kept if every block recomputing that way fits (else the
    blocks recompute whole: that fits where it does not). Then Qwen3 goes on the GPU if that all-recomputed step
    fits beside it (memory.plan_checkpointing says why it comes first);
    then the blocks share what is left."""
    if keep is not None:
        in_graph = in_graph and keep < n_blocks
        return MemoryPlan(keep=keep, predicted=step.peak_keeping(keep, in_graph), resident=False, in_graph=in_graph,
                          usable=budget.usable)
    in_graph = in_graph and step.fits(budget, step.in_graph_extra())
    resident = parked_bytes > 0 and step.plus(parked_bytes).fits(budget, step.in_graph_extra() if in_graph else 0)
    if resident:
        step = step.plus(parked_bytes)
    keep = step.most_kept(n_blocks, budget, in_graph)
    if keep == 0 and step.base() > budget.usable:  # nothing fits: the all-recomputed peak, said as it is
        return MemoryPlan(keep=0, predicted=step.base(), resident=resident, in_graph=in_graph, usable=budget.usable)
    return MemoryPlan(keep=keep, predicted=step.peak_keeping(keep, in_graph and keep < n_blocks), resident=resident,
                      in_graph=in_graph, usable=budget.usable)
