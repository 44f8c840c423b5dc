"""The batch sampler: bucket-homogeneous batches, deterministic per (seed, epoch), and the steps an epoch makes.

Split from data/dataset.py (which builds the entries it samples from): the sampler knows only indices, their group keys
(bucket, texture eligibility) and a batch size per group; the texture schedule, when there is one, marks its batches.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import Iterator, NamedTuple, Sequence


class BucketBatchSampler:
    """Bucket-homogeneous batches of dataset indices (a torch batch_sampler).

    Indices are grouped by (bucket, texture eligibility); each epoch every group is shuffled with a generator
    seeded from (seed, epoch), cut into batches of the group's batch size keeping the partial tail, and the
    batch order is shuffled. Deterministic per (seed, epoch) and rank-agnostic: it yields whole batches and
    Accelerate's data loader shards them across processes (never shard here). It deliberately has no
    `batch_size` attribute: Accelerate's BatchSamplerShard then treats batches as variable-length lists and, with
    even_batches, pads a short last round with whole earlier batches, so every batch stays one bucket.
    """

    def __init__(self, group_keys: Sequence, batch_sizes: dict, seed: int = 0):
        self.groups: dict = defaultdict(list)
        for index, key in enumerate(group_keys):
            self.groups[key].append(index)
        self.keys = sorted(self.groups)  # fixed order, independent of dict insertion
        missing = [k for k in self.keys if k not in batch_sizes]
        if missing:
            raise ValueError(f"no batch size for group(s) {missing}")
        self.batch_sizes = {k: int(batch_sizes[k]) for k in self.keys}
        self.seed = int(seed)
        self.epoch = 0
        self.texture = None  # a texture.TextureSchedule when the curriculum has texture phases

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return sum(math.ceil(len(self.groups[k]) / self.batch_sizes[k]) for k in self.keys)

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        epoch = self.epoch if epoch is None else int(epoch)
        rng = random.Random(f"anima-sampler/{self.seed}/{epoch}")
        out = []
        for k in self.keys:
            idx = list(self.groups[k])
            rng.shuffle(idx)
            bs = self.batch_sizes[k]
            out += [idx[i:i + bs] for i in range(0, len(idx), bs)]
        rng.shuffle(out)
        # texture phases: the same batches, the texture ones as (index, canvas) pairs (own RNG: order unchanged)
        return self.texture.mark(out, epoch) if self.texture is not None else out

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches())

    def largest_batch_tokens(self) -> int:
        """DiT tokens x images of the largest batch any epoch can hold (what sizes the activation memory); a
        texture-eligible group may be cut to its largest canvas instead of its bucket."""
        canvases = [(int(w), int(h)) for w, h in self.texture.tcfg.canvases] if self.texture is not None else []

        def tokens(key) -> int:
            sizes = [key[0]] + (canvases if key[1] else [])
            return max((w // 16) * (h // 16) for w, h in sizes)

        return max(min(len(self.groups[k]), self.batch_sizes[k]) * tokens(k) for k in self.keys)


class EpochKey(NamedTuple):
    """A dataset key with the epoch it belongs to: a DataLoader worker that persists across epochs holds its own
    copy of the dataset, whose set_epoch() the main process cannot reach, so the epoch travels with each key."""

    epoch: int
    key: object  # an index, or (index, canvas) for a texture sample


class EpochKeys:
    """The training loader's batch sampler: `sampler`'s batches, each key an EpochKey of the epoch the sampler is in
    when the loader starts iterating (the same epoch its batch order was drawn for). Like the sampler it has no
    `batch_size` (see BucketBatchSampler); set_epoch reaches the sampler (accelerate calls it on the batch sampler)."""

    def __init__(self, sampler: BucketBatchSampler):
        self.inner = sampler

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[list[EpochKey]]:
        epoch = self.inner.epoch
        return iter([[EpochKey(epoch, k) for k in batch] for batch in self.inner.batches(epoch)])


def steps_per_epoch(num_batches: int, num_processes: int = 1, accum: int = 1) -> int:
    """Optimizer steps per epoch: ceil(ceil(batches / processes) / accum); a partial accumulation group still
    steps (docs/training.md#batches-and-steps: 113 images, batch 12, accum 2, 2 processes -> 10 batches -> 3 steps)."""
    return math.ceil(math.ceil(num_batches / max(1, num_processes)) / max(1, accum))


def settings_not_followed(cfg, sampler: BucketBatchSampler, per_epoch: int) -> list[str]:
    """Settings a run cannot follow as written, one line each (train says them before the model loads, config
    too): a batch size no bucket fills (a batch never mixes buckets), and a max_steps beyond what the epochs give
    (the epochs still bound the run)."""
    out = []
    groups = sampler.groups
    if all(sampler.batch_sizes[k] > len(groups[k]) for k in sampler.keys):
        largest = max(len(g) for g in groups.values())
        out.append(f"[train] batch_size = {cfg.train.batch_size}: no bucket holds that many images (the largest "
                   f"holds {largest}; a batch never mixes buckets), so every batch is smaller; lower batch_size "
                   f"or add images")
    epochs_total = per_epoch * cfg.train.epochs
    if cfg.train.max_steps and cfg.train.max_steps > epochs_total:
        out.append(f"[train] max_steps = {cfg.train.max_steps} is more than epochs = {cfg.train.epochs} give "
                   f"({per_epoch} step(s) each, {epochs_total} in all): the run stops at step {epochs_total}; "
                   f"raise epochs to train {cfg.train.max_steps} steps")
    return out
