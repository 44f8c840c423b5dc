"""Per-block gradient checkpointing (`train.checkpoint_blocks`) and the compile = "auto" choice."""

from __future__ import annotations

import pytest
import torch

from anima_train.training import memory_plan, recompute
from anima_train.training.memory_plan import GIB, Budget, StepMemory, plan_memory
from anima_train.training.compiling import COMPILE_MIN_STEPS, resolve_compile
from anima_train.training.train import train
from tests.test_train import make_cfg

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _count_recomputes(monkeypatch) -> list:
    calls = []
    real = recompute.checkpoint

    def counting(fn, *args, **kw):
        calls.append(fn)
        return real(fn, *args, **kw)

    monkeypatch.setattr(recompute, "checkpoint", counting)
    return calls


def test_recomputing_some_blocks_changes_no_number(tiny_anima, latents_dir, tmp_path, monkeypatch):
    """0, 1 and all blocks recomputed train to the same bits, and exactly the asked number of blocks goes through
    torch.utils.checkpoint in each forward."""
    calls = _count_recomputes(monkeypatch)
    n_blocks = None
    runs = {}
    for setting in ("0", "1", '"all"'):
        calls.clear()
        result = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / setting.strip('"'), max_steps=3,
                                gradient_checkpointing="true", checkpoint_blocks=setting), cpu=True, no_save=True)
        n_blocks = len(result.components.transformer.transformer_blocks)
        runs[setting] = (result.losses, result.trainable_digest, len(calls))
    assert n_blocks >= 2
    assert runs["0"][2] == 0 and runs["1"][2] == 3 and runs['"all"'][2] == 3 * n_blocks  # 3 forwards each
    assert runs["0"][:2] == runs["1"][:2] == runs['"all"'][:2]


def test_gradient_checkpointing_false_wins_over_checkpoint_blocks(tiny_anima, latents_dir, tmp_path, monkeypatch):
    calls = _count_recomputes(monkeypatch)
    train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, max_steps=1, gradient_checkpointing="false",
                   checkpoint_blocks='"all"'), cpu=True, no_save=True)
    assert calls == []


def test_auto_recomputes_every_block_off_cuda():
    assert recompute.parse_setting(True, "auto", 28, CPU) == 28
    assert recompute.parse_setting(True, "auto", 28, CUDA) is None  # measured on the first step
    assert recompute.parse_setting(True, 40, 28, CUDA) == 28
    assert recompute.parse_setting(False, "all", 28, CUDA) == 0


def plan_unchecked(*, n_blocks, act, peak, steady, scale, budget, start=None, expandable=False):
    """(blocks kept, predicted peak) of the memory plan without Qwen3 and whole-block recompute."""
    plan = plan_memory(StepMemory(act=act, peak=peak, steady=steady, start=start, scale=scale),
                       Budget(budget, expandable), n_blocks=n_blocks)
    return plan.keep, plan.predicted


def usable_of(budget: int) -> int:
    return budget - max(int(budget * memory_plan.MARGIN_FRACTION), memory_plan.MARGIN_BYTES)


def test_plan_keeps_as_many_blocks_as_fit():
    # 24 GiB card: 5.5 GiB allocated before the first step, its peak 10 GiB, steady 6 GiB after it (the optimizer
    # state came in its optimizer step), a block keeps 1 GiB at the measured batch: a later step with every block
    # recomputed peaks at 6 + (10 - 5.5) = 10.5 GiB. The last kept block adds nothing (the all-checkpointed peak
    # already holds one block's recomputed activations, in the backward of the last block), each further one 1 GiB.
    keep, peak = plan_unchecked(n_blocks=28, act=1 * GIB, peak=10 * GIB, steady=6 * GIB, scale=1.0, budget=24 * GIB,
                                start=int(5.5 * GIB))
    usable = usable_of(24 * GIB)
    assert keep == 1 + (usable - int(10.5 * GIB)) // GIB and peak == int(10.5 * GIB) + (keep - 1) * GIB
    assert peak <= usable < peak + GIB
    # a batch twice as large somewhere in the epoch: the step's growth and block activations double
    keep2, peak2 = plan_unchecked(n_blocks=28, act=1 * GIB, peak=10 * GIB, steady=6 * GIB, scale=2.0,
                                  budget=24 * GIB, start=int(5.5 * GIB))
    assert peak2 <= usable and keep2 == 1 + (usable - 15 * GIB) // (2 * GIB)
    # a large card keeps them all; a card already full keeps none
    assert plan_unchecked(n_blocks=28, act=GIB, peak=10 * GIB, steady=6 * GIB, scale=1.0, budget=140 * GIB)[0] == 28
    assert plan_unchecked(n_blocks=28, act=GIB, peak=23 * GIB, steady=6 * GIB, scale=1.0, budget=24 * GIB)[0] == 0


def test_plan_keeps_the_last_block_when_the_all_checkpointed_step_fits():
    assert plan_unchecked(n_blocks=28, act=2 * GIB, peak=10 * GIB, steady=6 * GIB, scale=1.0,
                          budget=12 * GIB) == (1, 10 * GIB)
    assert plan_unchecked(n_blocks=28, act=2 * GIB, peak=int(11.5 * GIB), steady=6 * GIB, scale=1.0,
                          budget=12 * GIB)[0] == 0


def test_compile_auto_only_where_it_pays(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real(name, *a))
    assert resolve_compile("auto", CUDA, COMPILE_MIN_STEPS) == "default"
    assert resolve_compile("auto", CUDA, COMPILE_MIN_STEPS - 1) is None  # compiling would cost more than it saves
    assert resolve_compile("auto", CPU, 10**6) is None
    assert resolve_compile("off", CUDA, 10**6) is None
    assert resolve_compile("max-autotune", CPU, 1) == "max-autotune"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert resolve_compile("auto", CUDA, 10**6) is None  # no Triton (e.g. Windows without triton-windows)


