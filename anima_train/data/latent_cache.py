"""`anima-train cache`: encode a dataset's images into latent caches next to them (docs/training.md#latent-caches).

    anima-train cache DIR [DIR ...] --resolution 768 1024 [--dry-run] [--overwrite] [--allow-missing-captions]
    anima-train cache --config cfg.toml            # [dataset] folders/settings and train.model_path from a config

Prints the bucket plan and the cache size first, then writes `<stem>_WWWWxHHHH_anima.safetensors` beside each
image for each tier (one file per (image, bucket): a tier that collapses onto a lower one's bucket shares its file).
Existing caches that match the current settings are skipped; stale ones (other settings, another VAE) and damaged
ones (unreadable, or latents of the wrong shape/dtype for their bucket) are re-encoded; --overwrite re-encodes
everything. Images are grouped by bucket and encoded in batches.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace

from tqdm import tqdm

from anima_train.files import atomic_path
from anima_train.data.buckets import BUCKET_KEYS, DATASET_DEFAULTS, tier_counts, tier_report
from anima_train.config import ConfigError, DTYPE_NAMES, DatasetConfig, TrainConfig, load_config
from anima_train.errors import DATA_VERDICT_EXIT, USER_ERROR_EXIT
from anima_train.fixes import ref
from anima_train.data.cache_files import cache_path, vae_identity, written_as_cache
from anima_train.data.dataset import encode_latents, load_pixels
from anima_train.data.errors import DatasetError, the_dataset
from anima_train.data.planning import (IMAGE_CHANGED, IMAGE_UNRECORDED, BucketSettings, check_caches, plan_metadata,
    plan_sources, plan_warnings)
from anima_train.data.scan import scan_folders
from anima_train.data.sources import (UnreadableImages, find_undecodable, image_sources, missing_captions,
    refuse_missing_captions)

CACHE_HEADER_BYTES = 600  # safetensors header + our metadata, roughly


# ------------------------------------------------------------------------------------------- shared with audit


def add_dataset_arguments(parser: argparse.ArgumentParser, skip_unreadable: bool = True) -> None:
    """Folder, tier and bucket options shared by `cache` and `audit` (unset = the config's value or default)."""
    parser.add_argument("dirs", nargs="*", metavar="DIR", help="dataset folder(s); default: the config's folders")
    parser.add_argument("--config", metavar="CFG.toml",
                        help="take [dataset] folders/settings and train.model_path from a training config "
                             "(flags given here override it)")
    parser.add_argument("--resolution", type=int, nargs="+", metavar="R",
                        help="tier(s): area budgets of about R x R pixels (several = multi-resolution)")
    parser.add_argument("--model", metavar="PATH", help="diffusers repo with vae/ (default: the config's model_path)")
    d = DATASET_DEFAULTS
    parser.add_argument("--bucket-reso-steps", type=int,
                        help=f"bucket sides are multiples of this (default {d.bucket_reso_steps})")
    parser.add_argument("--max-bucket-reso", type=int,
                        help=f"per-side cap of every bucket (default {d.max_bucket_reso})")
    parser.add_argument("--min-bucket-reso", type=int,
                        help=f"smallest bucket side, upscale mode only (default {d.min_bucket_reso})")
    parser.add_argument("--upscale", action="store_const", const=True, default=None,
                        help="bucket_no_upscale = false: scale sources up or down to predefined buckets")
    parser.add_argument("--multires-training", action="store_const", const=True, default=None,
                        help="area tie-break among equal aspect ratios (upscale mode)")
    if skip_unreadable:
        parser.add_argument("--skip-unreadable", action="store_true", help="leave unreadable images out (listed)")


def flag_overrides(args) -> dict:
    """The BucketSettings fields given explicitly on the command line."""
    given = {"tiers": tuple(sorted(set(args.resolution))) if args.resolution else None,
             "bucket_reso_steps": args.bucket_reso_steps, "max_bucket_reso": args.max_bucket_reso,
             "min_bucket_reso": args.min_bucket_reso, "bucket_no_upscale": False if args.upscale else None,
             "multires_training": args.multires_training}
    return {k: v for k, v in given.items() if v is not None}


def resolve_dataset_args(args, *, need_tiers: bool = True, with_validation: bool = False):
    """(subsets, BucketSettings, model_path, tiers_given) from the flags and an optional --config; with_validation:
    the config's `[validation] folder` too (cached with the dataset's settings, as training reads it)."""
    if args.config:
        try:
            cfg = load_config(args.config)
        except ConfigError as e:
            raise DatasetError(str(e)) from None
        dataset, model_path = cfg.dataset, cfg.train.model_path
        subsets = dataset.resolved_subsets()
        if with_validation and cfg.validation.folder is not None and not args.dirs:
            subsets = [*subsets, SimpleNamespace(path=cfg.validation.folder, num_repeats=1, texture=True)]
    else:
        dataset, model_path, subsets = DatasetConfig(), TrainConfig().model_path, []
    if args.dirs:
        subsets = [SimpleNamespace(path=d, num_repeats=1, texture=True) for d in args.dirs]
    if not subsets:
        raise DatasetError("no dataset folder: give DIR, or --config with a [dataset] path or subsets")
    settings = dataclasses.replace(BucketSettings.from_config(dataset), **flag_overrides(args))
    if any(t <= 0 for t in settings.tiers):
        raise DatasetError(f"--resolution {list(settings.tiers)}: every tier must be > 0")
    refuse_what_the_config_refuses(settings, flag_overrides(args))
    subsets = _once_each(subsets)
    tiers_given = bool(args.resolution or args.config)
    if need_tiers and not tiers_given:
        raise DatasetError("no tier given: " + ref("flag cache --resolution",
                                                   "give the tier(s) with --resolution R [R ...] (or --config)")
                           + ": caches are made per tier")
    return subsets, settings, args.model or model_path, tiers_given


FLAGS = {"tiers": "resolution", "bucket_reso_steps": "bucket-reso-steps", "max_bucket_reso": "max-bucket-reso",
         "min_bucket_reso": "min-bucket-reso", "bucket_no_upscale": "upscale", "multires_training": "multires-training"}


def refuse_what_the_config_refuses(settings: BucketSettings, flags: dict) -> None:
    """The bucket settings of `cache` and `audit` pass the config's own [dataset] rules (one rule for both fronts: a
    --bucket-reso-steps that a config refuses must not write latents the model cannot use); a refused value is named
    by its flag when a flag gave it."""
    try:
        DatasetConfig(resolutions=list(settings.tiers), **{k: getattr(settings, k) for k in BUCKET_KEYS})
    except ConfigError as e:
        message = str(e)
        for key, flag in FLAGS.items():
            # --resolution is the one flag a node passes (its resolutions widget): named so that the node says it
            said = ref("name --resolution", "--resolution") if flag == "resolution" else f"--{flag}"
            for name in (("resolution", "resolutions") if key == "tiers" else (key,)) if key in flags else ():
                message = message.replace(f"[dataset] {name} = ", f"{said} ").replace(f"[dataset] {name}: ",
                                                                                    f"{said}: ")
        raise DatasetError(message) from None


def _once_each(subsets: list) -> list:
    """The folders to scan, each once: `cache DIR DIR` (or DIR and a link to it) names one folder twice, and would
    encode it twice. Said, since the user typed it twice."""
    seen, out = {}, []
    for sub in subsets:
        key = os.path.realpath(Path(sub.path).expanduser())
        if key in seen:
            print(f"note: {sub.path} is the folder {seen[key]} given before; it is scanned once")
            continue
        seen[key] = sub.path
        out.append(sub)
    return out


def plan_lines(plan, settings: BucketSettings) -> list[str]:
    """The bucket plan: per tier, its buckets and entry counts; and the size of the caches it makes."""
    lines = []
    files = {}
    for e in plan.entries:
        files[(e.source, e.plan.bucket)] = e.plan.bucket  # collapsed tiers share one file
    by_tier = defaultdict(Counter)
    for e in plan.entries:
        by_tier[e.tier][e.plan.bucket] += 1
    for t in settings.tiers:
        buckets = by_tier.get(t, Counter())
        lines.append(f"tier {t}: {sum(buckets.values())} entries in {len(buckets)} bucket(s)")
        for b, n in sorted(buckets.items(), key=lambda kv: (-kv[1], kv[0]))[:12]:
            lines.append(f"   {b[0]:>5}x{b[1]:<5} {n:>6}   {(b[0] // 16) * (b[1] // 16):>6} tokens")
        if len(buckets) > 12:
            lines.append(f"   ... {len(buckets) - 12} more bucket(s)")
    n_sized = len(plan.sources)
    lines += tier_report(tier_counts(plan.entries, n_sized, settings.tiers), n_sized)[0]
    size = sum(16 * (w // 8) * (h // 8) * 4 + CACHE_HEADER_BYTES for w, h in files.values())
    lines.append(f"cache    {len(files)} file(s), {size / 2**20:.1f} MiB (float32 latents)")
    return lines


# -------------------------------------------------------------------------------------------------- cache


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataset_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the cache size; write nothing")
    parser.add_argument("--overwrite", action="store_true", help="re-encode caches that already exist and match")
    parser.add_argument("--allow-missing-captions", action="store_true",
                        help="cache images without a <stem>.txt (training still needs the captions)")
    parser.add_argument("--batch-size", type=int, default=4, help="images per VAE forward (same bucket)")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES,
                        help="VAE compute dtype (default: bfloat16 on CUDA, float32 on CPU); caches are float32")


def load_vae(model_path, device: str, dtype: str):
    # lazy: diffusers and torch (several s): `anima-train audit` imports this module (its dataset arguments)
    from diffusers import AutoencoderKLQwenImage
    from anima_train.model.components import resolve_dtype

    vae_dir = Path(model_path) / "vae"
    if not vae_dir.is_dir():
        raise DatasetError("no VAE: " + ref("flag cache --model", "pass --model /path/to/anima-diffusers (the "
                                                                  "converted repo)") + f"\nno VAE at {vae_dir}")
    vae = AutoencoderKLQwenImage.from_pretrained(str(model_path), subfolder="vae", torch_dtype=resolve_dtype(dtype))
    return vae.to(device).eval().requires_grad_(False)


def save_cache(path: Path, latents, metadata: dict[str, str]) -> None:
    """Atomic write (temp file in the same folder, then os.replace)."""
    # lazy: safetensors.torch imports torch (~4.6 s): see load_vae
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({"latents": latents.detach().float().cpu().contiguous()}, str(tmp), metadata=metadata)


def run(args) -> int:
    try:
        return _run(args)
    except UnreadableImages as e:  # a verdict on the data, not a mistake in the command
        print(f"anima-train cache: error: {e}", file=sys.stderr)
        return DATA_VERDICT_EXIT
    except DatasetError as e:
        print(f"anima-train cache: error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT


def refuse_foreign_files(paths: list[Path]) -> None:
    """A file that has a cache's name but that `cache` did not write is the user's: never written over."""
    foreign = sorted({p for p in paths if os.path.lexists(p) and not (p.is_file() and written_as_cache(p))})
    if foreign:
        shown = ", ".join(str(p) for p in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise DatasetError(f"{len(foreign)} file(s) in {the_dataset()} have a latent cache's name but were not written "
                           f"by {ref('name cache', 'anima-train cache')}: move or rename them\n{shown} (never written "
                           f"over)")


def _device(name: str | None) -> str:
    """The --device to encode on, checked: a name torch knows, and a device this machine has."""
    # lazy: torch (~4.6 s): see load_vae
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise DatasetError(f"--device {name}: not a device name; use cpu, cuda or cuda:N (or leave it out: cuda "
                           f"when a GPU is visible, else cpu)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DatasetError(f"--device {name}: no CUDA GPU is visible to this process; use --device cpu (or check "
                               f"the driver and CUDA_VISIBLE_DEVICES)")
        if device.index is not None and device.index >= count:
            raise DatasetError(f"--device {name}: this machine has {count} CUDA GPU(s), numbered 0 to {count - 1}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise DatasetError(f"--device {name}: MPS is not available here; use --device cpu")
    elif device.type not in ("cpu", "mps"):
        raise DatasetError(f"--device {name}: anima-train encodes on cpu, cuda or mps")
    return str(device)


def _run(args) -> int:
    # lazy: torch (~4.6 s): see load_vae
    import torch

    subsets, settings, model_path, _ = resolve_dataset_args(args, with_validation=True)
    if args.batch_size < 1:
        raise DatasetError("--batch-size must be >= 1")
    device = _device(args.device)  # before the scan: a typo must not wait for it
    scan = scan_folders(subsets)
    for f in scan.folders:  # caching reads images; cache-only folders are left alone
        f.mode = "images" if f.images else "latents"
    sources, bad = image_sources(scan, skip_unreadable=args.skip_unreadable)
    if not sources:
        raise DatasetError(f"no images to cache in {the_dataset()}: give the folder of your images (it holds only "
                           f"caches or unreadable images)\n" + ", ".join(str(s.path) for s in subsets))
    missing = missing_captions(scan, sources)
    if not args.allow_missing_captions:
        refuse_missing_captions(missing, escape="cache them anyway (training then needs the same flag)",
                                command="cache")
    plan = plan_sources(sources, settings)

    print(f"images   {len(sources)} in {len(scan.folders)} folder(s)" +
          (f", {len(bad)} unreadable skipped" if bad else "") +
          (f", {len(missing)} without caption" if missing else "") +
          (f", {len(plan.dropped_small)} below min_source_area dropped" if plan.dropped_small else ""))
    for line in plan_lines(plan, settings) + scan.notes:
        print(line)

    vae_id = None if args.dry_run else vae_identity(model_path)
    check = check_caches(scan, plan, settings, vae_id)
    for text in plan_warnings(plan, settings, check, vae_id):
        print(f"warning: {text}")
    for path, why in sorted(check.damaged.items()):
        print(f"damaged  {path}: {why} (re-encoded)")
    stale_why = {cache_path(plan.sources[e.source].stem, e.plan.bucket): why for e, why in check.missing}
    for path, why in sorted(stale_why.items()):
        if why.startswith(IMAGE_CHANGED):
            print(f"stale    {path}: {why} (re-encoded)")
    if unrecorded := sum(why == IMAGE_UNRECORDED for why in stale_why.values()):
        print(f"stale    {unrecorded} cache file(s): {IMAGE_UNRECORDED}, so a changed image cannot be told "
              f"(re-encoded)")
    # one job per (source, bucket): a collapsed tier shares the lower tier's file
    jobs, seen = [], set()
    todo = check.entries if args.overwrite else [e for e, _ in check.missing]
    for e in todo:
        key = (e.source, e.plan.bucket)
        if key not in seen:
            seen.add(key)
            jobs.append(e)
    # the images to encode are decoded in full first (threads; once more when encoding, a second read of files
    # the OS has just cached), so a truncated or corrupt one is named before any encoding starts
    undecodable = find_undecodable(plan.sources[e.source].image for e in jobs)
    if undecodable and not args.skip_unreadable:
        raise UnreadableImages(undecodable)
    if undecodable:
        gone = {p for p, _ in undecodable}
        jobs = [e for e in jobs if plan.sources[e.source].image not in gone]
        print(f"skipped  {len(gone)} undecodable image(s) (--skip-unreadable): "
              + ", ".join(str(p) for p in sorted(gone)[:5]) + (" ..." if len(gone) > 5 else ""))
    refuse_foreign_files([cache_path(plan.sources[e.source].stem, e.plan.bucket) for e in jobs])
    stale = sum(1 for e in jobs if cache_path(plan.sources[e.source].stem, e.plan.bucket).exists())
    n_files = len({(e.source, e.plan.bucket) for e in plan.entries})
    print(f"todo     {len(jobs)} of {n_files} cache file(s) to write" +
          (f" ({stale} existing re-encoded: stale, damaged or --overwrite)" if stale else "") +
          (f"; {n_files - len(jobs)} already valid, skipped" if n_files - len(jobs) else ""))
    if args.dry_run or not jobs:
        return 0

    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    vae = load_vae(model_path, device, dtype)
    if vae_id is None:
        print(f"warning: cannot hash the VAE weights under {model_path}/vae; caches record no VAE identity")

    by_bucket = defaultdict(list)
    for e in jobs:
        by_bucket[e.plan.bucket].append(e)
    failed: list[tuple[Path, str]] = []
    written = 0
    t0 = time.perf_counter()
    with tqdm(total=len(jobs), unit="img", desc="caching", file=sys.stdout) as bar:
        for bucket in sorted(by_bucket):
            group = by_bucket[bucket]
            for i in range(0, len(group), args.batch_size):
                chunk, pixels = [], []
                for e in group[i:i + args.batch_size]:
                    src = plan.sources[e.source]
                    try:
                        pixels.append(load_pixels(src.image, e.plan))
                        chunk.append(e)
                    except Exception as exc:
                        failed.append((src.image, f"{type(exc).__name__}: {exc}"))
                        bar.update(1)
                if not chunk:
                    continue
                latents = encode_latents(vae, torch.stack(pixels))
                for e, z in zip(chunk, latents):
                    src = plan.sources[e.source]
                    save_cache(cache_path(src.stem, e.plan.bucket), z,
                               plan_metadata(e.plan, settings, e.tier, vae_id, src.image))
                    written += 1
                bar.update(len(chunk))
    dt = time.perf_counter() - t0
    print(f"wrote    {written} cache file(s) in {dt:.1f} s ({written / max(dt, 1e-9):.2f} img/s)")
    if failed:
        listing = "\n".join(f"  {p}  ({why})" for p, why in failed)
        print(f"anima-train cache: error: {len(failed)} image(s) could not be decoded and have no cache:\n{listing}\n"
              f"fix or delete them, then run the same command again (it skips the caches already written)",
              file=sys.stderr)
        return 0 if args.skip_unreadable else DATA_VERDICT_EXIT
    return 0
