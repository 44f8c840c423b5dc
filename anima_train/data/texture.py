"""Texture mode: the crop curriculum (docs/training.md#texture-mode).

A `[[curriculum]]` phase with `mode = "texture"` replaces the bucketed full image of every texture-eligible sample
with a canvas-sized crop of the *source* at native scale, chosen per step where the detail is, and captioned with
`[dataset.texture] trigger` alone. Subsets with `texture = false` stay full-resolution with their captions.

Who does what:
  - the sampler (sampler.BucketBatchSampler) asks `TextureSchedule.canvas` for each batch: the batch's optimizer
    step says which phase it falls in (progress = step / total, the quantity the trainer uses), and a
    texture-eligible batch in a texture phase gets one canvas, drawn with multiplicity (rung 1: among the canvases
    every source of the batch can hold, when `fit_aware`). The batch is then yielded as (index, canvas) pairs;
  - the dataset (in a loader worker) turns each pair into `texture_sample`: the crop through the oversize cascade,
    its loss mask and the trigger caption;
  - the trainer passes the batch's `loss_mask` to the loss and checks the phase agrees with the batch.

The oversize cascade for a source smaller than the canvas (scale = max(cw/w, ch/h)): `oversize = "cover"` or
`"skip"` (a batch must stack, so a skipped sample is covered), or scale <= `cover_max_scale` (rung 2) → a uniform
LANCZOS upscale by `scale`; else rung 3 pads: `reflect` mirrors the source symmetrically, the padding split evenly
on both sides, `black` fills zeros to the right/bottom exactly as PIL's out-of-bounds crop does (so the legacy
settings reproduce plain black padding byte for byte); rung 4 `mask_padding` gives invented pixels no loss (pixel
validity averaged over each 8x8 block to a latent cell).

The crop position (along every axis where the image is larger than the canvas) is drawn over at most 64 x 64 grid
positions with probability ∝ window energy^`energy_power`; the energy map is the grayscale |4-neighbour Laplacian|
at full resolution, box-averaged by `energy_downscale`. A flat image has energy exactly 0 and falls back to a
uniform position, as does `energy_power = 0`.

The loss mask is a supervised sub-region: one side ratio r ~ U(mask_ratio) for both sides (so it keeps the canvas
shape), at least 4 latent px, at a uniform offset, tapered by ½(1 − cos(π·d/F)) per axis (d = distance of a cell
centre from the region's edge, F = min(feather_latent_px, side/2)); the 2-D mask is the product of the two tapers.

Every random choice comes from a generator seeded by (seed, epoch, batch position) for the canvas and (seed, epoch,
index) for the crop, never from global state: workers, ranks and a resumed run draw exactly the same crops.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from PIL import Image

from anima_train.config.schema import active_phase
from anima_train.errors import UserError
from anima_train.fixes import ref
from anima_train.data.images import open_image

VAE_FACTOR = 8  # image px per latent cell
MIN_MASK_SIDE = 4  # latent px: the supervised region is never smaller than this
MAX_POSITIONS = 64  # crop positions per axis the energy draw chooses among

MULTI_PROCESS_REFUSAL = (
    "a texture-mode [[curriculum]] phase on {n} processes is refused: {fix}\nTexture mode under DDP produced "
    "visibly broken anatomy in the seed trainer's runs (two runs were lost before the "
    "cause was found: the DDP run, not the crop cascade, did the damage), and a warning at startup scrolls away "
    "unread, so this is a hard stop. To re-test a fix deliberately, set [train] allow_multi_gpu_texture = true and "
    "compare against a single-GPU control at matched steps. DDP stays the right tool for fullres training: remove "
    "the texture phases to use it.")


class TextureError(UserError, RuntimeError):
    """A texture-mode run that cannot start as configured (the message says why and what to do)."""


def texture_phases(cfg) -> list:
    return [ph for ph in cfg.curriculum if ph.mode == "texture"]


def refuse_multi_process(cfg, processes: int) -> None:
    """A texture phase on more than one process is a startup error unless allow_multi_gpu_texture
    (docs/training.md#several-processes)."""
    if processes > 1 and texture_phases(cfg) and not cfg.train.allow_multi_gpu_texture:
        raise TextureError(MULTI_PROCESS_REFUSAL.format(n=processes, fix=ref("run one process",
                                                                              "run it on one process (one GPU).")))


# ----------------------------------------------------------------------------------------------------------
# Canvas draw (rung 1)


def fitting_canvases(canvases: Sequence[Sequence[int]], sizes: Sequence[tuple[int, int] | None]) -> list[tuple]:
    """The canvases (duplicates kept: they are weights) that every source size can hold at native scale."""
    known = [s for s in sizes if s is not None]
    if not known or len(known) != len(sizes):
        return []
    min_w, min_h = min(w for w, _ in known), min(h for _, h in known)
    return [tuple(c) for c in canvases if c[0] <= min_w and c[1] <= min_h]


def draw_canvas(canvases: Sequence[Sequence[int]], sizes: Sequence[tuple[int, int] | None], fit_aware: bool,
                rng: random.Random) -> tuple[int, int]:
    """One canvas for a batch, drawn with multiplicity; with fit_aware among those the batch's sources all hold
    (unknown sizes, or none fits: among all)."""
    pool = fitting_canvases(canvases, sizes) if fit_aware else []
    pool = pool or [tuple(c) for c in canvases]
    w, h = pool[rng.randrange(len(pool))]
    return int(w), int(h)


# ----------------------------------------------------------------------------------------------------------
# Energy-weighted position


def energy_map(gray: np.ndarray, downscale: int) -> np.ndarray:
    """|4-neighbour Laplacian| of a grayscale image at full resolution (replicate borders, so a flat image is
    exactly 0), box-averaged over downscale x downscale blocks (the remainder rows/columns are left out)."""
    g = np.asarray(gray, dtype=np.float32)
    p = np.pad(g, 1, mode="edge")
    lap = np.abs(p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4.0 * g)
    hd, wd = g.shape[0] // downscale, g.shape[1] // downscale
    if hd == 0 or wd == 0:
        return np.zeros((max(hd, 1), max(wd, 1)), dtype=np.float64)
    return lap[:hd * downscale, :wd * downscale].reshape(hd, downscale, wd, downscale).mean(axis=(1, 3),
                                                                                                dtype=np.float64)


def grid_positions(slack: int) -> list[int]:
    """Candidate offsets 0..slack along one axis, at most MAX_POSITIONS of them, evenly spaced ([0] if slack <= 0)."""
    if slack <= 0:
        return [0]
    n = min(MAX_POSITIONS, slack + 1)
    return sorted({int(round(v)) for v in np.linspace(0, slack, n)})


def _cells(start: int, length: int, limit_px: int, downscale: int, cells: int) -> tuple[int, int]:
    a, b = max(0, start), min(limit_px, start + length)
    lo = min(cells - 1, int(round(a / downscale)))
    return lo, max(lo + 1, min(cells, int(round(b / downscale))))


def choose_position(energy: np.ndarray, downscale: int, image_size: tuple[int, int], canvas: tuple[int, int],
                    power: float, rng: random.Random) -> tuple[int, int]:
    """(x, y) of the canvas window over an image of image_size: ∝ window energy^power over the grid positions;
    uniform over them when power is 0 or the windows hold no energy. An axis where the image is not larger than
    the canvas has the single position 0."""
    (w, h), (cw, ch) = image_size, canvas
    xs, ys = grid_positions(w - cw), grid_positions(h - ch)
    n = len(xs) * len(ys)
    weights = None
    if power > 0 and n > 1:
        hd, wd = energy.shape
        integral = np.zeros((hd + 1, wd + 1))
        integral[1:, 1:] = energy.cumsum(0).cumsum(1)
        cx = [_cells(x, cw, w, downscale, wd) for x in xs]
        cy = [_cells(y, ch, h, downscale, hd) for y in ys]
        sums = np.array([[integral[y1, x1] - integral[y0, x1] - integral[y1, x0] + integral[y0, x0]
                          for (x0, x1) in cx] for (y0, y1) in cy]).ravel()
        sums = np.clip(sums, 0.0, None)  # cumsum round-off can leave -1e-12 on a flat image
        if sums.max() > 0:
            weights = (sums / sums.max()) ** power
            if not np.isfinite(weights).all() or weights.sum() <= 0:
                weights = None
    k = rng.choices(range(n), weights=weights.tolist())[0] if weights is not None else rng.randrange(n)
    return xs[k % len(xs)], ys[k // len(xs)]


# ----------------------------------------------------------------------------------------------------------
# One crop through the cascade


@dataclass
class TextureCrop:
    pixels: np.ndarray  # uint8 [ch, cw, 3]
    valid: np.ndarray | None  # float32 [ch, cw], 1 = a source pixel, 0 = invented; None = all source (no padding)
    position: tuple[int, int]  # the window's (x, y) in the image it was cut from (the source, or its cover resize)
    scale: float  # 1.0 = native scale; > 1 = covered by a LANCZOS upscale
    rung: str  # "native" | "cover" | "pad"


def crop_texture(image, canvas: tuple[int, int], tcfg, rng: random.Random) -> TextureCrop:
    """The canvas-sized crop of a PIL RGB image through the oversize cascade (module docstring)."""
    cw, ch = canvas
    w, h = image.size
    rung, scale = "native", 1.0
    if w < cw or h < ch:
        scale = max(cw / w, ch / h)
        if tcfg.oversize in ("cover", "skip") or scale <= tcfg.cover_max_scale:
            rung = "cover"
            size = (max(cw, int(round(w * scale))), max(ch, int(round(h * scale))))
            image = image.resize(size, Image.LANCZOS)
            w, h = size
        else:
            rung, scale = "pad", 1.0
    energy = energy_map(np.asarray(image.convert("L")), tcfg.energy_downscale) if tcfg.energy_power > 0 else None
    x, y = choose_position(energy if energy is not None else np.zeros((1, 1)), tcfg.energy_downscale, (w, h),
                           (cw, ch), tcfg.energy_power, rng)
    arr = np.asarray(image)
    if rung != "pad":
        return TextureCrop(np.ascontiguousarray(arr[y:y + ch, x:x + cw]), None, (x, y), scale, rung)
    window = arr[y:y + min(ch, h), x:x + min(cw, w)]  # the axes the source fills are cut, the others kept whole
    sh, sw = window.shape[:2]
    valid = np.zeros((ch, cw), dtype=np.float32)
    if tcfg.pad_mode == "black":  # PIL's out-of-bounds crop: the source at the origin, zeros right and below
        out = np.zeros((ch, cw, 3), dtype=np.uint8)
        out[:sh, :sw] = window
        valid[:sh, :sw] = 1.0
    else:  # reflect: mirror (edge pixel repeated, numpy "symmetric") evenly on both sides
        top, left = (ch - sh) // 2, (cw - sw) // 2
        out = np.pad(window, ((top, ch - sh - top), (left, cw - sw - left), (0, 0)), mode="symmetric")
        valid[top:top + sh, left:left + sw] = 1.0
    return TextureCrop(out, valid, (x, y), scale, rung)


def latent_validity(valid: np.ndarray) -> np.ndarray:
    """Pixel validity [H, W] → latent cells [H/8, W/8]: the valid fraction of each 8x8 block."""
    h, w = valid.shape
    return valid.reshape(h // VAE_FACTOR, VAE_FACTOR, w // VAE_FACTOR, VAE_FACTOR).mean(axis=(1, 3))


def _taper(side: int, feather: float) -> np.ndarray:
    f = min(float(feather), side / 2)
    if f <= 0:
        return np.ones(side)
    d = np.minimum(np.arange(side) + 0.5, side - np.arange(side) - 0.5)
    return np.where(d < f, 0.5 * (1.0 - np.cos(np.pi * np.minimum(d, f) / f)), 1.0)


def supervised_mask(latent_size: tuple[int, int], mask_ratio: Sequence[float], feather: float,
                    rng: random.Random) -> np.ndarray:
    """The supervised sub-region [h, w] over a latent canvas of latent_size = (w, h) (module docstring)."""
    lw, lh = latent_size
    r = rng.uniform(float(mask_ratio[0]), float(mask_ratio[1]))
    sw = min(lw, max(MIN_MASK_SIDE, int(round(r * lw))))
    sh = min(lh, max(MIN_MASK_SIDE, int(round(r * lh))))
    ox, oy = rng.randint(0, lw - sw), rng.randint(0, lh - sh)
    mask = np.zeros((lh, lw), dtype=np.float64)
    mask[oy:oy + sh, ox:ox + sw] = np.outer(_taper(sh, feather), _taper(sw, feather))
    return mask


def texture_sample(image_path, canvas: tuple[int, int], tcfg, seed: int, epoch: int, index: int) -> dict:
    """What the dataset yields for a texture-eligible sample in a texture phase: pixels [3, 1, ch, cw] in [-1, 1]
    (the same scaling as dataset.load_pixels), loss_mask [1, 1, ch/8, cw/8] and the trigger caption."""
    # lazy: torch (~4.6 s): the scan steps and `anima-train audit` import this module without needing torch
    import torch

    rng = random.Random(f"anima-texture/{int(seed)}/{int(epoch)}/{int(index)}")
    with open_image(image_path) as im:  # as a viewer shows it, like dataset.load_pixels
        crop = crop_texture(im, canvas, tcfg, rng)
    cw, ch = canvas
    mask = supervised_mask((cw // VAE_FACTOR, ch // VAE_FACTOR), tcfg.mask_ratio, tcfg.feather_latent_px, rng)
    if tcfg.mask_padding and crop.valid is not None:
        mask = mask * latent_validity(crop.valid)
    pixels = torch.from_numpy(crop.pixels.astype(np.float32) / 127.5 - 1.0).permute(2, 0, 1).unsqueeze(1)
    return {"pixels": pixels.contiguous(), "loss_mask": torch.from_numpy(mask.astype(np.float32))[None, None],
            "caption": tcfg.trigger, "bucket": (cw, ch)}


# ----------------------------------------------------------------------------------------------------------
# The schedule: which batches are texture batches, and their canvas


class TextureSchedule:
    """Decides, per batch of an epoch, whether it is a texture batch and its canvas (module docstring).

    sizes / eligible: per dataset index, the source's (w, h) and whether its subset takes texture crops. The run's
    shape (total optimizer steps, steps per epoch, processes, accumulation) is set by the trainer through set_run
    once it is known: batch position b of epoch e is the (b // processes)-th micro-batch of each rank, so it falls in
    optimizer step e * steps_per_epoch + (b // processes) // accum, exactly where the trainer's loop is then."""

    def __init__(self, phases: Sequence, tcfg, sizes: Sequence[tuple[int, int] | None], eligible: Sequence[bool],
                 seed: int):
        self.phases = sorted(phases, key=lambda ph: ph.at)
        self.tcfg = tcfg
        self.sizes = list(sizes)
        self.eligible = list(eligible)
        self.seed = int(seed)
        self.run: tuple[int, int, int, int] | None = None

    def set_run(self, total: int, steps_per_epoch: int, processes: int = 1, accum: int = 1) -> None:
        self.run = (max(1, int(total)), int(steps_per_epoch), max(1, int(processes)), max(1, int(accum)))

    def step_of(self, epoch: int, position: int) -> int:
        if self.run is None:
            raise RuntimeError("TextureSchedule.set_run was not called: the sampler cannot tell which batches fall "
                               "in a texture phase before the run's length is known")
        _, per_epoch, processes, accum = self.run
        return int(epoch) * per_epoch + (int(position) // processes) // accum

    def phase_at(self, epoch: int, position: int):
        return active_phase(self.phases, self.step_of(epoch, position) / self.run[0])

    def canvas(self, epoch: int, position: int, batch: Sequence[int]) -> tuple[int, int] | None:
        if not batch or not all(self.eligible[i] for i in batch):
            return None
        if self.phase_at(epoch, position).mode != "texture":
            return None
        rng = random.Random(f"anima-texture-canvas/{self.seed}/{int(epoch)}/{int(position)}")
        return draw_canvas(self.tcfg.canvases, [self.sizes[i] for i in batch], self.tcfg.fit_aware, rng)

    def mark(self, batches: list[list[int]], epoch: int) -> list[list]:
        """The epoch's batches with texture batches as [(index, canvas), ...] (the rest unchanged).

        On several processes the epoch is first padded to a multiple of the process count with its own first
        batches, as Accelerate's even_batches would pad it: done here, each repeat is decided at the position it is
        trained at (Accelerate's repeat would carry the decision of the epoch's first batches into its last step)."""
        processes = self.run[2] if self.run is not None else 1
        if processes > 1 and batches and len(batches) % processes:
            need = processes - len(batches) % processes
            batches = batches + [list(batches[i % len(batches)]) for i in range(need)]
        out = []
        for position, batch in enumerate(batches):
            canvas = self.canvas(epoch, position, batch)
            out.append(batch if canvas is None else [(i, canvas) for i in batch])
        return out


def check_batch_phase(batch: dict, phase) -> None:
    """The trainer's phase and the sampler's decision must agree (both read progress = step / total)."""
    textured = "loss_mask" in batch
    expect = phase is not None and phase.mode == "texture" and all(batch.get("texture", [False]))
    if textured != expect:
        raise RuntimeError(f"the data loader sent a {'texture' if textured else 'full-resolution'} batch in a "
                           f"{getattr(phase, 'mode', 'fullres')} phase (a sampler/trainer progress mismatch; please "
                           f"report it)")


# ----------------------------------------------------------------------------------------------------------
# Startup report


def feasibility_report(sizes: Sequence[tuple[int, int]], canvases: Sequence[Sequence[int]]) -> list[str]:
    """Per distinct canvas: how often it is drawn (its multiplicity), the share of texture-eligible sources that can
    hold it at native scale, and the median tightest slack min(w − cw, h − ch) (negative: most sources are smaller
    and get covered or padded)."""
    counts: dict[tuple[int, int], int] = {}
    for c in canvases:
        counts[tuple(c)] = counts.get(tuple(c), 0) + 1
    n = len(sizes)
    lines = [f"texture  canvas feasibility over {n} texture-eligible source(s) (native scale):"]
    for (cw, ch), k in counts.items():
        if not n:
            lines.append(f"  {cw}x{ch}  weight {k}/{len(canvases)}  no sources")
            continue
        slack = [min(w - cw, h - ch) for w, h in sizes]
        fit = sum(1 for s in slack if s >= 0)
        lines.append(f"  {cw}x{ch}  weight {k}/{len(canvases)}  fits {100 * fit / n:5.1f}%  median slack "
                     f"{int(statistics.median(slack))} px")
    if n and all(min(w - cw, h - ch) < 0 for w, h in sizes for cw, ch in counts):
        lines.append("  no source holds any canvas at native scale: every crop is covered or padded (smaller "
                     "canvases, or larger sources, give the crop freedom)")
    return lines


def split_key(key) -> tuple[int, tuple[int, int] | None]:
    """A sampler item: an int index, or (index, canvas) for a texture sample."""
    return (int(key[0]), key[1]) if isinstance(key, tuple) else (int(key), None)

