"""Caption building (docs/training.md#captions): a fresh caption on every __getitem__.

Files: `<stem>.txt` holds the tags (delimited by `tag_delimiter`, default ", "); an optional `<stem>_nl.txt`
next to it holds a natural-language caption. `read_caption_files(stem)` reads both. Captions are UTF-8 (a byte-order
mark is allowed and dropped); any other encoding is refused with the file's name, never guessed: a Latin-1/cp1252
byte sequence can also be valid in another code page, and a wrongly decoded tag would train silently.

Per call, in this order:
  1. caption dropout: with probability `caption_dropout_percent` the caption is "" (unconditional, for CFG);
  2. variant: `caption_mode`, or under "mixed" a draw weighted by the positive `mixed_weights` (none positive
     -> "tags"); an NL variant without NL text falls back to "tags";
  3. tags: split on the trimmed delimiter and on line breaks, strip, drop empties; the first
     `shuffle_keep_first_n` are pinned;
     `protected_tags` (case-insensitive) are never dropped; round(droppable · tag_dropout_percent) random
     droppable tags are removed, capped so at least `min_tags_kept` tags remain; order kept, then the
     unpinned tail is shuffled if `shuffle_tags`; joined with `tag_delimiter`;
  4. NL: if `nl_shuffle_sentences`, sentences (split on ". ") are shuffled, the first pinned if
     `nl_keep_first_sentence`, and the text ends with a "." again;
  5. "tags_nl" = "<tags>. <nl>", "nl_tags" = "<nl> <tags>" (the NL alone when no tag survives).

Randomness comes from a private random.Random seeded from (seed, epoch, index) only: the same sample in the
same epoch gives the same caption in any worker or rank, a new epoch gives a new view, and the global `random`
state is never read or advanced. Each random step draws the same amount whatever the options, so switching one
option on does not reshuffle the others' streams.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Mapping

from anima_train.config.constants import CAPTION_VARIANTS
from anima_train.errors import UserError
from anima_train.files import why_unreadable

NL_SUFFIX = "_nl"


def caption_rng(seed: int, epoch: int, index: int) -> random.Random:
    """A private generator for one sample in one epoch. A str seed is hashed with SHA-512 by random.Random,
    so the stream is the same across processes and Python runs (unlike hash())."""
    return random.Random(f"anima-caption/{int(seed)}/{int(epoch)}/{int(index)}")


class CaptionError(UserError, ValueError):
    """A caption file that cannot be used as it is; the message names the file and the fix."""

    def __init__(self, path: Path, problem: str, fix: str):
        super().__init__(f"caption {path} {problem}: {fix}")
        self.path, self.problem = path, problem


def read_caption_file(path: str | Path) -> str:
    """One caption file as text: UTF-8, with or without a byte-order mark."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise  # a missing caption is its callers' business (refused, or trained on an empty caption)
    except OSError as exc:  # a folder, no read permission, ...: the reader policy's message and fix
        raise UserError(why_unreadable(path, "a caption file") or f"caption {path}: {exc.strerror}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        start = max(0, e.start - 20)
        near = data[start:e.end + 20].decode("utf-8", errors="replace")
        raise CaptionError(path, f"is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}, near {near!r})",
                           "re-save it as UTF-8") from None


def read_caption_files(stem: str | Path) -> tuple[str, str | None]:
    """(tags text, NL text or None) for `<stem>.txt` and the optional `<stem>_nl.txt`."""
    stem = Path(stem)
    tags_path = stem.with_name(stem.name + ".txt")
    nl_path = stem.with_name(stem.name + NL_SUFFIX + ".txt")
    if not tags_path.is_file():
        raise FileNotFoundError(f"caption file {tags_path} is missing: every image/cache needs a <stem>.txt")
    tags = read_caption_file(tags_path)
    nl = read_caption_file(nl_path) if nl_path.is_file() else None
    return tags, nl


def split_tags(text: str, delimiter: str) -> list[str]:
    """Split on the delimiter without its surrounding spaces (", " also splits "a,b"), and on line breaks (tags on two
    lines are two tags, not `big\nsquare` glued into one); whitespace-only delimiters split on any whitespace."""
    sep = delimiter.strip()
    parts = [p for line in text.splitlines() for p in line.split(sep)] if sep else text.split()
    return [p.strip() for p in parts if p.strip()]


def process_tags(tags: list[str], options, rng: random.Random, protected: frozenset[str]) -> list[str]:
    """Pinning, protected tags, tag dropout with the min_tags_kept floor, then the shuffle of the tail."""
    shuffle_rng = random.Random(rng.getrandbits(64))  # split first: the dropout count cannot move the shuffle
    n_pinned = max(0, int(options.shuffle_keep_first_n))
    droppable = [i for i in range(n_pinned, len(tags)) if tags[i].lower() not in protected]
    n_drop = round(len(droppable) * float(options.tag_dropout_percent))
    n_drop = max(0, min(n_drop, len(tags) - int(options.min_tags_kept)))
    dropped = set(rng.sample(droppable, n_drop)) if n_drop else set()
    kept = [t for i, t in enumerate(tags) if i not in dropped]
    head, tail = kept[:n_pinned], kept[n_pinned:]
    if options.shuffle_tags:
        shuffle_rng.shuffle(tail)
    return head + tail


def process_nl(text: str, options, rng: random.Random) -> str:
    text = text.strip()
    if not options.nl_shuffle_sentences:
        return text
    if text.endswith("."):
        text = text[:-1]  # the split removes the other sentences' periods; put this one back at the end
    sentences = [s.strip() for s in text.split(". ") if s.strip()]
    head = sentences[:1] if options.nl_keep_first_sentence else []
    tail = sentences[len(head):]
    rng.shuffle(tail)
    text = ". ".join(head + tail)
    return text if text.endswith((".", "!", "?")) else text + "."


def choose_variant(options, rng: random.Random) -> str:
    """The caption variant: fixed, or a weighted draw under "mixed" (positive weights only)."""
    mode = options.caption_mode  # load_config checked it and the mixed_weights keys (one check, where they enter)
    draw = rng.random()  # drawn in every mode, so the later draws do not depend on the mode
    if mode != "mixed":
        return mode
    weights: Mapping[str, float] = options.mixed_weights or {}
    positive = [(v, float(weights.get(v, 0.0))) for v in CAPTION_VARIANTS if float(weights.get(v, 0.0)) > 0]
    if not positive:
        return "tags"
    target = draw * sum(w for _, w in positive)
    for variant, w in positive:
        target -= w
        if target < 0:
            return variant
    return positive[-1][0]  # float rounding at the top end


def build_caption(
    tags_text: str, nl_text: str | None, options, seed: int, epoch: int, index: int
) -> str:
    """The caption for sample `index` in `epoch`; deterministic in (seed, epoch, index) and the options (the
    config's `[dataset.caption]` table, a CaptionConfig, as load_config checked it)."""
    rng = caption_rng(seed, epoch, index)
    dropout = rng.random()
    variant = choose_variant(options, rng)
    # the tag and NL steps get their own streams, so e.g. NL shuffling never moves the tag draws
    tag_rng = random.Random(rng.getrandbits(64))
    nl_rng = random.Random(rng.getrandbits(64))
    if dropout < float(options.caption_dropout_percent):
        return ""
    nl = nl_text.strip() if nl_text else ""
    if variant != "tags" and not nl:
        variant = "tags"

    tags = ""
    if variant != "nl":
        kept = process_tags(split_tags(tags_text, options.tag_delimiter), options, tag_rng, options.protected_tag_set())
        tags = options.tag_delimiter.join(kept)
    if variant == "tags":
        return tags
    nl = process_nl(nl, options, nl_rng)
    if variant == "nl" or not tags:
        return nl
    if variant == "tags_nl":
        return f"{tags}. {nl}"
    return f"{nl} {tags}"
