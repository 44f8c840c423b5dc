"""Load the parts of a converted Anima diffusers repo that the trainer needs.

    parts = load_components("../anima-diffusers", dtype="bfloat16", device="cuda")
    parts.transformer, parts.text_conditioner, parts.text_encoder      # nn.Modules, eval mode, on `device`
    parts.tokenizer, parts.t5_tokenizer, parts.scheduler
    parts.vae                                                          # loaded on first access (lazy)

The repo is the one `anima-train convert` writes (or any diffusers Anima repo with the same subfolders). Every
component is loaded from its own subfolder with the plain `from_pretrained` of its class (docs/model.md#components); the
modular-pipeline index is never read. Everything is checked *before* the first weight is read, so a repo converted
without tokenizers fails in a second with a message naming the fix, not after loading 4 GB.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from anima_train.config import DTYPE_NAMES
from anima_train.errors import UserError
from anima_train.fixes import ref

# subfolder -> the file that must exist in it (any one of the names)
REQUIRED_FILES = {
    "transformer": ("config.json",),
    "text_conditioner": ("config.json",),
    "text_encoder": ("config.json",),
    "vae": ("config.json",),
    "scheduler": ("scheduler_config.json",),
    "tokenizer": ("tokenizer.json", "vocab.json", "tokenizer_config.json"),
    "t5_tokenizer": ("tokenizer.json", "spiece.model", "tokenizer_config.json"),
}
TOKENIZER_FOLDERS = ("tokenizer", "t5_tokenizer")
DEFAULT_TOKENIZER_REPO = "circlestone-labs/Anima-Base-v1.0-Diffusers"  # see model/convert.py for why this one


class ModelRepoError(UserError, FileNotFoundError):
    """A model_path that is not a usable Anima diffusers repo; the message says what is missing and the fix."""


def tokenizer_fix_hint(model_path: str | os.PathLike) -> str:
    return ref("run convert --tokenizers",
               f"Add them in one of two ways: run the same `anima-train convert` (or Convert node) again, same files "
               f"and out folder, with `--tokenizers DIR|REPO_ID` (default repo {DEFAULT_TOKENIZER_REPO}): it adds "
               f"them to the repo it wrote; or copy the two folders into the repo, e.g. `hf download "
               f"{DEFAULT_TOKENIZER_REPO} --include 'tokenizer/*' 't5_tokenizer/*' --local-dir {model_path}`")


def check_repo(model_path: str | os.PathLike) -> Path:
    """Raise ModelRepoError unless every subfolder the trainer loads is present. Reads no weights."""
    root = Path(model_path).expanduser()
    if not root.is_dir():
        raise ModelRepoError(
            f"model_path {str(root)!r} is not a directory. Point train.model_path (or ANIMA_MODEL) at a diffusers "
            f"Anima repo; " + ref("run convert", "make one from the ComfyUI single files with `anima-train convert "
                                                "--anima F --qwen F --vae F --out DIR`"))
    missing = [sub for sub, names in REQUIRED_FILES.items() if not any((root / sub / n).is_file() for n in names)]
    missing_tok = [m for m in missing if m in TOKENIZER_FOLDERS]
    missing_weights = [m for m in missing if m not in TOKENIZER_FOLDERS]
    if missing_weights:
        raise ModelRepoError(
            f"model_path {str(root)!r} is not a complete Anima diffusers repo: missing "
            f"{', '.join(f'{m}/' for m in missing_weights)}"
            f"{' and ' + ', '.join(f'{m}/' for m in missing_tok) if missing_tok else ''}. "
            + ref("run convert", "Convert the ComfyUI single files with `anima-train convert --anima F --qwen F "
                                 "--vae F --out DIR`"))
    if missing_tok:
        raise ModelRepoError(
            f"model_path {str(root)!r} has no {' and no '.join(f'{m}/' for m in missing_tok)} folder: the "
            f"tokenizers are required to "
            f"train (captions are tokenized on every step) and conversion cannot synthesise them. "
            + tokenizer_fix_hint(root))
    return root


# what each weight folder is converted from (`anima-train convert` flags), for the fix of a damaged one
WEIGHT_SOURCES = {"transformer": "--anima", "text_conditioner": "--anima", "text_encoder": "--qwen", "vae": "--vae"}
_SAFETENSORS_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
                            "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def damaged(path: Path, what: str) -> str:
    """The message for a damaged file of the repo: the component, the file, what is wrong and the fix."""
    component = path.parent.name
    source = WEIGHT_SOURCES.get(component, "--anima/--qwen/--vae")
    return (f"{path} ({component}) is damaged: {what}. "
            + ref("run convert", f"Re-convert the model into a new folder with `anima-train convert --anima F "
                                 f"--qwen F --vae F --out DIR` (this file comes from {source}), or download the "
                                 f"repo again, and point model_path at it"))


def safetensors_header(path: Path) -> dict:
    """The tensors' header of a safetensors file ({name: {dtype, shape, data_offsets}}), checked against the file:
    a header that parses and tensors whose bytes all lie inside the file. Raises ModelRepoError (damaged)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n <= 0 or n > size - 8:
            raise ModelRepoError(damaged(path, f"not a safetensors file (its first bytes are no header; the file "
                                               f"has {size} bytes)"))
        try:
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            raise ModelRepoError(damaged(path, f"its safetensors header is not valid JSON ({exc})")) from None
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = (int(x) for x in info["data_offsets"])
            count = 1
            for d in info["shape"]:
                count *= int(d)
            width = _SAFETENSORS_DTYPE_BYTES.get(info["dtype"])  # a dtype not listed here: its size is not checked
            if start > stop or (width is not None and stop - start != count * width):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise ModelRepoError(damaged(path, f"the header entry of tensor {name!r} is inconsistent")) from None
        end = max(end, stop)
    if 8 + n + end != size:
        what = "truncated" if 8 + n + end > size else "longer than its header says"
        raise ModelRepoError(damaged(path, f"{what} ({size} bytes; its header needs {8 + n + end})"))
    return {k: v for k, v in header.items() if k != "__metadata__"}


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        return value
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelRepoError(damaged(path, f"not valid JSON ({exc})")) from None


