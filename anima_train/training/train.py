"""One training run, top to bottom (the `anima-train train` command, its arguments and config gate, is
training/train_command.py).

`_train` sets the run up (refusals, data, model, optimizer, resume), `_loop` is the loop, `_step` one optimizer
step's micro-batch; saving (training/saving.py), the resume state (outputs/resume_state.py), stop requests
(training/stopping.py), the step's numbers (training/readout.py) and the divergence checks (training/divergence.py)
are behind named calls.

Flow matching (docs/model.md#flow-matching): x_t = (1−t)·x0 + t·ε, the DiT predicts v = ε − x0 from (x_t, t,
context). Latents come from the cache (or the VAE under `source = "encode"`); captions are rebuilt and encoded on
every step because tag shuffling and dropout change them per epoch. Accelerate runs it on one or many processes; it
is constructed with `mixed_precision="no"` because precision is `train.dtype` and nothing else (autocast breaks
SDNQ's backward).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import traceback
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader

from anima_train import errors
from anima_train.config import Config, copy_config_verbatim
from anima_train.data.batches import EpochKeys, steps_per_epoch
from anima_train.data.dataset import build_training_data, collate, encode_latents
from anima_train.data.texture import check_batch_phase, refuse_multi_process
from anima_train.model import fp8_base
from anima_train.model.components import DTYPES
from anima_train.model.prompts import encode_prompts
from anima_train.outputs import guard, manifest, resume_state, run_folder, tracking
from anima_train.outputs.checkpoint_files import tag_frequency
from anima_train.outputs.layout import LOSS_PLOT_NAME
from anima_train.outputs.plot import plot_losses
from anima_train.outputs.progress import Progress, StepStats
from anima_train.system import windows
from anima_train.training import honoured, optimizers, preflight, readout, recompute, saving, swap_plan
from anima_train.training.divergence import GradNorms, diverged, grad_norm
from anima_train.training.flow import (LOSS_TERMS, active_phase, flow_loss, noisy_latents, ot_pair_noise,
                                       phase_summary, sample_timesteps)
from anima_train.training.compiling import CompileDecision, compile_transformer, decide_compile
from anima_train.training.encode_ahead import ENCODED_KEY, encoded_ahead
from anima_train.training.memory import plan_checkpointing, qwen_for_encode, relieve, use_expandable_segments
from anima_train.training.previews import Previewer
from anima_train.training.models import Model, build_model, prepare
from anima_train.training.run_state import Run, TrainResult, recording
from anima_train.system.device import to_device
from anima_train.training.schedules import build_scheduler
from anima_train.training.stopping import StopRequests, with_resume_line
from anima_train.training.validation import Validation, ValidationSet, validation_items


def _precision_note() -> str | None:
    asked = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if asked and asked != "no":
        return (f"note: the environment asks for mixed precision {asked!r} (accelerate config or launch flag); "
                f"ignored — precision is [train] dtype")
    return None


def train(cfg: Config, *, dry_run: bool = False, no_save: bool = False, events: str | None = None,
          skip_unreadable: bool = False, cpu: bool = False, stop_file: str | None = None,
          overwrite: bool = False, allow_missing_captions: bool = False) -> TrainResult:
    # several processes on Windows: refused before accelerate starts (anima_train/system/windows.py says why)
    windows.refuse_multi_gpu(windows.launcher_processes())
    # batches come from pinned memory (the DataLoader's pin_memory on CUDA) and are copied without a host sync
    accelerator = Accelerator(mixed_precision="no", cpu=cpu,
                              dataloader_config=DataLoaderConfiguration(non_blocking=True),
                              gradient_accumulation_steps=cfg.train.gradient_accumulation_steps,
                              **tracking.accelerator_kwargs(cfg, Path(cfg.train.output_dir) / cfg.run_stem))
    progress = Progress(cfg.train.progress, 1, enabled=accelerator.is_main_process,
                        events=guard.checked_events(events, cfg))
    windows.install_console_handler()  # Windows: closing the console saves like a stop file (no-op elsewhere)
    try:
        with contextlib.ExitStack() as cleanup:
            return _train(cfg, accelerator, progress, dry_run=dry_run, no_save=no_save,
                          skip_unreadable=skip_unreadable, stop_file=stop_file, overwrite=overwrite,
                          allow_missing_captions=allow_missing_captions, cleanup=cleanup)
    except BaseException as exc:
        user = errors.user_message(exc := with_resume_line(exc, cfg))  # a user error, an interrupt: the message alone
        progress.event("error", message=user or f"{type(exc).__name__}: {exc}",
                       traceback="" if user else traceback.format_exc())
        raise exc
    finally:
        progress.close()
        windows.training_finished()  # a console close handler waiting for the save may let the process end


def _train(cfg: Config, accelerator, progress: Progress, *, dry_run: bool, no_save: bool,
           skip_unreadable: bool, stop_file: str | None = None, overwrite: bool = False,
           allow_missing_captions: bool = False, cleanup: contextlib.ExitStack) -> TrainResult:
    t_start = time.perf_counter()
    say = progress.message
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    dtype = DTYPES[cfg.train.dtype]
    run_dir = Path(cfg.train.output_dir) / cfg.run_stem

    # -- setup: refuse what cannot work, then data, model, optimizer, accelerator ---------------------------------
    state_dir, claim = _refuse_early(cfg, accelerator, run_dir, say, dry_run=dry_run, no_save=no_save,
                                     stop_file=stop_file, overwrite=overwrite, cleanup=cleanup)
    data = _scan_dataset(cfg, progress, state_dir, skip_unreadable=skip_unreadable,
                         allow_missing_captions=allow_missing_captions)
    held_out = validation_items(cfg, data, cfg.train.model_path) if cfg.validation.enabled else []
    accum = cfg.train.gradient_accumulation_steps
    per_epoch = steps_per_epoch(len(data.sampler), world, accum)
    for text in honoured.report(cfg, data, per_epoch):
        progress.warning(text)  # before the model loads: on the node before the run starts
    total = 1 if dry_run else _total_steps(cfg, per_epoch)
    compiling = _decide_compile(cfg, device, total, progress)  # before the model loads: a refusal costs nothing
    progress.event("status", message="loading model")
    if use_expandable_segments(device):  # before the weights load: they are the first segments
        say("speed    CUDA allocator: expandable segments")
    # Every rank builds the same adapters (peft's initialisation draws from the global RNG): DDP broadcasts rank 0's
    # parameters when it wraps the model, but the fp32 masters are made from each rank's own before that, and a
    # bf16 run on two GPUs trained a different adapter on each rank (tests/test_ddp.py). Then each rank its own seed.
    torch.manual_seed(cfg.train.seed)
    compiled = compiling.mode is not None
    whole_trunk_compiled = compiled and not cfg.train.compile_regional
    static_plan = swap_plan.static_plan(cfg, device, largest_tokens=data.sampler.largest_batch_tokens(),
                                        compiled=compiled, whole_trunk_compiled=whole_trunk_compiled)
    swap_blocks = swap_plan.blocks_to_swap(  # before the weights load: on a small card they would not all fit
        cfg, static_plan, whole_trunk_compiled=whole_trunk_compiled, say=say, warn=progress.warning)
    model = build_model(cfg, data, device, dtype, say, swap_blocks)
    gens = _seed(cfg.train.seed + rank, device)

    optimizer = optimizers.build_optimizer(model.groups, cfg.optimizer,
                                           compiled=compiled and device.type == "cuda")
    loader = _loader(cfg, data, device)
    scheduler = build_scheduler(optimizer, cfg.schedule, total, num_processes=world)
    data.set_run(total, per_epoch, world, accum)  # the sampler places texture phases by the same progress
    _compile_when_it_pays(cfg, model, compiling, say)
    if model.block_ckpt.measure is not None and model.block_ckpt.in_graph is not None:
        model.block_ckpt.measure.in_graph = static_plan is not None and static_plan.in_graph
    trainable, optimizer, loader, scheduler = prepare(accelerator, model, optimizer, loader, scheduler)
    _say_steps(say, cfg, per_epoch, batches=len(data.sampler), world=world, accum=accum)

    # -- resume ---------------------------------------------------------------------------------------------
    global_step, start_epoch, skip_batches = 0, 0, 0
    if state_dir is not None:
        global_step, start_epoch, skip_batches = resume_state.load_state(
            state_dir, trainable, optimizer, scheduler, gens, accelerator, batches_per_epoch=len(loader))
        if global_step >= total and not dry_run:  # the exact total is known only now (data, processes)
            raise resume_state.finished_error(state_dir, global_step, total, cfg.train.max_steps, cfg.train.epochs)
        say(f"resumed from {state_dir} at step {global_step} (epoch {start_epoch + 1}, batch {skip_batches})")
    start_step = global_step

    progress.set_total(total, start_step=global_step)
    first_loss_step, earlier_losses = resume_state.read_losses(state_dir, start_step)  # before a resume: the whole run
    progress.event("start", total=total, steps_per_epoch=per_epoch, processes=world, run_dir=str(run_dir),
                   epochs=-(-total // per_epoch), resumed_step=global_step, device=device.type,  # max_steps may cut
                   first_loss_step=first_loss_step, losses=earlier_losses)  # a resumed chart: the whole run
    if accelerator.is_main_process and not no_save:
        run_dir.mkdir(parents=True, exist_ok=True)
        copy_config_verbatim(cfg, manifest.output(run_dir, f"{cfg.run_stem}.toml"))

    result = TrainResult(run_dir=run_dir, final=None, global_step=global_step, total_steps=total,
                         batches_seen=[] if recording() else None,
                         tag_frequency=tag_frequency(data.sources) if accelerator.is_main_process else {})
    tracker = tracking.Tracker(accelerator, cfg, run_dir, resumed_step=start_step)
    cleanup.callback(tracker.close)
    run = Run(cfg=cfg, accelerator=accelerator, progress=progress, parts=model.parts, result=result,
              run_dir=run_dir, per_epoch=per_epoch, trainable=trainable, optimizer=optimizer, scheduler=scheduler,
              gens=gens, claim=claim, grad_norms=GradNorms(cfg, run_dir, result.saved, logged=tracker.on),
              inputs=resume_state.run_inputs(cfg, data))
    run.first_loss_step, run.earlier_losses = first_loss_step, earlier_losses  # the plot's and the next state's
    previews = Previewer(
        cfg, accelerator, progress, run_dir, parts=model.parts, device=device, dtype=dtype, parked=model.parked,
        models=lambda: tuple(accelerator.unwrap_model(m) for m in (model.transformer, model.conditioner,
                                                                   model.text_encoder)),
        keep_vae_on_device=model.vae is not None, enabled=not dry_run, on_images=tracker.images)

    validation = _validation(cfg, model, held_out, progress, tracker, enabled=not dry_run)
    epoch, batch_index = _loop(run, model, data, loader, tracker, previews, validation, StopRequests(stop_file),
                               start_epoch=start_epoch, skip_batches=skip_batches, no_save=no_save)

    # -- the end: last previews, final checkpoint, loss plot ---------------------------------------------------
    run.grad_norms.check()  # the last step's gradient, before anything shows or saves its weights
    run.grad_norms.log(tracker)
    if not result.stopped:
        previews.at_end(result.global_step)
    if validation is not None:
        if not result.stopped:  # a stop saves and exits at once, as the previews do
            validation.at_end(result.global_step)
        result.validation = validation.points
    if not no_save and not cfg.train.skip_final_save and not result.stopped:
        epoch_finished = batch_index >= len(loader)  # then a resume starts at the next epoch's first batch
        result.final = saving.save(run, epoch=epoch + (1 if epoch_finished else 0),
                                   batch_index=0 if epoch_finished else batch_index, final=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and not no_save and result.losses:
        plot_losses(run.earlier_losses + result.losses, manifest.output(run_dir, LOSS_PLOT_NAME),
                    title=f"training loss: {cfg.run_stem}", first_step=run.first_loss_step,
                    validation=[(p.step, p.loss) for p in result.validation])
    if model.parked is not None:
        model.parked.restore()  # in-process callers (eval, demo) get a normal model back
    if model.swap is not None:
        model.swap.restore()
    if recording():  # tests compare runs by it; a production run skips the copy of every trained tensor
        result.trainable_digest = resume_state.digest(accelerator.unwrap_model(m) for m in trainable)
    result.components = model.parts
    for line in validation.summary(run.earlier_losses + result.losses) if validation is not None else ():
        (progress.warning if line.startswith("warning:") else progress.message)(line.removeprefix("warning: "))
    _report_done(progress, result, start_step=start_step, total=total, t_start=t_start)
    # every rank tears the process group down together: a rank that leaves while the main one is still plotting has
    # been seen to abort the other at exit (gloo, "terminate called without an active exception", exit -6)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result


# -- the loop ---------------------------------------------------------------------------------------------------

def _loop(run: Run, model: Model, data, loader, tracker, previews: Previewer, validation: Validation | None,
          stops: StopRequests, *, start_epoch: int, skip_batches: int, no_save: bool) -> tuple[int, int]:
    """For epoch, for batch: a micro-step; after each optimizer step: the memory plan, the checks, the report, the
    previews and validation, then stop, save or go on. Returns the epoch (0-based) and its batches done where it
    ended."""
    cfg, accelerator, result, say = run.cfg, run.accelerator, run.result, run.progress.message
    world, total = accelerator.num_processes, result.total_steps
    totals = readout.StepTotals()
    # the model's own tensors (their gradients exist at clip time); the optimizer may hold fp32 masters instead
    params = [p for g in model.groups for p in g["params"]]
    epoch, batch_index = start_epoch, skip_batches
    if result.global_step < total:
        previews.before_training(result.global_step)
        if validation is not None:
            validation.before_training(result.global_step)
    while result.global_step < total and epoch < cfg.train.epochs:
        batches = accelerator.skip_first_batches(loader, skip_batches) if skip_batches else loader
        # Accelerate's loader re-applies its own iteration counter to the sampler/dataset when iterated, so it
        # must be told the epoch too (a resumed run's first full pass is the loader's iteration 0, not epoch N).
        batches.set_epoch(epoch)
        data.sampler.set_epoch(epoch)
        data.dataset.set_epoch(epoch)
        batch_index, skip_batches = skip_batches, 0  # batches of this epoch done (a resume skips some)
        for batch in encoded_ahead(batches, model):
            batch_index += 1
            result.saw(batch["index"])
            # curriculum: the last phase with at <= progress (absent: None, and nothing below changes)
            phase = active_phase(cfg.curriculum, result.global_step / total) if cfg.curriculum else None
            check_batch_phase(batch, phase)
            step_readout, lrs = _step(run, model, params, batch, phase, totals, stops)
            if step_readout is None:  # gradients accumulate: not an optimizer step yet
                continue

            # -- one optimizer step done: plan memory, check it, report it, then stop, save or go on -------------
            result.global_step = step = result.global_step + 1
            if model.block_ckpt.measure is not None:  # checkpoint_blocks = "auto": the first step measured; decide
                # with its outputs cached Qwen3 never needs the GPU's room: it stays parked
                plan_checkpointing(model.block_ckpt, data.sampler.largest_batch_tokens(),
                                   model.parked if model.text_cache is None else None, model.device, say)
            elif model.block_ckpt.retries is not None:  # after the plan: a step that stalled the allocator
                relieve(model.block_ckpt, model.parked, model.device, say)
            run.grad_norms.check(before=step)  # the earlier steps' norms: ready, reading them costs no wait
            stats, stop_votes, peaks = readout.receive(step_readout, accelerator)
            if not math.isfinite(stats["loss"]):
                raise diverged(cfg, run.run_dir, result.saved, step, f"the loss is {stats['loss']}", model=model)
            result.losses.append(stats["loss"])
            _report_step(run, model, tracker, stats, step=step, epoch=epoch, lrs=lrs, phase=phase, peaks=peaks,
                         images=totals.images * world)
            totals.images = 0
            previews.after_step(step)
            if validation is not None:
                validation.after_step(step, total)
            if step >= total:
                return epoch, batch_index
            if stops.agreed(stop_votes, world):
                say(f"stop requested ({stops.reason()}): saving step {step} and exiting")
                result.stopped = True
                if not no_save:  # a stop is not a finished run: keep what resuming needs unless opted out
                    saving.save(run, epoch=epoch, batch_index=batch_index, step=step,
                                with_state=cfg.train.save_state_on_stop)
                return epoch, batch_index
            if saving.every_steps_due(cfg, step) and not no_save:
                saving.save(run, epoch=epoch, batch_index=batch_index, step=step)
        epoch += 1
        previews.after_epoch(epoch, result.global_step)
        if validation is not None:
            validation.after_epoch(epoch, result.global_step, total)
        if saving.every_epochs_due(cfg, epoch) and not no_save:
            saving.save(run, epoch=epoch, batch_index=0, epoch_tag=epoch)
    return epoch, batch_index


def _step(run: Run, model: Model, params: list, batch: dict, phase, totals: readout.StepTotals,
          stops: StopRequests):
    """One micro-batch: forward, backward and, when the gradients are complete, clip and the optimizer step.
    Returns the step's readout (on its way to the host) and the learning rates it used, or (None, None) while the
    gradients still accumulate."""
    cfg, accelerator = run.cfg, run.accelerator
    step_readout = None
    totals.images += len(batch["index"])
    with accelerator.accumulate(*run.trainable):
        loss, loss_parts = _flow_matching_loss(cfg, model, run.gens, batch, phase)
        totals.add(loss, loss_parts)
        if accelerator.sync_gradients:  # on its way to the host while the backward runs (memory.HostCopy)
            step_readout = readout.send(accelerator, totals.names, totals.mean(), stop_vote=stops.vote())
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            norm = (accelerator.clip_grad_norm_(params, cfg.optimizer.max_grad_norm)
                    if cfg.optimizer.max_grad_norm > 0 else grad_norm(params))
            run.grad_norms.add(run.result.global_step + 1, norm)  # pre-clip; checked to be finite one step late
        if phase is not None:  # absolute each time, never compounded: scheduler LR x the phase's lr_mul
            for group, lr in zip(run.optimizer.param_groups, run.scheduler.get_last_lr()):
                group["lr"] = lr * phase.lr_mul
        used_lrs = [group["lr"] for group in run.optimizer.param_groups]  # what this step really used
        if accelerator.sync_gradients and model.block_ckpt.measure is not None:
            model.block_ckpt.measure.before_optimizer_step(accelerator.device)  # "auto": the backward's own peak
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
    return (step_readout, used_lrs) if step_readout is not None else (None, None)


def _report_step(run: Run, model: Model, tracker, stats: dict[str, float], *, step: int, epoch: int, lrs: list[float],
                 phase, peaks: list[float], images: int) -> None:
    """The optimizer step's numbers to the progress bar / events, and to TensorBoard."""
    cfg = run.cfg
    step_stats = _step_stats(cfg, stats, step=step, epoch=epoch, lrs=lrs, phase=phase, peak_gb=peaks)
    run.progress.step(step_stats, report=step % cfg.train.log_every == 0 or step == run.result.total_steps)
    tracker.step(step_stats, group_names=[g["name"] for g in model.groups], images=images)
    run.grad_norms.log(tracker, before=step)  # the previous step's (reading this one would wait)


