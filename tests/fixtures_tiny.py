"""Shared tiny-model helpers for tests (a plain module; conftest.py can wrap these in session fixtures).

Suggested conftest.py fixtures:

    @pytest.fixture(scope="session")
    def tiny_anima(tmp_path_factory):
        return fixtures_tiny.tiny_anima(tmp_path_factory)            # size="tiny", seed=0, float32

    @pytest.fixture(scope="session")
    def synthetic_dataset(tmp_path_factory):
        return fixtures_tiny.synthetic_dataset(tmp_path_factory)     # 16 images + captions
"""

from __future__ import annotations

import torch

_CACHE: dict = {}


def tiny_anima(tmp_path_factory, size: str = "tiny", seed: int = 0):
    """Build once per test session (per size/seed) and share; treat the files as read-only."""
    from anima_train.model.tiny import build_tiny_anima

    key = ("anima", size, seed)
    if key not in _CACHE:
        _CACHE[key] = build_tiny_anima(tmp_path_factory.mktemp(f"anima_{size}_{seed}"), seed=seed, size=size)
    return _CACHE[key]


def synthetic_dataset(tmp_path_factory, n: int = 16, seed: int = 0):
    from anima_train.model.tiny import make_synthetic_dataset

    key = ("dataset", n, seed)
    if key not in _CACHE:
        _CACHE[key] = make_synthetic_dataset(tmp_path_factory.mktemp(f"dataset_{n}_{seed}"), n=n, seed=seed)
    return _CACHE[key]


def load_repo(repo_dir):
    """Every component of a tiny diffusers repo with the plain per-subfolder from_pretrained calls."""
    from diffusers import AutoencoderKLQwenImage, CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    from transformers import Qwen2Tokenizer, Qwen3Model, T5TokenizerFast

    return dict(
        transformer=CosmosTransformer3DModel.from_pretrained(repo_dir, subfolder="transformer"),
        text_conditioner=AnimaTextConditioner.from_pretrained(repo_dir, subfolder="text_conditioner"),
        text_encoder=Qwen3Model.from_pretrained(repo_dir, subfolder="text_encoder"),
        vae=AutoencoderKLQwenImage.from_pretrained(repo_dir, subfolder="vae"),
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(repo_dir, subfolder="scheduler"),
        tokenizer=Qwen2Tokenizer.from_pretrained(repo_dir, subfolder="tokenizer"),
        t5_tokenizer=T5TokenizerFast.from_pretrained(repo_dir, subfolder="t5_tokenizer"),
    )


def latent_stats(vae):
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return mean, std


def training_loss(parts: dict, images: torch.Tensor, captions: list[str], generator=None) -> torch.Tensor:
    """The training step (docs/model.md#flow-matching): Qwen3 -> conditioner -> DiT (padding_mask) on VAE latents."""
    tok, t5_tok = parts["tokenizer"], parts["t5_tokenizer"]
    q = tok(captions, padding="longest", return_tensors="pt")
    t5 = t5_tok(captions, padding="longest", return_tensors="pt")
    mask = q.attention_mask
    qwen_h = parts["text_encoder"](input_ids=q.input_ids, attention_mask=mask).last_hidden_state * mask[..., None]
    mean, std = latent_stats(parts["vae"])
    x0 = (parts["vae"].encode(images[:, :, None]).latent_dist.mode() - mean) / std
    eps = torch.randn(x0.shape, generator=generator)
    u = torch.sigmoid(torch.randn(x0.shape[0], generator=generator))
    sigma = 3 * u / (1 + 2 * u)
    s = sigma.view(-1, 1, 1, 1, 1)
    x_t = (1 - s) * x0 + s * eps
    ctx = parts["text_conditioner"](source_hidden_states=qwen_h, target_input_ids=t5.input_ids,
                                    target_attention_mask=t5.attention_mask, source_attention_mask=mask)
    h, w = x_t.shape[-2:]
    v = parts["transformer"](x_t, timestep=sigma, encoder_hidden_states=ctx,
                             padding_mask=x_t.new_zeros(1, 1, 8 * h, 8 * w), return_dict=False)[0]
    return torch.nn.functional.mse_loss(v.float(), (eps - x0).float())


