"""Tiny random-weight Anima models, tokenizers and a synthetic captioned dataset, for tests and the demo.

    build_tiny_anima(out_dir, seed=0, size="tiny")   -> TinyAnima  (diffusers repo + native single files)
    build_tiny_anima(out_dir, blocks=40)              -> the same with 40 DiT blocks (Anima-2.9B's count)
    write_model_configs(out_dir, size="full")         -> a repo of config.json files only (what `plan` reads)
    make_synthetic_dataset(out_dir, n=16, seed=0)    -> [image paths]  (captions in <stem>.txt)

Nothing here downloads anything: the models use the real diffusers/transformers classes with small configs
(docs/model.md#tiny-models), the tokenizers are built from a fixed tag corpus (docs/model.md#tokenizers), and
everything is deterministic for a given seed (same bytes for the weight, tokenizer and image files).

Sizes
- "tiny": the configs of docs/model.md#tiny-models; the whole repo is ~4 MB and builds in well under a second
  (after imports).
- "comfy": the smallest Anima that ComfyUI's model detection builds correctly (docs/comfyui.md#model-detection), so
  the native files can be loaded by UNETLoader / VAELoader in integration tests:
  * DiT width 256: ComfyUI reads the width from `x_embedder.proj.1.weight` but hard-codes 16 heads and 10 blocks
    for any width other than 2048/5120, so the file must have exactly 10 blocks and 16 heads; head_dim = 256/16 = 16
    is even and >= 12 as the RoPE t/h/w split needs (8 or 10 divide by zero). 256 is the smallest width verified
    in ComfyUI (tested). Cross-attention input 1024 and AdaLN-LoRA rank 256 are ComfyUI constants.
  * llm_adapter at full size (the real CONDITIONER config): ComfyUI builds it with fixed dims, so it cannot shrink;
    it is ~135 M of the ~158 M parameters (~315 MB in bf16).
  * VAE: Wan2.1 layout with dim 16 but num_res_blocks=2 (ComfyUI hard-codes 2 and reads dim from
    `decoder.head.0.gamma`); same 194 tensor names as the real VAE.
  * Qwen3: hidden 1024 because the adapter's source_dim is 1024; otherwise tiny (2 layers, vocab 300).
    ComfyUI hard-codes the full Qwen3-0.6B config (28 layers, vocab 151936), so it DETECTS this file as
    Qwen3-0.6B but cannot load it (size mismatch); ComfyUI tests inject CONDITIONING instead
    (docs/comfyui.md#conditioning).
"""

from __future__ import annotations

import errno
import json
import math
import os
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from safetensors.torch import save_file

from anima_train.model import keymaps
from anima_train.files import atomic_path, publish_dir, temp_dir, write_text

# ----------------------------------------------------------------------------------------------------------
# Configurations (docs/model.md#configurations real, #tiny-models tiny)

TRANSFORMER_FULL = dict(in_channels=16, out_channels=16, num_attention_heads=16, attention_head_dim=128,
                        num_layers=28, mlp_ratio=4.0, text_embed_dim=1024, adaln_lora_dim=256,
                        max_size=(128, 240, 240), patch_size=(1, 2, 2), rope_scale=(1.0, 4.0, 4.0),
                        concat_padding_mask=True, extra_pos_embed_type=None)
CONDITIONER_FULL = dict(source_dim=1024, target_dim=1024, model_dim=1024, num_layers=6, num_attention_heads=16,
                        mlp_ratio=4.0, target_vocab_size=32128, use_self_attention=True, use_layer_norm=False,
                        min_sequence_length=512)
QWEN3_FULL = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False, tie_word_embeddings=False)
VAE_FULL = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True], dropout=0.0)

CONFIGS = {
    "full": dict(transformer=TRANSFORMER_FULL, text_conditioner=CONDITIONER_FULL, text_encoder=QWEN3_FULL,
                 vae=VAE_FULL),
    "tiny": dict(
        transformer=dict(TRANSFORMER_FULL, num_attention_heads=2, attention_head_dim=32, num_layers=2,
                         text_embed_dim=32, adaln_lora_dim=16),
        text_conditioner=dict(CONDITIONER_FULL, source_dim=32, target_dim=32, model_dim=32, num_layers=2,
                              num_attention_heads=4, target_vocab_size=110, min_sequence_length=64),
        text_encoder=dict(QWEN3_FULL, vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096),
        vae=dict(VAE_FULL, base_dim=8, num_res_blocks=1),
    ),
    "comfy": dict(  # why each number: see the module docstring
        transformer=dict(TRANSFORMER_FULL, num_attention_heads=16, attention_head_dim=16, num_layers=10),
        text_conditioner=dict(CONDITIONER_FULL),
        text_encoder=dict(QWEN3_FULL, vocab_size=300, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
        vae=dict(VAE_FULL, base_dim=16),
    ),
}
DEFAULT_DTYPE = {"tiny": torch.float32, "comfy": torch.bfloat16}

# ----------------------------------------------------------------------------------------------------------
# Synthetic content: the captions fully determine the picture (colour + shape + background), so a model that
# reads its text conditioning can beat one that ignores it.

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (240, 210, 40),
           "purple": (140, 50, 180), "orange": (245, 140, 20)}
