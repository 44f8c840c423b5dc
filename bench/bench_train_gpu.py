"""GPU benchmark of the real trainer (`anima_train.training.train.train`) on a full-size random-init Anima, beside the
naive baseline and the seed trainer, in one call, with the ratios.

1024x1024 (4096 tokens), bf16, AdamW; LoRA r32 on attention + MLP and a full finetune of the DiT. Ours runs the
configuration a user gets by default: `gradient_checkpointing = true` with `checkpoint_blocks = "auto"` (the fewest
recomputed blocks that fit the card, decided after the first step) and `compile = "auto"` (here "default": auto
compiles runs of 200+ steps, and the bench stops a long run early). Each of our steps also tokenises and encodes
its captions with Qwen3 and runs the LLM adapter, because that is what training does.

    python3 bench/bench_train_gpu.py --work /tmp/bench --only lora_b8,full_b4 \
        --baseline BASELINE.py --seed-bench SEED_BENCH.py --seed-tar 'SEED-*.tar.gz' [--cap-gib 24] [--steps 12]

The three comparison inputs are optional and not part of this repository: BASELINE.py is a naive diffusers + peft
training step on a full-size random Anima (prints one JSON line per run), SEED_BENCH.py times the original trainer
(the seed) from its unmodified source tarball SEED-*.tar.gz. Without them only our runs are measured.

Names: `lora_bN`, `full_bN` (fp32 masters + AdamW), `full8bit_bN` (adamw8bit + quantize_state + use_kahan: the
smallest full finetune), `fullkahan_bN` (adamw + use_kahan: bf16 moments and residual, one compiled kernel per tensor);
`NAME:SETTING` runs it with that checkpoint_blocks (ours: `lora_b2:all`) or, for the seed, `NAME:off` with its own
`gradient_checkpointing = false`; `NAME@K` (ours) runs it with `swap_blocks = K` (`lora_b4:auto@11`; `@0`: every block
on the GPU; without `@`: the default, `swap_blocks = "auto"`, and the JSON's `swapped_blocks` says what it chose).
Compare with the seed's best at the same memory (`--seed-only`: the largest batch that fits checkpointed under a cap,
`lora_b8:off` uncapped). `--diag` prints memory and allocator retries per micro-step and the plan "auto" chose. Under a
cap, give each of our configurations its own process: a finished run's compiled model stays allocated in the process.
`--cap-gib G` caps every process (ours, the seed's, the baseline's) with torch.cuda.set_per_process_memory_fraction, as
a G GiB card would. Prints one JSON line per run and a table.

Texture mode (docs/training.md#texture-mode) needs images, not latents (source = "encode": the VAE runs every step).
`encode_bN` (full-resolution 1024x1024 buckets, encoded in the loop) and `texture_bN` (one texture phase over the
whole run, 1024x1024 canvases cut from 1536x1536 sources) train the same LoRA on the same synthetic images, built on
first use under --work/images; their s/step difference is the per-step cost of texture mode:

    python3 bench/bench_train_gpu.py --work /tmp/bench --only encode_b4,texture_b4

`--previews N`: each of our runs also renders 2 preview images (1024x1024, --preview-steps Euler steps, CFG 4)
every N steps and at the end; its line adds the preview rounds, seconds per round and the GPU memory still
allocated after each round (flat = no growth). Compare its peak with the same run without --previews.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# each record carries the trained tensors' digest (A/B of two runs), which a run computes only when asked
os.environ.setdefault("ANIMA_TRAIN_RECORD", "1")

from anima_train.config import parse_config  # noqa: E402
from anima_train.data.synthetic import make_synthetic_latents  # noqa: E402
from anima_train.model.tiny import CONFIGS, build_qwen_tokenizer, build_t5_tokenizer  # noqa: E402
from anima_train.outputs.progress import SWAP_PREFIX  # noqa: E402
from anima_train.training.compiling import resolve_compile  # noqa: E402
from anima_train.training.train import train  # noqa: E402

LORA = '[adapter]\nkind = "lora"\nrank = 32\nalpha = 32.0\n[optimizer]\nlr = 1e-4\n'
FULL = '[adapter]\nkind = "none"\n[component_lr]\nadaln = 1e-5\nbase = 1e-5\n[optimizer]\nlr = 1e-5\n'
# the lean full finetune for 24 GiB cards: uint8 AdamW state + Kahan residual instead of fp32 masters
FULL_8BIT = ('[adapter]\nkind = "none"\n[component_lr]\nadaln = 1e-5\nbase = 1e-5\n[optimizer]\n'
             'kind = "adamw8bit"\nlr = 1e-5\nquantize_state = true\nuse_kahan = true\n')
# the lean full finetune without SDNQ: bf16 moments + Kahan residual, compiled per-tensor steps
# (training/adamw_kahan.py)
FULL_KAHAN = ('[adapter]\nkind = "none"\n[component_lr]\nadaln = 1e-5\nbase = 1e-5\n[optimizer]\n'
              'kind = "adamw"\nlr = 1e-5\nuse_kahan = true\n')
KINDS = {"lora": LORA, "full": FULL, "full8bit": FULL_8BIT, "fullkahan": FULL_KAHAN,
         # on images: the extra TOML starts inside [dataset]
         "encode": 'source = "encode"\n' + LORA,
         "texture": ('source = "encode"\n[dataset.texture]\ncanvases = [[1024, 1024]]\n[[curriculum]]\nat = 0.0\n'
                     'mode = "texture"\n' + LORA)}
IMAGE_KINDS = ("encode", "texture")
SEED_MODES = {"lora": "lora", "full": "full"}  # our kind -> seed_bench.py --mode
BASELINE_NAMES = {"lora": "lora_b{b}_ckpt", "full": "full_b{b}_ckpt"}


def parse_run(name: str) -> tuple[str, int]:
    m = re.fullmatch(r"(lora|full|full8bit|fullkahan|encode|texture)_b(\d+)", name)
    if not m:
        raise SystemExit(f"--only: unknown run {name!r}; use lora_bN, full_bN, full8bit_bN, fullkahan_bN, encode_bN "
                         "or texture_bN")
    return m.group(1), int(m.group(2))


def split_name(name: str) -> tuple[str, str, int | None]:
    """(run, its own checkpoint_blocks or "", its swap_blocks or None for the default "auto") of
    `RUN[:BLOCKS][@SWAP]` (lora_b4:auto@11), the run checked."""
    name, _, swap = name.partition("@")
    run, _, own_blocks = name.partition(":")
    parse_run(run)
    return run, own_blocks, int(swap) if swap else None




def build_repo(repo: Path) -> None:
    """Full-size random Anima + tiny tokenizers (the VAE is written for completeness; training reads latents)."""
    from diffusers import AutoencoderKLQwenImage, CosmosTransformer3DModel, FlowMatchEulerDiscreteScheduler
    from diffusers.models.condition_embedders.condition_embedder_anima import AnimaTextConditioner
    from transformers import Qwen3Config, Qwen3Model

    cfg = CONFIGS["full"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        models = {"transformer": CosmosTransformer3DModel(**cfg["transformer"]),
                  "text_conditioner": AnimaTextConditioner(**cfg["text_conditioner"]),
                  "text_encoder": Qwen3Model(Qwen3Config(**cfg["text_encoder"])),
                  "vae": AutoencoderKLQwenImage(**cfg["vae"])}
    for name, model in models.items():
        model.to(torch.bfloat16).save_pretrained(repo / name)
    del models
    torch.cuda.empty_cache()
    build_qwen_tokenizer().save_pretrained(repo / "tokenizer")
    build_t5_tokenizer().save_pretrained(repo / "t5_tokenizer")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(repo / "scheduler")


def prepare(work: Path, latents: int = 96) -> tuple[Path, Path]:
    """(repo, data) under work, built on first use: the full-size model and `latents` 1024x1024 synthetic latents
    (fewer: more epochs in a short run, as [dataset] cache_text_encoder_outputs needs to show its steady state)."""
    repo, data = work / "repo", work / ("data" if latents == 96 else f"data_{latents}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (repo / "vae").exists():
        raise SystemExit("run once on one process first: it builds the shared model repo and dataset")
    if not (repo / "vae").exists():
        build_repo(repo)
    if not data.exists():
        make_synthetic_latents(data, n=latents, latent_hw=(128, 128))  # 1024x1024 buckets, 4096 tokens
    return repo, data


def prepare_images(work: Path) -> Path:
    """48 synthetic 1536x1536 images with captions (for the encode/texture runs), built on first use."""
    from anima_train.model.tiny import make_synthetic_dataset

    images = work / "images"
    if not images.exists():
        make_synthetic_dataset(images, n=48, sizes=[(1536, 1536)], jpeg_every=0)
    return images


def run_config_text(name: str, repo: Path, data: Path, work: Path, steps: int, compile_mode: str | None,
                    resolution: int = 1024, dtype: str = "bfloat16", num_workers: int = 2,
                    checkpoint_blocks: str | None = None, previews: int = 0,
                    preview_steps: int = 20, swap_blocks: int | None = None, recompute: str | None = None,
                    base_matmul: str | None = None, text_cache: bool = False) -> tuple[str, str]:
    """(label, TOML text) of one run; bench/profile_train_gpu.py trains the same text. compile_mode None = what
    compile = "auto" picks for a long run on this device."""
    kind, batch = parse_run(name)
    if compile_mode is None:
        compile_mode = resolve_compile("auto", torch.device("cuda" if torch.cuda.is_available() else "cpu"), 10**6) \
            or "off"
    label = name + ("" if compile_mode == "off" else "_compiled") + (f"_ckpt{checkpoint_blocks}"
                                                                       if checkpoint_blocks else "") \
        + (f"_previews{previews}" if previews else "") \
        + (f"_swap{swap_blocks}" if swap_blocks is not None else "") \
        + (f"_recompute-{recompute}" if recompute else "") + (f"_base-{base_matmul}" if base_matmul else "") \
        + ("_textcache" if text_cache else "")
    extra = KINDS[kind]
    if previews:
        extra += (f'[sample]\nprompts = ["red circle, white background", "blue square, black background"]\n'
                  f'every_n_steps = {previews}\nsteps = {preview_steps}\nwidth = 1024\nheight = 1024\n')
    text = f"""
