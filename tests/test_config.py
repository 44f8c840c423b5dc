"""Tests of anima_train.config against the configuration of the original trainer this project re-creates.

The expected defaults below are written out by hand (that trainer's), not generated from the module, so a default
that drifts in anima_train/config/schema.py fails here.
"""

import dataclasses
import importlib.util
import os
import warnings
from pathlib import Path

import pytest

from anima_train import config as C
from anima_train.config import (Config, ConfigError, ConfigWarning, copy_config_verbatim, dump_toml, iter_fields,
                                load_config, parse_config, sanitize_run_name)

D = '[dataset]\npath = "/data/train"\n'  # the minimal valid config; dataset keys may follow it directly

# --------------------------------------------------------------------------------------------- spec defaults

SPEC_DEFAULTS = {
    "train": {
        "model_path": "../anima-diffusers", "output_dir": "output", "run_name": "anima", "epochs": 1,
        "max_steps": None, "batch_size": 1, "gradient_accumulation_steps": 1, "gradient_checkpointing": True,
        "checkpoint_blocks": "auto",  # ours (the speed issue): the original has only the all-or-nothing switch
        "recompute": "graph",  # ours (the speed issue): inside the compiled backward; "block" = the original's way
        "swap_blocks": "auto",  # ours (issues 26, 45): frozen block weights in host memory where the card needs it;
        # 0 = the original's
        "base_matmul": "bf16",  # ours (the speed issue): "fp8" = FP8 GEMMs over a frozen base; bf16 = the original's
        "dtype": "bfloat16", "seed": 42, "num_workers": 2, "vae_encode_chunk": 1, "save_every_steps": None,
        "save_every_epochs": 1, "save_native": True, "save_optimizer_state": False,
        "save_state_on_stop": True,  # ours (the ComfyUI issue): a stop keeps what resuming needs
        "keep_last_n": None,
        "resume_from": None, "skip_final_save": False, "allow_multi_gpu_texture": False, "log_every": 1,
        "progress": "auto", "compile": "auto", "compile_dynamic": True, "compile_regional": True,
    },
    "dataset": {
        "path": None, "resolution": 1024, "resolutions": None, "tier_collapse": "dedup",
        "min_source_area": 0.0, "min_bucket_reso": 256, "max_bucket_reso": 1920, "bucket_reso_steps": 64,
        "bucket_no_upscale": True, "multires_training": False, "num_repeats": 1, "source": "auto",
        "cache_text_encoder_outputs": False,  # ours (the speed issue): sd-scripts' name; the original encodes always
    },
    "dataset.subsets": {"path": C.REQUIRED, "num_repeats": 1, "texture": True},
    "dataset.caption": {
        "caption_mode": "tags", "mixed_weights": {"tags": 1.0, "nl": 1.0, "tags_nl": 1.0, "nl_tags": 1.0},
        "shuffle_tags": False, "shuffle_keep_first_n": 0, "tag_dropout_percent": 0.0,
        "caption_dropout_percent": 0.0, "min_tags_kept": 3, "tag_delimiter": ", ", "protected_tags": [],
        "protected_tags_file": None, "nl_shuffle_sentences": False, "nl_keep_first_sentence": True,
    },
    "dataset.texture": {
        "canvases": [[640, 1536], [1536, 640], [832, 1216], [1216, 832], [1024, 1024], [1024, 1024]],
        "trigger": "", "oversize": "pad", "fit_aware": True, "cover_max_scale": 1.15, "pad_mode": "reflect",
        "mask_padding": True, "mask_ratio": [0.5, 1.0], "feather_latent_px": 4, "energy_power": 1.0,
        "energy_downscale": 8,
    },
    "adapter": {
        "kind": "lora", "rank": 32, "alpha": 32.0, "dropout": 0.0, "components": ["self_attn", "cross_attn", "mlp"],
        "train_llm_adapter": False, "train_text_encoder": False, "text_encoder_rank": None, "lokr_factor": -1,
        "lokr_decompose_both": False, "output_format": "peft",
    },
    "component_lr": {
        "self_attn": None, "cross_attn": None, "mlp": None, "adaln": 0.0, "base": 0.0, "llm_adapter": 0.0,
        "text_encoder": None,
    },
    "quant": {
        "mode": "none", "weights_dtype": "int8", "use_quantized_matmul": "auto", "skip_policy": "default",
        "quantize_text_conditioner": False, "quantize_text_encoder": False, "extra_skip": [],
        "dynamic_loss_threshold": None, "group_size": 0, "use_stochastic_rounding": True,
    },
    "flow": {
        "timestep_sample_method": "logit_normal", "sigmoid_scale": 1.0, "shift": None, "flux_shift": False,
        "use_ot": False, "phase_mapping": "rescale", "hf_scale": 0.0, "hf_exponent": 1.0,
    },
    "curriculum": {"at": 0.0, "t_range": [0.0, 1.0], "mode": "fullres", "lr_mul": 1.0},
    "optimizer": {
        "kind": "adamw", "lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01,
        "max_grad_norm": 1.0, "quantize_state": False, "offload_state": False, "use_kahan": False,
    },
    "schedule": {
        "kind": "constant", "warmup_steps": 0, "min_lr_ratio": 0.0, "d": 0.9, "global_d": 0.78, "local_d": 0.85,
        "weight_power": 1.5, "num_segments": 8,
    },
}


@pytest.fixture(autouse=True)
def _no_model_env(monkeypatch):
    monkeypatch.delenv("ANIMA_MODEL", raising=False)


def _errors(text: str) -> str:
    with pytest.raises(ConfigError) as exc:
        parse_config(text)
    return str(exc.value)


def _file_errors(path) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    return str(exc.value)


@pytest.mark.parametrize("table", list(SPEC_DEFAULTS))
def test_every_key_has_the_spec_default(table):
    got = {f.name: f.default for f in iter_fields(table)}
    assert set(got) == set(SPEC_DEFAULTS[table]), "keys differ from the original trainer's"
    for key, want in SPEC_DEFAULTS[table].items():
        assert got[key] == want and type(got[key]) is type(want), f"[{table}] {key}: {got[key]!r} != {want!r}"


def test_defaults_of_a_loaded_minimal_config():
    cfg = parse_config(D)
    assert cfg.dataset.path == "/data/train"
    assert cfg.dataset.subsets == [] and cfg.curriculum == []
    for table, keys in SPEC_DEFAULTS.items():
        if table in ("dataset.subsets", "curriculum"):
            continue
        obj = cfg
        for part in table.split("."):
            obj = getattr(obj, part)
        for key, want in keys.items():
            if (table, key) != ("dataset", "path"):
                assert getattr(obj, key) == want, f"[{table}] {key}"
    # Omitting [adapter] gives a rank-32 LoRA; the tiers default to [resolution].
    assert cfg.adapter.kind == "lora" and cfg.adapter.rank == 32 and cfg.dataset.tiers == [1024]
    assert cfg.dataset.resolved_subsets() == [C.SubsetConfig(path="/data/train", num_repeats=1, texture=True)]


