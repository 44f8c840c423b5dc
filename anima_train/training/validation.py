"""`[validation]`: the validation loss and the text-conditioning margin on held-out images, while training and after.

A training loss is noise step to step (each step draws another timestep and noise), so a run is judged by a fixed
evaluation (training/fixed_eval.py): every held-out latent at the same fixed timesteps with the same fixed noise, so
two evaluations differ only by the model; and the same with the captions shuffled across images, whose excess over
the true captions is the *text-conditioning margin* (how much the prediction depends on the caption).

    ValidationSet.build(cfg, data, vae)      the held-out latents and captions (`folder`, or `fraction` of the dataset)
    Validation(...).at(step)                 one evaluation, reported (rank 0) to the log, events, TensorBoard
    Validation.summary(train_losses)         "validation loss A → B, margin C → D" and the one-line verdicts

Evaluation leaves training as it was: the models go back to their train/eval modes, no gradient is taken, the
optimizer is not touched, and the global CPU/CUDA random states are saved and restored around it (the fixed noise
has its own generator), so a run with validation has the training losses of a run without, bit for bit. Every
process evaluates (the weights are equal on every rank, so are the numbers); only the main process reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import torch

from anima_train.data.cache_files import load_latents
from anima_train.data.captions import build_caption, read_caption_files
from anima_train.data.errors import DatasetError
from anima_train.data.identity import same_files
from anima_train.data.dataset import Item, build_training_data, encode_latents, load_pixels
from anima_train.fixes import ref
from anima_train.outputs.progress import VALIDATION_PREFIX
from anima_train.training.fixed_eval import EvalResult, evaluate
from anima_train.training.memory import qwen_for_encode

# the verdicts' tolerances: a validation loss within 1% of its best has not "risen", and a margin that grew by less
# than 0.001 has not grown (the numbers are exact, but changes that small say nothing about the run)
ROSE_BY = 0.01
MARGIN_GREW_BY = 0.001


@dataclass
class ValidationSet:
    latents: list[torch.Tensor]  # normalised [16, 1, h, w], on the CPU
    captions: list[str]
    names: list[str]  # the held-out images' stems, for the log

    @classmethod
    def build(cls, cfg, items: list[Item], *, vae=None) -> "ValidationSet":
        """The latents and fixed captions of the held-out `items` (validation_items). `vae`: a function giving the
        encoder, called for an item without a cache only (source = "encode", or "auto" on a folder not cached)."""
        v = cfg.validation
        options = dataclasses.replace(cfg.dataset.caption, shuffle_tags=False, tag_dropout_percent=0.0,
                                      caption_dropout_percent=0.0, nl_shuffle_sentences=False)
        latents, captions = [], []
        for i, it in enumerate(items):
            latents.append(_latents(it, vae))
            tags, nl = read_caption_files(it.stem)
            captions.append(build_caption(tags, nl, options, v.seed, 0, i))  # no dropout, no shuffle: fixed
        return cls(latents, captions, [it.stem.name for it in items])


def validation_items(cfg, data=None, model_path=None) -> list[Item]:
    """The held-out images of `cfg.validation`: those of `folder` (scanned, checked and captioned like the dataset:
    a missing caption or stale cache is refused here, before the model loads), or the `fraction` of the dataset
    that `data` (build_training_data) split off."""
    if cfg.validation.folder is not None:
        items = folder_items(cfg, model_path)
        if data is not None:
            refuse_training_images(cfg, items, data)
        return items
    return list(data.held_out)


def refuse_training_images(cfg, items: list[Item], data) -> None:
    """A validation image that is also a training image (the same folder, one inside the other, a link or a copy)
    measures memorising, not learning: refused, naming the images."""
    trained = {it.image or it.cache for it in data.dataset.items}
    shared = same_files([it.image or it.cache for it in items], trained)
    if shared:
        def name(path):  # inside the validation folder: its name there, which the folder key already places
            return path.relative_to(cfg.validation.folder) if path.is_relative_to(cfg.validation.folder) else path

        shown = ", ".join(f"{name(p)}" + (f" = {q}" if p != q else "") for p, q in shared[:3])
        more = f" and {len(shared) - 3} more" if len(shared) > 3 else ""
        raise DatasetError(f"[validation] folder = {str(cfg.validation.folder)!r}: {len(shared)} of its {len(items)} "
                           f"image(s) are training images too ({shown}{more}), so its loss would measure memorising, "
                           f"not learning: give it images that are not in the training folders, or use [validation] "
                           f"fraction to hold some out of the dataset")


def folder_items(cfg, model_path=None) -> list[Item]:
    """One item per source of `[validation] folder`, checked like a dataset folder (captions, caches)."""
    d = dataclasses.replace(cfg.dataset, path=cfg.validation.folder, subsets=[], num_repeats=1)
    held = build_training_data(dataclasses.replace(cfg, dataset=d, validation=type(cfg.validation)()), model_path)
    items: dict[str, Item] = {}
    for it in held.dataset.items:
        items.setdefault(str(it.stem), it)
    if len(items) < 2:
        raise DatasetError(f"[validation] folder = {cfg.validation.folder} holds {len(items)} image(s); the "
                           f"text-conditioning margin swaps captions between images, so give it at least 2")
    return [items[k] for k in sorted(items)]


def _latents(item: Item, vae) -> torch.Tensor:
    if item.cache is not None:
        return load_latents(item.cache, item.plan.bucket)
    return encode_latents(vae(), load_pixels(item.image, item.plan)[None])[0].cpu()


@dataclass
class Point:
    step: int
    loss: float  # eval loss with the true captions
    shuffled: float  # with the captions shuffled across images
    margin: float  # shuffled - loss
    seconds: float


@dataclass
class Validation:
    cfg: object
    vset: ValidationSet
    parts: object  # model.components.Components (the bare modules)
    progress: object = None  # outputs.progress.Progress (reports on the main process only)
    tracker: object = None  # outputs.tracking.Tracker
    parked: object = None  # memory.ParkedWeights of a frozen Qwen3 waiting in host memory, or None
    text_cache: object = None  # prompts.QwenOutputs ([dataset] cache_text_encoder_outputs): it brings Qwen3 in itself
    block_ckpt: object = None  # recompute.BlockCheckpointing: its first-step measure must see training steps only
    points: list[Point] = field(default_factory=list)

    # -- when --------------------------------------------------------------------------------------------------
    def before_training(self, step: int) -> None:
        self.at(step)

    def after_step(self, step: int, total: int) -> None:
        n = self.cfg.validation.every_n_steps
        if n and step % n == 0 and step < total:
            self.at(step)

    def after_epoch(self, epoch: int, step: int, total: int) -> None:
        n = self.cfg.validation.every_n_epochs
        if n and epoch % n == 0 and step < total and not (self.points and self.points[-1].step == step):
            self.at(step)

    def at_end(self, step: int) -> None:
        if not (self.points and self.points[-1].step == step):
            self.at(step)

    # -- one evaluation ------------------------------------------------------------------------------------------
    def at(self, step: int) -> Point:
        v = self.cfg.validation
        t0 = time.perf_counter()
        with _untouched(self.parts, self.block_ckpt), qwen_for_encode(self.parked, self.text_cache):
            r: EvalResult = evaluate(self.parts, self.vset.latents, self.vset.captions, timesteps=tuple(v.timesteps),
                                     seed=v.seed, cached=self.text_cache)
        point = Point(step, r.true_captions, r.shuffled_captions, r.margin, time.perf_counter() - t0)
        self.points.append(point)
        if self.progress is not None:
            self.progress.message(describe(point, len(self.vset.latents), len(v.timesteps)))
            self.progress.event("validation", step=step, loss=point.loss, shuffled=point.shuffled,
                                margin=point.margin, seconds=point.seconds)
        if self.tracker is not None and self.tracker.on:
            self.tracker.accelerator.log({"validation/loss": point.loss, "validation/margin": point.margin,
                                          "validation/shuffled_captions": point.shuffled}, step=step)
        return point

    def summary(self, train_losses: list[float]) -> list[str]:
        return summary(self.points, train_losses)


def describe(point: Point, images: int, timesteps: int) -> str:
    return (f"validation step {point.step}: loss {point.loss:.4f}, margin {point.margin:+.4f} (shuffled captions "
            f"{point.shuffled:.4f}); {images} image(s) x {timesteps} timestep(s) x 2 in {point.seconds:.1f} s")


def summary(points: list[Point], train_losses: list[float]) -> list[str]:
    """The run's validation in one line, then one line per verdict that fires (each starts with "warning:")."""
    if len(points) < 2:
        return []
    first, last = points[0], points[-1]
    lines = [f"{VALIDATION_PREFIX}{first.loss:.3f} → {last.loss:.3f}, margin {first.margin:.3f} → {last.margin:.3f} "
             f"(steps {first.step} → {last.step})"]
    if last.margin - first.margin < MARGIN_GREW_BY:
        lines.append(f"warning: the text-conditioning margin did not grow ({first.margin:.4f} → {last.margin:.4f}): "
                     f"the run is not learning from its captions (do they describe the images? too few steps or "
                     f"too low a learning rate?)")
    best = min(points[:-1], key=lambda p: p.loss)
    fell, start, end = training_fell(train_losses)
    if last.loss > best.loss * (1 + ROSE_BY) and fell:
        lines.append(f"warning: validation loss rose {best.loss:.3f} (step {best.step}) → {last.loss:.3f} (step "
                     f"{last.step}) while the training loss fell {start:.3f} → {end:.3f}: overfitting"
                     + ref("run evaluate", "; compare the checkpoints with anima-train evaluate"))
    return lines


def training_fell(losses: list[float]) -> tuple[bool, float, float]:
    """Whether the training loss fell: the mean of its last quarter below that of its first (one step's loss is
    noise; a quarter of the run averages it out)."""
    if len(losses) < 2:
        return False, float("nan"), float("nan")
    k = max(1, len(losses) // 4)
    start, end = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return end < start, start, end


@contextlib.contextmanager
def _untouched(parts, block_ckpt=None):
    """Evaluation mode for the three models and the global random states saved: training continues as if nothing
    had run (LoRA dropout and anything else drawing from the global generators draws the same numbers). The
    checkpointing's first-step measure (checkpoint_blocks = "auto") is set aside, so it sees training steps only."""
    modules = [parts.transformer, parts.text_conditioner, parts.text_encoder]
    modes = [m.training for m in modules]
    measure = block_ckpt.measure if block_ckpt is not None else None
    cpu_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        if measure is not None:
            block_ckpt.measure = None
        for m in modules:
            m.eval()
        yield
    finally:
        if measure is not None:
            block_ckpt.measure = measure
        for m, mode in zip(modules, modes):
            m.train(mode)
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
