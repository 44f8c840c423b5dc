"""Training nodes: Training config -> Train -> Load trained LoRA, plus a prompt encoder for sampling.

* Anima: Training config — the common knobs of `anima_train.config` as widgets (type, default, help, choices and
  bounds read from the dataclass field metadata: the config module stays the single source of truth) plus a TOML
  text box for every other key. The result is validated by `parse_config` (the CLI's gate) in `validate_inputs`,
  so a bad value is shown on the node before anything runs. Output: ANIMA_TRAIN_CONFIG {toml, digest}.
* Anima: Train — runs `python -m anima_train train` (or accelerate's launcher for 2+ GPUs) in a worker process
  (nodes/worker.py), relays its events to the progress bar and to the `anima_train.progress` websocket event,
  copies the result where the stock LoraLoader lists it, and re-uses a finished run whose inputs are unchanged.
* Anima: Load trained LoRA — ComfyUI's own LoRA loading (what LoraLoader does) from a path or the loras folder.
* Anima: Encode prompt (trainer) — Qwen3 + both tokenizers of the diffusers repo the trainer uses, returned as the
  CONDITIONING ComfyUI's Anima model consumes (`cross_attn` + `t5xxl_ids`/`t5xxl_weights`; ComfyUI runs the LLM
  adapter itself). Prompts are encoded exactly as in training, and it works with any converted repo — including
  the tiny test models, whose Qwen3 ComfyUI's fixed-size text encoder cannot load.

This file is the nodes' schemas and `execute`; what they run on is library code beside it: training_config.py
(the widgets and the config they make), queue_memo.py (one queue's results), relay.py (worker events to ComfyUI),
run_picking.py (which run folder a job uses), train_outcome.py (the result, its texts, a Cancel's record) and
text_encoding.py (the Qwen3 path of the prompt encoder).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from anchor.atomic import write_text
from anima_train import adapters
import anima_train.config as anima_config  # called through the module: tests count parse_config's calls
from anima_train.config import ConfigError
from anima_train.data.texture import refuse_multi_process
from anima_train.system.windows import refuse_multi_gpu

from . import comfy
from . import fixes
from . import paths
from . import queue_memo
from . import run_records
from . import train_outcome
from . import worker
from .comfy import CATEGORY, io
from .relay import Relay
from .run_picking import JOB_CONFIG_NAME, pick_run
from .text_encoding import encode_conditioning
from .training_config import EXTRA_TOML, KNOBS, LATE_KNOBS, build_config, knob_input, model_and_data_digest

CONFIG_TYPE = "ANIMA_TRAIN_CONFIG"
ConfigType = io.Custom(CONFIG_TYPE)
# Cancel: the worker stops after the step in progress and saves (checkpoint + resume state), then it is ended. It
# gets two of its slowest steps so far plus GRACE_SAVE_S for the save, never more than GRACE_MAX_S in all.
GRACE_SAVE_S = 60.0
GRACE_MAX_S = 900.0


def cancel_grace(slowest_step_s: float) -> float:
    return min(GRACE_MAX_S, GRACE_SAVE_S + 2.0 * max(0.0, slowest_step_s))


# ----------------------------------------------------------------------------------------------------------
# Training config: widgets generated from anima_train.config field metadata


class ConfigRefused(ValueError):
    """The Training config's problems, one message for the whole node (see AnimaTrainConfig.validate_inputs)."""


