"""The FP8 frozen base (`[train] base_matmul = "fp8"`, anima_train/model/fp8_base.py).

The CPU runs the same torch._scaled_mm the GPU does (row-wise scales, fp32 accumulation), so the layer's numerics
and the training integration are checked here; speed and the A/B on the full-size model are GPU benchmarks
(bench/fp8_check_gpu.py, bench/results/fp8_base_*).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from anima_train import adapters
from anima_train.config import AdapterConfig, ConfigError
from anima_train.model import fp8_base
from anima_train.model.fp8_base import Fp8FrozenLinear
from anima_train.training.train import train
from tests.test_train import make_cfg


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def _spread(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Rows of very different sizes (10^-3 .. 10^3): with one scale per tensor instead of per row, E4M3 keeps
    the small rows to no digit (their error measured 100 %; per row it stays under 6 %)."""
    return t * 10 ** (torch.rand(t.shape[0], 1, generator=gen) * 6 - 3)


def test_the_fp8_layer_matches_an_fp32_reference_to_fp8_precision_in_output_and_input_gradient():
    """Output and input gradient within E4M3's precision of the fp32 product, row by row, on rows of very different
    magnitudes; and the layer really is FP8 (its error is well above bf16's). Fails with one scale per tensor (the
    small rows are lost) or with the backward's scales on the wrong axis."""
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(256, 512, bias=True).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(_spread(torch.randn(512, 256, generator=gen) * 0.02, gen))
    lin = lin.to(torch.bfloat16)
    layer = Fp8FrozenLinear(lin)
    x = _spread(torch.randn(300, 256, generator=gen), gen).to(torch.bfloat16).reshape(3, 100, 256)
    grad = _spread(torch.randn(300, 512, generator=gen), gen).to(torch.bfloat16).reshape(3, 100, 512)

    x8 = x.clone().requires_grad_(True)
    y8 = layer(x8)
    y8.backward(grad)
    x32 = x.float().requires_grad_(True)
    y32 = torch.nn.functional.linear(x32, lin.weight.float(), lin.bias.float())
    y32.backward(grad.float())
    y16 = torch.nn.functional.linear(x, lin.weight, lin.bias)

    assert y8.dtype == torch.bfloat16 and y8.shape == (3, 100, 512) and x8.grad.shape == x.shape
    for got, ref in ((y8, y32), (x8.grad, x32.grad)):
        per_row = [_rel(a, b) for a, b in zip(got.reshape(-1, got.shape[-1]), ref.reshape(-1, ref.shape[-1]))]
        assert max(per_row) < 0.08, max(per_row)  # every row, the smallest included
        assert 0.01 < _rel(got, ref) < 0.06
    assert _rel(y16, y32) < 0.005  # bf16 is far closer: the FP8 path is what ran
    assert layer.dequantized_weight().shape == lin.weight.shape
    assert _rel(layer.dequantized_weight(), lin.weight.float()) < 0.06


def test_conversion_takes_the_frozen_block_linears_but_not_the_adaln_or_trainable_ones():
    block = torch.nn.ModuleDict({
        "attn": torch.nn.Linear(32, 32).requires_grad_(False),
        "norm1": torch.nn.ModuleDict({"linear_1": torch.nn.Linear(32, 32).requires_grad_(False)}),
        "lora_A": torch.nn.Linear(32, 16),  # trainable: stays
        "odd": torch.nn.Linear(30, 32).requires_grad_(False),  # 30 inputs: not a multiple of 16
        "attn2": torch.nn.ModuleDict({"to_k": torch.nn.ModuleDict({"base_layer": torch.nn.Linear(32, 32)}),
                                      "to_q": torch.nn.ModuleDict({"base_layer": torch.nn.Linear(32, 32)})}),
    }).requires_grad_(False)
    block["lora_A"].requires_grad_(True)
    assert fp8_base.convert_blocks([block]) == 2
    assert isinstance(block["attn2"]["to_q"]["base_layer"], Fp8FrozenLinear)
    assert type(block["attn2"]["to_k"]["base_layer"]) is torch.nn.Linear
    assert isinstance(block["attn"], Fp8FrozenLinear)
    assert type(block["norm1"]["linear_1"]) is torch.nn.Linear and type(block["lora_A"]) is torch.nn.Linear
    assert type(block["odd"]) is torch.nn.Linear


