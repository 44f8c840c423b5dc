"""Read a training image the way an image viewer shows it: one loader for `cache`, `encode`, texture crops and the
scan/audit (so the size the scan buckets is the size of the pixels that get encoded).

    open_image(path) -> PIL RGB image, fully decoded          viewer_size(path) -> (w, h) as shown, header only

What "as a viewer shows it" means here:
- orientation: the EXIF Orientation tag is applied (a phone photo stored sideways trains upright; its size is the
  rotated one);
- bit depth: 16-bit grayscale (PIL modes I;16*, I) is scaled to 8 bit (value / 257, rounded), not clipped at 255
  (a plain `convert("RGB")` turns almost every 16-bit pixel white);
- transparency (RGBA, LA, PA, a palette or grayscale/RGB image with a transparent colour): composited over a white
  background, as most viewers and image editors' "flatten" show it (the hidden colour of a transparent pixel,
  often black, is not what anyone sees);
- CMYK, YCbCr, palette and 1-bit images: PIL's conversion to RGB.
Embedded ICC colour profiles are not applied (pixels are read as sRGB).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

BACKGROUND = (255, 255, 255)  # what a transparent pixel shows as (white: see the module docstring)
_ROTATED = {5, 6, 7, 8}  # EXIF orientations that swap width and height
_EXIF_ORIENTATION = 0x0112
_WIDE_GRAY = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # 16-bit (and 32-bit int) grayscale
_ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")


def _orientation(im) -> int:
    try:
        return int(im.getexif().get(_EXIF_ORIENTATION, 1) or 1)
    except Exception:  # noqa: BLE001 (a damaged EXIF block: show the pixels as stored, as viewers do)
        return 1


def viewer_size(im) -> tuple[int, int]:
    """(w, h) of an opened (not necessarily decoded) PIL image as a viewer shows it: rotated by its EXIF tag."""
    w, h = im.size
    return (h, w) if _orientation(im) in _ROTATED else (w, h)


def to_viewer_rgb(im):
    """A PIL image of any mode -> the RGB image a viewer shows (orientation, bit depth, transparency)."""
    if _orientation(im) != 1:
        im = ImageOps.exif_transpose(im)
    if im.mode in _WIDE_GRAY:
        # 16-bit samples 0..65535 -> 0..255 (65535 / 257 = 255): the whole range, not the bottom 256 values
        arr = np.asarray(im, dtype=np.float64)
        im = Image.fromarray(np.clip(np.rint(arr / 257.0), 0, 255).astype(np.uint8), "L")
    elif im.mode == "F":
        im = Image.fromarray(np.clip(np.rint(np.asarray(im, dtype=np.float64)), 0, 255).astype(np.uint8), "L")
    if im.mode in _ALPHA_MODES or "transparency" in im.info:
        rgba = im.convert("RGBA")  # P/L/RGB with a transparent colour become RGBA here too
        flat = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
        flat.alpha_composite(rgba)
        return flat.convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")


def open_image(path: str | Path):
    """The image at `path`, fully decoded, as the RGB picture a viewer shows (see the module docstring).
    Raises what PIL raises for a file it cannot read (OSError for a truncated one, UnidentifiedImageError, ...)."""
    with Image.open(path) as im:
        im.load()  # decode every byte now: a truncated file fails here, naming nothing yet (callers name it)
        return to_viewer_rgb(im)


def decoded_size(path: str | Path) -> tuple[int, int]:
    """Decode the whole file (so a truncated or corrupt one raises) and return its size as a viewer shows it."""
    with Image.open(path) as im:
        im.load()
        return viewer_size(im)


def header_size(path: str | Path) -> tuple[int, int]:
    """The size as a viewer shows it, from the header and EXIF only (no pixel decoding)."""
    with Image.open(path) as im:
        return viewer_size(im)
