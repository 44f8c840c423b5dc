"""`anima-train convert`: ComfyUI single files (DiT + adapter, Qwen3, VAE) -> a diffusers Anima repo.

    anima-train convert --anima anima-base-v1.0.safetensors --qwen qwen_3_06b_base.safetensors \\
                        --vae qwen_image_vae.safetensors --out ../anima-diffusers

Writes transformer/, text_conditioner/, text_encoder/, vae/, scheduler/, tokenizer/, t5_tokenizer/ and
modular_model_index.json (skip with --no-modular-index). Rules:
- The inputs are only read. Each is checked before conversion: unreadable/truncated files and a file passed in the
  wrong slot ("--vae got a Qwen3 text encoder") are refused with the file named.
- --out must be absent or empty: merging into an existing repo would let a stale file survive a re-convert. One
  exception: a repo this command wrote from the same three files (its convert record names their sizes and times,
  and every weight file is as written) is completed, not refused: the tokenizers it lacks are added, and a
  complete one is left as it is ("up to date").
- Everything is written into a temp folder beside --out and renamed at the end, so a failed run leaves no half repo.
- Tokenizers cannot be derived from weights. --tokenizers takes a local folder (always wins; it must hold
  tokenizer/ and t5_tokenizer/), a Hugging Face repo id (only those two folders are downloaded, via allow_patterns,
  into the normal HF cache) or `none`. They are fetched before any weight is read: an unreachable repo refuses the
  conversion with nothing written (a repo without tokenizers cannot train), unless `none` asks for exactly that.

Default tokenizer repo: circlestone-labs/Anima-Base-v1.0-Diffusers, the diffusers repo published by Anima's authors
(the original trainer README used a community mirror, Bluvoll/Anima-v1.0-Base-Diffusers, and notes both give
identical ids; we prefer the first-party source).

Model configs are inferred from tensor shapes (the released files give exactly the configs of
docs/model.md#configurations); values a checkpoint cannot carry (RoPE constants, the adapter's 512-token padding,
Qwen3 RoPE theta) are the real ones.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
import warnings
from pathlib import Path

import diffusers
import huggingface_hub
from safetensors import safe_open
from safetensors.torch import load_file

from anima_train.model import keymaps
from anima_train.files import publish_dir
from anima_train.errors import UserError
from anima_train.fixes import ref
from anima_train.model.components import DEFAULT_TOKENIZER_REPO, TOKENIZER_FOLDERS, tokenizer_fix_hint
from anima_train.model.tiny import (  # the real constants (docs/model.md#configurations)
    CONDITIONER_FULL, QWEN3_FULL, TRANSFORMER_FULL, VAE_FULL)

# which state_dict_kind each slot expects, and how to name it in messages
SLOTS = {
    "anima": ("anima_dit", "an Anima DiT single file (net.* with net.llm_adapter.*, e.g. anima-base-v1.0.safetensors)"),
    "qwen": ("qwen3", "a Qwen3-0.6B text encoder (e.g. qwen_3_06b_base.safetensors)"),
    "vae": ("vae", "a Qwen-Image / Wan2.1 VAE (e.g. qwen_image_vae.safetensors)"),
}
KIND_TO_SLOT = {kind: slot for slot, (kind, _) in SLOTS.items()}


class ConvertError(UserError, ValueError):
    """Conversion refused or failed; the message names the file/folder and the fix."""


class TokenizersMissingWarning(UserWarning):
    """The repo was written without tokenizers (--tokenizers none)."""


RECORD_NAME = "anima-convert.json"  # in the repo: the inputs it was converted from and the weight files written


def _flag(name: str, node: str = "") -> str:
    """A flag of this command as a message names it (anima_train/fixes.py): `--name` in a shell."""
    return ref(f"flag convert --{name}", f"--{name}" + (f" ({node}'s `{name}`)" if node else ""))


# ----------------------------------------------------------------------------------------------------------
# Reading and checking the inputs


def read_keys(path: Path, slot: str) -> list[str]:
    if not path.is_file():
        raise ConvertError(f"{_flag(slot)} {path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # SafetensorError, OSError: header unreadable or shorter than it claims
        raise ConvertError(f"{_flag(slot)} {path}: cannot read it as safetensors ({exc}). The file is truncated or "
                           f"corrupt (an interrupted download?); download it again") from exc


def check_slot(path: Path, slot: str, keys: list[str]) -> None:
    expected_kind, what = SLOTS[slot]
    kind = keymaps.state_dict_kind(keys)
    if kind == expected_kind:
        return
    msg = f"{_flag(slot)} {path} {keymaps.describe_state_dict(keys)}, not {what}"
    if kind in KIND_TO_SLOT:
        msg += f"; did you mean {_flag(KIND_TO_SLOT[kind])}?"
    elif kind.startswith("diffusers_"):
        msg += "; it is already in diffusers layout (convert takes the ComfyUI single files)"
    elif kind == "unknown":
        msg += f" (first keys: {', '.join(sorted(keys)[:3])})"
    raise ConvertError(msg)


def rename(fn, sd: dict, slot: str, path: Path, *args):
    """Apply a keymaps conversion; an unknown key becomes a ConvertError naming the file."""
    try:
        return fn(sd, *args)
    except KeyError as exc:
        raise ConvertError(f"{_flag(slot)} {path}: {exc.args[0] if exc.args else exc}; the file holds a tensor "
                           f"this "
                           f"converter has no mapping for (a modified or different model?)") from exc


def load_tensors(path: Path, slot: str) -> dict:
    try:
        return load_file(str(path))
    except Exception as exc:
        raise ConvertError(f"{_flag(slot)} {path}: reading the tensors failed ({exc}); the file is truncated or "
                           f"corrupt, download it again") from exc


def check_blocks(native: dict, path: Path) -> int:
    """The DiT's block count, read from the file's keys (never looked up from the width: Anima-2B and -2.9B share
    width 2048 with 28 and 40 blocks). The config is built from block 0, so every block must be numbered 0..N-1
    and hold block 0's tensors at block 0's shapes; else refused, naming the first block that differs."""
    found: dict[int, dict[str, tuple]] = {}
    for key, tensor in keymaps.strip_native_prefix(native).items():
        if m := re.match(r"^blocks\.(\d+)\.(.+)$", key):
            found.setdefault(int(m.group(1)), {})[m.group(2)] = tuple(tensor.shape)
    if not found:
        raise ConvertError(f"--anima {path}: the file has no DiT blocks (no net.blocks.N.* tensors); it is not an "
                           f"Anima DiT single file")
    n = max(found) + 1
    gaps = [i for i in range(n) if i not in found]
    if gaps:
        raise ConvertError(f"--anima {path}: block {gaps[0]} is missing (the file numbers its blocks up to {n - 1} "
                           f"but has no net.blocks.{gaps[0]}.* tensors); the file is damaged or was merged wrongly, "
                           f"download it again")
    stripped = keymaps.strip_native_prefix({k: None for k in native})
    prefix = next(iter(native))[:-len(next(iter(stripped)))] if stripped and native else ""  # the file's own spelling
    first = found[0]
    for index in range(1, n):
        block = found[index]
        if block == first:
            continue
        lacks = sorted(set(first) - set(block))
        extra = sorted(set(block) - set(first))
        own = f"{prefix}blocks.{index}."  # a tensor named by the file's own key: what the user can look up
        if lacks or extra:
            what = (f"{own}{lacks[0]} is missing (block 0 has it)" if lacks else
                    f"it has {own}{extra[0]}, which block 0 has not")
        else:
            name = next(k for k in sorted(first) if first[k] != block[k])
            what = f"{own}{name} has shape {list(block[name])}, block 0's is {list(first[name])}"
        raise ConvertError(f"--anima {path}: block {index} does not match the model built from the file (block "
                           f"0's shapes, {n} blocks): {what}; the file is damaged or mixes two models, download it "
                           f"again")
    return n


# ----------------------------------------------------------------------------------------------------------
# Configs from shapes (names after conversion to diffusers keys)


def _count(sd: dict, pattern: str) -> int:
    return len({m.group(1) for k in sd if (m := re.match(pattern, k))})


def transformer_config(sd: dict) -> dict:
    hidden, patch_in = sd["patch_embed.proj.weight"].shape
    head_dim = sd["transformer_blocks.0.attn1.norm_q.weight"].shape[0]
    p_t, p_h, p_w = TRANSFORMER_FULL["patch_size"]
    return dict(TRANSFORMER_FULL,
                in_channels=patch_in // (p_t * p_h * p_w) - 1,  # +1: the concatenated padding mask
                out_channels=sd["proj_out.weight"].shape[0] // (p_t * p_h * p_w),
                num_attention_heads=hidden // head_dim, attention_head_dim=head_dim,
                num_layers=_count(sd, r"^transformer_blocks\.(\d+)\."),
                mlp_ratio=sd["transformer_blocks.0.ff.net.0.proj.weight"].shape[0] / hidden,
                text_embed_dim=sd["transformer_blocks.0.attn2.to_k.weight"].shape[1],
                adaln_lora_dim=sd["transformer_blocks.0.norm1.linear_1.weight"].shape[0])


def conditioner_config(sd: dict) -> dict:
    target_dim, model_dim = sd["out_proj.weight"].shape
    head_dim = sd["blocks.0.cross_attn.q_norm.weight"].shape[0]
    return dict(CONDITIONER_FULL,
                source_dim=sd["blocks.0.cross_attn.k_proj.weight"].shape[1], target_dim=target_dim,
                model_dim=model_dim, num_layers=_count(sd, r"^blocks\.(\d+)\."),
                num_attention_heads=model_dim // head_dim,
                mlp_ratio=sd["blocks.0.mlp.0.weight"].shape[0] / model_dim,
                target_vocab_size=sd["embed.weight"].shape[0],
                use_self_attention="blocks.0.self_attn.q_proj.weight" in sd,
                use_layer_norm="blocks.0.norm_cross_attn.bias" in sd)


def qwen3_config(sd: dict) -> dict:
    head_dim = sd["layers.0.self_attn.q_norm.weight"].shape[0]
    vocab, hidden = sd["embed_tokens.weight"].shape
    return dict(QWEN3_FULL, vocab_size=vocab, hidden_size=hidden,
                intermediate_size=sd["layers.0.mlp.gate_proj.weight"].shape[0],
                num_hidden_layers=_count(sd, r"^layers\.(\d+)\."),
                num_attention_heads=sd["layers.0.self_attn.q_proj.weight"].shape[0] // head_dim,
                num_key_value_heads=sd["layers.0.self_attn.k_proj.weight"].shape[0] // head_dim, head_dim=head_dim)


def vae_config(native_sd: dict, path: Path) -> dict:
    base_dim, z_dim = native_sd["encoder.conv1.weight"].shape[0], native_sd["conv2.weight"].shape[0]
    r = keymaps.vae_num_res_blocks(native_sd)
    layout = keymaps.wan_vae_native_layout(base_dim, z_dim, r, VAE_FULL["dim_mult"], VAE_FULL["temperal_downsample"])
    got = {k: tuple(v.shape) for k, v in native_sd.items()}
    if got != layout:
        bad = sorted(set(got) ^ set(layout)) or sorted(k for k in got if got[k] != layout[k])
        raise ConvertError(f"{_flag('vae')} {path}: not the Wan2.1 VAE layout this converter knows (dim_mult "
                           f"{VAE_FULL['dim_mult']}); first difference at {bad[0]!r}")
    return dict(VAE_FULL, base_dim=base_dim, z_dim=z_dim, num_res_blocks=r)


# ----------------------------------------------------------------------------------------------------------
# Building and saving


# A problem found after renaming is said with the file's own key (what a user can look up in the file): each slot's
# way back from a diffusers key to its single file's key.
FILE_KEYS = {
    "transformer": lambda key: next(iter(keymaps.join_anima_native({key: None}, {}))),
    "text_conditioner": lambda key: next(iter(keymaps.join_anima_native({}, {key: None}))),
    "text encoder": lambda key: next(iter(keymaps.qwen3_diffusers_to_native({key: None}))),
    "VAE": keymaps.vae_diffusers_key_to_native,
}
_DOWNLOAD_AGAIN = "the file is damaged or not the released model: download it again"


def file_key(what: str, key: str) -> str:
    try:
        return FILE_KEYS[what](key)
    except Exception:  # noqa: BLE001 (a name the map does not know: the converted name is still a name)
        return key


def inferred_config(config_fn, sd: dict, what: str, slot: str, path: Path) -> dict:
    """The model's config from the shapes of `sd`; a tensor it needs that the file lacks is named as the file names
    it."""
    try:
        return config_fn(sd)
    except KeyError as exc:
        raise ConvertError(f"--{slot} {path}: the tensor {file_key(what, str(exc.args[0]))} is missing; "
                           f"{_DOWNLOAD_AGAIN}") from None


def _materialise(cls_factory, sd: dict, what: str, path: Path, slot: str):
    """Build the model without allocating weights, then adopt the converted tensors (strict: every key used). A
    missing, extra or wrongly shaped tensor is refused in one line with the file's own key."""
    # lazy: accelerate (~4 s measured cold): only materialising needs it
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = cls_factory()
    wanted = model.state_dict()
    problems = [f"the tensor {file_key(what, k)} is missing" for k in wanted if k not in sd]
    problems += [f"the tensor {file_key(what, k)} has shape {list(sd[k].shape)} where the file's other tensors make "
                 f"a model that needs {list(wanted[k].shape)}" for k in wanted
                 if k in sd and tuple(sd[k].shape) != tuple(wanted[k].shape)]
    problems += [f"the tensor {file_key(what, k)} belongs to no part of the {what}" for k in sd if k not in wanted]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConvertError(f"--{slot} {path}: {problems[0]}{more}; {_DOWNLOAD_AGAIN}")
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval()