def test_fp8_available_names_a_card_without_fp8(monkeypatch):
    assert fp8_base.fp8_available(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 3090")
    why = fp8_base.fp8_available(torch.device("cuda"))
    assert "RTX 3090" in why and "8.6" in why and "8.9" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert fp8_base.fp8_available(torch.device("cuda")) is None


def _updates(model: torch.nn.Module) -> torch.Tensor:
    """Every LoRA layer's learned update B·A (B starts at zero, A at the same seed in both runs), flattened."""
    params = dict(model.named_parameters())
    return torch.cat([(params[n].float() @ params[n.replace("lora_B", "lora_A")].float()).flatten()
                      for n in sorted(params) if "lora_B" in n])


def _tiny_run(tiny_anima, latents_dir, out, extra="", **keys):
    return train(make_cfg(tiny_anima.diffusers_dir, latents_dir, out, extra + '[optimizer]\nlr = 1e-3\n',
                          **{"max_steps": 4, "dtype": '"bfloat16"', **keys}), cpu=True)


def test_an_fp8_base_trains_the_lora_the_bf16_base_trains(tiny_anima, latents_dir, tmp_path):
    """The tiny model's LoRA on an FP8 base against the same run on its bf16 base: the frozen block Linears but
    the adaLN and the cross-attention's key and value multiplied in FP8; losses within 2 %, the learned update
    pointing the same way (cosine > 0.95), and the LoRA file the same file (keys, shapes, dtypes): nothing of the
    FP8 base leaks into what ComfyUI loads."""
    runs = {m: _tiny_run(tiny_anima, latents_dir, tmp_path / m, base_matmul=f'"{m}"') for m in ("bf16", "fp8")}
    blocks = runs["fp8"].components.transformer.transformer_blocks
    fp8_layers = {n for n, m in blocks.named_modules() if isinstance(m, Fp8FrozenLinear)}
    per_block = {n.split(".", 1)[1].replace(".base_layer", "") for n in fp8_layers}
    assert per_block == {"attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_out.0",
                         "ff.net.0.proj", "ff.net.2"}  # not the adaLN, not the cross-attention's k, v (text rows)
    assert len(fp8_layers) == 8 * len(blocks)
    assert not any(isinstance(m, Fp8FrozenLinear)
                   for m in runs["bf16"].components.transformer.modules())

    bf16, fp8 = runs["bf16"].losses, runs["fp8"].losses
    assert len(fp8) == 4 and all(abs(a - b) / a < 0.02 for a, b in zip(bf16, fp8)), (bf16, fp8)
    assert bf16 != fp8  # the FP8 path ran
    a, b = _updates(runs["bf16"].components.transformer), _updates(runs["fp8"].components.transformer)
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.95

    files = {m: load_file(str(r.final)) for m, r in runs.items()}
    assert files["fp8"].keys() == files["bf16"].keys() and len(files["fp8"]) > 0
    assert all(files["fp8"][k].shape == files["bf16"][k].shape and files["fp8"][k].dtype == files["bf16"][k].dtype
               for k in files["bf16"])


FP8_KINDS = [m.kind for m in adapters.METHODS.values() if not m.trains_base and not
             adapters.base_refusals(AdapterConfig(kind=m.kind), adapters.BaseFacts(matmul="fp8"))]


@pytest.mark.parametrize("kind", [k for k in FP8_KINDS if k != "lora"])  # LoRA: the tests above
def test_an_fp8_base_under_lokr_and_loha(tiny_anima, latents_dir, tmp_path, kind):
    """peft's LoKr and LoHa layers (every method that takes the FP8 base) call their base layer as LoRA does: the
    FP8 base trains them too."""
    runs = {m: _tiny_run(tiny_anima, latents_dir, tmp_path / m, f'kind = "{kind}"\n',
                         base_matmul=f'"{m}"', save_every_epochs=0) for m in ("bf16", "fp8")}
    bf16, fp8 = runs["bf16"].losses, runs["fp8"].losses
    assert all(abs(a - b) / a < 0.02 for a, b in zip(bf16, fp8)) and bf16 != fp8


def test_swapped_blocks_with_an_fp8_base_train_to_the_bits_of_the_resident_run(tiny_anima, latents_dir, tmp_path):
    """The swap moves the FP8 copies (buffers) in and out like any frozen weight: bit-equal to resident FP8."""
    runs = [_tiny_run(tiny_anima, latents_dir, tmp_path / str(swap), base_matmul='"fp8"', swap_blocks=swap,
                      gradient_checkpointing="true", checkpoint_blocks='"all"') for swap in (0, 2)]
    assert runs[0].losses == runs[1].losses
    assert runs[0].trainable_digest == runs[1].trainable_digest


@pytest.mark.parametrize("extra, keys, expect", [
    ('kind = "none"\n', {}, 'kind = "none" trains them all (full finetune); set base_matmul = "bf16"'),
    ('[quant]\nmode = "frozen"\n', {}, 'and [quant] mode = "frozen" both quantize the base; choose one'),
    ("", {"dtype": '"float32"'}, 'the FP8 GEMMs write bfloat16, but [train] dtype = "float32"; set dtype = "bfloat16"'),
])
def test_base_matmul_fp8_is_refused_where_it_cannot_work(tiny_anima, latents_dir, tmp_path, extra, keys, expect):
    with pytest.raises(ConfigError) as exc:
        make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, extra, base_matmul='"fp8"',
                 **{"dtype": '"bfloat16"', **keys})
    text = str(exc.value)
    assert expect in text and text.count('base_matmul = "fp8"') == 1, text


