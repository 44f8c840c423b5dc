"""Every refusal a node can show says its fix in ComfyUI terms: a widget, a node, a value; never a shell command, a
flag, a python path or a config key spelled for a TOML file the user never sees.

The walk below plays a ComfyUI user into each kind of refusal the nodes can reach: the Training config's gate (a
value, several problems at once, a model folder that is no repo, a folder the nodes may not use, a key typed in
extra_toml), the data verdicts and refusals of Audit and Cache, Convert's checks of its files, the Train node's
worker refusing a dataset without caches, Load and Encode prompt given a bad path. Each message is read as the node
shows it (the text ComfyUI puts on the node and in its "Validation failed" popup: str() of what the method raised,
or the node's report), and must hold no shell text, and its first line must fit the popup (120 characters) and name
what to set. The CLI keeps its own words (tests/test_cli_errors.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.fixtures_tiny import anima_train_cli

FIRST_LINE = 120
# Text a ComfyUI user cannot act on: a shell command, a flag, a python path, an exception's class, a reference token
# nobody rendered, or a config key spelled the TOML way where a widget sets it (extra_toml keys say "extra_toml").
SHELL = re.compile(r"anima-train|python|-m anima_train|(?<![\w-])--[a-z]|Traceback|[A-Z]\w+Error\b|\u27e6|\u27e7"
                   r"|(?<!extra_toml )\[\[?[a-z_.]+\]\]?(?: #\d+)? [a-z_]+ = ")


@pytest.fixture
def node_env(monkeypatch, tmp_path, tiny_anima):
    """The pack's node modules on the ComfyUI double; ComfyUI's folders under tmp_path (its input folder is tmp_path
    itself), the tiny model's folder allowed as a user would, the three model files as Convert lists them."""
    from tests import comfy_double

    comfy_double.install(monkeypatch)
    import nodes.comfy as comfy
    import nodes.nodes_dataset as nd
    import nodes.nodes_train as nt

    comfy_double.install_folders(monkeypatch, comfy, tmp_path, allowed=[tiny_anima.diffusers_dir.parent])
    files = {"diffusion_models": tmp_path / "models" / "diffusion_models", "vae": Path(tiny_anima.vae_file).parent,
             "text_encoders": Path(tiny_anima.qwen3_file).parent, "loras": tmp_path / "models" / "loras"}
    monkeypatch.setattr(comfy, "model_path", lambda kind, name: str(files[kind] / name))
    monkeypatch.setattr(comfy, "model_folder", lambda kind: str(files[kind]))
    monkeypatch.setattr(comfy, "model_files", lambda kind: [])
    monkeypatch.setattr(comfy, "free_vram", lambda: None)
    monkeypatch.setattr(comfy, "throw_if_interrupted", lambda: None)
    monkeypatch.setattr(comfy, "client_id", lambda: "client-1")
    monkeypatch.setattr(comfy, "prompt_id", lambda: "prompt-1")
    monkeypatch.setattr(comfy, "send_event", lambda data, sid=None: None)
    monkeypatch.setattr(comfy, "progress_bar", lambda total, node_id=None: type(
        "Bar", (), {"update_absolute": lambda self, value, total=None: None})())
    return type("Env", (), dict(nt=nt, nd=nd, comfy=comfy, tmp=tmp_path, files=files))


def _images(folder: Path, captions: bool = True) -> Path:
    from anima_train.model.tiny import make_synthetic_dataset

    make_synthetic_dataset(folder, n=3, sizes=[(64, 64)])
    if not captions:
        for txt in folder.glob("*.txt"):
            txt.unlink()
    return folder


def _widgets(nt, **over) -> dict:
    values = {p.id: p.options.get("default") for p in nt.AnimaTrainConfig.define_schema().inputs}
    values.update(over)
    return values


def _shown(call) -> str:
    """What the node shows when `call` raises: the text ComfyUI puts on the node and in its popup."""
    with pytest.raises(Exception) as refused:  # noqa: PT011 (each node raises its own kind; the text is the point)
        call()
    return str(refused.value)


def _check(name: str, text: str, names: tuple[str, ...] = ()) -> None:
    """No shell text anywhere; a first line that fits the popup and names one of `names` (the widgets and nodes
    that fix it)."""
    first = text.splitlines()[0] if text else ""
    assert not SHELL.search(text), f"{name}: shell text {SHELL.search(text).group(0)!r} on the node:\n{text}"
    assert len(first) <= FIRST_LINE, f"{name}: first line of {len(first)} characters:\n{text}"
    if names:
        assert any(n in first for n in names), f"{name}: the first line names none of {names}:\n{text}"


