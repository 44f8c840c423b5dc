"""A step's numbers on their way to the host without stalling the GPU: the loss and its named parts (flow.flow_loss's
terms, the OT pairing's moved fraction) of the micro-batches summed on the device, one copy per optimizer step queued
before the backward (memory.HostCopy), and under several processes one gather that also carries each rank's stop
vote and peak memory (no extra sync). The names travel beside the values: which parts a step has is the config's
(every micro-batch and rank has the same)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from anima_train.training.memory import HostCopy


def loss_values(loss: torch.Tensor, loss_parts: dict) -> torch.Tensor:
    """[loss, *loss_parts.values()] of one micro-batch as one device tensor: summed on the device, the host reads
    them once per optimizer step, not once per micro-batch. A part that is a Python number is filled in on the
    device (a tensor made on the host would be copied in: a host sync)."""
    loss = loss.detach().float()

    def value(part):
        return part.detach().float() if torch.is_tensor(part) else torch.full((), float(part), device=loss.device)

    return torch.stack([loss] + [value(part) for part in loss_parts.values()])


class StepTotals:
    """What the micro-batches of one optimizer step add up to: their named loss values (on the device) and images."""

    def __init__(self):
        self.names, self.values, self.micro, self.images = None, None, 0, 0

    def add(self, loss: torch.Tensor, loss_parts: dict) -> None:
        names = ("loss", *loss_parts)
        if self.names is not None and names != self.names:
            raise RuntimeError(f"a micro-batch's loss parts {names} differ from the run's {self.names}")
        values = loss_values(loss, loss_parts)
        self.names, self.values = names, values if self.values is None else self.values + values
        self.micro += 1

    def mean(self) -> torch.Tensor:
        """The mean over this step's micro-batches, in the order of `names`; the sum starts again."""
        mean = self.values / self.micro
        self.values, self.micro = None, 0
        return mean


@dataclass
class Readout:
    """A step's values on their way to the host, and their names."""
    names: tuple[str, ...]
    copy: HostCopy


def peak_gib(device: torch.device) -> float:
    # the caching allocator's host-side counter (no sync); it counts the queued kernels' memory already
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def send(accelerator, names: tuple[str, ...], stats: torch.Tensor, *, stop_vote: bool) -> Readout:
    """This step's named values (the mean over processes), on their way to the host, queued after the forward.
    With several processes each one's stop vote and peak memory travel with them."""
    world = accelerator.num_processes
    if world == 1:
        return Readout(names, HostCopy(stats))
    n = len(names)
    own = torch.stack([torch.full((), float(stop_vote), device=stats.device),  # filled on the device: no copy-in
                       torch.full((), peak_gib(stats.device), device=stats.device)])
    rows = accelerator.gather(torch.cat([stats.float(), own])).view(world, -1)
    return Readout(names, HostCopy(torch.cat([rows[:, :n].mean(0), rows[:, n], rows[:, n + 1]])))


def receive(readout: Readout, accelerator) -> tuple[dict[str, float], list[float], list[float]]:
    """({name: value} with "loss" first, stop votes, peak GiB per rank) of the step whose readout this is; no peaks
    off CUDA."""
    world, values, n = accelerator.num_processes, readout.copy.read(), len(readout.names)
    if world == 1:
        stats, votes, peaks = values, [], [peak_gib(accelerator.device)]
    else:
        stats, votes, peaks = values[:n], values[n:n + world], values[n + world:]
    return (dict(zip(readout.names, stats)), votes,
            [round(p, 2) for p in peaks] if accelerator.device.type == "cuda" else [])
