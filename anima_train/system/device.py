"""Host-to-device copies that do not stall the GPU: the one helper the model code (prompt encoding) and the
training step share, so it lives below both."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on the device without a host sync: from pinned memory the copy is queued behind the running
    kernels; from pageable memory CUDA would first wait for all of them."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