class StrictCuda:
    """torch.cuda's memory functions as the real ones behave on a 24 GiB card: a device index is required where
    torch requires one (a bare "cuda" device raised ValueError on the GPU once)."""

    def __init__(self, monkeypatch, *, allocated, peak, total=24 * GIB, fraction=1.0):
        def index_only(device):
            if not isinstance(device, int):
                raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
            return device

        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (index_only(d), (total - allocated, total))[1])
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d=None: (index_only(d), fraction)[1])
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: (index_only(d), allocated)[1])
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: (index_only(d), peak)[1])
        from anima_train.training import memory

        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # fixed segments unless a test says otherwise
        monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
        monkeypatch.setitem(memory._EXPANDABLE, "set", False)
        self.retries = 0  # the allocator's num_alloc_retries; a test raises it
        monkeypatch.setattr(torch.cuda, "memory_stats", lambda d=None: {"num_alloc_retries": self.retries})


class Parked:
    """The parked Qwen3 as the planner sees it: its host copy's size, and where its weights are."""

    def __init__(self, nbytes: int):
        self.host = [torch.zeros(nbytes // 4)]
        self.resident = False

    def stay_on_device(self):
        self.resident = True

    def leave_device(self):
        self.resident = False


def test_auto_plan_after_the_first_step(monkeypatch):
    """The decision the trainer makes after its first step, with torch.cuda's memory readings faked as a 24 GiB
    card (12 GiB of which a ComfyUI process holds): Qwen3 (1 GiB) kept on the GPU first, then as many blocks as the
    rest holds, and the message."""
    from anima_train.training.memory import plan_checkpointing

    StrictCuda(monkeypatch, allocated=6 * GIB, peak=10 * GIB, total=36 * GIB, fraction=2 / 3)  # cap 24 GiB
    blocks = [torch.nn.Linear(2, 2) for _ in range(28)]
    plan = recompute.BlockCheckpointing(blocks)
    plan.set_recomputed(28)
    plan.measure = recompute.Measure(tokens=4096 * 8, act=GIB, start=int(5.5 * GIB))
    said = []
    parked = Parked(GIB)
    plan_checkpointing(plan, 4096 * 8, parked, torch.device("cuda"), said.append)
    usable = usable_of(24 * GIB)
    # a later all-checkpointed step with Qwen3 resident: 6 + 1 + (10 - 5.5) = 11.5 GiB
    keep = 1 + (usable - int(11.5 * GIB)) // GIB
    assert plan.recomputed == 28 - keep and plan.measure is None and plan.retries == 0
    assert parked.resident
    assert said == [f"checkpointing auto: {28 - keep} of 28 blocks recompute (a block keeps 1.00 GiB at the largest "
                    f"batch; predicted peak {(11.5 * GIB + (keep - 1) * GIB) / GIB:.1f} of 24.0 GiB); "
                    f"Qwen3 stays on the GPU"]


def test_auto_plan_keeps_no_swapped_block_and_says_so(monkeypatch):
    """The same card with the first 20 blocks swapped ([train] swap_blocks: they always recompute): 11 blocks would
    fit, only the 8 unswapped ones keep, and the message and predicted peak are those of 20 recomputed blocks (it
    said 17 while 20 recomputed, before the floor went into the decision)."""
    from anima_train.training.memory import plan_checkpointing

    StrictCuda(monkeypatch, allocated=6 * GIB, peak=10 * GIB, total=36 * GIB, fraction=2 / 3)  # cap 24 GiB
    plan = recompute.BlockCheckpointing([torch.nn.Linear(2, 2) for _ in range(28)], floor=20)
    plan.set_recomputed(28)
    plan.measure = recompute.Measure(tokens=4096 * 8, act=GIB, start=int(5.5 * GIB))
    said = []
    plan_checkpointing(plan, 4096 * 8, Parked(GIB), torch.device("cuda"), said.append)
    assert plan.recomputed == 20
    assert said == ["checkpointing auto: 20 of 28 blocks recompute (a block keeps 1.00 GiB at the largest batch; "
                    f"predicted peak {(11.5 * GIB + 7 * GIB) / GIB:.1f} of 24.0 GiB); Qwen3 stays on the GPU"]


def test_auto_plan_at_8_gib_batch_2(monkeypatch):
    """8 GiB cap, LoRA b2 as measured on the H200 (4.15 GiB before the first step, its peak 6.27, steady 4.56 after,
    a block 0.71 GiB, Qwen3 1.11 GiB): a later step peaks at 6.68 GiB with Qwen3 parked, 7.79 with it resident.
    Fixed segments (1 GiB margin, 7 usable): Qwen3 parked, one block kept. Expandable segments (0.5 GiB margin, 7.5
    usable): Qwen3 parked, two blocks kept."""
    for expandable, recomputed in ((False, 27), (True, 26)):
        plan, parked, predicted, said = _plan_at(monkeypatch, start=4.15, peak=6.27, steady=4.56, act=0.706, cap=8,
                                                 expandable=expandable)
        assert (parked.resident, plan.recomputed) == (False, recomputed), said
        assert not said[0].endswith("Qwen3 stays on the GPU")


# Measured on the H200 (bench/results/caps_2026-12-02 and -02b, LoRA r32 1024x1024, compiled, one run each), GiB:
# allocated when the measured first step began, that step's peak (every block recomputed, Qwen3 parked), the steady
# memory after it, a block's activations, then the plan that ran (blocks kept, Qwen3 resident) and its later peak.
H200_RUNS = [
    # start, first peak, steady, act, kept, Qwen3 resident, peak measured  (cap, batch, segments, log)
    (4.20, 6.32, 4.61, 0.706, 0, False, 6.60),  # 8 GiB b2, fixed segments (call1_s1)
    (4.15, 6.21, 4.56, 0.706, 1, False, 6.55),  # 8 GiB b2, expandable (call1_s2)
    (4.16, 8.20, 4.56, 1.412, 1, False, 8.55),  # 12 GiB b4, expandable (call1_s3)
    (4.16, 8.20, 4.56, 1.412, 2, True, 11.07),  # 12 GiB b4, expandable (call2_cap12_b4_fix)
    (4.15, 6.27, 4.56, 0.706, 2, False, 7.26),  # 8 GiB b2, expandable (call2_cap8_b2_fix)
    (4.15, 6.27, 4.56, 0.706, 0, True, 7.66),  # 8 GiB b2, expandable (call4_cap8_b2_final)
    (4.16, 12.19, 4.57, 2.824, 4, True, 22.11),  # 24 GiB b8, expandable, the fixed planner's plan (-02b B3)
]
QWEN3_GIB = 1.11  # the frozen Qwen3-0.6B's weights (alloc 5.67 resident against 4.56 parked)


def _plan_at(monkeypatch, *, start, peak, steady, act, cap, expandable=True, tokens=8192, qwen=QWEN3_GIB):
    """plan_checkpointing with the memory readings of a first step (GiB) on a card of `cap` GiB; the Measure's
    start is set as the trainer records it (Measure.saw at the first micro-batch)."""
    from anima_train.training import memory
    from anima_train.training.memory import plan_checkpointing

    StrictCuda(monkeypatch, allocated=int(steady * GIB), peak=int(peak * GIB), total=int(cap * GIB))
    monkeypatch.setitem(memory._EXPANDABLE, "set", expandable)
    plan = recompute.BlockCheckpointing([torch.nn.Linear(2, 2) for _ in range(28)])
    plan.set_recomputed(28)
    plan.measure = recompute.Measure(tokens=tokens, act=int(act * GIB))
    plan.measure.start = int(start * GIB)
    parked, said = Parked(int(qwen * GIB)), []
    plan_checkpointing(plan, tokens, parked, torch.device("cuda"), said.append)
    predicted = float(said[0].split("predicted peak ")[1].split(" ")[0])
    return plan, parked, predicted, said


def test_the_plan_charges_what_the_first_step_did_not_hold_yet(monkeypatch):
    """The first step's peak lacks what that step leaves allocated for good (AdamW's state, 0.34 GiB for a LoRA r32:
    created by its first optimizer step, after the peak), so every later step peaks that much higher. Measured at
    8 GiB b2 (call 4): the first step peaked at 6.27 GiB with 4.15 allocated before it and 4.56 after; the plan
    predicted 7.4 GiB with Qwen3 kept on the GPU, the next step reached 7.66 (reserved 7.99 of 8.0), the allocator
    retried and the guard parked Qwen3 again. With the first step's growth charged, Qwen3 waits in host memory there
    and the plan keeps what fits beside the real peak; at 12 GiB b4 Qwen3 and two kept blocks fit (11.07 measured)."""
    plan, parked, predicted, said = _plan_at(monkeypatch, start=4.15, peak=6.27, steady=4.56, act=0.706, cap=8)
    assert not parked.resident, said
    assert plan.recomputed == 26 and 7.26 <= predicted <= 7.5, said  # 26 recomputed, parked: 7.26 measured
    plan, parked, predicted, said = _plan_at(monkeypatch, start=4.16, peak=8.20, steady=4.56, act=1.412, cap=12,
                                             tokens=16384)
    assert parked.resident and plan.recomputed == 26 and 11.07 <= predicted <= 11.4, said


def test_predicted_peaks_cover_every_measured_one(monkeypatch):
    """Every plan that ran on the H200: the planner's prediction for it is never under the peak it reached and at
    most 0.2 GiB over (the first step's one-off allocations, e.g. cuBLAS workspaces, are counted twice)."""
    for start, peak0, steady, act, kept, resident, measured in H200_RUNS:
        qwen = QWEN3_GIB if resident else 0.0
        step = StepMemory(act=int(act * GIB), start=int((start + qwen) * GIB), peak=int((peak0 + qwen) * GIB),
                          steady=int((steady + qwen) * GIB))
        predicted = step.peak_keeping(kept) / GIB
        assert measured <= predicted <= measured + 0.2, (start, peak0, kept, resident, measured, predicted)
    step = StepMemory(act=GIB, peak=10 * GIB, steady=10 * GIB)  # the all-recomputed peak: 10 GiB
    assert step.peak_keeping(0) == step.peak_keeping(1) == 10 * GIB
    assert step.peak_keeping(3) == 12 * GIB


def test_a_first_step_that_peaks_in_its_optimizer_step_is_not_counted_twice(monkeypatch):
    """A full finetune's first step peaks in its optimizer step (the new optimizer state beside the gradients); that
    state is then in the steady memory too, and steady + (peak - start) counted it twice: on the H200 under 24 GiB,
    full finetune b4 with 8-bit state, the plan predicted 22.8 GiB and recomputed 27 of 28 blocks, the run peaked at
    17.24 GiB (bench/results/fullft24_2026-12-03). With the peak before the optimizer step, a later step peaks at the
    larger of its backward and the first optimizer step's peak. (GiB, made up in that shape: 8 before the step, 13
    at the end of the backward, 16 in the optimizer step, 12 after it.)"""
    g = GIB

    def step_base(**kw):
        return StepMemory(act=g, **kw).base()

    old = step_base(start=8 * g, peak=16 * g, steady=12 * g, scale=1.0)
    assert old == 20 * g  # what the planner charged without the backward's own peak
    assert step_base(start=8 * g, peak=16 * g, steady=12 * g, scale=1.0, backward_peak=13 * g) == 17 * g
    # at twice the tokens the backward grows, the optimizer step does not
    assert step_base(start=8 * g, peak=16 * g, steady=12 * g, scale=2.0, backward_peak=13 * g) == 22 * g
    assert step_base(start=8 * g, peak=16 * g, steady=12 * g, scale=1.0, backward_peak=15.5 * g) == 19.5 * g
    # a peak in the backward (a LoRA: backward_peak == peak) keeps the old rule: H200_RUNS are unchanged
    for start, peak0, steady, *_ in H200_RUNS:
        args = dict(start=int(start * g), peak=int(peak0 * g), steady=int(steady * g), scale=1.0)
        assert step_base(**args, backward_peak=int(peak0 * g)) == step_base(**args)
    # the auto plan after such a first step keeps 3 more blocks (a block keeps 1 GiB) under the same peak
    from anima_train.training import memory
    from anima_train.training.memory import plan_checkpointing
    results = []
    for backward_peak in (None, 13 * g):
        StrictCuda(monkeypatch, allocated=12 * g, peak=16 * g, total=24 * g)
        monkeypatch.setitem(memory._EXPANDABLE, "set", True)
        plan = recompute.BlockCheckpointing([torch.nn.Linear(2, 2) for _ in range(28)])
        plan.set_recomputed(28)
        plan.measure = recompute.Measure(tokens=16384, act=g, start=8 * g, backward_peak=backward_peak)
        said = []
        plan_checkpointing(plan, 16384, None, torch.device("cuda"), said.append)
        results.append((plan.recomputed, said[0]))
    (old_recomputed, old_said), (new_recomputed, new_said) = results
    assert new_recomputed == old_recomputed - 3, results
    assert "predicted peak 22.0 of 24.0" in old_said and "predicted peak 22.0 of 24.0" in new_said, results


def test_measure_records_the_peak_before_the_optimizer_step(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 13 * GIB)
    m = recompute.Measure(tokens=0)
    m.before_optimizer_step(CUDA)
    assert m.backward_peak == 13 * GIB
    cpu = recompute.Measure(tokens=0)
    cpu.before_optimizer_step(CPU)
    assert cpu.backward_peak is None


def test_measure_records_the_memory_before_the_first_micro_batch(monkeypatch):
    allocated = [5 * GIB]
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: allocated[0])
    m = recompute.Measure(tokens=0)
    m.saw(8192, CUDA)
    allocated[0] = 7 * GIB  # a second micro-batch of the same step (gradient accumulation)
    m.saw(16384, CUDA)
    assert (m.start, m.tokens) == (5 * GIB, 16384)
    cpu = recompute.Measure(tokens=0)
    cpu.saw(4096, CPU)
    assert (cpu.start, cpu.tokens) == (None, 4096)


def test_a_step_that_makes_the_allocator_retry_gives_memory_back(monkeypatch):
    """After the plan, a step whose allocations had to free the cache and retry (a stall every step) first sends
    Qwen3 back to host memory, then recomputes one more block per such step; a step without retries changes
    nothing."""
    from anima_train.training.memory import plan_checkpointing, relieve

    cuda = StrictCuda(monkeypatch, allocated=6 * GIB, peak=10 * GIB, total=140 * GIB)
    plan = recompute.BlockCheckpointing([torch.nn.Linear(2, 2) for _ in range(28)])
    plan.set_recomputed(28)
    plan.measure = recompute.Measure(tokens=4096, act=GIB)
    parked, said = Parked(GIB), []
    device = torch.device("cuda")
    plan_checkpointing(plan, 4096, parked, device, said.append)
    assert parked.resident and plan.recomputed == 0
    relieve(plan, parked, device, said.append)
    assert parked.resident and plan.recomputed == 0 and len(said) == 1  # no retry: nothing changes
    cuda.retries = 1
    relieve(plan, parked, device, said.append)
    assert not parked.resident and plan.recomputed == 0 and "Qwen3 goes back to host memory" in said[-1]
    relieve(plan, parked, device, said.append)  # the same count: already answered
    assert plan.recomputed == 0
    cuda.retries = 3
    relieve(plan, parked, device, said.append)
    assert plan.recomputed == 1 and said[-1].endswith("now 1 of 28 blocks recompute")


def test_auto_plan_on_a_large_card_keeps_everything(monkeypatch):
    from anima_train.training.memory import plan_checkpointing

    StrictCuda(monkeypatch, allocated=6 * GIB, peak=10 * GIB, total=140 * GIB)
    blocks = [torch.nn.Linear(2, 2) for _ in range(28)]
    plan = recompute.BlockCheckpointing(blocks)
    plan.set_recomputed(28)
    plan.measure = recompute.Measure(tokens=4096 * 8, act=GIB)
    parked = Parked(4 * 2**20)
    said = []
    plan_checkpointing(plan, 4096 * 8, parked, torch.device("cuda"), said.append)
    assert parked.resident and plan.recomputed == 0 and said[0].endswith("; Qwen3 stays on the GPU")


def test_a_resident_text_encoder_is_not_parked_again_by_another_holder():
    """Seen on the GPU: after the plan kept Qwen3 on the GPU, the preview renderer (which holds the same parked
    weights) parked them again after its round, and the next training step met Qwen3 on the CPU (index_select:
    tensors on cuda:0 and cpu). Here park/restore record where the weights are."""
    from anima_train.training.memory import ParkedWeights

    class Recorded(ParkedWeights):
        where = "host"

        def park(self):
            self.where = "host"

        def restore(self):
            self.where = "device"

    parked = Recorded(torch.nn.Embedding(4, 2), torch.device("cpu"))
    with parked.on_device():
        assert parked.where == "device"
    assert parked.where == "host"  # parked between uses
    parked.stay_on_device()
    with parked.on_device():  # the previewer's round
        pass
    assert parked.where == "device"


def test_largest_batch_counts_texture_canvases():
    from types import SimpleNamespace

    from anima_train.data.batches import BucketBatchSampler

    keys = [((512, 512), True)] * 6 + [((768, 512), False)] * 2
    sampler = BucketBatchSampler(keys, {((512, 512), True): 4, ((768, 512), False): 4})
    assert sampler.largest_batch_tokens() == 4 * 32 * 32  # 4 x 512x512 beats 2 x 768x512
    sampler.texture = SimpleNamespace(tcfg=SimpleNamespace(canvases=[[1024, 1024], [512, 512]]))
    assert sampler.largest_batch_tokens() == 4 * 64 * 64  # a texture batch may be cut at 1024x1024


def test_blocks_added_to_the_recompute_mid_run_change_no_number(tiny_anima, latents_dir, tmp_path, monkeypatch):
    """relieve() may recompute one more block between two steps (the allocator retried). On the tiny model on the
    CPU: a run that starts with 1 block recomputed and gains one after every step trains to the same bits as the
    run with every block recomputed, and the recompute count did grow."""
    from dataclasses import dataclass

    from anima_train.training import memory

    calls = _count_recomputes(monkeypatch)
    reference = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "all", max_steps=3,
                               gradient_checkpointing="true", checkpoint_blocks='"all"'), cpu=True, no_save=True)
    n_blocks = len(reference.components.transformer.transformer_blocks)
    assert n_blocks >= 2

    @dataclass
    class Watched(recompute.BlockCheckpointing):
        retries: int | None = 0  # as after the auto plan (which only runs on CUDA)

    retries = iter(range(1, 100))  # every step made the allocator retry
    monkeypatch.setattr(recompute, "BlockCheckpointing", Watched)
    monkeypatch.setattr(memory, "alloc_retries", lambda device: next(retries))
    calls.clear()
    grown = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "grown", max_steps=3,
                           gradient_checkpointing="true", checkpoint_blocks="1"), cpu=True, no_save=True)
    # step 1 recomputed one block, step 2 two, step 3 three (no more than there are)
    assert len(calls) == sum(min(k, n_blocks) for k in (1, 2, 3)) > 3
    assert grown.components.transformer._gradient_checkpointing_func.recomputed == min(3, n_blocks)
    assert (grown.losses, grown.trainable_digest) == (reference.losses, reference.trainable_digest)


