"""The Train node's preview grid: a trainer `samples` event (PNG paths in the run folder) -> small inline images.

The trainer writes full-size PNGs to <run_dir>/samples/ (anima_train.training.previews), a folder ComfyUI's /view route
may not serve (output_dir can be anywhere). The node instead sends each preview as a small JPEG data URL inside the
`anima_train.progress` event, which js/anima_train.js puts in an <img> under the loss chart: a few kilobytes per
image, nothing to clean up, and no path is ever exposed to the page as a URL.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

from PIL import Image

THUMBNAIL_SIDE = 256  # px, the longer side; the grid shows them at about 120 px (2x for HiDPI screens)
DATA_URL_PREFIX = "data:image/jpeg;base64,"


def thumbnail_data_url(path: str | Path, side: int = THUMBNAIL_SIDE) -> str | None:
    """A JPEG data URL of the image at `path`, at most `side` px on its longer side; None if it cannot be read."""
    try:
        with Image.open(path) as image:
            image = image.convert("RGB")
            image.thumbnail((side, side), Image.Resampling.LANCZOS)
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=88)
    except (OSError, ValueError):
        return None
    return DATA_URL_PREFIX + base64.b64encode(buffer.getvalue()).decode("ascii")


def with_thumbnails(event: dict) -> dict:
    """The `samples` event as the page gets it: its fields plus `images`, one data URL (or null) per path."""
    return {**event, "images": [thumbnail_data_url(p) for p in event.get("paths") or []]}
