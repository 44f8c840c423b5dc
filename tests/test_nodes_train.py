"""Training nodes without ComfyUI: tests/comfy_double.py stands in for comfy_api, and the ComfyUI calls of
nodes/comfy.py (progress bar, websocket events, VRAM, interrupts, model folders) are replaced by recorders.

The Train node runs a fake trainer script that speaks the real protocol (reads the job TOML, prints JSON events,
writes the final file, honours --stop-file), so spawn, relay, publish, manifest and re-use run for real in ~1 s.
"""

from __future__ import annotations

import os
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import anima_train.config as anima_config
from anima_train import adapters
from anima_train.config import AdapterConfig, ConfigError, TrainConfig, parse_config

FAKE_TRAINER = textwrap.dedent(r'''
    import json, os, sys, time, tomllib
    job, stop_file, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = tomllib.loads(open(job).read())
    run_dir = os.path.join(cfg["train"]["output_dir"], cfg["train"]["run_name"])
    def ev(kind, **kw):
        print(json.dumps({"event": kind, **kw}), flush=True)
    ev("status", message="loading model")
    if mode == "loading":  # a model that takes long to load: no step, nothing to save yet
        time.sleep(60)
    if mode == "warn":  # the trainer's dataset warnings, sent while it scans the data
        ev("warning", text="tier 1024: 3/3 sources (100.0%) are smaller than this tier")
    ev("start", total=3, steps_per_epoch=3, epochs=1, processes=1, run_dir=run_dir, resumed_step=0)
    for step in (1, 2, 3):
        if mode == "swap" and step == 1:  # swap_blocks = "auto": said before the model loads, with the plan later
            ev("message", text="swap auto: 3 of 28 blocks swapped, the fewest with which the step fits")
        if mode in ("plan", "swap") and step == 2:  # the auto memory plan, said after the first optimizer step
            ev("message", text="checkpointing auto: 26 of 28 blocks recompute (a block keeps 0.71 GiB at the largest "
                               "batch; predicted peak 7.4 of 8.0 GiB)")
        if os.path.exists(stop_file):  # as the trainer stops: a step checkpoint, its resume state, `done`
            stem = os.path.join(run_dir, "%s-step%06d" % (cfg["train"]["run_name"], step - 1))
            open(stem + ".safetensors", "wb").write(b"lora weights")
            if cfg["train"].get("save_state_on_stop", True):
                os.makedirs(stem + "-state")
                open(os.path.join(stem + "-state", "state.json"), "w").write("{}")
            ev("checkpoint", path=stem + ".safetensors", step=step - 1)
            ev("done", step=step - 1, total=3, final=None, stopped=True, saved=[stem + ".safetensors"])
            sys.exit(0)
        if mode == "fail" and step == 2:
            print("RuntimeError: CUDA out of memory (fake)", file=sys.stderr, flush=True)
            ev("error", message="RuntimeError: CUDA out of memory (fake)", traceback="")
            sys.exit(1)
        ev("step", step=step, total=3, epoch=1, loss=1.0 / step, lr=[1e-4])
        if mode == "slow":  # a step that lasts until Cancel's stop file is there (a fixed sleep raced a busy machine)
            deadline = time.monotonic() + 60
            while not os.path.exists(stop_file) and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            time.sleep(0.01)
    final = os.path.join(run_dir, cfg["train"]["run_name"] + ".safetensors")
    open(final, "wb").write(b"lora weights " + json.dumps(cfg).encode())
    ev("checkpoint", path=final, step=3)
    if mode == "validation":  # [validation]: the summary and its verdict, as training/validation.py words them
        ev("validation", step=3, loss=1.453, shuffled=1.4527, margin=-0.0003, seconds=0.5)
        ev("message", text="validation loss 2.120 → 1.453, margin -0.001 → -0.000 (steps 0 → 3)")
        ev("warning", text="the text-conditioning margin did not grow (-0.0014 → -0.0003): the run is not learning "
                           "from its captions")
    ev("done", step=3, total=3, final=final, seconds=0.1)
''')


class Interrupted(BaseException):
    pass


class Bar:
    def __init__(self, log, total, node_id):
        self.log, self.total = log, total
        log.append(("bar", total, node_id))

    def update_absolute(self, value, total=None):
        self.log.append(("update", value, total))


@pytest.fixture
def comfy_env(monkeypatch, tmp_path, request):
    """The pack's node modules on the test double, with every nodes/comfy.py helper recorded. ComfyUI's folders are
    under tmp_path (its input folder is tmp_path itself); the tiny model's folder is allowed like a user would."""
    from tests import comfy_double

    comfy_double.install(monkeypatch)
    import nodes.comfy as comfy
    import nodes.nodes_train as nt
    import nodes.run_picking as run_picking
    import nodes.training_config as training_config

    allowed = [request.getfixturevalue("tiny_anima").diffusers_dir] if "tiny_anima" in request.fixturenames else []
    comfy_double.install_folders(monkeypatch, comfy, tmp_path, allowed)
    log = []
    folders = {"loras": tmp_path / "models" / "loras", "diffusion_models": tmp_path / "models" / "diffusion_models"}
    monkeypatch.setattr(comfy, "output_directory", lambda: str(tmp_path / "output"))
    monkeypatch.setattr(comfy, "model_folder", lambda kind: str(folders[kind]))
    monkeypatch.setattr(comfy, "model_path", lambda kind, name: str(folders[kind] / name))
    monkeypatch.setattr(comfy, "model_files", lambda kind: [])
    monkeypatch.setattr(comfy, "free_vram", lambda: log.append(("free_vram",)))
    monkeypatch.setattr(comfy, "throw_if_interrupted", lambda: None)
    monkeypatch.setattr(comfy, "progress_bar", lambda total, node_id=None: Bar(log, total, node_id))
    monkeypatch.setattr(comfy, "client_id", lambda: "client-1")
    monkeypatch.setattr(comfy, "prompt_id", lambda: "prompt-1")
    monkeypatch.setattr(comfy, "send_event", lambda data, sid=None: log.append(("ws", data, sid)))
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    mode = {"value": "ok"}
    spawned = []

    def command(job, stop, gpus):
        spawned.append((job, stop, gpus))
        return [sys.executable, "-u", str(script), str(job), str(stop), mode["value"]]

    real_train_command = nt.train_command
    monkeypatch.setattr(nt, "train_command", command)
    return type("Env", (), dict(nt=nt, comfy=comfy, log=log, folders=folders, mode=mode, spawned=spawned,
                                tmp=tmp_path, real_train_command=real_train_command, tc=training_config,
                                picking=run_picking))


