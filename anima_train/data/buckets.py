"""Aspect-ratio bucketing, sd-scripts-exact, plus the per-side cap, tiers and the size audit.

Behaviour (docs/training.md#buckets, #tiers-and-the-audit) reimplemented from facts read in kohya-ss/sd-scripts
(library/model_util.py `make_bucket_resolutions`, library/train_util.py `BucketManager.select_bucket`,
`get_crop_ltrb`, `trim_and_resize_if_required`). tests/data/buckets/sdscripts_parity.csv.gz holds the answers
sd-scripts' own code gave for ~21k (size, setting) pairs; tests/test_buckets.py requires all of them.

Two branches, picked by `bucket_no_upscale`:
  * no-upscale (default): the bucket is derived from the image. A source above the area budget r² is shrunk
    to ≈r² keeping its aspect (one side rounded to a step, the choice that keeps the aspect closer), a smaller
    one is left alone; the bucket is that size floored to `bucket_reso_steps`, the excess is centre-trimmed.
    `min_bucket_reso` is never read here (as in sd-scripts). The resize target is the pre-floor size, as in
    sd-scripts. The original trainer's "resized by max(bw/w, bh/h)" differs: a source inside the budget whose sides
    are not step multiples keeps its size here and is trimmed up to step-1 px per axis (1061 of the 4224
    no-upscale parity rows), and rounding differs by 1 px on a few resized sources (8 rows).
  * upscale: a predefined list of buckets under the area budget; the nearest aspect wins and the image is
    scaled (up or down) to cover it, then centre-trimmed. `multires_training` (a LoRA_Easy_Training_Scripts
    fork extension, not upstream sd-scripts) lists every height per width and breaks aspect ties by area.

Ours, not sd-scripts': `max_bucket_reso` is a per-side cap in both branches. The area budget bounds w·h but
not a side, and Anima's RoPE addresses 1920 px per side in spec (2048 before it breaks), so a too-long side is
shrunk uniformly (never enlarged). The upscale branch's candidates already respect it.

All sizes are (width, height).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from anima_train.config import ROPE_SIDE_DECLARED, ROPE_SIDE_LIMIT, TIER_COLLAPSE_MODES, DatasetConfig
from anima_train.errors import UserError

log = logging.getLogger(__name__)

DATASET_DEFAULTS = DatasetConfig()  # the `[dataset]` defaults: the one source of every bucket setting's default


class BucketError(UserError, ValueError):
    """A source or a setting that bucketing cannot handle; the message says which and what to change."""


@dataclass(frozen=True)
class BucketPlan:
    """Where one source lands at one tier.

    bucket    training size (W, H), multiples of bucket_reso_steps.
    resized   size the source is resized to (LANCZOS) before the centre trim; == source when no resize.
    crop_ltrb sd-scripts' `get_crop_ltrb(bucket, source)`: the source fitted *inside* the bucket, in bucket
              pixels (floats). It is what sd-scripts stores as crop metadata; it is not the trim box.
    trim      (x, y) offset of the bucket-sized window cut from the resized image: the pixel crop is
              resized_image.crop((x, y, x + W, y + H)).
    """

    source: tuple[int, int]
    bucket: tuple[int, int]
    resized: tuple[int, int]
    crop_ltrb: tuple[float, float, float, float]
    trim: tuple[int, int]

    @property
    def tokens(self) -> int:
        """DiT tokens: 8x VAE downsampling, then 2x2 patches."""
        return (self.bucket[0] // 16) * (self.bucket[1] // 16)


def make_bucket_resolutions(
    resolution: int, min_bucket_reso: int, max_bucket_reso: int, bucket_reso_steps: int, multires_training: bool
) -> list[tuple[int, int]]:
    """The upscale branch's predefined buckets for area budget resolution², sorted.

    sd-scripts: the largest square, then for each width min..max (by step) the tallest height that fits the area
    (capped at max), and its transpose. The multires fork adds every height from min up to that tallest one.
    """
    area = resolution * resolution
    step = bucket_reso_steps
    side = int(math.sqrt(area) // step) * step
    resos = {(side, side)}
    for width in range(min_bucket_reso, max_bucket_reso + 1, step):
        tallest = min(max_bucket_reso, int((area // width) // step) * step)
        heights = range(min_bucket_reso, tallest + 1, step) if multires_training else [tallest]
        for height in heights:
            if height >= min_bucket_reso:
                resos.add((width, height))
                resos.add((height, width))
    return sorted(resos)


def crop_ltrb(bucket: tuple[int, int], source: tuple[int, int]) -> tuple[float, float, float, float]:
    """sd-scripts' get_crop_ltrb (Stability AI's convention): fit the source's aspect inside the bucket,
    centred; left/top floor-divided by 2. Types follow Python's int/float mixing, so compare with ==."""
    bw, bh = bucket
    source_ar = source[0] / source[1]
    if bw / bh > source_ar:  # bucket wider: match heights
        fit_w, fit_h = bh * source_ar, bh
    else:
        fit_w, fit_h = bw, bw / source_ar
    left = (bw - fit_w) // 2
    top = (bh - fit_h) // 2
    return left, top, left + fit_w, top + fit_h


