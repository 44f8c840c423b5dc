"""What one full-size Anima block (LoRA r32 on attention + MLP, bf16, 1024x1024 = 4096 tokens) saves for its backward
under torch.compile's `activation_memory_budget`, without a GPU: the block is traced with fake tensors through AOT
autograd and Inductor's min-cut partitioner (flash attention stands in for SDPA, as on CUDA), and the forward graph's
saved tensors are summed (views of one buffer once; the block's inputs and frozen weights cost nothing extra).

    python3 bench/activation_budget_probe.py --batch 2 --budgets 1,0.5,0.1,0.06,0.04,0

At budget 1 (the default) it gives 0.706 GiB per block at batch 2: the activations the trainer measured on the H200
(bench/results/caps_2026-12-02). Prints one JSON line per budget and the largest saved buffers.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 2**30
VIEWS = {"aten.view.default", "aten.permute.default", "aten.t.default", "aten.transpose.int", "aten.alias.default",
         "aten._unsafe_view.default", "aten.unsqueeze.default", "aten.expand.default", "aten.reshape.default",
         "aten.squeeze.dim", "aten.slice.Tensor", "aten.select.int"}


def flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    assert attn_mask is None
    return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                              scale=scale)[0]


def fake_block(batch: int):
    """(block, its fake inputs, the fake mode): one transformer block of the full-size model with the LoRA."""
    from diffusers import CosmosTransformer3DModel
    from peft import LoraConfig
    from torch._subclasses.fake_tensor import FakeTensorMode

    from anima_train.model.tiny import TRANSFORMER_FULL

    torch.set_default_dtype(torch.bfloat16)
    model = CosmosTransformer3DModel(**dict(TRANSFORMER_FULL, num_layers=1))
    torch.set_default_dtype(torch.float32)
    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "transformer_blocks" in n
               and any(k in n for k in ("attn1", "attn2", "ff"))]
    model.add_adapter(LoraConfig(r=32, lora_alpha=32, target_modules=targets, init_lora_weights=True))
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:  # every weight a fake tensor on the meta device: nothing is computed
        for mod in model.modules():
            for name, prm in list(mod._parameters.items()):
                if prm is not None:
                    mod._parameters[name] = torch.nn.Parameter(mode.from_tensor(prm.data.bfloat16()).to("meta"))
            for name, buf in list(mod._buffers.items()):
                if buf is not None:
                    mod._buffers[name] = mode.from_tensor(buf).to("meta")
    for name, prm in model.named_parameters():
        prm.requires_grad_("lora_" in name)
    block = model.transformer_blocks[0]
    captured = {}

    def grab(module, args):
        captured["args"] = args
        raise StopIteration

    hook = block.register_forward_pre_hook(grab)
    with mode, torch.device("meta"):
        x = torch.randn(batch, 16, 1, 128, 128, dtype=torch.bfloat16)
        try:
            model(x, timestep=torch.rand(batch, dtype=torch.bfloat16),
                  encoder_hidden_states=torch.randn(batch, 512, 1024, dtype=torch.bfloat16),
                  padding_mask=x.new_zeros(1, 1, 1024, 1024), return_dict=False)
        except StopIteration:
            pass
    hook.remove()
    hidden, context, embedded, temb, (cos, sin) = captured["args"][:5]
    return block, (hidden.detach().requires_grad_(True), context, embedded, temb, cos, sin), mode


def saved_bytes(block, inputs, mode, budget: float) -> tuple[int, list]:
    """(bytes the forward saves beyond its inputs, the largest saved buffers) at this budget."""
    import torch._functorch.config as functorch_config
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    seen = {}

    def forward_compiler(gm, example_inputs):
        placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
        outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
        buffers = {}
        for node in outputs[1:]:
            while (isinstance(node, torch.fx.Node) and node.op == "call_function" and str(node.target) in VIEWS
                   and isinstance(node.args[0], torch.fx.Node)):
                node = node.args[0]
            value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
            if node not in placeholders and isinstance(value, torch.Tensor):
                buffers[node.name] = (str(value.dtype).removeprefix("torch."), tuple(value.shape),
                                      value.numel() * value.element_size())
        seen["buffers"] = buffers
        return gm

    params = dict(block.named_parameters()) | dict(block.named_buffers())

    def run(prm, hidden, context, embedded, temb, cos, sin):
        return torch.func.functional_call(block, prm, (hidden, context, embedded, temb, (cos, sin), None, None, None))

    with functorch_config.patch(activation_memory_budget=budget):
        compiled = aot_function(run, fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm,
                                decompositions=select_decomp_table(),
                                partition_fn=functools.partial(min_cut_rematerialization_partition,
                                                               compiler="inductor"))
        with mode:
            compiled(params, *inputs)
    buffers = seen["buffers"]
    return sum(b[2] for b in buffers.values()), sorted(buffers.items(), key=lambda kv: -kv[1][2])[:6]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--budgets", default="1,0.5,0.3,0.1,0.06,0.04,0")
    args = ap.parse_args()
    torch.nn.functional.scaled_dot_product_attention = flash_sdpa  # the CUDA kernel's saved set (output + logsumexp)
    block, inputs, mode = fake_block(args.batch)
    for budget in (float(b) for b in args.budgets.split(",")):
        total, largest = saved_bytes(block, inputs, mode, budget)
        print(json.dumps({"batch": args.batch, "budget": budget, "saved_gib_per_block": round(total / GIB, 4),
                          "largest": [f"{name} {dtype}{list(shape)} {size / 2**20:.1f} MiB"
                                      for name, (dtype, shape, size) in largest]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