class AnimaTrainConfig(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="AnimaTrainConfig",
            display_name="Anima: Training config",
            category=CATEGORY,
            description="The training settings, checked by the same rules as `anima-train train`. The common keys "
                        "are widgets; any other key of the config (see the trainer's README) goes into extra_toml, "
                        "which overrides the widgets. Empty output_dir = ComfyUI's output/anima_train. Relative "
                        "paths are in ComfyUI's input (datasets), models (model_path) or output folder (the rest); "
                        "folders outside ComfyUI's must be allowed first (README: folders the nodes may use).",
            inputs=[knob_input(k) for k in KNOBS] + [
                io.String.Input(EXTRA_TOML, multiline=True, default="",
                                tooltip="more config keys as TOML, e.g.\n[dataset]\nresolutions = [768, 1024]\n"
                                        "[component_lr]\nadaln = 1e-5\nThey override the widgets.")]
            + [knob_input(k) for k in LATE_KNOBS],
            outputs=[ConfigType.Output(display_name="config")],
        )

    @classmethod
    @fixes.shown_on(fixes.TRAINING_CONFIG)
    def validate_inputs(cls, **values):
        # Raised, not returned: ComfyUI files a returned message once for every input the method receives (all of
        # this node's ~36: the Errors panel counted 36 identical entries), an exception once, against this node.
        try:
            build_config(values)
        except ConfigError as exc:  # several problems: one line each, the first one first (the popup shows it)
            extra = fixes.extra_keys(values.get(EXTRA_TOML))
            raise ConfigRefused("\n".join(fixes.render(e, fixes.TRAINING_CONFIG, extra) for e in exc.errors)) from None
        return True

    @classmethod
    def fingerprint_inputs(cls, **values):
        # The widgets decide the output, but so do the files: a changed dataset or model must reach Train.
        try:
            cfg, text = build_config(values)
            return run_records.result_key(toml=text, **model_and_data_digest(cfg))
        except Exception:  # noqa: BLE001 (execute reports the problem)
            return run_records.result_key(values=values)

    @classmethod
    @fixes.shown_on(fixes.TRAINING_CONFIG)
    def execute(cls, **values):
        cfg, text = build_config(values)
        return io.NodeOutput({"toml": text, "digest": hashlib.sha256(text.encode()).hexdigest(),
                              "run_dir": str(Path(cfg.train.output_dir) / cfg.run_stem)})


# ----------------------------------------------------------------------------------------------------------
# Train


# A run's first seconds are mostly Python's imports. After a run has ended the Train node starts the next run's
# process ahead (worker.start_standby); for the first run of a ComfyUI session the page asks for it when a Train node
# appears on the canvas (a training workflow opened or reloaded), so that its imports are done by the time the user
# has set the widgets and queued. js/anima_train.js holds the same path.
WORKER_AHEAD_ROUTE = "/anima_train/worker_ahead"


def start_worker_ahead() -> dict:
    """Start the next one-process run's worker now, in the environment the Train node gives its runs (kept if one of
    it waits already; none with ANIMA_TRAIN_STANDBY=0). {"waiting": whether one waits now}."""
    return {"waiting": worker.start_standby(worker.worker_env())}


def train_command(job_config: Path, stop_file: Path, gpus: int) -> list[str]:
    return worker.anima_train_command(["train", str(job_config), "--events", "-", "--stop-file", str(stop_file)],
                                      processes=gpus)


