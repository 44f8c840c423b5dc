"""Gradient checkpointing per DiT block: recompute only as many blocks as the card's memory needs.

Recomputing a block's forward in backward costs about a third of its step time; keeping its activations costs
memory that grows with tokens x batch (a 1024x1024 image at batch 8 holds ~2.7 GiB per Anima block). The seed
checkpoints all 28 blocks or none. Here `train.checkpoint_blocks` picks how many:

- an integer k: the first k blocks recompute, the rest keep their activations;
- "all": every block (the seed's `gradient_checkpointing = true`);
- "auto" (default): on CUDA, the fewest that fit. The first optimizer step runs with every block but the last
  recomputed and measures, with the real shapes, dtype, adapter and compile mode: the activations the last (kept)
  block holds for its backward, the memory allocated before the step, the step's peak and the steady memory after
  the step (weights, gradients' end state, optimizer state). From then on the memory plan (training/memory_plan.py)
  decides. Keeping the last block adds nothing to that step's peak (memory_plan.StepMemory.peak_keeping). Off CUDA,
  "all".

How a block recomputes is `train.recompute`:

- "block" (torch.utils.checkpoint): the backward re-runs the block's whole forward, the same compiled graph when
  compiled. Which blocks recompute never changes the numbers: losses and weights are identical to the
  all-checkpointed run, and resume stays bit-exact.
- "graph" (the default; compiled runs): the block runs through a second compiled graph of it, partitioned with
  torch.compile's `activation_memory_budget` = 0, whose backward recomputes inside itself only what the gradients
  need, fused with the backward kernels, instead of torch.utils.checkpoint re-running every kernel of the forward
  through Python. On an H200 under 8 GiB (LoRA r32 b2, 1024x1024, one call) the step ran 0.1538 s/image against
  0.188 (bench/results/recompute_graph_2026-12-04). Its backward holds more while it recomputes
  (memory_plan.IN_GRAPH_EXTRA). That graph is cut elsewhere than the kept blocks' graph, and its fused kernels would
  round bf16 results at other places (the losses moved by up to 0.0012 over those 12 steps); compiled runs emulate
  eager's casts (compiling.round_like_eager), and the two train to the same bits on the tiny model
  (tests/test_checkpointing.py; on an H200 the losses within 2e-5 to 6e-5). Swapped blocks (training/weight_swap.py)
  still use torch.utils.checkpoint. Eager runs and a whole-trunk compile (compile_regional = false) have no compiled
  block to swap in: there "graph" is "block".

The first step of "auto" recomputes the way the run will go on (`Measure.in_graph`, from the static plan of
training/plan.py), so it compiles the graphs the later steps run and no step after it compiles again: in the graph
where the static plan recomputes some block there, whole otherwise. A whole block's recompute runs the block's own
compiled graph, the one a kept block runs, once the backward's thread counts threads as the forward's does
(BlockCheckpointing.threads). Where the measured plan disagrees with the static one, the next step compiles what it
switches to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch._functorch.config as functorch_config
from torch.utils.checkpoint import checkpoint

# recompute = "graph": the share of what a kept block saves for its backward (above its inputs) that an in-graph
# block saves too, torch's activation_memory_budget: 0 saves the inputs only; between 0 and 1 the partitioner keeps
# the results that cost the most FLOPs to recompute per byte (attention, the GEMMs) and recomputes the rest. 0: for
# the same memory a share spread over every block ran hardly faster than whole kept blocks (docs/training.md, "How a
# block recomputes"), and a planned share would compile another graph after the measured first step. A module
# constant so that a benchmark can set it (bench_train_gpu.py --torch-set).
IN_GRAPH_BUDGET = 0.0

@dataclass
class Measure:
    """What the first step saw (bytes). `act` = activations one block keeps for backward at that step's shape."""
    tokens: int  # tokens x batch of the measured step
    act: int = 0
    peak: int = 0
    steady: int = 0
    start: int | None = None  # allocated when the step began (its first micro-batch); None off CUDA
    backward_peak: int | None = None  # the step's peak before its optimizer step; None off CUDA
    in_graph: bool = False  # the measured step's blocks recompute inside the compiled graph (its peak holds that)
    kept_peak: int | None = None  # in the graph: the peak before its first recompute; None off CUDA

    def recompute_starts(self, device: torch.device) -> None:
        """The kept block's backward is done and the first in-graph block's begins: the peak so far is what more
        kept blocks would grow (memory_plan.StepMemory.kept_base). The first micro-batch's reading: later ones
        start after a whole backward with its in-graph extra."""
        if self.kept_peak is None and device.type == "cuda":
            self.kept_peak = torch.cuda.max_memory_allocated(device)

    def before_optimizer_step(self, device: torch.device) -> None:
        """The gradients are complete: the peak so far is the forward/backward's (see memory_plan.StepMemory.base)."""
        if device.type == "cuda":
            self.backward_peak = torch.cuda.max_memory_allocated(device)

    def saw(self, tokens: int, device: torch.device) -> None:
        """A micro-batch of the measured step starts: its tokens x batch, and (the first time) the memory allocated
        before it."""
        self.tokens = max(self.tokens, tokens)
        if self.start is None and device.type == "cuda":
            self.start = torch.cuda.memory_allocated(device)