# -- setup ------------------------------------------------------------------------------------------------------

def _validation(cfg: Config, model: Model, held_out: list, progress: Progress, tracker, *,
                enabled: bool) -> Validation | None:
    """`[validation]`: the held-out images' latents and fixed captions, and what evaluates and reports them (None:
    validation off, or a dry run)."""
    if not cfg.validation.enabled or not enabled:
        return None
    progress.event("status", message="loading the validation set")
    vset = ValidationSet.build(cfg, held_out, vae=lambda: model.parts.vae)
    v = cfg.validation
    if v.folder:
        progress.message(f"validation: {len(vset.names)} image(s) from {v.folder}, timesteps {list(v.timesteps)}: "
                         + ", ".join(vset.names))
    else:  # the dataset's report named the held-out images already (build_training_data)
        progress.message(f"validation: the {len(vset.names)} held-out image(s) above, timesteps {list(v.timesteps)}")
    return Validation(cfg, vset, model.parts, progress=progress, tracker=tracker, parked=model.parked,
                      text_cache=model.text_cache, block_ckpt=model.block_ckpt)


def _refuse_early(cfg: Config, accelerator, run_dir: Path, say, *, dry_run: bool, no_save: bool,
                  stop_file: str | None, overwrite: bool,
                  cleanup: contextlib.ExitStack) -> tuple[Path | None, run_folder.Claim]:
    """The checks that need no model, and the claim on the run folder. Returns the state folder a resume starts
    from (None: a fresh run) and the claim (run_folder.Claim: told when the first checkpoint is saved)."""
    # texture phases: one process unless allow_multi_gpu_texture (docs/training.md#several-processes)
    refuse_multi_process(cfg, accelerator.num_processes)
    if note := _precision_note():
        say(note)
    # a model, dataset, output folder or resume that cannot work must fail before minutes of model loading (a resume:
    # its state.json, the adapter it was trained with, and no newer state of its run that it would overwrite)
    preflight.check_run_paths(cfg, saving=not no_save)
    if cfg.train.base_matmul == "fp8" and (why := fp8_base.fp8_available(accelerator.device)):
        raise errors.UserError(f'[train] base_matmul = "fp8": {why}; set base_matmul = "bf16"')
    state_dir = resume_state.resolve_resume(cfg.train.resume_from) if cfg.train.resume_from else None
    if state_dir is not None and not dry_run:
        resume_state.refuse_finished(state_dir, cfg.train.max_steps, cfg.train.epochs)
    # ... and so must a run that would replace another run's files, share its folder, or stop at once
    claim = cleanup.enter_context(run_folder.claim_run(run_dir, cfg.run_stem, accelerator, resume_state=state_dir,
                                                 overwrite=overwrite, stop_file=stop_file, saving=not no_save,
                                                 say=say, reads=guard.run_reads(cfg)))
    return state_dir, claim


