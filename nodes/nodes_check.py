"""Environment check node: the ComfyUI face of `anima-train check`.

ComfyUI-Manager installs requirements.txt into ComfyUI's environment, where another pack may have pinned an old
diffusers or a torchvision for the wrong torch. This node shows what the trainer sees, before a training run fails.
"""

from __future__ import annotations

from anima_train.system.check import run_checks

from .comfy import CATEGORY, io


class AnimaEnvironmentCheck(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="AnimaTrainEnvironmentCheck",
            display_name="Anima: Check environment",
            category=CATEGORY,
            description="Imports every dependency of the Anima trainer and reports versions, devices and "
                        "optional pieces (scipy for OT; triton for SDNQ kernels and compile, judged by compiling "
                        "a kernel on the GPU, with the exact triton-windows pin for this torch on Windows).",
            inputs=[],
            outputs=[io.String.Output(display_name="report")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls):
        report = run_checks()
        text = report.text()
        return io.NodeOutput(text, ui={"text": [text]})


NODES = [AnimaEnvironmentCheck]
