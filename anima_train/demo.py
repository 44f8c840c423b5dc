"""`anima-train demo`: the whole job on the embedded default, with nothing to download.

Builds a tiny random-weight Anima (real diffusers classes, tiny configs) and a generated dataset of coloured shapes
with tag captions, caches its latents, trains a LoRA for a few dozen steps, and writes the LoRA (ComfyUI-loadable
keys), the run's TOML and a loss plot. It exercises the same code paths as a real run: convert-free diffusers repo →
`anima-train cache` → `anima-train train` → the exporters.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from anima_train.config import TrainConfig, load_config
from anima_train.config.keys import flag_type
from anima_train.data import latent_cache
from anima_train import errors
from anima_train.errors import UserError
from anima_train.outputs.run_folder import LOSS_PLOT_NAME

DEMO_TOML = """\
# anima-train demo: a tiny model and a generated dataset. A real run differs in model_path, dataset path,
# resolution (1024), dtype (bfloat16) and learning rate (1e-4 .. 2.5e-5); everything else works the same.
[train]
model_path = "{model}"
output_dir = "{output}"
run_name = "demo"
epochs = {steps}               # an epoch is at least one step, so max_steps ends the run
max_steps = {steps}
batch_size = 4
dtype = "float32"           # the tiny model trains in fp32; use bfloat16 on a GPU
num_workers = 0
progress = "{progress}"
gradient_checkpointing = false
save_every_epochs = 0
seed = {seed}

[dataset]
path = "{dataset}"
resolution = 128            # an AREA budget (about 128x128 px), not a side length
bucket_reso_steps = 16      # tiny images; real datasets keep the default 64

[adapter]
kind = "lora"
rank = 8
alpha = 8.0

[optimizer]
lr = 5e-3                   # tiny random model; real LoRAs use ~1e-4

[schedule]
kind = "cosine"
warmup_steps = {warmup}
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="DIR", help="where to put everything (empty or absent; default: a new "
                                                     "temporary folder)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--images", type=int, default=24, help="generated images (default 24)")
    parser.add_argument("--seed", type=flag_type(TrainConfig, "seed"), default=0)
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is visible")


def _cache(config: Path, device: str) -> None:
    parser = argparse.ArgumentParser()
    latent_cache.add_arguments(parser)
    args = parser.parse_args(["--config", str(config), "--device", device, "--dtype", "float32"])
    code = latent_cache.run(args)
    if code != 0:
        raise SystemExit(f"demo: caching failed (exit {code})")