def _scan_dataset(cfg: Config, progress: Progress, state_dir, *, skip_unreadable: bool, allow_missing_captions: bool):
    progress.event("status", message="scanning dataset")
    data = build_training_data(cfg, cfg.train.model_path, skip_unreadable=skip_unreadable,
                               allow_missing_captions=allow_missing_captions)
    for line in data.report:
        progress.message(line)
    for text in data.warnings + resume_state.inputs_changed(state_dir, data):  # said before the model loads
        progress.warning(text)
    return data


def _seed(seed: int, device: torch.device) -> dict[str, torch.Generator]:
    """Every random stream has its own generator; ranks differ by their index (docs/training.md#precision-and-seeds).
    The global seed covers the rest (peft's adapter initialisation, LoRA dropout)."""
    torch.manual_seed(seed)
    return {"noise": torch.Generator(device=device).manual_seed(seed),  # ε, on the device
            "timestep": torch.Generator().manual_seed(seed)}  # t, on the CPU (tiny draws)


def _total_steps(cfg: Config, per_epoch: int) -> int:
    """The run's horizon: max_steps is the horizon and a hard stop, but the epochs still bound the loop
    (docs/training.md#several-processes)."""
    epochs_total = per_epoch * cfg.train.epochs
    return min(cfg.train.max_steps, epochs_total) if cfg.train.max_steps else epochs_total


