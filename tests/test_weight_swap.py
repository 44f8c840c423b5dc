"""Frozen-weight block swap (`[train] swap_blocks`, training/weight_swap.py) on the tiny model.

The tiny DiT has 2 blocks and the swap keeps one on the device, so every step drops each block's weights and copies
them in again (forward, then the backward's recompute). A weight used while dropped is an empty tensor: a shape error.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from anima_train.config import ConfigError
from anima_train.training import weight_swap
from anima_train.training.train import train
from tests.test_train import make_cfg

STEPS = 3


def _watch(monkeypatch) -> list:
    """The swaps made in the run, and at every block call how many elements each block's frozen weights hold."""
    seen = []
    init, arrive = weight_swap.WeightSwap.__init__, weight_swap.WeightSwap.arrive

    def watching_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.append((self, []))

    def watching_arrive(self, index):
        arrive(self, index)
        sizes = [self.held_elements(i) for i in range(len(self.blocks))]
        next(calls for swap, calls in seen if swap is self).append((index, sizes))

    monkeypatch.setattr(weight_swap.WeightSwap, "__init__", watching_init)
    monkeypatch.setattr(weight_swap.WeightSwap, "arrive", watching_arrive)
    return seen


def _run(tiny_anima, latents_dir, out, **keys):
    return train(make_cfg(tiny_anima.diffusers_dir, latents_dir, out, max_steps=STEPS, gradient_checkpointing="true",
                          **keys), cpu=True, no_save=True)


@pytest.mark.parametrize("checkpoint_blocks", ['"all"', "0"])
def test_swapped_blocks_train_to_the_bits_of_the_resident_run(tiny_anima, latents_dir, tmp_path, monkeypatch,
                                                              checkpoint_blocks):
    """Losses and LoRA weights equal bit for bit to the all-checkpointed resident run, with each block's weights
    really dropped between its calls. With checkpoint_blocks = 0 the swapped blocks must still recompute (a kept
    block's backward would read its dropped weights): this case failed before the floor in BlockCheckpointing."""
    resident = _run(tiny_anima, latents_dir, tmp_path / "resident", checkpoint_blocks='"all"')
    seen = _watch(monkeypatch)
    swapped = _run(tiny_anima, latents_dir, tmp_path / "swapped", checkpoint_blocks=checkpoint_blocks,
                   swap_blocks=2)

    assert swapped.losses == resident.losses and len(swapped.losses) == STEPS
    assert swapped.trainable_digest == resident.trainable_digest
    (swap, calls), = seen
    n_blocks = len(swap.blocks)
    assert n_blocks == 2
    # forward 0, 1 then the recompute 1, 0: the first step copies 3 blocks in, every later one 2 (block 0 stays)
    assert swap.uploads == 1 + 2 * STEPS
    assert [index for index, _ in calls] == [0, 1, 1, 0] * STEPS
    for index, sizes in calls:  # only the block running holds its weights
        assert sizes[index] > 0 and all(size == 0 for other, size in enumerate(sizes) if other != index)


@pytest.mark.slow
def test_compiled_blocks_swap_outside_their_graph(tiny_anima, latents_dir, tmp_path):
    """Regional torch.compile (Inductor's CPU backend here) with the swap around each compiled block: the run trains
    to the bits of the compiled resident run (the swap changes each weight's storage at every call: a graph that
    had taken a weight as a constant, or a guard on it, would show here)."""
    runs = {}
    for swap in (0, 2):
        torch.compiler.reset()
        result = _run(tiny_anima, latents_dir, tmp_path / str(swap), checkpoint_blocks='"all"', swap_blocks=swap,
                      compile='"default"')
        runs[swap] = (result.losses, result.trainable_digest)
    assert runs[0] == runs[2]