def check_weights(model_path: str | os.PathLike) -> dict[str, dict[str, tuple[list[int], Path]]]:
    """Read every config.json and every safetensors header of the weight folders (no weights): a damaged file
    raises ModelRepoError naming the component and the file. Returns {component: {tensor: (shape, file)}}."""
    root = check_repo(model_path)
    shapes = {}
    for sub in WEIGHT_SOURCES:
        folder = root / sub
        _read_json(folder / "config.json")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelRepoError(damaged(folder / "config.json", "its folder holds no *.safetensors weights"))
        for index in folder.glob("*.safetensors.index.json"):
            _read_json(index)
        shapes[sub] = {k: (list(v["shape"]), f) for f in files for k, v in safetensors_header(f).items()}
    return shapes


def check_weight_shapes(model_path: str | os.PathLike) -> None:
    """check_weights, then every tensor's shape against the model its config.json builds (on the meta device: no
    memory, no weights read). Raises ModelRepoError naming the component, the tensor and both shapes."""
    # lazy: accelerate (~4 s measured cold): only loading needs it
    from accelerate import init_empty_weights

    root = Path(model_path).expanduser()
    shapes = check_weights(root)
    for sub, model in _empty_models(root, init_empty_weights).items():
        for name, tensor in model.state_dict().items():
            got, file = shapes[sub].get(name, (None, None))
            if got is not None and list(tensor.shape) != got:
                raise ModelRepoError(damaged(file, f"tensor {name} has shape {got}, but {sub}/config.json builds "
                                                   f"{list(tensor.shape)} (the weights and the config do not belong "
                                                   f"together)"))