def test_expandable_segments_unless_the_user_set_the_allocator(monkeypatch):
    from anima_train.training import memory
    from anima_train.training.memory import expandable_segments_on, use_expandable_segments

    asked = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", asked.append, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", asked.append, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setitem(memory._EXPANDABLE, "set", False)
    monkeypatch.setattr(memory.sys, "platform", "win32")  # PyTorch ignores the setting there
    assert not use_expandable_segments(CUDA) and asked == []
    monkeypatch.setattr(memory.sys, "platform", "linux")
    assert not use_expandable_segments(CPU) and asked == [] and not expandable_segments_on()
    assert use_expandable_segments(CUDA) and asked == ["expandable_segments:True"] and expandable_segments_on()
    monkeypatch.setitem(memory._EXPANDABLE, "set", False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert not use_expandable_segments(CUDA) and asked == ["expandable_segments:True"]
    assert not expandable_segments_on()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert expandable_segments_on()


def test_in_graph_recompute_is_charged_its_extra_and_given_up_where_only_whole_blocks_fit(monkeypatch):
    """recompute = "graph": the plan charges the backward graph's extra (half a block's activations) while any block
    recomputes, as the larger of it and the kept blocks' activations, not their sum (the kept blocks' backward frees
    theirs before the in-graph blocks' runs); where the extra does not fit beside the all-recomputed step but
    whole-block recompute does, the plan keeps whole-block recompute rather than not fitting."""
    def decide_plan(*, peak, budget, in_graph=False):
        plan = plan_memory(StepMemory(act=2 * GIB, peak=peak, steady=6 * GIB, start=5 * GIB), Budget(budget, True),
                           n_blocks=28, in_graph=in_graph)
        return plan.resident, plan.keep, plan.predicted, plan.in_graph

    block = decide_plan(peak=10 * GIB, budget=24 * GIB)
    graph = decide_plan(peak=10 * GIB, budget=24 * GIB, in_graph=True)
    assert graph[3] and not block[3]
    # usable 22.8 GiB, base 11 GiB: whole blocks keep 1 + 5 = 6 (peak 21); in the graph too, its extra (1 GiB)
    # under the kept blocks' 10
    assert block[1:3] == (6, 21 * GIB) and graph[1:3] == (6, 21 * GIB)
    # base 12.5 GiB: charged on top of the kept blocks the extra would cost one (5 keep, 21.5); as the larger, 6 keep
    assert decide_plan(peak=int(11.5 * GIB), budget=24 * GIB, in_graph=True)[1:3] == (6, int(22.5 * GIB))
    # all-recomputed base 22.5 GiB: whole-block recompute fits 22.8 usable, in-graph (23.5) does not: given up
    tight = decide_plan(peak=int(21.5 * GIB), budget=24 * GIB, in_graph=True)
    assert tight == decide_plan(peak=int(21.5 * GIB), budget=24 * GIB)[:3] + (False,)
    assert tight[1] == 1
    # every block kept: nothing recomputes, nothing extra
    roomy = decide_plan(peak=10 * GIB, budget=140 * GIB, in_graph=True)
    assert roomy[1:3] == (28, 11 * GIB + 27 * 2 * GIB)


@pytest.mark.slow
def _saved_and_gradients():
    """A compiled tiny trunk (fp32, Inductor's CPU backend) and step(how) -> (bytes the blocks save for their backward
    beyond the weights, the output, the trained weights' gradients), with every block kept ("kept") or recomputed
    whole ("block") or in the graph ("graph")."""
    from anima_train.model.tiny import build_models

    torch.compiler.reset()
    transformer = build_models("tiny", dtype=torch.float32)["transformer"].train()
    blocks = list(transformer.transformer_blocks)
    for param in transformer.parameters():
        param.requires_grad_(False)
    trained = [block.ff.net[0].proj.weight for block in blocks]
    for weight in trained:
        weight.requires_grad_(True)
    for block in blocks:
        block.compile(mode="default", dynamic=True)
    weights = {param.untyped_storage().data_ptr() for param in transformer.parameters()}
    x = torch.randn(2, 16, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    context = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(1))

    def step(how: str):
        ckpt = recompute.BlockCheckpointing(blocks)
        ckpt.set_recomputed(0 if how == "kept" else len(blocks))
        if how == "graph":
            ckpt.in_graph = recompute.in_graph_recompute("default", True)
        transformer.enable_gradient_checkpointing(ckpt)
        saved = [0]

        def pack(tensor):  # the weights (a compiled graph's inputs, saved by reference) cost nothing
            if tensor.untyped_storage().data_ptr() not in weights:
                saved[0] += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = transformer(x, timestep=torch.tensor([0.3, 0.7]), encoder_hidden_states=context,
                              padding_mask=x.new_zeros(1, 1, 256, 256), return_dict=False)[0]
        out.square().mean().backward()
        grads = [weight.grad for weight in trained]
        for weight in trained:
            weight.grad = None
        return saved[0], out.detach(), grads

    return step


def test_in_graph_recompute_saves_the_block_inputs_only_and_gives_the_same_gradients():
    """recompute = "graph" (Inductor's CPU backend here): a recomputed block saves for its backward about what
    torch.utils.checkpoint saves, a fraction of what a kept block saves (a path that fell back to keeping the
    activations would fail here), and the gradients are the whole-block recompute's."""
    step = _saved_and_gradients()
    kept, block, graph = step("kept"), step("block"), step("graph")
    assert graph[0] < kept[0] / 3 and block[0] < kept[0] / 3, (kept[0], block[0], graph[0])
    assert torch.allclose(graph[1], block[1], rtol=1e-5, atol=1e-6)
    assert all(torch.allclose(g, b, rtol=1e-4, atol=1e-7) for g, b in zip(graph[2], block[2]))
    assert all(torch.allclose(k, b, rtol=1e-4, atol=1e-7) for k, b in zip(kept[2], block[2]))


def test_an_in_graph_budget_saves_a_share_and_trains_to_the_same_bits(monkeypatch):
    """recompute.IN_GRAPH_BUDGET, the share of a kept block's activations an in-graph block saves (0 in the trainer;
    bench_train_gpu.py --torch-set sets it for the measurements in docs/training.md): the partitioner reads it when it
    cuts the graph, so a share between 0 and 1 saves more than the inputs and less than a kept block (fails where the
    budget is fixed at 0, or where an earlier graph is reused), and the gradients are the share-0 graph's to the bit."""
    step = _saved_and_gradients()
    kept = step("kept")
    torch.compiler.reset()  # Dynamo caches the in-graph function by its code: a new budget needs a new graph
    inputs_only = step("graph")
    monkeypatch.setattr(recompute, "IN_GRAPH_BUDGET", 0.3)
    torch.compiler.reset()
    share = step("graph")
    assert inputs_only[0] < share[0] < kept[0], (inputs_only[0], share[0], kept[0])
    assert torch.equal(share[1], inputs_only[1])
    assert all(torch.equal(a, b) for a, b in zip(share[2], inputs_only[2]))


@pytest.mark.slow
def test_a_compiled_run_recomputes_in_graph_by_default_and_says_so(tiny_anima, latents_dir, tmp_path, monkeypatch,
                                                                    capsys):
    """The default recompute = "graph" in a regionally compiled run: every recomputed block goes through the
    in-graph function (none through torch.utils.checkpoint), the log says so, and the losses are "block"'s."""
    checkpointed = _count_recomputes(monkeypatch)
    made = []
    real = recompute.in_graph_recompute

    def counting(mode, dynamic):
        run = real(mode, dynamic)

        def counted(block, *args):
            made.append(block)
            return run(block, *args)

        return counted

    monkeypatch.setattr(recompute, "in_graph_recompute", counting)
    kw = dict(max_steps=2, gradient_checkpointing="true", checkpoint_blocks='"all"', compile='"default"')
    torch.compiler.reset()
    graph = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "g", **kw), cpu=True, no_save=True)
    n_blocks = len(graph.components.transformer.transformer_blocks)
    assert len(made) == 2 * n_blocks and checkpointed == []
    assert "recompute inside the compiled graph" in capsys.readouterr().out
    block = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "b", **kw, recompute='"block"'),
                  cpu=True, no_save=True)
    assert len(checkpointed) == 2 * n_blocks and len(made) == 2 * n_blocks
    assert graph.losses == pytest.approx(block.losses, abs=1e-5)


