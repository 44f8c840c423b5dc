"""anima_train: a diffusers-native trainer for Anima (Cosmos-Predict2 DiT + LLM adapter) adapters.

Importing this package is cheap on purpose: ComfyUI imports the pack at start-up, and the CLI's `--help` must not
pay for torch. Heavy modules (torch, diffusers, peft) are imported by the submodules that need them.
"""

__version__ = "0.1.0"
