"""Planning: what a bucket plan depends on (BucketSettings), every source at every tier, and checking the
latent caches against the plan (stale, damaged or missing caches are refused with the fix)."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from anima_train.data.buckets import (BUCKET_KEYS, DATASET_DEFAULTS, BucketError, BucketPlan, below_min_source_area,
    make_bucketers, plan_tiers, tier_counts, tier_report)
from anima_train.data.cache_files import (CACHE_FORMAT, CacheUnreadable, cache_damage, cache_path, read_cache_metadata,
    wxh)
from anima_train.data.errors import DatasetError, the_dataset, the_resolution
from anima_train.data.identity import file_change, file_identity
from anima_train.data.scan import Scan
from anima_train.data.sources import Source
from anima_train.fixes import program, ref


# ----------------------------------------------------------------------------------------------------------
# Settings: what a bucket plan (and so a cache) depends on


@dataclass(frozen=True)
class BucketSettings:
    """The `[dataset]` keys that decide buckets, as a frozen value (a cache records it; audit rebuilds it from
    caches). Field names are the config keys and the defaults are DatasetConfig's: the config is their one source."""

    tiers: tuple[int, ...] = tuple(DATASET_DEFAULTS.tiers)
    bucket_reso_steps: int = DATASET_DEFAULTS.bucket_reso_steps
    bucket_no_upscale: bool = DATASET_DEFAULTS.bucket_no_upscale
    max_bucket_reso: int = DATASET_DEFAULTS.max_bucket_reso
    min_bucket_reso: int = DATASET_DEFAULTS.min_bucket_reso
    multires_training: bool = DATASET_DEFAULTS.multires_training
    tier_collapse: str = DATASET_DEFAULTS.tier_collapse
    min_source_area: float = DATASET_DEFAULTS.min_source_area

    @classmethod
    def from_config(cls, dataset) -> "BucketSettings":
        """From a DatasetConfig (or anything with its attribute names)."""
        return cls(tiers=tuple(sorted(set(dataset.tiers))), tier_collapse=dataset.tier_collapse,
                   min_source_area=float(dataset.min_source_area),
                   **{k: getattr(dataset, k) for k in BUCKET_KEYS})

    def bucketers(self):
        try:
            return make_bucketers(self.tiers, **{k: getattr(self, k) for k in BUCKET_KEYS})
        except BucketError as e:
            raise DatasetError(str(e)) from None

    def record(self, tier: int) -> dict:
        """The settings part of a cache's metadata (tier = the tier the cache was made for)."""
        return {"tier": tier, "resolutions": list(self.tiers), **{k: getattr(self, k) for k in BUCKET_KEYS}}

    def tier_value(self):
        return self.tiers[0] if len(self.tiers) == 1 else list(self.tiers)


# ----------------------------------------------------------------------------------------------------------
# Planning: every source at every tier


@dataclass(frozen=True)
class Entry:
    """One (source, tier) pair the epoch contains (before repeats)."""

    source: int  # index into the sources list
    tier: int
    plan: BucketPlan
    collapsed: bool
    cache: Path | None = None  # the latents to read (images / latents modes)


@dataclass
class Plan:
    sources: list[Source]  # kept sources (min_source_area applied)
    entries: list[Entry]
    dropped_small: list[Source]
    unsized: list[Source]  # caches without original_size (latents mode)
    unbucketable: list[tuple[Source, str]] = field(default_factory=list)  # (source, why) with drop_unbucketable


def plan_tiers_checked(sizes: Sequence[tuple[int, int]], bucketers: dict, tier_collapse: str):
    """plan_tiers, but a source that cannot be bucketed (too thin for a step) is reported, not fatal:
    returns (tier entries of the good sources re-indexed to `sizes`, [(index, reason)])."""
    try:
        return plan_tiers(sizes, bucketers, tier_collapse), []
    except BucketError:
        pass  # find every offender (rare path), then plan the rest
    bad, good = [], []
    for i, (w, h) in enumerate(sizes):
        try:
            for b in bucketers.values():
                b.select(w, h)
            good.append(i)
        except BucketError as e:
            bad.append((i, str(e)))
    entries = plan_tiers([sizes[i] for i in good], bucketers, tier_collapse)
    return [dataclasses.replace(e, source_index=good[e.source_index]) for e in entries], bad


