"""GPU benchmark of the real trainer (`anima_train.train.train`) on a full-size random-init Anima.

Same settings as the naive baseline (shared/bench/gpu_baseline.py): 1024x1024 (4096 tokens), bf16, gradient
checkpointing, AdamW; LoRA r32 on attention + MLP at batch 8 and a full finetune of the DiT at batch 4. Unlike the
baseline, each of our steps also tokenises and encodes its captions with Qwen3 and runs the LLM adapter, because
that is what training does. Run the baseline in the same call and compare:

    python3 bench/bench_train_gpu.py --work /tmp/bench [--steps 14] [--only lora_b8,full_b4] [--compile]

Prints one JSON line per configuration (s/step median after warm-up, s/image, peak GiB) and a table.

Texture mode (CONFIG.md §B.10) needs images, not latents (source = "encode": the VAE runs every step). The runs
`encode_b4` (full-resolution 1024x1024 buckets, encoded in the loop) and `texture_b4` (one texture phase over the
whole run, 1024x1024 canvases cut from 1536x1536 sources) train the same LoRA on the same synthetic images, built on
first use under --work/images; their s/step difference is the per-step cost of texture mode:

    python3 bench/bench_train_gpu.py --work /tmp/bench --only encode_b4,texture_b4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anima_train.config import load_config  # noqa: E402
from anima_train.tiny import CONFIGS, build_qwen_tokenizer, build_t5_tokenizer, make_synthetic_latents  # noqa: E402
from anima_train.train import train  # noqa: E402

RUNS = {
    # name: (batch, extra TOML)
    "lora_b8": (8, '[adapter]\nkind = "lora"\nrank = 32\nalpha = 32.0\n[optimizer]\nlr = 1e-4\n'),
    "full_b4": (4, '[adapter]\nkind = "none"\n[component_lr]\nadaln = 1e-5\nbase = 1e-5\n[optimizer]\nlr = 1e-5\n'),
    # the lean full finetune for 24 GiB cards: uint8 AdamW state + Kahan residual instead of fp32 masters
    "full_b4_8bit": (4, '[adapter]\nkind = "none"\n[component_lr]\nadaln = 1e-5\nbase = 1e-5\n[optimizer]\n'
                        'kind = "adamw8bit"\nlr = 1e-5\nquantize_state = true\nuse_kahan = true\n'),
    # on images (IMAGE_RUNS): the extra TOML starts inside [dataset]
    "encode_b4": (4, 'source = "encode"\n[adapter]\nkind = "lora"\nrank = 32\nalpha = 32.0\n[optimizer]\nlr = 1e-4\n'),
    "texture_b4": (4, 'source = "encode"\n[dataset.texture]\ncanvases = [[1024, 1024]]\n[[curriculum]]\nat = 0.0\n'
                      'mode = "texture"\n[adapter]\nkind = "lora"\nrank = 32\nalpha = 32.0\n[optimizer]\nlr = 1e-4\n'),
}
IMAGE_RUNS = ("encode_b4", "texture_b4")


def build_repo(repo: Path) -> None:
    """Full-size random Anima + tiny tokenizers (the VAE is written for completeness; training reads latents)."""
    from diffusers import AutoencoderKLQwenImage, CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    from transformers import Qwen3Config, Qwen3Model

    cfg = CONFIGS["full"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        models = {"transformer": CosmosTransformer3DModel(**cfg["transformer"]),
                  "text_conditioner": AnimaTextConditioner(**cfg["text_conditioner"]),
                  "text_encoder": Qwen3Model(Qwen3Config(**cfg["text_encoder"])),
                  "vae": AutoencoderKLQwenImage(**cfg["vae"])}
    for name, model in models.items():
        model.to(torch.bfloat16).save_pretrained(repo / name)
    del models
    torch.cuda.empty_cache()
    build_qwen_tokenizer().save_pretrained(repo / "tokenizer")
    build_t5_tokenizer().save_pretrained(repo / "t5_tokenizer")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(repo / "scheduler")


def prepare(work: Path) -> tuple[Path, Path]:
    """(repo, data) under work, built on first use: the full-size model and 1024x1024 synthetic latents."""
    repo, data = work / "repo", work / "data"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (repo / "vae").exists():
        raise SystemExit("run once on one process first: it builds the shared model repo and dataset")
    if not (repo / "vae").exists():
        build_repo(repo)
    if not data.exists():
        make_synthetic_latents(data, n=96, latent_hw=(128, 128))  # 1024x1024 buckets, 4096 tokens
    return repo, data


def prepare_images(work: Path) -> Path:
    """48 synthetic 1536x1536 images with captions (for the encode/texture runs), built on first use."""
    from anima_train.tiny import make_synthetic_dataset

    images = work / "images"
    if not images.exists():
        make_synthetic_dataset(images, n=48, sizes=[(1536, 1536)], jpeg_every=0)
    return images


def run_config_text(name: str, repo: Path, data: Path, work: Path, steps: int, compile_mode: str | None,
                    resolution: int = 1024, dtype: str = "bfloat16", num_workers: int = 2) -> tuple[str, str]:
    """(label, TOML text) of one RUNS configuration; bench/profile_train_gpu.py trains the same text."""
    batch, extra = RUNS[name]
    label = name + ("_compiled" if compile_mode else "")
    text = f"""
