"""`anima-train train CFG.toml`: the command. Its config gate (the values, and the paths they name) runs before the
trainer is imported, so a mistake in the config is said in a fraction of a second instead of after the seconds that
torch, accelerate, diffusers and peft take to import; the run itself is training/train.py.

    anima-train train cfg.toml [--max-steps N] [--no-save] [--dry-run] [--events PATH|-]
    accelerate launch --num_processes 2 -m anima_train train cfg.toml
"""

from __future__ import annotations

from anima_train import errors
from anima_train.config import load_config
from anima_train.training import preflight


def add_arguments(parser) -> None:
    parser.add_argument("config", help="the run's TOML config")
    parser.add_argument("--max-steps", type=int, metavar="N",
                        help="stop after N optimizer steps (overrides the config)")
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
    if args.max_steps is not None and args.max_steps < 1:
        raise errors.UserError(f"--max-steps {args.max_steps}: must be at least 1")
    # the paths' problems in one message with the values' (the run checks them again before it loads the model)
    cfg = load_config(args.config, also=preflight.path_check(saving=not (args.no_save or args.dry_run)))
    if args.max_steps is not None:
        cfg.train.max_steps = args.max_steps
    # lazy: the trainer imports torch, accelerate, diffusers and peft (seconds); a config it would refuse is said first
    from anima_train.training.train import train

    train(cfg, dry_run=args.dry_run, no_save=args.no_save or args.dry_run, events=args.events,
          skip_unreadable=args.skip_unreadable, cpu=args.cpu, stop_file=args.stop_file, overwrite=args.overwrite,
          allow_missing_captions=args.allow_missing_captions)
    return 0
