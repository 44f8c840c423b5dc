"""Which folders the nodes may read and write: a graph can be posted to a listening ComfyUI by anyone who reaches its
port, so a path typed into a node must not reach the rest of the machine.

The rule (README "Folders the nodes may use"):

* allowed: ComfyUI's own folders (output, input, temp, and every model folder, including those added by
  extra_model_paths.yaml) and the folders the user lists, in the ANIMA_TRAIN_ALLOWED_DIRS environment variable
  (os.pathsep-separated) and/or in `anima_train_paths.txt` next to the pack (one folder per line, # comments).
  A listed folder may be read (datasets, models) and written (the latent caches beside the images, runs);
* a relative path is relative to the ComfyUI folder where such a thing lives, never to ComfyUI's working folder:
  datasets and the protected-tags file to input/, model repos to models/, everything else (run folders, resume
  states, trained files) to output/;
* `~`, `..` and symlinks are resolved first (Path.resolve), so `output/../../etc` and a link inside output/ that
  leads elsewhere are judged by where they really lead. The resolved path is what the node then uses.

Anything else is refused with PathRefused, whose message names the key, the path and how to allow it. The CLI
(`anima-train`) is not confined: a shell user owns the machine.

Everything here is a pure function of the allowed roots (a Policy), so it is tested without ComfyUI; only
`current_policy()` asks ComfyUI (through nodes/comfy.py) for its folders.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import tomlkit

from anima_train.config import ConfigError

from .worker import pack_dir

ALLOWED_DIRS_ENV = "ANIMA_TRAIN_ALLOWED_DIRS"
SETTINGS_NAME = "anima_train_paths.txt"  # in the pack's folder (next to requirements.txt)

# Where a relative path of each kind resolves (a key of Policy.bases).
INPUT, OUTPUT, MODELS = "input", "output", "models"
CODE = "custom_nodes"  # a key of ComfyUI's folders that is refused, not allowed

# Every path a training config can carry, and the base of a relative one. "dataset.subsets.path" is the path of
# each [[dataset.subsets]] table.
CONFIG_PATHS = (("train.model_path", MODELS), ("train.output_dir", OUTPUT), ("train.resume_from", OUTPUT),
                ("dataset.path", INPUT), ("dataset.subsets.path", INPUT),
                ("dataset.caption.protected_tags_file", INPUT))


class PathRefused(ConfigError):
    """A node input names a path outside the allowed folders; `errors` holds one message per path. A ConfigError, so
    the Training config node shows it like any other problem of the config."""


@dataclass(frozen=True)
class Policy:
    comfy_roots: tuple[Path, ...]  # ComfyUI's folders, resolved
    user_roots: tuple[Path, ...]  # the folders the user listed, resolved
    bases: Mapping[str, Path]  # INPUT / OUTPUT / MODELS -> the folder a relative path is joined to
    settings_file: Path | None = None
    notes: tuple[str, ...] = field(default=())  # entries of the user's list that were ignored, and why
    denied: tuple[Path, ...] = field(default=())  # code folders (custom_nodes, the pack): never, even when allowed

    @property
    def roots(self) -> tuple[Path, ...]:
        return self.comfy_roots + self.user_roots

    def allows(self, path: Path) -> bool:
        return _under(path, self.roots) and not _under(path, self.denied)

    def resolve(self, value: str | os.PathLike, key: str, base: str) -> Path:
        """The absolute, symlink-free path `value` names; PathRefused when it is outside every allowed folder."""
        path = Path(os.path.expanduser(os.fspath(value)))
        if not path.is_absolute():
            path = self.bases[base] / path
        real = path.resolve()
        if self.allows(real):
            return real
        if _under(real, self.denied):
            raise PathRefused(f"{key} = {os.fspath(value)!r} leads to {real}, inside ComfyUI's custom_nodes or this "
                              f"pack's folder: code, which the Anima nodes never read or write, even when allowed; "
                              f"choose a folder outside them")
        raise PathRefused(self.refusal(key, value, real, path))

    def refusal(self, key: str, value, real: Path, path: Path) -> str:
        leads = "" if real == Path(os.path.abspath(path)) else f", a link to {real},"
        folder = real.parent if real.is_file() else real
        where = f"a line of {self.settings_file}" if self.settings_file else f"a line of {SETTINGS_NAME} in the pack"
        sep = ";" if os.pathsep == ";" else ":"
        msg = (f"{key} = {os.fspath(value)!r}{leads} is outside the folders the Anima nodes may use (ComfyUI's "
               f"output, input, temp and model folders, and the folders you allow). To allow it, add {folder} (or a "
               f"folder above it) as {where}, or to the {ALLOWED_DIRS_ENV} environment variable (folders separated "
               f"by '{sep}'; restart ComfyUI after changing it), and queue again.")
        if self.notes:
            msg += " Note: " + "; ".join(self.notes) + "."
        return msg


def _under(path: Path, roots) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def _entries(text: str) -> list[str]:
    return [line.split("#", 1)[0].strip() for line in text.splitlines()]


def user_dirs(environ: Mapping[str, str], settings_file: Path | None) -> tuple[list[Path], list[str]]:
    """The folders the user allows (env var, then the settings file) and notes on ignored entries.

    An entry must be an absolute folder (after `~`); a relative one would depend on ComfyUI's working folder, so it
    is ignored and the refusal message says so."""
    sources = [(ALLOWED_DIRS_ENV, [e.strip() for e in environ.get(ALLOWED_DIRS_ENV, "").split(os.pathsep)])]
    dirs, notes = [], []
    if settings_file is not None:
        try:
            sources.append((str(settings_file), _entries(settings_file.read_text(encoding="utf-8"))))
        except FileNotFoundError:
            pass
        except (OSError, UnicodeDecodeError) as exc:
            notes.append(f"{settings_file} cannot be read ({exc}), so none of its folders is allowed")
    for where, entries in sources:
        for entry in entries:
            if not entry:
                continue
            path = Path(os.path.expanduser(entry))
            if not path.is_absolute():
                notes.append(f"{where}: {entry!r} is not an absolute path and was ignored")
                continue
            dirs.append(path.resolve())
    return dirs, notes


def make_policy(folders: Mapping[str, list[str]], environ: Mapping[str, str] | None = None,
                settings_file: str | os.PathLike | None = None, pack: str | os.PathLike | None = None) -> Policy:
    """The policy for ComfyUI's `folders` ({"output": [...], "input": [...], "temp": [...], "models": [...]}; the first
    entry of output / input / models is the base of relative paths; "custom_nodes": refused) plus the user's list.
    The `pack` folder is refused too: a graph must not rewrite the settings file or the code."""
    environ = os.environ if environ is None else environ
    settings = Path(settings_file) if settings_file is not None else None
    comfy = tuple(dict.fromkeys(Path(p).resolve() for kind, paths in folders.items() if kind != CODE
                                for p in paths if p))
    denied = [Path(p).resolve() for p in folders.get(CODE, []) if p]
    if pack is not None:
        denied.append(Path(pack).resolve())
    user, notes = user_dirs(environ, settings)
    bases = {kind: Path(folders[kind][0]).resolve() for kind in (INPUT, OUTPUT, MODELS)}
    return Policy(comfy, tuple(user), bases, settings, tuple(notes), tuple(dict.fromkeys(denied)))


def settings_file() -> Path:
    return pack_dir() / SETTINGS_NAME


def current_policy() -> Policy:
    """The policy of the running ComfyUI (its folders now, the environment, the settings file as it is now)."""
    # lazy: nodes/comfy.py imports ComfyUI's comfy_api: only this function needs it, the rest of paths works without
    from . import comfy

    return make_policy(comfy.comfy_folders(), os.environ, settings_file(), pack_dir())


# -- training configs ----------------------------------------------------------------------------------------------


def confine_tree(tree: dict, policy: Policy, skip: Callable[[str], bool] = lambda value: False) -> list[str]:
    """Check every path of a parsed training config (CONFIG_PATHS) and replace each by the path it resolves to.
    Returns one message per refused path; `skip(value)` is True for a value not known yet (a linked input)."""
    problems = []

    def check(table: dict, name: str, key: str, base: str) -> None:
        value = table.get(name)
        if not isinstance(value, str) or not value.strip() or skip(value):
            return  # a wrong type or an empty value is parse_config's to report
        try:
            table[name] = str(policy.resolve(value, key, base))
        except PathRefused as exc:
            problems.append(str(exc))

    for dotted, base in CONFIG_PATHS:
        *tables, name = dotted.split(".")
        if tables == ["dataset", "subsets"]:
            subsets = (tree.get("dataset") or {}).get("subsets") if isinstance(tree.get("dataset"), dict) else None
            for i, sub in enumerate(subsets if isinstance(subsets, list) else []):
                if isinstance(sub, dict):
                    check(sub, name, f"[[dataset.subsets]] #{i + 1} path", base)
            continue
        table = tree
        for part in tables:
            table = table.get(part) if isinstance(table, dict) else None
        if isinstance(table, dict):
            check(table, name, f"[{'.'.join(tables)}] {name}", base)
    return problems


def confine_toml(text: str, policy: Policy) -> str:
    """A training config's TOML text with every path checked and resolved; PathRefused listing every refusal.

    For a config that reaches a node as a value (Train, Audit, Cache): the Training config node has confined it
    already, but a posted graph may give a node any value."""
    try:
        tree = tomllib.loads(text)
    except ValueError as exc:
        raise ConfigError(f"the training config is not valid TOML: {exc}") from None
    problems = confine_tree(tree, policy)
    if problems:
        raise refused(problems)
    return tomlkit.dumps(tree)


def refused(problems: list[str]) -> PathRefused:
    if len(problems) == 1:
        return PathRefused(problems[0], problems)
    return PathRefused(f"{len(problems)} paths are outside the folders the Anima nodes may use:\n"
                       + "\n".join(f"  - {p}" for p in problems), problems)


# -- plain node inputs -----------------------------------------------------------------------------------------------

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # what anima_train.model.convert accepts as a Hugging Face repo id


def tokenizers_source(value: str, policy: Policy, key: str = "tokenizers") -> str:
    """Convert's `tokenizers`: "none", a Hugging Face repo id (passed on: downloaded into the HF cache), or a folder
    (confined, relative to models/). "owner/name" is a folder when models/owner/name is one."""
    value = value.strip()
    if value.lower() == "none":
        return value
    looks_like_path = value.startswith(("/", "~", ".")) or os.path.isabs(value)
    if not looks_like_path and _REPO_ID.fullmatch(value) and not (policy.bases[MODELS] / value).is_dir():
        return value
    return str(policy.resolve(value, key, MODELS))