SHAPES = ("circle", "square", "triangle")
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15), "gray": (128, 128, 128)}
OTHER_TAGS = ("1girl, solo, long hair, short hair, blue eyes, red eyes, smile, looking at viewer, "
              "masterpiece, best quality, simple background, outdoors, sky, cat, dog, 2girls, from above")


def caption_for(colour: str, shape: str, background: str) -> str:
    return f"{colour} {shape}, {background} background"


def tokenizer_corpus() -> list[str]:
    lines = [caption_for(c, s, b) for c in COLOURS for s in SHAPES for b in BACKGROUNDS]
    return lines + [OTHER_TAGS, OTHER_TAGS.replace(", ", " ")]


# ----------------------------------------------------------------------------------------------------------
# Tokenizers (docs/model.md#tokenizers). Both are deterministic: BPE training in `tokenizers` is (checked), the Unigram
# trainer is not (its scores vary run to run), so the T5-like vocabulary is built directly from word counts.

def build_qwen_tokenizer(vocab_size: int = 300):
    """Qwen-like byte-level BPE -> transformers.Qwen2Tokenizer; `<|endoftext|>` is the last id, as in Qwen."""
    # lazy: tokenizers + transformers (4.7 s measured on top of torch): only the tiny-model builders need them
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()  # same pipeline Qwen2Tokenizer rebuilds around the vocab
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(tokenizer_corpus(), trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Qwen2Tokenizer(vocab=model["vocab"], merges=merges)
    assert len(tok) <= vocab_size and tok.convert_tokens_to_ids("<|endoftext|>") == len(tok) - 1
    return tok


def build_t5_tokenizer(max_len: int = 110, extra_ids: int = 8):
    """T5-like Unigram (pad 0, </s> 1, <unk> 2, Metaspace) -> transformers.T5Tokenizer of len <= max_len."""
    # lazy: see build_qwen_tokenizer
    from transformers import T5Tokenizer

    text = " ".join(tokenizer_corpus()).replace(",", " ")
    counts = Counter(text.split())
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789,.:;!?'\"()-_") | set("".join(counts)))
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)] + [(c, -12.0) for c in chars]
    room = max_len - extra_ids - len(pieces)
    words = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:room]  # deterministic tie-break
    total = sum(counts.values())
    pieces += [("▁" + w, round(math.log(n / total), 4)) for w, n in words]
    tok = T5Tokenizer(vocab=pieces, extra_ids=extra_ids)
    assert len(tok) <= max_len
    return tok


# ----------------------------------------------------------------------------------------------------------
# Models and files

@dataclass(frozen=True)
class TinyAnima:
    root: Path
    size: str
    seed: int
    dtype: str
    diffusers_dir: Path  # AnimaModularPipeline layout: transformer/ text_conditioner/ text_encoder/ tokenizer/ ...
    native_dir: Path
    anima_file: Path  # net.* DiT + net.llm_adapter.*   (ComfyUI models/diffusion_models)
    qwen3_file: Path  # model.* Qwen3                   (ComfyUI models/text_encoders)
    vae_file: Path  # ComfyUI WanVAE names            (ComfyUI models/vae)
    configs: dict = field(default_factory=dict)


def configs_for(size: str, blocks: int | None = None) -> dict:
    """The four configs of one size; `blocks` sets the DiT's block count (Anima-2.9B: the 2B's blocks deepened from
    28 to 40, same widths), else the size's own."""
    if size not in CONFIGS:
        raise ValueError(f"size must be one of {', '.join(CONFIGS)}, got {size!r}")
    cfg = dict(CONFIGS[size])
    if blocks is not None:
        cfg["transformer"] = dict(cfg["transformer"], num_layers=blocks)
    return cfg


