"""A latent cache file: its name beside the image, its header (layout, metadata, damage), the VAE identity it
records, and reading its latents (docs/training.md: latent caches)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from safetensors import safe_open

from anima_train.data.errors import DatasetError, the_dataset
from anima_train.fixes import ref


CACHE_TAIL = "_anima.safetensors"
CACHE_NAME = re.compile(r"^(?P<stem>.+)_(?P<w>\d{4})x(?P<h>\d{4})_anima\.safetensors$")
CACHE_FORMAT = "anima-latent-cache/1"


def written_as_cache(path: Path) -> bool:
    """Whether the file at a cache's name is one `cache` wrote: its safetensors header (read as JSON, so a file cut
    short after it still counts) records CACHE_FORMAT. Caches are written whole (atomic_path), so any other file
    there is not ours, whatever its name says: `cache` never writes over it (docs/architecture.md#nothing-lost)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100_000_000:
                return False
            header = json.loads(f.read(size))
        return isinstance(header, dict) and (header.get("__metadata__") or {}).get("format") == CACHE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


class CacheUnreadable(DatasetError):
    """A latent cache whose safetensors header cannot be read (truncated, not safetensors)."""

    def __init__(self, path: Path, reason: str):
        super().__init__("a latent cache cannot be read: delete it and "
                         + ref("run cache", "re-run anima-train cache") + f"\nlatent cache {path} cannot be read "
                         f"({reason})" if written_as_cache(path) else
                         f"a file in {the_dataset()} has a latent cache's name but is no cache: move or rename it\n"
                         f"{path} was not written by {ref('name cache', 'anima-train cache')} ({reason})")
        self.path, self.reason = path, reason


def cache_path(stem_path: Path, bucket: tuple[int, int]) -> Path:
    """`<stem>_WWWWxHHHH_anima.safetensors` beside the image (stem_path = folder / stem)."""
    return stem_path.with_name(f"{stem_path.name}_{bucket[0]:04d}x{bucket[1]:04d}{CACHE_TAIL}")


def wxh(size) -> str:
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
        return f"latents {got}, but bucket {wxh(bucket)} needs {want}"
    return None


def _nonfinite(tensor) -> int:
    # lazy: torch (~4.6 s): the scan steps and `anima-train audit` import this module without needing torch
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


def load_latents(path: Path, bucket: tuple[int, int] | None = None):
    """The cache's latents [16, 1, H/8, W/8], float32. The layout is checked against `bucket` (default: the bucket
    in the file name), so a file replaced since the scan cannot feed a wrong-shaped tensor to the model."""
    # lazy: safetensors.torch imports torch (~4.6 s): see _nonfinite
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
            raise DatasetError(f"latent cache {path} is damaged: {why}; "
                               + ref("run cache", "re-run anima-train cache") + " (it re-encodes "
                               "damaged caches), or delete the file when its image is gone")
    return t.float()
