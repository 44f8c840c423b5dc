"""A step's numbers on their way to the host without stalling the GPU: the micro-batches' [loss, mse, hf, ot] summed
on the device, one copy per optimizer step queued before the backward (memory.HostCopy), and under several processes
one gather that also carries each rank's stop vote and peak memory (no extra sync)."""

from __future__ import annotations

import torch

from anima_train.training.memory import HostCopy


def loss_values(loss: torch.Tensor, loss_parts: dict) -> torch.Tensor:
    """[loss, mse, hf, ot] of one micro-batch as one device tensor: summed on the device, the host reads them once
    per optimizer step, not once per micro-batch. A part that is a Python number is filled in on the device (a
    tensor made on the host would be copied in: a host sync)."""
    loss = loss.detach().float()

    def value(part):
        return part.detach().float() if torch.is_tensor(part) else torch.full((), float(part), device=loss.device)

    return torch.stack([loss] + [value(loss_parts.get(k, d)) for k, d in (("mse", loss), ("hf", 0.0), ("ot", 0.0))])


class StepTotals:
    """What the micro-batches of one optimizer step add up to: their loss values (on the device) and images."""

    def __init__(self):
        self.values, self.micro, self.images = None, 0, 0

    def add(self, values: torch.Tensor) -> None:
        self.values = values if self.values is None else self.values + values
        self.micro += 1

    def mean(self) -> torch.Tensor:
        """The mean over this step's micro-batches; the sum starts again."""
        mean = self.values / self.micro
        self.values, self.micro = None, 0
        return mean


def peak_gib(device: torch.device) -> float:
    # the caching allocator's host-side counter (no sync); it counts the queued kernels' memory already
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def send(accelerator, stats: torch.Tensor, *, stop_vote: bool) -> HostCopy:
    """This step's [loss, mse, hf, ot] (the mean over processes), on its way to the host, queued after the
    forward. With several processes each one's stop vote and peak memory travel with it."""
    world = accelerator.num_processes
    if world == 1:
        return HostCopy(stats)
    own = torch.stack([torch.full((), float(stop_vote), device=stats.device),  # filled on the device: no copy-in
                       torch.full((), peak_gib(stats.device), device=stats.device)])
    rows = accelerator.gather(torch.cat([stats.float(), own])).view(world, -1)
    return HostCopy(torch.cat([rows[:, :4].mean(0), rows[:, 4], rows[:, 5]]))


def receive(readout: HostCopy, accelerator) -> tuple[list[float], list[float], list[float]]:
    """(stats, stop votes, peak GiB per rank) of the step whose readout this is; no peaks off CUDA."""
    world, values = accelerator.num_processes, readout.read()
    if world == 1:
        stats, votes, peaks = values, [], [peak_gib(accelerator.device)]
    else:
        stats, votes, peaks = values[:4], values[4:4 + world], values[4 + world:]
    return stats, votes, [round(p, 2) for p in peaks] if accelerator.device.type == "cuda" else []
