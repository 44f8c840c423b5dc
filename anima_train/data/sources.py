"""Sources: one image (or one cached stem) with its original size, read from a scan; unreadable images and
missing or unreadable captions are refused here."""

from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from anima_train.data.cache_files import parse_wxh
from anima_train.data.captions import CaptionError, read_caption_files
from anima_train.data.errors import DatasetError, the_dataset
from anima_train.data.images import decoded_size, header_size
from anima_train.data.scan import Scan
from anima_train.errors import UserError
from anima_train.files import why_unreadable
from anima_train.fixes import ref


# ----------------------------------------------------------------------------------------------------------
# Sources: one image (or one cached stem) with its original size


@dataclass
class Source:
    folder: int  # index into Scan.folders
    stem: Path  # folder / stem
    image: Path | None
    size: tuple[int, int] | None  # original (w, h); None for a cache without original_size


def image_sources(scan: Scan, *, skip_unreadable: bool = False,
                  decode: bool = False) -> tuple[list[Source], list[tuple[Path, str]]]:
    """Sources from the image files, each sized as a viewer shows it (images.viewer_size). With `decode`, every
    image is decoded in full (in threads: PIL releases the GIL while decoding), so a truncated or corrupt file is
    found now, by name, not at the training step that first draws it; without, only headers are read (for images
    that are trained from their caches and never decoded). Unreadable images are all listed at once
    (UnreadableImages); with skip_unreadable they are left out and returned as (path, reason)."""
    todo = [(fi, f, stem, path) for fi, f in enumerate(scan.folders) if f.mode != "latents"
            for stem, path in f.images.items()]
    results = _read_sizes([job[3] for job in todo], decode)
    sources, bad = [], []
    for (fi, f, stem, path), (size, why) in zip(todo, results):
        if why is not None:
            bad.append((path, why))
        else:
            sources.append(Source(fi, f.path / stem, path, (int(size[0]), int(size[1]))))
    if bad and not skip_unreadable:
        raise UnreadableImages(bad)
    return sources, bad


def _read_sizes(paths: Sequence[Path], decode: bool) -> list[tuple[tuple[int, int] | None, str | None]]:
    """(viewer size, None) or (None, why it cannot be read) per path; decoding runs in threads."""
    def size_of(path):
        try:
            return (decoded_size if decode else header_size)(path), None
        except Exception as e:  # noqa: BLE001 (any failure to read the file is reported with its name)
            return None, read_failure(e)

    workers = max(1, min(8, os.cpu_count() or 1, len(paths))) if decode else 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(size_of, paths))


def find_undecodable(paths: Iterable[Path]) -> list[tuple[Path, str]]:
    """(path, why) for each image that cannot be decoded in full (threads)."""
    paths = sorted(set(paths))
    return [(p, why) for p, (_, why) in zip(paths, _read_sizes(paths, True)) if why is not None]


def read_failure(e: Exception) -> str:
    """Why an image cannot be read, in words (no exception class: a node shows this text as it is)."""
    text = str(e)
    if "truncated" in text.lower():
        return "truncated: the file ends early (an interrupted download or copy)"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    if "cannot identify image file" in text:  # Pillow's words for bytes of no format it reads
        return "not an image Pillow can decode (damaged, or another format under an image's name)"
    return text or "unreadable"


class UnreadableImages(DatasetError):
    """Images that cannot be decoded; `bad` = [(path, why)]. `anima-train cache` reports this as a data verdict."""

    def __init__(self, bad: Sequence[tuple[Path, str]]):
        shown = "\n".join(f"  {p}  ({why})" for p, why in bad[:50])
        more = f"\n  ... and {len(bad) - 50} more" if len(bad) > 50 else ""
        skip = ref("flag train --skip-unreadable", ", or skip them (--skip-unreadable on the command line, "
                                                   "skip_unreadable=True in code)")
        super().__init__(f"{len(bad)} image(s) cannot be read in {the_dataset()}: fix or delete them (re-download or "
                         f"re-export them){skip}\n{shown}{more}")
        self.bad = list(bad)


def cache_sources(scan: Scan, metadata: dict[Path, dict]) -> list[Source]:
    """Sources from cache files (latents mode): the size is the caches' `original_size` (None if absent)."""
    sources = []
    for fi, f in enumerate(scan.folders):
        if f.mode != "latents":
            continue
        for stem, paths in f.caches.items():
            sizes = [metadata[p]["original_size"] for p in paths if "original_size" in metadata[p]]
            size = parse_wxh(Counter(sizes).most_common(1)[0][0]) if sizes else None
            sources.append(Source(fi, f.path / stem, None, size))
    return sources


def missing_captions(scan: Scan, sources: Sequence[Source]) -> list[Path]:
    return [s.stem.with_name(s.stem.name + ".txt") for s in sources
            if s.stem.name not in scan.folders[s.folder].captions]


def refuse_missing_captions(missing: Sequence[Path], what: str = "image",
                            escape: str = "train them on an empty caption", command: str = "train") -> None:
    """Refuse uncaptioned sources, naming them and the ways out; `escape` = what --allow-missing-captions does in
    `command`."""
    there = [why for p in missing if os.path.lexists(p) and (why := why_unreadable(p, "a caption file"))]
    if there:  # a folder named <stem>.txt, ...: each with its own fix, below the line that says so
        raise DatasetError(f"{len(there)} caption file(s) in {the_dataset()} cannot be read: fix each as said "
                           f"below\n" + "\n".join(there))
    if missing:
        shown = "\n".join(f"  {p}" for p in missing[:50])
        more = f"\n  ... and {len(missing) - 50} more" if len(missing) > 50 else ""
        escape = ref(f"flag {command} --allow-missing-captions", f", or pass --allow-missing-captions to {escape}")
        raise DatasetError(f"{len(missing)} {what}(s) have no caption file in {the_dataset()}: write a <stem>.txt "
                           f"(tags) for each, or delete the {what}s{escape}\n{shown}{more}")


def refuse_unreadable_captions(sources: Sequence[Source]) -> None:
    """Read every caption now (tags and NL), so that a bad file stops the run before training, not at the step
    that first draws it; all bad files are listed at once."""
    bad, encoding = [], 0
    for s in sources:
        try:
            read_caption_files(s.stem)
        except FileNotFoundError:
            continue  # missing captions are refuse_missing_captions' business
        except CaptionError as e:
            bad.append(f"{e.path} {e.problem}: re-save it as UTF-8 (in most editors: Save As, encoding UTF-8)")
            encoding += 1
        except (UserError, OSError) as e:  # a folder, no read permission: the reader policy's own fix
            bad.append(str(e))
    if bad:
        shown = "\n".join(f"  {line}" for line in bad[:50])
        more = f"\n  ... and {len(bad) - 50} more" if len(bad) > 50 else ""
        fix = "re-save each as UTF-8" if encoding == len(bad) else "fix each as said below"
        raise DatasetError(f"{len(bad)} caption file(s) cannot be read in {the_dataset()}: {fix}, then run "
                           f"again\n{shown}{more}")