def test_the_training_config_gate_says_widgets(node_env, tiny_anima):
    nt, data = node_env.nt, _images(node_env.tmp / "data")
    good = _widgets(nt, model_path=str(tiny_anima.diffusers_dir), dataset_path=str(data))
    assert nt.AnimaTrainConfig.validate_inputs(**good) is True

    def refused(**over) -> str:
        return _shown(lambda: nt.AnimaTrainConfig.validate_inputs(**dict(good, **over)))

    lr = refused(learning_rate=0.0)
    lr_hint = " (LoRAs train at about 1e-4, Prodigy-style optimizers at 1.0)"  # the key's own bound hint
    assert lr.splitlines()[0] == "learning_rate = 0.0: must be > 0.0" + lr_hint, lr  # the widget, not "[optimizer] lr"
    _check("lr", lr, ("learning_rate",))
    typed = refused(extra_toml="[optimizer]\nlr = 0\n")  # typed into extra_toml, which wins: fixed there
    assert typed.splitlines()[0] == "extra_toml [optimizer] lr = 0.0: must be > 0.0" + lr_hint, typed
    _check("extra_toml", typed, ("extra_toml",))
    no_repo = refused(model_path=str(data))  # a folder of images, not a converted model
    _check("model", no_repo, ("model_path",))
    assert 'run "Anima: Convert checkpoint"' in no_repo, no_repo
    outside = refused(dataset_path="/nope/elsewhere")
    _check("confined", outside, ("dataset_path",))
    foreign = refused(extra_toml="[train]\ncache_latents = true\n")  # sd-scripts' key: what to do instead
    _check("foreign key", foreign)
    assert '"Anima: Cache latents"' in foreign, foreign


def test_several_config_problems_are_shown_together_each_once(node_env, tiny_anima, tmp_path):
    """lr = 0 and a dataset folder that does not exist: both, in one message, each once (the folder check used to
    run only once the values passed, so the user fixed one, queued again and met the other)."""
    nt = node_env.nt
    values = _widgets(nt, model_path=str(tiny_anima.diffusers_dir), dataset_path=str(node_env.tmp / "my_datset"),
                      learning_rate=0.0)
    text = _shown(lambda: nt.AnimaTrainConfig.validate_inputs(**values))
    _check("two problems", text, ("learning_rate",))
    assert text.count("learning_rate = 0.0") == 1 and text.count("my_datset") == 2, text  # its value and its path
    assert text.count("dataset folder not found") == 1 and "dataset_path" in text, text

    # the template's empty dataset_path beside another problem: both said, the empty folder as the widget to set
    # (it was refused alone before the values were checked: the user met lr = 0 only after setting the folder)
    empty = _shown(lambda: nt.AnimaTrainConfig.validate_inputs(**dict(values, dataset_path="")))
    assert empty.count("learning_rate = 0.0") == 1, empty
    assert empty.count('set the dataset_path widget on "Anima: Training config"') == 1, empty
    assert "[dataset]" not in empty and "subsets" not in empty, empty

    # the shell: the same two problems in one message, named the TOML way, exit 2
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[train]\nmodel_path = "{tiny_anima.diffusers_dir}"\n[dataset]\npath = "{tmp_path / "nope"}"\n'
                   f"[optimizer]\nlr = 0\n")
    out = anima_train_cli("train", cfg, "--dry-run", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"anima-train train: error: {cfg}: 2 problems in the config:\n"), out.stderr
    assert out.stderr.count("[optimizer] lr = 0.0: must be > 0.0") == 1, out.stderr
    assert out.stderr.count("[dataset] path = ") == 1 and "dataset folder not found" in out.stderr, out.stderr


def test_audit_cache_and_convert_say_their_widgets(node_env, tiny_anima):
    nd = node_env.nd
    data = _images(node_env.tmp / "data")
    # the data verdict: no caches, so NOT SAFE, with the node that makes them and the widget the VAE check needs
    report = nd.AnimaTrainAudit.execute(dataset_dir=str(data), resolutions="64").values[0]
    assert "NOT SAFE" in report, report  # the child got as far as its verdict
    assert not SHELL.search(report), f"shell text {SHELL.search(report).group(0)!r} in the report:\n{report}"
    assert '"Anima: Cache latents"' in report and 'model_path on "Anima: Audit dataset"' in report, report

    bare = _images(node_env.tmp / "bare", captions=False)
    uncaptioned = _shown(lambda: nd.AnimaTrainCache.execute(dataset_dir=str(bare), resolutions="64", dry_run=True))
    assert "have no caption file" in uncaptioned, uncaptioned  # the child refused the captions
    _check("cache captions", uncaptioned, ("dataset_dir",))
    assert 'allow_missing_captions on "Anima: Cache latents"' in uncaptioned, uncaptioned

    missing = _shown(lambda: nd.AnimaTrainCache.execute(dataset_dir=str(data / "nope"), resolutions="64"))
    _check("cache folder", missing, ("dataset_dir",))
    outside = _shown(lambda: nd.AnimaTrainAudit.execute(dataset_dir="/nope/elsewhere", resolutions="64"))
    _check("audit confined", outside, ("dataset_dir",))

    broken = node_env.files["diffusion_models"] / "broken.safetensors"
    broken.parent.mkdir(parents=True, exist_ok=True)
    broken.write_bytes(b"not a safetensors file")
    convert = _shown(lambda: nd.AnimaTrainConvert.execute(
        anima=broken.name, qwen=Path(tiny_anima.qwen3_file).name, vae=Path(tiny_anima.vae_file).name,
        out_dir=str(node_env.tmp / "models" / "repo"), tokenizers="none"))
    assert "cannot read it as safetensors" in convert, convert  # the child read the file
    _check("convert", convert, ("anima",))