def test_auto_plan_with_in_graph_recompute_says_so_or_falls_back_to_whole_blocks(monkeypatch):
    """recompute = "graph" after the first step, the 24 GiB card above: the plan charges the backward graph's extra
    half block where it makes the peak (here the 10 kept blocks' 10 GiB do), says "inside the compiled graph" and
    keeps the in-graph function; on a card where only whole-block recompute fits it drops the function (the blocks
    recompute whole) and says that."""
    from anima_train.training.memory import plan_checkpointing

    def in_graph(block, *args):
        return block(*args)

    StrictCuda(monkeypatch, allocated=6 * GIB, peak=10 * GIB, total=36 * GIB, fraction=2 / 3)  # cap 24 GiB
    plan = recompute.BlockCheckpointing([torch.nn.Linear(2, 2) for _ in range(28)], in_graph=in_graph)
    plan.set_recomputed(28)
    plan.measure = recompute.Measure(tokens=4096 * 8, act=GIB, start=int(5.5 * GIB))
    said = []
    plan_checkpointing(plan, 4096 * 8, Parked(GIB), torch.device("cuda"), said.append)
    # usable 22.08 GiB; all recomputed with Qwen3 resident 11.5, + 0.5 in the graph: 1 + 10 kept, peak 11.5 + 10
    assert plan.recomputed == 17 and plan.in_graph is in_graph
    assert said == ["checkpointing auto: 17 of 28 blocks recompute inside the compiled graph (a block keeps 1.00 GiB "
                    "at the largest batch; predicted peak 21.5 of 24.0 GiB); Qwen3 stays on the GPU"]

    # all recomputed, Qwen3 parked: 6 + (20.8 - 5.5) = 21.3 GiB fits 22.08 whole, not with the graph's 0.5 + 0.5
    StrictCuda(monkeypatch, allocated=6 * GIB, peak=int(20.8 * GIB), total=36 * GIB, fraction=2 / 3)
    plan = recompute.BlockCheckpointing([torch.nn.Linear(2, 2) for _ in range(28)], in_graph=in_graph)
    plan.set_recomputed(28)
    plan.measure = recompute.Measure(tokens=4096 * 8, act=2 * GIB, start=int(5.5 * GIB))
    said = []
    plan_checkpointing(plan, 4096 * 8, Parked(GIB), torch.device("cuda"), said.append)
    assert plan.recomputed == 27 and plan.in_graph is None
    assert said == ['checkpointing auto: 27 of 28 blocks recompute whole (recompute = "graph" would not fit) (a '
                    "block keeps 2.00 GiB at the largest batch; predicted peak 21.3 of 24.0 GiB)"]


