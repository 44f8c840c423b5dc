"""What a graph posted to a listening ComfyUI may make the nodes read and write (nodes/paths.py, README "Folders the
nodes may use"): only ComfyUI's own folders and the ones the user lists; `..`, symlinks and absolute paths that lead
elsewhere are refused with a message saying how to allow them.

The policy is tested as pure functions; then each node is given paths outside, through the values a posted graph
controls (widgets, extra_toml, a config value), and must refuse them before anything is read or written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from anima_train.config import parse_config
from tests.test_nodes_train import refusal


@pytest.fixture
def comfy_root(tmp_path):
    """A ComfyUI base folder and, beside it, a folder that is not ComfyUI's ("elsewhere")."""
    root = tmp_path / "comfy"
    for sub in ("input", "output", "temp", "models/loras", "custom_nodes/pack"):
        (root / sub).mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "data").mkdir(parents=True)
    return root, elsewhere


def folders(root: Path) -> dict:
    return {"output": [str(root / "output")], "input": [str(root / "input")], "temp": [str(root / "temp")],
            "models": [str(root / "models"), str(root / "models" / "loras")],
            "custom_nodes": [str(root / "custom_nodes")]}


def policy(root, environ=None, settings=None, pack=None):
    from nodes.paths import make_policy

    return make_policy(folders(root), environ or {}, settings, pack)


# -- the policy ---------------------------------------------------------------------------------------------------


def test_relative_paths_resolve_in_comfys_folders_not_the_working_folder(comfy_root, monkeypatch):
    from nodes.paths import INPUT, MODELS, OUTPUT

    root, elsewhere = comfy_root
    monkeypatch.chdir(elsewhere)  # ComfyUI's working folder must not matter
    p = policy(root)
    assert p.resolve("data", "dataset_dir", INPUT) == root / "input" / "data"
    assert p.resolve("runs", "output_dir", OUTPUT) == root / "output" / "runs"
    assert p.resolve("repo", "model_path", MODELS) == root / "models" / "repo"
    assert p.resolve(str(root / "models" / "loras" / "x.safetensors"), "lora_path", OUTPUT) == \
        root / "models" / "loras" / "x.safetensors"  # absolute inside another of ComfyUI's folders


def test_dotdot_absolute_and_home_paths_outside_are_refused_with_how_to_allow(comfy_root):
    from nodes.paths import ALLOWED_DIRS_ENV, OUTPUT, SETTINGS_NAME, PathRefused

    root, elsewhere = comfy_root
    settings = root / "custom_nodes" / "pack" / SETTINGS_NAME
    p = policy(root, settings=settings)
    for value in ("../../elsewhere/data", str(elsewhere / "data"), "/etc", "~/.ssh",
                  f"{root / 'output'}/../../elsewhere"):
        with pytest.raises(PathRefused) as exc:
            p.resolve(value, "[train] output_dir", OUTPUT)
        msg = str(exc.value)
        assert msg.startswith(f"[train] output_dir = {value!r}") and "outside the folders" in msg, msg
        assert str(settings) in msg and ALLOWED_DIRS_ENV in msg and "queue again" in msg


def test_symlinks_are_judged_by_where_they_lead(comfy_root):
    from nodes.paths import INPUT, PathRefused

    root, elsewhere = comfy_root
    (root / "input" / "out_link").symlink_to(elsewhere / "data", target_is_directory=True)
    (root / "input" / "in_link").symlink_to(root / "output", target_is_directory=True)
    p = policy(root)
    with pytest.raises(PathRefused, match=f"a link to {elsewhere / 'data'}"):
        p.resolve("out_link", "dataset_dir", INPUT)
    with pytest.raises(PathRefused):
        p.resolve("out_link/sub/../x", "dataset_dir", INPUT)
    assert p.resolve("in_link/run", "dataset_dir", INPUT) == root / "output" / "run"  # leads inside: fine


def test_the_environment_variable_and_the_settings_file_allow_folders(comfy_root, tmp_path):
    from nodes.paths import ALLOWED_DIRS_ENV, INPUT, PathRefused

    root, elsewhere = comfy_root
    other = tmp_path / "other"
    other.mkdir()
    env = {ALLOWED_DIRS_ENV: os.pathsep.join([str(elsewhere / "data"), "", str(other)])}
    assert policy(root, env).resolve(str(elsewhere / "data" / "set1"), "k", INPUT) == elsewhere / "data" / "set1"
    assert policy(root, env).resolve(str(other), "k", INPUT) == other
    with pytest.raises(PathRefused):  # the folder above an allowed one is not allowed
        policy(root, env).resolve(str(elsewhere), "k", INPUT)

    settings = tmp_path / "anima_train_paths.txt"
    settings.write_text(f"# datasets\n{elsewhere / 'data'}   # the big disk\n\nrelative/dir\n", encoding="utf-8")
    p = policy(root, settings=settings)
    assert p.resolve(str(elsewhere / "data" / "x"), "k", INPUT) == elsewhere / "data" / "x"
    with pytest.raises(PathRefused) as exc:
        p.resolve(str(other), "k", INPUT)
    assert "'relative/dir' is not an absolute path and was ignored" in str(exc.value)
    # read when asked, so an edit needs no restart
    settings.write_text(str(other) + "\n", encoding="utf-8")
    assert policy(root, settings=settings).resolve(str(other), "k", INPUT) == other
    # a settings file that cannot be read allows nothing, says so, and leaves the environment's folders allowed
    settings.unlink()
    settings.mkdir()
    p = policy(root, env, settings=settings)
    assert p.resolve(str(other), "k", INPUT) == other
    with pytest.raises(PathRefused, match="cannot be read"):
        p.resolve("/etc", "k", INPUT)