def test_the_train_node_says_how_to_make_the_missing_caches(node_env, tiny_anima):
    nt = node_env.nt
    data = _images(node_env.tmp / "data")
    config = nt.AnimaTrainConfig.execute(**_widgets(nt, model_path=str(tiny_anima.diffusers_dir),
                                                    dataset_path=str(data), resolution=64, source="images",
                                                    run_name="cat")).values[0]
    nt.AnimaTrainTrain.hidden = type("H", (), {"unique_id": "5"})()
    try:
        text = _shown(lambda: nt.AnimaTrainTrain.execute(config=config))
    finally:
        del nt.AnimaTrainTrain.hidden
    assert "have no valid latent cache" in text, text  # the worker got as far as the dataset's caches
    _check("train caches", text)
    assert 'run "Anima: Cache latents"' in text and 'source = "encode"' in text, text


def test_load_and_encode_say_their_widgets(node_env, tiny_anima):
    nt = node_env.nt
    gone = _shown(lambda: nt.AnimaLoadTrainedLora.execute(model=None, lora_path="gone.safetensors"))
    _check("load", gone, ("lora_path",))
    outside = _shown(lambda: nt.AnimaLoadTrainedLora.execute(model=None, lora_path="/nope/x.safetensors"))
    _check("load confined", outside, ("lora_path",))
    no_repo = _shown(lambda: nt.AnimaTrainTextEncode.execute(model_path=str(node_env.tmp), text="a cat"))
    _check("encode", no_repo, ("model_path",))
    assert 'run "Anima: Convert checkpoint"' in no_repo, no_repo


def test_every_node_and_widget_a_fix_names_exists(node_env):
    """The clauses of nodes/fixes.py name nodes and widgets by their shown names: each must be one."""
    from nodes import fixes, nodes_dataset, nodes_train

    schemas = {c.define_schema().node_id: c.define_schema() for c in nodes_dataset.NODES + nodes_train.NODES}
    for node_id, widgets in fixes.WIDGETS_NAMED.items():
        inputs = {p.id for p in schemas[node_id].inputs}
        assert set(widgets) <= inputs, (node_id, set(widgets) - inputs)
    # every reference the trainer writes has the node's words for it
    root = Path(__file__).resolve().parents[1] / "anima_train"
    written = {m.group(1) for f in root.rglob("*.py") for m in re.finditer(r'\bref\(\s*"([^"]+)"', f.read_text())}
    written |= {"flag train --allow-missing-captions", "flag cache --allow-missing-captions"}  # f-strings: these
    written |= {f"flag convert --{flag}" for flag in ("anima", "qwen", "vae", "tokenizers", "out")}
    assert {"run convert", "run cache", "flag audit --model"} <= written, written
    assert written <= set(fixes.CLAUSES), written - set(fixes.CLAUSES)
    shown = {s.display_name for s in schemas.values()}
    for name in (fixes.TRAINING_CONFIG, fixes.CONVERT, fixes.AUDIT, fixes.CACHE, fixes.TRAIN, fixes.LOAD):
        assert name in shown, name


def test_the_shell_keeps_its_words(monkeypatch):
    """Outside a node's process the same references are the CLI's text; a worker child writes tokens."""
    from anima_train import fixes
    from anima_train.model.components import ModelRepoError, check_repo

    monkeypatch.delenv(fixes.REFS_ENV, raising=False)
    with pytest.raises(ModelRepoError, match=r"`anima-train convert --anima F --qwen F --vae F --out DIR`"):
        check_repo("/nope/model")
    with fixes.writing_refs(), pytest.raises(ModelRepoError) as refused:
        check_repo("/nope/model")
    assert "\u27e6run convert\u27e7" in str(refused.value) and "anima-train" not in str(refused.value)
    monkeypatch.setenv(fixes.REFS_ENV, "refs")
    assert fixes.ref("run cache", "x") == "\u27e6run cache\u27e7"


def _no_images(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("not an image\n")
    return folder


def _uncaptioned(folder: Path) -> Path:
    return _images(folder, captions=False)


def _bad_caption(folder: Path) -> Path:
    _images(folder)
    next(folder.glob("*.txt")).write_bytes(b"a cat, \xff\xfe tags\n")
    return folder


def _bad_image(folder: Path) -> Path:
    _images(folder)
    next(folder.glob("*.png")).write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)  # a PNG's signature, then nothing
    return folder


def _thin_image(folder: Path) -> Path:
    from PIL import Image

    _images(folder)
    Image.new("RGB", (4, 400), "white").save(folder / "thin.png")
    (folder / "thin.txt").write_text("a line\n")
    return folder


def _zero_repeats(folder: Path) -> Path:
    _images(folder)
    _images(folder / "0_cats")
    return folder