def _empty_models(root: Path, init_empty_weights) -> dict:
    # lazy: diffusers + transformers model classes (1.9 s + 4.7 s measured on top of torch): the repo checks
    # (preflight, the nodes, `cache`) need only the folder layout
    from diffusers import AutoencoderKLQwenImage, CosmosTransformer3DModel
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    from transformers import Qwen3Config, Qwen3Model

    models = {}
    with init_empty_weights():
        for sub, cls in (("transformer", CosmosTransformer3DModel), ("text_conditioner", AnimaTextConditioner),
                         ("vae", AutoencoderKLQwenImage)):
            try:
                models[sub] = cls.from_config(cls.load_config(root, subfolder=sub))
            except Exception as exc:  # noqa: BLE001 (a config with wrong values: name the file)
                raise ModelRepoError(damaged(root / sub / "config.json",
                                             f"it does not build a model ({exc})")) from None
        try:
            models["text_encoder"] = Qwen3Model(Qwen3Config.from_pretrained(root, subfolder="text_encoder"))
        except Exception as exc:  # noqa: BLE001
            raise ModelRepoError(damaged(root / "text_encoder" / "config.json",
                                         f"it does not build a model ({exc})")) from None
    return models


def load_damage(root: Path, sub: str, exc: Exception) -> ModelRepoError:
    """A weight folder that failed to load after the checks passed (diffusers/transformers' own error, minus its
    advice to ignore mismatched sizes): the component, the folder and the fix."""
    text = str(exc).split(" If you want to")[0].split(" You may consider")[0].strip()
    return ModelRepoError(damaged(root / sub / "config.json", f"loading {sub}/ failed ({type(exc).__name__}: {text})"))


DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the [train] dtype names -> torch dtypes
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
    return DTYPES[name]


@dataclass
class AnimaComponents:
    transformer: Any
    text_conditioner: Any
    text_encoder: Any
    tokenizer: Any
    t5_tokenizer: Any
    scheduler: Any
    model_path: Path
    dtype: torch.dtype
    device: torch.device
    _vae: Any = field(default=None, repr=False)

    @property
    def vae(self):
        """AutoencoderKLQwenImage, loaded on first access (training from a latent cache never needs it)."""
        if self._vae is None:
            # lazy: see _empty_models
            from diffusers import AutoencoderKLQwenImage

            self._vae = AutoencoderKLQwenImage.from_pretrained(self.model_path, subfolder="vae", dtype=self.dtype)
            self._vae.to(self.device).eval().requires_grad_(False)
        return self._vae

    def release_vae(self) -> None:
        """Drop the VAE (e.g. after encoding the latent cache); the next `.vae` loads it again."""
        self._vae = None


def load_components(model_path: str | os.PathLike, dtype: str | torch.dtype = torch.bfloat16,
                    device: str | torch.device = "cpu", load_vae: bool = False) -> AnimaComponents:
    """Load transformer, text_conditioner, text_encoder (Qwen3Model), both tokenizers and the scheduler from a
    diffusers Anima repo; the VAE is lazy unless `load_vae`. Models come back in eval mode with requires_grad off
    (the trainer decides what to train) in `dtype` on `device`."""
    # lazy: see _empty_models
    from diffusers import CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    from transformers import AutoTokenizer, Qwen3Model

    root = check_repo(model_path)  # before any weight is read
    dtype, device = resolve_dtype(dtype), torch.device(device)
    tokenizer = AutoTokenizer.from_pretrained(root, subfolder="tokenizer")
    t5_tokenizer = AutoTokenizer.from_pretrained(root, subfolder="t5_tokenizer")
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root, subfolder="scheduler")

    def ready(model):
        return model.to(device).eval().requires_grad_(False)

    def load(cls, sub):
        try:
            return ready(cls.from_pretrained(root, subfolder=sub, dtype=dtype))
        except Exception as exc:  # a damaged file the header check cannot see (diffusers/transformers/safetensors)
            file_error = isinstance(exc, (ValueError, RuntimeError)) or type(exc).__module__.startswith("safetensors")
            if not file_error and not (isinstance(exc, OSError) and exc.errno is None):
                raise  # the machine's (disk, permissions: an errno) or a bug: not the file's
            raise load_damage(root, sub, exc) from exc

    parts = AnimaComponents(
        transformer=load(CosmosTransformer3DModel, "transformer"),
        text_conditioner=load(AnimaTextConditioner, "text_conditioner"),
        text_encoder=load(Qwen3Model, "text_encoder"),
        tokenizer=tokenizer, t5_tokenizer=t5_tokenizer, scheduler=scheduler,
        model_path=root, dtype=dtype, device=device)
    if load_vae:
        parts.vae  # noqa: B018 (loads it)
    return parts