def test_a_first_step_measured_in_the_graph_plans_from_its_peak_before_the_first_in_graph_recompute(monkeypatch):
    """The measured first step recomputes in the graph (Measure.in_graph), so its peak holds the graph's extra. Kept
    blocks grow the step's peak from where it stood before that extra, read as the first in-graph block's backward
    begins (`kept_peak`): charged from the whole peak, the extra would be counted under every kept block."""
    from anima_train.training.memory import plan_checkpointing

    def decide(kept_peak):
        StrictCuda(monkeypatch, allocated=6 * GIB, peak=int(10.5 * GIB), total=36 * GIB, fraction=2 / 3)  # 24 GiB
        ckpt = recompute.BlockCheckpointing([torch.nn.Linear(2, 2) for _ in range(28)], in_graph=lambda b, *a: b(*a))
        ckpt.set_recomputed(27)
        ckpt.measure = recompute.Measure(tokens=4096 * 8, act=GIB, start=int(5.5 * GIB), in_graph=True,
                                         kept_peak=kept_peak)
        said = []
        plan_checkpointing(ckpt, 4096 * 8, Parked(GIB), torch.device("cuda"), said.append)
        return ckpt.recomputed, said[0]

    # usable 22.08 GiB, Qwen3 resident (+1): the whole step 6 + 5 + 1 = 12; before the extra 6 + 4 + 1 = 11
    assert decide(None) == (17, "checkpointing auto: 17 of 28 blocks recompute inside the compiled graph (a block "
                                "keeps 1.00 GiB at the largest batch; predicted peak 22.0 of 24.0 GiB); Qwen3 stays "
                                "on the GPU")
    assert decide(int(9.5 * GIB)) == (16, "checkpointing auto: 16 of 28 blocks recompute inside the compiled graph "
                                          "(a block keeps 1.00 GiB at the largest batch; predicted peak 22.0 of 24.0 "
                                          "GiB); Qwen3 stays on the GPU")