# The trainer's data verdicts a Train node meets (the worker's own refusals, after the Training config's gate passed):
# (what the folder holds, the source widget, a phrase that proves the worker got that far, the widgets or nodes its
# first line names, the fix its first line says)
DATA_VERDICTS = {
    "no images": (_no_images, "encode", "no images", ("dataset_path",), "give a folder of"),
    "no captions": (_uncaptioned, "encode", "have no caption file", ("dataset_path",), "write a <stem>.txt"),
    "caption not UTF-8": (_bad_caption, "encode", "not UTF-8", ("dataset_path",), "re-save each as UTF-8"),
    "unreadable image": (_bad_image, "encode", "cannot be read", ("dataset_path",), "fix or delete them"),
    "no caches": (_images, "images", "no valid latent cache", ('"Anima: Cache latents"',), "dry_run off"),
    "unbucketable": (_thin_image, "encode", "cannot be bucketed", ("dataset_path",), "delete or crop them"),
    "zero repeats": (_zero_repeats, "encode", "repeats", ("dataset_path",), "to 1_cats"),
}


@pytest.mark.parametrize("case", sorted(DATA_VERDICTS))
def test_the_train_nodes_data_verdicts_lead_with_their_fix(node_env, tiny_anima, case):
    """A data verdict of the trainer, relayed by the Train node from its worker (a real child): its first line is
    the verdict and its fix in widgets and nodes (within the popup's 120 characters), not "training X did not
    start" with the fix cut off below it; no shell text anywhere; the class ComfyUI shows is no python path."""
    from nodes import worker

    nt = node_env.nt
    build, source, reached, names, fix = DATA_VERDICTS[case]
    data = build(node_env.tmp / "data")
    config = nt.AnimaTrainConfig.execute(**_widgets(nt, model_path=str(tiny_anima.diffusers_dir),
                                                    dataset_path=str(data), resolution=64, source=source,
                                                    run_name="cat")).values[0]
    nt.AnimaTrainTrain.hidden = type("H", (), {"unique_id": "5"})()
    try:
        with pytest.raises(worker.WorkerError) as refused:
            nt.AnimaTrainTrain.execute(config=config)
    finally:
        del nt.AnimaTrainTrain.hidden
    text = str(refused.value)
    assert reached in text, text  # the worker's own verdict, not an earlier refusal
    _check(case, text, names)
    assert fix in text.splitlines()[0], text  # the fix itself, not only its widget, is on the popup's line
    assert not text.startswith("training"), text  # the verdict leads; the run's name and the log come after it
    assert "did not start" in text and "full log: " in text, text
    shown_type = refused.type.__qualname__ if refused.type.__module__ == "builtins" else \
        f"{refused.type.__module__}.{refused.type.__qualname__}"  # how ComfyUI names the exception on the node
    assert not SHELL.search(shown_type) and "." not in shown_type and "_" not in shown_type, shown_type


def test_our_errors_raised_on_a_node_are_named_in_words_and_stay_what_they_were():
    """ComfyUI shows module.qualname beside the message: no python path for the pack's own errors (Load, Encode and
    the other nodes that raise in ComfyUI's process), and every except clause still catches them."""
    from anima_train.model.components import ModelRepoError
    from nodes import fixes as node_fixes

    def shown(cls) -> str:  # how ComfyUI names the exception on the node
        return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"

    @node_fixes.shown_on(node_fixes.TRAIN)
    def load():
        raise ModelRepoError("the repo at /x is not a converted Anima repo")

    with pytest.raises(ModelRepoError) as refused:
        load()
    assert shown(refused.type) == "Anima trainer" and isinstance(refused.value, ModelRepoError)

    @node_fixes.shown_on(node_fixes.TRAIN)
    def other():
        raise ValueError("a library's own error")

    with pytest.raises(ValueError) as kept:
        other()
    assert shown(kept.type) == "ValueError"


# ---------------------------------------------------------------------------------------------------------------
# The walk of every data refusal: each `raise` of a user error in anima_train/data/*.py is reached below from the
# node that shows it (in this process: the library call its worker makes, fast), or said here to be out of a
# node's reach and why. A raise site added without either fails test_every_data_refusal_is_walked_or_out_of_reach.

DATA_DIR = Path(__file__).resolve().parents[1] / "anima_train" / "data"


