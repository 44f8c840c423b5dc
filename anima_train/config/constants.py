"""Names and limits the config's keys are checked against, shared by the tables (schema.py), the rules (rules.py) and
the modules that act on a key's value. No imports: every other config module may import this one."""

DEFAULT_MODEL_PATH = "../anima-diffusers"
MODEL_PATH_ENV = "ANIMA_MODEL"

DIT_COMPONENTS = ("self_attn", "cross_attn", "mlp", "adaln", "base")
COMPONENT_LR_KEYS = DIT_COMPONENTS + ("llm_adapter", "text_encoder")
DTYPE_NAMES = ("bfloat16", "float16", "float32")  # [train] dtype; models.DTYPES maps them to torch dtypes
LORA_FORMATS = ("peft", "kohya")  # LoRA file layouts (adapters/lora/model.py state_dict's fmt)
SDNQ_OPTIMIZERS = ("adamw8bit", "adafactor", "came", "lion", "muon")
CAME_BETAS = [0.9, 0.999, 0.9999]
ROPE_SIDE_LIMIT = 2048  # RoPE table: 128 patch units x 16 px; 2112 crashes (docs/training.md#rope-side-limits)
ROPE_SIDE_DECLARED = 1920  # declared spatial range (120 units x 16 px); beyond it RoPE extrapolates
TIER_COLLAPSE_MODES = ("dedup", "repeat")  # buckets.plan_tiers
CAPTION_MODES = ("tags", "nl", "tags_nl", "nl_tags", "mixed")  # [dataset.caption] caption_mode (data/captions.py)
CAPTION_VARIANTS = ("tags", "nl", "tags_nl", "nl_tags")  # the mixed_weights keys, in draw order
MAX_RANK = 4096  # above every layer width of Anima and Qwen3: a larger rank adds nothing (and 10**20 crashes torch)
# What every value can reach, checked for every key by its type (config/keys.py): an integer goes to torch and numpy
# (seeds, step counters) as a signed 64-bit one, a number into float32 tensors (the optimizer's step, the loss).
INT_LIMIT = 2**63 - 1
FLOAT_LIMIT = 3.4028234663852886e38  # the largest float32
# A learning rate (or a multiplier of one) above this cannot train: Adam's first steps move each weight by ~lr / (1 -
# beta1), so 1e38 overflows float32 there (an internal error, not a divergence); up to 1e6 (times a multiplier of
# 1e6, over 1 - beta1 = 1e-4) it stays far inside float32 and a run that blows up is the divergence check's (exit 5).
MAX_LEARNING_RATE = 1e6
MAX_REPEATS = 10_000  # per subset/folder; an epoch holds every repeat, so 10**20 would never end (or overflow)
SAMPLE_SHIFT = 3.0  # ComfyUI's Anima model_sampling (supported_models.Anima: shift 3.0, multiplier 1.0)