class AnimaTrainTrain(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="AnimaTrainTrain",
            display_name="Anima: Train",
            category=CATEGORY,
            description="Train in a separate worker process (ComfyUI's models are unloaded first; a crash or an "
                        "out-of-memory error ends only the worker). Progress and loss stream to the node; Cancel "
                        "asks the worker to save a checkpoint and stop, then ends its whole process tree. A run "
                        "whose config, dataset and model are unchanged is re-used, not trained again.",
            inputs=[
                ConfigType.Input("config"),
                io.Int.Input("gpus", default=1, min=1, max=64,
                             tooltip="processes (one per GPU); 2 or more run accelerate launch (DDP); Linux "
                                     "only (refused on Windows)"),
                io.Boolean.Input("copy_to_loras", default=True,
                                 tooltip="copy the result into models/loras/anima_train/ (full finetunes: "
                                         "models/diffusion_models/anima_train/) so the stock loaders list it; "
                                         "an existing file of another content is never replaced"),
            ],
            outputs=[io.String.Output(display_name="path"), io.Image.Output(display_name="loss_plot")],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    @fixes.shown_on(fixes.TRAIN)
    def execute(cls, config, gpus=1, copy_to_loras=True):
        refuse_multi_gpu(gpus)  # Windows: no tested multi-GPU path; before any worker or run folder exists
        hidden = getattr(cls, "hidden", None)
        node_id = str(getattr(hidden, "unique_id", None)) if getattr(hidden, "unique_id", None) is not None else None
        toml = config["toml"] if isinstance(config, dict) else str(config)
        cfg = queue_memo.queued("toml", toml)  # this queue's Training config node built it: confined and checked
        if cfg is None:
            toml = paths.confine_toml(toml, paths.current_policy())  # a posted graph may give any value here
            cfg = anima_config.parse_config(toml)
        refuse_multi_process(cfg, gpus)  # the trainer refuses it too, but only after accelerate launched the workers
        key = run_records.result_key(toml=toml, gpus=gpus, **model_and_data_digest(cfg))
        cfg, toml, run_dir, manifest, note, job_lock = pick_run(cfg, toml, key)
        try:
            return cls._run(cfg, toml, run_dir, manifest, note, key, gpus, copy_to_loras,
                            Relay(node_id, comfy.client_id(), comfy.prompt_id()))
        finally:
            if job_lock is not None:
                job_lock.release()

    @classmethod
    def _run(cls, cfg, toml, run_dir, manifest, note, key, gpus, copy_to_loras, relay):
        run_dir.mkdir(parents=True, exist_ok=True)
        if note:  # the chart keeps it on show through the run (the folder the run trains in, and why)
            relay.send({"event": "run_note", "text": note})
        if manifest is not None:
            final = Path(manifest["final"]["path"])
            losses = [float(x) for x in manifest.get("losses", [])]
            published = train_outcome.publish(final, cfg.adapter.kind, cfg.run_stem) if copy_to_loras else None
            relay.send({"event": "done", "step": manifest.get("steps"), "total": manifest.get("steps"),
                        "final": str(final), "reused": True, "losses": losses,  # the chart shows the run
                        "validation": manifest.get("validation_points", [])})
            image = train_outcome.loss_image(losses, run_dir)
            text = train_outcome.summary(cfg, final, published, manifest.get("steps"), 0, True,
                                         manifest.get("warnings", []), note, manifest.get("memory_plan", []),
                                         manifest.get("validation", []))
            return io.NodeOutput(str(final), image, ui={"text": [text]})

        comfy.free_vram()
        job_config = run_dir / JOB_CONFIG_NAME
        write_text(job_config, toml)
        # The trainer reads the stop file after each optimizer step: before the first one (model loading) there is
        # nothing to save, so a Cancel then ends the worker at once instead of waiting out the grace period.
        grace_now = lambda: cancel_grace(relay.slowest_step_s) if relay.steps_seen else 0.0  # noqa: E731
        stop_file = worker.job_stop_file(run_dir)
        try:
            result = worker.run_job(train_command(job_config, stop_file, gpus),
                                    log_path=run_dir / worker.LOG_NAME, on_event=relay,
                                    check_interrupt=comfy.throw_if_interrupted, env=worker.worker_env(),
                                    cwd=str(run_dir), stop_file=stop_file, grace_s=grace_now,
                                    on_stop_event=relay.after_stop, standby=gpus == 1)
        except BaseException:  # Cancel (ComfyUI's interrupt) or a failed callback: the worker has been stopped
            train_outcome.after_cancel(run_dir, key, relay)
            raise
        (run_dir / run_records.CANCELLED_NAME).unlink(missing_ok=True)  # this run is past its Cancel now
        worker.raise_for_failure(result, f"training {cfg.run_stem}")
        done = result.last("done") or {}
        if not done.get("final"):
            raise worker.WorkerError(f"training {cfg.run_stem} ended without a final checkpoint (skip_final_save "
                                     f"= true, or the worker stopped early); log: {result.log_path}")
        final = Path(done["final"])
        published = train_outcome.publish(final, cfg.adapter.kind, cfg.run_stem) if copy_to_loras else None
        run_records.write_manifest(run_dir, key, final, steps=done.get("step"), losses=relay.losses,
                              published=str(published) if published else None, warnings=relay.warnings,
                              memory_plan=relay.memory_plan, validation=relay.validation,
                              validation_points=relay.validation_points)
        image = train_outcome.loss_image(relay.losses, run_dir)
        text = train_outcome.summary(cfg, final, published, done.get("step"), result.seconds, False, relay.warnings,
                                     note, relay.memory_plan, relay.validation)
        return io.NodeOutput(str(final), image, ui={"text": [text]})


# ----------------------------------------------------------------------------------------------------------
# Load trained LoRA

NO_FILE = "(use lora_path)"


def resolve_lora(lora_path: str, lora_name: str) -> str:
    if lora_path and lora_path.strip():
        path = str(paths.current_policy().resolve(lora_path.strip(), "lora_path", paths.OUTPUT))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"lora_path {path!r}: no such file (connect Anima: Train's path output, or pick "
                                    f"a file in lora_name)")
        return path
    if not lora_name or lora_name == NO_FILE:
        raise ValueError("no LoRA given: connect a path to lora_path or choose a file in lora_name")
    return comfy.model_path("loras", lora_name)