@pytest.fixture
def dataset(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    for i in range(3):
        (d / f"img_{i}.png").write_bytes(b"png")
        (d / f"img_{i}.txt").write_text("red circle, white background")
    return d


def widgets(nt, model_path, dataset_dir, **over):
    """Every widget at its schema default, like a freshly added node, then `over`."""
    schema = nt.AnimaTrainConfig.define_schema()
    values = {p.id: p.options.get("default") for p in schema.inputs}
    values.update(model_path=str(model_path), dataset_path=str(dataset_dir))
    values.update(over)
    return values


# -- Training config ---------------------------------------------------------------------------------------------


def test_config_widgets_come_from_the_config_metadata(comfy_env):
    nt = comfy_env.nt
    ports = {p.id: p for p in nt.AnimaTrainConfig.define_schema().inputs}
    assert ports["epochs"].kind == "INT" and ports["epochs"].options["default"] == TrainConfig().epochs
    # the range (ge=1 in TrainConfig) is said in the tooltip; the widget itself does not clamp (see below)
    assert "[valid: >= 1]" in ports["epochs"].options["tooltip"]
    assert ports["epochs"].options["min"] < 0 and ports["learning_rate"].options["min"] < 0
    assert "passes over the dataset" in ports["epochs"].options["tooltip"]
    assert ports["adapter"].kind == "COMBO" and ports["adapter"].options["options"] == list(adapters.kinds())
    assert ports["dtype"].options["advanced"] is True and ports["epochs"].options["advanced"] is None
    assert ports["gradient_checkpointing"].kind == "BOOLEAN"
    assert "[valid: >= 0, <= 1]" in ports["tag_dropout"].options["tooltip"]  # ge=0.0, le=1.0
    assert ports["tag_dropout"].options["max"] > 1.0
    assert ports["extra_toml"].options["multiline"] is True
    # every knob maps to a real key, and the widget names are unique
    assert len({k.widget for k in comfy_env.tc.ALL_KNOBS}) == len(comfy_env.tc.ALL_KNOBS)
    assert AdapterConfig().kind == ports["adapter"].options["default"]


def test_the_late_knobs_come_after_extra_toml_and_leave_an_older_workflows_config_as_it_was(comfy_env, dataset):
    """swap_blocks, base_matmul and cache_text_encoder_outputs became widgets after workflows had been saved: a saved
    workflow holds widget
    values by position, so they come after extra_toml (tests/test_browser_advanced.py loads an older workflow in the
    frontend), and at their defaults they add nothing to the config text, which the node's re-use and resume key
    is computed from: an older workflow's finished run is still re-used, its cancelled run still resumed."""
    nt = comfy_env.nt
    order = [p.id for p in nt.AnimaTrainConfig.define_schema().inputs]
    late = ["swap_blocks", "base_matmul", "cache_text_encoder_outputs"]
    assert order[-4:] == ["extra_toml", *late], order[-5:]
    ports = {p.id: p for p in nt.AnimaTrainConfig.define_schema().inputs}
    assert ports["base_matmul"].kind == "COMBO" and ports["base_matmul"].options["options"] == ["bf16", "fp8"]
    assert ports["swap_blocks"].kind == "INT" and ports["swap_blocks"].options["advanced"] is True
    assert ports["cache_text_encoder_outputs"].kind == "BOOLEAN"
    older = {k: v for k, v in widgets(nt, "x", dataset).items() if k not in late}
    text = comfy_env.tc.config_toml(older)
    defaults = dict(swap_blocks=0, base_matmul="bf16", cache_text_encoder_outputs=False)
    assert comfy_env.tc.config_toml(dict(older, **defaults)) == text
    assert not any(key in text for key in late)
    chosen = tomllib.loads(comfy_env.tc.config_toml(dict(older, swap_blocks=12, base_matmul="fp8",
                                                         cache_text_encoder_outputs=True)))
    assert (chosen["train"]["swap_blocks"], chosen["train"]["base_matmul"]) == (12, "fp8")
    assert chosen["dataset"]["cache_text_encoder_outputs"] is True
    # extra_toml still wins over a widget
    over = tomllib.loads(comfy_env.tc.config_toml(dict(older, swap_blocks=12, extra_toml="[train]\nswap_blocks = 3\n")))
    assert over["train"]["swap_blocks"] == 3


def test_no_config_widget_gets_a_control_after_generate_widget(comfy_env):
    # ComfyUI's frontend gives an INT input named seed / noise_seed a "control after generate" widget (default:
    # randomize) unless the input declares control_after_generate; it shifts every saved value after it and would
    # re-roll the training seed after each queue. tests/test_browser_workflows.py checks it in the real frontend.
    ints = [p for p in comfy_env.nt.AnimaTrainConfig.define_schema().inputs if p.kind == "INT"]
    undeclared = [p.id for p in ints if p.options.get("control_after_generate") is not False]
    assert ints and not undeclared, f"INT widgets without control_after_generate=False: {undeclared}"
    assert not {p.id for p in ints} & {"seed", "noise_seed"}


def refusal(nt, **values) -> str:
    """The message the Training config's validate_inputs raises for these widget values (ComfyUI shows it once)."""
    with pytest.raises(nt.ConfigRefused) as refused:
        nt.AnimaTrainConfig.validate_inputs(**values)
    return str(refused.value)


def test_config_validates_with_load_config_before_running(comfy_env, tiny_anima, dataset):
    nt = comfy_env.nt
    good = widgets(nt, tiny_anima.diffusers_dir, dataset, run_name="my run", epochs=2)
    assert nt.AnimaTrainConfig.validate_inputs(**good) is True
    out = nt.AnimaTrainConfig.execute(**good).values[0]
    cfg = parse_config(out["toml"])
    assert cfg.train.epochs == 2 and cfg.run_stem == "my-run" and cfg.adapter.rank == 16
    assert cfg.train.output_dir == str(comfy_env.tmp / "output" / "anima_train")  # empty widget -> ComfyUI output
    assert out["run_dir"] == str(comfy_env.tmp / "output" / "anima_train" / "my-run")
    assert cfg.train.max_steps is None and cfg.flow.shift is None  # 0 = unset

    # the CLI's own rule messages reach the node, a key named by the widget or extra_toml that sets it
    bad = refusal(nt, **dict(good, extra_toml="[flow]\nshift = 0.0\n"))
    assert bad.startswith("extra_toml [flow] shift = 0.0: must be > 0.0"), bad
    assert refusal(nt, **dict(good, shift=-1.0)).startswith("shift = -1.0: must be > 0.0")
    bad = refusal(nt, **dict(good, extra_toml="[train]\nepochz = 3\n"))
    assert "epochz" in bad
    bad = refusal(nt, **dict(good, extra_toml="[train\n"))
    assert "extra_toml: not valid TOML" in bad
    # a value outside a key's range, as typed into its widget: the frontend would clamp it to the widget's min/max
    # without a word (1.5 trained as 1.0, a negative LR shown as 0), so the widgets do not clamp and the gate refuses
    # it with the value typed
    bad = refusal(nt, **dict(good, tag_dropout=1.5))
    assert bad.startswith("tag_dropout = 1.5: must be <= 1.0"), bad
    bad = refusal(nt, **dict(good, learning_rate=-0.0001))
    assert bad.startswith("learning_rate = -0.0001: must be > 0.0"), bad
    missing = refusal(nt, **dict(good, dataset_path=str(dataset / "nope")))
    assert "dataset folder" in missing and "nope" in missing
    no_repo = refusal(nt, **dict(good, model_path=str(dataset)))
    assert "not a complete Anima diffusers repo" in no_repo
    with pytest.raises(ConfigError):
        nt.AnimaTrainConfig.execute(**dict(good, model_path=""))


def test_extra_toml_overrides_widgets_and_replaces_their_forms(comfy_env, tiny_anima, dataset, tmp_path):
    nt = comfy_env.nt
    other = tmp_path / "other"
    other.mkdir()
    extra = (f'[train]\nepochs = 7\n[dataset]\nresolutions = [512, 768]\n[[dataset.subsets]]\npath = "{other}"\n'
             f"num_repeats = 3\n")
    text = nt.AnimaTrainConfig.execute(**widgets(nt, tiny_anima.diffusers_dir, dataset, epochs=2,
                                                 extra_toml=extra)).values[0]["toml"]
    cfg = parse_config(text)
    assert cfg.train.epochs == 7 and cfg.dataset.tiers == [512, 768]
    assert cfg.dataset.path is None and [s.path for s in cfg.dataset.subsets] == [str(other)]


def test_output_format_widget_reaches_the_lora_file_format(comfy_env, tiny_anima, dataset):
    nt = comfy_env.nt
    port = {p.id: p for p in nt.AnimaTrainConfig.define_schema().inputs}["output_format"]
    assert port.kind == "COMBO" and port.options["options"] == ["peft", "kohya"]
    assert port.options["default"] == AdapterConfig().output_format == "peft"
    assert "lora_unet_" in port.options["tooltip"]
    values = widgets(nt, tiny_anima.diffusers_dir, dataset, output_format="kohya")
    assert parse_config(nt.AnimaTrainConfig.execute(**values).values[0]["toml"]).adapter.output_format == "kohya"
    bad = refusal(nt, **dict(values, adapter="lokr"))
    assert 'output_format = "kohya" applies to kind = "lora"' in bad and "[adapter]" not in bad, bad


def test_a_text_cache_with_captions_that_change_is_refused_in_the_widgets_terms(comfy_env, tiny_anima, dataset):
    """[dataset] cache_text_encoder_outputs, as its widget: the refusal names the widgets (and extra_toml where it
    set the key), as a ComfyUI user set them."""
    nt = comfy_env.nt
    values = widgets(nt, tiny_anima.diffusers_dir, dataset, cache_text_encoder_outputs=True)
    assert nt.AnimaTrainConfig.validate_inputs(**dict(values, caption_dropout=0.1)) is True
    bad = " ".join(refusal(nt, **dict(values, shuffle_tags=True)).split())  # the node breaks long lines
    assert bad == ("cache_text_encoder_outputs = true keeps one Qwen3 output per caption, but shuffle_tags = true "
                   "makes a new caption every epoch; set cache_text_encoder_outputs = false, or turn those off "
                   "(caption_dropout may stay)"), bad
    bad = " ".join(refusal(nt, **dict(values, tag_dropout=0.2,
                                      extra_toml="[dataset.caption]\nnl_shuffle_sentences = true\n")).split())
    assert "but extra_toml [dataset.caption] nl_shuffle_sentences = true and tag_dropout = 0.2 make" in bad, bad


def test_example_workflow_widget_values_line_up_with_the_config_node(comfy_env):
    """The UI file stores widget values by position: each must be a valid value of the widget at its position."""
    import json

    nt = comfy_env.nt
    workflow = json.loads((Path(__file__).resolve().parents[1] / "example_workflows"
                           / "Train a LoRA on your images, then sample with it.json").read_text())
    node = next(n for n in workflow["nodes"] if n["type"] == "AnimaTrainConfig")
    values = list(node["widgets_values"])
    named = {}
    for port in nt.AnimaTrainConfig.define_schema().inputs:
        value, o = values.pop(0), port.options
        if o.get("control_after_generate"):
            values.pop(0)  # "fixed" / "randomize": a frontend-only value
        named[port.id] = value
        if port.kind == "COMBO":
            assert value in o["options"], (port.id, value)
        elif port.kind == "BOOLEAN":
            assert isinstance(value, bool), (port.id, value)
        elif port.kind in ("INT", "FLOAT"):
            assert isinstance(value, (int, float)) and not isinstance(value, bool), (port.id, value)
            assert port.kind == "FLOAT" or isinstance(value, int), (port.id, value)
            assert o["min"] <= value <= o["max"], (port.id, value)
        else:
            assert isinstance(value, str), (port.id, value)
    assert not values, f"{len(values)} widget value(s) left over"
    assert named["output_format"] == "peft" and named["num_workers"] == 2 and named["keep_last_n"] == 0
    assert named["run_name"] == "my_first_anima_lora" and named["training_seed"] == 42 and named["dtype"] == "bfloat16"
    assert named["swap_blocks"] == 0 and named["base_matmul"] == "bf16"


def test_linked_inputs_are_not_known_at_validation_and_pass(comfy_env, dataset):
    nt = comfy_env.nt
    values = widgets(nt, "x", dataset)
    values["model_path"] = None  # e.g. linked from the Convert node
    assert nt.AnimaTrainConfig.validate_inputs(**values) is True


def test_config_fingerprint_follows_the_dataset_files(comfy_env, tiny_anima, dataset):
    nt = comfy_env.nt
    values = widgets(nt, tiny_anima.diffusers_dir, dataset)
    f0 = nt.AnimaTrainConfig.fingerprint_inputs(**values)
    assert nt.AnimaTrainConfig.fingerprint_inputs(**values) == f0
    (dataset / "img_9.png").write_bytes(b"new image")
    assert nt.AnimaTrainConfig.fingerprint_inputs(**values) != f0
    assert nt.AnimaTrainConfig.fingerprint_inputs(**dict(values, epochs=5)) != f0


# -- Train ---------------------------------------------------------------------------------------------------


def _config(env, tiny_anima, dataset, **over):
    return env.nt.AnimaTrainConfig.execute(**widgets(env.nt, tiny_anima.diffusers_dir, dataset, **over)).values[0]


def _train(env, config, **kw):
    env.nt.AnimaTrainTrain.hidden = type("H", (), {"unique_id": "12:5"})()  # a subgraph node id
    try:
        return env.nt.AnimaTrainTrain.execute(config=config, **kw)
    finally:
        del env.nt.AnimaTrainTrain.hidden


def test_train_relays_events_publishes_and_records(comfy_env, tiny_anima, dataset):
    env = comfy_env
    config = _config(env, tiny_anima, dataset, run_name="cat")
    out = _train(env, config)
    path, image = out.values
    run_dir = Path(config["run_dir"])
    assert path == str(run_dir / "cat.safetensors") and Path(path).is_file()
    assert (tuple(image.shape[:1]) == (1,) and image.shape[-1] == 3
            and 0 <= float(image.min()) <= float(image.max()) <= 1)
    # VRAM freed before the worker started; progress bar and websocket events carry the node id and client, and
    # the events the prompt id, so only the page that queued this prompt draws them (js/run_follow.js)
    assert env.log[0] == ("free_vram",)
    assert ("bar", 3, "12:5") in env.log and ("update", 3, 3) in env.log
    ws = [e for e in env.log if e[0] == "ws"]
    kinds = [d["event"] for _, d, _ in ws]
    assert kinds == ["status", "start", "step", "step", "step", "checkpoint", "done"]
    assert all(d["node"] == "12:5" and d["prompt_id"] == "prompt-1" and sid == "client-1" for _, d, sid in ws)
    assert [d["loss"] for _, d, _ in ws if d["event"] == "step"] == [1.0, 0.5, pytest.approx(1 / 3)]
    # the trained file where LoraLoader lists it, the job files in the run dir
    copy = env.folders["loras"] / "anima_train" / "cat.safetensors"
    assert copy.read_bytes() == Path(path).read_bytes()
    assert "copy" in out.ui["text"][0] and str(copy) in out.ui["text"][0]
    assert (run_dir / "comfyui-job.toml").read_text() == config["toml"]
    assert (run_dir / "comfyui-result.json").is_file()
    assert not (run_dir / "comfyui-loss.png").exists()  # one loss chart per run: the trainer's loss.png
    assert env.spawned[0][2] == 1


def test_train_shows_the_trainers_warnings(comfy_env, tiny_anima, dataset):
    env = comfy_env
    env.mode["value"] = "warn"
    config = _config(env, tiny_anima, dataset, run_name="warned")
    out = _train(env, config)
    warning = "tier 1024: 3/3 sources (100.0%) are smaller than this tier"
    ws = [e[1] for e in env.log if e[0] == "ws"]
    assert {"node": "12:5", "prompt_id": "prompt-1", "event": "warning", "text": warning} in ws  # to the chart
    assert f"warning: {warning}" in out.ui["text"][0].splitlines()  # and in the node's result text
    env.log.clear()
    again = _train(env, config)  # a re-used run still says what was wrong with its data
    assert again.ui["text"][0].startswith("re-used") and f"warning: {warning}" in again.ui["text"][0]


def test_train_shows_the_memory_plan_it_chose(comfy_env, tiny_anima, dataset):
    env = comfy_env
    env.mode["value"] = "plan"
    config = _config(env, tiny_anima, dataset, run_name="planned")
    out = _train(env, config)
    said = ("checkpointing auto: 26 of 28 blocks recompute (a block keeps 0.71 GiB at the largest batch; predicted "
            "peak 7.4 of 8.0 GiB)")
    ws = [e[1] for e in env.log if e[0] == "ws"]
    assert {"node": "12:5", "prompt_id": "prompt-1", "event": "message", "text": said} in ws  # the chart's note
    assert f"memory   {said}" in out.ui["text"][0].splitlines()  # and it stays in the node's result text
    env.log.clear()
    again = _train(env, config)  # a re-used run still says the plan it ran with
    assert again.ui["text"][0].startswith("re-used") and f"memory   {said}" in again.ui["text"][0].splitlines()


def test_train_shows_the_swap_it_chose_with_the_memory_plan(comfy_env, tiny_anima, dataset):
    """issue 45: swap_blocks = "auto" decides before the model loads; the node's result text keeps that line with
    the checkpoint plan's, in the order the run said them."""
    env = comfy_env
    env.mode["value"] = "swap"
    out = _train(env, _config(env, tiny_anima, dataset, run_name="swapped"))
    memory = [line for line in out.ui["text"][0].splitlines() if line.startswith("memory   ")]
    assert memory == ["memory   swap auto: 3 of 28 blocks swapped, the fewest with which the step fits",
                      "memory   checkpointing auto: 26 of 28 blocks recompute (a block keeps 0.71 GiB at the largest "
                      "batch; predicted peak 7.4 of 8.0 GiB)"]


def test_the_swap_blocks_widget_stands_for_auto_at_zero(comfy_env, dataset):
    """swap_blocks' default became "auto" (issue 45): the INT widget keeps 0 as its default, which writes no key, so
    the run plans the swap; a number is written as the count."""
    nt = comfy_env.nt
    port = {p.id: p for p in nt.AnimaTrainConfig.define_schema().inputs}["swap_blocks"]
    assert port.kind == "INT" and port.options["default"] == 0 and "[0 here = auto]" in port.options["tooltip"]
    values = widgets(nt, "x", dataset)
    assert parse_config(comfy_env.tc.config_toml(dict(values, swap_blocks=0))).train.swap_blocks == "auto"
    assert parse_config(comfy_env.tc.config_toml(dict(values, swap_blocks=3))).train.swap_blocks == 3


def test_train_shows_the_validation_summary_and_its_verdict(comfy_env, tiny_anima, dataset):
    env = comfy_env
    env.mode["value"] = "validation"
    config = _config(env, tiny_anima, dataset, run_name="validated")
    out = _train(env, config)
    said = "validation loss 2.120 → 1.453, margin -0.001 → -0.000 (steps 0 → 3)"
    ws = [e[1] for e in env.log if e[0] == "ws"]
    assert any(e["event"] == "validation" and e["step"] == 3 for e in ws)  # the chart's second line
    lines = out.ui["text"][0].splitlines()
    assert said in lines and any(x.startswith("warning: the text-conditioning margin did not grow") for x in lines)
    env.log.clear()
    again = _train(env, config)  # a re-used run still says how its validation went
    assert again.ui["text"][0].startswith("re-used") and said in again.ui["text"][0].splitlines()
    reused = [e[1] for e in env.log if e[0] == "ws" and e[1]["event"] == "done"]
    assert reused[-1]["validation"] == [[3, 1.453, -0.0003]]  # the re-used chart draws the validation line too


def test_an_unchanged_rerun_reuses_the_result_without_a_worker(comfy_env, tiny_anima, dataset):
    env = comfy_env
    config = _config(env, tiny_anima, dataset, run_name="cat")
    first = _train(env, config)
    env.log.clear()
    again = _train(env, config)
    assert len(env.spawned) == 1 and ("free_vram",) not in env.log
    assert again.values[0] == first.values[0] and again.ui["text"][0].startswith("re-used the finished run")
    assert [e[1] for e in env.log if e[0] == "ws"][-1]["reused"] is True
    # a new caption changes the dataset digest: trains again (under a free name, see below)
    (dataset / "img_0.txt").write_text("blue square, black background")
    second = _train(env, config)
    assert len(env.spawned) == 2
    # so does editing the result file
    Path(second.values[0]).write_bytes(b"edited by hand")
    _train(env, config)
    assert len(env.spawned) == 3


def test_a_changed_run_gets_a_free_name_and_never_replaces_the_earlier_one(comfy_env, tiny_anima, dataset):
    env = comfy_env
    config = _config(env, tiny_anima, dataset, run_name="cat")
    first = _train(env, config)
    kept = Path(first.values[0]).read_bytes()
    (dataset / "img_0.txt").write_text("blue square, black background")  # new inputs: a new run
    env.log.clear()
    second = _train(env, config)
    out_dir = Path(config["run_dir"]).parent
    assert second.values[0] == str(out_dir / "cat-2" / "cat-2.safetensors")
    assert Path(first.values[0]).read_bytes() == kept  # the earlier run's file is untouched
    note = (f"run name 'cat': {out_dir / 'cat'} holds an earlier run or a running job, so this one is 'cat-2' "
            f"({out_dir / 'cat-2'})")
    assert second.ui["text"][0].splitlines()[0] == note  # shown on the node...
    assert [d["text"] for _, d, _ in (e for e in env.log if e[0] == "ws") if d["event"] == "run_note"] == [note]
    assert (env.folders["loras"] / "anima_train" / "cat-2.safetensors").is_file()  # ...and in the loras copy
    # unchanged inputs again: the finished run is found under its new name and re-used
    assert _train(env, config).values[0] == second.values[0] and len(env.spawned) == 2


def test_one_queue_parses_its_config_once_and_walks_the_dataset_once(comfy_env, tiny_anima, dataset, monkeypatch):
    # ComfyUI calls, for one queued prompt: the Training config's validate_inputs (when it is queued),
    # fingerprint_inputs and execute, then Train's execute (which here also renames the run: its name is taken)
    env, nt = comfy_env, comfy_env.nt
    calls = {"parse_config": 0, "confine_toml": 0, "dataset_digest": 0}

    def counted(name, fn):
        def count(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return count

    monkeypatch.setattr(anima_config, "parse_config", counted("parse_config", anima_config.parse_config))
    monkeypatch.setattr(nt.paths, "confine_toml", counted("confine_toml", nt.paths.confine_toml))
    monkeypatch.setattr(nt.run_records, "dataset_digest", counted("dataset_digest", nt.run_records.dataset_digest))

    def queue(prompt, **over):
        monkeypatch.setattr(env.comfy, "queued_prompt_id", lambda: prompt)
        values = widgets(nt, tiny_anima.diffusers_dir, dataset, run_name="once", **over)
        assert nt.AnimaTrainConfig.validate_inputs(**values) is True
        nt.AnimaTrainConfig.fingerprint_inputs(**values)
        return _train(env, nt.AnimaTrainConfig.execute(**values).values[0])

    queue("prompt-a")
    assert calls == {"parse_config": 1, "confine_toml": 0, "dataset_digest": 1}
    second = queue("prompt-b", epochs=2)  # a new queue parses again (files may have changed in between)
    assert calls == {"parse_config": 2, "confine_toml": 0, "dataset_digest": 2}
    assert Path(second.values[0]).parent.name == "once-2"
    # outside a queued prompt (a script calling the node) nothing is kept
    monkeypatch.setattr(env.comfy, "queued_prompt_id", lambda: None)
    values = widgets(nt, tiny_anima.diffusers_dir, dataset, run_name="once")
    nt.AnimaTrainConfig.validate_inputs(**values)
    nt.AnimaTrainConfig.validate_inputs(**values)
    assert calls["parse_config"] == 4


def test_each_job_has_its_own_stop_file(comfy_env, tiny_anima, dataset):
    env = comfy_env
    _train(env, _config(env, tiny_anima, dataset, run_name="a"))
    _train(env, _config(env, tiny_anima, dataset, run_name="a", epochs=3))
    (_, stop_a, _), (_, stop_b, _) = env.spawned
    assert stop_a != stop_b and stop_a.parent.name == "a" and stop_b.parent.name == "a-2"
    assert stop_a.name != stop_b.name  # cancelling one job can never stop another one
    assert not stop_a.exists() and not stop_b.exists()


def test_a_user_file_in_loras_is_never_replaced(comfy_env, tiny_anima, dataset):
    env = comfy_env
    mine = env.folders["loras"] / "anima_train" / "cat.safetensors"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"a LoRA the user made")
    out = _train(env, _config(env, tiny_anima, dataset, run_name="cat"))
    assert mine.read_bytes() == b"a LoRA the user made"
    assert (mine.parent / "cat-2.safetensors").read_bytes() == Path(out.values[0]).read_bytes()


def test_train_failure_shows_the_worker_error_on_the_node(comfy_env, tiny_anima, dataset):
    env = comfy_env
    env.mode["value"] = "fail"
    config = _config(env, tiny_anima, dataset, run_name="oom")
    with pytest.raises(RuntimeError) as exc:
        _train(env, config)
    msg = str(exc.value)
    assert "training oom failed" in msg and "CUDA out of memory (fake)" in msg
    assert "comfyui-worker.log" in msg
    assert not (Path(config["run_dir"]) / "comfyui-result.json").exists()


@pytest.mark.parametrize("state_on_stop", [True, False])
def test_cancel_keeps_the_run_says_where_it_stopped_and_the_next_queue_resumes_it(comfy_env, tiny_anima, dataset,
                                                                                   monkeypatch, state_on_stop):
    env = comfy_env
    env.mode["value"] = "slow"

    def interrupted():
        if any(e[0] == "ws" and e[1]["event"] == "step" for e in env.log):
            raise Interrupted()

    monkeypatch.setattr(env.comfy, "throw_if_interrupted", interrupted)
    # the default config (save_optimizer_state off); a config may opt out of the state a stop writes
    extra = "" if state_on_stop else "[train]\nsave_state_on_stop = false\n"
    config = _config(env, tiny_anima, dataset, run_name="stopme", extra_toml=extra)
    run_dir = Path(config["run_dir"])
    with pytest.raises(Interrupted):
        _train(env, config)
    after = [e[1] for e in env.log if e[0] == "ws"]
    assert [e["event"] for e in after[-3:]] == ["checkpoint", "done", "cancelled"]
    ckpt = run_dir / "stopme-step000001.safetensors"
    assert after[-3]["path"] == str(ckpt) and ckpt.is_file()
    said = after[-1]["text"]
    assert said.startswith("cancelled at step 1 of 3: saved ") and str(ckpt) in said, said
    assert not any(p.name.startswith((".comfyui-stop", "comfyui-stop")) for p in run_dir.iterdir())
    from anima_train.outputs.run_folder import lock_holder

    assert lock_holder(run_dir, env.picking.JOB_LOCK_NAME) is None  # the node's lock on the folder is free again

    # queue the same inputs again, with Cancel not pressed
    monkeypatch.setattr(env.comfy, "throw_if_interrupted", lambda: None)
    env.mode["value"] = "ok"
    env.log.clear()
    out = _train(env, config)
    job = parse_config((Path(out.values[0]).parent / env.nt.JOB_CONFIG_NAME).read_text())
    messages = [e[1]["text"] for e in env.log if e[0] == "ws" and e[1]["event"] == "run_note"]
    if state_on_stop:
        assert said.endswith("queue again (same inputs) to resume from step 1"), said
        assert after[-1]["resumable"] is True
        assert job.train.resume_from == str(run_dir / "stopme-step000001-state")  # resumed in the same folder
        assert job.run_stem == "stopme" and out.values[0] == str(run_dir / "stopme.safetensors")
        assert any("resuming the run cancelled at step 1 of 3" in m for m in messages), messages
    else:
        assert "no resume state: save_state_on_stop = false" in said and after[-1]["resumable"] is False
        assert job.train.resume_from is None and job.run_stem == "stopme-2"  # a new run, beside the stopped one
    assert not (run_dir / env.nt.run_records.CANCELLED_NAME).exists()


def test_the_cancel_grace_follows_the_step_time_and_is_bounded(comfy_env):
    nt = comfy_env.nt
    assert nt.cancel_grace(0.5) == nt.GRACE_SAVE_S + 1.0
    assert nt.cancel_grace(100.0) == nt.GRACE_SAVE_S + 200.0  # a slow step still gets to its end, then the save
    assert nt.cancel_grace(10_000.0) == nt.GRACE_MAX_S


def test_cancel_while_the_model_loads_ends_the_worker_at_once(comfy_env, tiny_anima, dataset, monkeypatch):
    import time

    env = comfy_env
    env.mode["value"] = "loading"

    def interrupted():
        if any(e[0] == "ws" and e[1]["event"] == "status" for e in env.log):
            raise Interrupted()

    monkeypatch.setattr(env.comfy, "throw_if_interrupted", interrupted)
    config = _config(env, tiny_anima, dataset, run_name="early", save_optimizer_state=True)
    t0 = time.perf_counter()
    with pytest.raises(Interrupted):
        _train(env, config)
    assert time.perf_counter() - t0 < 5.0  # not the 60 s grace meant for saving optimizer state


# -- Load trained LoRA, prompt encoding -------------------------------------------------------------------------


def test_load_trained_lora_prefers_the_path_and_uses_comfys_loader(comfy_env, tmp_path, monkeypatch):
    env = comfy_env
    calls = []
    monkeypatch.setattr(env.comfy, "load_lora", lambda m, c, p, sm, sc: (calls.append((m, c, p, sm, sc)) or
                                                                         ("patched model", "patched clip")))
    lora = tmp_path / "x.safetensors"
    lora.write_bytes(b"w")
    node = env.nt.AnimaLoadTrainedLora
    out = node.execute(model="model", lora_path=str(lora), lora_name="ignored.safetensors", strength_model=0.8,
                       strength_clip=0.5, clip=None)
    assert out.values == ("patched model", None) and calls == [("model", None, str(lora), 0.8, 0.0)]
    out = node.execute(model="model", lora_path="", lora_name="from_folder.safetensors", clip="clip")
    assert calls[-1][2] == str(env.folders["loras"] / "from_folder.safetensors") and out.values[1] == "patched clip"
    with pytest.raises(FileNotFoundError, match="no such file"):
        node.execute(model="model", lora_path=str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="no LoRA given"):
        node.execute(model="model", lora_path="", lora_name=env.nt.NO_FILE)
    assert node.execute(model="model", lora_path=str(lora), strength_model=0, strength_clip=0).values == ("model", None)
    f0 = node.fingerprint_inputs(lora_path=str(lora))
    lora.write_bytes(b"retrained")
    assert node.fingerprint_inputs(lora_path=str(lora)) != f0


def test_encode_prompt_gives_the_conditioning_layout_comfy_anima_consumes(comfy_env, tiny_anima):
    import torch

    cond = comfy_env.nt.AnimaTrainTextEncode.execute(model_path=str(tiny_anima.diffusers_dir),
                                                     text="red circle, white background").values[0]
    (cross_attn, extras), = cond
    hidden = tiny_anima.configs["text_encoder"]["hidden_size"]
    assert cross_attn.ndim == 3 and cross_attn.shape[0] == 1 and cross_attn.shape[2] == hidden
    assert torch.isfinite(cross_attn).all() and cross_attn.abs().sum() > 0
    ids, weights = extras["t5xxl_ids"], extras["t5xxl_weights"]
    assert ids.dtype == torch.int32 and ids.ndim == 1 and int(ids[-1]) == 1  # T5 appends </s> (id 1)
    assert torch.equal(weights, torch.ones(ids.shape[0]))
    encode = comfy_env.nt.AnimaTrainTextEncode.execute
    other = encode(model_path=str(tiny_anima.diffusers_dir), text="red square, white background").values[0][0][0]
    assert other.shape == cross_attn.shape and not torch.allclose(other, cross_attn)
    # an empty prompt: one masked (zeroed) Qwen token, as in training's caption dropout; T5 still gives </s>
    (empty, empty_extras), = encode(model_path=str(tiny_anima.diffusers_dir), text="").values[0]
    assert empty.shape == (1, 1, hidden) and float(empty.abs().sum()) == 0.0
    assert empty_extras["t5xxl_ids"].tolist() == [1]


def test_two_comfyui_instances_never_pick_the_same_run_folder(comfy_env, tiny_anima, dataset):
    """Another ComfyUI (same output folder) has picked output/anima_train/cat and not started its worker yet: the
    folder has no run files and no trainer lock, only that node's job lock. This job must take cat-2."""
    from anima_train.outputs import run_folder

    env = comfy_env
    config = _config(env, tiny_anima, dataset, run_name="cat")
    other = run_folder.RunLock(Path(config["run_dir"]), env.picking.JOB_LOCK_NAME)  # an OS lock: held per open file
    other.acquire()
    try:
        out = _train(env, config)
    finally:
        other.release()
    assert out.values[0] == str(Path(config["run_dir"]).parent / "cat-2" / "cat-2.safetensors")
    assert env.spawned[0][0].parent.name == "cat-2" and "running job" in out.ui["text"][0].splitlines()[0]
    assert not (Path(config["run_dir"]) / "comfyui-job.toml").exists()  # the other job's folder is untouched
    # the lock is released after the job: the next job may use cat-2 again (re-used, unchanged inputs)
    assert run_folder.lock_holder(Path(out.values[0]).parent, env.picking.JOB_LOCK_NAME) is None


@pytest.mark.slow
def test_a_trainer_lock_refusal_is_shown_on_the_node(comfy_env, tiny_anima, dataset, monkeypatch):
    """The real trainer as the worker. Between the node picking a free folder and its worker starting, a CLI run
    (`anima-train train`) starts in the same folder; the worker refuses (RunRefused) and the node says why."""
    from anima_train.outputs import run_folder

    env = comfy_env
    monkeypatch.setattr(env.nt, "train_command", env.real_train_command)
    cli = {}
    picked = env.nt.pick_run

    def pick_then_cli_starts(*args):
        result = picked(*args)
        cli["lock"] = run_folder.RunLock(result[2])  # the trainer's own lock, as the CLI run holds it
        cli["lock"].acquire()
        return result

    monkeypatch.setattr(env.nt, "pick_run", pick_then_cli_starts)
    config = _config(env, tiny_anima, dataset, run_name="cat", dtype="float32")
    try:
        with pytest.raises(Exception) as exc:
            _train(env, config)
    finally:
        cli["lock"].release()
    msg = str(exc.value)
    run_dir = Path(config["run_dir"])
    # what happened, first, once, in the trainer's words (holder and the ways out), without an exit status
    # (its first line within 120 characters: the rest of it on the second line)
    first = " ".join(msg.splitlines()[:2])
    assert first.startswith(f"{run_dir} is in use by another training run (pid {os.getpid()} on "), msg
    assert "\ntraining cat did not start\n" in msg, msg  # the run it concerns: after the message
    assert max(map(len, msg.splitlines()[:1])) <= 120, msg
    assert "give this run another run_name (Anima: Training config)" in msg, msg  # the widget, on its node
    assert msg.replace("\n", " ").count("is in use by another") == 1, msg
    assert "exit status" not in msg and msg.splitlines()[-1] == f"full log: {run_dir / 'comfyui-worker.log'}"
    assert [e[1]["message"] for e in env.log if e[0] == "ws" and e[1]["event"] == "error"] == [
        first]  # the chart shows it too
    assert not run_folder.run_files(run_dir, "cat") and not (run_dir / "comfyui-result.json").exists()


def test_relay_sends_previews_as_small_inline_images(comfy_env, tmp_path):
    """A trainer `samples` event (PNG paths) reaches the page with one small JPEG data URL per image, in order; an
    unreadable file is a null, not a failed run."""
    import base64
    import io

    from PIL import Image

    paths = []
    for i, colour in enumerate(((220, 30, 30), (30, 60, 220))):
        path = tmp_path / "samples" / f"step000010-prompt{i:02d}.png"
        path.parent.mkdir(exist_ok=True)
        Image.new("RGB", (1024, 768), colour).save(path)
        paths.append(str(path))
    relay = comfy_env.nt.Relay("7", "client-1", "prompt-1")
    relay({"event": "samples", "step": 10, "paths": paths + [str(tmp_path / "gone.png")], "prompts": ["a", "b", "c"]})
    (kind, sent, sid), = [entry for entry in comfy_env.log if entry[0] == "ws"]
    assert sid == "client-1" and sent["node"] == "7" and sent["prompt_id"] == "prompt-1" and sent["step"] == 10
    assert sent["images"][2] is None and len(sent["images"]) == 3
    for url, colour in zip(sent["images"][:2], ((220, 30, 30), (30, 60, 220))):
        assert url.startswith("data:image/jpeg;base64,") and len(url) < 20_000
        image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        assert image.size == (256, 192)
        assert all(abs(a - b) <= 3 for a, b in zip(image.getpixel((128, 96)), colour))


def test_a_texture_curriculum_goes_in_extra_toml_and_two_gpus_are_refused_before_a_worker(comfy_env, tiny_anima,
                                                                                         dataset):
    from anima_train.data.texture import TextureError

    env = comfy_env
    extra = ('[dataset]\nsource = "encode"\n[dataset.texture]\ncanvases = [[64, 64], [64, 64], [128, 64]]\n'
             'trigger = "tex"\n[[curriculum]]\nat = 0.0\n[[curriculum]]\nat = 0.5\nmode = "texture"\n'
             't_range = [0.0, 0.6]\nlr_mul = 0.5\n')
    values = widgets(env.nt, tiny_anima.diffusers_dir, dataset, run_name="tex", extra_toml=extra)
    assert env.nt.AnimaTrainConfig.validate_inputs(**values) is True
    config = env.nt.AnimaTrainConfig.execute(**values).values[0]
    cfg = parse_config(config["toml"])
    assert [p.mode for p in cfg.curriculum] == ["fullres", "texture"] and cfg.dataset.texture.trigger == "tex"
    assert cfg.dataset.texture.canvases == [[64, 64], [64, 64], [128, 64]] and cfg.dataset.source == "encode"
    with pytest.raises(TextureError, match="on 2 processes is refused: set gpus to 1"):
        _train(env, config, gpus=2)
    assert env.spawned == []  # refused on the node, before a worker (and accelerate launch) started
    _train(env, config, gpus=1)
    assert env.spawned[0][2] == 1


def test_the_page_starts_the_first_runs_worker_ahead_through_the_packs_route(comfy_env, monkeypatch):
    """A Train node on the canvas asks the server (js/anima_train.js) to start the next run's worker, in the
    environment the Train node gives its runs, so that the first run of a ComfyUI session skips Python's imports
    too. Fails without it: no route, and a session's first run starts its own process."""
    import asyncio

    import nodes
    from nodes import worker

    routes = {}
    monkeypatch.setattr(comfy_env.comfy, "add_post_route", lambda path, respond: routes.setdefault(path, respond))
    asyncio.run(nodes.AnimaTrainExtension().on_load())
    respond = routes[comfy_env.nt.WORKER_AHEAD_ROUTE]
    js = (Path(__file__).resolve().parents[1] / "js" / "anima_train.js").read_text(encoding="utf-8")
    assert f'WORKER_AHEAD_ROUTE = "{comfy_env.nt.WORKER_AHEAD_ROUTE}"' in js  # the path the page posts to
    try:
        assert respond() == {"waiting": True}
        first = worker._standby["proc"]
        assert first.poll() is None and worker._standby["env"] == worker.worker_env()
        assert respond() == {"waiting": True} and worker._standby["proc"] is first  # asked again: the same one
        worker.stop_standby()
        monkeypatch.setenv(worker.STANDBY_ENV, "0")
        assert respond() == {"waiting": False} and "proc" not in worker._standby
    finally:
        worker.stop_standby()
