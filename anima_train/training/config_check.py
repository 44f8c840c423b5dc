"""`anima-train config`: check one config file and what it names without training, or print the config reference.

    anima-train config cfg.toml                     # load + check a config and the paths it names; no model loads
    anima-train config --reference                  # print docs/config.md (every key: type, default, bounds, help)
    anima-train config --reference --out FILE       # write it (docs/config.md is this output, kept in sync by a test)

The check is what `train` checks before it loads the model (the config, its paths, the dataset, what will not be
honoured), so it sits with them here; the reference itself is the config's (config/reference.py). No torch here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from anima_train.config.load import load_config
from anima_train.config.reference import reference_markdown
from anima_train.data.batches import steps_per_epoch
from anima_train.data.dataset import build_training_data
from anima_train.errors import UserError
from anima_train.files import atomic_path
from anima_train.training import honoured
from anima_train.training.preflight import check_run_paths, path_check


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", metavar="CFG.toml",
                        help="check this config and the paths it names (model, dataset, output folder, resume_from)")
    parser.add_argument("--reference", action="store_true",
                        help="print the reference of every config key (docs/config.md)")
    parser.add_argument("--out", metavar="FILE", help="with --reference: write it to FILE instead of printing it")
    # the dataset is checked as `train` checks it, so the flags that change train's verdict are here too
    parser.add_argument("--skip-unreadable", action="store_true", help="as train: skip unreadable images")
    parser.add_argument("--allow-missing-captions", action="store_true",
                        help="as train: accept images without a <stem>.txt")


def _write_new(out: Path, text: str) -> None:
    """--out FILE: written atomically, and never over an existing file (it may be the user's own notes or config;
    published with a hard link, so a file that appears meanwhile is not replaced either)."""
    refused = UserError(f"--out {out}: the file already exists; give another path, or delete it first to replace it")
    if out.exists() or out.is_symlink():
        raise refused
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: the folder {out.parent} does not exist; create it or give another path")
    try:
        with atomic_path(out, overwrite=False) as tmp:
            tmp.write_text(text, encoding="utf-8", newline="")
    except FileExistsError:
        raise refused from None


def run(args) -> int:
    if args.reference:
        text = reference_markdown()
        if args.out:
            _write_new(Path(args.out), text)
            print(f"wrote {args.out}")
        else:
            sys.stdout.write(text)
        return 0
    if not args.config:
        raise UserError("give a config file to check (anima-train config CFG.toml), or --reference for the list "
                        "of every key")

    # its warnings are printed as they come (cli.main formats them); its paths' problems come with its values'
    cfg = load_config(args.config, also=path_check())
    check_run_paths(cfg)  # and the weights' shapes
    # what `train` checks before it loads the model: images (decoded when they will be), captions, caches, buckets
    data = build_training_data(cfg, cfg.train.model_path, skip_unreadable=args.skip_unreadable,
                               allow_missing_captions=args.allow_missing_captions)
    per_epoch = steps_per_epoch(len(data.sampler), 1, cfg.train.gradient_accumulation_steps)  # one process
    for text in data.warnings + honoured.report(cfg, data, per_epoch):
        print(f"warning: {text}")
    print(f"{args.config}: OK ({cfg.adapter.kind if cfg.adapter.kind != 'none' else 'full finetune'}; the model, "
          f"dataset ({len(data.sources)} source(s), {len(data.entries)} entries, {data.mode}) and output folder are "
          f"usable)")
    return 0
