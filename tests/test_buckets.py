"""Bucketing: sd-scripts parity table, the per-side cap, the RoPE check, tiers/collapse and the audit ladder."""

import csv
import gzip
import json
import logging
import math
import random
from pathlib import Path

import pytest

from anima_train.data.buckets import (BucketError, Bucketer, area_percentiles, audit_report, below_min_source_area,
    bucket_settings, ceiling_tier, crop_ltrb, make_bucket_resolutions, make_bucketers, plan_tiers, suggest_ladder,
    tier_counts, tier_report, verify_max_resolution)

PARITY = Path(__file__).parent / "data" / "buckets" / "sdscripts_parity.csv.gz"


def load_parity():
    with gzip.open(PARITY, "rt", encoding="utf-8") as f:
        header = json.loads(f.readline().removeprefix("# "))
        rows = list(csv.reader(f))
    return header, rows


def test_sdscripts_parity_every_row():
    header, rows = load_parity()
    settings = header["settings"]
    assert len(rows) >= 500 * len(settings) and len(settings) >= 16
    # the table covers both branches, both steps, multires on/off and several tiers
    assert {s["bucket_no_upscale"] for s in settings} == {True, False}
    assert {s["multires_training"] for s in settings} == {True, False}
    assert {s["bucket_reso_steps"] for s in settings} == {32, 64}
    assert {512, 768, 1024, 1536} <= {s["resolution"] for s in settings}

    bucketers = [Bucketer(**s) for s in settings]
    mismatches = []
    for row in rows:
        si, w, h, bw, bh, rw, rh = map(int, row[:7])
        expected = ((bw, bh), (rw, rh), tuple(float(x) for x in row[7:11]), (int(row[11]), int(row[12])))
        plan = bucketers[si].select(w, h)
        got = (plan.bucket, plan.resized, tuple(float(x) for x in plan.crop_ltrb), plan.trim)
        if got != expected:
            mismatches.append((settings[si], (w, h), got, expected))
    assert not mismatches, f"{len(mismatches)}/{len(rows)} rows differ from sd-scripts, first: {mismatches[:3]}"


def test_parity_table_discriminates():
    """Negative control: flipping multires_training must break many rows, so the table can fail."""
    header, rows = load_parity()
    settings = header["settings"]
    flipped = [Bucketer(**{**s, "multires_training": not s["multires_training"]}) for s in settings]
    upscale_rows = [r for r in rows if not settings[int(r[0])]["bucket_no_upscale"]]
    differ = sum(flipped[int(r[0])].select(int(r[1]), int(r[2])).bucket != (int(r[3]), int(r[4])) for r in upscale_rows)
    assert differ > len(upscale_rows) // 10


@pytest.mark.parametrize(
    "resolution, source, bucket",
    [
        (1536, (512, 512), (512, 512)),  # never upscaled
        (1536, (1920, 1080), (1920, 1024)),
        (1536, (3840, 2160), (1920, 1024)),  # area-shrunk to 2048x1152, then capped to 1920 long side
        (1536, (6000, 800), (1920, 256)),  # capped on the long side
        (1024, (1920, 1080), (1344, 768)),
        (1024, (6000, 800), (1920, 256)),
    ],
)
def test_per_side_cap_worked_examples(resolution, source, bucket):
    plan = Bucketer(resolution, max_bucket_reso=1920).select(*source)
    assert plan.bucket == bucket
    assert plan.resized[0] >= bucket[0] and plan.resized[1] >= bucket[1]  # cropped, never padded
    assert plan.resized[0] <= source[0] and plan.resized[1] <= source[1]  # never enlarged


def test_cap_off_matches_plain_sdscripts_and_cap_is_shrink_only():
    # without the cap sd-scripts would give 2048x1152 for 3840x2160 at 1536
    assert Bucketer(1536, max_bucket_reso=4096).select(3840, 2160).bucket == (2048, 1152)
    capped, free = Bucketer(1536, max_bucket_reso=1920), Bucketer(1536, max_bucket_reso=100000)
    n_capped = 0
    for w, h in synthetic_sizes(2000, seed=3):
        a, b = capped.select(w, h), free.select(w, h)
        assert max(a.bucket) <= 1920
        if max(b.resized) <= 1920:
            assert a == b  # the cap only acts on sizes above it
        else:
            n_capped += 1
            assert a.resized[0] <= b.resized[0] and a.resized[1] <= b.resized[1]
    assert n_capped > 50  # wide sources above the area budget do reach the cap