def build_models(size: str = "tiny", seed: int = 0, dtype: torch.dtype | None = None,
                 blocks: int | None = None) -> dict:
    """The four random-weight models of one size; each gets its own seed offset so they do not depend on
    each other (and the caller's global RNG state is left untouched)."""
    # lazy: diffusers + transformers model classes (1.9 s + 4.7 s measured on top of torch): see build_qwen_tokenizer
    from diffusers import AutoencoderKLQwenImage, CosmosTransformer3DModel
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    from diffusers.utils import logging as diffusers_logging
    from transformers import Qwen3Config, Qwen3Model

    if size not in ("tiny", "comfy"):
        raise ValueError(f"size must be 'tiny' or 'comfy', got {size!r}")
    cfg = configs_for(size, blocks)
    dtype = dtype or DEFAULT_DTYPE[size]
    makers = {
        "transformer": lambda: CosmosTransformer3DModel(**cfg["transformer"]),
        "text_conditioner": lambda: AnimaTextConditioner(**cfg["text_conditioner"]),
        "text_encoder": lambda: Qwen3Model(Qwen3Config(**cfg["text_encoder"])),
        "vae": lambda: AutoencoderKLQwenImage(**cfg["vae"]),
    }
    models = {}
    for offset, (name, make) in enumerate(makers.items()):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1000 + offset)
            model = make().eval()
        if dtype != torch.float32:
            # diffusers warns that `learnable_pos_embed` should stay fp32; Anima does not have that module
            # (extra_pos_embed_type=None), so the warning is noise here
            level = diffusers_logging.get_verbosity()
            diffusers_logging.set_verbosity_error()
            try:
                model = model.to(dtype)
            finally:
                diffusers_logging.set_verbosity(level)
        models[name] = model
    return models


def _save_safetensors(sd: dict, path: Path) -> None:
    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(tmp), metadata={"format": "pt"})


def _claim(final: Path, overwrite: bool) -> None:
    if final.exists():
        if not overwrite:
            # with its errno: the CLI says a file in the way as the machine's error it is (errors.user_message);
            # two tiny-models into one folder meet here
            raise FileExistsError(errno.EEXIST, f"{os.strerror(errno.EEXIST)} (in code: overwrite=True)", str(final))
        shutil.rmtree(final) if final.is_dir() else final.unlink()


def build_tiny_anima(out_dir, seed: int = 0, size: str = "tiny", dtype: torch.dtype | None = None,
                     overwrite: bool = False, blocks: int | None = None) -> TinyAnima:
    """Write `out_dir/diffusers/` (a diffusers Anima modular-pipeline repo) and `out_dir/native/`
    (`anima.safetensors`, `qwen3.safetensors`, `vae.safetensors`) with the same random weights. `blocks`: the DiT's
    block count (default: the size's)."""
    # lazy: see build_models
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.modular_pipelines import AnimaAutoBlocks

    if size not in DEFAULT_DTYPE:
        raise ValueError(f"size must be 'tiny' or 'comfy', got {size!r}")
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    final_repo, final_native = out_dir / "diffusers", out_dir / "native"
    for final in (final_repo, final_native):
        _claim(final, overwrite)
    models = build_models(size, seed, dtype, blocks)
    tokenizer = build_qwen_tokenizer(CONFIGS[size]["text_encoder"]["vocab_size"])
    t5_tokenizer = build_t5_tokenizer(min(110, CONFIGS[size]["text_conditioner"]["target_vocab_size"]))

    # diffusers repo: written by the real pipeline's save_pretrained into a temp folder, then renamed into place
    # (temp_dir: a failure, a full disk or Ctrl-C, leaves no temp folder behind)
    with temp_dir(final_repo) as tmp_repo:
        pipe = AnimaAutoBlocks().init_pipeline()
        pipe.update_components(tokenizer=tokenizer, t5_tokenizer=t5_tokenizer,
                               scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), **models)
        pipe.save_pretrained(str(tmp_repo), overwrite_modular_index=True)
        # the index records the save folder; point it at the final one (diffusers loads local folders from the
        # folder it is given anyway, so this only keeps the file truthful)
        index = tmp_repo / "modular_model_index.json"
        text = index.read_text().replace(json.dumps(str(tmp_repo))[1:-1], json.dumps(str(final_repo))[1:-1])
        index.write_text(text)
        publish_dir(tmp_repo, final_repo)  # the umask's modes, whatever save_pretrained gave

    # native single files, ComfyUI names
    try:
        with temp_dir(final_native) as tmp_native:
            _save_safetensors(keymaps.join_anima_native(models["transformer"].state_dict(),
                                                        models["text_conditioner"].state_dict()),
                              tmp_native / "anima.safetensors")
            _save_safetensors(keymaps.qwen3_diffusers_to_native(models["text_encoder"].state_dict()),
                              tmp_native / "qwen3.safetensors")
            _save_safetensors(keymaps.vae_diffusers_to_native(models["vae"].state_dict()),
                              tmp_native / "vae.safetensors")
            publish_dir(tmp_native, final_native)
    except BaseException:
        shutil.rmtree(final_repo, ignore_errors=True)  # published by this call a moment ago: both parts or neither
        raise

    return TinyAnima(root=out_dir, size=size, seed=seed, dtype=str(next(models["transformer"].parameters()).dtype),
                     diffusers_dir=final_repo, native_dir=final_native,
                     anima_file=final_native / "anima.safetensors", qwen3_file=final_native / "qwen3.safetensors",
                     vae_file=final_native / "vae.safetensors", configs=configs_for(size, blocks))