[train]
model_path = "{repo}"
output_dir = "{work / 'out'}"
run_name = "{label}"
epochs = 1000
max_steps = {steps}
batch_size = {batch}
dtype = "{dtype}"
num_workers = {num_workers}
progress = "off"
gradient_checkpointing = true
{f'checkpoint_blocks = {json.dumps(int(checkpoint_blocks) if checkpoint_blocks.isdigit() else checkpoint_blocks)}'
 if checkpoint_blocks else ''}
save_every_epochs = 0
skip_final_save = true
compile = "{compile_mode}"
{f'swap_blocks = {swap_blocks}' if swap_blocks is not None else ''}
{f'recompute = "{recompute}"' if recompute else ''}
{f'base_matmul = "{base_matmul}"' if base_matmul else ''}
[dataset]
path = "{data}"
resolution = {resolution}
{'cache_text_encoder_outputs = true' if text_cache else ''}
{extra}"""
    return label, text


def bench(name: str, repo: Path, data: Path, work: Path, steps: int, compile_mode: str | None,
          checkpoint_blocks: str | None = None, cap_gib: float | None = None, previews: int = 0,
          preview_steps: int = 20, recompute: str | None = None, base_matmul: str | None = None,
          save_adapter: Path | None = None, text_cache: bool = False) -> dict:
    name, own_blocks, swap = split_name(name)  # lora_b2:all@11: checkpoint_blocks = "all", swap_blocks = 11
    checkpoint_blocks = own_blocks or checkpoint_blocks
    kind, batch = parse_run(name)
    if kind in IMAGE_KINDS:
        data = prepare_images(work)
    label, text = run_config_text(name, repo, data, work, steps, compile_mode, checkpoint_blocks=checkpoint_blocks,
                                  previews=previews, preview_steps=preview_steps, swap_blocks=swap,
                                  recompute=recompute, base_matmul=base_matmul, text_cache=text_cache)
    events = work / f"{label}.jsonl"
    events.unlink(missing_ok=True)  # the event file appends: an earlier run's steps would skew the timing
    cfg = parse_config(text)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0, t0_wall = time.perf_counter(), time.time()
    result = train(cfg, events=str(events), no_save=True)
    wall = time.perf_counter() - t0
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    stamps = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    times = [r["time"] for r in stamps if r["event"] == "step"]  # only the main process writes events
    deltas = [b - a for a, b in zip(times, times[1:])][3:]  # skip warm-up (first steps, compile, the plan)
    med = statistics.median(deltas) if deltas else float("nan")
    trainable = sum(p.numel() for m in (result.components.transformer, result.components.text_conditioner)
                    for p in m.parameters() if p.requires_grad)
    recomputed = result.components.transformer._gradient_checkpointing_func.recomputed \
        if getattr(result.components.transformer, "gradient_checkpointing", False) else 0
    swapped = swap if swap is not None else swapped_by_auto(stamps)
    rec = dict(call=CALL, who="ours", name=label, run=name, cap_gib=cap_gib, base_matmul=base_matmul or "bf16",
               sdpa_first=SDPA_FIRST["name"], rank=rank, processes=world, batch=batch,
               steps=len(result.losses), trainable=trainable, recomputed_blocks=recomputed, swapped_blocks=swapped,
               s_per_step=round(med, 4), s_per_image=round(med / (batch * world), 4),
               images_per_s=round(batch * world / med, 2) if deltas else None,
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), digest=result.trainable_digest[:16],
               # from train() being called, as the seed's from its Trainer being built: model loading included
               first_step_s=round(times[0] - t0_wall, 1) if times else None,
               steady_s=steady_seconds(times, t0_wall), wall_s=round(wall, 1),
               start_s=next((round(r["time"] - t0_wall, 1) for r in stamps if r["event"] == "start"), None),
               first_deltas=[round(b - a, 2) for a, b in zip(times[:5], times[1:6])],
               loss_first=round(result.losses[0], 4), loss_last=round(result.losses[-1], 4),
               losses=[round(loss, 4) for loss in result.losses],
               **allocator_stats())
    if save_adapter is not None:  # the trained tensors, for an A/B of two runs (bench/compare_adapters.py)
        save_adapter.mkdir(parents=True, exist_ok=True)
        save_file({n: p.detach().float().cpu().contiguous() for n, p in result.components.transformer.named_parameters()
                   if p.requires_grad}, str(save_adapter / f"{label}.safetensors"))
        rec["adapter_file"] = str(save_adapter / f"{label}.safetensors")
    rounds = [r for r in stamps if r["event"] == "samples"]
    if rounds:
        rec.update(preview_rounds=len(rounds), preview_s=[r["seconds"] for r in rounds],
                   allocated_gib_after_round=[r.get("gpu_allocated_gib") for r in rounds])
    if COMPILE_REPORT["on"]:
        rec["compile"] = compile_report()
    print(json.dumps(rec), flush=True)
    del result
    torch.cuda.empty_cache()
    return rec


COMPILE_REPORT = {"on": False}  # --compile-report


def compile_report() -> dict:
    """torch.compile's own account of this process so far: frames compiled, recompiles, graph breaks, and seconds per
    phase (Dynamo's trace, AOT autograd, Inductor), then reset, so each run reports its own."""
    import torch._dynamo.utils as dynamo_utils

    counters = {group: dict(values) for group, values in dynamo_utils.counters.items()
                if group in ("stats", "frames", "recompiles", "graph_break", "inductor", "aot_autograd")}
    try:
        headers, values = dynamo_utils.compile_times(repr="csv", aggregate=True)
        times = {h: round(float(v), 1) for h, v in zip(headers, values) if float(v) >= 0.1}
    except Exception as exc:  # noqa: BLE001 (a private API that moves between torch versions)
        times = {"error": str(exc)[:200]}
    dynamo_utils.counters.clear()
    getattr(dynamo_utils, "compilation_time_metrics", {}).clear()
    return {"counters": {g: dict(sorted(v.items(), key=lambda kv: -kv[1])[:12]) for g, v in counters.items()},
            "seconds": dict(sorted(times.items(), key=lambda kv: -kv[1])[:15])}


CALL = os.environ.get("BENCH_CALL", "")  # one id per GPU call: rows of different calls are never compared


def steady_seconds(times: list[float], start: float) -> float | None:
    """Seconds from the start to the first step after which 5 steps in a row run within 10 % of the median step
    (after the first 3): a second compile at step 2, or a plan that settles late, shows here."""
    deltas = [b - a for a, b in zip(times, times[1:])]
    if len(deltas) < 8:
        return None
    med = statistics.median(deltas[3:])
    first = next((i for i in range(len(deltas) - 4) if all(abs(d - med) <= 0.1 * med for d in deltas[i:i + 5])), None)
    return round(times[first] - start, 1) if first is not None else None


def swapped_by_auto(stamps: list[dict]) -> int | None:
    """The blocks swap_blocks = "auto" swapped, from the run's "swap auto:" line (None: it said none, off CUDA)."""
    for record in stamps:
        text = str(record.get("text", "")) if record.get("event") == "message" else ""
        if text.startswith(SWAP_PREFIX):
            found = re.match(rf"{SWAP_PREFIX} (?:(\d+) of|every block swapped \((\d+)\))", text)
            return int(found.group(1) or found.group(2)) if found else 0
    return None


def allocator_stats() -> dict:
    """The caching allocator's counters: a retry is a failed cudaMalloc answered by freeing every cached block and
    trying again (a sync and a stall); near a memory cap, retries every step mean the plan thrashes."""
    s = torch.cuda.memory_stats()
    return dict(alloc_retries=s.get("num_alloc_retries", 0), ooms=s.get("num_ooms", 0),
                peak_reserved_gib=round(s.get("reserved_bytes.all.peak", 0) / 2**30, 2),
                alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))