def _raise_sites() -> list[tuple[str, str, int, int, str]]:
    """(file, function qualname, first line, last line, source) of every `raise` of a user error (a UserError
    subclass, or a function annotated to return one: planning.stale_cache_error) in anima_train/data/*.py."""
    import ast
    import importlib
    import inspect
    import typing

    from anima_train.errors import UserError

    def ours(obj) -> bool:
        if inspect.isclass(obj):
            return issubclass(obj, UserError)
        if inspect.isfunction(obj):
            returned = typing.get_type_hints(obj).get("return")
            return inspect.isclass(returned) and issubclass(returned, UserError)
        return False

    sites = []
    for file in sorted(DATA_DIR.glob("*.py")):
        module = importlib.import_module(f"anima_train.data.{file.stem}")
        source = file.read_text()

        def walk(node, names: tuple[str, ...]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    walk(child, (*names, child.name))
                    continue
                if isinstance(child, ast.Raise) and child.exc is not None:
                    called = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                    if isinstance(called, ast.Name) and ours(getattr(module, called.id, None)):
                        sites.append((file.name, ".".join(names), child.lineno, child.end_lineno,
                                      ast.get_source_segment(source, child)))
                walk(child, names)

        walk(ast.parse(source), ())
    return sites


def _matches(entry: tuple[str, str, str], site) -> bool:
    """An entry (file, function, a phrase of the raise statement) names this site."""
    file, function, phrase = entry
    return site[0] == file and site[1] == function and phrase in site[4]


# The raise sites no node reaches, and why (the gate that refuses first, the widget that cannot give the value, the
# flag no node passes, or a bug of ours); each entry is (file, function, a phrase of the raise statement).
NOT_FROM_A_NODE = {
    ("scan.py", "scan_folders", "does not exist"):
        "the Training config's gate checks every folder (test_several_config_problems_are_shown_together_each_once), "
        "Cache and Audit check dataset_dir before the worker starts (test_audit_cache_and_convert_say_their_widgets)",
    ("scan.py", "resolve_modes", "use one of"):
        "the Training config's gate refuses an unknown source (a choice widget; the config's choices rule)",
    ("dataset.py", "build_training_data", "texture [[curriculum]] phase needs"):
        "the Training config's gate refuses a texture phase without source = encode (config rules); only a Config "
        "changed in code gets here (test_texture)",
    ("dataset.py", "bucket_batch_sizes", "has no entry for tier"):
        "the Training config's gate requires batch_size's keys to equal the tiers (config rules: _batch_size_tiers)",
    ("dataset.py", "build_training_data", "left out as unreadable"):
        "only --skip-unreadable (the CLI's flag; no node passes it) leaves every image out as unreadable",
    ("dataset.py", "load_pixels", ""):
        "the scan decoded the image already: only a file changed while the run goes on, or a bucketing bug of ours",
    ("cache_files.py", "load_latents", ""):
        "the scan read and checked the cache already: only a file replaced while the run goes on",
    ("captions.py", "read_caption_file", ""):
        "every caption is read by sources.refuse_unreadable_captions first, which lists these texts under its own "
        "first line (walked: 'caption not UTF-8'); a caption changed while the run goes on is its only other way",
    ("planning.py", "BucketSettings.bucketers", ""):
        "the config's [dataset] rules refuse the bucket settings Bucketer refuses: the Training config's gate for "
        "Train, refuse_what_the_config_refuses for Cache and Audit (walked: 'tier below the step')",
    ("planning.py", "plan_sources", "raise DatasetError(str(e))"):
        "plan_tiers refuses an unknown tier_collapse or a bucket over 2048 px, which the config's rules refuse first",
    ("buckets.py", "Bucketer.__init__", ""): "caught and said by planning.BucketSettings.bucketers (listed there)",
    ("buckets.py", "Bucketer._shrunk_size", ""): "caught by planning.plan_tiers_checked: an unbucketable source "
                                                 "(walked: 'unbucketable')",
    ("buckets.py", "Bucketer.select", ""): "caught by planning.plan_tiers_checked: an unbucketable source "
                                           "(walked: 'unbucketable')",
    ("buckets.py", "verify_max_resolution", ""): "caught by planning.plan_sources (listed there)",
    ("buckets.py", "plan_tiers", ""): "caught by planning.plan_sources (listed there)",
    ("buckets.py", "area_percentiles", ""): "the audit refuses a dataset with no sized source before it asks for "
                                            "percentiles (walked: 'nothing to audit')",
    ("latent_cache.py", "resolve_dataset_args", "raise DatasetError(str(e))"):
        "the config Cache and Audit get is the Training config's output, which passed the same load_config",
    ("latent_cache.py", "resolve_dataset_args", "no dataset folder"):
        "nodes_dataset.dataset_args refuses an empty dataset_dir without a config first; a config has a folder",
    ("latent_cache.py", "resolve_dataset_args", "every tier must be > 0"):
        "nodes_dataset.parse_resolutions refuses a tier <= 0 first; a config's tiers passed its gate",
    ("latent_cache.py", "_device", "--device"): "the Cache node passes no --device (the CLI's flag only)",
    ("latent_cache.py", "_run", "--batch-size must be"): "the batch_size widget's minimum is 1 (ComfyUI refuses less)",
}


def _broken_link(folder: Path) -> Path:
    _images(folder)
    (folder / "gone.png").symlink_to(folder / "nowhere.png")
    return folder


def _shared_stem(folder: Path) -> Path:
    from PIL import Image

    _images(folder)
    Image.new("RGB", (64, 64), "white").save(folder / "img_0000.webp")  # beside img_0000.png: one stem, two images
    return folder


def _too_many_repeats(folder: Path) -> Path:
    _images(folder)
    return _images(folder / "99999_cats").parent


def _linked_into_itself(folder: Path) -> Path:
    _images(folder)
    (folder / "3_again").symlink_to(folder)  # every image reached twice
    return folder


def _caches_only(folder: Path) -> Path:
    from anima_train.data.synthetic import make_synthetic_latents

    make_synthetic_latents(folder, n=3)  # no original_size: one tier only
    return folder


def _images_and_caches_only(folder: Path) -> Path:
    _images(folder)
    _caches_only(folder / "1_cached")
    return folder


def _caption_is_a_folder(folder: Path) -> Path:
    _images(folder)
    (folder / "img_0000.txt").unlink()
    (folder / "img_0000.txt").mkdir()
    return folder


def _foreign_cache(folder: Path) -> Path:
    _images(folder)
    (folder / "img_0000_0064x0064_anima.safetensors").write_bytes(b"my own notes, not a cache")
    return folder


def _foreign_cache_only(folder: Path) -> Path:
    _caches_only(folder)
    (folder / "zzz_0128x0128_anima.safetensors").write_bytes(b"my own notes, not a cache")
    (folder / "zzz.txt").write_text("a line\n")
    return folder


def _truncated_cache(folder: Path) -> Path:
    from anima_train.data.cache_files import CACHE_FORMAT
    from safetensors.torch import save_file
    import torch

    _caches_only(folder)
    cache = next(folder.glob("*_anima.safetensors"))
    save_file({"latents": torch.zeros(16, 1, 16, 16)}, str(cache), metadata={"format": CACHE_FORMAT})
    cache.write_bytes(cache.read_bytes()[:-100])  # ours by its header, its tensor cut short
    return folder


def _two_unsized_caches(folder: Path) -> Path:
    import shutil

    _caches_only(folder)
    first = sorted(folder.glob("*_anima.safetensors"))[0]
    shutil.copy(first, first.with_name(first.name.replace("0128x0128", "0064x0064")))
    return folder


def _damaged_unsized_cache(folder: Path) -> Path:
    from safetensors.torch import save_file
    import torch

    _caches_only(folder)
    save_file({"latents": torch.zeros(16, 1, 8, 8)}, str(sorted(folder.glob("*_anima.safetensors"))[0]))
    return folder


def _truncated_png(folder: Path) -> Path:
    _images(folder)
    png = next(folder.glob("*.png"))
    png.write_bytes(png.read_bytes()[:-len(png.read_bytes()) // 2])  # its header intact, its pixels cut short
    return folder


def _tiny_images(folder: Path) -> Path:
    from anima_train.model.tiny import make_synthetic_dataset

    make_synthetic_dataset(folder, n=3, sizes=[(32, 32)])
    return folder


TEXTURE = ('[dataset.texture]\ncanvases = [[64, 64]]\ntrigger = "texture"\n[[curriculum]]\nat = 0.0\n'
           '[[curriculum]]\nat = 0.5\nmode = "texture"\n')


# Each case: the node that shows it ("train": its worker's build_training_data, "train node": the node's own
# execute, "cache"/"audit": the node with its worker's command run in this process), the folder, the widgets, the
# raise site it reaches (file, function, a phrase of the raise), the widgets or nodes its first line names, and
# the fix that first line says.
WALK = {
    "no images": ("train", _no_images, {}, ("scan.py", "scan_folders", "no images"),
                  ("dataset_path",), "give a folder of"),
    "broken link": ("train", _broken_link, {}, ("scan.py", "_entries", "symbolic link"),
                    ("dataset_path",), "remove it"),
    "shared stem": ("train", _shared_stem, {}, ("scan.py", "_list_folder", "share the stem"),
                    ("dataset_path",), "rename or remove one"),
    "zero repeats": ("train", _zero_repeats, {}, ("scan.py", "scan_folders", "N >= 1"),
                     ("dataset_path",), "to 1_cats"),
    "over max repeats": ("train", _too_many_repeats, {}, ("scan.py", "scan_folders", "smaller N"),
                         ("dataset_path",), "with a smaller N"),
    "two paths to one image": ("train", _linked_into_itself, {}, ("scan.py", "_refuse_twice_seen", ""),
                               ("dataset_path",), "remove the link"),
    "caches but no images": ("train", _caches_only, {"source": "images"},
                             ("scan.py", "resolve_modes", "has caches but no images"), ("source",), '"latents"'),
    "mixed source modes": ("train", _images_and_caches_only, {"source": "auto"},
                           ("scan.py", "resolve_modes", "different source modes"), ("source",), '"latents"'),
    "unreadable image": ("train", _bad_image, {"source": "encode"}, ("sources.py", "image_sources", ""),
                         ("dataset_path",), "fix or delete them"),
    "caption is a folder": ("train", _caption_is_a_folder, {"source": "encode"},
                            ("sources.py", "refuse_missing_captions", "fix each as said"), ("dataset_path",), "fix"),
    "no captions": ("train", _uncaptioned, {"source": "encode"},
                    ("sources.py", "refuse_missing_captions", "have no caption file"), ("dataset_path",),
                    "write a <stem>.txt"),
    "caption not UTF-8": ("train", _bad_caption, {"source": "encode"},
                          ("sources.py", "refuse_unreadable_captions", ""), ("dataset_path",),
                          "re-save each as UTF-8"),
    "unbucketable": ("train", _thin_image, {"source": "encode"}, ("planning.py", "plan_sources", "cannot be bucketed"),
                     ("dataset_path",), "delete or crop them"),
    "no caches": ("train", _images, {"source": "images"}, ("dataset.py", "build_training_data", "stale_cache_error"),
                  ('"Anima: Cache latents"',), "dry_run off"),
    "undecodable, no cache": ("train", _truncated_png, {"source": "images"},
                              ("dataset.py", "build_training_data", "UnreadableImages"), ("dataset_path",),
                              "fix or delete them"),
    "all below min_source_area": ("train", _tiny_images, {"extra_toml": "[dataset]\nmin_source_area = 0.5\n"},
                                  ("dataset.py", "build_training_data", "drops every image"), ("min_source_area",),
                                  "lower"),
    "the validation fraction": ("train", _images, {"extra_toml": "[validation]\nfraction = 0.9\n"},
                                ("dataset.py", "held_out_stems", ""), ("fraction",), "lower it"),
    "not our cache": ("train", _foreign_cache_only, {"source": "latents"},
                      ("cache_files.py", "read_cache_metadata", ""), ("dataset_path",), "move or rename it"),
    "truncated cache": ("train", _truncated_cache, {"source": "latents"},
                        ("cache_files.py", "read_cache_metadata", ""), ('"Anima: Cache latents"',), "delete it"),
    "unsized caches, two tiers": ("train", _caches_only,
                                  {"source": "latents", "extra_toml": "[dataset]\nresolutions = [64, 128]\n"},
                                  ("dataset.py", "_latents_entries", "cannot be attributed"), ("resolution",),
                                  "to one tier"),
    "two unsized caches of a stem": ("train", _two_unsized_caches, {"source": "latents"},
                                     ("dataset.py", "_latents_entries", "keep one of"), ("dataset_path",),
                                     "keep one"),
    "damaged unsized cache": ("train", _damaged_unsized_cache, {"source": "latents"},
                              ("dataset.py", "_latents_entries", "is damaged"), ("dataset_path",), "delete it"),
    "texture on two GPUs": ("train node", _images, {"source": "encode", "extra_toml": TEXTURE},
                            ("texture.py", "refuse_multi_process", ""), ("gpus",), "gpus"),
    "cache: no tier": ("cache", _images, {"resolutions": ""}, ("latent_cache.py", "resolve_dataset_args", "tier(s)"),
                       ("resolutions",), "set resolutions"),
    "cache: tier below the step": ("cache", _images, {"resolutions": "32"},
                                   ("latent_cache.py", "refuse_what_the_config_refuses", ""), ("resolutions",),
                                   "raise the tier"),
    "cache: foreign cache files": ("cache", _foreign_cache, {"resolutions": "64"},
                                   ("latent_cache.py", "refuse_foreign_files", ""), ("dataset_dir",),
                                   "move or rename them"),
    "cache: caches only": ("cache", _caches_only, {"resolutions": "64"},
                           ("latent_cache.py", "_run", "no images to cache"), ("dataset_dir",), "give the folder"),
    "cache: undecodable": ("cache", _truncated_png, {"resolutions": "64"},
                           ("latent_cache.py", "_run", "UnreadableImages"), ("dataset_dir",), "fix or delete them"),
    "cache: no VAE": ("cache", _images, {"resolutions": "64", "dry_run": False, "model_path": "no_vae"},
                      ("latent_cache.py", "load_vae", ""), ("model_path",), "set model_path"),
    "audit: nothing to audit": ("audit", _caches_only, {}, ("audit.py", "audit", "nothing to audit"),
                                ("dataset_dir",), "give the folder"),
}


def _in_process(args: list[str], what: str, **_):
    """run_cli's stand-in: the worker's command (`cache ...`, `audit ...`) parsed by its own parser and run here,
    its error raised instead of printed (the node shows the error's text either way)."""
    import argparse

    from anima_train.data import audit, latent_cache

    parser = argparse.ArgumentParser()
    {"cache": latent_cache, "audit": audit}[args[0]].add_arguments(parser)
    parsed = parser.parse_args(args[1:])
    {"cache": latent_cache._run, "audit": audit.audit}[args[0]](parsed)
    raise AssertionError(f"{what} refused nothing: {args}")


def _refused(node_env, tiny_anima, monkeypatch, case) -> tuple[str, BaseException]:
    """Play `case` into its refusal: (the text its node shows, the exception)."""
    from anima_train.config import parse_config
    from anima_train.data.dataset import build_training_data
    from anima_train.fixes import writing_refs
    from nodes import fixes

    node, build, widgets, *_ = WALK[case]
    nt, nd = node_env.nt, node_env.nd
    data = build(node_env.tmp / "data")
    if node in ("cache", "audit"):
        monkeypatch.setattr(nd, "run_cli", _in_process)
        (node_env.tmp / "models" / "no_vae").mkdir(parents=True, exist_ok=True)
        cls, here = (nd.AnimaTrainCache, fixes.CACHE) if node == "cache" else (nd.AnimaTrainAudit, fixes.AUDIT)
        with pytest.raises(Exception) as refused:  # noqa: PT011 (each refusal raises its own kind)
            cls.execute(**dict({"dataset_dir": str(data)}, **widgets))
        return fixes.render(str(refused.value), here), refused.value
    values = _widgets(nt, model_path=str(tiny_anima.diffusers_dir), dataset_path=str(data), resolution=64,
                      run_name="cat", **widgets)
    assert nt.AnimaTrainConfig.validate_inputs(**values) is True  # past the gate: the trainer's own verdict
    config = nt.AnimaTrainConfig.execute(**values).values[0]
    with pytest.raises(Exception) as refused:  # noqa: PT011
        if node == "train node":
            nt.AnimaTrainTrain.hidden = type("H", (), {"unique_id": "5"})()
            try:
                nt.AnimaTrainTrain.execute(config=config, gpus=2)
            finally:
                del nt.AnimaTrainTrain.hidden
        else:
            cfg = parse_config(config["toml"])
            with writing_refs():  # as the worker writes it (its environment says so)
                build_training_data(cfg, cfg.train.model_path)
    return fixes.render(str(refused.value), fixes.TRAIN), refused.value


def _raised_at(exc: BaseException, sites) -> tuple | None:
    """The raise site under anima_train/data that raised `exc` (its traceback's last frame there on a raise)."""
    import traceback

    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if Path(frame.filename).parent == DATA_DIR:
            for site in sites:
                if Path(frame.filename).name == site[0] and site[2] <= frame.lineno <= site[3]:
                    return site
    return None


@pytest.mark.parametrize("case", sorted(WALK))
def test_each_data_refusal_leads_with_its_fix_on_its_node(node_env, tiny_anima, monkeypatch, case):
    """The refusal as its node shows it: raised where the case says, no shell text, a first line within the popup's
    120 characters that names the widget or node to change and says the fix."""
    *_, at, names, fix = WALK[case]
    text, exc = _refused(node_env, tiny_anima, monkeypatch, case)
    site = _raised_at(exc, _raise_sites())
    assert site is not None and _matches(at, site), f"{case}: raised at {site and site[:3]}, not {at}:\n{text}"
    _check(case, text, names)
    assert fix in text.splitlines()[0], f"{case}: the first line does not say {fix!r}:\n{text}"


def test_every_data_refusal_is_walked_or_out_of_reach():
    """Every raise of a user error in anima_train/data is a case of the walk above or in NOT_FROM_A_NODE with the
    reason; every entry of both names a raise that exists (a removed one goes from the tables too)."""
    sites = _raise_sites()
    walked = [case[3] for case in WALK.values()]
    unclaimed = [f"{file}:{first} in {function}: {text.splitlines()[0]}"
                 for file, function, first, _, text in sites
                 if not any(_matches(entry, (file, function, first, _, text)) for entry in [*walked, *NOT_FROM_A_NODE])]
    assert not unclaimed, "raise sites neither walked from a node nor said to be out of reach:\n" + "\n".join(unclaimed)
    stale = [entry for entry in [*walked, *NOT_FROM_A_NODE] if not any(_matches(entry, s) for s in sites)]
    assert not stale, f"entries that name no raise site: {stale}"
    assert all(NOT_FROM_A_NODE.values())


def test_a_cache_data_verdict_leads_the_cache_nodes_message(tmp_path):
    """`cache` exits 4 for images it cannot decode (a verdict on the data, not a crash): the Cache node's message
    leads with that verdict and its fix, as for exit 2, not "caching failed (worker exit status 4)" above a log
    line that starts with the shell's `anima-train cache: error:`."""
    from anima_train.errors import DATA_VERDICT_EXIT
    from anima_train.fixes import OPEN, CLOSE
    from nodes import fixes, worker

    log = tmp_path / "cache.log"
    log.write_text(f"==== cache 2026-01-01\nimages   3 in 1 folder(s)\n"
                   f"anima-train cache: error: 1 image(s) cannot be read in {OPEN}name dataset{CLOSE}: fix or delete "
                   f"them (re-download or re-export them)\n  {tmp_path}/a.png  (truncated)\n")
    result = worker.JobResult(returncode=DATA_VERDICT_EXIT, log_path=log)
    text = fixes.render(worker.failure_message(result, "caching"), fixes.CACHE)
    _check("cache verdict", text, ("dataset_dir",))
    assert text.splitlines()[0] == "1 image(s) cannot be read in dataset_dir: fix or delete them (re-download or " \
                                   "re-export them)", text
    assert "exit status" not in text and f"{tmp_path}/a.png" in text, text