def test_upscale_branch_respects_cap_and_min():
    bk = Bucketer(1536, bucket_no_upscale=False, min_bucket_reso=256, max_bucket_reso=1920)
    assert all(256 <= min(r) and max(r) <= 1920 for r in bk.predefined)
    # a small source is enlarged to cover its bucket in this branch
    plan = bk.select(300, 200)
    assert plan.resized[0] >= plan.bucket[0] and plan.resized[1] >= plan.bucket[1] and plan.resized[0] > 300


def test_multires_list_is_a_superset_with_more_entries():
    plain = make_bucket_resolutions(1024, 256, 1024, 64, False)
    multi = make_bucket_resolutions(1024, 256, 1024, 64, True)
    assert set(plain) <= set(multi) and len(multi) > 5 * len(plain)
    assert all(w * h <= 1024 * 1024 and w % 64 == 0 and h % 64 == 0 for w, h in multi)
    # the tie-break: a 16:9 source gets an exact 16:9 bucket of the closest area under multires
    assert Bucketer(1024, bucket_no_upscale=False, multires_training=True).select(1920, 1080).bucket == (1024, 576)
    assert Bucketer(1024, bucket_no_upscale=False, multires_training=False).select(1920, 1080).bucket == (1344, 768)


def test_crop_ltrb_fits_source_inside_bucket():
    left, top, right, bottom = crop_ltrb((1344, 768), (1920, 1080))
    assert (left, right) == (0, 1344) and top == 6 and bottom == pytest.approx(762)


def test_bad_settings_and_sources_raise_clearly():
    with pytest.raises(BucketError, match="max_bucket_reso"):
        Bucketer(2048, max_bucket_reso=1920)
    with pytest.raises(BucketError, match="min_bucket_reso"):
        Bucketer(512, bucket_no_upscale=False, min_bucket_reso=1024, max_bucket_reso=768)
    with pytest.raises(BucketError, match="empty bucket"):
        Bucketer(1024).select(40, 900)  # 40 px wide: below one 64 px step
    with pytest.raises(BucketError, match="not positive"):
        Bucketer(1024).select(0, 10)


def test_verify_max_resolution(caplog):
    assert verify_max_resolution([(1920, 1024), (1024, 1024)]) == []
    with caplog.at_level(logging.WARNING, logger="anima_train.data.buckets"):
        assert verify_max_resolution([(2048, 512), (1984, 640), (1920, 1088)]) == [(1984, 640), (2048, 512)]
    assert "1984x640" in caplog.text and "max_bucket_reso = 1920" in caplog.text
    with pytest.raises(BucketError, match="2112x512"):
        verify_max_resolution([(2112, 512), (1024, 1024)])


def test_plan_tiers_checks_rope_of_produced_buckets():
    with pytest.raises(BucketError, match="above 2048"):
        plan_tiers([(8000, 1000)], make_bucketers([1536], max_bucket_reso=4096))


# ---------------------------------------------------------------------------------------------------------- tiers


def synthetic_sizes(n, seed=7):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ar = math.exp(rng.uniform(math.log(0.3), math.log(3.2)))
        area = math.exp(rng.uniform(math.log(0.1e6), math.log(20e6)))
        w = max(64, round(math.sqrt(area * ar)))
        out.append((w, max(64, round(area / w))))
    return out


@pytest.mark.parametrize("tiers", [[640, 832, 1088], [768, 1024, 1280], [512, 768, 1024, 1536]])
@pytest.mark.parametrize("steps", [64, 32])
def test_buckets_monotone_in_tier_for_ladder_spacings(tiers, steps):
    bucketers = make_bucketers(tiers, bucket_reso_steps=steps)
    for w, h in synthetic_sizes(1500):
        buckets = [bucketers[t].select(w, h).bucket for t in sorted(tiers)]
        for lo, hi in zip(buckets, buckets[1:]):
            assert hi[0] >= lo[0] and hi[1] >= lo[1], (w, h, buckets)


def test_tiers_one_step_apart_are_not_monotone_in_sdscripts_arithmetic():
    """Why collapse detection compares buckets, not sizes: at 1024 the width is rounded first, at 1088 the
    height, and the larger tier's bucket comes out narrower (sd-scripts gives the same)."""
    b = make_bucketers([1024, 1088])
    assert b[1024].select(2847, 926).bucket == (1792, 576)
    assert b[1088].select(2847, 926).bucket == (1728, 576)