def install_cpu_kernel_trace() -> None:
    """--trace-cpu-kernels: a warm start spent ~30 s in Inductor's CPU ISA check (bench/results/first_step_2026-12-06,
    call 3), which runs only where some graph of a CUDA run holds a C++ (CPU) kernel. One JSON line per C++ kernel
    loaded: the head of its source and the stack that asked for it (the graph's Python wrapper names its module), and
    the whole stack of the first ISA check, whoever asks for it."""
    import traceback

    from torch._inductor import codecache

    original = codecache.CppCodeCache.load_async.__func__

    def load_async(cls, main_code, *args, **kwargs):
        # ours, the graph's generated module (under the compile cache) and torch's compile entry points
        stack = [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                 if "site-packages" not in f.filename or "compile_fx" in f.filename or "_dynamo/eval" in f.filename]
        print(json.dumps({"diag": "cpu_kernel", "source_head": str(main_code)[:1200], "stack": stack[-12:]}),
              flush=True)
        return original(cls, main_code, *args, **kwargs)

    codecache.CppCodeCache.load_async = classmethod(load_async)

    from torch._inductor import cpu_vec_isa

    check_build = cpu_vec_isa.VecISA.check_build

    def traced_check_build(self, code):  # the ISA check itself, whoever asks for it: the whole stack, once
        if not getattr(traced_check_build, "done", False):
            traced_check_build.done = True
            print(json.dumps({"diag": "cpu_isa_check", "stack": [f"{f.filename}:{f.lineno} {f.name}"
                                                                  for f in traceback.extract_stack()[:-1]][-40:]}),
                  flush=True)
        return check_build(self, code)

    cpu_vec_isa.VecISA.check_build = traced_check_build


