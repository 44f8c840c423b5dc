"""LoRA: ΔW = B·A·alpha/rank on each adapted Linear (peft `LoraConfig`).

Files: `diffusion_model.<native module>.lora_A/lora_B.weight` with the scale folded into lora_B (ComfyUI and diffusers'
Anima loader both read it), or with `[adapter] output_format = "kohya"` sd-scripts' `lora_unet_<module>.lora_down/
lora_up/alpha`. The Qwen3 `_te` file is a LoRA whatever the kind (export.py).
"""

from anima_train.adapters.base import AdapterMethod

METHOD = AdapterMethod(
    name="lora",
    kind="lora",
    title="LoRA",
    order=0,
    summary="",
    layout="LoRA files use diffusion_model.<module>.lora_A/lora_B keys (or lora_unet_* with output_format = "
           '"kohya"), which ComfyUI loads',
    dropout="on the layer input",
    shape_keys=("rank",),
    exclusive={"output_format": "the kohya lora_unet_* layout defines LoRA only (lora_down/lora_up/alpha)"},
    network_module="networks.lora",
    architecture="/lora",
    factors=("lora_A.weight", "lora_B.weight", "lora_down.weight", "lora_up.weight", "alpha"),
)