@pytest.mark.slow
def test_in_graph_recompute_trains_bf16_to_the_bits_of_whole_blocks(tiny_anima, latents_dir, tmp_path):
    """bf16, compiled: recompute = "graph" (a second graph of the block, cut elsewhere) trains to the same losses
    and LoRA weights, bit for bit, as whole-block recompute, so the plan it picks moves no number. Fails without
    the trainer's emulated casts (`compiling.round_like_eager`; run it with TORCHINDUCTOR_EMULATE_PRECISION_CASTS=0):
    the fused graph kept bf16 results in fp32 that the other graph rounds, and the first loss already differs
    (2.13540 against 2.13544)."""
    kw = dict(max_steps=3, dtype='"bfloat16"', gradient_checkpointing="true", checkpoint_blocks='"all"',
              compile='"default"')
    runs = {}
    for how in ("graph", "block"):
        torch.compiler.reset()
        runs[how] = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / how, "[optimizer]\nlr = 1e-3\n",
                                   recompute=f'"{how}"', **kw), cpu=True, no_save=True)
    graph, block = runs["graph"], runs["block"]
    assert graph.losses == block.losses
    assert graph.trainable_digest and graph.trainable_digest == block.trainable_digest


@pytest.mark.slow
def test_a_whole_block_recompute_runs_the_graph_its_forward_compiled():
    """torch.utils.checkpoint recomputes a block on autograd's device thread, whose intra-op thread count is 1 by
    then (the DataLoader's pin-memory thread set it), while the forward ran on the main thread's count: Dynamo's
    guard on the count failed and the block compiled again (on an H100 2 of the first step's 4 block graphs). On the
    CPU the backward runs on the thread that calls it, so here that thread's count is 1 as the device thread's is.
    The recompute runs the graph the forward compiled: one graph. Fails without BlockCheckpointing.threads (2)."""
    import threading

    import torch._dynamo.utils as dynamo_utils

    original = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.compiler.reset()
        dynamo_utils.counters.clear()
        block = torch.nn.Linear(8, 8)
        block.compile(mode="default")
        ckpt = recompute.BlockCheckpointing([block])
        ckpt.set_recomputed(1)
        out = ckpt(block, torch.randn(4, 8, requires_grad=True))
        failed = []

        def backward():  # as autograd's device thread, once the pin-memory thread has set the count to 1
            try:
                torch.set_num_threads(1)
                out.square().sum().backward()
            except Exception as exc:  # noqa: BLE001 (reported below)
                failed.append(exc)

        thread = threading.Thread(target=backward)
        thread.start()
        thread.join()
        assert not failed, failed
        assert block.weight.grad is not None
        assert dynamo_utils.counters["stats"]["unique_graphs"] == 1, dict(dynamo_utils.counters["recompiles"])
    finally:
        torch.set_num_threads(original)