def write_modular_index(repo: Path, final: Path) -> None:
    """The AnimaModularPipeline index (what `save_pretrained` of the pipeline writes), pointing at `final`."""
    parts = {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
             "t5_tokenizer": ("transformers", "T5Tokenizer"),
             "text_conditioner": ("diffusers", "AnimaTextConditioner"),
             "text_encoder": ("transformers", "Qwen3Model"),
             "tokenizer": ("transformers", "Qwen2Tokenizer"),
             "transformer": ("diffusers", "CosmosTransformer3DModel"),
             "vae": ("diffusers", "AutoencoderKLQwenImage")}
    index = {"_blocks_class_name": "AnimaAutoBlocks", "_class_name": "AnimaModularPipeline",
             "_diffusers_version": diffusers.__version__}
    for name, (lib, cls) in parts.items():
        index[name] = [lib, cls, {"pretrained_model_name_or_path": str(final), "revision": None, "subfolder": name,
                                  "type_hint": [lib, cls], "variant": None}]
    (repo / "modular_model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def resolve_tokenizers(value: str) -> Path | str | None:
    """Local folder (checked now) -> Path; 'none' -> None; else a repo id (str), fetched after the weights."""
    if value.lower() == "none":
        return None
    local = Path(value).expanduser()
    if local.is_dir():
        missing = [t for t in TOKENIZER_FOLDERS if not (local / t).is_dir()]
        if missing:
            raise ConvertError(f"{_flag('tokenizers')} {local}: folder has no "
                               f"{' or '.join(m + '/' for m in missing)}; point "
                               f"it at a diffusers Anima repo (or any folder holding tokenizer/ and t5_tokenizer/)")
        return local
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", value):  # "./x", "/abs", "a/b/c": a missing folder
        raise ConvertError(f"{_flag('tokenizers')} {value!r} is neither an existing folder nor a Hugging Face repo "
                           f"id "
                           f"(owner/name); use `none` to skip the tokenizers")
    return value


def fetch_tokenizers(repo_id: str) -> tuple[Path | None, str]:
    """Download only tokenizer/ and t5_tokenizer/ of `repo_id` into the HF cache -> (folder, ""), or
    (None, reason) if that fails for any reason."""
    try:
        root = Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=[f"{t}/*" for t in TOKENIZER_FOLDERS]))
        missing = [t for t in TOKENIZER_FOLDERS if not (root / t).is_dir()]
        if missing:
            raise FileNotFoundError(f"the repo has no {' or '.join(m + '/' for m in missing)}")
        return root, ""
    except Exception as exc:  # offline, repo missing/gated, HF validation error, ...
        return None, f"{type(exc).__name__}: {exc}"