def plan_sources(sources: Sequence[Source], settings: BucketSettings, *, drop_unbucketable: bool = False) -> Plan:
    """Apply min_source_area, then bucket every sized source at every tier (dedup/repeat collapse). Sources
    that cannot be bucketed are all listed in one error, or left out with drop_unbucketable."""
    kept, small, unsized = [], [], []
    for s in sources:
        if s.size is None:
            unsized.append(s)
        elif settings.min_source_area and below_min_source_area(*s.size, settings.min_source_area, settings.tiers):
            small.append(s)
        else:
            kept.append(s)
    try:
        tier_entries, bad = plan_tiers_checked([s.size for s in kept], settings.bucketers(), settings.tier_collapse)
    except BucketError as e:
        raise DatasetError(str(e)) from None
    unbucketable = [(kept[i], why) for i, why in bad]
    if unbucketable and not drop_unbucketable:
        shown = "\n".join(f"  {s.image or s.stem}: {why}" for s, why in unbucketable[:50])
        raise DatasetError(f"{len(unbucketable)} source(s) in {the_dataset()} cannot be bucketed: delete or crop them, "
                           f"or raise {the_resolution()}\n{shown}\n(or lower bucket_reso_steps)")
    if bad:  # re-index onto the kept-and-bucketable list
        good = [i for i in range(len(kept)) if i not in {j for j, _ in bad}]
        remap = {old: new for new, old in enumerate(good)}
        kept = [kept[i] for i in good]
        tier_entries = [dataclasses.replace(e, source_index=remap[e.source_index]) for e in tier_entries]
    entries = [Entry(e.source_index, e.tier, e.plan, e.collapsed) for e in tier_entries]
    return Plan(kept, entries, small, unsized, unbucketable)


def plan_metadata(plan: BucketPlan, settings: BucketSettings, tier: int, vae_id: str | None,
                  image: Path | None) -> dict[str, str]:
    """The metadata written into a cache (all strings, as safetensors requires); `image`: the file it is encoded
    from, whose identity it records (None: no image, as for a test's hand-made cache)."""
    return {
        "format": CACHE_FORMAT,
        "bucket": wxh(plan.bucket),
        "original_size": wxh(plan.source),
        "resized": wxh(plan.resized),
        "trim": f"{plan.trim[0]},{plan.trim[1]}",
        "crop_ltrb": json.dumps(list(plan.crop_ltrb)),
        "settings": json.dumps({**settings.record(tier), "vae": vae_id}),
        **({IMAGE_KEY: json.dumps(file_identity(image))} if image is not None else {}),
    }


IMAGE_KEY = "image"  # a cache's record of the image it was encoded from (identity.file_identity)
IMAGE_CHANGED = "its image changed since it was encoded"  # how cache_problem starts that reason
IMAGE_UNRECORDED = "it records no image identity (made by an older anima-train)"


def cache_problem(meta: dict, plan: BucketPlan, vae_id: str | None, image: Path | None = None) -> str | None:
    """None if the cache matches the plan (and the VAE, when both are known) and was encoded from `image` as it is
    now (when the image exists: without it the cache is the only copy, and stands); else a short reason."""
    if meta.get("format") != CACHE_FORMAT:
        return "not an anima latent cache of this format"
    for key, want in (("original_size", wxh(plan.source)), ("bucket", wxh(plan.bucket)),
                      ("resized", wxh(plan.resized)), ("trim", f"{plan.trim[0]},{plan.trim[1]}")):
        if meta.get(key) != want:
            return f"{key} {meta.get(key)} != {want}"
    made_with = settings_record(meta).get("vae")
    if vae_id and made_with and made_with != vae_id:
        return "made with another VAE"
    if image is not None:
        try:
            record = json.loads(meta[IMAGE_KEY])
        except (KeyError, json.JSONDecodeError):
            return IMAGE_UNRECORDED
        if why := file_change(record, image):
            return f"{IMAGE_CHANGED} ({image.name} {why})"
    return None


def settings_record(meta: dict) -> dict:
    """The bucket settings a cache was made with (its `settings` metadata, see BucketSettings.record); {} if absent."""
    try:
        return json.loads(meta.get("settings", "{}"))
    except json.JSONDecodeError:
        return {}


