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
