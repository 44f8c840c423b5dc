"""Lines other libraries print that a user of anima-train cannot act on, kept out of every command's output.

One table, one row per line: where it comes from, the text it starts with, and why it says nothing to the user.
`cli.main` applies it before a command's module loads (several of these are said at import time), so the shell and
the ComfyUI nodes get the same output: a node's log is the output of a `python -m anima_train` child. `--debug` or
ANIMA_TRAIN_DEBUG=1 keeps every line, as it keeps tracebacks.

A row drops one message, never a whole logger: the same library's other messages (a real failure) still come
through. A line printed by a library's C++ side cannot be caught once printed, so its row removes the cause instead
(an environment setting another program left to this process).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class LogLine:
    """A message a library writes to its `logging` logger (logging.Logger.warning and the like)."""

    logger: str  # the logger's name: the library's module that says it
    starts: str  # the message's first words, as printed
    why: str  # why nothing in it is for the user (the table's reason to exist; read by the tests' failure text)


@dataclass(frozen=True)
class RenamedVariable:
    """An environment variable whose old name makes a library's C++ side print a deprecation at start-up: the same
    setting under its new name, when the installed version reads the new name and the user has not set that one."""

    old: str
    new: str
    package: str  # the distribution whose version decides
    since: tuple[int, int]  # the first (major, minor) that reads `new` and complains about `old`
    why: str


LOG_LINES: tuple[LogLine, ...] = (
    LogLine("sdnq", "SDNQ: OpenVINO MM kernels are not available!",
            "OpenVINO is an optional int8 matmul for CPUs that SDNQ tries at import; without it SDNQ uses torch's, "
            "which is what a CPU run of this trainer uses anyway (nothing to install)"),
    LogLine("torch.utils.cpp_extension", "No CUDA runtime is found, using CUDA_HOME=",
            "torch notes, while a library imports its C++ extension helper, that a CUDA toolkit folder exists but "
            "no GPU is usable; nothing here compiles CUDA code, and the run's own report (and `anima-train check`) "
            "says which device trains"),
    LogLine("diffusers.guiders.guider_utils", "Guiders are currently an experimental feature",
            "diffusers builds a guider object with the Anima pipeline; the trainer and its previews never use "
            "guiders, so the API's stability is not the user's concern"),
    LogLine("diffusers.models.modeling_utils", "There are modules in ",
            "said on every `.to(dtype)` of a diffusers model that lists modules to keep in float32; the Cosmos "
            "DiT lists `learnable_pos_embed`, which Anima does not have (extra_pos_embed_type is None), and the "
            "LLM adapter lists none"),
)

RENAMED_VARIABLES: tuple[RenamedVariable, ...] = (
    RenamedVariable("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "torch", (2, 9),
                    "ComfyUI sets the old name for itself and its child processes inherit it; torch 2.9 and later "
                    "read the new name and print a deprecation for the old one, which the user never set"),
)


class _DropLines(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 (a malformed record is the library's to report, not ours to drop)
            return True
        return not text.startswith(self.starts)


def _version(package: str) -> tuple[int, int] | None:
    try:
        found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        return None
    return (int(found.group(1)), int(found.group(2))) if found else None


def rename_variables(environ: dict) -> None:
    """The RENAMED_VARIABLES rows on `environ`: the old name becomes the new one where the installed version reads
    the new one and the user has not set it. Also for a child's environment (the ComfyUI worker's, whose launcher
    imports torch before our CLI runs)."""
    for var in RENAMED_VARIABLES:
        version = _version(var.package)
        if var.old in environ and var.new not in environ and version is not None and version >= var.since:
            environ[var.new] = environ.pop(var.old)


@contextlib.contextmanager
def filtered(environ: dict | None = None) -> Iterator[None]:
    """Apply the table until the block ends (an in-process caller of cli.main gets its loggers back). The
    environment rows act on `environ` (default os.environ) before anything imports the library, and stay: torch
    reads the variable lazily, as late as the process's exit, and the new name means the same to the versions
    that read it."""
    environ = os.environ if environ is None else environ
    by_logger: dict[str, list[str]] = {}
    for line in LOG_LINES:
        by_logger.setdefault(line.logger, []).append(line.starts)
    installed = [(logging.getLogger(name), _DropLines(tuple(starts))) for name, starts in by_logger.items()]
    for logger, drop in installed:
        logger.addFilter(drop)
    rename_variables(environ)
    try:
        yield
    finally:
        for logger, drop in installed:
            logger.removeFilter(drop)