@pytest.mark.slow
def test_a_compiled_run_compiles_the_block_once_whichever_blocks_swap(tiny_anima, latents_dir, tmp_path):
    """Dynamo guards on a block's type, and a swapped block has the swapping class: the swapped and the resident
    blocks compiled a graph each (on an H100 under 6 GiB, one more compile of ~17 s). Every block of a trunk that
    swaps takes the class (WeightSwap.others), so a run with block 0 swapped (recomputed whole) and block 1 kept
    compiles as many graphs as the resident run, and trains to its bits. Fails without `others` (one more graph)."""
    import torch._dynamo.utils as dynamo_utils

    runs = {}
    for swap in (0, 1):
        torch.compiler.reset()
        dynamo_utils.counters.clear()
        result = _run(tiny_anima, latents_dir, tmp_path / str(swap), checkpoint_blocks="1", swap_blocks=swap,
                      compile='"default"', recompute='"block"')
        runs[swap] = (dynamo_utils.counters["stats"]["unique_graphs"], result.losses, result.trainable_digest)
    assert runs[1] == runs[0]


def test_validation_without_gradients_runs_the_swapped_blocks_too(tiny_anima, latents_dir, tmp_path, monkeypatch):
    """Validation runs the DiT under no_grad, where diffusers calls each block directly (no checkpoint function):
    the swapped blocks' own __call__ still brings their weights in, and the losses are the resident run's."""
    extra = "[validation]\nfraction = 0.25\nseed = 3\nevery_n_steps = 1\n"
    resident = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "resident", extra, max_steps=2,
                              gradient_checkpointing="true", checkpoint_blocks='"all"'), cpu=True, no_save=True)
    seen = _watch(monkeypatch)
    swapped = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / "swapped", extra, max_steps=2,
                             gradient_checkpointing="true", swap_blocks=2), cpu=True, no_save=True)
    (swap, calls), = seen
    assert len(calls) > 4 * 2  # the training calls and the validation's
    assert [(p.step, p.loss) for p in swapped.validation] == [(p.step, p.loss) for p in resident.validation]
    assert len(swapped.validation) >= 2 and swapped.losses == resident.losses


def test_the_saved_lora_is_the_resident_runs_and_the_model_comes_back_whole(tiny_anima, latents_dir, tmp_path):
    """The LoRA file written while blocks are swapped out holds the resident run's tensors (and no placeholder);
    after the run every block has its own class and its weights again (in-process callers: eval, the demo)."""
    files = {}
    for swap in (0, 1):
        result = train(make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path / str(swap), max_steps=2,
                                gradient_checkpointing="true", checkpoint_blocks='"all"', swap_blocks=swap),
                       cpu=True)
        files[swap] = load_file(str(result.final))
    assert files[1].keys() == files[0].keys() and len(files[0]) > 0
    assert all(torch.equal(files[1][k], files[0][k]) for k in files[0])
    blocks = result.components.transformer.transformer_blocks
    assert not any(hasattr(block, "_weight_swap") for block in blocks)
    assert type(blocks[0]) is type(blocks[1])
    assert all(p.numel() > 0 for p in blocks[0].parameters())
    assert type(blocks[0]).__call__ is torch.nn.Module.__call__  # the swapping subclass is gone


@pytest.mark.parametrize("extra, key_text", [
    ('kind = "none"\n', 'kind = "none" trains them all'),
    ('[quant]\nmode = "frozen"\n', "quantized base"),
])
def test_swap_blocks_refused_where_it_cannot_work(tiny_anima, latents_dir, tmp_path, extra, key_text):
    with pytest.raises(ConfigError) as exc:
        make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, extra, gradient_checkpointing="true",
                 swap_blocks=4)
    text = str(exc.value)
    assert "[train] swap_blocks = 4" in text and key_text in text and text.count("swap_blocks = 4") == 1


def test_swap_blocks_and_a_whole_trunk_compile_are_refused_but_not_without_compiling(tiny_anima, latents_dir,
                                                                                      tmp_path):
    with pytest.raises(ConfigError) as exc:
        make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, gradient_checkpointing="true", swap_blocks=4,
                 compile_regional="false")
    assert "compile_regional = false compiles the whole trunk; set compile_regional = true" in str(exc.value)
    cfg = make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, gradient_checkpointing="true", swap_blocks=4,
                   compile_regional="false", compile='"off"')  # nothing compiles: nothing to refuse
    assert cfg.train.swap_blocks == 4


def test_swap_blocks_needs_checkpointing(tiny_anima, latents_dir, tmp_path):
    with pytest.raises(ConfigError) as exc:
        make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, gradient_checkpointing="false", swap_blocks=4)
    assert "gradient_checkpointing = false; set gradient_checkpointing = true or swap_blocks = 0" in str(exc.value)