def test_fields_carry_help_and_choices_for_generators():
    for table in C.TABLES:
        for f in iter_fields(table):
            assert f.help and "\n" not in f.help, f"[{table}] {f.name} has no one-line help"
    choices = {f.name: f.choices for f in iter_fields("train")}
    assert choices["dtype"] == ("bfloat16", "float16", "float32")
    assert choices["progress"] == ("auto", "bar", "plain", "off")
    assert set(choices["compile"]) == {"auto", "off", "default", "reduce-overhead", "max-autotune",
                                       "max-autotune-no-cudagraphs"}
    assert choices["epochs"] is None
    types = {f.name: f.type for f in iter_fields("train")}
    assert types["epochs"] is int and types["max_steps"] == int | None  # real types, not annotation strings
    assert set(next(f for f in iter_fields("adapter") if f.name == "components").choices) == {
        "self_attn", "cross_attn", "mlp", "adaln", "base"}
    assert {f.name for f in iter_fields(C.DatasetConfig)} == set(SPEC_DEFAULTS["dataset"])  # class form too


# --------------------------------------------------------------------------------------------- env, sources


def test_anima_model_env_overrides_the_default_only(monkeypatch):
    assert parse_config(D).train.model_path == "../anima-diffusers"
    monkeypatch.setenv("ANIMA_MODEL", "/models/anima")
    assert parse_config(D).train.model_path == "/models/anima"
    assert parse_config(D + '[train]\nmodel_path = "/explicit"\n').train.model_path == "/explicit"
    # The env value is the default, so dump_toml leaves it out and the file stays portable.
    assert "model_path" not in dump_toml(parse_config(D))


def test_load_a_path_or_a_str_path_and_parse_text(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text(D + "[train]\nepochs = 4\n")
    for path in (f, str(f)):
        assert load_config(path).train.epochs == 4 and load_config(path).source_path == f
    assert parse_config(f.read_text()).train.epochs == 4 and parse_config(f.read_text()).source_path is None


def test_load_config_never_takes_text_for_a_path(tmp_path, monkeypatch):
    """Which one a string is, the caller says: load_config reads a file, parse_config takes TOML text. A str path
    that does not exist is "not found" whatever it looks like, and TOML text given to load_config is no file."""
    monkeypatch.chdir(tmp_path)
    assert "config file not found" in _file_errors("configs/lora.toml")
    assert "config file not found" in _file_errors("epochs=3")
    (tmp_path / "x = 1").write_text(D)  # a file whose name looks like TOML is still a file
    assert load_config("x = 1").source_path == Path("x = 1")
    with pytest.raises(TypeError):
        parse_config(tmp_path / "c.toml")


def test_missing_file_and_bad_toml_name_the_file(tmp_path):
    assert "not found" in _file_errors(str(tmp_path / "nope.toml"))
    f = tmp_path / "broken.toml"
    f.write_text(D + "[train\n")
    msg = _file_errors(f)
    assert str(f) in msg and "not valid TOML" in msg and "line" in msg


def test_errors_name_the_file(tmp_path):
    f = tmp_path / "lora.toml"
    f.write_text(D + "[train]\nepochs = 0\n")
    msg = _file_errors(f)
    assert msg.startswith(str(f)) and "[train] epochs = 0: must be >= 1" in msg


# --------------------------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("text, where, bad, suggestion", [
    (D + "[train]\nepoch = 3\n", "[train]", "epoch", "did you mean 'epochs'?"),
    (D + "[train]\nlr = 1e-4\n", "[train]", "lr", "'lr' belongs in [optimizer]"),
    (D + "[optimizer]\nlerning_rate = 1e-4\n", "[optimizer]", "lerning_rate", "valid keys: kind, lr,"),
    (D + "resolutoin = 768\n", "[dataset]", "resolutoin", "did you mean 'resolution'?"),
    (D + "[dataset.caption]\ncaption_mod = \"nl\"\n", "[dataset.caption]", "caption_mod",
     "did you mean 'caption_mode'?"),
    (D + "[dataset.texture]\ncanvas = [[512, 512]]\n", "[dataset.texture]", "canvas", "did you mean 'canvases'?"),
    ('[[dataset.subsets]]\npath = "/a"\nnum_repeat = 2\n', "[[dataset.subsets]] #1", "num_repeat",
     "did you mean 'num_repeats'?"),
    (D + "[[curriculum]]\nat = 0.0\ntrange = [0.0, 0.5]\n", "[[curriculum]] #1", "trange",
     "did you mean 't_range'?"),
    (D + "[adapter]\nrank = 8\ntype = \"lora\"\n", "[adapter]", "type", "valid keys: kind, rank, alpha"),
])
def test_unknown_key_names_table_key_and_suggestion(text, where, bad, suggestion):
    msg = _errors(text)
    assert f"{where} unknown key '{bad}'" in msg and suggestion in msg and "valid keys:" in msg


@pytest.mark.parametrize("text, where, bad, suggestion", [
    # sd-scripts users type sd-scripts' names: each must lead to our key, in its table
    (D + "[train]\nlearning_rate = 1e-4\n", "[train]", "learning_rate", "did you mean [optimizer] lr?"),
    (D + "[optimizer]\nlearning_rate = 1e-4\n", "[optimizer]", "learning_rate", "did you mean 'lr'?"),
    (D + "[adapter]\nnetwork_dim = 16\n", "[adapter]", "network_dim", "did you mean 'rank'?"),
    (D + "[train]\nnetwork_alpha = 16\n", "[train]", "network_alpha", "did you mean [adapter] alpha?"),
    (D + "[train]\ntrain_batch_size = 2\n", "[train]", "train_batch_size", "did you mean 'batch_size'?"),
    (D + "[train]\nmax_train_steps = 2\n", "[train]", "max_train_steps", "did you mean 'max_steps'?"),
    (D + "[train]\noutput_name = \"x\"\n", "[train]", "output_name", "did you mean 'run_name'?"),
    (D + "[train]\nmixed_precision = \"bf16\"\n", "[train]", "mixed_precision", "did you mean 'dtype'?"),
    (D + "[train]\nlr_scheduler = \"cosine\"\n", "[train]", "lr_scheduler", "did you mean [schedule] kind?"),
    (D + "[train]\nenable_bucket = true\n", "[train]", "enable_bucket", "bucketing is always on here"),
    # a typo of a key of another table, and a generic word for this table's `kind`
    (D + "[train]\nwarmup_step = 3\n", "[train]", "warmup_step", "did you mean [schedule] warmup_steps?"),
    (D + "[adapter]\ntype = \"lora\"\n", "[adapter]", "type", "did you mean 'kind'?"),
    (D + "[validation]\nvalidation_split = 0.1\n", "[validation]", "validation_split", "did you mean 'fraction'?"),
    (D + "[train]\nvalidate_every_n_steps = 5\n", "[train]", "validate_every_n_steps",
     "did you mean [validation] every_n_steps?"),
])
def test_unknown_key_suggests_our_name_for_other_trainers_names(text, where, bad, suggestion):
    msg = _errors(text)
    assert f"{where} unknown key '{bad}' ({suggestion}" in msg


def test_a_flat_sd_scripts_key_outside_any_table_names_its_table():
    msg = _errors("learning_rate = 1e-4\n" + D)
    assert "'learning_rate' is outside any table; keys go inside a table, e.g. [optimizer] lr" in msg
    msg = _errors("no_such_thing = 1\n" + D)
    assert "'no_such_thing' is outside any table; it is not a key of any table" in msg and "[train] no_" not in msg