def test_custom_nodes_and_the_pack_are_refused_even_when_allowed(comfy_root):
    from nodes.paths import ALLOWED_DIRS_ENV, INPUT, OUTPUT, PathRefused

    root, _ = comfy_root
    pack = root / "custom_nodes" / "pack"
    p = policy(root, {ALLOWED_DIRS_ENV: str(root)}, pack=pack)
    for value in (str(pack / "anima_train_paths.txt"), str(root / "custom_nodes" / "evil"), "../custom_nodes"):
        with pytest.raises(PathRefused, match="inside ComfyUI's custom_nodes or this pack's folder"):
            p.resolve(value, "out_dir", OUTPUT)
    assert p.resolve(str(root / "notes"), "k", INPUT) == root / "notes"  # the rest of the allowed folder is fine


def test_every_path_of_a_training_config_is_checked_and_resolved(comfy_root):
    from nodes.paths import confine_tree

    root, elsewhere = comfy_root
    tree = {"train": {"model_path": "repo", "output_dir": "runs", "resume_from": "runs/a/a-state"},
            "dataset": {"subsets": [{"path": "set1"}, {"path": "set2"}],
                        "caption": {"protected_tags_file": "tags.txt"}}}
    assert confine_tree(tree, policy(root)) == []
    assert tree["train"] == {"model_path": str(root / "models" / "repo"), "output_dir": str(root / "output" / "runs"),
                             "resume_from": str(root / "output" / "runs" / "a" / "a-state")}
    assert [s["path"] for s in tree["dataset"]["subsets"]] == [str(root / "input" / s) for s in ("set1", "set2")]
    assert tree["dataset"]["caption"]["protected_tags_file"] == str(root / "input" / "tags.txt")

    out = str(elsewhere)
    bad = {"train": {"model_path": out, "output_dir": out, "resume_from": out},
           "dataset": {"path": out, "subsets": [{"path": "ok"}, {"path": out}],
                       "caption": {"protected_tags_file": out}}}
    problems = confine_tree(bad, policy(root))
    keys = [p.split(" = ")[0] for p in problems]
    assert keys == ["[train] model_path", "[train] output_dir", "[train] resume_from", "[dataset] path",
                    "[[dataset.subsets]] #2 path", "[dataset.caption] protected_tags_file"]
    linked = {"train": {"model_path": "<linked model_path>"}}
    assert confine_tree(linked, policy(root), skip=lambda v: v.startswith("<linked")) == []


# -- the nodes ----------------------------------------------------------------------------------------------------


@pytest.fixture
def nodes_env(monkeypatch, tmp_path, tiny_anima):
    """ComfyUI's folders under tmp_path/comfy (comfy_double.install_folders: input = that folder itself), a folder
    beside it that is not ComfyUI's, and the tiny model allowed as a user would list it."""
    from tests import comfy_double

    comfy_double.install(monkeypatch)
    import nodes.comfy as comfy
    import nodes.nodes_dataset as nd
    import nodes.nodes_train as nt

    root, elsewhere = tmp_path / "comfy", tmp_path / "elsewhere"
    (root / "output").mkdir(parents=True)
    (elsewhere / "data").mkdir(parents=True)
    comfy_double.install_folders(monkeypatch, comfy, root, allowed=[tiny_anima.diffusers_dir])
    data = root / "data"
    data.mkdir()
    for i in range(2):
        (data / f"{i}.png").write_bytes(b"png")
        (data / f"{i}.txt").write_text("a cat")
    spawned = []
    monkeypatch.setattr(nd.worker, "run_job", lambda *a, **k: spawned.append(a) or pytest.fail("worker started"))
    monkeypatch.setattr(nt.worker, "run_job", lambda *a, **k: spawned.append(a) or pytest.fail("worker started"))
    monkeypatch.setattr(comfy, "free_vram", lambda: None)
    return type("E", (), dict(nt=nt, nd=nd, comfy=comfy, root=root, elsewhere=elsewhere, data=data,
                              model=tiny_anima.diffusers_dir, spawned=spawned))


def config_values(env, **over):
    schema = env.nt.AnimaTrainConfig.define_schema()
    values = {p.id: p.options.get("default") for p in schema.inputs}
    values.update(model_path=str(env.model), dataset_path=str(env.data))
    values.update(over)
    return values


