"""Scanning the source folders: images, captions and latent caches per folder, DreamBooth `N_name`
subfolders and their repeats, and each folder's source mode (docs/training.md: datasets)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from anima_train.config import MAX_REPEATS
from anima_train.data.cache_files import CACHE_NAME, CACHE_TAIL
from anima_train.data.errors import DatasetError, the_dataset
from anima_train.fixes import ref


IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")  # what sd-scripts accepts
# images a user may well drop in a dataset folder that are not read (animated or rarely decodable): said, not skipped
OTHER_IMAGE_EXTENSIONS = (".gif", ".tif", ".tiff", ".avif", ".heic", ".heif", ".jxl", ".jp2", ".ico", ".psd", ".svg")
_READ_EXTENSIONS = IMAGE_EXTENSIONS + OTHER_IMAGE_EXTENSIONS + (".txt", CACHE_TAIL)
REPEAT_FOLDER = re.compile(r"^(?P<n>\d+)_(?P<name>.+)$")  # sd-scripts DreamBooth folders: "10_char"
SOURCE_MODES = ("images", "latents", "encode", "auto")


# ----------------------------------------------------------------------------------------------------------
# Folders


@dataclass
class Folder:
    """One scanned directory: a source folder or one of its N_name subfolders."""

    subset: int  # index into the resolved subsets
    path: Path
    repeats: int  # folder factor x subset num_repeats
    texture: bool
    images: dict[str, Path] = field(default_factory=dict)  # stem -> image file
    caches: dict[str, list[Path]] = field(default_factory=dict)  # stem -> cache files
    captions: set[str] = field(default_factory=set)  # stems with a <stem>.txt
    unused: list[Path] = field(default_factory=list)  # images in a format the trainer does not read
    mode: str = ""  # images | latents | encode, once resolved


@dataclass
class Scan:
    folders: list[Folder]
    subsets: list  # SubsetConfig-like (path, num_repeats, texture)
    notes: list[str]  # things worth printing (ignored subfolders, ...)


def _entries(path: Path, want_dirs: bool) -> list[str]:
    """The sorted names of the files (or folders) in `path`, hidden ones left out. A symbolic link that loops or
    cannot be followed is refused by name: silently dropping it would drop the images the user put behind it."""
    names = []
    with os.scandir(path) as it:
        for e in sorted(it, key=lambda e: e.name):  # sorted: the first bad link named is the same on every run
            if e.name.startswith("."):
                continue
            try:
                kind = e.is_dir() if want_dirs else e.is_file()
                if not kind and not want_dirs and e.is_symlink() and e.name.lower().endswith(_READ_EXTENSIONS):
                    os.stat(e.path)  # a link to nothing is no file: an image (caption, cache) link is said, not skipped
            except OSError as exc:
                raise DatasetError(f"a link in {the_dataset()} is broken: remove it or point it at a real file or "
                                   f"folder\n{path / e.name}: a symbolic link that cannot be followed "
                                   f"({exc.strerror})") from None
            if kind:
                names.append(e.name)
    return sorted(names)


def _list_folder(folder: Folder) -> None:
    names = _entries(folder.path, want_dirs=False)
    for name in names:
        lower = name.lower()
        if lower.endswith(CACHE_TAIL):
            m = CACHE_NAME.match(name)
            if m:
                folder.caches.setdefault(m["stem"], []).append(folder.path / name)
        elif lower.endswith(".txt"):
            folder.captions.add(name[:-4])
        elif lower.endswith(OTHER_IMAGE_EXTENSIONS):
            folder.unused.append(folder.path / name)
        elif lower.endswith(IMAGE_EXTENSIONS):
            stem = name.rsplit(".", 1)[0]
            if stem in folder.images:
                raise DatasetError(
                    f"two images in {the_dataset()} share the stem {stem!r}: rename or remove one of them\n"
                    f"{folder.images[stem].name} and {name} in {folder.path} would share one caption and one cache")
            folder.images[stem] = folder.path / name


def scan_folders(subsets) -> Scan:
    """List every source folder and its N_name subfolders (see the module docstring)."""
    folders, notes = [], []
    for i, sub in enumerate(subsets):
        root = Path(sub.path).expanduser()
        if not root.is_dir():
            # no "in the config": `cache DIR` and `audit DIR` get here with a folder typed on the command line
            raise DatasetError(f"dataset folder {root} does not exist (or is not a folder): check the path")
        top = Folder(i, root, int(sub.num_repeats), bool(sub.texture))
        _list_folder(top)
        mine = [top]
        for name in _entries(root, want_dirs=True):
            m = REPEAT_FOLDER.match(name)
            if not m:
                notes.append(f"{root / name}: not scanned (only N_name subfolders such as 10_{name} are)")
                continue
            n = int(m["n"])
            if n < 1:
                raise DatasetError(f"rename folder {name} in {the_dataset()} to 1_{m['name']}: an N_name folder needs "
                                   f"N >= 1 repeats\n"
                                   f"{root / name}: an N_name folder needs N >= 1 repeats; rename it")
            if n * int(sub.num_repeats) > MAX_REPEATS:
                raise DatasetError(f"rename folder {name} in {the_dataset()} with a smaller N: "
                                   f"over {MAX_REPEATS} repeats\n"
                                   f"{root / name}: {n} x num_repeats {sub.num_repeats} = {n * int(sub.num_repeats)} "
                                   f"repeats is more than {MAX_REPEATS}; rename the folder with a smaller N")
            sub_folder = Folder(i, root / name, n * int(sub.num_repeats), bool(sub.texture))
            _list_folder(sub_folder)
            mine.append(sub_folder)
        unread = [p for f in mine for p in f.unused]
        mine = [f for f in mine if f.images or f.caches]
        if not mine:
            also = (f" ({len(unread)} image(s) in a format it does not read, e.g. {unread[0].name}: convert them to "
                    f"PNG)" if unread else "")
            raise DatasetError(f"no images in {the_dataset()}: give a folder of {' '.join(IMAGE_EXTENSIONS)} "
                               f"images\ndataset folder {root} holds no images ({' '.join(IMAGE_EXTENSIONS)}) and no "
                               f"*{CACHE_TAIL} caches{also}: check the path")
        folders += mine
    _refuse_twice_seen(folders)
    unused = [p for f in folders for p in f.unused]
    if unused:
        kinds = sorted({p.suffix.lower() for p in unused})
        notes.append(f"{len(unused)} image(s) in a format the trainer does not read ({' '.join(kinds)}) are left out, "
                     f"e.g. {unused[0]}: convert them to PNG to train on them")
    return Scan(folders, list(subsets), notes)


def _refuse_twice_seen(folders: list[Folder]) -> None:
    """One image file reached by two paths (a link `3_again -> .`, a folder linked into itself) would count as two
    sources, each with its own caption lookup and cache: refused, naming both paths."""
    seen: dict[tuple[int, int], Path] = {}
    twice = []
    for f in folders:
        for path in f.images.values():
            st = os.stat(path)
            first = seen.setdefault((st.st_dev, st.st_ino), path)
            if first != path:
                twice.append((path, first))
    if twice:
        shown = "\n".join(f"  {p} is {first}" for p, first in twice[:10])
        more = f"\n  ... and {len(twice) - 10} more" if len(twice) > 10 else ""
        raise DatasetError(f"{len(twice)} image file(s) in {the_dataset()} are reached by two paths: remove the link\n"
                           f"each would train as two sources (a symbolic or hard link):\n{shown}{more}\n(to weight "
                           f"a folder, name it N_name or set num_repeats)")


def resolve_modes(scan: Scan, source: str) -> str:
    """Give every folder its mode; all folders must agree (a batch is all pixels or all latents)."""
    if source not in SOURCE_MODES:
        raise DatasetError(f"[dataset] source = {source!r}: use one of {', '.join(SOURCE_MODES)}")
    for f in scan.folders:
        if source == "auto":
            f.mode = "images" if f.images else "latents"
        elif source in ("images", "encode") and not f.images:
            raise DatasetError(
                f'caches but no images in {the_dataset()}: set [dataset] source = "latents"\n'
                f'{f.path} has caches but no images, and source = "{source}" buckets from images: "latents" (or '
                f'"auto") trains on the caches')
        else:
            f.mode = source
    modes = {f.mode for f in scan.folders}
    if len(modes) > 1:
        lines = []
        for f in scan.folders:
            what = f"{len(f.images)} images" if f.images else f"{sum(map(len, f.caches.values()))} caches, no images"
            lines.append(f"  subset {f.subset} {f.path}: {f.mode} ({what})")
        raise DatasetError(
            f'mixed source modes: set [dataset] source = "latents" after {ref("name cache", "`anima-train cache`")} '
            "on the image folders\nthe dataset folders resolve to different source modes, but a batch must be all "
            "latents from one kind of source:\n" + "\n".join(lines) + "\n(or restore the images of the folders "
            "that hold caches only)")
    return modes.pop()