def test_unknown_section():
    msg = _errors(D + "[trian]\nepochs = 2\n")
    assert "unknown table 'trian'" in msg and "did you mean 'train'?" in msg and "valid tables:" in msg
    msg = _errors(D + "[lora]\nrank = 8\n")
    assert "unknown table 'lora'" in msg and "adapter" in msg


def test_key_outside_any_table():
    msg = _errors("epochs = 3\n" + D)
    assert "'epochs' is outside any table" in msg and "[train] epochs" in msg


def test_curriculum_as_single_table_asks_for_double_brackets():
    msg = _errors(D + "[curriculum]\nat = 0.0\n")
    assert "[[curriculum]]" in msg and "array of tables" in msg


def test_subsets_as_single_table_asks_for_double_brackets():
    assert "[[dataset.subsets]]" in _errors('[dataset.subsets]\npath = "/a"\n')


# --------------------------------------------------------------------------------------------- types


@pytest.mark.parametrize("text, expected", [
    (D + '[train]\nepochs = "3"\n', '[train] epochs = "3": expected an integer (e.g. epochs = 1), got a string'),
    (D + "[train]\nepochs = true\n", "[train] epochs = true: expected an integer"),  # a bool is not an int
    (D + "[train]\nepochs = 2.0\n", "[train] epochs = 2.0: expected an integer"),
    (D + "[train]\ngradient_checkpointing = 1\n", "gradient_checkpointing = 1: expected true or false"),
    (D + "[optimizer]\nlr = true\n", "[optimizer] lr = true: expected a number"),
    (D + "[optimizer]\nlr = nan\n", "expected a finite number"),
    (D + "[optimizer]\nbetas = 0.9\n", "betas = 0.9: expected a list of numbers"),
    (D + "[adapter]\ncomponents = \"mlp\"\n", "expected a list of strings"),
    (D + "[dataset.texture]\ncanvases = [1024, 1024]\n", "expected a list of lists of integers"),
    (D + "[train]\nbatch_size = { big = 4 }\n", 'the key "big" is not a whole number'),
    (D + "[quant]\nuse_quantized_matmul = \"yes\"\n", 'expected true or false or "auto"'),
    (D + "[quant]\nuse_quantized_matmul = 1\n", 'expected true or false or "auto"'),
])
def test_wrong_types_name_the_expected_type(text, expected):
    assert expected in _errors(text)


def test_int_is_accepted_where_a_float_is_expected():
    cfg = parse_config(D + "[optimizer]\nlr = 1\nmax_grad_norm = 2\n")
    assert cfg.optimizer.lr == 1.0 and type(cfg.optimizer.lr) is float
    assert type(cfg.optimizer.max_grad_norm) is float


def test_many_errors_are_reported_together():
    text = ('[train]\nepoch = 2\ndtype = "fp16"\n[dataset]\npath = "/d"\nresolution = 1024\nresolutions = [768]\n'
            "[flow]\nshift = 0.0\n[optimizer]\nkind = \"came\"\n[[curriculum]]\nat = 0.0\nt_range = [0, 600]\n")
    with pytest.raises(ConfigError) as exc:
        parse_config(text)
    errs = exc.value.errors
    assert len(errs) == 6, errs
    joined = str(exc.value)
    assert "6 problems" in joined
    for part in ("'epoch'", "dtype", "resolution and resolutions", "shift = 0.0", "needs 3 betas", "divide by 1000"):
        assert part in joined
    assert all("\n" not in e for e in errs)  # one problem per line


def test_bad_value_does_not_cause_follow_on_errors():
    # adapter.kind is unknown; the quant rule that depends on it must stay quiet instead of guessing.
    msg = _errors(D + '[adapter]\nkind = "glora"\n[quant]\nmode = "training"\n')
    assert "unknown value \"glora\"" in msg and "\n" not in msg  # one problem: one line


# --------------------------------------------------------------------------------------------- rules