def convert(anima: str | os.PathLike, qwen: str | os.PathLike, vae: str | os.PathLike, out: str | os.PathLike,
            tokenizers: str = DEFAULT_TOKENIZER_REPO, modular_index: bool = True, log=print) -> dict:
    """Convert the three single files into a diffusers repo at `out`. Returns a report:
    {"out": Path, "counts": {file slot/component: tensor count}, "tokenizers": source or None}."""
    # lazy: diffusers + transformers model classes (1.9 s + 4.7 s measured on top of torch): `anima-train convert
    # --help` and key reading skip them
    from diffusers import AutoencoderKLQwenImage, CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    from transformers import Qwen3Config, Qwen3Model

    inputs = {"anima": Path(anima).expanduser(), "qwen": Path(qwen).expanduser(), "vae": Path(vae).expanduser()}
    out = Path(out).expanduser().absolute()
    # cheap checks first: output folder, tokenizer source, every input's header and slot; then the tokenizers
    # (a download) before any weight is read, so a repo is never written without them unless asked
    earlier = None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        earlier = _same_conversion(out, inputs)
        if earlier is None:
            raise ConvertError(f"{_flag('out')} {out} exists and is not an empty folder; convert refuses to merge "
                               f"into an "
                               f"existing repo (a stale file would survive). Choose a new folder or empty this one")
    token_source = resolve_tokenizers(tokenizers)
    for slot, path in inputs.items():
        check_slot(path, slot, read_keys(path, slot))
    if isinstance(token_source, str):
        log(f"fetching tokenizer/ and t5_tokenizer/ from {token_source} (only those folders)")
        fetched, why_not = fetch_tokenizers(token_source)
        if fetched is None:
            raise ConvertError(
                f"{_flag('tokenizers')} {token_source}: could not fetch tokenizer/ and t5_tokenizer/ ({why_not}); "
                f"nothing was written. Point {_flag('tokenizers', 'the Convert node')} at a local folder holding "
                f"tokenizer/ and t5_tokenizer/, e.g. a downloaded diffusers Anima repo, or give `none` to convert "
                f"without them (training then needs them added)")
        token_source = fetched
    if earlier is not None:
        return _complete(out, earlier, token_source, log)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    counts: dict[str, int] = {}
    try:
        t0 = time.perf_counter()
        native = load_tensors(inputs["anima"], "anima")
        counts["anima file"] = len(native)
        dit_sd, cond_sd = rename(keymaps.split_anima_native, native, "anima", inputs["anima"])
        blocks = check_blocks(native, inputs["anima"])  # after the rename, which names a tensor it cannot map
        del native
        cfg = inferred_config(transformer_config, dit_sd, "transformer", "anima", inputs["anima"])
        model = _materialise(lambda: CosmosTransformer3DModel(**cfg), dit_sd, "transformer", inputs["anima"], "anima")
        model.save_pretrained(tmp / "transformer")
        counts["transformer"] = len(dit_sd)
        del model, dit_sd
        cfg = inferred_config(conditioner_config, cond_sd, "text_conditioner", "anima", inputs["anima"])
        model = _materialise(lambda: AnimaTextConditioner(**cfg), cond_sd, "text_conditioner", inputs["anima"],
                             "anima")
        model.save_pretrained(tmp / "text_conditioner")
        counts["text_conditioner"] = len(cond_sd)
        del model, cond_sd
        log(f"anima: {counts['anima file']} tensors -> transformer {counts['transformer']} + text_conditioner "
            f"{counts['text_conditioner']}")

        native = load_tensors(inputs["qwen"], "qwen")
        counts["qwen file"] = len(native)
        te_sd = rename(keymaps.qwen3_native_to_diffusers, native, "qwen", inputs["qwen"])
        del native
        cfg = inferred_config(qwen3_config, te_sd, "text encoder", "qwen", inputs["qwen"])
        model = _materialise(lambda: Qwen3Model(Qwen3Config(**cfg)), te_sd, "text encoder", inputs["qwen"], "qwen")
        model.save_pretrained(tmp / "text_encoder")
        counts["text_encoder"] = len(te_sd)
        dropped = counts["qwen file"] - counts["text_encoder"]
        log(f"qwen: {counts['qwen file']} tensors -> text_encoder {counts['text_encoder']}"
            + (f" ({dropped} LM-head tensor(s) dropped: Qwen3Model has no head)" if dropped else ""))
        del model, te_sd

        native = load_tensors(inputs["vae"], "vae")
        counts["vae file"] = len(native)
        cfg = inferred_config(lambda sd: vae_config(sd, inputs["vae"]), native, "the file", "vae", inputs["vae"])
        vae_sd = rename(keymaps.vae_native_to_diffusers, native, "vae", inputs["vae"], cfg["num_res_blocks"])
        del native
        model = _materialise(lambda: AutoencoderKLQwenImage(**cfg), vae_sd, "VAE", inputs["vae"], "vae")
        model.save_pretrained(tmp / "vae")
        counts["vae"] = len(vae_sd)
        log(f"vae: {counts['vae file']} tensors -> vae {counts['vae']}")
        del model, vae_sd

        FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(tmp / "scheduler")
        if isinstance(token_source, Path):
            for t in TOKENIZER_FOLDERS:
                shutil.copytree(token_source / t, tmp / t)
            log(f"tokenizers: copied from {token_source}")
        if modular_index:
            write_modular_index(tmp, out)
        _write_record(tmp, inputs, blocks)
        publish_dir(tmp, out)  # `out` is absent or empty (checked above)
        log(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if token_source is None:
        _warn_no_tokenizers(out, log)
    return {"out": out, "counts": counts, "tokenizers": token_source}


def _warn_no_tokenizers(out: Path, log) -> None:
    message = (f"tokenizers skipped (--tokenizers none): {out} holds every weight, but training needs tokenizer/ "
               f"and t5_tokenizer/. " + tokenizer_fix_hint(out))
    warnings.warn(message, TokenizersMissingWarning, stacklevel=3)
    log(f"WARNING: {message}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _file_record(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_record(repo: Path, inputs: dict[str, Path], blocks: int) -> None:
    """What a later convert into the same folder compares with: the three inputs (path, size, time) and every
    weight file written (size), relative to the repo; and the model converted (the DiT file's name, its sha256 and
    block count), which a run's files name as their base model."""
    weights = {str(p.relative_to(repo)): p.stat().st_size for p in sorted(repo.rglob("*.safetensors"))}
    record = {"inputs": {slot: {"path": str(path.absolute()), **_file_record(path)} for slot, path in inputs.items()},
              "weights": weights,
              "model": {"file": inputs["anima"].name, "sha256": _sha256(inputs["anima"]), "blocks": blocks}}
    (repo / RECORD_NAME).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def _same_conversion(out: Path, inputs: dict[str, Path]) -> dict | None:
    """The record of `out` when this command wrote it from these same three files and its weights are still as
    written, else None."""
    try:
        record = json.loads((out / RECORD_NAME).read_text(encoding="utf-8"))
        for slot, path in inputs.items():
            if record["inputs"][slot] != {"path": str(path.absolute()), **_file_record(path)}:
                return None
        for rel, size in record["weights"].items():
            if (out / rel).stat().st_size != size:
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record


def _complete(out: Path, record: dict, token_source: Path | None, log) -> dict:
    """A repo converted earlier from the same files: add the tokenizers it lacks (each folder copied beside it and
    renamed in), or say it is up to date."""
    missing = [t for t in TOKENIZER_FOLDERS if not (out / t).is_dir()]
    counts = {"weight files": len(record["weights"])}
    if not missing:
        log(f"{out} was converted from these same files and is complete: up to date, nothing written")
        return {"out": out, "counts": counts, "tokenizers": token_source, "completed": []}
    if token_source is None:
        _warn_no_tokenizers(out, log)
        return {"out": out, "counts": counts, "tokenizers": None, "completed": []}
    for folder in missing:
        tmp = out / f".{folder}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(token_source / folder, tmp)
        publish_dir(tmp, out / folder)
    log(f"{out} was converted from these same files ({len(record['weights'])} weight files checked): added "
        f"{' and '.join(m + '/' for m in missing)} from {token_source}")
    return {"out": out, "counts": counts, "tokenizers": token_source, "completed": missing}


# ----------------------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--anima", required=True, help="Anima DiT single file (net.*, incl. llm_adapter)")
    parser.add_argument("--qwen", required=True, help="Qwen3-0.6B text encoder single file (ComfyUI text_encoders)")
    parser.add_argument("--vae", required=True, help="Qwen-Image / Wan2.1 VAE single file (ComfyUI vae)")
    parser.add_argument("--out", required=True, help="output folder; must be absent or empty")
    parser.add_argument("--tokenizers", default=DEFAULT_TOKENIZER_REPO,
                        help="folder holding tokenizer/ and t5_tokenizer/ (wins if it exists), a Hugging Face repo "
                             f"id (default {DEFAULT_TOKENIZER_REPO}; only those two folders are downloaded), "
                             "or `none`")
    parser.add_argument("--no-modular-index", action="store_true",
                        help="do not write modular_model_index.json (the trainer never reads it)")


def run(args: argparse.Namespace) -> int:
    try:
        convert(args.anima, args.qwen, args.vae, args.out, tokenizers=args.tokenizers,
                modular_index=not args.no_modular_index)
    except ConvertError as exc:
        print(f"anima-train convert: {exc}", file=sys.stderr)
        return 2
    return 0
