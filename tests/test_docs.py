"""The design is written down inside the repository, and nothing in the repository points outside it.

* No text file names the research notes the project was first built from (their upper-case file names, the
  section sign they were cited with, the notes' folders or the build machine's absolute paths): a person who clones
  the repository cannot read them. Facts the code relies on live in docs/ (model.md, comfyui.md, anchor.md,
  sdnq.md, training.md, and the generated config.md).
* One folder beside the checkout is allowed, precisely: `shared/comfyui/` (as `../shared/comfyui/...`).
  It is the input of the CI harness (.ci/comfyui.sh extracts the ComfyUI snapshot from there, README says how to
  point it elsewhere), not a design reference.
* Every `docs/<file>` cited anywhere exists, and every `docs/<name>.md#<anchor>` names a heading of that file.
  Relative links inside docs/*.md and README.md resolve as well.

The patterns below are spelled so that this file does not match them itself (`[o]`, `[e]`, `\\u00a7`).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DESIGN_DOCS = ("model.md", "comfyui.md", "anchor.md", "sdnq.md", "training.md", "config.md")

OUTSIDE = [
    (re.compile(r"\b(CONFIG|MODEL|COMFYUI|SDNQ|ANCHOR|PEERS|WINDOWS|SCHEMA)\.md\b"), "a research note's file name"),
    (re.compile("\u00a7"), "a section sign (how the research notes were cited)"),
    (re.compile(r"/w[o]rk/"), "an absolute path of the build machine"),
    (re.compile(r"(?<![\w.-])(?:\.\./)?shar[e]d/(?!comfyui/)"), "a folder beside the checkout (only "
                                                                "shared/comfyui/, the CI snapshot, is allowed)"),
    (re.compile(r"\bspe[c]/|\bseeds?/0\d\d|\bsee[d] 0\d\d\b"), "the research notes' folders"),
]
SKIP_DIRS = {".git", "venv", "node_modules", "__pycache__", ".pytest_cache"}


def _candidate_files() -> list[Path]:
    """Tracked files plus new ones git does not ignore; without git (an unpacked archive), the tree."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True, timeout=60).stdout
        names = sorted({n for n in out.decode("utf-8", "surrogateescape").split("\0") if n})
        return [ROOT / n for n in names if not (set(Path(n).parts) & SKIP_DIRS)]
    except (OSError, subprocess.SubprocessError):
        found = []
        for folder, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith("venv")]
            found += [Path(folder) / f for f in files]
        return sorted(found)


def text_files() -> dict[str, str]:
    """{path relative to the root: text} of every text file (binary files, e.g. PNG or gzip, are skipped)."""
    out = {}
    for path in _candidate_files():
        try:
            data = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            continue  # deleted in the work tree, or a submodule folder
        if b"\0" in data:
            continue
        try:
            out[path.relative_to(ROOT).as_posix()] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return out


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    files = text_files()
    assert "README.md" in files and "anima_train/model/keymaps.py" in files, "the file listing missed the sources"
    return files


def test_the_design_docs_exist():
    missing = [name for name in DESIGN_DOCS if not (DOCS / name).is_file()]
    assert not missing, f"docs/ lacks {missing}"


def test_nothing_points_at_notes_outside_the_repository(texts):
    found = []
    for name, text in texts.items():
        for number, line in enumerate(text.splitlines(), 1):
            for pattern, what in OUTSIDE:
                if m := pattern.search(line):
                    found.append(f"{name}:{number}: {m.group(0)!r} ({what}): {line.strip()[:120]}")
    assert not found, ("references to files outside the repository; cite docs/<name>.md#<heading> instead:\n"
                       + "\n".join(found))


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation other than - and _ dropped, spaces -> -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, seen, fenced = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


CITATION = re.compile(r"(?<![\w/.-])docs/([\w.-]+\.(?:md|png))((?:#[\w-]+)?)")
# more headings of the same page may follow a citation: "docs/training.md#buckets, #tiers-and-the-audit and
# #curriculum", also across a line break (and a comment's "# ")
MORE_ANCHORS = re.compile(r"(?:,|\s+and|\s+or)\s+(?:#\s+)?(#[\w-]+)")