RULES = [
    # [train]
    ("dtype", D + '[train]\ndtype = "fp8"\n', ['[train] dtype = "fp8"', "bfloat16", "float16", "float32"]),
    ("progress", D + '[train]\nprogress = "tqdm"\n', ["progress", '"plain"']),
    ("compile", D + '[train]\ncompile = "fast"\n', ["compile", '"max-autotune"']),
    ("vae_encode_chunk", D + "[train]\nvae_encode_chunk = 0\n", ["vae_encode_chunk = 0: must be >= 1"]),
    ("epochs", D + "[train]\nepochs = 0\n", ["epochs = 0: must be >= 1"]),
    ("batch_size", D + "[train]\nbatch_size = 0\n", ["batch_size = 0: must be >= 1"]),
    ("batch_size map value", D + "resolutions = [768]\n[train]\nbatch_size = { 768 = 0 }\n", ["must be >= 1"]),
    ("accum", D + "[train]\ngradient_accumulation_steps = 0\n", ["gradient_accumulation_steps = 0: must be >= 1"]),
    ("max_steps", D + "[train]\nmax_steps = 0\n", ["max_steps = 0: must be >= 1"]),
    ("log_every", D + "[train]\nlog_every = 0\n", ["log_every = 0: must be >= 1"]),
    ("keep_last_n", D + "[train]\nkeep_last_n = 0\n", ["keep_last_n = 0: must be >= 1"]),
    ("batch map extra key", D + "resolutions = [768, 1024]\n[train]\nbatch_size = { 768 = 8, 1024 = 4, 1280 = 2 }\n",
     ["batch_size keys [768, 1024, 1280] must equal the declared tiers [768, 1024]", "not tiers: [1280]"]),
    ("batch map missing tier", D + "resolutions = [768, 1024]\n[train]\nbatch_size = { 768 = 8 }\n",
     ["batch_size keys [768] must equal the declared tiers [768, 1024]", "without a key: [1024]"]),
    ("batch map vs resolution", D + "resolution = 768\n[train]\nbatch_size = { 1024 = 8 }\n",
     ["keys [1024] must equal the declared tiers [768]"]),
    # [dataset]
    ("path and subsets", D + '[[dataset.subsets]]\npath = "/b"\n', ["both path and [[dataset.subsets]]"]),
    ("no path no subsets", "[dataset]\nresolution = 768\n", ["no training data"]),
    ("empty config", "", ["no training data"]),
    ("resolution and resolutions", D + "resolution = 1024\nresolutions = [1024]\n",
     ["both resolution and resolutions"]),
    ("resolutions empty", D + "resolutions = []\n", ["resolutions = []"]),
    ("tier not positive", D + "resolutions = [0, 768]\n", ["every tier must be > 0"]),
    ("tier over max_bucket_reso", D + "resolutions = [768, 2048]\n", ["[2048] exceed max_bucket_reso = 1920"]),
    ("resolution over max_bucket_reso", D + "max_bucket_reso = 768\n", ["[1024] exceed max_bucket_reso = 768"]),
    ("tier_collapse", D + 'tier_collapse = "merge"\n', ["tier_collapse", '"dedup"', '"repeat"']),
    ("min_source_area", D + "min_source_area = -1\n", ["min_source_area = -1.0: must be >= 0.0"]),
    ("source", D + 'source = "cache"\n', ["source", '"encode"']),
    ("bucket_reso_steps", D + "bucket_reso_steps = 8\n", ["bucket_reso_steps = 8: must be a multiple of 16"]),
    ("num_repeats", D + "num_repeats = 0\n", ["[dataset] num_repeats = 0: must be >= 1"]),
    ("subset twice", '[[dataset.subsets]]\npath = "/a"\n[[dataset.subsets]]\npath = "/a/"\n',
     ["[[dataset.subsets]] #2 path", "same folder as [[dataset.subsets]] #1"]),
    ("subset repeats", '[[dataset.subsets]]\npath = "/a"\nnum_repeats = 0\n',
     ["[[dataset.subsets]] #1 num_repeats = 0: must be >= 1"]),
    ("subset without path", "[[dataset.subsets]]\nnum_repeats = 2\n", ["missing the required key 'path'"]),
    # [dataset.caption]
    ("caption_mode", D + '[dataset.caption]\ncaption_mode = "natural"\n', ["caption_mode", '"tags_nl"', '"mixed"']),
    ("mixed_weights key", D + '[dataset.caption]\nmixed_weights = { tag = 1.0 }\n',
     ["mixed_weights: unknown key(s) tag", "did you mean 'tags'"]),
    ("tag_dropout_percent", D + "[dataset.caption]\ntag_dropout_percent = 10\n",
     ["tag_dropout_percent = 10.0: must be <= 1.0", "fraction"]),
    ("caption_dropout_percent", D + "[dataset.caption]\ncaption_dropout_percent = -0.1\n",
     ["caption_dropout_percent = -0.1: must be >= 0.0"]),
    ("protected_tags_file", D + '[dataset.caption]\nprotected_tags_file = "/nonexistent/tags.txt"\n',
     ["protected_tags_file", "file not found"]),
    # [dataset.texture]
    ("canvases empty", D + "[dataset.texture]\ncanvases = []\n", ["canvases = []"]),
    ("canvas not pair", D + "[dataset.texture]\ncanvases = [[1024]]\n", ["[1024] is not a [w, h] pair"]),
    ("canvas side 16", D + "[dataset.texture]\ncanvases = [[1000, 1024]]\n", ["side 1000", "multiple of 16"]),
    ("canvas side zero", D + "[dataset.texture]\ncanvases = [[0, 1024]]\n", ["side 0", "positive multiple of 16"]),
    ("canvas side 2048", D + "[dataset.texture]\ncanvases = [[2064, 512]]\n", ["side 2064 > 2048"]),
    ("oversize", D + '[dataset.texture]\noversize = "crop"\n', ["oversize", '"cover"']),
    ("pad_mode", D + '[dataset.texture]\npad_mode = "zero"\n', ["pad_mode", '"black"']),
    ("cover_max_scale", D + "[dataset.texture]\ncover_max_scale = 0.9\n", ["cover_max_scale = 0.9: must be >= 1.0"]),
    ("mask_ratio lo 0", D + "[dataset.texture]\nmask_ratio = [0.0, 1.0]\n", ["0 < lo <= hi <= 1"]),
    ("mask_ratio lo>hi", D + "[dataset.texture]\nmask_ratio = [0.8, 0.5]\n", ["0 < lo <= hi <= 1"]),
    ("mask_ratio hi>1", D + "[dataset.texture]\nmask_ratio = [0.5, 1.5]\n", ["0 < lo <= hi <= 1"]),
    ("mask_ratio len", D + "[dataset.texture]\nmask_ratio = [0.5]\n", ["0 < lo <= hi <= 1"]),
    ("energy_power", D + "[dataset.texture]\nenergy_power = -1\n", ["energy_power = -1.0: must be >= 0.0"]),
    ("energy_downscale", D + "[dataset.texture]\nenergy_downscale = 0\n", ["energy_downscale = 0: must be >= 1"]),
    # [adapter]
    ("adapter kind", D + '[adapter]\nkind = "glora"\n', ['kind = "glora"', '"lokr"', '"none"']),
    ("adapter component", D + '[adapter]\ncomponents = ["self_attn", "ffn"]\n',
     ['unknown value "ffn"', '"adaln"']),
    ("adapter rank", D + "[adapter]\nrank = 0\n", ["rank = 0: must be >= 1"]),
    ("te with lokr", D + '[adapter]\nkind = "lokr"\ntrain_text_encoder = true\n',
     ['train_text_encoder = true is not supported with kind = "lokr"']),
    ("te with loha", D + '[adapter]\nkind = "loha"\ntrain_text_encoder = true\n',
     ['[adapter] train_text_encoder = true is not supported with kind = "loha"', 'use kind = "lora"']),
    ("kohya with loha", D + '[adapter]\nkind = "loha"\noutput_format = "kohya"\n',
     ['[adapter] output_format = "kohya" applies to kind = "lora", but kind = "loha"', "hada_*", '"peft"']),
    ("te with dora", D + '[adapter]\nkind = "dora"\ntrain_text_encoder = true\n',
     ['[adapter] train_text_encoder = true is not supported with kind = "dora"', 'use kind = "lora"']),
    ("kohya with dora", D + '[adapter]\nkind = "dora"\noutput_format = "kohya"\n',
     ['[adapter] output_format = "kohya" applies to kind = "lora", but kind = "dora"', "dora_scale", '"peft"']),
    ("output format", D + '[adapter]\noutput_format = "diffusers"\n', ['output_format = "diffusers"', '"kohya"']),
    ("kohya with lokr", D + '[adapter]\nkind = "lokr"\noutput_format = "kohya"\n',
     ['[adapter] output_format = "kohya" applies to kind = "lora", but kind = "lokr"', "lokr_*", '"peft"']),
    ("kohya with full finetune", D + '[adapter]\nkind = "none"\noutput_format = "kohya"\n',
     ['[adapter] output_format = "kohya" applies to kind = "lora", but kind = "none"', "save_native"]),
    # [component_lr]
    ("all frozen", D + "[component_lr]\nself_attn = 0.0\ncross_attn = 0.0\nmlp = 0.0\n",
     ["nothing to train", "frozen"]),
    ("all frozen adaln only", D + '[adapter]\ncomponents = ["adaln"]\n', ["nothing to train", "adaln = 0.0"]),
    ("lr on non-injected", D + '[adapter]\ncomponents = ["self_attn"]\n[component_lr]\nmlp = 2e-5\n',
     ["[component_lr] mlp = 2e-05", "no adapter is injected into mlp", '["self_attn"]']),
    ("llm_adapter lr without train_llm_adapter", D + "[component_lr]\nllm_adapter = 1e-5\n",
     ["llm_adapter = 1e-05", "train_llm_adapter = true"]),
    ("negative component lr", D + "[component_lr]\nmlp = -1e-5\n", ["mlp = -1e-05: must be >= 0.0"]),
    # [quant]
    ("frozen needs adapter", D + '[adapter]\nkind = "none"\n[quant]\nmode = "frozen"\n',
     ['mode = "frozen"', 'kind = "none"']),
    ("training needs full ft", D + '[quant]\nmode = "training"\n', ['mode = "training"', 'kind = "lora"']),
    ("quant mode", D + '[quant]\nmode = "int8"\n', ['mode = "int8"', '"frozen"']),
    ("skip_policy", D + '[quant]\nskip_policy = "none"\n', ["skip_policy", '"all_adaln"']),
    ("weights_dtype", D + '[quant]\nweights_dtype = "int9000"\n', ["not an SDNQ weight dtype"]),
    # [flow]
    ("shift and flux_shift", D + "[flow]\nshift = 3.0\nflux_shift = true\n", ["shift and flux_shift"]),
    ("shift zero", D + "[flow]\nshift = 0.0\n", ["shift = 0.0: must be > 0.0", "omit the key"]),
    ("shift negative", D + "[flow]\nshift = -1\n", ["shift = -1.0: must be > 0.0"]),
    ("sigmoid_scale zero", D + "[flow]\nsigmoid_scale = 0\n", ["sigmoid_scale = 0.0: must be > 0.0"]),
    ("sigmoid_scale uniform", D + '[flow]\ntimestep_sample_method = "uniform"\nsigmoid_scale = 2.0\n',
     ["sigmoid_scale = 2.0 is rejected", "logit_normal"]),
    ("sigmoid_scale with shift", D + "[flow]\nshift = 3.0\nsigmoid_scale = 2.0\n",
     ["sigmoid_scale = 2.0 is rejected", "shift = 3.0"]),
    ("sample method", D + '[flow]\ntimestep_sample_method = "beta"\n', ["timestep_sample_method", '"uniform"']),
    ("phase_mapping", D + '[flow]\nphase_mapping = "clip"\n', ["phase_mapping", '"truncate"']),
    ("hf_scale", D + "[flow]\nhf_scale = -0.5\n", ["hf_scale = -0.5: must be >= 0.0"]),
    ("hf_exponent", D + "[flow]\nhf_exponent = 0\n", ["hf_exponent = 0.0: must be > 0.0"]),
    # [[curriculum]]
    ("at 1", D + "[[curriculum]]\nat = 1.0\n", ["at = 1.0: must be < 1"]),
    ("at negative", D + "[[curriculum]]\nat = -0.1\n", ["at = -0.1: must be >= 0.0"]),
    ("t_range not pair", D + "[[curriculum]]\nat = 0.0\nt_range = [0.5]\n", ["t_range = [0.5]: must be a pair"]),
    ("t_range discrete", D + "[[curriculum]]\nat = 0.0\nt_range = [0, 600]\n",
     ["looks like discrete timesteps, divide by 1000", "t_range = [0.0, 0.6]"]),
    ("t_range order", D + "[[curriculum]]\nat = 0.0\nt_range = [0.6, 0.2]\n", ["need 0 <= lo < hi <= 1"]),
    ("t_range negative", D + "[[curriculum]]\nat = 0.0\nt_range = [-0.1, 0.5]\n", ["need 0 <= lo < hi <= 1"]),
    ("curriculum mode", D + '[[curriculum]]\nat = 0.0\nmode = "crop"\n', ['mode = "crop"', '"texture"']),
    ("lr_mul", D + "[[curriculum]]\nat = 0.0\nlr_mul = 0\n", ["lr_mul = 0.0: must be > 0.0"]),
    ("first phase not at 0", D + "[[curriculum]]\nat = 0.5\n[[curriculum]]\nat = 0.3\n",
     ["first phase starts at 0.3", "at = 0.0"]),
    ("duplicate at", D + "[[curriculum]]\nat = 0.0\n[[curriculum]]\nat = 0.5\n[[curriculum]]\nat = 0.5\n",
     ["same at = 0.5"]),
    # [optimizer]
    ("came betas", D + '[optimizer]\nkind = "came"\n', ['kind = "came" needs 3 betas', "[0.9, 0.999, 0.9999]"]),
    ("adamw betas", D + "[optimizer]\nbetas = [0.9, 0.99, 0.999]\n", ['kind = "adamw" needs 2 betas']),
    ("beta range", D + "[optimizer]\nbetas = [0.9, 1.0]\n", ["every beta must be in [0, 1)"]),
    ("8-bit state with adamw", D + "[optimizer]\nuse_kahan = true\nquantize_state = true\n",
     ["quantize_state = true only works with an SDNQ optimizer"]),
    ("kahan adamw in float16", D + '[train]\ndtype = "float16"\n[optimizer]\nuse_kahan = true\n',
     ['use_kahan = true with kind = "adamw"', 'dtype = "bfloat16"']),
    ("offload with adamw", D + "[optimizer]\noffload_state = true\n", ["offload_state = true only works"]),
    ("optimizer kind", D + '[optimizer]\nkind = "sgd"\n', ['kind = "sgd"', '"adamw8bit"', '"muon"']),
    ("lr zero", D + "[optimizer]\nlr = 0\n", ["lr = 0.0: must be > 0.0"]),
    # [schedule]
    ("schedule kind", D + '[schedule]\nkind = "cosin"\n', ['kind = "cosin"', 'did you mean "cosine"']),
    ("min_lr_ratio", D + "[schedule]\nmin_lr_ratio = 1.0\n", ["min_lr_ratio = 1.0: must be < 1.0"]),
    ("d", D + "[schedule]\nd = 1.0\n", ["d = 1.0: must be < 1.0", "0/0"]),
    ("global_d", D + "[schedule]\nglobal_d = -0.1\n", ["global_d = -0.1: must be >= 0.0"]),
    ("local_d", D + "[schedule]\nlocal_d = 1\n", ["local_d = 1.0: must be < 1.0"]),
    ("weight_power", D + "[schedule]\nweight_power = -1\n", ["weight_power = -1.0: must be >= 0.0"]),
    ("num_segments", D + "[schedule]\nnum_segments = 0\n", ["num_segments = 0: must be >= 1"]),
    ("warmup_steps", D + "[schedule]\nwarmup_steps = -1\n", ["warmup_steps = -1: must be >= 0"]),
    # [validation]
    ("validation folder and fraction", D + '[validation]\nfraction = 0.1\nfolder = "."\n',
     ["[validation] sets both folder and fraction = 0.1; keep one"]),
    ("validation fraction 1", D + "[validation]\nfraction = 1.0\n", ["[validation] fraction = 1.0: must be < 1.0"]),
    ("validation fraction negative", D + "[validation]\nfraction = -0.1\n", ["fraction = -0.1: must be >= 0.0"]),
    ("validation timesteps", D + "[validation]\nfraction = 0.1\ntimesteps = [0.0, 0.5]\n",
     ["[validation] timesteps = [0.0, 0.5]: give at least one timestep, each strictly between 0 and 1"]),
    ("validation no timesteps", D + "[validation]\nfraction = 0.1\ntimesteps = []\n",
     ["[validation] timesteps = []: give at least one timestep"]),
    ("validation folder missing", D + '[validation]\nfolder = "no/such/held_out"\n',
     ['[validation] folder = "no/such/held_out": no such folder']),
    ("validation cadence without a set", D + "[validation]\nevery_n_steps = 5\n",
     ["[validation] every_n_steps set, but there is nothing to evaluate", "fraction = 0.1"]),
    ("validation every 0", D + "[validation]\nfraction = 0.1\nevery_n_epochs = 0\n",
     ["every_n_epochs = 0: must be >= 1"]),
]