@pytest.mark.parametrize("kind", [m.kind for m in adapters.METHODS.values() if m.kind not in FP8_KINDS
                                  and not m.trains_base])
def test_a_method_that_needs_the_base_weight_is_refused_with_the_fp8_base(tiny_anima, latents_dir, tmp_path, kind):
    """DoRA normalises each base weight; the FP8 base keeps only FP8 copies beside a meta weight: one problem that
    names both keys and the fix (the method's base rule, adapters.BaseFacts), and the same for swapped blocks (their
    weights are not on the GPU when the file is written)."""
    for keys, extra, expect in (({"base_matmul": '"fp8"'}, "",
                                 '[train] base_matmul = "fp8" keeps no plain base weight'),
                                ({"swap_blocks": 1, "gradient_checkpointing": "true"}, "",
                                 "[train] swap_blocks = 1 keeps a swapped block's weights")):
        with pytest.raises(ConfigError) as exc:
            make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, f'kind = "{kind}"\n' + extra,
                     **{"dtype": '"bfloat16"', **keys})
        text = str(exc.value)
        assert f'[adapter] kind = "{kind}"' in text and expect in text and 'use kind = "lora"' in text, text
        assert text.count(f'[adapter] kind = "{kind}"') == 1, text
    make_cfg(tiny_anima.diffusers_dir, latents_dir, tmp_path, f'kind = "{kind}"\n', dtype='"bfloat16"')  # bf16: fine


@pytest.mark.slow
def test_a_compiled_run_with_an_fp8_base_trains_as_the_eager_one(tiny_anima, latents_dir, tmp_path):
    """Regional torch.compile with dynamic shapes (the default) over the FP8 layers, Inductor's CPU backend here,
    one block recomputing in its compiled graph: the losses of the eager FP8 run. Failed at first with Dynamo's
    "lift_tracked_freevar_to_input should not be called on root SubgraphTracer" (a module-level float read inside
    the autograd.Function; quantize_rows now spells it as a literal)."""
    runs = {}
    for mode in ("off", "default"):
        torch.compiler.reset()
        runs[mode] = _tiny_run(tiny_anima, latents_dir, tmp_path / mode, base_matmul='"fp8"', compile=f'"{mode}"',
                               gradient_checkpointing="true", checkpoint_blocks="1", max_steps=3).losses
    assert len(runs["default"]) == 3
    assert all(abs(a - b) / a < 1e-3 for a, b in zip(runs["off"], runs["default"])), runs
