"""The name ComfyUI's Templates browser gives this pack's example workflows.

ComfyUI 0.29 lists a pack's `example_workflows/*.json` under the pack's *folder* name (`GET /workflow_templates`
answers {folder name: [template names]}), and its frontend (1.47) labels that category with the i18n message
`templateWorkflows.category.<folder name, "." -> "_">` when one exists, else with the folder name itself. Custom nodes
add i18n messages through `<pack>/locales/<lang>/main.json` (served, merged over every pack, by `GET /i18n`).

The folder name is whatever the user cloned or installed the pack as, so no shipped file can carry that key: at start
up (`comfy_entrypoint`) the pack writes `locales/<lang>/main.json` with the key for the folder it was loaded from,
labelled with the pack's display name. The frontend looks the key up in the UI's language only (vue-i18n `te`, no
fallback to English), so the label is written for every language frontend 1.47 ships; it is a name, the same in all.
The files are generated (git ignores them); other keys in them are kept. A read-only install keeps the folder name as
the label, and says so in the log.

The frontend takes nothing else from a pack for its templates: a card's title and description are the file name
(workflowTemplatesStore builds them as `title: name, description: name`; the README says so where it lists the
example workflows), so there is nothing more to write here.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from anchor.atomic import write_json

DISPLAY_NAME = "Anima Trainer"  # pyproject.toml [tool.comfy] DisplayName (tests/test_nodes_templates.py checks)
# the UI languages of ComfyUI's frontend 1.47 (its src/locales/); a language added later shows the folder name
LOCALES = ("en", "zh", "zh-TW", "ja", "ko", "ru", "fr", "es", "ar", "tr", "pt-BR", "fa", "he")

log = logging.getLogger(__name__)


def category_key(folder_name: str) -> str:
    """The frontend's i18n key for a custom-node template category (its normalizeI18nKey: "." -> "_")."""
    return folder_name.replace(".", "_")


def locale_messages(existing: dict, folder_name: str, label: str = DISPLAY_NAME) -> dict:
    """`existing` (a locales/<lang>/main.json) with the template category of `folder_name` labelled `label`."""
    messages = dict(existing)
    workflows = dict(messages.get("templateWorkflows") or {})
    category = dict(workflows.get("category") or {})
    category[category_key(folder_name)] = label
    workflows["category"] = category
    messages["templateWorkflows"] = workflows
    return messages


def name_template_category(pack_dir: str | os.PathLike, label: str = DISPLAY_NAME) -> list[Path] | None:
    """Write `<pack_dir>/locales/<lang>/main.json` for every language in LOCALES so that the Templates browser lists
    this pack's templates as `label` whatever the folder is called. Returns the files, or None when they could not
    be written (the label stays the folder name). `pack_dir` is the folder as ComfyUI loaded it (a symlink is not
    resolved: its name is the key)."""
    pack_dir = Path(pack_dir)
    paths = []
    for lang in LOCALES:
        path = pack_dir / "locales" / lang / "main.json"
        try:
            existing = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, ValueError):
            existing = {}
        if not isinstance(existing, dict):
            existing = {}
        messages = locale_messages(existing, pack_dir.name, label)
        paths.append(path)
        if messages == existing:
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, messages)
        except OSError as e:
            log.warning("Anima Trainer: could not write %s (%s); the Templates browser lists the example workflows "
                        "under the folder name %r", path, e, pack_dir.name)
            return None
    return paths