@pytest.mark.parametrize("text, expected", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule(text, expected):
    msg = _errors(text)
    for part in expected:
        assert part in msg, f"{part!r} not in:\n{msg}"


def test_texture_phase_without_encode_is_told_to_set_source_encode():
    msg = _errors(D + '[[curriculum]]\nat = 0.0\nmode = "texture"\n')
    assert 'mode = "texture" needs [dataset] source = "encode"' in msg and "not implemented" not in msg


def test_texture_phase_needs_encode_once_implemented():
    msg = _errors(D + '[[curriculum]]\nat = 0.0\nmode = "texture"\n')
    assert 'mode = "texture" needs [dataset] source = "encode"' in msg


def test_use_ot_needs_scipy(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "scipy" else real(name, *a))
    assert "use_ot = true needs scipy" in _errors(D + "[flow]\nuse_ot = true\n")


def test_valid_variants_load():
    parse_config(D + "resolutions = [768, 1024]\n[train]\nbatch_size = { 1024 = 4, 768 = 8 }\n")
    parse_config(D + "[flow]\nsigmoid_scale = 2.0\n")  # logit_normal, no shift
    parse_config(D + "[flow]\nsigmoid_scale = 2.0\nshift = 1.0\n")
    parse_config(D + "[flow]\nflux_shift = true\n")
    parse_config(D + '[optimizer]\nkind = "came"\nbetas = [0.9, 0.999, 0.9999]\n')
    parse_config(D + '[optimizer]\nkind = "adamw8bit"\nuse_kahan = true\nquantize_state = true\n')
    parse_config(D + '[adapter]\nkind = "none"\n[quant]\nmode = "training"\n')
    parse_config(D + '[quant]\nmode = "frozen"\nuse_quantized_matmul = false\nweights_dtype = "float8_e4m3fn"\n')
    parse_config(D + '[adapter]\ncomponents = ["self_attn"]\n[component_lr]\nmlp = 0.0\n')  # 0 on non-injected ok
    parse_config(D + "[component_lr]\nadaln = 0.0\nself_attn = 0.0\n")  # some frozen, not all
    parse_config(D + '[adapter]\nkind = "none"\n[component_lr]\nadaln = 1e-6\nbase = 1e-6\n')  # full FT: all parts
    parse_config(D + 'source = "encode"\n[[curriculum]]\nat = 0.0\n[[curriculum]]\nat = 0.5\nmode = "texture"\n')
    parse_config(D + "[dataset.texture]\ncanvases = [[1920, 512]]\nmask_ratio = [1.0, 1.0]\n")
    assert parse_config(D + '[adapter]\noutput_format = "kohya"\n').adapter.output_format == "kohya"
    loha = parse_config(D + '[adapter]\nkind = "loha"\nrank = 8\nalpha = 4\ndropout = 0.1\ntrain_llm_adapter = true\n'
                          '[component_lr]\nllm_adapter = 1e-6\n[quant]\nmode = "frozen"\n')
    assert loha.adapter.kind == "loha" and loha.injected_components() == ["self_attn", "cross_attn", "mlp",
                                                                          "llm_adapter"]


def test_tiers_are_deduplicated_and_sorted():
    cfg = parse_config(D + "resolutions = [1024, 768, 1024]\n")
    assert cfg.dataset.resolutions == [768, 1024] and cfg.dataset.tiers == [768, 1024]


def test_the_rules_read_and_report_and_change_nothing(tmp_path):
    """The rules across keys only read a config and report (normalise.NORMALISE puts values in final form, before them):
    run over a valid config whose values are not yet normalised, they leave every value as it was."""
    import copy

    from anima_train.config import rules
    from anima_train.config.keys import Problems, Where
    from anima_train.config.validate import Context, _scoped

    (tmp_path / "held_out").mkdir()
    (tmp_path / "tags.txt").write_text("Sky\n", encoding="utf-8")
    (tmp_path / "prompts.txt").write_text("a cat\n", encoding="utf-8")
    f = tmp_path / "c.toml"
    f.write_text(D + 'resolutions = [1024, 768]\n[dataset.caption]\nprotected_tags_file = "tags.txt"\n'
                 '[sample]\nprompts_file = "prompts.txt"\n[validation]\nfolder = "held_out"\n'
                 "[[curriculum]]\nat = 0.0\n[[curriculum]]\nat = 0.5\n", encoding="utf-8")
    cfg = load_config(f)
    as_written = [(cfg.dataset, "resolutions", [1024, 768, 768]), (cfg.dataset.caption, "mixed_weights", {"nl": 1.0}),
                  (cfg.dataset.caption, "file_protected_tags", []), (cfg.sample, "file_prompts", []),
                  (cfg.validation, "folder", "held_out"), (cfg, "curriculum", cfg.curriculum[::-1])]
    for table, key, value in as_written:
        object.__setattr__(table, key, value)  # as a file writes them, past the assignment check
    before = copy.deepcopy(cfg)
    p = Problems()
    for scope, rule in rules.RULES:
        for table, at in _scoped(cfg, Where("", toml=True), scope):
            rule(table, p, Context(toml=True, base_dir=tmp_path, require_data=True), at)
    assert not p.errors, p.errors
    assert cfg == before and [ph.at for ph in cfg.curriculum] == [0.5, 0.0]
    assert (cfg.dataset.caption.file_protected_tags, cfg.sample.file_prompts) == ([], [])


def test_curriculum_is_sorted_by_at():
    cfg = parse_config(D + "[[curriculum]]\nat = 0.5\nlr_mul = 0.5\n[[curriculum]]\nat = 0.0\n"
                          "t_range = [0.0, 0.6]\n")
    assert [ph.at for ph in cfg.curriculum] == [0.0, 0.5]
    assert cfg.curriculum[0].t_range == [0.0, 0.6] and cfg.curriculum[1].lr_mul == 0.5


def test_protected_tags_file_is_relative_to_the_config_folder(tmp_path, monkeypatch):
    sub = tmp_path / "configs"
    sub.mkdir()
    (sub / "tags.txt").write_text("# pinned\nBlue Hair\n\n  Solo  \n#comment\n", encoding="utf-8")
    f = sub / "c.toml"
    f.write_text(D + '[dataset.caption]\nprotected_tags = ["Red Eyes"]\nprotected_tags_file = "tags.txt"\n')
    monkeypatch.chdir(tmp_path)  # the cwd must not matter
    cap = load_config(f).dataset.caption
    assert cap.file_protected_tags == ["blue hair", "solo"]
    assert cap.protected_tag_set() == {"blue hair", "solo", "red eyes"}
    assert "file not found" in _errors(f.read_text())  # from text: relative to the cwd, where it is not


def test_mixed_weights_omitted_variants_weigh_zero():
    cap = parse_config(D + '[dataset.caption]\ncaption_mode = "mixed"\nmixed_weights = { tags = 2, nl = 1 }\n')
    assert cap.dataset.caption.mixed_weights == {"tags": 2.0, "nl": 1.0, "tags_nl": 0.0, "nl_tags": 0.0}


# --------------------------------------------------------------------------------------------- warnings


def test_canvas_over_1920_warns():
    with pytest.warns(ConfigWarning, match="side 2048 > 1920"):
        parse_config(D + "[dataset.texture]\ncanvases = [[2048, 512]]\n")


def test_text_encoder_lr_unset_warns():
    with pytest.warns(ConfigWarning, match="inherits optimizer.lr"):
        parse_config(D + "[adapter]\ntrain_text_encoder = true\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_config(D + "[adapter]\ntrain_text_encoder = true\n[component_lr]\ntext_encoder = 1e-6\n")


def test_injected_but_frozen_by_default_warns():
    with pytest.warns(ConfigWarning, match="adaln defaults to 0.0"):
        parse_config(D + '[adapter]\ncomponents = ["mlp", "adaln"]\n')


def test_top_level_num_repeats_with_subsets_warns():
    with pytest.warns(ConfigWarning, match="ignored with"):
        parse_config('[dataset]\nnum_repeats = 3\n[[dataset.subsets]]\npath = "/a"\n')


def test_default_config_is_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_config(D)


# --------------------------------------------------------------------------------------------- dump / copy

BUSY = """
[train]
output_dir = "runs"
run_name = "my run"
epochs = 12
max_steps = 3000
batch_size = { 768 = 12, 1024 = 8, 1280 = 4 }
gradient_accumulation_steps = 2
gradient_checkpointing = false
dtype = "float16"
seed = 7
num_workers = 0
vae_encode_chunk = 2
save_every_steps = 500
save_every_epochs = 0
save_native = false
save_optimizer_state = true
keep_last_n = 3
resume_from = "runs/x/x-state"
skip_final_save = true
allow_multi_gpu_texture = true
log_every = 10
progress = "plain"
compile = "max-autotune"
compile_dynamic = false

[dataset]
resolutions = [1280, 768, 1024]
tier_collapse = "repeat"
min_source_area = 0.5
min_bucket_reso = 320
max_bucket_reso = 1792
bucket_reso_steps = 32
bucket_no_upscale = false
multires_training = true
source = "encode"

[[dataset.subsets]]
path = "/data/train"

[[dataset.subsets]]
path = "/data/colors"
num_repeats = 2
texture = false

[dataset.caption]
caption_mode = "mixed"
mixed_weights = { tags = 3, nl_tags = 1 }
shuffle_tags = true
shuffle_keep_first_n = 1
tag_dropout_percent = 0.1
caption_dropout_percent = 0.05
min_tags_kept = 2
tag_delimiter = "; "
protected_tags = ["solo", "1girl"]
nl_shuffle_sentences = true
nl_keep_first_sentence = false

[dataset.texture]
canvases = [[512, 1024], [1024, 512]]
trigger = "texture"
oversize = "cover"
fit_aware = false
cover_max_scale = 1.0
pad_mode = "black"
mask_padding = false
mask_ratio = [0.25, 0.75]
feather_latent_px = 2
energy_power = 0.5
energy_downscale = 4

[flow]
sigmoid_scale = 1.3
use_ot = true
phase_mapping = "truncate"
hf_scale = 0.25
hf_exponent = 1.5
flux_shift = true

[optimizer]
kind = "came"
lr = 2e-5
betas = [0.9, 0.999, 0.9999]
eps = 1e-6
weight_decay = 0.0
max_grad_norm = 0.0
quantize_state = true
offload_state = true
use_kahan = true

[schedule]
kind = "rerex"
warmup_steps = 100
min_lr_ratio = 0.05
d = 0.8
global_d = 0.7
local_d = 0.8
weight_power = 1.0
num_segments = 4

[component_lr]
self_attn = 2e-5
cross_attn = 1e-5
mlp = 0.0
adaln = 1e-6
llm_adapter = 5e-6
text_encoder = 1e-6

[adapter]
kind = "lora"
rank = 16
alpha = 8
dropout = 0.1
components = ["self_attn", "cross_attn", "mlp", "adaln"]
train_llm_adapter = true
train_text_encoder = true
text_encoder_rank = 8
lokr_factor = 4
lokr_decompose_both = true
output_format = "kohya"

[quant]
mode = "frozen"
weights_dtype = "uint8"
use_quantized_matmul = true
skip_policy = "all_adaln"
quantize_text_conditioner = true
quantize_text_encoder = true
extra_skip = ["*.proj_out", "x_embedder"]
dynamic_loss_threshold = 1e-3
group_size = 32
use_stochastic_rounding = false

[[curriculum]]
at = 0.5
t_range = [0.0, 0.6]
mode = "texture"
lr_mul = 0.5

[[curriculum]]
at = 0.0
"""


def test_dump_round_trip_of_a_busy_config(monkeypatch):
    monkeypatch.setenv("ANIMA_MODEL", "/models/anima")
    cfg = parse_config(BUSY)
    text = dump_toml(cfg)
    back = parse_config(text)
    assert back == cfg
    # Spot checks that the test config really is non-default and survived (guards against an empty dump).
    assert back.optimizer.kind == "came" and back.train.batch_size == {768: 12, 1024: 8, 1280: 4}
    assert back.dataset.tiers == [768, 1024, 1280] and back.curriculum[1].mode == "texture"
    assert back.dataset.subsets[1].texture is False and back.quant.use_quantized_matmul is True
    assert cfg != parse_config(D)
    # Only non-default values are written: the defaults of [train] stay out.
    assert "model_path" not in text and "\nepochs = 12" in text and "compile_regional" not in text


def test_dump_of_a_default_config_writes_only_adapter_kind():
    assert dump_toml(Config()).strip() == '[adapter]\nkind = "lora"'
    cfg = parse_config(D + '[adapter]\nkind = "none"\n')
    text = dump_toml(cfg)
    assert 'kind = "none"' in text and parse_config(text) == cfg


def test_dump_changes_are_detected():
    # A round trip that silently dropped a key would still be "equal" if nothing were compared: check inequality.
    a = parse_config(D + "[train]\nepochs = 3\n")
    b = parse_config(dump_toml(a).replace("epochs = 3", "epochs = 4"))
    assert a != b


def test_copy_config_verbatim_keeps_comments_and_line_endings(tmp_path):
    src = tmp_path / "lora.toml"
    raw = ('# my experiment\r\n[dataset]\r\npath = "/data/train"  # 413 images\r\n\r\n[train]\r\n'
           'epochs = 3 # short\r\n').encode()
    src.write_bytes(raw)
    cfg = load_config(src)
    dest = copy_config_verbatim(cfg, tmp_path / "out" / "run" / "anima.toml")
    assert dest.read_bytes() == raw
    assert [p.name for p in dest.parent.iterdir()] == ["anima.toml"]  # no temp file left behind
    src.write_text("changed after load")  # the copy is of what was loaded, not of the file now
    assert copy_config_verbatim(cfg, tmp_path / "again.toml").read_bytes() == raw


def test_copy_config_verbatim_from_text_and_from_code(tmp_path):
    text = D + "# comment kept\n[train]\nepochs = 2\n"
    assert copy_config_verbatim(parse_config(text), tmp_path / "a.toml").read_text() == text
    cfg = Config()
    cfg.dataset.path = "/d"
    out = copy_config_verbatim(cfg, tmp_path / "b.toml")
    assert load_config(out) == cfg


def test_copy_config_verbatim_leaves_its_own_source_as_it_is(tmp_path):
    """A run started from its own config copy (`train out/r/r.toml`, resuming) writes nothing over it."""
    src = tmp_path / "c.toml"
    src.write_text(D + "# mine\n")
    before = src.stat().st_mtime_ns
    assert copy_config_verbatim(load_config(src), src) == src
    assert src.read_text() == D + "# mine\n" and src.stat().st_mtime_ns == before


def test_source_fields_do_not_affect_equality(tmp_path):
    src = tmp_path / "c.toml"
    src.write_text(D)
    a, b = load_config(src), parse_config(D + "# different text\n")
    assert a == b and a.source_text != b.source_text and a.source_path != b.source_path


# --------------------------------------------------------------------------------------------- run names


@pytest.mark.parametrize("name, want", [
    ("my run 2", "my-run-2"), ("a/b\\c", "a-b-c"), ("run:1?", "run-1"), (".hidden", "hidden"),
    ("sesión-1", "sesión-1"), ("  padded  ", "padded"), ("CON", "CON-run"), ("lpt3", "lpt3-run"),
    ("nul.v2", "nul-run.v2"), ("COM10", "COM10"), ("", "anima"), ("///", "anima"), ("-.-", "anima"),
    ("a__b..c", "a__b..c"), ("日本語 ラン", "日本語-ラン"), ("x\ty\nz", "x-y-z"),
])
def test_sanitize_run_name(name, want):
    assert sanitize_run_name(name) == want


def test_sanitize_fallback_and_run_stem():
    assert sanitize_run_name("???", fallback="run") == "run"
    assert parse_config(D + '[train]\nrun_name = "my run 2"\n').run_stem == "my-run-2"


def test_component_learning_rates():
    cfg = parse_config(D + '[component_lr]\nmlp = 2e-5\nadaln = 1e-6\n[adapter]\ncomponents = ["mlp", "adaln", '
                          '"self_attn"]\n')
    assert cfg.component_learning_rates() == {"mlp": 2e-5, "adaln": 1e-6, "self_attn": 1e-5}
    full = parse_config(D + '[adapter]\nkind = "none"\n')
    assert full.component_learning_rates() == {"self_attn": 1e-5, "cross_attn": 1e-5, "mlp": 1e-5, "adaln": 0.0,
                                               "base": 0.0, "llm_adapter": 0.0}


def test_import_is_light():
    # config must not pull in torch (CLI --help, ComfyUI start-up).
    import subprocess
    import sys
    code = "import sys, anima_train.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1], env={**os.environ, "PYTHONPATH": "."})
    assert out.stdout.strip() == "False"


def test_config_tables_are_all_registered():
    nested = {f.name for f in dataclasses.fields(Config) if "table" in f.metadata or "array" in f.metadata}
    assert nested <= set(C.TABLES)


# ------------------------------------------------------------------------------------------- the one gate


def test_a_table_built_in_code_is_checked_like_a_file():
    # the same message as the file's, the key named as code names it; one problem, one line
    with pytest.raises(ConfigError) as exc:
        C.ScheduleConfig(d=1.0)
    assert str(exc.value) == "schedule.d = 1.0: must be < 1.0 (d = 1 makes REX 0/0)"
    assert _errors(D + "[schedule]\nd = 1.0\n") == ("<config text>: [schedule] d = 1.0: must be < 1.0 "
                                                    "(d = 1 makes REX 0/0)")
    with pytest.raises(ConfigError, match=r'schedule.kind = "rexx": unknown value "rexx"; did you mean "rex"\?'):
        C.ScheduleConfig(kind="rexx")
    with pytest.raises(ConfigError, match=r'train.epochs = "3": expected an integer \(e.g. epochs = 1\), got a string'):
        C.TrainConfig(epochs="3")
    # an unknown keyword: the key meant, also for sd-scripts' names and for a key of another table
    with pytest.raises(ConfigError, match=r"optimizer: unknown key 'learning_rate' \(did you mean 'lr'\?\)"):
        C.OptimizerConfig(learning_rate=1e-4)
    with pytest.raises(ConfigError, match=r"train: unknown key 'warmup_steps' \('warmup_steps' belongs in schedule\)"):
        C.TrainConfig(warmup_steps=10)
    with pytest.raises(ConfigError, match=r"dataset.subsets is missing the required key 'path' \(source directory\)"):
        C.SubsetConfig()
    # the rules across keys: of one table when it is built, across tables when the Config is
    with pytest.raises(ConfigError, match=r'\[optimizer\] betas = \[0.9, 0.95\]: kind = "came" needs 3 betas'):
        C.OptimizerConfig(kind="came")
    with pytest.raises(ConfigError, match=r"\[flow\] shift and flux_shift = true are both set"):
        C.FlowConfig(shift=3.0, flux_shift=True)
    with pytest.raises(ConfigError, match=r'\[quant\] mode = "frozen" quantizes a base'):
        Config(adapter=C.AdapterConfig(kind="none"), quant=C.QuantConfig(mode="frozen"))
    # every problem at once, one line each
    with pytest.raises(ConfigError) as exc:
        C.TrainConfig(epochs=0, dtype="fp8", batch_size=0)
    assert exc.value.errors == [
        "train.epochs = 0: must be >= 1",
        'train.dtype = "fp8": unknown value "fp8"; choose from "bfloat16", "float16", "float32"',
        "[train] batch_size = 0: must be >= 1"]
    assert str(exc.value).startswith("3 problems in the config:\n  - train.epochs = 0")
    # dataclasses.replace builds a new table (checked); assigning a key checks that key
    with pytest.raises(ConfigError, match=r"schedule.min_lr_ratio = 1.5: must be < 1.0"):
        dataclasses.replace(C.ScheduleConfig(), min_lr_ratio=1.5)
    cfg = Config()
    with pytest.raises(ConfigError, match=r"^train.epochs = 0: must be >= 1$"):
        cfg.train.epochs = 0
    assert cfg.train.epochs == 1
    # good values pass and are converted as from a file; a Config in code may leave its dataset for later
    assert C.OptimizerConfig(lr=1, betas=(0.9, 0.99)).lr == 1.0
    assert C.OptimizerConfig(betas=(0.9, 0.99)).betas == [0.9, 0.99]
    assert C.DatasetConfig(resolutions=[1024, 768]).tiers == [768, 1024]
    assert Config().dataset.path is None
    # a constructor without arguments trusts the declared defaults: they pass the full check
    C.validate(Config())
    for name, cls in C.TABLES.items():
        if name != "dataset.subsets":  # its path is required
            C.validate(cls())


def test_the_config_modules_import_without_a_cycle():
    # the package's modules form a chain, none imports back (also not inside a function), and each imports alone
    import ast
    import subprocess
    import sys
    package = Path(importlib.util.find_spec("anima_train.config").origin).parent
    assert package.name == "config" and (package / "__init__.py").is_file()
    graph = {}
    for path in sorted(package.glob("*.py")):
        if path.name == "__init__.py":
            continue
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "anima_train.config":
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("anima_train.config."):
                deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[2] for a in node.names if a.name.startswith("anima_train.config."))
        graph[path.stem] = deps
    assert {"schema", "rules", "validate", "load", "aliases", "reference"} <= set(graph)
    done: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join(path + (name,))}"
        for dep in sorted(graph[name]):
            visit(dep, path + (name,))
        if name not in done:
            done.append(name)

    for name in graph:
        visit(name, ())
    for name in graph:
        out = subprocess.run([sys.executable, "-c", f"import anima_train.config.{name}"], capture_output=True,
                             text=True, cwd=package.parents[1], env={**os.environ, "PYTHONPATH": "."})
        assert out.returncode == 0, (name, out.stderr)


def test_validation_is_off_by_default_and_a_relative_folder_is_read_from_the_config_folder(tmp_path):
    assert not parse_config(D).validation.enabled
    (tmp_path / "held_out").mkdir()
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(D + '[validation]\nfolder = "held_out"\nevery_n_steps = 10\n', encoding="utf-8")
    v = load_config(cfg_path).validation
    assert v.enabled and Path(v.folder) == tmp_path / "held_out" and v.every_n_steps == 10