def explain_settings(meta: dict, settings: BucketSettings, vae_id: str | None) -> str:
    """Which settings differ between a cache's record and the current ones, e.g.
    "bucket_reso_steps=64, the config says 32"."""
    rec = settings_record(meta)
    if not rec:
        return "no settings record (not made by anima-train cache)"
    diffs = []
    old_tiers = rec.get("resolutions")
    if old_tiers is not None and sorted(old_tiers) != list(settings.tiers):
        key = "resolution" if len(old_tiers) == 1 and len(settings.tiers) == 1 else "resolutions"
        old = old_tiers[0] if key == "resolution" else old_tiers
        diffs.append(f"{key}={old}, the config says {settings.tier_value()}")
    upscale_branch = not settings.bucket_no_upscale or not rec.get("bucket_no_upscale", True)
    for k in BUCKET_KEYS:
        if k in ("min_bucket_reso", "multires_training") and not upscale_branch:
            continue  # inert in the no-upscale branch
        if k in rec and rec[k] != getattr(settings, k):
            old, new = rec[k], getattr(settings, k)
            if isinstance(new, bool):
                old, new = str(old).lower(), str(new).lower()
            diffs.append(f"{k}={old}, the config says {new}")
    if vae_id and rec.get("vae") and rec["vae"] != vae_id:
        diffs.append(f"VAE {rec['vae'][:19]}, the model's VAE is {vae_id[:19]}")
    return "; ".join(diffs) if diffs else "the same settings (the image may have changed since)"


def cache_command(folders: Iterable[Path], settings: BucketSettings, overwrite: bool = False, *,
                  model: str | os.PathLike | None = None, config: str | os.PathLike | None = None,
                  allow_missing_captions: bool = False) -> str:
    """The `anima-train cache` line that makes caches for the current settings, ready to paste into a shell: from
    the training config when there is one (its folders, settings and model_path), else folders + flags + --model."""
    if config is not None:
        parts = ["cache", "--config", str(Path(config).absolute())]
    else:
        d = BucketSettings()
        parts = ["cache", *sorted({str(p) for p in folders}), "--resolution", *map(str, settings.tiers)]
        parts += ["--bucket-reso-steps", str(settings.bucket_reso_steps)]  # always: it is what changes most
        if settings.max_bucket_reso != d.max_bucket_reso:
            parts += ["--max-bucket-reso", str(settings.max_bucket_reso)]
        if not settings.bucket_no_upscale:
            parts += ["--upscale"]
            if settings.min_bucket_reso != d.min_bucket_reso:
                parts += ["--min-bucket-reso", str(settings.min_bucket_reso)]
            if settings.multires_training:
                parts += ["--multires-training"]
        if model is not None:
            parts += ["--model", str(model)]
    if allow_missing_captions:
        parts.append("--allow-missing-captions")
    if overwrite:
        parts.append("--overwrite")
    return " ".join([program(), *map(shlex.quote, parts)])


@dataclass
class CacheCheck:
    """Result of matching a plan's entries against the cache files on disk."""

    entries: list[Entry]  # with .cache set where valid
    missing: list[tuple[Entry, str]]  # (entry, why) for entries without a valid cache (stale or damaged)
    unused: list[Path]  # caches of known stems that no entry names (other tiers / settings)
    metadata: dict[Path, dict]
    damaged: dict[Path, str] = field(default_factory=dict)  # entry caches that are unreadable or mis-shaped: why


def check_caches(scan: Scan, plan: Plan, settings: BucketSettings, vae_id: str | None,
                 metadata: dict[Path, dict] | None = None) -> CacheCheck:
    """For each entry, the cache file its plan names, if it exists, is intact (readable, latents of the bucket's
    shape and dtype) and matches (see cache_problem). A damaged file is re-encoded like a stale one, so it is
    checked first: its metadata may well be right."""
    metadata = {} if metadata is None else metadata
    out, missing, used, named, damaged = [], [], set(), set(), {}
    for e in plan.entries:
        src = plan.sources[e.source]
        path = cache_path(src.stem, e.plan.bucket)
        named.add(path)
        if path in scan.folders[src.folder].caches.get(src.stem.name, ()):
            try:
                if path not in metadata:
                    metadata[path] = read_cache_metadata(path)
            except CacheUnreadable as exc:
                why = damaged[path] = f"cannot be read ({exc.reason})"
            else:
                why = cache_damage(metadata[path], e.plan.bucket)
                if why is not None:
                    damaged[path] = why
                else:
                    why = cache_problem(metadata[path], e.plan, vae_id, src.image)
            if why is None:
                out.append(Entry(e.source, e.tier, e.plan, e.collapsed, path))
                used.add(path)
                continue
        else:
            why = "no cache file"
        out.append(e)
        missing.append((e, why))
    unused = [p for s in plan.sources for p in scan.folders[s.folder].caches.get(s.stem.name, ()) if p not in named]
    return CacheCheck(out, missing, unused, metadata, damaged)


