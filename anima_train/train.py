"""`anima-train train cfg.toml`: the training loop, top to bottom.

    anima-train train cfg.toml [--max-steps N] [--no-save] [--dry-run] [--events PATH|-]
    accelerate launch --num_processes 2 -m anima_train train cfg.toml

Flow matching (MODEL.md §6): x_t = (1−t)·x0 + t·ε, the DiT predicts v = ε − x0 from (x_t, t, context). Latents come
from the cache (or the VAE under `source = "encode"`); captions are rebuilt and encoded on every step because tag
shuffling and dropout change them per epoch. Accelerate runs it on one or many processes; it is constructed with
`mixed_precision="no"` because precision is `train.dtype` and nothing else (autocast breaks SDNQ's backward).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from anima_train import checkpoints as ckpt
from anima_train import checkpointing, errors, parent_watch, preflight, runs, sampling, tracking, windows
from anima_train.speed import (CompileDecision, HostCopy, ParkedWeights, compile_transformer, decide_compile,
                               plan_checkpointing, relieve, to_device, use_expandable_segments)
from anima_train.atomic import publish_dir, write_text
from anima_train.config import Config, copy_config_verbatim, load_config
from anima_train.progress import Progress, StepStats

from anima_train.models import DTYPES


@dataclass
class TrainResult:
    run_dir: Path
    final: Path | None
    global_step: int
    losses: list[float] = field(default_factory=list)  # mean-over-ranks loss per optimizer step
    saved: list[Path] = field(default_factory=list)
    tag_frequency: dict = field(default_factory=dict)
    stopped: bool = False  # ended early through the stop file
    components: object = field(default=None, repr=False)  # the trained models (in-process callers: eval, demo)
    trainable_digest: str = ""  # sha256 over this process's trainable tensors: equal on every rank under DDP
    batches_seen: list[list[int]] = field(default_factory=list)  # dataset indices per micro-batch, this rank
    total_steps: int = 0  # the run's horizon in optimizer steps (max_steps capped by the epochs)


@dataclass
class Run:
    """What a checkpoint save needs, gathered once the run is set up: `_save(run, epoch=..., batch_index=...)`."""
    cfg: Config
    accelerator: object
    progress: Progress
    parts: object  # models.Components: the bare modules the checkpoint files are written from
    result: TrainResult  # its step, horizon and tag frequency go into the file; each save is appended to it
    run_dir: Path
    per_epoch: int  # optimizer steps per epoch
    trainable: list  # the trained modules as accelerate prepared them, the transformer first
    optimizer: object
    scheduler: object
    gens: dict  # the random generators by stream ("noise", "timestep"): their states go into the resume state
    claim: runs.Claim  # the run folder's claim: an --overwrite's set-aside files go once the first save is in place
    grad_norms: list = field(default_factory=list)  # (step, HostCopy) gradient norms not yet checked to be finite
    earlier_losses: list = field(default_factory=list)  # a resumed run's losses before it (its state's losses.json)
    first_loss_step: int = 1  # the step of earlier_losses[0] (or of this run's first loss when there are none)


class Diverged(errors.UserError):
    """The loss or the gradient norm became non-finite: the run stops there, saving nothing of that step on."""

    exit_code = errors.DIVERGED_EXIT


def add_arguments(parser) -> None:
    parser.add_argument("config", help="the run's TOML config")
    parser.add_argument("--max-steps", type=int, metavar="N", help="stop after N optimizer steps (overrides the config)")
    parser.add_argument("--no-save", action="store_true", help="write no checkpoint, config copy or state")
    parser.add_argument("--dry-run", action="store_true", help="build everything, run one step, save nothing, exit")
    parser.add_argument("--events", metavar="PATH|-", help="append JSON-lines progress events to PATH (- = stdout)")
    parser.add_argument("--skip-unreadable", action="store_true", help="skip unreadable images instead of refusing")
    parser.add_argument("--allow-missing-captions", action="store_true",
                        help="train images without a <stem>.txt on an empty caption instead of refusing")
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is visible")
    parser.add_argument("--stop-file", metavar="PATH",
                        help="stop gracefully (checkpoint + state, then exit) as soon as PATH exists; refused if "
                             "PATH exists already at start")
    parser.add_argument("--overwrite", action="store_true",
                        help="when output_dir/run_name holds an earlier run of that name, delete its checkpoints, "
                             "-state folders and config copy first (listed as they go) instead of refusing")


def run(args) -> int:
    cfg = load_config(args.config)
    if args.max_steps is not None:
        if args.max_steps < 1:
            raise errors.UserError(f"--max-steps {args.max_steps}: must be at least 1")
        cfg.train.max_steps = args.max_steps
    train(cfg, dry_run=args.dry_run, no_save=args.no_save or args.dry_run, events=args.events,
          skip_unreadable=args.skip_unreadable, cpu=args.cpu, stop_file=args.stop_file, overwrite=args.overwrite,
          allow_missing_captions=args.allow_missing_captions)
    return 0


def _precision_note() -> str | None:
    asked = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if asked and asked != "no":
        return (f"note: the environment asks for mixed precision {asked!r} (accelerate config or launch flag); "
                f"ignored — precision is [train] dtype")
    return None


def train(cfg: Config, *, dry_run: bool = False, no_save: bool = False, events: str | None = None,
          skip_unreadable: bool = False, cpu: bool = False, stop_file: str | None = None,
          overwrite: bool = False, allow_missing_captions: bool = False) -> TrainResult:
    # several processes on Windows: refused before accelerate starts (anima_train/windows.py says why)
    windows.refuse_multi_gpu(windows.launcher_processes())
    from accelerate import Accelerator, DataLoaderConfiguration

    # batches come from pinned memory (the DataLoader's pin_memory on CUDA) and are copied without a host sync
    accelerator = Accelerator(mixed_precision="no", cpu=cpu, dataloader_config=DataLoaderConfiguration(non_blocking=True),
                              gradient_accumulation_steps=cfg.train.gradient_accumulation_steps,
                              **tracking.accelerator_kwargs(cfg, Path(cfg.train.output_dir) / cfg.run_stem))
    progress = Progress(cfg.train.progress, 1, enabled=accelerator.is_main_process, events=events)
    windows.install_console_handler()  # Windows: closing the console saves like a stop file (no-op elsewhere)
    try:
        with contextlib.ExitStack() as cleanup:
            return _train(cfg, accelerator, progress, dry_run=dry_run, no_save=no_save,
                          skip_unreadable=skip_unreadable, stop_file=stop_file, overwrite=overwrite,
                          allow_missing_captions=allow_missing_captions, cleanup=cleanup)
    except BaseException as exc:
        user = errors.user_message(exc)  # a user error is its message alone, as on the command line
        progress.event("error", message=user or f"{type(exc).__name__}: {exc}",
                       traceback="" if user else traceback.format_exc())
        raise
    finally:
        progress.close()
        windows.training_finished()  # a console close handler waiting for the save may let the process end


def _train(cfg: Config, accelerator, progress: Progress, *, dry_run: bool, no_save: bool,
           skip_unreadable: bool, stop_file: str | None = None, overwrite: bool = False,
           allow_missing_captions: bool = False, cleanup: contextlib.ExitStack) -> TrainResult:
    from anima_train.sampler import settings_not_followed, steps_per_epoch
    from anima_train.flow import active_phase
    from anima_train.optimizers import build_optimizer
    from anima_train.schedules import build_scheduler
    from anima_train.texture import check_batch_phase

    t_start = time.perf_counter()
    say = progress.message
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    dtype = DTYPES[cfg.train.dtype]
    run_dir = Path(cfg.train.output_dir) / cfg.run_stem

    # -- setup: refuse what cannot work, then data, model, optimizer, accelerator ---------------------------------
    state_dir, claim = _refuse_early(cfg, accelerator, run_dir, say, dry_run=dry_run, no_save=no_save,
                                     stop_file=stop_file, overwrite=overwrite, cleanup=cleanup)
    data = _scan_dataset(cfg, progress, skip_unreadable=skip_unreadable,
                         allow_missing_captions=allow_missing_captions)
    accum = cfg.train.gradient_accumulation_steps
    per_epoch = steps_per_epoch(len(data.sampler), world, accum)
    for text in settings_not_followed(cfg, data.sampler, per_epoch):
        progress.warning(text)  # before the model loads: on the node before the run starts
    total = 1 if dry_run else _total_steps(cfg, per_epoch)
    compiling = _decide_compile(cfg, device, total, progress)  # before the model loads: a refusal costs nothing
    progress.event("status", message="loading model")
    gens = _seed(cfg.train.seed + rank, device)
    if use_expandable_segments(device):  # before the weights load: they are the first segments
        say("speed    CUDA allocator: expandable segments")
    model = _build_model(cfg, data, device, dtype, say)

    optimizer = build_optimizer(model.groups, cfg.optimizer)
    loader = _loader(cfg, data, device)
    scheduler = build_scheduler(optimizer, cfg.schedule, total, num_processes=world)
    data.set_run(total, per_epoch, world, accum)  # the sampler places texture phases by the same progress
    _compile_when_it_pays(cfg, model, compiling, say)
    trainable, optimizer, loader, scheduler = _prepare(accelerator, model, optimizer, loader, scheduler)
    # the model's own tensors (their gradients exist at clip time); the optimizer may hold fp32 masters instead
    params = [p for g in model.groups for p in g["params"]]
    _say_steps(say, cfg, per_epoch, batches=len(data.sampler), world=world, accum=accum)

    # -- resume ---------------------------------------------------------------------------------------------
    global_step, start_epoch, skip_batches = 0, 0, 0
    if state_dir is not None:
        global_step, start_epoch, skip_batches = _load_state(state_dir, trainable, optimizer, scheduler, gens,
                                                              accelerator, batches_per_epoch=len(loader))
        if global_step >= total and not dry_run:  # the exact total is known only now (data, processes)
            raise ckpt.finished_error(state_dir, global_step, total, cfg.train.max_steps, cfg.train.epochs)
        say(f"resumed from {state_dir} at step {global_step} (epoch {start_epoch + 1}, batch {skip_batches})")
    start_step = global_step

    progress.set_total(total, start_step=global_step)
    progress.event("start", total=total, steps_per_epoch=per_epoch, epochs=cfg.train.epochs, processes=world,
                   run_dir=str(run_dir), resumed_step=global_step)
    if accelerator.is_main_process and not no_save:
        run_dir.mkdir(parents=True, exist_ok=True)
        copy_config_verbatim(cfg, run_dir / f"{cfg.run_stem}.toml")

    result = TrainResult(run_dir=run_dir, final=None, global_step=global_step, total_steps=total,
                         tag_frequency=tag_frequency(data.sources) if accelerator.is_main_process else {})
    run = Run(cfg=cfg, accelerator=accelerator, progress=progress, parts=model.parts, result=result,
              run_dir=run_dir, per_epoch=per_epoch, trainable=trainable, optimizer=optimizer, scheduler=scheduler,
              gens=gens, claim=claim)
    if state_dir is not None:  # the losses before the resume, for the plot and the next state
        run.first_loss_step, run.earlier_losses = ckpt.read_losses(state_dir, start_step)
    else:
        run.first_loss_step = start_step + 1
    tracker = tracking.Tracker(accelerator, cfg, run_dir, resumed_step=start_step)
    cleanup.callback(tracker.close)
    previews = sampling.Previewer(
        cfg, accelerator, progress, run_dir, parts=model.parts, device=device, dtype=dtype, parked=model.parked,
        models=lambda: tuple(accelerator.unwrap_model(m) for m in (model.transformer, model.conditioner,
                                                                   model.text_encoder)),
        keep_vae_on_device=model.vae is not None, enabled=not dry_run, on_images=tracker.images)

    # -- the loop: for epoch, for batch: micro-step, backward, clip, step; report; maybe save or stop ------------
    # a worker whose ComfyUI ends, or whose console window is closed (Windows), saves like a stop-file stop
    watched = parent_watch.save_before_exit() or windows.install_console_handler()
    stats_sum, micro = None, 0  # device tensor [loss, mse, hf, ot] summed over the step's micro-batches
    step_images, readout, norms = 0, None, []  # norms: (step, HostCopy) not yet logged
    epoch, done = start_epoch, global_step >= total
    if not done:
        previews.before_training(global_step)
    while not done and epoch < cfg.train.epochs:
        batches = accelerator.skip_first_batches(loader, skip_batches) if skip_batches else loader
        # Accelerate's loader re-applies its own iteration counter to the sampler/dataset when iterated, so it
        # must be told the epoch too (a resumed run's first full pass is the loader's iteration 0, not epoch N).
        batches.set_epoch(epoch)
        data.sampler.set_epoch(epoch)
        data.dataset.set_epoch(epoch)
        batch_index, skip_batches = skip_batches, 0  # batches of this epoch done (a resume skips some)
        for batch in batches:
            batch_index += 1
            result.batches_seen.append([int(i) for i in batch["index"]])
            step_images += len(batch["index"])
            # curriculum: the last phase with at <= progress (absent: None, and nothing below changes)
            phase = active_phase(cfg.curriculum, global_step / total) if cfg.curriculum else None
            check_batch_phase(batch, phase)
            with accelerator.accumulate(*trainable):
                loss, loss_parts = _flow_matching_loss(cfg, model, gens, batch, phase)
                values = _loss_values(loss, loss_parts)
                stats_sum = values if stats_sum is None else stats_sum + values
                micro += 1
                if accelerator.sync_gradients:  # on its way to the host while the backward runs (speed.HostCopy)
                    readout = _readout(accelerator, stats_sum / micro, stop_vote=bool(stop_file or watched)
                                       and _stop_vote(stop_file))
                    stats_sum, micro = None, 0
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = (accelerator.clip_grad_norm_(params, cfg.optimizer.max_grad_norm)
                            if cfg.optimizer.max_grad_norm > 0 else _grad_norm(params))
                    if norm is not None:  # pre-clip; checked to be finite one step late, or before a save
                        copy = HostCopy(norm.float().reshape(1))
                        run.grad_norms.append((global_step + 1, copy))
                        if tracker.on:  # for TensorBoard: read at the next report
                            norms.append((global_step + 1, copy))
                if phase is not None:  # absolute each time, never compounded: scheduler LR x the phase's lr_mul
                    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
                        group["lr"] = lr * phase.lr_mul
                used_lrs = [group["lr"] for group in optimizer.param_groups]  # what this step really used
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            if not accelerator.sync_gradients:
                continue

            # -- one optimizer step done: report it, then stop, save or go on --------------------------------
            global_step += 1
            if model.block_ckpt.measure is not None:  # checkpoint_blocks = "auto": the first step measured; decide
                plan_checkpointing(model.block_ckpt, data.sampler.largest_batch_tokens(), model.parked, device, say)
            elif model.block_ckpt.retries is not None:  # after the plan: a step that stalled the allocator
                relieve(model.block_ckpt, model.parked, device, say)
            _check_grad_norms(run, before=global_step)  # the earlier steps' norms: ready, reading them costs no wait
            stats, stop_votes, peaks = _read(readout, accelerator)
            if not math.isfinite(stats[0]):
                raise _diverged(run, global_step, f"the loss is {stats[0]}")
            result.losses.append(stats[0])
            result.global_step = global_step
            step_stats = _step_stats(cfg, stats, step=global_step, epoch=epoch, lrs=used_lrs, phase=phase,
                                     peak_gb=peaks)
            progress.step(step_stats, report=global_step % cfg.train.log_every == 0 or global_step == total)
            tracker.step(step_stats, group_names=[g["name"] for g in model.groups], images=step_images * world)
            while norms and norms[0][0] < global_step:  # the previous step's (reading this one would wait)
                tracker.grad_norm(norms[0][0], norms.pop(0)[1].read()[0])
            step_images = 0
            previews.after_step(global_step)
            if global_step >= total:
                done = True
                break
            # one process: the stop file now; several: the votes sent with this step's loss (all ranks agree)
            if (stop_file or watched) and (any(stop_votes) if world > 1 else _stop_vote(stop_file)):
                reason = ("the parent process ended" if parent_watch.parent_gone() else windows.close_reason()
                          if windows.close_requested() else stop_file)
                say(f"stop requested ({reason}): saving step {global_step} and exiting")
                result.stopped = True
                if not no_save:  # a stop is not a finished run: keep what resuming needs unless opted out
                    _save(run, epoch=epoch, batch_index=batch_index, step=global_step,
                          with_state=cfg.train.save_state_on_stop)
                done = True
                break
            every = cfg.train.save_every_steps
            if every and global_step % every == 0 and not no_save:
                _save(run, epoch=epoch, batch_index=batch_index, step=global_step)
        if done:  # the horizon or a stop, mid-epoch
            break
        epoch += 1
        previews.after_epoch(epoch, global_step)
        every = cfg.train.save_every_epochs
        if every and epoch % every == 0 and epoch < cfg.train.epochs and not no_save:
            _save(run, epoch=epoch, batch_index=0, epoch_tag=epoch)

    # -- the end: last previews, final checkpoint, loss plot ---------------------------------------------------
    _check_grad_norms(run)  # the last step's gradient, before anything shows or saves its weights
    for step_of, norm in norms:
        tracker.grad_norm(step_of, norm.read()[0])
    if not result.stopped:
        previews.at_end(global_step)
    if not no_save and not cfg.train.skip_final_save and not result.stopped:
        epoch_finished = batch_index >= len(loader)  # then a resume starts at the next epoch's first batch
        result.final = _save(run, epoch=epoch + (1 if epoch_finished else 0),
                             batch_index=0 if epoch_finished else batch_index, final=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and not no_save and result.losses:
        from anima_train.plot import plot_losses

        plot_losses(run.earlier_losses + result.losses, run_dir / runs.LOSS_PLOT_NAME,
                    title=f"training loss: {cfg.run_stem}", first_step=run.first_loss_step)
    if model.parked is not None:
        model.parked.restore()  # in-process callers (eval, demo) get a normal model back
    result.trainable_digest = _digest(accelerator.unwrap_model(m) for m in trainable)
    result.components = model.parts
    _report_done(progress, result, start_step=start_step, total=total, t_start=t_start)
    # every rank tears the process group down together: a rank that leaves while the main one is still plotting has
    # been seen to abort the other at exit (gloo, "terminate called without an active exception", exit -6)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result


# -- setup ------------------------------------------------------------------------------------------------------

def _refuse_early(cfg: Config, accelerator, run_dir: Path, say, *, dry_run: bool, no_save: bool,
                  stop_file: str | None, overwrite: bool,
                  cleanup: contextlib.ExitStack) -> tuple[Path | None, runs.Claim]:
    """The checks that need no model, and the claim on the run folder. Returns the state folder a resume starts
    from (None: a fresh run) and the claim (runs.Claim: told when the first checkpoint is saved)."""
    from anima_train.texture import refuse_multi_process

    # texture phases: one process unless allow_multi_gpu_texture (CONFIG.md §1)
    refuse_multi_process(cfg, accelerator.num_processes)
    if note := _precision_note():
        say(note)
    # a model, dataset, output folder or resume that cannot work must fail before minutes of model loading (a resume:
    # its state.json, the adapter it was trained with, and no newer state of its run that it would overwrite)
    preflight.check_run_paths(cfg, saving=not no_save)
    state_dir = ckpt.resolve_resume(cfg.train.resume_from) if cfg.train.resume_from else None
    if state_dir is not None and not dry_run:
        ckpt.refuse_finished(state_dir, cfg.train.max_steps, cfg.train.epochs)
    # ... and so must a run that would replace another run's files, share its folder, or stop at once
    claim = cleanup.enter_context(runs.claim_run(run_dir, cfg.run_stem, accelerator, resume_state=state_dir,
                                                 overwrite=overwrite, stop_file=stop_file, saving=not no_save,
                                                 say=say))
    return state_dir, claim


def _scan_dataset(cfg: Config, progress: Progress, *, skip_unreadable: bool, allow_missing_captions: bool):
    from anima_train.dataset import build_training_data

    progress.event("status", message="scanning dataset")
    data = build_training_data(cfg, cfg.train.model_path, skip_unreadable=skip_unreadable,
                               allow_missing_captions=allow_missing_captions)
    for line in data.report:
        progress.message(line)
    for text in data.warnings:
        progress.warning(text)
    return data


def _seed(seed: int, device: torch.device) -> dict[str, torch.Generator]:
    """Every random stream has its own generator; ranks differ by their index (CONFIG.md §B.13). The global seed
    covers the rest (peft's adapter initialisation, LoRA dropout)."""
    torch.manual_seed(seed)
    return {"noise": torch.Generator(device=device).manual_seed(seed),  # ε, on the device
            "timestep": torch.Generator().manual_seed(seed)}  # t, on the CPU (tiny draws)


@dataclass
class Model:
    """The three models as a training step calls them, and what their memory needs.

    `transformer`, `conditioner` and `text_encoder` start as the bare modules; `_prepare` swaps in accelerate's
    wrappers for the trained ones. `parts` keeps the bare modules (checkpoint files, previews)."""
    parts: object  # models.Components
    device: torch.device
    dtype: torch.dtype
    groups: list  # the optimizer's parameter groups (adapters.build_param_groups)
    train_conditioner: bool
    train_text_encoder: bool
    block_ckpt: checkpointing.BlockCheckpointing
    recompute: int | None  # DiT blocks that recompute from the start; None = "auto", decided after step one
    parked: ParkedWeights | None  # the frozen Qwen3, when it waits in host memory between steps
    vae: object  # source = "encode": the VAE encodes each batch in the step; else None (latents are cached)
    transformer: torch.nn.Module
    conditioner: torch.nn.Module
    text_encoder: torch.nn.Module

    def trained(self) -> list[torch.nn.Module]:
        """The modules the optimizer updates, in the order accelerate prepares them (and the resume state numbers
        them): the transformer, then the conditioner and the text encoder when trained."""
        return [m for m, on in ((self.transformer, True), (self.conditioner, self.train_conditioner),
                                (self.text_encoder, self.train_text_encoder)) if on]


def _build_model(cfg: Config, data, device: torch.device, dtype: torch.dtype, say) -> Model:
    """The base models, quantized (quant.mode), with the adapters wrapped in, in train mode; block checkpointing
    and the parked Qwen3 set up."""
    from anima_train.adapters import build_param_groups, inject_adapters
    from anima_train.models import load_components

    parts = load_components(cfg.train.model_path, dtype=dtype, device=device)
    transformer, conditioner, text_encoder = parts.transformer, parts.text_conditioner, parts.text_encoder

    if cfg.quant.mode != "none":  # before the adapters: LoRA/LoKr wrap the quantized Linears
        from anima_train.quant import dit_tokens, quantize_models

        tokens = [dit_tokens(*e.plan.bucket) for e in data.entries]
        report = quantize_models({"transformer": transformer, "text_conditioner": conditioner,
                                  "text_encoder": text_encoder}, cfg, token_counts=tokens)
        for line in report.summary().splitlines():
            say(line)
    inject_adapters(transformer, conditioner, text_encoder, cfg)
    groups, table = build_param_groups({"transformer": transformer, "text_conditioner": conditioner,
                                        "text_encoder": text_encoder}, cfg)
    for line in table.splitlines():
        say(line)
    train_conditioner = any(p.requires_grad for p in conditioner.parameters())
    train_text_encoder = any(p.requires_grad for p in text_encoder.parameters())
    # which DiT blocks recompute their activations in backward: a count, or "auto" = measured on the first step
    blocks = list(transformer.transformer_blocks)
    recompute = checkpointing.parse_setting(cfg.train.gradient_checkpointing, cfg.train.checkpoint_blocks,
                                            len(blocks), device)
    block_ckpt = checkpointing.BlockCheckpointing(blocks)
    block_ckpt.set_recomputed(len(blocks) if recompute is None else recompute)
    if recompute is None:
        block_ckpt.measure = checkpointing.Measure(tokens=0)
    if block_ckpt.recomputed:
        transformer.enable_gradient_checkpointing(block_ckpt)
    if cfg.train.gradient_checkpointing and train_conditioner and hasattr(conditioner, "enable_gradient_checkpointing"):
        conditioner.enable_gradient_checkpointing()
    transformer.train()
    conditioner.train(train_conditioner)
    text_encoder.train(train_text_encoder)

    # A frozen Qwen3 is needed for a few milliseconds per step but would sit in VRAM (1.1 GiB) through the DiT's
    # forward and backward, where the peak is: park its weights in pinned host memory between steps.
    parked = None
    if device.type == "cuda" and not train_text_encoder and not cfg.quant.quantize_text_encoder:
        parked = ParkedWeights(text_encoder, device)
    return Model(parts=parts, device=device, dtype=dtype, groups=groups, train_conditioner=train_conditioner,
                 train_text_encoder=train_text_encoder, block_ckpt=block_ckpt, recompute=recompute, parked=parked,
                 vae=parts.vae if cfg.dataset.source == "encode" else None,
                 transformer=transformer, conditioner=conditioner, text_encoder=text_encoder)


def _total_steps(cfg: Config, per_epoch: int) -> int:
    """The run's horizon: max_steps is the horizon and a hard stop, but the epochs still bound the loop
    (CONFIG.md §1)."""
    epochs_total = per_epoch * cfg.train.epochs
    return min(cfg.train.max_steps, epochs_total) if cfg.train.max_steps else epochs_total


def _decide_compile(cfg: Config, device: torch.device, total: int, progress: Progress) -> CompileDecision:
    """Whether to torch.compile (speed.decide_compile: a probe that really compiles on this device, when compiling
    is wanted). A failure under compile = "auto" is one warning line (the log, the node) and an eager run; an
    explicitly asked mode that cannot work is a UserError here, before the model loads."""
    decision = decide_compile(cfg, device, total)
    if decision.warning:
        progress.warning(decision.warning)
    elif decision.probes:
        progress.message(f"probed {' and '.join(decision.probes)} on {device.type}: works")
    return decision


def _loader(cfg: Config, data, device: torch.device):
    """The training DataLoader. Its worker processes persist across epochs (on Windows each one is a spawned
    process that imports torch again: seconds per worker and epoch otherwise); a worker keeps its own copy of the
    dataset, so each sample key carries its epoch (sampler.EpochKeys) and the captions are still drawn per epoch."""
    from torch.utils.data import DataLoader

    from anima_train.dataset import collate
    from anima_train.sampler import EpochKeys

    workers = cfg.train.num_workers
    return DataLoader(data.dataset, batch_sampler=EpochKeys(data.sampler), collate_fn=collate,
                      num_workers=workers, persistent_workers=workers > 0, pin_memory=device.type == "cuda")


def _compile_when_it_pays(cfg: Config, model: Model, decision: CompileDecision, say) -> None:
    """torch.compile the DiT when decided (compile = "auto": on CUDA, for a run long enough, when the probe
    compiled), then say how the step is sped up."""
    compile_mode = decision.mode
    if compile_mode:
        compile_transformer(model.transformer, cfg, compile_mode)
    n_blocks = len(model.block_ckpt.blocks)
    ckpt_text = ("auto (decided after the first step)" if model.recompute is None
                 else f"{model.recompute} of {n_blocks} blocks")
    say(f"speed    compile {compile_mode or 'off'} (compile = {cfg.train.compile}); checkpointing {ckpt_text}")


def _prepare(accelerator, model: Model, optimizer, loader, scheduler):
    """accelerate.prepare: the trained models wrapped (DDP on many processes), which the step calls from now on;
    returns the prepared trainable modules, optimizer, loader and scheduler."""
    trained = model.trained()
    prepared = accelerator.prepare(*trained, optimizer, loader, scheduler)
    trainable, (optimizer, loader, scheduler) = list(prepared[: len(trained)]), prepared[len(trained):]
    model.transformer = trainable[0]
    if model.train_conditioner:
        model.conditioner = trainable[1]
    if model.train_text_encoder:
        model.text_encoder = trainable[-1]
    return trainable, optimizer, loader, scheduler


def _say_steps(say, cfg: Config, per_epoch: int, *, batches: int, world: int, accum: int) -> None:
    say(f"steps    {per_epoch}/epoch x {cfg.train.epochs} epoch(s) = {per_epoch * cfg.train.epochs}"
        + (f", capped at max_steps {cfg.train.max_steps}" if cfg.train.max_steps else "")
        + f"  (batches {batches}, processes {world}, accumulation {accum})")
    if world > 1:
        say(f"note: {world} processes share each epoch's batches, so an epoch has {world}x fewer optimizer steps "
            f"than on one process")


# -- one step ---------------------------------------------------------------------------------------------------

def _flow_matching_loss(cfg: Config, model: Model, gens: dict, batch: dict, phase) -> tuple[torch.Tensor, dict]:
    """One micro-batch: x_t = (1−t)·x0 + t·ε, the DiT predicts v = ε − x0 from (x_t, t, caption). Returns the
    loss and its parts (mse, hf, ot) for the report."""
    from anima_train.dataset import encode_latents
    from anima_train.flow import flow_loss, noisy_latents, ot_pair_noise, sample_timesteps
    from anima_train.text import encode_prompts

    device, dtype, parts, block_ckpt, parked = model.device, model.dtype, model.parts, model.block_ckpt, model.parked
    if model.vae is not None:  # source = "encode": the VAE runs here, without autograd
        chunk = cfg.train.vae_encode_chunk  # images per VAE forward: bounds the encode's share of the peak
        x0 = torch.cat([encode_latents(model.vae, px) for px in batch["pixels"].split(chunk)]).to(device, dtype)
    else:
        x0 = batch["latents"].to(device, dtype)
    b, _, _, h, w = x0.shape
    if block_ckpt.measure is not None:
        block_ckpt.measure.tokens = max(block_ckpt.measure.tokens, b * (h // 2) * (w // 2))
    noise = torch.randn(x0.shape, generator=gens["noise"], device=device, dtype=torch.float32).to(dtype)
    moved = None
    if cfg.flow.use_ot:  # pair each latent with its most similar noise row (per micro-batch)
        noise, moved = ot_pair_noise(x0, noise)
    t = to_device(sample_timesteps(b, cfg.flow, gens["timestep"], latent_hw=(h, w), phase=phase), device)
    x_t = noisy_latents(x0, noise, t)
    with parked.on_device() if parked is not None else contextlib.nullcontext():
        context = encode_prompts(batch["caption"], tokenizer=parts.tokenizer, t5_tokenizer=parts.t5_tokenizer,
                                 text_encoder=model.text_encoder, conditioner=model.conditioner, device=device,
                                 train_text_encoder=model.train_text_encoder)
    pred = model.transformer(x_t, timestep=t.to(dtype), encoder_hidden_states=context.to(dtype),
                             padding_mask=x_t.new_zeros(1, 1, 8 * h, 8 * w), return_dict=False)[0]
    mask = to_device(batch["loss_mask"], device) if "loss_mask" in batch else None  # texture crops only
    loss, loss_parts = flow_loss(pred, x0, noise, x_t, t, hf_scale=cfg.flow.hf_scale,
                                 hf_exponent=cfg.flow.hf_exponent, mask=mask)
    if moved is not None:
        loss_parts["ot"] = moved
    return loss, loss_parts


def _loss_values(loss: torch.Tensor, loss_parts: dict) -> torch.Tensor:
    """[loss, mse, hf, ot] of one micro-batch as one device tensor: summed on the device, the host reads them once
    per optimizer step, not once per micro-batch. A part that is a Python number is filled in on the device (a
    tensor made on the host would be copied in: a host sync)."""
    loss = loss.detach().float()

    def value(part):
        return part.detach().float() if torch.is_tensor(part) else torch.full((), float(part), device=loss.device)

    return torch.stack([loss] + [value(loss_parts.get(k, d)) for k, d in (("mse", loss), ("hf", 0.0), ("ot", 0.0))])


def _step_stats(cfg: Config, stats: list[float], *, step: int, epoch: int, lrs: list[float], phase,
                peak_gb: list[float]) -> StepStats:
    """The optimizer step's report from its mean-over-ranks [loss, mse, hf, ot]; a part the config does not use
    is None."""
    from anima_train.flow import phase_summary

    return StepStats(step=step, epoch=epoch + 1, loss=stats[0],
                     mse=stats[1] if cfg.flow.hf_scale > 0 else None,
                     hf=stats[2] if cfg.flow.hf_scale > 0 else None,
                     ot=stats[3] if cfg.flow.use_ot else None,
                     lrs=lrs, peak_gb=peak_gb,
                     phase=phase_summary(cfg.curriculum, phase))


def _report_done(progress: Progress, result: TrainResult, *, start_step: int, total: int, t_start: float) -> None:
    step = result.global_step
    ran = step - start_step
    progress.message(
        f"done: {ran} step(s)" + (f" this run (steps {start_step + 1}–{step})" if start_step and ran else "")
        + (f" this run (resumed at step {start_step})" if start_step and not ran else "")
        + f" in {time.perf_counter() - t_start:.1f} s"
        + (f"; final checkpoint {result.final}" if result.final else ""))
    progress.event("done", step=step, total=total, steps_this_run=ran,
                   final=str(result.final) if result.final else None, stopped=result.stopped,
                   saved=[str(p) for p in result.saved],
                   seconds=time.perf_counter() - t_start)


def _stop_vote(stop_file: str | None) -> bool:
    """This process wants to stop: the stop file exists, the parent (ComfyUI) is gone, or the console is closing."""
    return bool((stop_file and os.path.exists(stop_file)) or parent_watch.parent_gone()
                or windows.close_requested())


def _peak_gib(device: torch.device) -> float:
    # the caching allocator's host-side counter (no sync); it counts the queued kernels' memory already
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def _readout(accelerator, stats: torch.Tensor, *, stop_vote: bool) -> HostCopy:
    """This step's [loss, mse, hf, ot] (the mean over processes), on its way to the host (HostCopy), queued after the
    forward. With several processes each one's stop vote and peak memory travel with it: one gather, no extra sync;
    every rank then reads the same votes, so all stop at the same step (a lone rank leaving would hang the
    others)."""
    world = accelerator.num_processes
    if world == 1:
        return HostCopy(stats)
    own = torch.stack([torch.full((), float(stop_vote), device=stats.device),  # filled on the device: no copy-in
                       torch.full((), _peak_gib(stats.device), device=stats.device)])
    rows = accelerator.gather(torch.cat([stats.float(), own])).view(world, -1)
    return HostCopy(torch.cat([rows[:, :4].mean(0), rows[:, 4], rows[:, 5]]))


def _read(readout: HostCopy, accelerator) -> tuple[list[float], list[float], list[float]]:
    """(stats, stop votes, peak GiB per rank) of the step whose readout this is; no peaks off CUDA."""
    world, values = accelerator.num_processes, readout.read()
    if world == 1:
        stats, votes, peaks = values, [], [_peak_gib(accelerator.device)]
    else:
        stats, votes, peaks = values[:4], values[4:4 + world], values[4 + world:]
    return stats, votes, [round(p, 2) for p in peaks] if accelerator.device.type == "cuda" else []


def _grad_norm(params) -> torch.Tensor | None:
    """The total gradient norm (what clip_grad_norm_ returns) when nothing clips: queued on the device, not read."""
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None


def _check_grad_norms(run: Run, before: int | None = None) -> None:
    """Raise Diverged at the first non-finite gradient norm of the steps before `before` (None: every step so far,
    which waits for the last backward: done before a save, which waits for it anyway)."""
    while run.grad_norms and (before is None or run.grad_norms[0][0] < before):
        step, copy = run.grad_norms.pop(0)
        value = copy.read()[0]
        if not math.isfinite(value):
            raise _diverged(run, step, f"the gradient norm is {value}")


def _diverged(run: Run, step: int, what: str) -> Diverged:
    """Every rank sees the same loss (the mean over ranks) and norm (after the all-reduce): all stop here."""
    cfg = run.cfg
    newest = ckpt.latest_state(run.run_dir) if run.run_dir.is_dir() else None
    kept = (f"the last good checkpoint and state are kept (newest: {newest})" if newest is not None
            else "the checkpoints saved before it are kept" if run.result.saved
            else "nothing was saved before it")
    clip = ("" if cfg.optimizer.max_grad_norm > 0
            else ", set [optimizer] max_grad_norm (gradient clipping, e.g. 1.0)")
    return Diverged(
        f"training diverged at step {step}: {what}; nothing from this step on was saved, {kept}. Lower [optimizer] "
        f"lr (now {cfg.optimizer.lr:g}){clip}, or look for damaged data, then resume from the newest state or start "
        f"again")


# -- checkpoints ----------------------------------------------------------------------------------------------

def _save(run: Run, *, epoch: int, batch_index: int, step: int | None = None, epoch_tag: int | None = None,
          final: bool = False, with_state: bool = False) -> Path:
    """A checkpoint (named by step, by epoch, or the final one) and, with save_optimizer_state (or `with_state`: a
    stop), its resume state; then older checkpoints pruned to keep_last_n. A resume continues at `epoch` (0-based)
    after `batch_index` of its batches."""
    cfg, accelerator, progress, result, run_dir = run.cfg, run.accelerator, run.progress, run.result, run.run_dir
    per_epoch = run.per_epoch
    _check_grad_norms(run)  # never a checkpoint of weights that a non-finite gradient has touched
    stem = ckpt.checkpoint_stem(cfg.run_stem, step=None if final else step,
                                epoch=None if final else epoch_tag)
    accelerator.wait_for_everyone()
    path = None
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        models = {"transformer": accelerator.unwrap_model(run.trainable[0]),
                  "text_conditioner": run.parts.text_conditioner, "text_encoder": run.parts.text_encoder}
        path = write_checkpoint(run_dir, stem, models, cfg, step=result.global_step,
                                epoch=ckpt.epoch_of_step(result.global_step, per_epoch),
                                num_epochs=ckpt.epoch_of_step(result.total_steps, per_epoch),
                                max_steps=result.total_steps, tag_frequency=result.tag_frequency)
        result.saved.append(path)
        progress.event("checkpoint", path=str(path), step=result.global_step)
        progress.message(f"saved {path}")
    if cfg.train.save_optimizer_state or with_state:
        _save_state(run_dir / f"{stem}{ckpt.STATE_SUFFIX}", accelerator, run.trainable, run.optimizer,
                    run.scheduler, run.gens,
                    dict(global_step=result.global_step, epoch=epoch, batch_in_epoch=batch_index,
                         steps_per_epoch=per_epoch, run=cfg.run_stem, checkpoint=stem,
                         adapter=ckpt.describe_adapter(cfg)),
                    losses=dict(first_step=run.first_loss_step, losses=run.earlier_losses + result.losses))
    if accelerator.is_main_process:
        run.claim.published()
    if accelerator.is_main_process and not final:
        for p in ckpt.prune_checkpoints(run_dir, cfg.run_stem, cfg.train.keep_last_n, per_epoch,
                                        protect=cfg.train.resume_from):
            progress.message(f"pruned {p.name}")
    accelerator.wait_for_everyone()
    return Path(path) if path else run_dir / f"{stem}.safetensors"


def _digest(models) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(_trainable_state(models).items()):
        h.update(name.encode())
        h.update(tensor.float().numpy().tobytes())
    return h.hexdigest()


def write_checkpoint(run_dir: Path, stem: str, models: dict, cfg: Config, *, step: int, epoch: int, num_epochs: int,
                     max_steps: int, tag_frequency: dict | None = None) -> Path:
    """One checkpoint in the layout ComfyUI loads directly: the [adapter] kind's file (adapters.<method>.model:
    save_checkpoint; a full finetune's is a native single file, or diffusers folders with save_native = false), plus
    the `_te` sibling for a Qwen3 LoRA. Replaces a file of the same name (a re-run of the same step).

    The numbers describe the run that writes the file (sd-scripts' meaning): step = optimizer steps done (ss_steps),
    epoch = the 1-based epoch that step falls in (ss_epoch), num_epochs / max_steps = the epochs and steps the run
    really does (ss_num_epochs, ss_max_train_steps), i.e. after a max_steps cap, not the configured epochs."""
    from anima_train import adapters
    from anima_train.adapters import export as ex
    from anima_train.adapters import text_encoder_rank_alpha
    method = adapters.method(cfg.adapter.kind)
    dtype = DTYPES[cfg.train.dtype]

    def metadata(file_kind: str, rank: int | None, alpha: float | None) -> dict[str, str]:
        return ex.training_metadata(
            kind=file_kind, title=cfg.run_stem, rank=rank, alpha=alpha,
            resolution=cfg.dataset.tiers, steps=step, epoch=epoch, num_epochs=num_epochs,
            max_steps=max_steps, tag_frequency=tag_frequency,
            training_config=config_json(cfg),
            network_args={"components": cfg.adapter.components, "train_llm_adapter": cfg.adapter.train_llm_adapter},
            extra={"step": step, "run": cfg.run_stem})

    meta = metadata(method.name, *((None, None) if method.trains_base else (cfg.adapter.rank, cfg.adapter.alpha)))
    path = run_dir / method.output_name(stem, cfg)
    with ckpt.writing(path, run_dir):
        path = method.runtime().save_checkpoint(path, models, cfg, meta, dtype)
    if cfg.adapter.train_text_encoder:  # the Qwen3 LoRA's own rank and alpha, even beside a full finetune
        te_meta = metadata("te_lora", *text_encoder_rank_alpha(cfg))
        te_path = ex.text_encoder_lora_path(run_dir / f"{stem}.safetensors")
        with ckpt.writing(te_path, run_dir):
            ex.save_text_encoder_lora(te_path, models["text_encoder"], te_meta, dtype=dtype, overwrite=True)
    return path


def config_json(cfg: Config) -> dict:
    """The resolved config as plain data (ss_training_config is JSON, as in sd-scripts)."""
    import dataclasses

    data = dataclasses.asdict(cfg)
    for private in ("source_path", "source_text"):
        data.pop(private, None)
    return data


def tag_frequency(sources) -> dict[str, dict[str, int]]:
    """sd-scripts' `ss_tag_frequency`: {dataset folder: {tag: count}} over the raw `.txt` captions."""
    from anima_train.captions import read_caption_file, split_tags

    freq: dict[str, dict[str, int]] = {}
    for src in sources:
        txt = Path(f"{src.stem}.txt")
        if not txt.is_file():
            continue
        counts = freq.setdefault(txt.parent.name, {})
        for tag in split_tags(read_caption_file(txt), ","):
            counts[tag] = counts.get(tag, 0) + 1
    return freq


def _trainable_state(models) -> dict[str, torch.Tensor]:
    out = {}
    for i, model in enumerate(models):
        for name, p in model.named_parameters():
            if p.requires_grad:
                t = p.detach()
                if type(t).__name__ == "SDNQTensor":  # quantized master weights (quant.mode = "training")
                    t = t.dequantize()
                out[f"{i}/{name}"] = t.to("cpu").contiguous()
    return out


def _save_state(state_dir: Path, accelerator, trainable, optimizer, scheduler, gens, info: dict,
                losses: dict | None = None) -> None:
    """`<stem>-state/`: state.json + accelerator/ {trainable weights, optimizer, scheduler, per-rank RNG}, and
    losses.json (every step's loss so far: the plot of a resumed run covers the whole run).

    Only the trainable tensors are stored (a LoRA run's state is megabytes, not the 4 GB base). Every file is
    safetensors or a `torch.save` of plain tensors/numbers that `torch.load(weights_only=True)` reads back."""
    import shutil

    from safetensors.torch import save_file

    tmp = state_dir.with_name(f".{state_dir.name}.tmp")
    acc = ckpt.ACCELERATOR_DIR

    def write(name: str, save) -> None:  # a failure names the file a user knows, not the temp one
        with ckpt.writing(state_dir / name, state_dir.parent, f"The state {state_dir.name}"):
            save(tmp / name)

    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / acc).mkdir(parents=True)
        accelerator.wait_for_everyone()
        write(f"{acc}/rng_rank{accelerator.process_index}.safetensors",
              lambda p: save_file({name: g.get_state() for name, g in gens.items()}, str(p)))
        if accelerator.is_main_process:
            unwrapped = [accelerator.unwrap_model(m) for m in trainable]
            write(f"{acc}/{ckpt.TRAINABLE_FILE}", lambda p: save_file(_trainable_state(unwrapped), str(p)))
            write(f"{acc}/optimizer.pt", lambda p: torch.save(optimizer.state_dict(), p))
            write(f"{acc}/scheduler.pt", lambda p: torch.save(scheduler.state_dict(), p))
            if losses is not None:
                write(ckpt.LOSSES_FILE, lambda p: write_text(p, json.dumps(losses) + "\n"))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write(ckpt.STATE_FILE,
                  lambda p: ckpt.write_json_atomic(p, {**info, "processes": accelerator.num_processes}))
            publish_dir(tmp, state_dir)
    except BaseException:
        if accelerator.is_main_process:  # a half-written state is of no use: leave no hidden temp dir behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()


def _load_state(state_dir: Path, trainable, optimizer, scheduler, gens, accelerator, *,
                batches_per_epoch: int) -> tuple[int, int, int]:
    from safetensors.torch import load_file

    info = ckpt.read_state(state_dir)
    ckpt.check_position(state_dir, info, batches_per_epoch)
    if info.get("processes", 1) != accelerator.num_processes:
        raise ckpt.ResumeError(
            f"{state_dir} was saved by {info.get('processes')} process(es), this run has {accelerator.num_processes}: "
            f"resume with the same number of processes")
    inner = state_dir / ckpt.ACCELERATOR_DIR
    with ckpt.load_state_file(inner / ckpt.TRAINABLE_FILE):
        weights = load_file(str(inner / ckpt.TRAINABLE_FILE))
    for i, model in enumerate(accelerator.unwrap_model(m) for m in trainable):
        own = {n: p for n, p in model.named_parameters() if p.requires_grad}
        expected = {f"{i}/{n}" for n in own}
        have = {k for k in weights if k.startswith(f"{i}/")}
        if expected != have:
            raise ckpt.ResumeError(f"{state_dir}: its trainable tensors do not match this run's "
                                   f"({len(have)} saved vs {len(expected)} here); was the adapter config changed?")
        for n, p in own.items():  # a state from before state.json described its adapter: shapes, by tensor
            saved = weights[f"{i}/{n}"]
            if saved.shape != p.shape:
                raise ckpt.ResumeError(
                    f"{state_dir}: its tensor {n} is {list(saved.shape)}, this run's is {list(p.shape)}: the [adapter] "
                    f"settings (rank, kind, components) differ from the run that saved it; set them back to resume "
                    f"it, or start a new run")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(weights[f"{i}/{n}"])
    with ckpt.load_state_file(inner / "optimizer.pt"):
        optimizer_state = torch.load(inner / "optimizer.pt", weights_only=True, map_location="cpu")
    with ckpt.load_state_file(inner / "scheduler.pt"):
        scheduler_state = torch.load(inner / "scheduler.pt", weights_only=True)
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(scheduler_state)
    rng = inner / f"rng_rank{accelerator.process_index}.safetensors"
    with ckpt.load_state_file(rng):
        rng_states = load_file(str(rng))
    for name, state in rng_states.items():
        gens[name].set_state(state)
    return int(info["global_step"]), int(info["epoch"]), int(info.get("batch_in_epoch", 0))