def cited_anchors(text: str, end: int) -> list[str]:
    found = []
    while m := MORE_ANCHORS.match(text, end):
        found.append(m.group(1))
        end = m.end()
    return found


def test_every_cited_doc_and_heading_exists(texts):
    bad = []
    for name, text in texts.items():
        for m in CITATION.finditer(text):
            where = f"{name}:{text.count(chr(10), 0, m.start()) + 1}"
            target = DOCS / m.group(1)
            if not target.is_file():
                bad.append(f"{where}: docs/{m.group(1)} does not exist")
                continue
            wanted = [m.group(2)] if m.group(2) else []
            if m.group(2) or target.suffix == ".md":
                wanted += cited_anchors(text, m.end())
            have = anchors(target) if target.suffix == ".md" else set()
            bad += [f"{where}: docs/{m.group(1)} has no heading {a}" for a in wanted if a[1:] not in have]
    assert not bad, "\n".join(bad)


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_relative_links_in_the_docs_resolve():
    bad = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for m in LINK.finditer(line):
                target = m.group(1)
                if re.match(r"[a-z]+:", target):
                    continue  # https:, mailto:
                file_part, _, anchor = target.partition("#")
                resolved = (page.parent / file_part).resolve() if file_part else page
                where = f"{page.relative_to(ROOT)}:{number}: {target}"
                if not resolved.exists():
                    bad.append(f"{where}: no such file")
                elif ROOT not in resolved.parents and resolved != ROOT:
                    bad.append(f"{where}: outside the repository")
                elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                    bad.append(f"{where}: no heading #{anchor}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------------------- what the docs quote of the code

ARCHITECTURE = DOCS / "architecture.md"
CITED_SOURCE = re.compile(r"(?<![\w/.<-])((?:anima_train|nodes|anchor|tests|bench|js)/[\w./-]*\w)")


def _exists(cited: str) -> bool:
    """A file or folder; `nodes/fixes.shown_on` is a name in nodes/fixes.py. (A name followed by `<`, `*` or `{` is
    a pattern, `nodes/nodes_<family>.py`, and not checked.)"""
    return (ROOT / cited).exists() or (ROOT / (cited.rpartition(".")[0] + ".py")).is_file()


def test_every_source_path_the_docs_cite_exists():
    """A doc that names a file of the repository (`anima_train/adapters/inject.py`, `tests/test_layers.py`) names one
    that exists: a moved or split module takes its docs with it."""
    bad = []
    for doc in sorted([*DOCS.glob("*.md"), ROOT / "README.md"]):
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            bad += [f"{doc.relative_to(ROOT)}:{n}: {m.group(1)}" for m in CITED_SOURCE.finditer(line)
                    if line[m.end():m.end() + 1] not in ("<", "*", "{") and not _exists(m.group(1))]
    assert not bad, "docs cite files that do not exist:\n  " + "\n  ".join(bad)


def test_the_architecture_names_every_adapter_method():
    """docs/architecture.md's `adapters/` line lists the methods by title, in the registry's (menu) order."""
    from anima_train import adapters

    text = ARCHITECTURE.read_text(encoding="utf-8")
    listed = re.search(r"^  adapters/\s+which weights train, one folder per method \(([^)]*)\)", text, re.M)
    assert listed, "docs/architecture.md: the adapters/ line no longer lists the methods"
    assert [s.strip() for s in listed.group(1).split(",")] == [m.title for m in adapters.METHODS.values()]


def test_the_count_of_function_local_imports_is_the_one_quoted():
    from tests.test_imports import function_local_imports, source_files

    text = " ".join(ARCHITECTURE.read_text(encoding="utf-8").split())
    quoted = re.search(r"; now (\d+), each with its reason", text)
    assert quoted, "docs/architecture.md (Imports) no longer quotes how many function-local imports remain"
    assert int(quoted.group(1)) == sum(len(function_local_imports(p)) for p in source_files())
