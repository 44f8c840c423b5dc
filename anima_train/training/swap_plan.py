"""`[train] swap_blocks = "auto"` in a run: how many DiT blocks keep their frozen weights in host memory
(training/weight_swap.py), decided before the model loads.

The checkpoint plan (`checkpoint_blocks = "auto"`, training/memory.py) measures the first step; the swap cannot
wait for it. The weights go to the device as the model loads, and on a card too small for them (6 GiB: the 2B's
3.98 GiB of bf16 weights, the first step's 2 GiB and the margin) that first step would run out of memory before
any measurement. So the count comes from the static plan of `anima-train plan` (training/plan.py: the config, the
model's config.json files, the card's memory now), with the largest batch the dataset really holds: the fewest
blocks with which the all-recomputed step fits, every block where none does (the most the run can save; it says
so), none off CUDA or where no block can swap (a full finetune, a quantized base, no checkpointing, a whole-trunk
compile). After the first step the checkpoint plan refines the rest from its measurement, the swapped blocks
recomputing whatever it decides.

Exact: a swapped block computes from a bit-exact copy of its weights and always recomputes, so the count changes
where the weights wait, never a number (tests/test_swap_plan.py)."""

from __future__ import annotations

import torch

from anima_train import fixes
from anima_train.config.schema import Config
from anima_train.model.shape import declared_shape
from anima_train.outputs.progress import SWAP_PREFIX
from anima_train.training import memory, plan, recompute
from anima_train.training.memory_plan import GIB


def card_budget(device: torch.device) -> int | None:
    """Bytes this process may use on `device` now (recompute.memory_now: the card, its per-process fraction, less
    what other programs hold); None off CUDA."""
    if device.type != "cuda":
        return None
    return recompute.memory_now(device)[2]


def static_plan(cfg: Config, device: torch.device, *, largest_tokens: int, compiled: bool,
                whole_trunk_compiled: bool) -> plan.Plan | None:
    """This run's plan as `anima-train plan` makes it for this card (its memory now, the dataset's largest batch),
    before the model loads, where a decision that cannot wait for the first step's measurement asks for it; None off
    CUDA and where none does. Those decisions: swap_blocks = "auto" (blocks_to_swap), and with checkpoint_blocks =
    "auto" and the in-graph recompute on, how the measured first step recomputes (`Plan.in_graph`: in the graph where
    the plan recomputes some block there; whole where it keeps every block, since a whole block's recompute runs the
    kept blocks' graph, or where the graph's extra would not fit), so that step compiles what the run goes on with
    (recompute.py)."""
    t = cfg.train
    auto_swap = t.swap_blocks == "auto"
    first_step_asks = recompute.parse_setting(t.gradient_checkpointing, t.checkpoint_blocks, 1, device) is None \
        and recompute.in_graph_applies(t, compiled)
    budget = card_budget(device)
    if budget is None or not (auto_swap or first_step_asks):
        return None
    return plan.make_plan(cfg, budget, memory.expandable_segments_on(), look_for_swap=False,
                          shape=declared_shape(t.model_path), largest=(largest_tokens, largest_batch(cfg)),
                          whole_trunk_compiled=whole_trunk_compiled, look_for_batch=auto_swap)


def blocks_to_swap(cfg: Config, chosen: plan.Plan | None, *, whole_trunk_compiled: bool, say, warn) -> int:
    """The swapped blocks' count for this run: the config's number, or under "auto" the static plan's choice
    (said in one line, and a warning when even that is predicted not to fit)."""
    if not isinstance(cfg.train.swap_blocks, str):
        return cfg.train.swap_blocks
    if chosen is None:  # off CUDA there is no card to fit
        return 0
    # where no block can swap, no prediction is said either (it counts a quantized base unquantized)
    if why := plan.swap_unavailable(cfg, whole_trunk_compiled):
        say(f"{SWAP_PREFIX} none (no block can swap: {why})")
        return 0
    count, gib = chosen.inputs.swapped, GIB
    peak = f"predicted peak {plan.peak_text(chosen)}"
    if count == 0:
        say(f"{SWAP_PREFIX} none: the model fits on the GPU ({peak})")
    else:
        say(f"{SWAP_PREFIX} {count} of {chosen.n_blocks} blocks swapped, the fewest with which the step fits "
            f"({chosen.inputs.host_bytes / gib:.2f} GiB of frozen weights in host memory; {peak})"
            if chosen.fits else f"{SWAP_PREFIX} every block swapped ({chosen.n_blocks}), and still {peak}")
    if not chosen.fits:
        warn(f"the step is predicted not to fit this card ({peak}); "
             + (f"a smaller batch would: {plan.batch_fix_text(chosen)}" if chosen.batch_fix is not None
                else "lower [train] batch_size or [dataset] resolution")
             + fixes.ref("run plan", "; `anima-train plan CONFIG --vram GiB` shows the whole plan"))
    return count


def largest_batch(cfg: Config) -> int:
    batch_sizes = cfg.train.batch_size
    return batch_sizes if isinstance(batch_sizes, int) else max(batch_sizes.values())