class _Block(torch.nn.Module):
    """A frozen Linear, a norm's buffer and a trainable low-rank pair: what a LoRA'd DiT block holds, small."""

    def __init__(self, width: int, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.base = torch.nn.Linear(width, width).requires_grad_(False)
        with torch.no_grad():
            self.base.weight.copy_(torch.randn(width, width, generator=gen) / width ** 0.5)
            self.base.bias.copy_(torch.randn(width, generator=gen) * 0.1)
        self.register_buffer("scale", torch.rand(width, generator=gen) + 0.5)
        self.down = torch.nn.Parameter(torch.randn(3, width, generator=gen) * 0.1)
        self.up = torch.nn.Parameter(torch.randn(width, 3, generator=gen) * 0.1)

    def forward(self, x):
        return x + torch.tanh(self.base(x) * self.scale + x @ self.down.T @ self.up.T)


def _stack_step(blocks, swapped: int):
    """One forward and backward through the stack: the first `swapped` blocks under non-reentrant checkpointing
    (as BlockCheckpointing runs them). Returns the loss and every trainable gradient."""
    x = torch.randn(4, 7, 10, generator=torch.Generator().manual_seed(5))
    for index, block in enumerate(blocks):
        x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if index < swapped else block(x)
    loss = x.square().mean()
    loss.backward()
    grads = [p.grad.clone() for b in blocks for p in (b.down, b.up)]
    for b in blocks:
        b.down.grad = b.up.grad = None
    return loss.detach(), grads


def test_a_deeper_stack_swaps_block_by_block_to_the_resident_bits(monkeypatch):
    """Five blocks, four swapped (the tiny DiT has two): the forward runs 0..3, the backward's recompute 3..0; at
    every call only the running block holds weights, every block's weights (a weight, a bias and a buffer, moved
    as one flat copy per dtype) come back in place, and the gradients equal the resident stack's bit for bit.
    Written to fail first: with the views assigned one tensor off (offsets shifted) the gradients differ."""
    resident = [_Block(10, seed) for seed in range(5)]
    expected = [_stack_step(resident, 4) for _ in range(3)]
    blocks = [_Block(10, seed) for seed in range(5)]
    swap = weight_swap.WeightSwap(blocks[:4], torch.device("cpu"))
    seen = []
    arrive = swap.arrive

    def watching(index):
        arrive(index)
        seen.append(([swap.held_elements(i) for i in range(4)], index))

    monkeypatch.setattr(swap, "arrive", watching)
    got = [_stack_step(blocks, 4) for _ in range(3)]
    for (loss, grads), (loss_r, grads_r) in zip(got, expected):
        assert torch.equal(loss, loss_r) and all(torch.equal(g, r) for g, r in zip(grads, grads_r))
    assert [index for _, index in seen] == [0, 1, 2, 3, 3, 2, 1, 0] * 3
    for sizes, index in seen:
        assert sizes[index] > 0 and all(size == 0 for other, size in enumerate(sizes) if other != index)
    # 0 and 3 stay between their calls (3 at the turn, 0 into the next step): 1 + 6 copies per step
    assert swap.uploads == 1 + 6 * 3 and len(swap.layout[0]) == 1  # one dtype: one flat copy per block
    swap.restore()
    assert torch.equal(_stack_step(blocks, 4)[0], _stack_step(resident, 4)[0])


def test_restore_falls_back_to_host_memory_when_the_card_is_full(monkeypatch):
    """After a run that needed the swap, the card may not hold the whole model: restore() must not end the run with
    an out-of-memory traceback (the files are written by then). The device copy is made to fail here."""
    blocks = [_Block(10, seed) for seed in range(3)]
    want = [b.base.weight.clone() for b in blocks]
    swap = weight_swap.WeightSwap(blocks, torch.device("cpu"))
    real = weight_swap.WeightSwap._restore_to

    def full_card(self, device):
        if device == self.device and device.type == "cpu" and not getattr(self, "_failed", False):
            self._failed = True
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, device)

    monkeypatch.setattr(weight_swap.WeightSwap, "_restore_to", full_card)
    swap.restore()
    assert swap._failed and all(torch.equal(b.base.weight, w) for b, w in zip(blocks, want))
    assert all(type(b) is _Block for b in blocks)