[train]
model_path = "{repo}"
output_dir = "{work / 'out'}"
run_name = "{label}"
epochs = 1000
max_steps = {steps}
batch_size = {batch}
dtype = "{dtype}"
num_workers = {num_workers}
progress = "off"
gradient_checkpointing = true
save_every_epochs = 0
skip_final_save = true
{f'compile = "{compile_mode}"' if compile_mode else ''}
[dataset]
path = "{data}"
resolution = {resolution}
{extra}"""
    return label, text


def bench(name: str, repo: Path, data: Path, work: Path, steps: int, compile_mode: str | None) -> dict:
    batch = RUNS[name][0]
    if name in IMAGE_RUNS:
        data = prepare_images(work)
    label, text = run_config_text(name, repo, data, work, steps, compile_mode)
    events = work / f"{label}.jsonl"
    cfg = load_config(text)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = train(cfg, events=str(events), no_save=True)
    wall = time.perf_counter() - t0
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    stamps = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    times = [r["time"] for r in stamps if r["event"] == "step"]  # only the main process writes events
    deltas = [b - a for a, b in zip(times, times[1:])][3:]  # skip warm-up (first steps, compile)
    med = statistics.median(deltas) if deltas else float("nan")
    trainable = sum(p.numel() for m in (result.components.transformer, result.components.text_conditioner)
                    for p in m.parameters() if p.requires_grad)
    rec = dict(name=label, rank=rank, processes=world, batch=batch, steps=len(result.losses), trainable=trainable,
               s_per_step=round(med, 4), s_per_image=round(med / (batch * world), 4),
               images_per_s=round(batch * world / med, 2) if deltas else None,
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), digest=result.trainable_digest[:16],
               first_step_s=round(times[0] - stamps[0]["time"], 1) if times else None, wall_s=round(wall, 1),
               loss_first=round(result.losses[0], 4), loss_last=round(result.losses[-1], 4))
    print(json.dumps(rec), flush=True)
    del result
    torch.cuda.empty_cache()
    return rec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/anima-bench")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--only", default="lora_b8,full_b4")
    ap.add_argument("--compile", default=None, help="also run with train.compile = MODE (e.g. default)")
    ap.add_argument("--skip-eager", action="store_true", help="with --compile: only the compiled runs")
    args = ap.parse_args()
    t0 = time.perf_counter()
    repo, data = prepare(Path(args.work))
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "setup_s": round(time.perf_counter() - t0, 1)}), flush=True)
    rows = []
    names = args.only.split(",")
    plan = ([] if args.skip_eager and args.compile else [(n, None) for n in names]) \
        + [(n, args.compile) for n in names if args.compile]
    for name, mode in plan:  # eager first: the essential numbers come out even if a compiled run fails
        try:
            rows.append(bench(name, repo, data, work, args.steps, mode))
        except Exception as exc:  # report and go on with the next configuration
            print(json.dumps({"name": name, "compile": mode, "error": f"{type(exc).__name__}: {exc}"[:2000]}),
                  flush=True)
            torch.cuda.empty_cache()
    print(f"\n{'config':<20}{'batch':>6}{'s/step':>10}{'s/image':>10}{'peakGiB':>9}")
    for r in rows:
        print(f"{r['name']:<20}{r['batch']:>6}{r['s_per_step']:>10.3f}{r['s_per_image']:>10.4f}{r['peak_gib']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
