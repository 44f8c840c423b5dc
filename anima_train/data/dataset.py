"""The dataset pipeline: scan folders, bucket every source at every tier, find (and check) latent caches, and
serve bucket-homogeneous batches (docs/training.md: buckets, latent caches, tiers, batches, captions).

    build_training_data(cfg, model_path) -> TrainingData   what the trainer calls
    the steps it runs, also used by `anima-train cache` / `audit`: scan.py (folders, modes), sources.py (images,
    captions), planning.py (buckets per tier, cache checks), cache_files.py (a cache's name, header and latents)

Folders. A source folder (`[dataset] path` or a `[[dataset.subsets]]` path) is scanned for images
(.png .jpg .jpeg .webp .bmp), captions `<stem>.txt` (+ optional `<stem>_nl.txt`) and latent caches
`<stem>_WWWWxHHHH_anima.safetensors`. Its immediate subfolders named like sd-scripts' DreamBooth folders,
`N_name` (e.g. `10_char`), are scanned too, each as its own group repeated N x the subset's `num_repeats`
(so `num_repeats = 2` and a subfolder `10_char` give 20 repeats); files directly in the folder get `num_repeats`.
Other subfolders are not scanned (reported). A source folder itself named `N_name` gets no extra factor: its
repeats are what the config says. Scanning is not recursive below the `N_name` level.

Source modes (`[dataset] source`): `images` buckets from the images and reads their caches (every expected
(image, bucket) pair must have a valid cache); `latents` reads caches only (images may be deleted: the source
size comes from the cache's `original_size`); `encode` buckets like `images` and yields pixels for the trainer's
VAE; `auto` is `latents` for a folder without images, and for image folders `images` when every pair has a valid
cache, else `encode` (said in the report). Every folder must end up in one mode.

Caches. One safetensors file per (source, bucket) beside the image: tensor `latents` (16, 1, H/8, W/8), float32,
normalised per channel with the VAE's `latents_mean/std`; metadata `bucket`, `original_size`, `resized`, `trim`,
`crop_ltrb` and `settings`, a JSON record of what it depends on (tier, resolutions, the bucket keys, the VAE's
identity). A cache is valid when its plan (original size, resized size, trim, bucket) equals the plan the current
settings give and its VAE is the current one; otherwise the scan refuses and says which setting changed. A cache
is damaged when it cannot be read or its tensor is not float32 (16, 1, H/8, W/8) for the bucket in its name; the
scan treats it like a stale one (`anima-train cache` re-encodes it) and names the file, and the loader checks the
layout again when it reads the tensor.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from PIL import Image

from anima_train.data.batches import BucketBatchSampler, EpochKey
from anima_train.data.buckets import BucketPlan, crop_ltrb, tier_counts, tier_report
from anima_train.data.cache_files import (cache_bucket, cache_damage, load_latents, read_cache_metadata, vae_identity,
    wxh)
from anima_train.data.captions import build_caption, read_caption_files
from anima_train.data.errors import DatasetError, the_dataset, the_resolution
from anima_train.data.images import open_image
from anima_train.data.planning import (BucketSettings, CacheCheck, Entry, Plan, check_caches, plan_sources,
    plan_warnings, stale_cache_error)
from anima_train.data.scan import Scan, resolve_modes, scan_folders
from anima_train.data.sources import (Source, UnreadableImages, cache_sources, find_undecodable, image_sources,
    missing_captions, read_failure, refuse_missing_captions, refuse_unreadable_captions)
from anima_train.data.texture import TextureSchedule, feasibility_report, split_key, texture_phases, texture_sample
from anima_train.fixes import ref


# ----------------------------------------------------------------------------------------------------------
# Pixels and latents


def load_pixels(image: Path, plan: BucketPlan):
    """The training crop as a float tensor [3, 1, H, W] in [-1, 1]: LANCZOS resize to plan.resized, then the
    bucket-sized window at plan.trim. Shared by `anima-train cache` and source = "encode", so both paths see
    bit-identical pixels."""
    # lazy: torch (~4.6 s): the scan steps and `anima-train audit` import this module without needing torch
    import torch

    try:
        im = open_image(image)
    except Exception as e:  # noqa: BLE001 (the scan decoded it: the file changed or broke since)
        raise DatasetError(f"{image} cannot be read ({read_failure(e)}): the file changed during the run; fix "
                           f"or delete it and restart") from e
    with im:
        if im.size != plan.source:
            raise DatasetError(f"{image} is {wxh(im.size)} but was scanned as {wxh(plan.source)}: the file "
                               f"changed during the run; restart to re-scan")
        if im.size != plan.resized:
            im = im.resize(plan.resized, Image.LANCZOS)
        (x, y), (w, h) = plan.trim, plan.bucket
        if x < 0 or y < 0 or x + w > im.size[0] or y + h > im.size[1]:
            raise DatasetError(f"{image}: trim window {plan.trim} + {wxh(plan.bucket)} exceeds the resized "
                               f"{wxh(im.size)} (a bucketing bug; please report it)")
        im = im.crop((x, y, x + w, y + h))
        arr = np.asarray(im, dtype=np.float32)
    return torch.from_numpy(arr / 127.5 - 1.0).permute(2, 0, 1).unsqueeze(1).contiguous()


def encode_latents(vae, pixels):
    """Normalised latents (docs/model.md#latent-normalisation): (vae.encode(x).latent_dist.mode() - mean) / std, fp32.
    pixels: [B, 3, 1, H, W] in [-1, 1] -> [B, 16, 1, H/8, W/8]."""
    # lazy: torch (~4.6 s): the scan steps and `anima-train audit` import this module without needing torch
    import torch

    p = next(vae.parameters())
    with torch.no_grad():
        z = vae.encode(pixels.to(device=p.device, dtype=p.dtype)).latent_dist.mode().float()
    mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=z.device).view(1, -1, 1, 1, 1)
    return (z - mean) / std


# ----------------------------------------------------------------------------------------------------------
# Dataset, collate, batch sizes (the sampler: data/batches.py)


@dataclass(frozen=True)
class Item:
    """What one dataset index reads (entries expanded by their folder's repeats)."""

    stem: Path
    image: Path | None
    cache: Path | None
    plan: BucketPlan
    tier: int
    texture: bool


class AnimaDataset:
    """Map-style dataset (torch's Dataset protocol). `__getitem__(i)` -> {latents | pixels, caption, bucket,
    index, tier, texture}; the caption is rebuilt every call from a (seed, epoch, index) RNG, the epoch being
    set_epoch()'s or the one a batches.EpochKey carries. A texture sample
    (the sampler yields (index, canvas) in texture phases, see anima_train/data/texture.py) is a canvas crop of the
    source with a loss_mask, captioned with `texture_options.trigger`."""

    def __init__(self, items: Sequence[Item], mode: str, caption_options, seed: int = 0,
                 uncaptioned: Iterable[Path] = (), texture_options=None):
        self.items = list(items)
        self.texture_options = texture_options
        self.uncaptioned = frozenset(uncaptioned)  # stems allowed to have no <stem>.txt: an empty caption
        self.mode = mode
        self.caption_options = caption_options
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key) -> dict:
        epoch = self.epoch
        if isinstance(key, EpochKey):  # the training loader's keys carry their epoch (persistent workers)
            epoch, key = key.epoch, key.key
        index, canvas = split_key(key)
        it = self.items[index]
        if canvas is not None:
            out = texture_sample(it.image, canvas, self.texture_options, self.seed, epoch, index)
            return {**out, "index": index, "tier": it.tier, "texture": True}
        tags, nl = ("", None) if it.stem in self.uncaptioned else read_caption_files(it.stem)
        out = {
            "caption": build_caption(tags, nl, self.caption_options, self.seed, epoch, index),
            "bucket": it.plan.bucket,
            "index": index,
            "tier": it.tier,
            "texture": it.texture,
        }
        if self.mode == "encode":
            out["pixels"] = load_pixels(it.image, it.plan)
        else:
            out["latents"] = load_latents(it.cache, it.plan.bucket)
        return out


def collate(batch: Sequence[dict]) -> dict:
    """Stack one bucket-homogeneous batch: latents [B,16,1,h,w] or pixels [B,3,1,H,W]; lists for the rest."""
    # lazy: torch (~4.6 s): the scan steps and `anima-train audit` import this module without needing torch
    import torch

    buckets = {b["bucket"] for b in batch}
    if len(buckets) != 1:
        raise ValueError(f"a batch mixes buckets {sorted(buckets)}: use BucketBatchSampler as batch_sampler")
    out = {"bucket": batch[0]["bucket"], "caption": [b["caption"] for b in batch],
           "index": [b["index"] for b in batch], "tier": [b["tier"] for b in batch],
           "texture": [b["texture"] for b in batch]}
    key = "pixels" if "pixels" in batch[0] else "latents"
    out[key] = torch.stack([b[key] for b in batch])
    if "loss_mask" in batch[0]:  # a texture batch: [B, 1, 1, h, w]
        out["loss_mask"] = torch.stack([b["loss_mask"] for b in batch])
    return out


def bucket_batch_sizes(entries_by_bucket: dict[tuple[int, int], set[int]], batch_size) -> dict[tuple[int, int], int]:
    """Batch size per bucket: an int everywhere, or {tier: int} where a bucket shared by several tiers takes the
    largest tier's batch size (its memory cost is that of the largest tier it serves)."""
    if isinstance(batch_size, int):
        return {b: batch_size for b in entries_by_bucket}
    out = {}
    for bucket, tiers in entries_by_bucket.items():
        top = max(tiers)
        if top not in batch_size:
            raise DatasetError(f"[train] batch_size has no entry for tier {top} (keys: {sorted(batch_size)})")
        out[bucket] = int(batch_size[top])
    return out


# ----------------------------------------------------------------------------------------------------------
# Building it all


@dataclass
class TrainingData:
    mode: str  # images | latents | encode
    sources: list[Source]
    entries: list[Entry]
    dataset: AnimaDataset
    sampler: BucketBatchSampler
    report: list[str]  # startup lines
    warnings: list[str]
    settings: BucketSettings
    scan: Scan = field(repr=False, default=None)
    held_out: list[Item] = field(default_factory=list)  # [validation] fraction: one item per held-out source


    def set_epoch(self, epoch: int) -> None:
        """New batch order and new captions for this epoch (sampler and dataset)."""
        self.sampler.set_epoch(epoch)
        self.dataset.set_epoch(epoch)

    def set_run(self, total: int, steps_per_epoch: int, processes: int = 1, accum: int = 1) -> None:
        """The run's shape, which the sampler needs to place texture phases (no-op without them)."""
        if self.sampler.texture is not None:
            self.sampler.texture.set_run(total, steps_per_epoch, processes, accum)


def _latents_entries(scan: Scan, settings: BucketSettings, vae_id: str | None,
                     warn: list[str]) -> tuple[list[Source], Plan, CacheCheck]:
    """Latents mode: sources from cache metadata, planned like images, attributed to tiers by plan match."""
    metadata: dict[Path, dict] = {}
    for f in scan.folders:
        if f.mode == "latents":
            for paths in f.caches.values():
                for p in paths:
                    metadata[p] = read_cache_metadata(p)
    sources = cache_sources(scan, metadata)
    plan = plan_sources(sources, settings)
    check = check_caches(scan, plan, settings, vae_id, metadata)
    # caches without original_size: attributable only when there is one tier and one such cache per stem
    extra = []
    for s in plan.unsized:
        paths = scan.folders[s.folder].caches[s.stem.name]
        if len(settings.tiers) > 1:
            raise DatasetError(
                f"caches without original_size fit no one of several tiers: set {the_resolution()} to one tier, or "
                + ref("run cache", "re-cache from the images with anima-train cache")
                + f"\ncaches for {s.stem} carry no original_size, so they cannot be attributed to one of the tiers "
                  f"{list(settings.tiers)}")
        if len(paths) > 1:
            raise DatasetError(f"{len(paths)} caches of one image in {the_dataset()} lack original_size: keep one of "
                               f"them\n{len(paths)} caches for {s.stem} carry no original_size and only one can be "
                               f"used per source: keep one of {', '.join(p.name for p in paths)}")
        bucket = cache_bucket(paths[0])
        if why := cache_damage(check.metadata[paths[0]], bucket):
            raise DatasetError(f"a latent cache in {the_dataset()} is damaged: delete it, or restore its image and "
                               + ref("run cache", "re-run anima-train cache")
                               + f"\nlatent cache {paths[0]} is damaged: {why} (its image is gone, so it cannot be "
                                 f"re-encoded)")
        bplan = BucketPlan(bucket, bucket, bucket, crop_ltrb(bucket, bucket), (0, 0))
        plan.sources.append(s)
        extra.append(Entry(len(plan.sources) - 1, settings.tiers[0], bplan, False, paths[0]))
    if extra:
        warn.append(f"{len(extra)} cache(s) carry no original_size: used as-is at tier {settings.tiers[0]} "
                    f"(their bucket cannot be checked against the settings)")
    check.entries += extra
    return sources, plan, check


def _auto_mode(scan: Scan, settings: BucketSettings, vae_id: str | None) -> tuple[str, str | None]:
    """source = "auto" on image folders: "images" (train on the caches) when every image has a valid cache at every
    tier, else "encode" for all of them (a batch is all latents or all pixels) and the line that says so. A stale
    cache is never trained on: it counts as missing. source = "images" refuses instead (stale_cache_error)."""
    sources, _ = image_sources(scan, skip_unreadable=True, decode=False)
    plan = plan_sources(sources, settings)
    missing = {plan.sources[e.source].image for e, _ in check_caches(scan, plan, settings, vae_id).missing}
    if not missing:
        return "images", None
    for f in scan.folders:
        f.mode = "encode"
    return "encode", (f"source   auto: {len(missing)} of {len(plan.sources)} image(s) have no valid latent cache for "
                      f"these settings, so every image is encoded in the training loop; caching the latents first with "
                      f"{ref('name cache', '`anima-train cache`')} makes later runs faster")


def build_training_data(cfg, model_path=None, *, skip_unreadable: bool = False,
                        allow_missing_captions: bool = False) -> TrainingData:
    """Scan, plan, check caches and build the dataset + sampler + startup report for a loaded Config.
    Sources without a caption file are refused, or with allow_missing_captions trained on an empty caption."""
    d = cfg.dataset
    settings = BucketSettings.from_config(d)
    warn: list[str] = []
    scan = scan_folders(d.resolved_subsets())
    mode = resolve_modes(scan, d.source)
    if mode != "encode" and any(ph.mode == "texture" for ph in getattr(cfg, "curriculum", ())):
        # load_config refuses this; a Config changed in code must not get as far as the cache check
        raise DatasetError(f'a texture [[curriculum]] phase needs [dataset] source = "encode" (crops are chosen '
                           f'per step), but the dataset resolved to {mode!r}')
    vae_id = None
    if mode != "encode" and model_path is not None:
        vae_id = vae_identity(model_path)
        if vae_id is None:
            warn.append(f"no VAE under {model_path}/vae: the caches' VAE identity is not checked")

    live = None  # source = "auto" without a valid cache for every image: the line that says so
    if mode == "images" and d.source == "auto":
        mode, live = _auto_mode(scan, settings, vae_id)
    if mode == "latents":
        sources, plan, check = _latents_entries(scan, settings, vae_id, warn)
    else:
        # encode decodes every image while training: decode them all now (cached images are never decoded)
        sources, bad = image_sources(scan, skip_unreadable=skip_unreadable, decode=mode == "encode")
        if bad:
            warn.append(f"skipped {len(bad)} unreadable image(s): " + ", ".join(str(p) for p, _ in bad[:5])
                        + (" ..." if len(bad) > 5 else ""))
        plan = plan_sources(sources, settings)
        check = check_caches(scan, plan, settings, vae_id) if mode == "images" else None
        if check is not None and check.missing:
            # images that still need a cache will be decoded by `cache`: one that cannot be is named now, not
            # behind a "run cache" that then fails on it
            undecodable = find_undecodable(plan.sources[e.source].image for e, _ in check.missing)
            if undecodable and not skip_unreadable:
                raise UnreadableImages(undecodable)
            if undecodable:
                gone = {p for p, _ in undecodable}
                warn.append(f"skipped {len(gone)} undecodable image(s) without a cache: "
                            + ", ".join(str(p) for p in sorted(gone)[:5]) + (" ..." if len(gone) > 5 else ""))
                sources = [s for s in sources if s.image not in gone]
                plan = plan_sources(sources, settings)
                check = check_caches(scan, plan, settings, vae_id)
        orphans = sum(1 for f in scan.folders for stem in f.caches if stem not in f.images)
        if orphans and mode == "images":
            warn.append(f"{orphans} cached stem(s) have no image and are not used under source = images: set "
                        f'source = "latents" to train on every cache')
    uncaptioned = missing_captions(scan, plan.sources)
    if not allow_missing_captions:
        refuse_missing_captions(uncaptioned, "cache" if mode == "latents" else "image")
    elif uncaptioned:
        warn.append(f"{len(uncaptioned)} source(s) have no caption file and train on an empty caption "
                    f"(--allow-missing-captions), e.g. {uncaptioned[0]}")
    refuse_unreadable_captions(plan.sources)
    if check is not None:
        if check.missing:
            raise stale_cache_error(scan, plan, check, settings, vae_id, model=model_path,
                                    config=getattr(cfg, "source_path", None),
                                    allow_missing_captions=allow_missing_captions)
        entries = check.entries
    else:
        entries = plan.entries
    if not entries:
        if plan.dropped_small:
            raise DatasetError(f"[dataset] min_source_area = {settings.min_source_area} drops every image: lower it, "
                               f"or add larger images\n{len(plan.dropped_small)} source(s) in {the_dataset()} are "
                               f"smaller than {settings.min_source_area} x {min(settings.tiers)}^2 px")
        raise DatasetError(f"no usable image in {the_dataset()}: every one was left out as unreadable; fix them "
                           f"(the warnings name them)")
    entries, held_out = _split_off(cfg, plan, scan, entries)

    # expand repeats into dataset items
    items, keys = [], []
    for e in entries:
        src = plan.sources[e.source]
        folder = scan.folders[src.folder]
        item = Item(src.stem, src.image, e.cache, e.plan, e.tier, folder.texture)
        items += [item] * folder.repeats
        keys += [(e.plan.bucket, folder.texture)] * folder.repeats
    tiers_by_bucket: dict = defaultdict(set)
    for e in entries:
        tiers_by_bucket[e.plan.bucket].add(e.tier)
    per_bucket = bucket_batch_sizes(tiers_by_bucket, cfg.train.batch_size)
    sampler = BucketBatchSampler(keys, {k: per_bucket[k[0]] for k in set(keys)}, seed=cfg.train.seed)
    dataset = AnimaDataset(items, mode, d.caption, seed=cfg.train.seed,
                           uncaptioned=(p.with_name(p.name[:-len(".txt")]) for p in uncaptioned),
                           texture_options=d.texture)
    texture_lines = _attach_texture(cfg, items, sampler)

    n_sized = sum(1 for s in plan.sources if s.size is not None)
    sized_entries = [e for e in entries if plan.sources[e.source].size is not None]
    lines = tier_report(tier_counts(sized_entries, n_sized, settings.tiers), n_sized)[0]
    report = startup_report(scan, plan, entries, items, sampler, mode) + ([live] if live else []) + lines \
        + texture_lines
    warn += plan_warnings(plan, settings, check, vae_id) + scan.notes
    if held_out:
        report.append(f"validation: {len(held_out)} image(s) held out (fraction {cfg.validation.fraction}, seed "
                      f"{cfg.validation.seed}), never trained on: " + ", ".join(it.stem.name for it in held_out))
    return TrainingData(mode, plan.sources, entries, dataset, sampler, report, warn, settings, scan, held_out)


def held_out_stems(stems: Sequence[str], fraction: float, seed: int) -> set[str]:
    """The sources `[validation] fraction` holds out: round(fraction x n) of them, at least 2 (the text-conditioning
    margin swaps captions between images), drawn by `seed` from the names sorted, so the same folder and seed hold out
    the same images on every machine and in every run."""
    names = sorted(set(stems))
    k = max(2, round(fraction * len(names)))
    if len(names) - k < 1:
        raise DatasetError(f"[validation] fraction = {fraction} leaves no image to train on: lower it, or add "
                           f"images\n[validation] fraction = {fraction} holds out {k} of the dataset's {len(names)} "
                           f"image(s) (at least 2 for the caption margin), leaving none to train on; or use "
                           f"[validation] folder = a separate held-out folder")
    return set(random.Random(seed).sample(names, k))


def _split_off(cfg, plan: Plan, scan: Scan, entries: list[Entry]) -> tuple[list[Entry], list[Item]]:
    """The training entries without the held-out sources, and one item per held-out source (the first tier planned
    for it). Nothing is held out unless `[validation] fraction` is set."""
    v = getattr(cfg, "validation", None)
    if v is None or not v.fraction:
        return entries, []
    stems = {str(plan.sources[e.source].stem) for e in entries}
    out = held_out_stems(stems, v.fraction, v.seed)
    held: dict[str, Item] = {}
    for e in entries:
        src = plan.sources[e.source]
        if str(src.stem) in out and str(src.stem) not in held:
            held[str(src.stem)] = Item(src.stem, src.image, e.cache, e.plan, e.tier, False)
    return ([e for e in entries if str(plan.sources[e.source].stem) not in out],
            [held[k] for k in sorted(held)])


def _attach_texture(cfg, items: Sequence[Item], sampler: BucketBatchSampler) -> list[str]:
    """Texture phases: give the sampler its TextureSchedule; the startup lines (canvas feasibility)."""
    phases = texture_phases(cfg)
    if not phases:
        return []
    sampler.texture = TextureSchedule(cfg.curriculum, cfg.dataset.texture, [it.plan.source for it in items],
                                      [it.texture for it in items], cfg.train.seed)
    sizes = sorted({(it.stem, it.plan.source) for it in items if it.texture}, key=str)
    return feasibility_report([s for _, s in sizes], cfg.dataset.texture.canvases)


def startup_report(scan: Scan, plan: Plan, entries: Sequence[Entry], items: Sequence[Item],
                   sampler: BucketBatchSampler, mode: str) -> list[str]:
    what = {"images": "images (cached latents)", "latents": "latents (cache files only)",
            "encode": "encode (pixels; the VAE runs in the loop)"}[mode]
    buckets = Counter(it.plan.bucket for it in items)
    common = ", ".join(f"{wxh(b)} ({n})" for b, n in buckets.most_common(3))
    lines = [f"source   {what}",
             f"samples  {len(items)} per epoch ({len(entries)} entries x repeats), {len(sampler)} batches",
             f"buckets  {len(buckets)}; most common: {common}"]
    per_subset_entries: Counter = Counter()
    per_subset_items: Counter = Counter()
    for e in entries:
        f = scan.folders[plan.sources[e.source].folder]
        per_subset_entries[f.subset] += 1
        per_subset_items[f.subset] += f.repeats
    total = max(1, len(items))
    lines.append("subsets")
    for i, sub in enumerate(scan.subsets):
        reps = sorted({f.repeats for f in scan.folders if f.subset == i})
        xn = "/".join(f"x{r}" for r in reps) or f"x{sub.num_repeats}"
        tail = "  [fullres only -- keeps its captions]" if not sub.texture else ""
        lines.append(f"  {sub.path}: {per_subset_entries[i]} entries, {100 * per_subset_items[i] / total:.1f}% "
                     f"of epoch  {xn}{tail}")
    return lines