def test_config_node_refuses_paths_outside_in_widgets_and_extra_toml(nodes_env):
    env = nodes_env
    nt, outside = env.nt, env.elsewhere
    assert nt.AnimaTrainConfig.validate_inputs(**config_values(env)) is True
    for over in ({"output_dir": str(outside)}, {"output_dir": "../../../elsewhere"},
                 {"dataset_path": str(outside / "data")},
                 {"extra_toml": f'[train]\noutput_dir = "{outside}"\n'},
                 {"extra_toml": f'[train]\nresume_from = "{outside}/run-state"\n'},
                 {"extra_toml": f'[[dataset.subsets]]\npath = "{outside / "data"}"\n'},
                 {"extra_toml": f'[dataset.caption]\nprotected_tags_file = "{outside / "tags.txt"}"\n'}):
        msg = " ".join(refusal(nt, **config_values(env, **over)).split())  # the popup's first line is broken
        assert "outside the folders the Anima nodes may use" in msg, (over, msg)
        assert "ANIMA_TRAIN_ALLOWED_DIRS" in msg and "anima_train_paths.txt" in msg, msg
    # a symlink in ComfyUI's output folder that leads elsewhere
    (env.root / "output" / "runs").symlink_to(outside, target_is_directory=True)
    msg = refusal(nt, **config_values(env, output_dir="runs"))
    assert f"a link to {outside}" in msg


def test_config_node_resolves_relative_paths_in_comfys_folders(nodes_env, monkeypatch):
    env = nodes_env
    monkeypatch.chdir(env.elsewhere)  # the worker runs in the run folder: a relative path must not reach it
    (env.root / "models").mkdir()
    (env.root / "models" / "anima").symlink_to(env.model, target_is_directory=True)
    out = env.nt.AnimaTrainConfig.execute(**config_values(env, dataset_path="data", model_path="anima",
                                                          output_dir="my_runs")).values[0]
    cfg = parse_config(out["toml"])
    assert cfg.dataset.path == str(env.data)
    assert cfg.train.model_path == str(env.model)  # models/anima leads to the allowed tiny model: its real path
    assert cfg.train.output_dir == str(env.root / "output" / "my_runs")


def test_train_node_refuses_a_config_value_with_paths_outside(nodes_env):
    env = nodes_env
    good = env.nt.AnimaTrainConfig.execute(**config_values(env)).values[0]
    # a posted graph may give Train any literal config, not only the Training config node's output
    toml = good["toml"].replace(str(env.root / "output"), str(env.elsewhere))
    with pytest.raises(Exception) as exc:
        env.nt.AnimaTrainTrain.execute(config={"toml": toml})
    said = " ".join(str(exc.value).split())  # the popup's first line is broken
    assert "outside the folders" in said and 'output_dir (Anima: Training config)' in said, said  # its widget
    assert not env.spawned and not list(env.elsewhere.glob("*/*.toml"))


def test_dataset_and_model_nodes_refuse_paths_outside(nodes_env):
    env = nodes_env
    nd, nt, outside = env.nd, env.nt, env.elsewhere
    calls = [
        lambda: nd.AnimaTrainCache.execute(dataset_dir=str(outside / "data"), resolutions="64", dry_run=False),
        lambda: nd.AnimaTrainCache.execute(dataset_dir=f"data;{outside / 'data'}", resolutions="64"),
        lambda: nd.AnimaTrainAudit.execute(dataset_dir="../../elsewhere/data", resolutions="64"),
        lambda: nd.AnimaTrainAudit.execute(dataset_dir="data", resolutions="64", model_path=str(outside)),
        lambda: nd.AnimaTrainAudit.execute(config={"toml": f'[dataset]\npath = "{outside / "data"}"\n'}),
        lambda: nt.AnimaLoadTrainedLora.execute(model=None, lora_path=str(outside / "x.safetensors")),
        lambda: nt.AnimaTrainTextEncode.execute(model_path=str(outside), text="a cat"),
    ]
    for call in calls:
        with pytest.raises(Exception) as exc:
            call()
        assert "outside the folders the Anima nodes may use" in " ".join(str(exc.value).split()), exc.value
    assert not env.spawned


def test_convert_refuses_an_out_dir_or_tokenizer_folder_outside(nodes_env, monkeypatch):
    env = nodes_env
    nd = env.nd
    monkeypatch.setattr(env.comfy, "model_path", lambda kind, name: str(env.model / "transformer" / "x"))
    names = dict(anima="a.safetensors", qwen="q.safetensors", vae="v.safetensors")
    for over in ({"out_dir": str(env.elsewhere / "repo"), "tokenizers": "none"},
                 {"out_dir": "../../elsewhere/repo", "tokenizers": "none"},
                 {"out_dir": "", "tokenizers": str(env.elsewhere)}):
        with pytest.raises(Exception, match="outside the folders"):
            nd.AnimaTrainConvert.execute(**names, **over)
    assert not env.spawned and not (env.elsewhere / "repo").exists()
    # a Hugging Face repo id is not a path
    from nodes.paths import current_policy, tokenizers_source

    assert tokenizers_source("circlestone-labs/Anima", current_policy()) == "circlestone-labs/Anima"
    assert tokenizers_source("none", current_policy()) == "none"