def _decide_compile(cfg: Config, device: torch.device, total: int, progress: Progress) -> CompileDecision:
    """Whether to torch.compile (compiling.decide_compile: a probe that really compiles on this device, when compiling
    is wanted). A failure under compile = "auto" is one warning line (the log, the node) and an eager run; an
    explicitly asked mode that cannot work is a UserError here, before the model loads."""
    decision = decide_compile(cfg, device, total)
    if decision.warning:
        progress.warning(decision.warning)
    elif decision.probes:
        progress.message(f"probed {' and '.join(decision.probes)} on {device.type}: works"
                         + (f"; compiled kernels kept in {decision.cache_dir}" if decision.cache_dir else ""))
    return decision


def _loader(cfg: Config, data, device: torch.device):
    """The training DataLoader. Its worker processes persist across epochs (on Windows each one is a spawned
    process that imports torch again: seconds per worker and epoch otherwise); a worker keeps its own copy of the
    dataset, so each sample key carries its epoch (batches.EpochKeys) and the captions are still drawn per epoch."""
    workers = cfg.train.num_workers
    return DataLoader(data.dataset, batch_sampler=EpochKeys(data.sampler), collate_fn=collate,
                      num_workers=workers, persistent_workers=workers > 0, pin_memory=device.type == "cuda")