@pytest.mark.parametrize("in_graph", [True, False])
def test_the_measured_first_step_recomputes_as_the_run_will_and_measures_its_kept_block(monkeypatch, in_graph):
    """checkpoint_blocks = "auto": the first step keeps the last block and reads what its forward leaves allocated
    (its activations), and the other blocks recompute the way the plan will have them (Measure.in_graph: inside the
    compiled graph, else torch.utils.checkpoint), so that step compiles the graphs the later ones run. Before, every
    block recomputed through torch.utils.checkpoint on that step and the in-graph function compiled at step 2."""
    checkpointed = _count_recomputes(monkeypatch)
    through_graph = []

    def graph(block, *args):
        through_graph.append(block)
        return block(*args)

    allocated = iter([5 * GIB, 5 * GIB + 300])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: next(allocated))
    blocks = [torch.nn.Linear(4, 4) for _ in range(4)]
    ckpt = recompute.BlockCheckpointing(blocks, in_graph=graph)
    ckpt.set_recomputed(len(blocks) - 1)  # as models.build_model sets it for "auto"
    ckpt.measure = recompute.Measure(tokens=0, in_graph=in_graph)
    # in the graph, the peak is read as the kept block's backward ends and before the first recomputed block's
    events = []
    monkeypatch.setattr(recompute.Measure, "recompute_starts", lambda self, device: events.append("read"))
    blocks[-2].weight.register_hook(lambda grad: events.append("last recomputed block's backward"))
    x = torch.randn(2, 4, requires_grad=True)
    for block in blocks:
        x = ckpt(block, x)
    x.sum().backward()
    assert ckpt.measure.act == 300
    assert through_graph == (blocks[:-1] if in_graph else [])
    assert len(checkpointed) == (0 if in_graph else 3)
    assert events == (["read", "last recomputed block's backward"] if in_graph
                      else ["last recomputed block's backward"])


