"""Saving during a run: a checkpoint (by step, by epoch, or the final one), its resume state when wanted, then the
older checkpoints pruned to keep_last_n. Every rank calls `save`; the main process writes the files."""

from __future__ import annotations

from pathlib import Path

from anima_train.config import Config
from anima_train.outputs import checkpoint_files, manifest, resume_state
from anima_train.outputs.layout import STATE_SUFFIX, checkpoint_stem
from anima_train.training.run_state import Run


def every_steps_due(cfg: Config, step: int) -> bool:
    every = cfg.train.save_every_steps
    return bool(every) and step % every == 0


def every_epochs_due(cfg: Config, epoch: int) -> bool:
    """After `epoch` finished epochs; never after the last one (the final save follows)."""
    every = cfg.train.save_every_epochs
    return bool(every) and epoch % every == 0 and epoch < cfg.train.epochs


def save(run: Run, *, epoch: int, batch_index: int, step: int | None = None, epoch_tag: int | None = None,
         final: bool = False, with_state: bool = False) -> Path:
    """A checkpoint and, with save_optimizer_state (or `with_state`: a stop), its resume state; then older
    checkpoints pruned. A resume continues at `epoch` (0-based) after `batch_index` of its batches."""
    cfg, accelerator, progress, result, run_dir = run.cfg, run.accelerator, run.progress, run.result, run.run_dir
    per_epoch = run.per_epoch
    run.grad_norms.check()  # never a checkpoint of weights that a non-finite gradient has touched
    stem = checkpoint_stem(cfg.run_stem, step=None if final else step, epoch=None if final else epoch_tag)
    accelerator.wait_for_everyone()
    path = None
    if accelerator.is_main_process:
        # the names this checkpoint may take (file or diffusers folder, `_te`, `-state`) are recorded as this run's
        manifest.output(run_dir, f"{stem}.safetensors", stem, f"{stem}_te.safetensors", f"{stem}{STATE_SUFFIX}")
        models = {"transformer": accelerator.unwrap_model(run.trainable[0]),
                  "text_conditioner": run.parts.text_conditioner, "text_encoder": run.parts.text_encoder}
        path = checkpoint_files.write_checkpoint(
            run_dir, stem, models, cfg, step=result.global_step,
            epoch=checkpoint_files.epoch_of_step(result.global_step, per_epoch),
            num_epochs=checkpoint_files.epoch_of_step(result.total_steps, per_epoch),
            max_steps=result.total_steps, tag_frequency=result.tag_frequency)
        result.saved.append(path)
        progress.event("checkpoint", path=str(path), step=result.global_step)
        progress.message(f"saved {path}")
    if cfg.train.save_optimizer_state or with_state:
        resume_state.save_state(
            run_dir / f"{stem}{STATE_SUFFIX}", accelerator, run.trainable, run.optimizer, run.scheduler, run.gens,
            dict(global_step=result.global_step, epoch=epoch, batch_in_epoch=batch_index, steps_per_epoch=per_epoch,
                 run=cfg.run_stem, checkpoint=stem, adapter=resume_state.describe_adapter(cfg), inputs=run.inputs),
            losses=dict(first_step=run.first_loss_step, losses=run.earlier_losses + result.losses))
    if accelerator.is_main_process:
        run.claim.published()
    if accelerator.is_main_process and not final:
        for p in checkpoint_files.prune_checkpoints(run_dir, cfg.run_stem, cfg.train.keep_last_n, per_epoch,
                                                    protect=cfg.train.resume_from):
            progress.message(f"pruned {p.name}")
    accelerator.wait_for_everyone()
    return Path(path) if path else run_dir / f"{stem}.safetensors"