def write_model_configs(out_dir, size: str = "full", blocks: int | None = None) -> Path:
    """A repo of the four components' config.json files and no weights (`out_dir` itself): what `anima-train plan`
    reads, so a full-size Anima can be planned where its 4 GB of weights are not."""
    # lazy: see build_models
    from diffusers import AutoencoderKLQwenImage, CosmosTransformer3DModel
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    from transformers import Qwen3Config

    cfg = configs_for(size, blocks)
    out_dir = Path(out_dir)
    for name, cls in (("transformer", CosmosTransformer3DModel), ("text_conditioner", AnimaTextConditioner),
                      ("vae", AutoencoderKLQwenImage)):
        with torch.device("meta"):
            cls(**cfg[name]).save_config(out_dir / name)
    Qwen3Config(**cfg["text_encoder"]).save_pretrained(out_dir / "text_encoder")
    return out_dir


# ----------------------------------------------------------------------------------------------------------
# Synthetic dataset

def _draw(size: tuple[int, int], colour: str, shape: str, background: str, rng: random.Random):
    w, h = size
    img = Image.new("RGB", (w, h), BACKGROUNDS[background])
    side = max(4, int(min(w, h) * rng.uniform(0.6, 0.9)))
    x0, y0 = rng.randint(0, w - side), rng.randint(0, h - side)
    box = (x0, y0, x0 + side - 1, y0 + side - 1)
    draw = ImageDraw.Draw(img)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(x0 + side / 2, y0), (x0, y0 + side - 1), (x0 + side - 1, y0 + side - 1)], fill=fill)
    return img


def make_synthetic_dataset(out_dir, n: int = 16, seed: int = 0, sizes=None, min_side: int = 64,
                           max_side: int = 256, aspect_range=(0.3, 3.2), jpeg_every: int = 3,
                           overwrite: bool = False) -> list[Path]:
    """Write `n` images (`img_0000.png` / every `jpeg_every`-th one as `.jpg`) with tag captions `<stem>.txt`.

    Sizes: explicit `sizes=[(w, h), ...]` (cycled), else the long side is drawn from [min_side, max_side] and
    the aspect ratio w/h log-uniformly from `aspect_range`; the first two images sit at the two extremes so every
    dataset covers the whole range. Each caption ("red circle, white background") fully determines the content.
    Returns the image paths in order.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lo, hi = aspect_range
    plan = []
    for i in range(n):
        if sizes:
            w, h = sizes[i % len(sizes)]
        else:
            aspect = lo if i == 0 else hi if i == 1 else math.exp(rng.uniform(math.log(lo), math.log(hi)))
            long_side = rng.randint(min_side, max_side)
            w, h = (long_side, round(long_side / aspect)) if aspect >= 1 else (round(long_side * aspect), long_side)
            w, h = max(w, 16), max(h, 16)
        ext = ".jpg" if jpeg_every and i % jpeg_every == jpeg_every - 1 else ".png"
        colour, shape, background = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(list(BACKGROUNDS))
        while BACKGROUNDS[background] == COLOURS[colour]:  # never invisible (cannot happen with these palettes)
            background = rng.choice(list(BACKGROUNDS))
        plan.append((out_dir / f"img_{i:04d}{ext}", (w, h), colour, shape, background, rng.random()))
    if not overwrite:
        for path, *_ in plan:
            for p in (path, path.with_suffix(".txt")):
                if p.exists():
                    raise FileExistsError(f"{p} already exists; pass overwrite=True or choose an empty folder")
    paths = []
    for path, size, colour, shape, background, draw_seed in plan:
        img = _draw(size, colour, shape, background, random.Random(draw_seed))
        with atomic_path(path) as tmp:
            img.save(tmp, format="JPEG" if path.suffix == ".jpg" else "PNG",
                     **({"quality": 95} if path.suffix == ".jpg" else {}))
        write_text(path.with_suffix(".txt"), caption_for(colour, shape, background) + "\n")
        paths.append(path)
    return paths


if __name__ == "__main__":  # python -m anima_train.model.tiny OUT_DIR [tiny|comfy]: build and print timings/sizes
    import sys

    target = Path(sys.argv[1])
    which = sys.argv[2] if len(sys.argv) > 2 else "tiny"
    t0 = time.perf_counter()
    built = build_tiny_anima(target / which, size=which, overwrite=True)
    print(f"{which}: built in {time.perf_counter() - t0:.2f} s")
    for f in sorted(p for p in built.root.rglob("*") if p.is_file()):
        print(f"{f.stat().st_size:>12,d}  {f.relative_to(built.root)}")
