"""`anima-train audit`: a dataset's size distribution, a tier ladder for it, and whether its images can be deleted.

    anima-train audit DIR [DIR ...] [--resolution R ...] [--config cfg.toml] [--model PATH]

Prints the source-area percentiles and the suggested ladder (docs/training.md#tiers-and-the-audit), the collapse rate
of the configured ladder and of the suggested one, and a verdict: SAFE to delete the images only when every readable
image is cached at every configured tier with the current settings (and, when the model's VAE is found, by that VAE),
no cache file is damaged (unreadable, or latents of the wrong shape/dtype for its bucket) and every source has its
caption; otherwise NOT SAFE with the reasons and counts. The dataset warnings the trainer prints (tier collapse,
min_source_area drops, unused caches) come as "warning:" lines. Every image without a valid cache is decoded (a
truncated one is a NOT SAFE reason, by name: it can never be cached). Exit status 0 = SAFE, 4 = NOT SAFE
(errors.DATA_VERDICT_EXIT), 2 = error.

Tiers and bucket settings: --resolution / flags, else --config, else the settings recorded in the caches
themselves (the most common record), else the defaults (resolution 1024).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import Counter
from pathlib import Path

from anima_train.data.buckets import BUCKET_KEYS, audit_report, make_bucketers, suggest_ladder, tier_counts
from anima_train.data.latent_cache import add_dataset_arguments, flag_overrides, resolve_dataset_args
from anima_train.data.cache_files import (CacheUnreadable, cache_bucket, cache_damage, cache_path, parse_wxh,
    read_cache_metadata, vae_identity)
from anima_train.data.errors import DatasetError, the_dataset
from anima_train.data.planning import (IMAGE_CHANGED, IMAGE_UNRECORDED, BucketSettings, cache_command, check_caches,
    made_with, plan_sources, plan_tiers_checked, plan_warnings, settings_record)
from anima_train.data.scan import scan_folders
from anima_train.data.sources import Source, find_undecodable, image_sources, missing_captions
from anima_train.errors import DATA_VERDICT_EXIT
from anima_train.fixes import ref


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataset_arguments(parser, skip_unreadable=False)  # the audit lists unreadable images as a reason


def run(args) -> int:
    try:
        lines, safe = audit(args)
    except DatasetError as e:
        print(f"anima-train audit: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if safe else DATA_VERDICT_EXIT


def settings_from_caches(metadata: dict) -> BucketSettings | None:
    """The most common settings record among the caches (tiers + bucket keys), if any."""
    records = Counter()
    for meta in metadata.values():
        rec = settings_record(meta)
        if "resolutions" in rec and all(k in rec for k in BUCKET_KEYS):
            records[json.dumps({"tiers": rec["resolutions"], **{k: rec[k] for k in BUCKET_KEYS}})] += 1
    if not records:
        return None
    best = json.loads(records.most_common(1)[0][0])
    best["tiers"] = tuple(sorted(best["tiers"]))
    return BucketSettings(**best)


def ladder_lines(sizes, ladder, settings: BucketSettings, label: str) -> list[str]:
    """Collapse rate of one ladder (dedup): per tier, and over all (source, tier) pairs."""
    bucketers = make_bucketers(ladder, **{k: getattr(settings, k) for k in BUCKET_KEYS})
    entries, bad = plan_tiers_checked(sizes, bucketers, "dedup")
    n = len(sizes) - len(bad)
    if n == 0:
        return [f"   {label:<10} [{', '.join(map(str, ladder))}]: no source can be bucketed with these settings"]
    counts = tier_counts(entries, n, ladder)
    per_tier = ", ".join(f"{c.tier} {100 * c.collapsed / n:.1f}%" for c in counts)
    pairs = sum(c.collapsed for c in counts)
    skipped = f"; {len(bad)} source(s) cannot be bucketed" if bad else ""
    return [f"   {label:<10} [{', '.join(map(str, ladder))}]: {pairs}/{n * len(ladder)} (source, tier) "
            f"pairs collapse ({100 * pairs / (n * len(ladder)):.1f}%); per tier: {per_tier}{skipped}"]


def _examples(items, k: int = 4) -> str:
    items = list(items)
    return ", ".join(map(str, items[:k])) + (f" and {len(items) - k} more" if len(items) > k else "")


def audit(args) -> tuple[list[str], bool]:
    subsets, settings, model_path, tiers_given = resolve_dataset_args(args, need_tiers=False)
    scan = scan_folders(subsets)
    all_caches = [p for f in scan.folders for ps in f.caches.values() for p in ps]
    metadata, damaged = {}, {}  # damaged: every cache file that is unreadable or mis-shaped for its bucket -> why
    for p in all_caches:
        try:
            metadata[p] = read_cache_metadata(p)
        except CacheUnreadable as exc:
            damaged[p] = f"cannot be read ({exc.reason})"
            continue
        if why := cache_damage(metadata[p], cache_bucket(p)):
            damaged[p] = why
    out = []
    if not tiers_given:
        recorded = settings_from_caches(metadata)
        if recorded is not None:
            settings = dataclasses.replace(recorded, **flag_overrides(args),
                                           tier_collapse=settings.tier_collapse,
                                           min_source_area=settings.min_source_area)
            out.append(f"settings taken from the caches' records: resolutions {list(settings.tiers)}, "
                       f"bucket_reso_steps {settings.bucket_reso_steps}, bucket_no_upscale "
                       f"{str(settings.bucket_no_upscale).lower()} ("
                       + ref("flag audit --resolution", "pass --resolution or --config") + " to audit others)")
        else:
            out.append(f"no tier given and no cache records: auditing the default tier {settings.tiers[0]} ("
                       + ref("flag audit --resolution", "pass --resolution or --config") + " to audit others)")

    # sources: every image (header), plus cached stems whose image is gone (size from the cache metadata)
    for f in scan.folders:
        f.mode = "images"
    image_srcs, unreadable = image_sources(scan, skip_unreadable=True)  # headers: sizes of a large set, fast
    cache_only = []
    for fi, f in enumerate(scan.folders):
        for stem, paths in f.caches.items():
            if stem in f.images:
                continue
            sizes = [metadata[p]["original_size"] for p in paths if "original_size" in metadata.get(p, {})]
            size = parse_wxh(Counter(sizes).most_common(1)[0][0]) if sizes else None
            cache_only.append(Source(fi, f.path / stem, None, size))
    sources = image_srcs + [s for s in cache_only if s.size is not None]
    unsized = [s for s in cache_only if s.size is None]
    if not sources:
        raise DatasetError(f"nothing to audit in {the_dataset()}: give the folder of your images\nno readable images "
                           f"and no caches with an original_size in " + ", ".join(str(s.path) for s in subsets))

    areas = [s.size[0] * s.size[1] for s in sources]
    sizes = [s.size for s in sources]
    out += audit_report(areas, settings.bucket_reso_steps, settings.max_bucket_reso)
    out.append("collapse (dedup): a tier above a source's own area repeats a lower tier's bucket")
    out += ladder_lines(sizes, list(settings.tiers), settings, "configured")
    suggested = suggest_ladder(areas, settings.bucket_reso_steps, settings.max_bucket_reso)
    if suggested != list(settings.tiers):
        out += ladder_lines(sizes, suggested, settings, "suggested")

    # verdict
    vae_id = vae_identity(model_path) if model_path else None
    plan = plan_sources(sources, settings, drop_unbucketable=True)
    check = check_caches(scan, plan, settings, vae_id, metadata)
    reasons = []
    def cached_stem(e) -> bool:
        src = plan.sources[e.source]
        return bool(scan.folders[src.folder].caches.get(src.stem.name))

    # an image without a valid cache must be decodable to ever get one: decode those (threads), name the bad ones
    unreadable += find_undecodable(plan.sources[e.source].image for e, _ in check.missing
                                   if plan.sources[e.source].image is not None)
    never = [e for e, _ in check.missing if not cached_stem(e)]
    stale = [e for e, why in check.missing
             if cached_stem(e) and cache_path(plan.sources[e.source].stem, e.plan.bucket) not in damaged
             and not why.startswith(IMAGE_CHANGED) and why != IMAGE_UNRECORDED]
    changed = [(e, why) for e, why in check.missing if why.startswith(IMAGE_CHANGED) or why == IMAGE_UNRECORDED]
    if never:
        reasons.append(f"{len(never)} (image, tier) pair(s) have no cache: "
                       + _examples(f"{plan.sources[e.source].stem.name} (tier {e.tier})" for e in never))
    if stale:
        src = plan.sources[stale[0].source]
        newest = max(scan.folders[src.folder].caches[src.stem.name], key=lambda p: p.stat().st_mtime_ns)
        reasons.append(f"{len(stale)} (image, tier) pair(s) have only caches made with other settings (e.g. "
                       f"{src.stem.name}: {made_with(check, newest, settings, vae_id)}): "
                       + _examples(f"{plan.sources[e.source].stem.name} (tier {e.tier})" for e in stale))
    if changed:
        reasons.append(f"{len(changed)} cache file(s) may not hold their image as it is now: "
                       + _examples(f"{cache_path(plan.sources[e.source].stem, e.plan.bucket).name} ({why})"
                                   for e, why in changed))
    if damaged:
        reasons.append(f"{len(damaged)} cache file(s) are damaged and would not train ("
                       + ref("run cache", "re-encode them with anima-train cache") + " while the images exist, "
                       "or delete them): "
                       + "; ".join(f"{p} ({why})" for p, why in list(damaged.items())[:4])
                       + (f" and {len(damaged) - 4} more" if len(damaged) > 4 else ""))
    uncaptioned = missing_captions(scan, sources + unsized)
    if uncaptioned:
        reasons.append(f"{len(uncaptioned)} source(s) have no caption file: " + _examples(p.name for p in uncaptioned))
    if unreadable:
        reasons.append(f"{len(unreadable)} image(s) cannot be read, so they have no cache (fix or delete them): "
                       + "; ".join(f"{p} ({why})" for p, why in unreadable[:4])
                       + (f" and {len(unreadable) - 4} more" if len(unreadable) > 4 else ""))
    vaes = {settings_record(m).get("vae") for m in metadata.values()} - {None}
    if plan.unbucketable:
        reasons.append(f"{len(plan.unbucketable)} source(s) cannot be bucketed with these settings (so no cache): "
                       + _examples(s.stem.name for s, _ in plan.unbucketable))
    if len(vaes) > 1:
        reasons.append(f"the caches were made with {len(vaes)} different VAEs")
    if len(settings.tiers) > 1 and unsized:
        reasons.append(f"{len(unsized)} image-less cache stem(s) carry no original_size and cannot be attributed "
                       f"to a tier: " + _examples(s.stem.name for s in unsized))

    image_bytes = sum(s.image.stat().st_size for s in image_srcs)
    cache_bytes = sum(p.stat().st_size for p in all_caches)
    out.append(f"files    {len(image_srcs)} image(s) {image_bytes / 2**20:.1f} MiB, {len(all_caches)} cache(s) "
               f"{cache_bytes / 2**20:.1f} MiB"
               + (f", {len(cache_only)} cached stem(s) without image" if cache_only else ""))
    out += [f"warning: {text}" for text in plan_warnings(plan, settings, check, vae_id)]
    if vae_id is None:
        out.append(f"note     VAE identity not checked (no VAE under {model_path}/vae; "
                   + ref("flag audit --model", "pass --model") + ")")
    if reasons:
        out.append("verdict  NOT SAFE to delete the images:")
        out += [f"  - {r}" for r in reasons]
        tops = [Path(s.path) for s in subsets]
        if never or stale or damaged or changed:
            out.append(f"fix: {ref('run cache', cache_command(tops, settings, model=model_path))}")
        return out, False
    out.append(f"verdict  SAFE to delete the images: every image is cached at tier(s) {list(settings.tiers)} with the "
               f"current settings and every cache has its caption (keep the .txt files and the caches)")
    return out, True
