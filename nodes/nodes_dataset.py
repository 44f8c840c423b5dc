"""Model and dataset preparation nodes: Convert checkpoint, Audit dataset, Cache latents.

Each is the ComfyUI face of an `anima-train` subcommand and runs it as a worker process (nodes/worker.py) with the
same flags a shell user would type: the CLI is the stable interface, the job's memory (a 4 GB conversion, a VAE
on the GPU) is returned to the system when it ends, and Cancel ends it like a training run. The command's text
output becomes the node's STRING output and is shown on the node (ui text).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from anchor.atomic import write_json
from anima_train.errors import DATA_VERDICT_EXIT
from anima_train.model.components import DEFAULT_TOKENIZER_REPO, ModelRepoError, check_repo

from . import comfy
from . import fixes
from . import paths
from . import run_records
from . import worker
from .comfy import CATEGORY, io
from .nodes_train import ConfigType

CONVERT_MARKER = "comfyui-convert.json"  # in the converted repo: which inputs made it (re-queue = no-op)
CONVERTED_SUBDIR = "anima_diffusers"  # default output: models/anima_diffusers/<anima file stem>/
TQDM_PROGRESS = re.compile(r"^\s*caching:.*?\|\s*(\d+)/(\d+)\b")


def _text(result: worker.JobResult) -> str:
    lines = [ln for ln in result.lines if not TQDM_PROGRESS.match(ln)]
    return "\n".join(lines).strip()


def parse_resolutions(text: str) -> list[int]:
    """"1024" or "768, 1024" -> [768, 1024]; "" -> []."""
    parts = [p for p in re.split(r"[,\s]+", (text or "").strip()) if p]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"resolutions {text!r}: give whole numbers separated by commas, e.g. \"768, 1024\"") \
            from None
    if any(v <= 0 for v in values):
        raise ValueError(f"resolutions {text!r}: every tier must be > 0")
    return sorted(set(values))


def dataset_args(dataset_dir: str, resolutions: str, model_path: str, config_file: str | None) -> list[str]:
    """The DIR / --resolution / --model / --config part shared by `cache` and `audit`. Folders are confined
    (nodes/paths.py: a relative one is in ComfyUI's input folder, model_path in its models folder)."""
    args = []
    policy = paths.current_policy()
    dirs = [d.strip() for d in (dataset_dir or "").split(";") if d.strip()]
    for d in dirs:
        folder = policy.resolve(d, "dataset_dir", paths.INPUT)
        if not folder.is_dir():
            raise FileNotFoundError(f"dataset_dir = {d!r}: no such folder ({folder}); set dataset_dir to a folder of "
                                    f"images (several: separate them with ';')")
        args.append(str(folder))
    if not dirs and config_file is None:
        raise ValueError("no dataset: set dataset_dir (several folders: separate them with ';') or connect a "
                         "training config")
    tiers = parse_resolutions(resolutions)
    if tiers:
        args += ["--resolution", *map(str, tiers)]
    if model_path and model_path.strip():
        args += ["--model", str(policy.resolve(model_path.strip(), "model_path", paths.MODELS))]
    if config_file is not None:
        args += ["--config", config_file]
    return args


def _config_file(config) -> str | None:
    """The connected training config as a temp TOML file for `--config` (the caller deletes it); its paths confined
    like the Training config node's (a posted graph may give this input any value)."""
    if not config:
        return None
    text = paths.confine_toml(config["toml"] if isinstance(config, dict) else str(config), paths.current_policy())
    fd, path = tempfile.mkstemp(prefix="anima-train-", suffix=".toml")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _log_dir() -> Path:
    try:
        base = Path(comfy.output_directory())
    except ImportError:
        base = Path(tempfile.gettempdir())
    return base / "anima_train" / "logs"


def run_cli(args: list[str], what: str, *, ok_codes=(0,), on_line=None) -> worker.JobResult:
    """`python -m anima_train ARGS` as an interruptible worker; raises WorkerError with its log tail on failure."""
    log = _log_dir() / f"{args[0]}.log"
    result = worker.run_job(worker.anima_train_command(args), log_path=log, on_line=on_line,
                            check_interrupt=comfy.throw_if_interrupted, env=worker.worker_env())
    worker.raise_for_failure(result, what, ok_codes)
    return result


def _dataset_fingerprint(dataset_dir, config, *widgets) -> str:
    dirs = [d.strip() for d in (dataset_dir or "").split(";") if d.strip()]
    return run_records.result_key(data=run_records.dataset_digest(dirs), config=config and str(config), widgets=widgets)


# ----------------------------------------------------------------------------------------------------------


class AnimaTrainConvert(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="AnimaTrainConvert",
            display_name="Anima: Convert checkpoint",
            category=CATEGORY,
            description="Convert the three ComfyUI single files (Anima DiT, Qwen3-0.6B text encoder, Qwen-Image "
                        "VAE) into the diffusers repo the trainer loads. Done once; re-running with the same files "
                        "re-uses the repo.",
            inputs=[
                io.Combo.Input("anima", options=comfy.model_files("diffusion_models"),
                               tooltip="models/diffusion_models: the Anima DiT (e.g. anima-base-v1.0.safetensors)"),
                io.Combo.Input("qwen", options=comfy.model_files("text_encoders"),
                               tooltip="models/text_encoders: Qwen3-0.6B (e.g. qwen_3_06b_base.safetensors)"),
                io.Combo.Input("vae", options=comfy.model_files("vae"),
                               tooltip="models/vae: the Qwen-Image VAE (e.g. qwen_image_vae.safetensors)"),
                io.String.Input("out_dir", default="",
                                tooltip=f"where the repo goes (a relative path is in ComfyUI's models folder); "
                                        f"empty = models/{CONVERTED_SUBDIR}/<anima file name>"),
                io.String.Input("tokenizers", default=DEFAULT_TOKENIZER_REPO,
                                tooltip="folder with tokenizer/ and t5_tokenizer/, a Hugging Face repo id (only "
                                        "those two folders are downloaded), or none"),
            ],
            # not an output node: it runs only for a node that needs its repo, so a graph whose training config
            # fails validation converts and downloads nothing (ComfyUI runs every valid output node of a queued graph)
            outputs=[io.String.Output(display_name="model_path")],
        )

    @classmethod
    def _resolve(cls, anima, qwen, vae, out_dir):
        files = {"anima": comfy.model_path("diffusion_models", anima), "qwen": comfy.model_path("text_encoders", qwen),
                 "vae": comfy.model_path("vae", vae)}
        if out_dir and out_dir.strip():  # confined; a relative one is in ComfyUI's models folder
            out = paths.current_policy().resolve(out_dir.strip(), "out_dir", paths.MODELS)
        else:
            name = Path(anima).name.removesuffix(".safetensors").replace("/", "_")
            out = Path(comfy.models_directory()) / CONVERTED_SUBDIR / name
        return files, out

    @classmethod
    def fingerprint_inputs(cls, anima=None, qwen=None, vae=None, out_dir="", tokenizers="", **_):
        try:
            files, out = cls._resolve(anima, qwen, vae, out_dir)
            return run_records.result_key(inputs=run_records.files_digest(files.values()), out=str(out), tok=tokenizers)
        except Exception:  # noqa: BLE001
            return run_records.result_key(values=[anima, qwen, vae, out_dir, tokenizers])

    @classmethod
    @fixes.shown_on(fixes.CONVERT)
    def execute(cls, anima, qwen, vae, out_dir="", tokenizers=""):
        files, out = cls._resolve(anima, qwen, vae, out_dir)
        key = run_records.result_key(inputs=run_records.files_digest(files.values()), tok=tokenizers)
        marker = out / CONVERT_MARKER
        try:
            if json.loads(marker.read_text(encoding="utf-8")).get("key") == key:
                check_repo(out)
                text = f"{out} is already converted from these files (re-used)"
                return io.NodeOutput(str(out), ui={"text": [text]})
        except (OSError, ValueError, ModelRepoError):
            pass
        tokenizers = paths.tokenizers_source(tokenizers, paths.current_policy()) if tokenizers and tokenizers.strip() \
            else ""
        args = ["convert", "--anima", files["anima"], "--qwen", files["qwen"], "--vae", files["vae"],
                "--out", str(out)] + (["--tokenizers", tokenizers] if tokenizers else [])
        result = run_cli(args, "conversion")
        write_json(marker, {"key": key, "inputs": files})
        text = _text(result) or f"wrote {out}"
        return io.NodeOutput(str(out), ui={"text": [text]})


class AnimaTrainAudit(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="AnimaTrainAudit",
            display_name="Anima: Audit dataset",
            category=CATEGORY,
            description="Size distribution, a suggested resolution ladder, cache coverage, and whether the images "
                        "could be deleted (every one cached at every tier with the current settings).",
            inputs=[
                io.String.Input("dataset_dir", default="",
                                tooltip="image folder(s); several: separate with ';'. A relative one is in ComfyUI's "
                                        "input folder"),
                io.String.Input("resolutions", default="", tooltip="tier(s), e.g. \"1024\" or \"768, 1024\"; empty "
                                                                   "= the config's, else what the caches record"),
                io.String.Input("model_path", default="", tooltip="converted repo, to check the caches' VAE"),
                ConfigType.Input("config", optional=True, tooltip="take folders and settings from this config"),
            ],
            outputs=[io.String.Output(display_name="report"), io.Boolean.Output(display_name="safe_to_delete")],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, dataset_dir="", resolutions="", model_path="", config=None, **_):
        return _dataset_fingerprint(dataset_dir, config, resolutions, model_path)

    @classmethod
    @fixes.shown_on(fixes.AUDIT)
    def execute(cls, dataset_dir="", resolutions="", model_path="", config=None):
        config_file = _config_file(config)
        try:
            args = ["audit"] + dataset_args(dataset_dir, resolutions, model_path, config_file)
            # NOT SAFE (exit 4) is a finding, not an error
            result = run_cli(args, "the audit", ok_codes=(0, DATA_VERDICT_EXIT))
        finally:
            if config_file:
                os.unlink(config_file)
        text = fixes.render(_text(result), fixes.AUDIT)
        return io.NodeOutput(text, result.returncode == 0, ui={"text": [text]})


class AnimaTrainCache(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="AnimaTrainCache",
            display_name="Anima: Cache latents",
            category=CATEGORY,
            description="Encode the dataset's images into latent caches next to them (one per image and bucket), "
                        "so training reads latents instead of running the VAE. Dry run prints the plan and the "
                        "cache size only. Valid caches are skipped.",
            inputs=[
                io.String.Input("dataset_dir", default="",
                                tooltip="image folder(s); several: separate with ';'. A relative one is in ComfyUI's "
                                        "input folder"),
                io.String.Input("resolutions", default="1024", tooltip="tier(s), e.g. \"1024\" or \"768, 1024\""),
                io.String.Input("model_path", default="", tooltip="converted repo (its vae/ encodes)"),
                io.Boolean.Input("dry_run", default=True, tooltip="print the plan and the cache size; write nothing"),
                io.Boolean.Input("overwrite", default=False, tooltip="re-encode caches that exist and match"),
                io.Int.Input("batch_size", default=4, min=1, max=256, tooltip="images per VAE forward"),
                io.Boolean.Input("allow_missing_captions", default=False,
                                 tooltip="cache images without a caption file (training still needs captions)"),
                ConfigType.Input("config", optional=True, tooltip="take folders and settings from this config"),
            ],
            outputs=[io.String.Output(display_name="report")],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, dataset_dir="", resolutions="", model_path="", dry_run=True, overwrite=False,
                           batch_size=4, allow_missing_captions=False, config=None, **_):
        if overwrite and not dry_run:
            return float("nan")  # an explicit re-encode always runs
        return _dataset_fingerprint(dataset_dir, config, resolutions, model_path, dry_run, batch_size,
                                    allow_missing_captions)

    @classmethod
    @fixes.shown_on(fixes.CACHE)
    def execute(cls, dataset_dir="", resolutions="1024", model_path="", dry_run=True, overwrite=False, batch_size=4,
                allow_missing_captions=False, config=None):
        hidden = getattr(cls, "hidden", None)
        node_id = getattr(hidden, "unique_id", None)
        config_file = _config_file(config)
        bar = None

        def on_line(line: str) -> None:
            nonlocal bar
            m = TQDM_PROGRESS.match(line)
            if m:
                done, total = int(m.group(1)), int(m.group(2))
                if bar is None:
                    bar = comfy.progress_bar(total, node_id=str(node_id) if node_id is not None else None)
                bar.update_absolute(done, total)

        try:
            args = ["cache"] + dataset_args(dataset_dir, resolutions, model_path, config_file)
            args += ["--batch-size", str(batch_size)]
            args += ["--dry-run"] if dry_run else []
            args += ["--overwrite"] if overwrite else []
            args += ["--allow-missing-captions"] if allow_missing_captions else []
            if not dry_run:
                comfy.free_vram()  # the worker's VAE wants the GPU ComfyUI's models hold
            result = run_cli(args, "caching", on_line=on_line)
        finally:
            if config_file:
                os.unlink(config_file)
        text = fixes.render(_text(result), fixes.CACHE)
        return io.NodeOutput(text, ui={"text": [text]})


NODES = [AnimaTrainConvert, AnimaTrainAudit, AnimaTrainCache]