def _compile_when_it_pays(cfg: Config, model: Model, decision: CompileDecision, say) -> None:
    """torch.compile the DiT when decided (compile = "auto": on CUDA, for a run long enough, when the probe
    compiled), then say how the step is sped up."""
    compile_mode = decision.mode
    if compile_mode:
        compile_transformer(model.transformer, cfg, compile_mode)
        model.block_ckpt.uniform_inputs = True
        if recompute.in_graph_applies(cfg.train, compiled=True):
            model.block_ckpt.in_graph = recompute.in_graph_recompute(compile_mode, cfg.train.compile_dynamic)
    n_blocks = len(model.block_ckpt.blocks)
    ckpt_text = ("auto (decided after the first step)" if model.recompute is None
                 else f"{model.block_ckpt.recomputed} of {n_blocks} blocks")  # with the swapped ones
    how = " (recompute inside the compiled graph)" if model.block_ckpt.in_graph is not None else ""
    say(f"speed    compile {compile_mode or 'off'} (compile = {cfg.train.compile}); checkpointing {ckpt_text}{how}")


def _say_steps(say, cfg: Config, per_epoch: int, *, batches: int, world: int, accum: int) -> None:
    say(f"steps    {per_epoch}/epoch x {cfg.train.epochs} epoch(s) = {per_epoch * cfg.train.epochs}"
        + (f", capped at max_steps {cfg.train.max_steps}" if cfg.train.max_steps else "")
        + f"  (batches {batches}, processes {world}, accumulation {accum})")
    if world > 1:
        say(f"note: {world} processes share each epoch's batches, so an epoch has {world}x fewer optimizer steps "
            f"than on one process")



