"""Preview images while training ([sample]): the model being trained, adapter active, sampled as ComfyUI samples it.

What ComfyUI's KSampler does for Anima (sampler "euler", scheduler "simple"; docs/comfyui.md#sampling, read in the
snapshot's comfy/model_sampling.py, comfy/samplers.py, comfy/sample.py) and what this module does the same way:
  * sigmas: ModelSamplingDiscreteFlow keeps 1000 sigmas shift(t), t = 1/1000 .. 1 (float32), with
    shift(t) = s·t / (1 + (s − 1)·t) and s = 3.0 for Anima; "simple" takes every (1000/steps)-th from the top, then 0;
  * noise: torch.randn of the latent's shape [1, 16, 1, H/8, W/8], float32, on the CPU, from a generator seeded
    with the seed (ComfyUI reseeds the global generator; here a private one, so training's RNG is left alone);
  * the empty latent is not normalised, so x = σ₀·noise; the DiT gets σ itself as its timestep (multiplier 1);
  * CFG on the denoised estimate: x0 = x − σ·v per side, x0 = x0_uncond + cfg·(x0_cond − x0_uncond); Euler
    x ← x + (σ_next − σ)·(x − x0)/σ; cfg 1 skips the negative pass;
  * the result is un-normalised (Wan2.1 latent mean/std), decoded by the VAE, and mapped from [−1, 1] to [0, 1].
The context is the trainer's own text path (anima_train.model.prompts.encode_prompts: Qwen3 + LLM adapter), one prompt
at a time like ComfyUI's CLIPTextEncode; the adapter's output is padded to 512 tokens, as ComfyUI pads it.

Memory: prompts are encoded with the parked Qwen3 brought in for the moment (memory.ParkedWeights), and a VAE that
training does not use waits on the CPU and visits the GPU only for the decode. Everything runs without autograd,
in eval mode (no LoRA dropout), inside `torch.random.fork_rng`, so a run with previews draws the same noise,
timesteps and batches as one without.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from anima_train.outputs import manifest
from anima_train.outputs.run_folder import SAMPLES_DIR
from anima_train.model.prompts import encode_prompts
from anima_train.files import atomic_path

NUM_TRAIN_SIGMAS = 1000  # ComfyUI's ModelSamplingDiscreteFlow table length (timesteps = 1000)


def shifted_sigma(t: torch.Tensor, shift: float) -> torch.Tensor:
    """σ = s·t / (1 + (s − 1)·t), the static shift of flow matching (ComfyUI's time_snr_shift)."""
    return t if shift == 1.0 else shift * t / (1 + (shift - 1) * t)


def simple_sigmas(steps: int, shift: float) -> torch.Tensor:
    """The `steps + 1` sigmas of ComfyUI's "simple" scheduler on Anima's flow model_sampling, float32."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    table = shifted_sigma(torch.arange(1, NUM_TRAIN_SIGMAS + 1) / NUM_TRAIN_SIGMAS, shift)
    stride = NUM_TRAIN_SIGMAS / steps
    return torch.tensor([float(table[-(1 + int(i * stride))]) for i in range(steps)] + [0.0], dtype=torch.float32)


def initial_noise(seed: int, height: int, width: int) -> torch.Tensor:
    """ComfyUI's noise for `seed` and a one-image Anima latent: [1, 16, 1, H/8, W/8] float32, CPU."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn((1, 16, 1, height // 8, width // 8), generator=generator, dtype=torch.float32)


@torch.no_grad()
def euler_cfg(transformer, noise: torch.Tensor, sigmas: torch.Tensor, cond: torch.Tensor,
              uncond: torch.Tensor | None, cfg_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Flow-matching Euler with CFG from pure noise; returns the normalised latent (float32, noise's device).
    cond/uncond: the DiT context [1, L, D] of the prompt and of the negative prompt."""
    x = sigmas[0] * noise
    guided = uncond is not None and cfg_scale != 1.0
    sides = [cond, uncond] if guided else [cond]
    batched = guided and cond.shape == uncond.shape  # one forward for both sides (ComfyUI batches them too)
    context = torch.cat(sides).to(dtype) if batched else None
    h, w = x.shape[-2:]
    mask = x.new_zeros(1, 1, 8 * h, 8 * w, dtype=dtype)
    for i in range(len(sigmas) - 1):
        sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])

        def velocity(x_in, ctx):
            t = torch.full((x_in.shape[0],), sigma, device=x_in.device, dtype=dtype)
            return transformer(x_in.to(dtype), timestep=t, encoder_hidden_states=ctx, padding_mask=mask,
                               return_dict=False)[0].float()

        if batched:
            v = velocity(torch.cat([x, x]), context).chunk(2)
        else:
            v = [velocity(x, side.to(dtype)) for side in sides]
        denoised = [x - sigma * vi for vi in v]
        x0 = denoised[1] + cfg_scale * (denoised[0] - denoised[1]) if guided else denoised[0]
        x = x + (x - x0) / sigma * (sigma_next - sigma)
    return x


@torch.no_grad()
def decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents [B, 16, 1, h, w] -> images [B, 3, 8h, 8w] in [0, 1], float32 on the CPU."""
    p = next(vae.parameters())
    mean = torch.tensor(vae.config.latents_mean, device=p.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=p.device).view(1, -1, 1, 1, 1)
    z = latents.to(p.device, torch.float32) * std + mean
    pixels = vae.decode(z.to(p.dtype)).sample[:, :, 0].float()
    return ((pixels + 1) / 2).clamp(0, 1).cpu()


def to_pil(image: torch.Tensor):
    """[3, H, W] in [0, 1] -> PIL RGB (rounded, as ComfyUI's SaveImage does with clip(255·x))."""
    array = (image.permute(1, 2, 0) * 255).round().clamp(0, 255).to(torch.uint8).numpy()
    return Image.fromarray(array, "RGB")


def sample_path(samples_dir: Path, step: int, index: int) -> Path:
    """<run_dir>/samples/step000120-prompt00.png: sorted by step, then by prompt."""
    return Path(samples_dir) / f"step{step:06d}-prompt{index:02d}.png"


@contextlib.contextmanager
def eval_mode(*modules):
    """Eval mode for the duration (no dropout), every submodule's own flag restored after."""
    saved = [(m, m.training) for root in modules for m in root.modules()]
    for root in modules:
        root.eval()
    try:
        yield
    finally:
        for m, flag in saved:
            m.training = flag


@contextlib.contextmanager
def vae_on(vae, device: torch.device):
    """The VAE on `device` for the duration; one kept elsewhere (the CPU) goes back there after."""
    home = next(vae.parameters()).device
    if home != device:
        vae.to(device)
    try:
        yield vae
    finally:
        if home != device:
            vae.to(home)


@dataclass
class Preview:
    step: int
    paths: list[Path]
    images: list  # PIL images, for TensorBoard
    seconds: float


def render(prompts: list[str], negative: str, *, width: int, height: int, steps: int, cfg_scale: float, seed: int,
           shift: float, transformer, conditioner, text_encoder, tokenizer, t5_tokenizer, vae, device, dtype,
           parked=None) -> list[torch.Tensor]:
    """One image per prompt ([3, H, W] in [0, 1], CPU), every one from the same seed's noise."""
    devices = [device] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad(), eval_mode(transformer, conditioner, text_encoder):
        def encode(text: str) -> torch.Tensor:
            return encode_prompts([text], tokenizer=tokenizer, t5_tokenizer=t5_tokenizer, text_encoder=text_encoder,
                                  conditioner=conditioner, device=device)

        with parked.on_device() if parked is not None else contextlib.nullcontext():
            conds = [encode(p) for p in prompts]
            uncond = encode(negative) if cfg_scale != 1.0 else None
        sigmas = simple_sigmas(steps, shift)
        latents = [euler_cfg(transformer, initial_noise(seed, height, width).to(device), sigmas, c, uncond,
                             cfg_scale, dtype) for c in conds]
        del conds, uncond
        with vae_on(vae, torch.device(device)):
            return [decode(vae, z)[0] for z in latents]


class Previewer:
    """When and how a run renders its [sample] previews; every rank calls it at the same points.

    Only the main process renders (others wait at a barrier); the images go to <run_dir>/samples/, out as a
    `samples` progress event, and to TensorBoard when it is on."""

    def __init__(self, cfg, accelerator, progress, run_dir: Path, *, parts, models, device, dtype, parked=None,
                 keep_vae_on_device: bool = False, enabled: bool = True, on_images=None):
        self.s = cfg.sample
        self.prompts = self.s.all_prompts()
        self.enabled = enabled and bool(self.prompts)
        self.accelerator, self.progress, self.parts = accelerator, progress, parts
        self.samples_dir = Path(run_dir) / SAMPLES_DIR
        self.models = models  # callable -> (transformer, conditioner, text_encoder), unwrapped, adapters active
        self.device, self.dtype, self.parked = device, dtype, parked
        self.keep_vae_on_device = keep_vae_on_device
        self.on_images = on_images
        self.last_step: int | None = None
        self._vae = None

    def before_training(self, step: int) -> None:
        if self.s.before_first_step:
            self.render(step)

    def after_step(self, step: int) -> None:
        if self.s.every_n_steps and step % self.s.every_n_steps == 0:
            self.render(step)

    def after_epoch(self, epoch: int, step: int) -> None:
        if self.s.every_n_epochs and epoch % self.s.every_n_epochs == 0:
            self.render(step)

    def at_end(self, step: int) -> None:
        if self.s.at_end:
            self.render(step)

    def _vae_model(self):
        if self._vae is None:
            self._vae = self.parts.vae  # loads on the training device on first use
            if not self.keep_vae_on_device:
                self._vae.to("cpu")  # visits the GPU only while decoding
        return self._vae

    def render(self, step: int) -> Preview | None:
        if not self.enabled or self.last_step == step:
            return None
        self.last_step = step
        preview = None
        if self.accelerator.is_main_process:
            t0 = time.perf_counter()
            transformer, conditioner, text_encoder = self.models()
            images = render(self.prompts, self.s.negative_prompt, width=self.s.width, height=self.s.height,
                            steps=self.s.steps, cfg_scale=self.s.cfg_scale, seed=self.s.seed, shift=self.s.shift,
                            transformer=transformer, conditioner=conditioner, text_encoder=text_encoder,
                            tokenizer=self.parts.tokenizer, t5_tokenizer=self.parts.t5_tokenizer,
                            vae=self._vae_model(), device=self.device, dtype=self.dtype, parked=self.parked)

            pil, paths = [to_pil(im) for im in images], []
            manifest.output(self.samples_dir.parent, SAMPLES_DIR)  # the folder is this run's (or refused)
            for i, image in enumerate(pil):
                path = sample_path(self.samples_dir, step, i)
                with atomic_path(path) as tmp:
                    image.save(tmp, format="PNG")
                paths.append(path)
            preview = Preview(step=step, paths=paths, images=pil, seconds=time.perf_counter() - t0)
            allocated = None  # what stays on the GPU after a round: flat across rounds = nothing leaks
            if torch.device(self.device).type == "cuda":
                allocated = round(torch.cuda.memory_allocated(self.device) / 2**30, 3)
            self.progress.event("samples", step=step, paths=[str(p) for p in paths], prompts=self.prompts,
                                seconds=round(preview.seconds, 3), gpu_allocated_gib=allocated)
            self.progress.message(f"previews: {len(paths)} image(s) at step {step} in {preview.seconds:.1f} s "
                                  f"-> {self.samples_dir}")
            if self.on_images is not None:
                self.on_images(step, pil)
        self.accelerator.wait_for_everyone()
        return preview
