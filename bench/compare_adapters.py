"""Compare the LoRA updates of two runs (bench_train_gpu.py --save-adapter): the A/B of a change that is not exact.

    python3 bench/compare_adapters.py A.safetensors B.safetensors

Both runs start from the same LoRA (same seed: the same A, and B = 0), so each layer's learned update is
ΔW = B·A. Prints one JSON line: the cosine between the two runs' updates over all layers together (the update
direction), the lowest per-layer cosine, and the relative difference of their norms.
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file


def updates(path: str) -> dict[str, torch.Tensor]:
    tensors = load_file(path)
    out = {}
    for name, b in tensors.items():
        if ".lora_B." in name:
            a = tensors[name.replace(".lora_B.", ".lora_A.")]
            out[name.replace(".lora_B.", ".")] = (b.double() @ a.double()).flatten()
    return out


def main() -> int:
    first, second = updates(sys.argv[1]), updates(sys.argv[2])
    if sorted(first) != sorted(second) or not first:
        raise SystemExit("the two files do not hold the same LoRA layers")
    names = sorted(first)
    a = torch.cat([first[n] for n in names])
    b = torch.cat([second[n] for n in names])
    per_layer = {n: torch.nn.functional.cosine_similarity(first[n], second[n], dim=0).item() for n in names}
    worst = min(per_layer, key=per_layer.get)
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    print(json.dumps({"layers": len(names), "cosine": round(cosine, 5),
                      "lowest_layer_cosine": round(per_layer[worst], 5), "lowest_layer": worst,
                      "norm_a": round(a.norm().item(), 6), "norm_b": round(b.norm().item(), 6),
                      "norm_rel_diff": round(abs(a.norm().item() - b.norm().item()) / a.norm().item(), 5)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
