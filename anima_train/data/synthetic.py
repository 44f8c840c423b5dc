"""A latents-only dataset for the tests, the demo and the benches: caches and captions written straight from the
tiny models' vocabulary (model/tiny.py), no VAE; named and written as `anima-train cache` names and writes them."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from safetensors.torch import save_file

from anima_train.data.cache_files import cache_path
from anima_train.files import atomic_path, write_text
from anima_train.model.tiny import BACKGROUNDS, COLOURS, SHAPES, caption_for


def make_synthetic_latents(out_dir, n: int = 12, seed: int = 0, latent_hw: tuple[int, int] = (16, 16),
                           overwrite: bool = False) -> list[Path]:
    """A latents-only dataset whose captions determine the latents: `<stem>_WWWWxHHHH_anima.safetensors` (tensor
    `latents` [16,1,h,w], no size metadata: one tier) plus `<stem>.txt`.

    Why: a random tiny VAE maps every picture to nearly the same latent (between-image spread ~3% of the latent
    std), so text cannot help predict it and a conditioning test learns nothing. Here each background, colour and
    shape has its own fixed 16-channel direction, so a model that reads its caption can beat one that does not.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    h, w = latent_hw
    g = torch.Generator().manual_seed(10_000 + seed)
    vectors = {name: torch.randn(16, generator=g) for name in [*COLOURS, *BACKGROUNDS]}
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    rng = random.Random(seed)
    paths = []
    for i in range(n):
        colour, shape, background = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(list(BACKGROUNDS))
        side = rng.randint(h // 2, h - 2)
        y0, x0 = rng.randint(0, h - side), rng.randint(0, w - side)
        inside = (yy >= y0) & (yy < y0 + side) & (xx >= x0) & (xx < x0 + side)
        if shape == "circle":
            cy, cx, r = y0 + side / 2, x0 + side / 2, side / 2
            inside = (yy + 0.5 - cy) ** 2 + (xx + 0.5 - cx) ** 2 <= r * r
        elif shape == "triangle":
            inside = inside & ((yy - y0) >= (xx - x0 - side / 2).abs() * 2)
        mask = inside.float()[None, None]  # [1,1,h,w]
        lat = (vectors[background].view(16, 1, 1, 1) * (1 - mask)
               + vectors[colour].view(16, 1, 1, 1) * mask) * 0.7
        lat = lat + 0.05 * torch.randn(lat.shape, generator=g)
        stem = out_dir / f"lat_{i:04d}"
        cache = cache_path(stem, (8 * w, 8 * h))
        txt = stem.with_suffix(".txt")
        if not overwrite and (cache.exists() or txt.exists()):
            raise FileExistsError(f"{cache} or {txt} already exists; pass overwrite=True or use an empty folder")
        with atomic_path(cache) as tmp:
            save_file({"latents": lat.contiguous()}, str(tmp))
        write_text(txt, caption_for(colour, shape, background) + "\n")
        paths.append(cache)
    return paths