@pytest.mark.slow
def test_every_block_of_a_compiled_run_runs_one_graph():
    """The first block's input needs no gradient and every later block's does: Dynamo guards on requires_grad, and
    the first block compiled a graph of its own (one more compile per way a block runs, ~25 s cold each on an
    H100). Compiled runs ask for that gradient (BlockCheckpointing.uniform_inputs): kept or recomputed whole, every
    block runs one graph, and the weights' gradients are those of the run that did not ask. Fails without (2)."""
    import torch._dynamo.utils as dynamo_utils

    blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(3)]
    x = torch.randn(4, 8)

    def grads(uniform: bool, recomputed: int) -> list[torch.Tensor]:
        ckpt = recompute.BlockCheckpointing(blocks, uniform_inputs=uniform)
        ckpt.set_recomputed(recomputed)
        h = x
        for block in blocks:
            h = ckpt(block, h)
        h.square().sum().backward()
        out = [b[0].weight.grad.clone() for b in blocks]
        for block in blocks:
            block.zero_grad(set_to_none=True)
        return out

    eager = grads(False, 0)
    for block in blocks:
        block.compile(mode="default")
    for recomputed in (0, 3):
        torch.compiler.reset()
        dynamo_utils.counters.clear()
        compiled = grads(True, recomputed)
        assert dynamo_utils.counters["stats"]["unique_graphs"] == 1, (recomputed, dict(dynamo_utils.counters["stats"]))
        assert all(torch.allclose(c, e, rtol=1e-5, atol=1e-6) for c, e in zip(compiled, eager))
