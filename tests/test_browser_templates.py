"""The Templates browser of the real ComfyUI frontend lists the example workflows under the pack's name, with their
pictures, when the pack is installed under a folder name of the user's choosing.

tests/browser/templates.cjs opens the Templates dialog with the side bar's button, as a user does, and reads back the
labels of its "Extensions" group and, for each, the page title and every card (title, description, picture). The
pack is installed as custom_nodes/my-anima-clone (not its own name): ComfyUI 0.29 keys a pack's templates by folder
name, and frontend 1.47 shows that name unless an i18n message `templateWorkflows.category.<folder>` names it, which
the pack writes at start-up (nodes/templates.py). The frontend looks that message up in the UI's language only, so
the test runs in English and in Chinese (the Comfy.Locale setting).

Title and description: frontend 1.47 builds every custom-node template card from the file name alone
(workflowTemplatesStore: `title: name, description: name`; getTemplateDescription turns "-" and "_" into spaces);
ComfyUI 0.29 serves only the names. Nothing the pack ships can change them, so the test pins what the UI shows: when
a frontend starts reading a description from somewhere, this fails and says what it shows.

ANIMA_TEMPLATES_SCREENSHOT=<path>: also write the dialog, showing the pack's category, there.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from PIL import Image

from nodes.templates import DISPLAY_NAME
from tests import comfy_browser

pytestmark = [pytest.mark.comfyui, pytest.mark.slow]

ROOT = comfy_browser.ROOT
DRIVER = comfy_browser.BROWSER_DIR / "templates.cjs"
FOLDER = "my-anima-clone"  # the folder a user cloned the pack as: not the pack's name
WORKFLOWS = sorted(p.stem for p in (ROOT / "example_workflows").glob("*.json"))


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    tools = comfy_browser.browser_tools()
    base = comfy_browser.base_folder(tmp_path_factory.mktemp("comfy_base"), folder=FOLDER)
    with comfy_browser.serve(base, "AnimaTrainConfig") as (url, _):
        yield {"url": url, "base": base, **tools}


# UI language -> the title of the Templates browser's "Extensions" group in it (frontend 1.47's locales)
LANGUAGES = {"en": "Extensions", "zh": "扩展"}


@pytest.mark.parametrize("locale", LANGUAGES)
def test_templates_browser_lists_the_examples_under_the_packs_name(comfy, locale, tmp_path):
    settings = comfy["base"] / comfy_browser.SETTINGS  # read by the server on every request
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "Comfy.Locale": locale}))
    cfg = {"url": comfy["url"] + "/", "chromium": comfy["chromium"], "userDataDir": str(tmp_path / "chrome"),
           "outDir": str(tmp_path), "extensionsTitle": LANGUAGES[locale],
           "shot": os.environ.get("ANIMA_TEMPLATES_SCREENSHOT") if locale == "en" else None}
    run = subprocess.run([comfy["node"], str(DRIVER), json.dumps(cfg)], cwd=comfy_browser.BROWSER_DIR,
                         capture_output=True, text=True, timeout=400)
    server_log = (comfy["base"] / "server.log").read_text()[-4000:]
    assert run.returncode == 0, f"browser driver failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}\n{server_log}"
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["pageErrors"] == [], r["pageErrors"]
    print("\nTEMPLATES DIALOG", json.dumps({"extensions": r["extensions"]}, indent=1))

    # 1. the category: one extension (ours), labelled with the pack's name in the side panel and as the page title
    assert r["extensionLabels"] == [DISPLAY_NAME], \
        f"the Templates browser's Extensions group ({locale}) shows {r['extensionLabels']}, not {DISPLAY_NAME!r} " \
        f"(the pack installed as custom_nodes/{FOLDER})"
    shown = r["extensions"][0]
    assert shown["pageTitle"] == [DISPLAY_NAME], shown["pageTitle"]

    # 2. every example workflow is a card there, with its picture (example_workflows/<name>.jpg) loaded
    cards = {c["name"]: c for c in shown["cards"]}
    assert sorted(cards) == WORKFLOWS, sorted(cards)
    for name, card in cards.items():
        with Image.open(ROOT / "example_workflows" / f"{name}.jpg") as picture:
            size = list(picture.size)
        # the dialog shows it from a blob: URL of what it fetched, so the loaded size says which picture it is
        assert card["pictures"] and all([p["width"], p["height"]] == size for p in card["pictures"]), \
            (name, size, card["pictures"])

    # 3. title and description: what frontend 1.47 makes of the file name (the module docstring says why)
    for name, card in cards.items():
        assert (card["title"], card["description"]) == (name, name.replace("_", " ").replace("-", " ")), \
            f"the card of {name} now shows title {card['title']!r}, description {card['description']!r}: " \
            "this frontend reads them from somewhere; give the templates a real title and description there"
