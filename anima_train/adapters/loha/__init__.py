"""LoHa: ΔW = (w1_a·w1_b) ⊙ (w2_a·w2_b)·alpha/rank, the Hadamard product of two rank-r products (peft
`LoHaConfig`; LyCORIS' LoHa). Twice LoRA's parameters at the same rank, for an update of rank up to rank².

Files: `diffusion_model.<native module>.hada_w1_a / hada_w1_b / hada_w2_a / hada_w2_b` and `.alpha` (ComfyUI
scales by alpha / rank with rank = hada_w1_b's first dimension); the kohya `lora_unet_*` layout is LoRA-only and
refused. [adapter] rank, alpha and dropout (as rank dropout) apply; a fresh LoHa is an exact no-op (w2_b = 0).
"""

from anima_train.adapters.base import AdapterMethod


def parameters(adapter, in_features: int, out_features: int) -> int:
    """Two LoRA-shaped pairs: 2 x rank x (in + out)."""
    return 2 * adapter.rank * (in_features + out_features)


METHOD = AdapterMethod(
    name="loha",
    kind="loha",
    title="LoHa",
    order=2,
    summary="",
    layout="LoHa files use diffusion_model.<module>.hada_* keys, which ComfyUI loads",
    dropout="rank dropout",
    shape_keys=("rank",),
    text_encoder=False,
    network_module="lycoris.kohya",
    architecture="/lycoris",
    network_args={"algo": "loha"},
    parameters=parameters,
    factors=("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"),
)