def made_with(check: CacheCheck, path: Path, settings: BucketSettings, vae_id: str | None) -> str:
    """explain_settings for one cache file, or why it cannot be told."""
    try:
        meta = check.metadata.get(path) or read_cache_metadata(path)
    except CacheUnreadable as exc:
        return f"settings unknown (the file cannot be read: {exc.reason})"
    return explain_settings(meta, settings, vae_id)


def stale_cache_error(scan: Scan, plan: Plan, check: CacheCheck, settings: BucketSettings,
                      vae_id: str | None, *, model=None, config=None, allow_missing_captions: bool = False
                      ) -> DatasetError:
    """One error for every (source, tier) pair without a valid cache, grouped by the setting that changed; its
    fix is a cache command that works as printed (from `config`, the training config's file, when there is one)."""
    by_reason: dict[str, list[str]] = defaultdict(list)
    damaged = []
    for e, why in check.missing:
        src = plan.sources[e.source]
        path = cache_path(src.stem, e.plan.bucket)
        if path in check.damaged:
            damaged.append(f"{path} ({check.damaged[path]})")
            continue
        others = scan.folders[src.folder].caches.get(src.stem.name, [])
        if why.startswith(IMAGE_CHANGED):
            reason = f"are stale: {IMAGE_CHANGED}"
        elif why == IMAGE_UNRECORDED:
            reason = f"are stale: {IMAGE_UNRECORDED}"
        elif not others:
            reason = "are missing"
        else:
            latest = max(others, key=lambda p: p.stat().st_mtime_ns)
            reason = f"were made with {made_with(check, latest, settings, vae_id)}"
        by_reason[reason].append(f"{src.stem.name} (tier {e.tier}, {wxh(e.plan.bucket)})")
    n = len(check.missing)
    folders = sorted({scan.folders[plan.sources[e.source].folder].path for e, _ in check.missing})
    tops = sorted({Path(scan.subsets[scan.folders[plan.sources[e.source].folder].subset].path)
                   for e, _ in check.missing})
    fix = cache_command(tops, settings, model=model, config=config, allow_missing_captions=allow_missing_captions)
    # the fix first: the caches' reasons and files below it
    lines = [f"{n} (source, tier) pair(s) have no valid latent cache; fix: "
             f"{ref('run cache', f're-run `{fix}` (it re-encodes stale and damaged caches)')}, or set the config "
             f"back to the settings the caches were made with"]
    for reason, items in by_reason.items():
        shown = ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
        lines.append(f"  caches for {shown} {reason}")
    if damaged:
        lines.append(f"  {len(damaged)} cache file(s) are damaged (training on them would be wrong):")
        lines += [f"    {d}" for d in damaged[:10]]
        if len(damaged) > 10:
            lines.append(f"    ... and {len(damaged) - 10} more")
    if any(f.mode == "latents" for f in scan.folders):
        lines.append("(the images are gone from " + ", ".join(map(str, folders[:3]))
                     + ": restore them to re-cache, or set the settings back)")
    return DatasetError("\n".join(lines))


def plan_warnings(plan: Plan, settings: BucketSettings, check: CacheCheck | None = None,
                  vae_id: str | None = None) -> list[str]:
    """What `train`, `cache` and `audit` all warn about (each prints these lines as "warning: ..."; the trainer
    also sends them as events): tiers that >= 1 % of the sources collapse onto a lower tier's bucket, sources
    that min_source_area drops, and cache files no tier uses under the current settings."""
    sized = [e for e in plan.entries if plan.sources[e.source].size is not None]
    n_sized = sum(1 for s in plan.sources if s.size is not None)
    warn = tier_report(tier_counts(sized, n_sized, settings.tiers), n_sized)[1]
    if plan.dropped_small:
        warn.append(f"min_source_area = {settings.min_source_area}: dropped {len(plan.dropped_small)} source(s) "
                    f"smaller than {settings.min_source_area} x {min(settings.tiers)}^2 px (e.g. "
                    f"{', '.join(s.stem.name for s in plan.dropped_small[:3])})")
    if check is not None and check.unused:
        warn.append(f"{len(check.unused)} cache file(s) match no declared tier under the current settings and are "
                    f"ignored (e.g. {check.unused[0].name}: made with "
                    f"{made_with(check, check.unused[0], settings, vae_id)})")
    return warn
