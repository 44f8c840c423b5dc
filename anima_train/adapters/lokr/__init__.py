"""LoKr: ΔW = kron(w1, w2)·alpha/rank, either factor optionally low-rank (peft `LoKrConfig`; LyCORIS' LoKr).

Files: `diffusion_model.<native module>.lokr_w1[_a/_b] / lokr_w2[_a/_b]` (+ `.alpha` where ComfyUI reads one);
the kohya `lora_unet_*` layout is LoRA-only and refused. Its own keys: lokr_factor, lokr_decompose_both.
"""

from anima_train.adapters.base import AdapterMethod


def check(adapter, rules) -> None:
    if rules.ok("lokr_factor") and adapter.lokr_factor != -1 and adapter.lokr_factor < 1:
        rules.error(f"[adapter] lokr_factor = {adapter.lokr_factor}: use -1 (most balanced) or a factor >= 1",
                    "lokr_factor")


METHOD = AdapterMethod(
    name="lokr",
    kind="lokr",
    title="LoKr",
    order=1,
    summary="",
    layout="LoKr files use diffusion_model.<module>.lokr_* keys, which ComfyUI loads",
    dropout="rank dropout",
    shape_keys=("rank", "lokr_factor", "lokr_decompose_both"),
    text_encoder=False,
    check=check,
    network_module="lycoris.kohya",
    architecture="/lycoris",
    network_args={"algo": "lokr"},
)
