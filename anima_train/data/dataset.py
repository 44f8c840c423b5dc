"""The dataset pipeline: scan folders, bucket every source at every tier, find (and check) latent caches, and
serve bucket-homogeneous batches (docs/training.md: buckets, latent caches, tiers, batches, captions).

    build_training_data(cfg, model_path) -> TrainingData   what the trainer calls
    scan_folders / plan_sources / attach_caches              the same steps, used by `anima-train cache` / `audit`

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
VAE; `auto` is `images` for a folder with any image, else `latents`. Every folder must end up in one mode.

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

import dataclasses
import hashlib
import json
import os
import re
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from anima_train.data.buckets import (BUCKET_KEYS, DATASET_DEFAULTS, BucketError, BucketPlan, below_min_source_area,
    crop_ltrb, make_bucketers, plan_tiers, tier_counts, tier_report)
from anima_train.data.captions import CaptionError, build_caption, read_caption_files
from anima_train.config import MAX_REPEATS
from anima_train.errors import UserError
from anima_train.data.images import decoded_size, header_size, open_image
from anima_train.data.batches import BucketBatchSampler, EpochKey

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")  # what sd-scripts accepts
CACHE_TAIL = "_anima.safetensors"
CACHE_NAME = re.compile(r"^(?P<stem>.+)_(?P<w>\d{4})x(?P<h>\d{4})_anima\.safetensors$")
REPEAT_FOLDER = re.compile(r"^(?P<n>\d+)_(?P<name>.+)$")  # sd-scripts DreamBooth folders: "10_char"
CACHE_FORMAT = "anima-latent-cache/1"
SOURCE_MODES = ("images", "latents", "encode", "auto")


class DatasetError(UserError, ValueError):
    """A dataset problem found while scanning; the message names the files/settings and the fix."""


class CacheUnreadable(DatasetError):
    """A latent cache whose safetensors header cannot be read (truncated, not safetensors)."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"latent cache {path} cannot be read ({reason}): delete it and re-run anima-train cache")
        self.path, self.reason = path, reason


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


def cache_path(stem_path: Path, bucket: tuple[int, int]) -> Path:
    """`<stem>_WWWWxHHHH_anima.safetensors` beside the image (stem_path = folder / stem)."""
    return stem_path.with_name(f"{stem_path.name}_{bucket[0]:04d}x{bucket[1]:04d}{CACHE_TAIL}")


def _wxh(size) -> str:
    return f"{size[0]}x{size[1]}"


def parse_wxh(text: str) -> tuple[int, int]:
    w, h = text.lower().split("x")
    return int(w), int(h)


# ----------------------------------------------------------------------------------------------------------
# VAE identity: a content hash of the weights and the config, so caches from another VAE are refused

_VAE_ID_MEMO: dict = {}


