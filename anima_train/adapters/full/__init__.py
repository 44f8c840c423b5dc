"""Full finetune ([adapter] kind = "none"): nothing is injected; every weight of the DiT and the LLM adapter is a
candidate, grouped by the component that owns it (inject.owner_component), frozen where its LR is 0.

Files: the native single file (`net.*`, the released checkpoint's 685 names) for ComfyUI's UNETLoader, or with
`[train] save_native = false` the diffusers folders `<stem>/transformer/` + `<stem>/text_conditioner/`.
"""

from anima_train.adapters.base import AdapterMethod


def output_name(stem: str, cfg) -> str:
    return f"{stem}.safetensors" if cfg.train.save_native else stem


METHOD = AdapterMethod(
    name="full",
    kind="none",
    title="full finetune",
    order=99,
    summary="full finetune",
    layout="a full finetune is written as a model file (train.save_native), not a LoRA",
    trains_base=True,
    comfy_folder="diffusion_models",
    output_name=output_name,
)
