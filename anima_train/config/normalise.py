"""Putting what the config's keys say into the form the rest of the trainer reads, after every key's own check
(`validate` runs NORMALISE before rules.RULES, NORMALISE_AFTER after them): tiers ascending, every caption variant
weighed, the files and folder a key names read or resolved from the config's folder, the curriculum's phases in
order.

The only code that writes to a table while it is built. The rules read a table and report; a step here changes only
a value its key check passed, and the same value the rules then find valid, so every message is the one the rules
would give either way. No import of the tables: this module only reads and sets their attributes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from anima_train.config.constants import CAPTION_VARIANTS
from anima_train.config.keys import Problems


def named_path(value: str, base_dir: Path) -> Path:
    """A file or folder a config key names: relative paths are read from the config file's folder."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else base_dir / path


def text_lines(path: Path) -> list[str] | OSError | UnicodeDecodeError:
    """The lines of a UTF-8 text file, or why it cannot be read."""
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        return exc


def prompt_lines(lines: list[str]) -> list[str]:
    """The prompts of a prompts_file: one per line, stripped; blank lines and # comments skipped."""
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def parse_protected_tags(lines: Iterable[str]) -> list[str]:
    """The tags of a protected_tags_file, in file order: one per line, lower-cased; blank lines and # comments
    skipped. (load_config reads the file, relative to the config's folder, and keeps these in
    CaptionConfig.file_protected_tags; the captions read them there.)"""
    return [s.strip().lower() for s in lines if s.strip() and not s.strip().startswith("#")]


def _sorted_tiers(d, p: Problems, ctx, w) -> None:
    both = {"resolution", "resolutions"} <= ctx.given("dataset", d)
    if not both and d.resolutions and p.ok("dataset.resolutions") and all(r > 0 for r in d.resolutions):
        d.resolutions = sorted(set(d.resolutions))


def _weighed_variants(c, p: Problems, ctx, w) -> None:
    # Omitted variants weigh 0: a table { tags = 1 } means tags only.
    if (p.ok("dataset.caption.mixed_weights") and all(k in CAPTION_VARIANTS for k in c.mixed_weights)
            and all(weight >= 0 for weight in c.mixed_weights.values())):
        c.mixed_weights = {k: c.mixed_weights.get(k, 0.0) for k in CAPTION_VARIANTS}


def _protected_tags_read(c, p: Problems, ctx, w) -> None:
    if c.protected_tags_file is not None and ctx.base_dir is not None and p.ok("dataset.caption.protected_tags_file"):
        lines = text_lines(named_path(c.protected_tags_file, ctx.base_dir))
        if isinstance(lines, list):  # a file that cannot be read is _caption's to report
            c.file_protected_tags = parse_protected_tags(lines)


def _prompts_read(s, p: Problems, ctx, w) -> None:
    if s.prompts_file is not None and ctx.base_dir is not None and p.ok("sample.prompts_file"):
        lines = text_lines(named_path(s.prompts_file, ctx.base_dir))
        if isinstance(lines, list):  # a file that cannot be read is _sample_prompts_file's to report
            s.file_prompts = prompt_lines(lines)


def _validation_folder_resolved(v, p: Problems, ctx, w) -> None:
    if v.folder is not None and ctx.base_dir is not None and p.ok("validation.folder"):
        path = named_path(v.folder, ctx.base_dir)
        if path.is_dir():  # one that is not is _validation's to report
            v.folder = str(path)


def _phases_in_order(cfg, p: Problems, ctx, w) -> None:
    if cfg.curriculum and all(p.ok(f"curriculum[{i}].at") for i in range(len(cfg.curriculum))):
        cfg.curriculum.sort(key=lambda ph: ph.at)


# (scope, step) run after every key's own check and before RULES: what the rules read is in its final form
NORMALISE = [
    ("dataset", _sorted_tiers),
    ("dataset.caption", _weighed_variants),
    ("dataset.caption", _protected_tags_read),
    ("sample", _prompts_read),
    ("validation", _validation_folder_resolved),
]
# (scope, step) run after RULES: the phase rules name each [[curriculum]] table by its place in the file
NORMALISE_AFTER = [
    ("", _phases_in_order),
]
