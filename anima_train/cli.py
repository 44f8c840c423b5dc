"""`anima-train` — one entry point, one subcommand per job.

Each subcommand lives in its own module, which provides `add_arguments(parser)` and `run(args) -> int`. The module
is imported only when its subcommand runs, so `anima-train --help` and `anima-train check` start in well under a
second and a broken optional dependency in one command cannot take the others down with it.

Errors: a command raises `anima_train.errors.UserError` (or one of its subclasses: ConfigError, DatasetError,
ResumeError, ...) for anything the user can fix; `main` prints its message as `anima-train CMD: error: ...` and
returns 2 (or the error's own exit_code: 5 for a diverged run). Any other exception is an internal error: one line,
exit 1, and the traceback only with `--debug` or ANIMA_TRAIN_DEBUG=1. Ctrl-C, SIGTERM and Windows' Ctrl+Break are
one interrupt policy for the whole command, its imports included: the same unwinding, one line, exit 130
(docs/architecture.md#nothing-lost).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import time
import warnings
from dataclasses import dataclass

from anima_train import __version__, adapters, errors
from anima_train.system import interrupts, third_party_noise


@dataclass(frozen=True)
class Command:
    module: str
    help: str
    add_arguments: str = "add_arguments"
    run: str = "run"


COMMANDS: dict[str, Command] = {
    "convert": Command("anima_train.model.convert",
                       "convert ComfyUI single files (DiT, Qwen3, VAE) into a diffusers repo"),
    "cache": Command("anima_train.data.latent_cache", "encode a dataset's images into latent caches next to them"),
    "audit": Command("anima_train.data.audit", "report a dataset's size distribution, tier ladder and cache coverage"),
    "train": Command("anima_train.training.train_command", f"train a {adapters.table_help()} from a TOML config"),
    "evaluate": Command("anima_train.training.evaluate",
                        "print a config's validation loss and text-conditioning margin for the base model or a "
                        "checkpoint (--checkpoint FILE), to compare the checkpoints of a run"),
    "plan": Command("anima_train.training.plan",
                    "print the memory plan a config would run with (blocks recomputed, Qwen3 placement, peak) "
                    "under --vram GiB, without training"),
    "config": Command("anima_train.training.config_check",
                      "check a config and the paths it names, or print every key (--reference)"),
    "demo": Command("anima_train.demo", "train a LoRA on a tiny model and a generated dataset (no downloads)"),
    "tiny-model": Command("anima_train.demo", "write a tiny random Anima model to try the trainer on your images",
                          "tiny_model_add_arguments", "tiny_model_run"),
    "check": Command("anima_train.system.check", "import every dependency, print versions and device info"),
    "anchor-info": Command("anchor.cli", "print an anchor file's usage card and width signature",
                           "info_add_arguments", "info_run"),
    "anchor-convert": Command("anchor.cli", "convert a .pt anchor file to .safetensors",
                              "convert_add_arguments", "convert_run"),
}


class NotYetImplemented(RuntimeError):
    """A subcommand whose module has not landed yet."""


def _load(name: str):
    cmd = COMMANDS[name]
    try:
        module = importlib.import_module(cmd.module)
    except ModuleNotFoundError as exc:
        # Only "this command's own module is missing" means not-yet; a missing third-party dependency inside
        # it is a real installation problem and must surface as such.
        if exc.name == cmd.module:
            raise NotYetImplemented(
                f"`anima-train {name}` is not implemented yet in this version ({__version__}); "
                f"see the project's open issues for its status") from None
        raise
    return getattr(module, cmd.add_arguments), getattr(module, cmd.run)


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="anima-train",
        description=f"Train and load Anima adapters ({adapters.table_help()}) from a shell.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {n:<15} {c.help}" for n, c in COMMANDS.items())
        + "\n\nRun `anima-train COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"anima-train {__version__}")
    parser.add_argument("command", choices=list(COMMANDS), metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = errors.debug_requested()
    if argv[:1] == ["--debug"]:  # `anima-train --debug COMMAND ...` as well as `anima-train COMMAND ... --debug`
        debug, argv = True, argv[1:]
    top = _top_parser()
    if not argv or argv[0].startswith("-"):
        top.parse_args(argv or ["--help"])  # prints help/version and exits
        return 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        top.parse_args([name])  # argparse's own "invalid choice" message, exit 2
        return 2
    # known before the command's module loads (the flag is parsed with its options below): several of the lines
    # the filter drops are printed while a library is imported
    debug = debug or "--debug" in rest
    with contextlib.nullcontext() if debug else third_party_noise.filtered():
        return _run(name, rest, debug)


def _run(name: str, rest: list[str], debug: bool) -> int:
    default_format = warnings.formatwarning
    # the interrupt policy covers the whole command: importing it (seconds of torch), its arguments, its run
    with interrupts.policy() as received:
        try:
            try:
                add_arguments, run = _load(name)
            except NotYetImplemented as exc:
                print(f"anima-train: {exc}", file=sys.stderr)
                return 2
            parser = argparse.ArgumentParser(prog=f"anima-train {name}", description=COMMANDS[name].help)
            add_arguments(parser)
            parser.add_argument("--debug", action="store_true",
                                help=f"show the full traceback of an error (or set {errors.DEBUG_ENV}=1)")
            args = parser.parse_args(rest)
            debug = debug or args.debug
            if not debug:
                warnings.formatwarning = _plain_format(name)
            return int(run(args) or 0)
        except KeyboardInterrupt as exc:
            if debug:
                raise
            if errors.is_main_process():  # under a launcher every rank gets the signal: the main one says it
                print(f"anima-train {name}: {errors.interrupted_message(exc)}", file=sys.stderr)
            return errors.INTERRUPTED_EXIT
        except Exception as exc:  # noqa: BLE001 (every error becomes one message; --debug shows the traceback)
            if debug:
                raise
            if received.how and errors.is_main_process():
                # a library swallowed the interrupt and failed later (caught it and raised its own error): the
                # interrupt is what happened
                print(f"anima-train {name}: {received.how}", file=sys.stderr)
                return errors.INTERRUPTED_EXIT
            return _report(name, exc)
        finally:
            warnings.formatwarning = default_format  # in-process callers get theirs back


def _plain_format(name: str):
    """warnings.formatwarning that shows our own warnings (a config that loads but looks wrong, ...) as one line,
    without Python's file:line and source echo; everyone else's keep the default format. (Formatting only: a
    caller recording warnings, e.g. pytest.warns, still gets them.)"""
    default = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None):
        if category.__module__.split(".")[0] not in ("anima_train", "anchor"):
            return default(message, category, filename, lineno, line)
        return f"anima-train {name}: warning: {message}\n" if errors.is_main_process() else ""

    return formatwarning


def _report(name: str, exc: Exception) -> int:
    """One message on stderr for an error that escaped a command; the exit status (2 user error, 1 internal)."""
    message = errors.user_message(exc)
    if message is not None:
        if errors.is_main_process():  # every DDP process hits the same user error: one of them says it
            print(f"anima-train {name}: error: {message}", file=sys.stderr)
        else:
            # the launcher ends every process as soon as one exits: a rank that got here first must not take the main
            # process down before it has printed the message. The main process exits at once and the launcher ends
            # this one; if it is still alive after the grace period, the error was its own, so it says it.
            try:
                time.sleep(errors.QUIET_RANK_GRACE_S)
            except KeyboardInterrupt:  # the launcher's SIGTERM, as the interrupt policy turns it: the main one spoke
                return errors.exit_code(exc)
            print(f"[rank {os.environ.get('RANK')}] anima-train {name}: error: {message}", file=sys.stderr)
        return errors.exit_code(exc)
    rank = "" if errors.is_main_process() else f"[rank {os.environ.get('RANK')}] "
    print(f"{rank}anima-train {name}: internal error: {type(exc).__name__}: {exc}\n"
          f"This is a bug in anima-train, not in your input. Re-run with --debug (or {errors.DEBUG_ENV}=1) to see "
          f"the traceback, and include it when you report the problem.", file=sys.stderr)
    return errors.INTERNAL_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