def install_diag() -> None:
    """--diag: one JSON line per micro-step (memory now, peaks so far, allocator retries) and one for the plan
    checkpoint_blocks = "auto" makes after the first step, with what it measured."""
    import anima_train.training.train as train_module

    loss_fn, plan_fn = train_module._flow_matching_loss, train_module.plan_checkpointing
    count = [0]

    def loss(*args, **kwargs):
        s = torch.cuda.memory_stats()
        print(json.dumps({"diag": "micro", "n": count[0], "t": round(time.perf_counter(), 3),
                          "alloc_gib": round(s.get("allocated_bytes.all.current", 0) / 2**30, 2),
                          "peak_gib": round(s.get("allocated_bytes.all.peak", 0) / 2**30, 2),
                          "reserved_gib": round(s.get("reserved_bytes.all.current", 0) / 2**30, 2),
                          "peak_reserved_gib": round(s.get("reserved_bytes.all.peak", 0) / 2**30, 2),
                          "retries": s.get("num_alloc_retries", 0), "ooms": s.get("num_ooms", 0)}), flush=True)
        count[0] += 1
        return loss_fn(*args, **kwargs)

    def plan(block_ckpt, largest_tokens, parked, device, say):
        m = block_ckpt.measure
        seen = dict(act_gib=round(m.act / 2**30, 3), tokens=m.tokens, largest_tokens=largest_tokens)

        def tell(message):
            say(message)
            print(json.dumps({"diag": "plan", "message": message, **seen}), flush=True)

        return plan_fn(block_ckpt, largest_tokens, parked, device, tell)

    train_module._flow_matching_loss, train_module.plan_checkpointing = loss, plan