def run(args) -> int:
    t0 = time.perf_counter()
    for flag, value in (("--steps", args.steps), ("--images", args.images)):
        if value < 1:  # before anything is built or written
            raise UserError(f"{flag} {value}: must be at least 1 (defaults: --steps 40, --images 24)")
    if args.out and Path(args.out).exists() and any(Path(args.out).iterdir()):
        print(f"demo: {args.out} is not empty; give an empty or new folder with --out (nothing was written)",
              file=sys.stderr)
        return 2
    print("demo: loading torch, diffusers and transformers", flush=True)  # the first seconds are imports
    # lazy: torch (4.6-7.7 s measured) through the trainer: `anima-train demo --help` imports this module
    import torch
    from anima_train.training.fixed_eval import cached_eval_set, evaluate
    from anima_train.model.components import load_components
    from anima_train.model.tiny import build_tiny_anima, make_synthetic_dataset
    from anima_train.training.train import train

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="anima-train-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    use_cuda = torch.cuda.is_available() and not args.cpu
    device = "cuda" if use_cuda else "cpu"

    print(f"demo: building a tiny Anima and {args.images} generated images in {out}")
    tiny = build_tiny_anima(out / "model", seed=args.seed)
    # four aspect ratios (1:1, 5:3, 3:5, 12:5) so batches of 4 fill up; real datasets have many more buckets
    make_synthetic_dataset(out / "dataset", n=args.images, seed=args.seed,
                           sizes=[(128, 128), (160, 96), (96, 160), (192, 80)])
    toml = out / "demo.toml"
    toml.write_text(DEMO_TOML.format(model=tiny.diffusers_dir.as_posix(), output=(out / "output").as_posix(),
                                     dataset=(out / "dataset").as_posix(), steps=args.steps, seed=args.seed,
                                     warmup=min(2, args.steps - 1), progress="auto"), encoding="utf-8")
    cfg = load_config(toml)
    print(f"demo: caching latents (anima-train cache --config {toml})")
    _cache(toml, device)
    latents, captions = cached_eval_set(out / "dataset")
    print(f"demo: measuring the base model's eval loss on the {len(latents)} cached images (fixed timesteps and "
          "noise: the trained LoRA is measured on the same)", flush=True)
    before = evaluate(load_components(tiny.diffusers_dir, dtype="float32", device=device), latents, captions)

    print(f"demo: training a rank-8 LoRA for {args.steps} steps on the {device} (anima-train train {toml})")
    result = train(cfg, cpu=not use_cuda)
    print("demo: measuring the trained LoRA's eval loss (the same timesteps and noise)", flush=True)
    after = evaluate(result.components, latents, captions)
    plot = result.run_dir / LOSS_PLOT_NAME  # every run writes its loss plot

    drop = 100 * (1 - after.true_captions / before.true_captions)
    print()
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    print(f"  eval loss (fixed timesteps and noise): {before.true_captions:.4f} -> {after.true_captions:.4f} "
          f"({drop:.0f}% lower)")
    print(f"  LoRA (ComfyUI: models/loras):  {result.final}")
    print(f"  config copy:                   {result.run_dir / 'demo.toml'}")
    print(f"  loss plot:                     {plot}")
    print(f"  tiny model (diffusers repo):   {tiny.diffusers_dir}")
    print(f"  tiny model (ComfyUI files):    {tiny.native_dir}")
    print(f"Everything stays in {out}. To try your own images on the tiny model, point a config's "
          f'[train] model_path at "{tiny.diffusers_dir}" (see `anima-train tiny-model --help`).')
    return 0


# ----------------------------------------------------------------------------------------------- tiny-model

TINY_MODEL_TOML = """\
[train]
model_path = "{model}"
dtype = "float32"            # the tiny model trains in fp32
max_steps = 20
epochs = 20                  # an epoch is at least one step, so max_steps ends the run (the default is 1 epoch)
[dataset]
path = "/your/images"        # images with a <stem>.txt caption each
resolution = 256
source = "encode"            # the tiny VAE runs in the loop: no `anima-train cache` step needed
[optimizer]
lr = 5e-3                    # tiny random model; real LoRAs use ~1e-4
"""


def tiny_model_add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", metavar="DIR", help="folder to write (absent or empty): DIR/diffusers is the model_path "
                                                   "for a config, DIR/native holds the same weights as ComfyUI files")
    parser.add_argument("--seed", type=flag_type(TrainConfig, "seed"), default=0,
                        help="seed of the random weights (default 0)")


def tiny_model_run(args) -> int:
    """A tiny random-weight Anima (seconds, no downloads) to try configs, datasets and ComfyUI wiring on."""
    # lazy: model.tiny imports torch: see run
    from anima_train.model.tiny import build_tiny_anima

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} is not an empty folder; give a new or empty one (nothing was written)")
    try:
        tiny = build_tiny_anima(out, seed=args.seed)
    except KeyboardInterrupt as exc:  # build_tiny_anima leaves nothing half-written
        raise errors.Interrupted(getattr(exc, "how", "interrupted"),
                                 f"nothing was written to {out}: run the command again") from None
    print(f"tiny model (diffusers repo, a config's model_path): {tiny.diffusers_dir}")
    print(f"tiny model (ComfyUI single files):                 {tiny.native_dir}")
    print("Random weights: it trains and loads like Anima but draws noise. A config to try it on your own images:\n")
    print(TINY_MODEL_TOML.format(model=tiny.diffusers_dir.as_posix()))
    return 0