@dataclass
class BlockCheckpointing:
    """The transformer's gradient-checkpointing function (diffusers calls it as `func(block, *args)`): blocks in
    `recompute` recompute (through `in_graph` where set, else torch.utils.checkpoint), the others run directly."""
    blocks: list
    recompute: set = field(default_factory=set)  # ids of the blocks that recompute
    measure: Measure | None = None
    retries: int | None = None  # the allocator's retry count when the auto plan was made (then watched)
    floor: int = 0  # blocks that recompute whatever the plan says (the swapped ones: training/weight_swap.py)
    in_graph: Callable | None = None  # recompute = "graph": in_graph_recompute(); None = torch.utils.checkpoint
    # Dynamo guards each compiled graph on torch.get_num_threads(). torch.utils.checkpoint recomputes a block on
    # autograd's device thread, whose count is taken from the process-wide one when the thread first asks, and the
    # DataLoader's pin-memory thread has set that to 1 by then: the main thread forwards with its own (16 on an
    # H100 host), so every recompute failed the guard and compiled the block twice more (2 of the first step's 4
    # block graphs, bench/results/first_step_2026-12-06). The recompute runs with the forward's count.
    threads: int = field(default_factory=torch.get_num_threads)
    # Compiled runs: the first block's input asks for its gradient, as every later block's input does. Dynamo
    # guards on requires_grad, so the first block had a graph of its own, for each way a block runs (kept, in the
    # graph): one more compile each, ~25 s cold at 1024² b8 on an H100 (bench/results/first_step_2026-12-06). The
    # cost: that input's gradient, the first block's three projections run backward once more (~0.3 % of a step
    # by their FLOPs; not timed).
    uniform_inputs: bool = False

    def __call__(self, block, *args):
        if self.uniform_inputs and not args[0].requires_grad:
            args = (args[0].detach().requires_grad_(),) + args[1:]
        if id(block) not in self.recompute:
            return block(*args) if self.measure is None else self._kept_and_measured(block, *args)
        if self.in_graph is not None and block not in self.blocks[:self.floor] \
                and (self.measure is None or self.measure.in_graph):
            out = self.in_graph(block, *args)
            if self.measure is not None and out.requires_grad and block is self._last_recomputed():
                # its output's gradient is ready when the kept block's backward ends, before this block's begins
                measure = self.measure
                out.register_hook(lambda grad: measure.recompute_starts(grad.device))
            return out
        return checkpoint(self._whole, block, *args, use_reentrant=False)

    def _whole(self, block, *args):
        if torch.get_num_threads() != self.threads:  # the backward's recompute (see `threads`)
            torch.set_num_threads(self.threads)
        return block(*args)

    def _kept_and_measured(self, block, *args):
        # The measured step's kept block: what its forward leaves allocated is what it holds for its backward (and
        # its output, which the next block keeps as its input either way), as the compiled graph saves it. Its
        # forward runs outside any compiled region (the blocks are compiled one by one), so the reading is exact.
        before = torch.cuda.memory_allocated()
        out = block(*args)
        self.measure.act = max(self.measure.act, torch.cuda.memory_allocated() - before)
        return out

    def _last_recomputed(self):
        return next(b for b in reversed(self.blocks) if id(b) in self.recompute)

    def set_recomputed(self, count: int) -> None:
        """The first `count` blocks recompute (which ones does not matter for memory: all are alike), and never
        fewer than `floor`."""
        self.recompute = {id(b) for b in self.blocks[:max(count, self.floor)]}

    @property
    def recomputed(self) -> int:
        return sum(id(b) in self.recompute for b in self.blocks)


def in_graph_applies(train, compiled: bool) -> bool:
    """recompute = "graph" takes effect: the run compiles (`compiled`) its blocks one by one (compile_regional);
    eager runs and a whole-trunk compile have no compiled block to swap in and recompute whole blocks."""
    return train.recompute == "graph" and compiled and train.compile_regional


def _block_forward(block, *args):
    # not block(): its own compiled call would nest a compile in this one (and a block's hooks would run: only a
    # swapped block has any, and it never comes here)
    return block.forward(*args)


def in_graph_recompute(mode: str, dynamic: bool | None) -> Callable:
    """recompute = "graph": a function (block, *args) -> block's output through a compiled graph of the block that
    saves nothing but its inputs for the backward and recomputes the rest inside the backward graph. One graph
    serves every block (their parameters are its inputs); the budget is read when the graph is partitioned, on
    its first call and on each recompile."""
    compiled = torch.compile(_block_forward, mode=mode, dynamic=dynamic)

    def run(block, *args):
        with functorch_config.patch(activation_memory_budget=IN_GRAPH_BUDGET):
            return compiled(block, *args)

    return run


def parse_setting(gradient_checkpointing: bool, checkpoint_blocks: int | str, n_blocks: int,
                  device: torch.device) -> int | None:
    """Blocks to recompute from the config: a count, or None for "auto" (decided after the first step)."""
    if not gradient_checkpointing:
        return 0
    if checkpoint_blocks == "all":
        return n_blocks
    if checkpoint_blocks == "auto":
        return None if device.type == "cuda" else n_blocks
    return min(int(checkpoint_blocks), n_blocks)


def memory_now(device: torch.device) -> tuple[int, int, int]:
    """(allocated now, peak so far, budget) in bytes. The budget is what this process may use: the card (or the
    per-process fraction set on it), and no more than is free now plus what it holds already (ComfyUI or another
    program may hold part of the card)."""
    index = device.index if device.index is not None else torch.cuda.current_device()  # "cuda" has no index
    free, total = torch.cuda.mem_get_info(index)
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.9
    fraction = get_fraction(index) if get_fraction is not None else 1.0
    budget = min(int(total * fraction), free + torch.cuda.memory_reserved(index))
    return torch.cuda.memory_allocated(index), torch.cuda.max_memory_allocated(index), budget