def test_collapse_dedup_vs_repeat():
    sizes = [(512, 512), (1000, 1000), (4000, 3000), (700, 1400)]
    bucketers = make_bucketers([640, 832, 1088])
    dedup = plan_tiers(sizes, bucketers, "dedup")
    repeat = plan_tiers(sizes, bucketers, "repeat")
    assert len(repeat) == len(sizes) * 3
    # 512x512 fills no tier above its own area: one entry under dedup, three identical under repeat
    assert [e.tier for e in dedup if e.source_index == 0] == [640]
    assert [e.plan.bucket for e in repeat if e.source_index == 0] == [(512, 512)] * 3
    assert [e.collapsed for e in repeat if e.source_index == 0] == [False, True, True]
    # 4000x3000 is larger than every tier: three distinct buckets in both modes
    assert len({e.plan.bucket for e in dedup if e.source_index == 2}) == 3
    # dedup == repeat minus the collapsed entries, and keeps no duplicate (source, bucket)
    assert dedup == [e for e in repeat if not e.collapsed]
    assert len({(e.source_index, e.plan.bucket) for e in dedup}) == len(dedup)
    for mode, entries in (("dedup", dedup), ("repeat", repeat)):
        counts = tier_counts(entries, len(sizes), [640, 832, 1088])
        # only 512x512 collapses (at 832 and 1088); 1000x1000 fills 1088 partly: 960x960, a new bucket
        assert [c.collapsed for c in counts] == [0, 1, 1]
        assert [c.entries for c in counts] == ([4, 3, 3] if mode == "dedup" else [4, 4, 4])
    with pytest.raises(BucketError, match="tier_collapse"):
        plan_tiers(sizes, bucketers, "drop")


def test_tier_report_warns_at_one_percent():
    sizes = [(4000, 3000)] * 99 + [(500, 500)]  # 448x448 at both tiers
    entries = plan_tiers(sizes, make_bucketers([512, 1024]))
    lines, warnings = tier_report(tier_counts(entries, 100, [512, 1024]), 100)
    assert lines[0] == "tiers    100 sources x 2 tier(s)"
    assert "99 entries  (1 collapsed onto a lower tier)" in lines[2]
    assert len(warnings) == 1 and warnings[0].startswith("tier 1024: 1/100")
    sizes = [(4000, 3000)] * 200 + [(500, 500)]  # 0.5%: no warning
    _, warnings = tier_report(tier_counts(plan_tiers(sizes, make_bucketers([512, 1024])), 201, [512, 1024]), 201)
    assert warnings == []


def test_min_source_area():
    assert below_min_source_area(600, 600, 1.0, [640, 832])  # 360k < 640²
    assert not below_min_source_area(640, 640, 1.0, [832, 640])
    assert not below_min_source_area(100, 100, 0.0, [640])


# ---------------------------------------------------------------------------------------------------------- audit


def test_audit_percentiles_use_floor_index():
    areas = list(range(100, 0, -1))  # unsorted on purpose
    pct = area_percentiles(areas)
    assert pct[0.01] == 2 and pct[0.10] == 11 and pct[0.50] == 51 and pct[0.90] == 91
    with pytest.raises(BucketError):
        area_percentiles([])


def test_ceiling_tier():
    assert ceiling_tier(1.24e6) == 1088  # sqrt = 1113.6
    assert ceiling_tier(0.55e6) == 704
    assert ceiling_tier(5.0e6) == 2176
    assert ceiling_tier(100) == 64  # floor of the ladder
    assert ceiling_tier(1.24e6, step=32) == 1088 and ceiling_tier(1.26e6, step=32) == 1120


def test_suggested_ladder_example_and_cap():
    # 10% of the sources at or below 1.24 MP -> top rung 1088 -> [640, 832, 1088]
    areas = [1.0e6] * 10 + [1.24e6] + [3.0e6] * 89
    assert area_percentiles(areas)[0.10] == 1.24e6
    assert suggest_ladder(areas) == [640, 832, 1088]
    # a set of huge sources is capped at the RoPE spec side: 1920 / 1.25^k floored to 64
    assert suggest_ladder([40e6] * 50) == [1216, 1536, 1920]
    lines = audit_report(areas)
    assert "   suggested ladder: resolutions = [640, 832, 1088]" in lines
    assert lines[-1] == "   -> 10/100 sources (10.0%) sit below the top rung"


def test_config_dataset_table_can_be_passed_through():
    config = pytest.importorskip("anima_train.config")
    d = config.DatasetConfig(path="x", resolutions=[640, 1024], bucket_reso_steps=32)
    bucketers = make_bucketers(d.tiers, **bucket_settings(d))
    assert sorted(bucketers) == [640, 1024] and bucketers[1024].step == 32
    assert bucketers[1024].select(1920, 1080).bucket == Bucketer(1024, bucket_reso_steps=32).select(1920, 1080).bucket