def vae_identity(model_path) -> str | None:
    """sha256 of `vae/*.safetensors` (bytes) and `vae/config.json` (parsed, without diffusers' bookkeeping keys
    that start with "_"), or None when the model has no `vae/` folder. Memoised per (file, size, mtime)."""
    vae_dir = Path(model_path) / "vae"
    weights = sorted(vae_dir.glob("*.safetensors")) if vae_dir.is_dir() else []
    config = vae_dir / "config.json"
    if not weights or not config.is_file():
        return None
    key = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in weights + [config])
    if key not in _VAE_ID_MEMO:
        h = hashlib.sha256()
        for p in weights:
            with open(p, "rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
        cfg = {k: v for k, v in json.loads(config.read_text(encoding="utf-8")).items() if not k.startswith("_")}
        h.update(json.dumps(cfg, sort_keys=True).encode())
        _VAE_ID_MEMO[key] = "sha256:" + h.hexdigest()
    return _VAE_ID_MEMO[key]


# ----------------------------------------------------------------------------------------------------------
# Folders


@dataclass
class Folder:
    """One scanned directory: a source folder or one of its N_name subfolders."""

    subset: int  # index into the resolved subsets
    path: Path
    repeats: int  # folder factor x subset num_repeats
    texture: bool
    images: dict[str, Path] = field(default_factory=dict)  # stem -> image file
    caches: dict[str, list[Path]] = field(default_factory=dict)  # stem -> cache files
    captions: set[str] = field(default_factory=set)  # stems with a <stem>.txt
    mode: str = ""  # images | latents | encode, once resolved


@dataclass
class Scan:
    folders: list[Folder]
    subsets: list  # SubsetConfig-like (path, num_repeats, texture)
    notes: list[str]  # things worth printing (ignored subfolders, ...)


def _entries(path: Path, want_dirs: bool) -> list[str]:
    """The sorted names of the files (or folders) in `path`, hidden ones left out. A symbolic link that loops or
    cannot be followed is refused by name: silently dropping it would drop the images the user put behind it."""
    names = []
    with os.scandir(path) as it:
        for e in sorted(it, key=lambda e: e.name):  # sorted: the first bad link named is the same on every run
            if e.name.startswith("."):
                continue
            try:
                kind = e.is_dir() if want_dirs else e.is_file()
            except OSError as exc:
                raise DatasetError(f"{path / e.name}: a symbolic link that cannot be followed ({exc.strerror}): "
                                   f"remove it or point it at a real file or folder") from None
            if kind:
                names.append(e.name)
    return sorted(names)


def _list_folder(folder: Folder) -> None:
    names = _entries(folder.path, want_dirs=False)
    for name in names:
        lower = name.lower()
        if lower.endswith(CACHE_TAIL):
            m = CACHE_NAME.match(name)
            if m:
                folder.caches.setdefault(m["stem"], []).append(folder.path / name)
        elif lower.endswith(".txt"):
            folder.captions.add(name[:-4])
        elif lower.endswith(IMAGE_EXTENSIONS):
            stem = name.rsplit(".", 1)[0]
            if stem in folder.images:
                raise DatasetError(
                    f"{folder.images[stem].name} and {name} in {folder.path} share the stem {stem!r}, so they would "
                    f"share one caption and one cache: rename or remove one of them")
            folder.images[stem] = folder.path / name


def scan_folders(subsets) -> Scan:
    """List every source folder and its N_name subfolders (see the module docstring)."""
    folders, notes = [], []
    for i, sub in enumerate(subsets):
        root = Path(sub.path).expanduser()
        if not root.is_dir():
            # no "in the config": `cache DIR` and `audit DIR` get here with a folder typed on the command line
            raise DatasetError(f"dataset folder {root} does not exist (or is not a folder): check the path")
        top = Folder(i, root, int(sub.num_repeats), bool(sub.texture))
        _list_folder(top)
        mine = [top]
        for name in _entries(root, want_dirs=True):
            m = REPEAT_FOLDER.match(name)
            if not m:
                notes.append(f"{root / name}: not scanned (only N_name subfolders such as 10_{name} are)")
                continue
            n = int(m["n"])
            if n < 1:
                raise DatasetError(f"{root / name}: an N_name folder needs N >= 1 repeats; rename it")
            if n * int(sub.num_repeats) > MAX_REPEATS:
                raise DatasetError(f"{root / name}: {n} x num_repeats {sub.num_repeats} = {n * int(sub.num_repeats)} "
                                   f"repeats is more than {MAX_REPEATS}; rename the folder with a smaller N")
            sub_folder = Folder(i, root / name, n * int(sub.num_repeats), bool(sub.texture))
            _list_folder(sub_folder)
            mine.append(sub_folder)
        mine = [f for f in mine if f.images or f.caches]
        if not mine:
            raise DatasetError(f"dataset folder {root} holds no images ({' '.join(IMAGE_EXTENSIONS)}) and no "
                               f"*{CACHE_TAIL} caches: check the path")
        folders += mine
    return Scan(folders, list(subsets), notes)


def resolve_modes(scan: Scan, source: str) -> str:
    """Give every folder its mode; all folders must agree (a batch is all pixels or all latents)."""
    if source not in SOURCE_MODES:
        raise DatasetError(f"[dataset] source = {source!r}: use one of {', '.join(SOURCE_MODES)}")
    for f in scan.folders:
        if source == "auto":
            f.mode = "images" if f.images else "latents"
        elif source in ("images", "encode") and not f.images:
            raise DatasetError(
                f'{f.path} has caches but no images, and source = "{source}" buckets from images: set '
                f'source = "latents" (or "auto") to train on the caches')
        else:
            f.mode = source
    modes = {f.mode for f in scan.folders}
    if len(modes) > 1:
        lines = []
        for f in scan.folders:
            what = f"{len(f.images)} images" if f.images else f"{sum(map(len, f.caches.values()))} caches, no images"
            lines.append(f"  subset {f.subset} {f.path}: {f.mode} ({what})")
        raise DatasetError(
            "the dataset folders resolve to different source modes, but a batch must be all latents from one "
            "kind of source:\n" + "\n".join(lines) + '\nfix: set [dataset] source = "latents" to train on the '
            "caches everywhere (cache the image folders first with anima-train cache), or restore the images")
    return modes.pop()


# ----------------------------------------------------------------------------------------------------------
# Sources: one image (or one cached stem) with its original size


@dataclass
class Source:
    folder: int  # index into Scan.folders
    stem: Path  # folder / stem
    image: Path | None
    size: tuple[int, int] | None  # original (w, h); None for a cache without original_size


LATENT_CHANNELS = 16
LATENTS_NONFINITE = "@nonfinite"  # key added by read_cache_metadata: count of NaN/inf latents, when there are any
LATENTS_LAYOUT = "@latents"  # key added by read_cache_metadata: the tensor's layout from the header, never in a file
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def latents_layout(dtype: str, shape) -> str:
    """"float32 [16, 1, 16, 16]": how layouts are compared and shown (dtype in torch's spelling)."""
    dtype = str(dtype).removeprefix("torch.")
    return f"{_SAFETENSORS_DTYPES.get(dtype, dtype.lower())} {list(shape)}"


def expected_latents_layout(bucket: tuple[int, int]) -> str:
    """What a cache for a W x H bucket holds: float32 (16, 1, H/8, W/8), as `anima-train cache` writes it."""
    return latents_layout("float32", (LATENT_CHANNELS, 1, bucket[1] // 8, bucket[0] // 8))


def cache_bucket(path: Path) -> tuple[int, int] | None:
    """The bucket a cache's file name declares (`..._WWWWxHHHH_anima.safetensors`)."""
    m = CACHE_NAME.match(path.name)
    return (int(m["w"]), int(m["h"])) if m else None


def latents_problem(got: str | None, bucket: tuple[int, int]) -> str | None:
    """None when a cache's tensor layout (latents_layout, or meta[LATENTS_LAYOUT] from read_cache_metadata; None
    = no tensor `latents`) fits the bucket; else what is wrong."""
    want = expected_latents_layout(bucket)
    if got is None:
        return "no tensor named latents"
    if got != want:
        return f"latents {got}, but bucket {_wxh(bucket)} needs {want}"
    return None


def _nonfinite(tensor) -> int:
    import torch

    return int(tensor.numel() - torch.isfinite(tensor).sum()) if tensor.is_floating_point() else 0


def cache_damage(meta: dict, bucket: tuple[int, int]) -> str | None:
    """What is wrong with a cache's latents (read_cache_metadata's meta) for a bucket: the layout, or NaN/inf values;
    None when nothing is."""
    why = latents_problem(meta.get(LATENTS_LAYOUT), bucket)
    if why is None and meta.get(LATENTS_NONFINITE):
        why = f"its latents hold {meta[LATENTS_NONFINITE]} non-finite value(s) (NaN/inf)"
    return why


def read_cache_metadata(path: Path) -> dict:
    """The cache's metadata plus LATENTS_LAYOUT: the layout of its tensor `latents` (from the header), absent when
    there is none, and LATENTS_NONFINITE: how many of its values are NaN/inf, absent when none (the data is read:
    a cache of NaNs trains NaN weights). CacheUnreadable for a truncated or foreign file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = dict(f.metadata() or {})
            meta.pop(LATENTS_LAYOUT, None)
            meta.pop(LATENTS_NONFINITE, None)
            if "latents" in f.keys():
                tensor = f.get_slice("latents")
                meta[LATENTS_LAYOUT] = latents_layout(tensor.get_dtype(), tensor.get_shape())
                bad = _nonfinite(f.get_tensor("latents"))
                if bad:
                    meta[LATENTS_NONFINITE] = bad
            return meta
    except Exception as e:  # a truncated/foreign file: say which
        raise CacheUnreadable(path, str(e)) from e


def image_sources(scan: Scan, *, skip_unreadable: bool = False,
                  decode: bool = False) -> tuple[list[Source], list[tuple[Path, str]]]:
    """Sources from the image files, each sized as a viewer shows it (images.viewer_size). With `decode`, every
    image is decoded in full (in threads: PIL releases the GIL while decoding), so a truncated or corrupt file is
    found now, by name, not at the training step that first draws it; without, only headers are read (for images
    that are trained from their caches and never decoded). Unreadable images are all listed at once
    (UnreadableImages); with skip_unreadable they are left out and returned as (path, reason)."""
    todo = [(fi, f, stem, path) for fi, f in enumerate(scan.folders) if f.mode != "latents"
            for stem, path in f.images.items()]
    results = _read_sizes([job[3] for job in todo], decode)
    sources, bad = [], []
    for (fi, f, stem, path), (size, why) in zip(todo, results):
        if why is not None:
            bad.append((path, why))
        else:
            sources.append(Source(fi, f.path / stem, path, (int(size[0]), int(size[1]))))
    if bad and not skip_unreadable:
        raise UnreadableImages(bad)
    return sources, bad


def _read_sizes(paths: Sequence[Path], decode: bool) -> list[tuple[tuple[int, int] | None, str | None]]:
    """(viewer size, None) or (None, why it cannot be read) per path; decoding runs in threads."""
    def size_of(path):
        try:
            return (decoded_size if decode else header_size)(path), None
        except Exception as e:  # noqa: BLE001 (any failure to read the file is reported with its name)
            return None, _read_failure(e)

    workers = max(1, min(8, os.cpu_count() or 1, len(paths))) if decode else 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(size_of, paths))


def find_undecodable(paths: Iterable[Path]) -> list[tuple[Path, str]]:
    """(path, why) for each image that cannot be decoded in full (threads)."""
    paths = sorted(set(paths))
    return [(p, why) for p, (_, why) in zip(paths, _read_sizes(paths, True)) if why is not None]


def _read_failure(e: Exception) -> str:
    text = str(e)
    if "truncated" in text.lower():
        return "truncated: the file ends early (an interrupted download or copy)"
    return f"{type(e).__name__}: {text}"


class UnreadableImages(DatasetError):
    """Images that cannot be decoded; `bad` = [(path, why)]. `anima-train cache` reports this as a data verdict."""

    def __init__(self, bad: Sequence[tuple[Path, str]]):
        shown = "\n".join(f"  {p}  ({why})" for p, why in bad[:50])
        more = f"\n  ... and {len(bad) - 50} more" if len(bad) > 50 else ""
        super().__init__(f"{len(bad)} image(s) cannot be read:\n{shown}{more}\nfix or delete them (re-download or "
                         f"re-export them), or skip them (--skip-unreadable on the command line, skip_unreadable=True "
                         f"in code)")
        self.bad = list(bad)


def cache_sources(scan: Scan, metadata: dict[Path, dict]) -> list[Source]:
    """Sources from cache files (latents mode): the size is the caches' `original_size` (None if absent)."""
    sources = []
    for fi, f in enumerate(scan.folders):
        if f.mode != "latents":
            continue
        for stem, paths in f.caches.items():
            sizes = [metadata[p]["original_size"] for p in paths if "original_size" in metadata[p]]
            size = parse_wxh(Counter(sizes).most_common(1)[0][0]) if sizes else None
            sources.append(Source(fi, f.path / stem, None, size))
    return sources


def missing_captions(scan: Scan, sources: Sequence[Source]) -> list[Path]:
    return [s.stem.with_name(s.stem.name + ".txt") for s in sources
            if s.stem.name not in scan.folders[s.folder].captions]


def refuse_missing_captions(missing: Sequence[Path], what: str = "image",
                            escape: str = "train them on an empty caption") -> None:
    """Refuse uncaptioned sources, naming them and the ways out; `escape` = what --allow-missing-captions does."""
    if missing:
        shown = "\n".join(f"  {p}" for p in missing[:50])
        more = f"\n  ... and {len(missing) - 50} more" if len(missing) > 50 else ""
        raise DatasetError(f"{len(missing)} {what}(s) have no caption file:\n{shown}{more}\nwrite a <stem>.txt "
                           f"for each (tags), delete the {what}s, or pass --allow-missing-captions to {escape}")


def refuse_unreadable_captions(sources: Sequence[Source]) -> None:
    """Read every caption now (tags and NL), so that a bad file stops the run before training, not at the step
    that first draws it; all bad files are listed at once."""
    bad = []
    for s in sources:
        try:
            read_caption_files(s.stem)
        except FileNotFoundError:
            continue  # missing captions are refuse_missing_captions' business
        except CaptionError as e:
            bad.append(f"{e.path} {e.problem}")
        except OSError as e:
            bad.append(str(e))
    if bad:
        shown = "\n".join(f"  {line}" for line in bad[:50])
        more = f"\n  ... and {len(bad) - 50} more" if len(bad) > 50 else ""
        raise DatasetError(f"{len(bad)} caption file(s) cannot be read:\n{shown}{more}\nre-save each as UTF-8 "
                           f"(in most editors: Save As, encoding UTF-8), then start the run again")


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
        raise DatasetError(f"{len(unbucketable)} source(s) cannot be bucketed with these settings:\n{shown}\n"
                           f"delete or crop them, or lower bucket_reso_steps / raise the resolution")
    if bad:  # re-index onto the kept-and-bucketable list
        good = [i for i in range(len(kept)) if i not in {j for j, _ in bad}]
        remap = {old: new for new, old in enumerate(good)}
        kept = [kept[i] for i in good]
        tier_entries = [dataclasses.replace(e, source_index=remap[e.source_index]) for e in tier_entries]
    entries = [Entry(e.source_index, e.tier, e.plan, e.collapsed) for e in tier_entries]
    return Plan(kept, entries, small, unsized, unbucketable)


def plan_metadata(plan: BucketPlan, settings: BucketSettings, tier: int, vae_id: str | None) -> dict[str, str]:
    """The metadata written into a cache (all strings, as safetensors requires)."""
    return {
        "format": CACHE_FORMAT,
        "bucket": _wxh(plan.bucket),
        "original_size": _wxh(plan.source),
        "resized": _wxh(plan.resized),
        "trim": f"{plan.trim[0]},{plan.trim[1]}",
        "crop_ltrb": json.dumps(list(plan.crop_ltrb)),
        "settings": json.dumps({**settings.record(tier), "vae": vae_id}),
    }


def cache_problem(meta: dict, plan: BucketPlan, vae_id: str | None) -> str | None:
    """None if the cache matches the plan (and the VAE, when both are known); else a short reason."""
    if meta.get("format") != CACHE_FORMAT:
        return "not an anima latent cache of this format"
    for key, want in (("original_size", _wxh(plan.source)), ("bucket", _wxh(plan.bucket)),
                      ("resized", _wxh(plan.resized)), ("trim", f"{plan.trim[0]},{plan.trim[1]}")):
        if meta.get(key) != want:
            return f"{key} {meta.get(key)} != {want}"
    made_with = settings_record(meta).get("vae")
    if vae_id and made_with and made_with != vae_id:
        return "made with another VAE"
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
    import shlex

    from anima_train.cli import program

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
                    why = cache_problem(metadata[path], e.plan, vae_id)
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
        if not others:
            reason = "are missing"
        else:
            latest = max(others, key=lambda p: p.stat().st_mtime_ns)
            reason = f"were made with {made_with(check, latest, settings, vae_id)}"
        by_reason[reason].append(f"{src.stem.name} (tier {e.tier}, {_wxh(e.plan.bucket)})")
    n = len(check.missing)
    lines = [f"{n} (source, tier) pair(s) have no valid latent cache for the current settings:"]
    for reason, items in by_reason.items():
        shown = ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")
        lines.append(f"  caches for {shown} {reason}")
    if damaged:
        lines.append(f"  {len(damaged)} cache file(s) are damaged (training on them would be wrong):")
        lines += [f"    {d}" for d in damaged[:10]]
        if len(damaged) > 10:
            lines.append(f"    ... and {len(damaged) - 10} more")
    folders = sorted({scan.folders[plan.sources[e.source].folder].path for e, _ in check.missing})
    tops = sorted({Path(scan.subsets[scan.folders[plan.sources[e.source].folder].subset].path)
                   for e, _ in check.missing})
    fix = cache_command(tops, settings, model=model, config=config, allow_missing_captions=allow_missing_captions)
    lines.append(f"fix: re-run `{fix}` (it re-encodes stale and damaged caches), or set the "
                 f"config back to the settings the caches were made with")
    if any(f.mode == "latents" for f in scan.folders):
        lines.append("(the images are gone from " + ", ".join(map(str, folders[:3]))
                     + ": restore them to re-cache, or set the settings back)")
    return DatasetError("\n".join(lines))


# ----------------------------------------------------------------------------------------------------------
# Pixels and latents


def load_pixels(image: Path, plan: BucketPlan):
    """The training crop as a float tensor [3, 1, H, W] in [-1, 1]: LANCZOS resize to plan.resized, then the
    bucket-sized window at plan.trim. Shared by `anima-train cache` and source = "encode", so both paths see
    bit-identical pixels."""
    import torch
    from PIL import Image

    try:
        im = open_image(image)
    except Exception as e:  # noqa: BLE001 (the scan decoded it: the file changed or broke since)
        raise DatasetError(f"{image} cannot be read ({_read_failure(e)}): the file changed during the run; fix "
                           f"or delete it and restart") from e
    with im:
        if im.size != plan.source:
            raise DatasetError(f"{image} is {_wxh(im.size)} but was scanned as {_wxh(plan.source)}: the file "
                               f"changed during the run; restart to re-scan")
        if im.size != plan.resized:
            im = im.resize(plan.resized, Image.LANCZOS)
        (x, y), (w, h) = plan.trim, plan.bucket
        if x < 0 or y < 0 or x + w > im.size[0] or y + h > im.size[1]:
            raise DatasetError(f"{image}: trim window {plan.trim} + {_wxh(plan.bucket)} exceeds the resized "
                               f"{_wxh(im.size)} (a bucketing bug; please report it)")
        im = im.crop((x, y, x + w, y + h))
        arr = np.asarray(im, dtype=np.float32)
    return torch.from_numpy(arr / 127.5 - 1.0).permute(2, 0, 1).unsqueeze(1).contiguous()


def encode_latents(vae, pixels):
    """Normalised latents (docs/model.md#latent-normalisation): (vae.encode(x).latent_dist.mode() - mean) / std, fp32.
    pixels: [B, 3, 1, H, W] in [-1, 1] -> [B, 16, 1, H/8, W/8]."""
    import torch

    p = next(vae.parameters())
    with torch.no_grad():
        z = vae.encode(pixels.to(device=p.device, dtype=p.dtype)).latent_dist.mode().float()
    mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=z.device).view(1, -1, 1, 1, 1)
    return (z - mean) / std


def load_latents(path: Path, bucket: tuple[int, int] | None = None):
    """The cache's latents [16, 1, H/8, W/8], float32. The layout is checked against `bucket` (default: the bucket
    in the file name), so a file replaced since the scan cannot feed a wrong-shaped tensor to the model."""
    from safetensors.torch import load_file

    try:
        t = load_file(str(path))["latents"]
    except Exception as e:
        raise CacheUnreadable(path, f"{type(e).__name__}: {e}") from e
    bucket = bucket or cache_bucket(path)
    if bucket is not None:
        why = latents_problem(latents_layout(t.dtype, t.shape), bucket) or (
            f"its latents hold {_nonfinite(t)} non-finite value(s) (NaN/inf)" if _nonfinite(t) else None)
        if why is not None:
            raise DatasetError(f"latent cache {path} is damaged: {why}; re-run anima-train cache (it re-encodes "
                               f"damaged caches), or delete the file when its image is gone")
    return t.float()


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
        from anima_train.data.texture import split_key, texture_sample

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
                f"caches for {s.stem} carry no original_size, so they cannot be attributed to one of the tiers "
                f"{list(settings.tiers)}: re-cache from the images with anima-train cache, or use one resolution")
        if len(paths) > 1:
            raise DatasetError(f"{len(paths)} caches for {s.stem} carry no original_size and only one can be used "
                               f"per source: keep one of {', '.join(p.name for p in paths)}")
        bucket = cache_bucket(paths[0])
        if why := cache_damage(check.metadata[paths[0]], bucket):
            raise DatasetError(f"latent cache {paths[0]} is damaged: {why}; delete it (its image is gone, so it "
                               f"cannot be re-encoded) or restore the image and re-run anima-train cache")
        bplan = BucketPlan(bucket, bucket, bucket, crop_ltrb(bucket, bucket), (0, 0))
        plan.sources.append(s)
        extra.append(Entry(len(plan.sources) - 1, settings.tiers[0], bplan, False, paths[0]))
    if extra:
        warn.append(f"{len(extra)} cache(s) carry no original_size: used as-is at tier {settings.tiers[0]} "
                    f"(their bucket cannot be checked against the settings)")
    check.entries += extra
    return sources, plan, check


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
        raise DatasetError("the dataset has no usable entries after scanning (all dropped or unreadable)")

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
    report = startup_report(scan, plan, entries, items, sampler, mode) + lines + texture_lines
    warn += plan_warnings(plan, settings, check, vae_id) + scan.notes
    return TrainingData(mode, plan.sources, entries, dataset, sampler, report, warn, settings, scan)


def _attach_texture(cfg, items: Sequence[Item], sampler: BucketBatchSampler) -> list[str]:
    """Texture phases: give the sampler its TextureSchedule; the startup lines (canvas feasibility)."""
    from anima_train.data.texture import TextureSchedule, feasibility_report, texture_phases

    phases = texture_phases(cfg)
    if not phases:
        return []
    sampler.texture = TextureSchedule(cfg.curriculum, cfg.dataset.texture, [it.plan.source for it in items],
                                      [it.texture for it in items], cfg.train.seed)
    sizes = sorted({(it.stem, it.plan.source) for it in items if it.texture}, key=str)
    return feasibility_report([s for _, s in sizes], cfg.dataset.texture.canvases)


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


def startup_report(scan: Scan, plan: Plan, entries: Sequence[Entry], items: Sequence[Item],
                   sampler: BucketBatchSampler, mode: str) -> list[str]:
    what = {"images": "images (cached latents)", "latents": "latents (cache files only)",
            "encode": "encode (pixels; the VAE runs in the loop)"}[mode]
    buckets = Counter(it.plan.bucket for it in items)
    common = ", ".join(f"{_wxh(b)} ({n})" for b, n in buckets.most_common(3))
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