def capped_python(cap_gib: float | None) -> list[str]:
    """python3 that caps its CUDA memory to cap_gib (as a card of that size would) before running the script."""
    if not cap_gib:
        return [sys.executable]
    code = ("import sys, runpy, torch; "
            f"torch.cuda.set_per_process_memory_fraction({cap_gib} * 2**30 / torch.cuda.mem_get_info()[1]); "
            "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    return [sys.executable, "-c", code]


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def run_peer(cmd: list[str], log: Path, env: dict | None = None) -> list[dict]:
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log.write_text(proc.stdout + proc.stderr)
    rows = json_lines(proc.stdout)
    for r in rows:
        print(json.dumps(r), flush=True)
    if proc.returncode:
        print(json.dumps({"peer_failed": cmd[-1], "rc": proc.returncode, "tail": proc.stderr[-1500:]}), flush=True)
    print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def baseline_rows(script: str, names: list[str], steps: int, cap_gib: float | None, work: Path) -> dict:
    """{our run name: baseline JSON} for the runs the baseline has (it checkpoints every block, eager)."""
    wanted = {}
    for n in names:
        kind, b = parse_run(n.partition(":")[0])
        if kind in BASELINE_NAMES:
            wanted[BASELINE_NAMES[kind].format(b=b)] = n
    if not wanted:
        return {}
    rows = run_peer(capped_python(cap_gib) + [script, "--steps", str(steps), "--only", ",".join(wanted)],
                    work / "baseline.log")
    return {wanted[r["name"]]: dict(r, call=CALL, who="naive", run=wanted[r["name"]], cap_gib=cap_gib)
            for r in rows if r.get("name") in wanted}


def seed_rows(bench_script: str, tar: str, repo: Path, data: Path, names: list[str], steps: int,
              compile_mode: str | None, cap_gib: float | None, work: Path) -> dict:
    """{our run name: seed JSON}: the seed's own trainer, unmodified, checkpointing every block (its default) or,
    for NAME:off, with its checkpointing switched off."""
    src = work / "seed_src"
    if not src.exists():
        with tarfile.open(tar) as t:
            t.extractall(src, filter="data")
    roots = [p.parent for p in src.glob("*/anima")] or [src]
    out = {}
    for n in names:
        kind, b = parse_run(n.partition(":")[0])
        if kind not in SEED_MODES:
            continue
        cmd = capped_python(cap_gib) + [bench_script, "--seed-src", str(roots[0]), "--repo", str(repo),
                                        "--data", str(data), "--work", str(work / "seed_work"),
                                        "--mode", SEED_MODES[kind], "--batch", str(b), "--steps", str(steps)]
        if compile_mode and compile_mode != "off":
            cmd += ["--compile", compile_mode]
        if n.endswith(":off"):  # the seed's own switch: gradient_checkpointing = false
            cmd.append("--no-grad-ckpt")
        # The seed sets expandable segments at import, before torch touches CUDA; the cap wrapper touches CUDA
        # first, so hand it the same setting through the environment, as a user's run of the seed has it.
        env = dict(os.environ)
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        rows = run_peer(cmd, work / f"seed_{n.replace(':', '_')}.log", env)
        if rows:
            out[n] = dict(rows[-1], call=CALL, who="seed", run=n, cap_gib=cap_gib, base_matmul="bf16")
            print(json.dumps(out[n]), flush=True)  # the row as compared, with the call's fields
    return out


def set_torch_config(item: str) -> None:
    """MODULE.ATTR=VALUE (VALUE a Python literal) on an importable torch config module; printed with the run."""
    import ast
    import importlib

    target, _, text = item.partition("=")
    module_name, _, attr = target.rpartition(".")
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise SystemExit(f"--torch-set: {module_name} has no {attr}")
    setattr(module, attr, ast.literal_eval(text))
    print(json.dumps({"torch_set": target, "value": getattr(module, attr)}), flush=True)


SDPA_FIRST = {"name": None}  # what --sdpa-first put first, for each row of ours


def set_sdpa_first(name: str) -> None:
    """Process-wide, before anything traces: a compiled graph takes the kernel that was first when it was traced."""
    from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends, _sdpa_kernel

    first = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]
    order = [first] + [b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH) if b != first]
    _sdpa_kernel(order, set_priority=True)
    SDPA_FIRST["name"] = name
    print(json.dumps({"sdpa_order": [b.name for b in _cur_sdpa_kernel_backends(with_priority=True)]}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/anima-bench")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--only", default="lora_b8,full_b4", help="runs: lora_bN, full_bN, full8bit_bN, fullkahan_bN")
    ap.add_argument("--compile", default=None, help="our train.compile (default: what compile = \"auto\" picks)")
    ap.add_argument("--checkpoint-blocks", default=None, help="our train.checkpoint_blocks (default: auto)")
    ap.add_argument("--recompute", default=None, choices=("block", "graph"),
                    help="our train.recompute (default: the config's default): block = torch.utils.checkpoint, "
                         "graph = inside the compiled backward")
    ap.add_argument("--base-matmul", default=None, choices=("bf16", "fp8"),
                    help="our train.base_matmul (default: the config's default, bf16)")
    ap.add_argument("--save-adapter", default=None, metavar="DIR",
                    help="write each of our runs' trained tensors to DIR/<run>.safetensors (for an A/B)")
    ap.add_argument("--cap-gib", type=float, default=None, help="cap every process's CUDA memory to this many GiB")
    ap.add_argument("--baseline", default=None, help="gpu_baseline.py: run it in this call (same steps and cap)")
    ap.add_argument("--seed-bench", default=None, help="seed_bench.py: run the seed in this call (needs --seed-tar)")
    ap.add_argument("--seed-tar", default=None, help="the seed's source tarball (a glob is fine)")
    ap.add_argument("--seed-only", default=None, help="runs for the seed (default: --only)")
    ap.add_argument("--seed-compile", default="default", help="the seed's compile mode (off = eager)")
    ap.add_argument("--twice", action="store_true", help="run ours twice: the second first step is warm-compiled")
    ap.add_argument("--torch-set", action="append", default=[], metavar="MODULE.ATTR=VALUE",
                    help="set a torch config for our runs, after the trainer's own (experiments), e.g. "
                         "torch._functorch.config.activation_memory_budget=0.5 or "
                         "torch._inductor.config.coordinate_descent_tuning=True")
    ap.add_argument("--compile-report", action="store_true",
                    help="add torch.compile's counters and seconds per phase to each of our rows")
    ap.add_argument("--text-cache", action="store_true",
                    help="our runs keep Qwen3's outputs per caption ([dataset] cache_text_encoder_outputs)")
    ap.add_argument("--latents", type=int, default=96,
                    help="synthetic 1024x1024 latents in the dataset (default 96; fewer: more epochs per run)")
    ap.add_argument("--diag", action="store_true", help="print memory and allocator counters every micro-step")
    ap.add_argument("--trace-cpu-kernels", action="store_true",
                    help="print each C++ (CPU) kernel Inductor loads, with the stack that asked for it")
    ap.add_argument("--previews", type=int, default=0, metavar="N",
                    help="add a [sample] table: 2 previews at 1024x1024 every N steps and at the end")
    ap.add_argument("--preview-steps", type=int, default=20, help="Euler steps per preview (default 20)")
    ap.add_argument("--sdpa-first", default=None, choices=("cudnn", "flash", "efficient"),
                    help="put this attention kernel first in torch's order for the whole process (an experiment: "
                         "torch 2.11 picks cuDNN's on Hopper by itself; Inductor's cache does not key on the order, "
                         "so give each setting its own TORCHINDUCTOR_CACHE_DIR)")
    args = ap.parse_args()
    if args.sdpa_first:
        set_sdpa_first(args.sdpa_first)
    work = Path(args.work)
    t0 = time.perf_counter()
    repo, data = prepare(work, args.latents)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "setup_s": round(time.perf_counter() - t0, 1), "cap_gib": args.cap_gib}), flush=True)
    names = args.only.split(",")
    for n in names:
        split_name(n)
    if args.diag:
        install_diag()
    if args.trace_cpu_kernels:
        install_cpu_kernel_trace()
    COMPILE_REPORT["on"] = args.compile_report
    if args.torch_set:  # after the trainer's own compile settings (compile_transformer), so that these win
        import anima_train.training.train as train_module

        compile_transformer = train_module.compile_transformer

        def compile_then_set(*a, **kw):
            compile_transformer(*a, **kw)
            for item in args.torch_set:
                set_torch_config(item)

        train_module.compile_transformer = compile_then_set
        for item in args.torch_set:  # checked (and printed) before anything runs
            set_torch_config(item)
    if args.cap_gib:
        torch.cuda.set_per_process_memory_fraction(args.cap_gib * 2**30 / torch.cuda.mem_get_info()[1])
    ours = []
    for name in names:
        for attempt in range(2 if args.twice else 1):
            try:
                ours.append(bench(name, repo, data, work, args.steps, args.compile, args.checkpoint_blocks,
                                  args.cap_gib, args.previews, args.preview_steps, args.recompute,
                                  args.base_matmul, Path(args.save_adapter) if args.save_adapter else None,
                                  args.text_cache))
            except Exception as exc:  # report and go on with the next configuration
                print(json.dumps({"name": name, "error": f"{type(exc).__name__}: {exc}"[:2000]}), flush=True)
                torch.cuda.empty_cache()
    torch.cuda.empty_cache()  # ours first: the peers run in their own processes after it
    naive = baseline_rows(args.baseline, names, args.steps, args.cap_gib, work) if args.baseline else {}
    seed = {}
    if args.seed_bench:
        tar = sorted(glob.glob(args.seed_tar or ""))
        if not tar:
            raise SystemExit("--seed-bench needs --seed-tar (the seed's source tarball)")
        seed = seed_rows(args.seed_bench, tar[-1], repo, data, (args.seed_only or args.only).split(","),
                         args.steps, args.seed_compile, args.cap_gib, work)
    print(f"\n{'run':<16}{'who':<7}{'batch':>6}{'s/image':>10}{'peakGiB':>9}{'1st step s':>11}"
          f"{'seed/ours':>10}{'naive/ours':>11}")
    for r in ours:
        sd, nv = seed.get(r["run"]), naive.get(r["run"])
        for row in [x for x in (nv, sd) if x]:
            print(f"{row['name'][:16]:<16}{row['who']:<7}{row['batch']:>6}{row['s_per_image']:>10.4f}"
                  f"{row.get('peak_gib') or 0:>9.1f}{row.get('first_step_s') or 0:>11.1f}")
        print(f"{r['name'][:16]:<16}{'ours':<7}{r['batch']:>6}{r['s_per_image']:>10.4f}{r['peak_gib']:>9.1f}"
              f"{r['first_step_s'] or 0:>11.1f}"
              f"{(sd['s_per_image'] / r['s_per_image']) if sd else float('nan'):>10.2f}"
              f"{(nv['s_per_image'] / r['s_per_image']) if nv else float('nan'):>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