# -- one micro-batch ------------------------------------------------------------------------------------------

def _flow_matching_loss(cfg: Config, model: Model, gens: dict, batch: dict, phase) -> tuple[torch.Tensor, dict]:
    """One micro-batch: x_t = (1−t)·x0 + t·ε, the DiT predicts v = ε − x0 from (x_t, t, caption). Returns the
    loss and its named parts for the report: flow_loss's terms, and "ot" (the OT pairing's moved fraction)."""
    device, dtype, parts, block_ckpt, parked = model.device, model.dtype, model.parts, model.block_ckpt, model.parked
    if model.vae is not None:  # source = "encode": the VAE runs here, without autograd
        chunk = cfg.train.vae_encode_chunk  # images per VAE forward: bounds the encode's share of the peak
        x0 = torch.cat([encode_latents(model.vae, px) for px in batch["pixels"].split(chunk)]).to(device, dtype)
    else:
        x0 = batch["latents"].to(device, dtype)
    b, _, _, h, w = x0.shape
    if block_ckpt.measure is not None:
        block_ckpt.measure.saw(b * (h // 2) * (w // 2), device)  # tokens x batch, and memory before the step
    noise = torch.randn(x0.shape, generator=gens["noise"], device=device, dtype=torch.float32).to(dtype)
    moved = None
    if cfg.flow.use_ot:  # pair each latent with its most similar noise row (per micro-batch)
        noise, moved = ot_pair_noise(x0, noise)
    t = to_device(sample_timesteps(b, cfg.flow, gens["timestep"], latent_hw=(h, w), phase=phase), device)
    x_t = noisy_latents(x0, noise, t)
    encoded = batch.get(ENCODED_KEY)  # Qwen3's output, when it was encoded ahead (encode_ahead.py)
    with qwen_for_encode(parked if encoded is None else None, model.text_cache):
        context = encode_prompts(batch["caption"], tokenizer=parts.tokenizer, t5_tokenizer=parts.t5_tokenizer,
                                 text_encoder=model.text_encoder, conditioner=model.conditioner, device=device,
                                 train_text_encoder=model.train_text_encoder, cached=model.text_cache,
                                 encoded=encoded)
    pred = model.transformer(x_t, timestep=t.to(dtype), encoder_hidden_states=context.to(dtype),
                             padding_mask=x_t.new_zeros(1, 1, 8 * h, 8 * w), return_dict=False)[0]
    mask = to_device(batch["loss_mask"], device) if "loss_mask" in batch else None  # texture crops only
    loss, loss_parts = flow_loss(pred, x0, noise, x_t, t, hf_scale=cfg.flow.hf_scale,
                                 hf_exponent=cfg.flow.hf_exponent, mask=mask)
    if moved is not None:
        loss_parts["ot"] = moved
    return loss, loss_parts


def _step_stats(cfg: Config, stats: dict[str, float], *, step: int, epoch: int, lrs: list[float], phase,
                peak_gb: list[float]) -> StepStats:
    """The optimizer step's report from its mean-over-ranks named values: the loss, its terms by name (each
    flow.LOSS_TERMS name; None unless the step has two or more terms: one term is the loss) and the OT pairing's
    moved fraction (None without use_ot)."""
    terms = {name: stats.get(name) for name in LOSS_TERMS}
    if sum(value is not None for value in terms.values()) < 2:
        terms = dict.fromkeys(LOSS_TERMS)
    return StepStats(step=step, epoch=epoch + 1, loss=stats["loss"], terms=terms, ot=stats.get("ot"),
                     lrs=lrs, peak_gb=peak_gb, phase=phase_summary(cfg.curriculum, phase))


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
