"""DoRA: a LoRA whose layer is re-normalised: W' = m · (W + s·B·A) / ‖W + s·B·A‖, each output row scaled to its own
trained magnitude m (peft `LoraConfig(use_dora=True)`; Liu et al. 2024, weight-decomposed low-rank adaptation). One
parameter more per output row than a LoRA of the same rank.

Its own kind rather than LoRA + a flag: it writes another file, needs the base weight (so it has its own refusals),
and ComfyUI's loader reads it as its own thing (`dora_scale`); a kind keeps each of those in this folder.

Files: `diffusion_model.<native module>.lora_up.weight / lora_down.weight / alpha / dora_scale`, which ComfyUI's stock
LoRA loader applies with its weight decomposition (model.py says how dora_scale is made to give peft's W'). [adapter]
rank, alpha and dropout (on the layer input) apply; a fresh DoRA is an exact no-op (B = 0, m = ‖W‖).

Where it cannot work: DoRA reads the base weight every step (its norm) and at every save (dora_scale). The FP8 base
([train] base_matmul = "fp8") keeps FP8 copies beside a meta weight, and a swapped block ([train] swap_blocks) holds
its weight on the GPU only while it runs: both are refused. An SDNQ base ([quant] mode = "frozen") works: its
weights dequantise where peft reads them (tests/test_quant.py: the same gradients as over the dequantised weight), and
the file's dora_scale is made from that weight, as any adapter trained on a quantised base is.
"""

from anima_train.adapters.base import AdapterMethod


def parameters(adapter, in_features: int, out_features: int) -> int:
    """A LoRA's rank x (in + out), and the magnitude: one per output row."""
    return adapter.rank * (in_features + out_features) + out_features


def base_rule(adapter, base, rules) -> None:
    if base.matmul == "fp8":
        rules.error('[adapter] kind = "dora" normalises each base weight, but [train] base_matmul = "fp8" keeps no '
                    'plain base weight to normalise (FP8 copies only); set [train] base_matmul = "bf16", or use '
                    'kind = "lora"', "kind")
    elif base.swap_blocks:
        rules.error(f'[adapter] kind = "dora" reads each base weight when it saves (dora_scale), but [train] '
                    f'swap_blocks = {base.swap_blocks} keeps a swapped block\'s weights on the GPU only while it runs; '
                    f'set [train] swap_blocks = 0, or use kind = "lora"', "kind")


METHOD = AdapterMethod(
    name="dora",
    kind="dora",
    title="DoRA",
    order=3,
    summary="",
    layout="DoRA files use diffusion_model.<module>.lora_up/lora_down/alpha/dora_scale keys, which ComfyUI loads",
    dropout="on the layer input",
    shape_keys=("rank",),
    text_encoder=False,
    base_rule=base_rule,
    network_module="lycoris.kohya",
    architecture="/lycoris",
    network_args={"algo": "lora", "dora_wd": True},
    parameters=parameters,
    factors=("lora_down.weight", "lora_up.weight", "alpha", "dora_scale"),
    required_factors=("dora_scale",),
)