class Bucketer:
    """Buckets sources for one tier. Argument names are the `[dataset]` config keys.

    resolution is the tier: an AREA budget (≈ resolution² pixels), not a side length.
    """

    def __init__(
        self,
        resolution: int,
        *,
        bucket_no_upscale: bool = DATASET_DEFAULTS.bucket_no_upscale,
        min_bucket_reso: int = DATASET_DEFAULTS.min_bucket_reso,
        max_bucket_reso: int = DATASET_DEFAULTS.max_bucket_reso,
        bucket_reso_steps: int = DATASET_DEFAULTS.bucket_reso_steps,
        multires_training: bool = DATASET_DEFAULTS.multires_training,
    ) -> None:
        if resolution <= 0 or bucket_reso_steps <= 0 or min_bucket_reso <= 0:
            raise BucketError(
                f"resolution ({resolution}), bucket_reso_steps ({bucket_reso_steps}) and min_bucket_reso "
                f"({min_bucket_reso}) must be positive"
            )
        if resolution < bucket_reso_steps:  # the smallest bucket, steps x steps, is already larger than the tier
            raise BucketError(
                f"resolution {resolution} is below bucket_reso_steps ({bucket_reso_steps}): bucket sides are "
                f"multiples of bucket_reso_steps, so no image fits a {resolution}x{resolution} area; raise the "
                f"resolution (e.g. 1024) or lower bucket_reso_steps"
            )
        # sd-scripts asserts the same two relations (in both branches)
        if max_bucket_reso < resolution:
            raise BucketError(
                f"max_bucket_reso ({max_bucket_reso}) is below the tier resolution {resolution}: raise "
                f"max_bucket_reso or lower the resolution"
            )
        if max_bucket_reso < min_bucket_reso:
            raise BucketError(f"max_bucket_reso ({max_bucket_reso}) is below min_bucket_reso ({min_bucket_reso})")
        self.resolution = resolution
        self.max_area = resolution * resolution
        self.no_upscale = bucket_no_upscale
        self.min_reso = min_bucket_reso
        self.max_reso = max_bucket_reso
        self.step = bucket_reso_steps
        self.multires = multires_training
        self.predefined: list[tuple[int, int]] = []
        if not bucket_no_upscale:
            self.predefined = make_bucket_resolutions(
                resolution, min_bucket_reso, max_bucket_reso, bucket_reso_steps, multires_training
            )
            self._predefined_set = set(self.predefined)
            self._aspects = np.array([w / h for w, h in self.predefined])
            self._areas = np.array([w * h for w, h in self.predefined])

    def _round_to_step(self, x: float) -> int:
        x = int(x + 0.5)
        return x - x % self.step

    def _predefined_bucket(self, w: int, h: int) -> tuple[int, int]:
        if (w, h) in self._predefined_set:  # an exact fit is kept (sd-scripts: pre-bucketed fine-tune sets)
            return (w, h)
        errors = np.abs(self._aspects - w / h)
        if not self.multires:
            return self.predefined[int(errors.argmin())]  # first minimum, list sorted by (W, H)
        # fork: among aspect errors within 1e-4 of the best, the area closest to the source's
        close = np.flatnonzero(errors <= errors.min() + 1e-4)
        return self.predefined[int(close[np.abs(self._areas[close] - w * h).argmin()])]

    def _shrunk_size(self, w: int, h: int) -> tuple[int, int]:
        """No-upscale branch: the size the source is resized to (sd-scripts' arithmetic, same float order)."""
        if w * h <= self.max_area:
            return (w, h)
        aspect = w / h
        rw = math.sqrt(self.max_area * aspect)
        rh = self.max_area / rw
        # round the width to a step, or the height: whichever keeps the aspect closer
        bw = self._round_to_step(rw)
        bh_w = self._round_to_step(bw / aspect)
        bh = self._round_to_step(rh)
        bw_h = self._round_to_step(bh * aspect)
        if bh_w == 0 or bh == 0:  # sd-scripts divides by zero here; only for absurd aspects
            raise BucketError(f"source {w}x{h} is too thin to bucket at resolution {self.resolution}")
        if abs(bw / bh_w - aspect) < abs(bw_h / bh - aspect):
            return (bw, int(bw / aspect + 0.5))
        return (int(bh * aspect + 0.5), bh)

    def select(self, width: int, height: int) -> BucketPlan:
        """Bucket, resized size, crop and trim for a width x height source."""
        w, h = int(width), int(height)
        if w <= 0 or h <= 0:
            raise BucketError(f"source size {width}x{height} is not positive")
        if self.no_upscale:
            resized = self._shrunk_size(w, h)
            longest = max(resized)
            if longest > self.max_reso:  # per-side cap (ours): uniform shrink, round half up
                shrink = self.max_reso / longest
                resized = (int(resized[0] * shrink + 0.5), int(resized[1] * shrink + 0.5))
            bucket = (resized[0] - resized[0] % self.step, resized[1] - resized[1] % self.step)
            if bucket[0] == 0 or bucket[1] == 0:
                raise BucketError(
                    f"source {w}x{h} gives an empty bucket {bucket[0]}x{bucket[1]} (a side is below "
                    f"bucket_reso_steps={self.step} after resizing): drop it or use a smaller bucket_reso_steps"
                )
        else:
            bucket = self._predefined_bucket(w, h)
            aspect = w / h
            # cover the bucket: match the side that the aspect makes binding
            scale = bucket[1] / h if aspect > bucket[0] / bucket[1] else bucket[0] / w
            resized = (int(w * scale + 0.5), int(h * scale + 0.5))
        trim = ((resized[0] - bucket[0]) // 2, (resized[1] - bucket[1]) // 2)
        return BucketPlan((w, h), bucket, resized, crop_ltrb(bucket, (w, h)), trim)


def verify_max_resolution(buckets: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """RoPE per-side check (not area) of produced buckets.

    Raises BucketError if a side exceeds 2048 px; returns the buckets with a side in (1920, 2048] and logs one
    warning for them. Anima declares 120 patch units (1920 px); its RoPE table reaches 128 units (2048 px).
    """
    buckets = sorted(set(tuple(b) for b in buckets))
    too_big = [b for b in buckets if max(b) > ROPE_SIDE_LIMIT]
    if too_big:
        shown = ", ".join(f"{w}x{h}" for w, h in too_big[:5])
        raise BucketError(
            f"bucket(s) {shown} have a side above {ROPE_SIDE_LIMIT} px, beyond Anima's RoPE range (128 patch "
            f"units; 2112 px crashes): set max_bucket_reso <= {ROPE_SIDE_DECLARED}"
        )
    beyond_spec = [b for b in buckets if max(b) > ROPE_SIDE_DECLARED]
    if beyond_spec:
        shown = ", ".join(f"{w}x{h}" for w, h in beyond_spec[:5])
        log.warning(
            f"{len(beyond_spec)} bucket(s) ({shown}{', ...' if len(beyond_spec) > 5 else ''}) have a side in "
            f"({ROPE_SIDE_DECLARED}, {ROPE_SIDE_LIMIT}] px: beyond the declared RoPE range (120 patch units), "
            f"positions extrapolate; max_bucket_reso = {ROPE_SIDE_DECLARED} stays in spec"
        )
    return beyond_spec


# ---------------------------------------------------------------------------------------------------------
# Tiers (docs/training.md#tiers-and-the-audit): every source is bucketed at every tier. Buckets grow with the
# tier until the tier passes the source's own area; above that a tier repeats a lower tier's bucket ("collapse").
# "Grow" holds per side for ladders spaced like the audit's (x1.25) but not for tiers about one step apart:
# sd-scripts rounds the width first at one tier and the height at the next, so 2847x926 buckets to 1792x576
# at 1024 and 1728x576 at 1088. Collapse is therefore "same bucket as any lower tier", never a size test.


@dataclass(frozen=True)
class TierEntry:
    source_index: int
    tier: int
    plan: BucketPlan
    collapsed: bool  # its bucket equals the one of a lower tier for the same source


BUCKET_KEYS = ("bucket_no_upscale", "min_bucket_reso", "max_bucket_reso", "bucket_reso_steps", "multires_training")


def bucket_settings(dataset) -> dict:
    """The Bucketer keywords taken by name from a `[dataset]` config object."""
    return {k: getattr(dataset, k) for k in BUCKET_KEYS}


def make_bucketers(tiers: Sequence[int], **settings) -> dict[int, Bucketer]:
    """One Bucketer per tier, ascending: make_bucketers(cfg.dataset.tiers, **bucket_settings(cfg.dataset))."""
    return {t: Bucketer(t, **settings) for t in sorted(set(tiers))}


def plan_tiers(
    sizes: Sequence[tuple[int, int]], bucketers: dict[int, Bucketer],
    tier_collapse: str = DATASET_DEFAULTS.tier_collapse,
) -> list[TierEntry]:
    """Cross product sources x tiers, with collapse handling.

    dedup  keeps the first (lowest-tier) entry of each (source, bucket); a collapsed tier adds nothing.
    repeat keeps all N entries per source (collapsed ones marked), so a small source weighs N x.
    Checks the produced buckets against the RoPE limit.
    """
    if tier_collapse not in TIER_COLLAPSE_MODES:
        raise BucketError(f"tier_collapse = {tier_collapse!r}: use one of {', '.join(TIER_COLLAPSE_MODES)}")
    tiers = sorted(bucketers)
    entries: list[TierEntry] = []
    for index, (w, h) in enumerate(sizes):
        seen: set[tuple[int, int]] = set()
        for t in tiers:
            plan = bucketers[t].select(w, h)
            collapsed = plan.bucket in seen
            seen.add(plan.bucket)
            if collapsed and tier_collapse == "dedup":
                continue
            entries.append(TierEntry(index, t, plan, collapsed))
    verify_max_resolution({e.plan.bucket for e in entries})
    return entries


def below_min_source_area(width: int, height: int, min_source_area: float, tiers: Sequence[int]) -> bool:
    """True if the source is to be dropped: w·h < min_source_area · (smallest tier)²."""
    return width * height < min_source_area * min(tiers) ** 2


@dataclass
class TierCounts:
    tier: int
    entries: int
    collapsed: int  # sources whose bucket at this tier repeats a lower tier's


def tier_counts(entries: Sequence[TierEntry], n_sources: int, tiers: Sequence[int]) -> list[TierCounts]:
    """Per-tier entry and collapse counts. Under dedup collapsed entries are absent, so the collapse count is
    n_sources minus the entries; under repeat they are present and marked."""
    out = []
    for t in sorted(set(tiers)):
        mine = [e for e in entries if e.tier == t]
        marked = sum(e.collapsed for e in mine)
        out.append(TierCounts(t, len(mine), marked + (n_sources - len(mine))))
    return out


def tier_report(counts: Sequence[TierCounts], n_sources: int) -> tuple[list[str], list[str]]:
    """Startup lines and warnings (a tier whose collapse rate is >= 1%)."""
    lines = [f"tiers    {n_sources} sources x {len(counts)} tier(s)"]
    warnings = []
    for c in counts:
        extra = f"  ({c.collapsed} collapsed onto a lower tier)" if c.collapsed else ""
        lines.append(f"         {c.tier:>5}: {c.entries:>6} entries{extra}")
        if n_sources and c.collapsed / n_sources >= 0.01:
            warnings.append(
                f"tier {c.tier}: {c.collapsed}/{n_sources} sources ({100 * c.collapsed / n_sources:.1f}%) are "
                f"smaller than this tier and repeat a lower tier's bucket; run the audit for a ladder that "
                f"fits the data, or accept it"
            )
    return lines, warnings


# ---------------------------------------------------------------------------------------------------------
# Audit (docs/training.md#tiers-and-the-audit): what ladder does this dataset's size distribution support?

AUDIT_PERCENTILES = (0.01, 0.05, 0.10, 0.25, 0.50, 0.90)


def area_percentiles(areas: Sequence[float], percentiles: Sequence[float] = AUDIT_PERCENTILES) -> dict[float, float]:
    """Nearest-rank on the sorted areas: index floor(p·n)."""
    if not areas:
        raise BucketError("no sources to audit")
    ordered = sorted(areas)
    n = len(ordered)
    return {p: ordered[min(n - 1, int(p * n))] for p in percentiles}


def ceiling_tier(area: float, step: int = 64) -> int:
    """The largest tier a source of this area fills: max(64, floor(sqrt(area)/step)·step)."""
    return max(64, int(math.sqrt(area) // step) * step)


def suggest_ladder(areas: Sequence[float], step: int = DATASET_DEFAULTS.bucket_reso_steps,
                   max_tier: int = ROPE_SIDE_DECLARED) -> list[int]:
    """Three rungs, 1.25x apart in side: top = min(ceiling(p10), max_tier); rungs ceiling((top/1.25^k)²)."""
    top = min(ceiling_tier(area_percentiles(areas, (0.10,))[0.10], step), max_tier)
    return sorted({ceiling_tier((top / 1.25**k) ** 2, step) for k in range(3)})


def audit_report(areas: Sequence[float], step: int = DATASET_DEFAULTS.bucket_reso_steps,
                 max_tier: int = ROPE_SIDE_DECLARED) -> list[str]:
    """The audit's size-distribution table and the proposed ladder."""
    pct = area_percentiles(areas)
    ladder = suggest_ladder(areas, step, max_tier)
    top = ladder[-1]
    below = sum(a < top * top for a in areas)
    lines = [f"source-area distribution ({len(areas)} sources)", "   pct     MP    tier at this source's own ceiling"]
    for p, a in pct.items():
        lines.append(f"   p{round(p * 100):<4} {a / 1e6:5.2f}  {ceiling_tier(a, step):>6}px")
    lines.append(f"   suggested ladder: resolutions = [{', '.join(map(str, ladder))}]")
    lines.append(f"   -> {below}/{len(areas)} sources ({100 * below / len(areas):.1f}%) sit below the top rung")
    return lines