def comfy_text_encoder(tmp_path_factory, seed: int = 0):
    """A random-weight Qwen3 text encoder ComfyUI's CLIPLoader loads (native names, bf16, ~1.2 GB, ~15 s).

    The one model that cannot be tiny: ComfyUI hard-codes the Qwen3-0.6B config of Anima's text encoder (28 layers,
    vocab 151936; docs/comfyui.md#model-detection), so a workflow with a CLIPLoader needs a file of exactly that
    shape. The shapes come from transformers' Qwen3 with the full config, built on the meta device (no 0.6B
    initialisation)."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3Model

    from anima_train.model import keymaps
    from anima_train.model.tiny import QWEN3_FULL

    key = ("comfy_text_encoder", seed)
    if key not in _CACHE:
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in Qwen3Model(Qwen3Config(**QWEN3_FULL)).state_dict().items()}
        gen = torch.Generator().manual_seed(seed)
        sd = {}
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):  # RMSNorm scales
                sd[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                sd[name] = torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
        path = tmp_path_factory.mktemp("qwen3_full") / "qwen3_06b_random.safetensors"
        save_file(keymaps.qwen3_diffusers_to_native(sd), str(path), metadata={"format": "pt"})
        _CACHE[key] = path
    return _CACHE[key]


def small_run_toml(model, data, out, *, train: str = "", tables: str = "", progress: str = "off") -> str:
    """The TOML of a small CPU run on the tiny model over 128-px latents: fp32, no DataLoader workers, no progress bar,
    no gradient checkpointing, a rank-4 LoRA. `train`: more [train] lines; `tables`: more tables after [adapter]."""
    return f"""[train]
model_path = "{model}"
output_dir = "{out}"
dtype = "float32"
num_workers = 0
progress = "{progress}"
gradient_checkpointing = false
{train}
[dataset]
path = "{data}"
resolution = 128
[adapter]
rank = 4
alpha = 4.0
{tables}"""


def torchrun(args: list, *, cwd, timeout: int = 600):
    """`python -m torch.distributed.run --nproc_per_node 2 ARGS...` on CPU (gloo), with the repository first on the
    path and a free local port (parallel test runs must not collide); returns the CompletedProcess (text)."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "MASTER_ADDR": "127.0.0.1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def anima_train_cli(*args, cwd, env: dict | None = None, timeout: float = 600):
    """`python -m anima_train ARGS...` as a user runs it, with the repository first on the path (from any cwd);
    returns the CompletedProcess (text). The user's debug setting (ANIMA_TRAIN_DEBUG, which shows tracebacks) is
    dropped unless `env` sets it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from anima_train.errors import DEBUG_ENV

    root = Path(__file__).resolve().parents[1]
    full = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1"}
    full.pop(DEBUG_ENV, None)
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "anima_train", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=full, timeout=timeout)


def stand_in_command(name: str, module_source: str, *argv, cwd, env: dict | None = None, before: str = "pass",
                     timeout: float = 120):
    """`anima-train ARGV...` run through the CLI's `main` as a user's command is, with a command `name` added whose
    module (`name`_cmd.py in `cwd`, with `add_arguments` and `run` as every command module has them) is
    `module_source`: a test's stand-in for an import or a run that fails in a way a real one cannot be made to on
    demand. `before`: Python run first in the child, before the CLI is imported. Returns the CompletedProcess
    (text); the debug setting is dropped unless `env` sets it, as in anima_train_cli."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from anima_train.errors import DEBUG_ENV

    (Path(cwd) / f"{name}_cmd.py").write_text(module_source)
    root = Path(__file__).resolve().parents[1]
    full = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{cwd}", "OMP_NUM_THREADS": "1"}
    full.pop(DEBUG_ENV, None)
    full.update(env or {})
    code = (f"import sys; {before}; from anima_train import cli; "
            f"cli.COMMANDS[{name!r}] = cli.Command({name + '_cmd'!r}, 'x'); sys.exit(cli.main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True, cwd=cwd,
                          env=full, timeout=timeout)


def folder_digests(folder) -> dict:
    """{relative path: sha256} of every file under `folder`, hidden ones included: a run's bytes before and after."""
    import hashlib
    from pathlib import Path

    folder = Path(folder)
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def forget_inductor_cpu_checks() -> None:
    """Inductor remembers for the whole process whether the C++ compiler builds vectorised code (cpu_vec_isa's
    cached checks). A test that swaps in a failing compiler leaves "no vector ISA" behind, and a kernel that the
    on-disk cache holds with at::vec code is then built without the ISA flags ("'at::vec' has not been declared":
    test_regional_compile_matches_eager failed so in CI). Call after such a test."""
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    for cls in vars(cpu_vec_isa).values():
        if isinstance(cls, type) and issubclass(cls, cpu_vec_isa.VecISA):
            for attr in vars(cls).values():
                if hasattr(attr, "cache_clear"):
                    attr.cache_clear()
