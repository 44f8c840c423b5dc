"""The trainer's configuration: one TOML file, typed dataclasses, every value checked when a config is built.

    cfg = load_config("configs/lora.toml")      # a file; parse_config(toml_text) for text
    cfg.train.epochs, cfg.dataset.tiers, cfg.component_learning_rates()
    ScheduleConfig(kind="rex", d=0.5)           # built in code: checked by the same gate
    dump_toml(cfg)                              # only non-default values (+ adapter.kind)
    copy_config_verbatim(cfg, run_dir / f"{cfg.run_stem}.toml")   # comments kept

The modules, each importing only those listed above it (no import cycle; tests/test_config.py checks it):

    constants.py  names and limits the keys are checked against (dtype names, RoPE limits, ...)
    keys.py       what a key is (field metadata) and how one value is checked: type, choices, bounds; ConfigError
    aliases.py    other trainers' names (sd-scripts) for the did-you-mean of an unknown key
    rules.py      the rules across keys, each with the table it reads
    validate.py   the one gate: validate(table or Config) checks every key and then the rules of that scope;
                  @section / @root make every table's constructor call it
    schema.py     the tables: one dataclass per TOML table, one field per key (help, choices, bounds)
    load.py       TOML in and out: load_config (the file's structure, then validate), dump_toml, copy_config_verbatim
    reference.py  docs/config.md, generated from the tables (`anima-train config --reference`: training/config_check.py)

One gate. load_config and a constructor called in code go through the same `validate`: a bad value gets the same
message (the key, the fix, did-you-mean, sd-scripts' names), with the key named as a file names it ("[schedule] d")
or as code does ("schedule.d"); every problem at once, one line each. So the modules that use a config do not check
its values again. On purpose, a file must name its training data while `Config()` in code may leave it for later,
and the files that keys name (protected_tags_file, prompts_file) are read by load_config, relative to the config's
folder. Assigning a key of a built table checks that key; the rules across keys run when a table is built
(`dataclasses.replace` builds a new one).

Why not pydantic (a ComfyUI dependency) or another schema library. Measured with pydantic 2.14 on a model of 7 of
these tables (extra="forbid", strict, validate_assignment): importing pydantic takes ~130-180 ms of CPU and building
the 7 models ~50-70 ms, against ~75 ms for this whole package (ComfyUI imports it at start-up). Its errors are not
ours: an unknown value gives "Input should be 'constant', 'linear', ... [type=literal_error, input_value='rexx',
input_type=str]" and a link, no did-you-mean; sd-scripts' `learning_rate` gives "Extra inputs are not permitted"; a
wrong table key gives two lines of union branches; and a rule across tables (a model_validator) does not run once a
field failed, so a config with a bad value and a broken rule shows one problem, not both. Lax mode takes the string
"3" as an integer; strict mode refuses the TOML table { 768 = 16 } (its keys are strings). Keeping our messages would
mean rewriting every error pydantic produces and keeping aliases.py, rules.py and the collector anyway: the library
would add ~200 ms of start-up and a translation layer, and remove little.
"""

from anima_train.config.constants import (CAME_BETAS, COMPONENT_LR_KEYS, DEFAULT_MODEL_PATH, DIT_COMPONENTS,
                                          DTYPE_NAMES, LORA_FORMATS, MAX_RANK, MAX_REPEATS, MODEL_PATH_ENV,
                                          ROPE_SIDE_DECLARED, ROPE_SIDE_LIMIT, SAMPLE_SHIFT, SDNQ_OPTIMIZERS,
                                          TIER_COLLAPSE_MODES)
from anima_train.config.keys import REQUIRED, ConfigError, ConfigWarning, as_toml
from anima_train.config.load import TEXT_SOURCE, copy_config_verbatim, dump_toml, load_config, parse_config
from anima_train.config.schema import (ARRAY_TABLES, TABLES, AdapterConfig, CaptionConfig,
                                       ComponentLRConfig, Config, CurriculumPhase, DatasetConfig, FieldInfo,
                                       FlowConfig, LoggingConfig, OptimizerConfig, QuantConfig, SampleConfig,
                                       ScheduleConfig, SubsetConfig, TextureConfig, TrainConfig, iter_fields,
                                       sanitize_run_name)
from anima_train.config.validate import validate

__all__ = [
    "ARRAY_TABLES", "CAME_BETAS", "COMPONENT_LR_KEYS", "DEFAULT_MODEL_PATH", "DIT_COMPONENTS", "DTYPE_NAMES",
    "LORA_FORMATS", "MAX_RANK", "MAX_REPEATS", "MODEL_PATH_ENV", "REQUIRED", "ROPE_SIDE_DECLARED",
    "ROPE_SIDE_LIMIT", "SAMPLE_SHIFT", "SDNQ_OPTIMIZERS", "TABLES", "TEXT_SOURCE", "TIER_COLLAPSE_MODES",
    "AdapterConfig", "CaptionConfig", "ComponentLRConfig", "Config", "ConfigError", "ConfigWarning",
    "CurriculumPhase", "DatasetConfig", "FieldInfo", "FlowConfig", "LoggingConfig", "OptimizerConfig", "QuantConfig",
    "SampleConfig", "ScheduleConfig", "SubsetConfig", "TextureConfig", "TrainConfig", "as_toml",
    "copy_config_verbatim", "dump_toml", "iter_fields", "load_config", "parse_config", "sanitize_run_name",
    "validate",
]