class AnimaLoadTrainedLora(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="AnimaLoadTrainedLora",
            display_name="Anima: Load trained LoRA",
            category=CATEGORY,
            description=f"Apply a trained {adapters.titles(adapters_only=True, sep='/')} file to MODEL (and CLIP, "
                        "when the file has a Qwen3 part) the way the stock LoraLoader does. "
                        "lora_path (e.g. from Anima: Train) wins over lora_name.",
            inputs=[
                io.Model.Input("model"),
                io.String.Input("lora_path", default="", tooltip="a .safetensors path (a relative one is in ComfyUI's "
                                                                "output folder); empty = use lora_name"),
                io.Combo.Input("lora_name", options=[NO_FILE] + comfy.model_files("loras"), default=NO_FILE,
                               tooltip="a file from models/loras"),
                io.Float.Input("strength_model", default=1.0, min=-100.0, max=100.0, step=0.01),
                io.Float.Input("strength_clip", default=1.0, min=-100.0, max=100.0, step=0.01),
                io.Clip.Input("clip", optional=True),
            ],
            outputs=[io.Model.Output(display_name="MODEL"), io.Clip.Output(display_name="CLIP")],
        )

    @classmethod
    def fingerprint_inputs(cls, lora_path="", lora_name=NO_FILE, strength_model=1.0, strength_clip=1.0, **_):
        try:  # re-run when the file under the same name changes
            path = resolve_lora(lora_path or "", lora_name)
            st = os.stat(path)
            return f"{path}|{st.st_size}|{st.st_mtime_ns}|{strength_model}|{strength_clip}"
        except Exception:  # noqa: BLE001 (a linked path is unknown here; execute reports real problems)
            return f"{lora_path}|{lora_name}|{strength_model}|{strength_clip}"

    @classmethod
    @fixes.shown_on(fixes.LOAD)
    def execute(cls, model, lora_path="", lora_name=NO_FILE, strength_model=1.0, strength_clip=1.0, clip=None):
        path = resolve_lora(lora_path, lora_name)
        if strength_model == 0 and strength_clip == 0:
            return io.NodeOutput(model, clip)
        new_model, new_clip = comfy.load_lora(model, clip, path, strength_model, strength_clip if clip else 0.0)
        return io.NodeOutput(new_model, new_clip if clip is not None else None)


# ----------------------------------------------------------------------------------------------------------
# Prompt encoding with the trainer's own text path

class AnimaTrainTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="AnimaTrainTextEncode",
            display_name="Anima: Encode prompt (trainer)",
            category=CATEGORY,
            description="Encode a prompt with the Qwen3 text encoder and tokenizers of a converted Anima diffusers "
                        "repo, exactly as the trainer encodes captions; feeds KSampler like CLIPTextEncode.",
            inputs=[io.String.Input("model_path", default="", tooltip="the converted diffusers repo (as in the "
                                                                      "training config; a relative "
                                                                      "one is in ComfyUI's models folder)"),
                    io.String.Input("text", multiline=True, default="")],
            outputs=[io.Conditioning.Output(display_name="CONDITIONING")],
        )

    @classmethod
    @fixes.shown_on("Anima: Encode prompt (trainer)")
    def execute(cls, model_path, text):
        if model_path and model_path.strip():
            model_path = str(paths.current_policy().resolve(model_path.strip(), "model_path", paths.MODELS))
        return io.NodeOutput(encode_conditioning(model_path, text))


NODES = [AnimaTrainConfig, AnimaTrainTrain, AnimaLoadTrainedLora, AnimaTrainTextEncode]
