"""DDP on CPU: 2 processes (gloo) through torchrun + Accelerate, on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from anima_train.data.batches import steps_per_epoch
from anima_train.data.synthetic import make_synthetic_latents
from tests.fixtures_tiny import small_run_toml, torchrun

ROOT = Path(__file__).resolve().parents[1]


def test_steps_per_epoch_worked_example():
    # 113 images, micro-batch 12, accumulation 2, 2 processes: 10 batches -> 5 per rank -> 3 optimizer steps
    assert steps_per_epoch(-(-113 // 12), num_processes=2, accum=2) == 3
    assert steps_per_epoch(10, 1, 1) == 10 and steps_per_epoch(10, 2, 1) == 5 and steps_per_epoch(1, 2, 2) == 1


@pytest.mark.slow
def test_two_processes_keep_identical_adapters_on_different_data(tiny_anima, tmp_path):
    data, held_out = tmp_path / "data", tmp_path / "held_out"
    make_synthetic_latents(data, n=20, seed=3)
    make_synthetic_latents(held_out, n=3, seed=4)
    cfg = tmp_path / "ddp.toml"
    cfg.write_text(small_run_toml(tiny_anima.diffusers_dir, data, tmp_path / "out",
                                  train="epochs = 2\nbatch_size = 4\ngradient_accumulation_steps = 2",
                                  tables=f'[optimizer]\nlr = 1e-2\n[validation]\nfolder = "{held_out}"\n'
                                         f"every_n_steps = 2\n"))
    args = [ROOT / "tests" / "ddp_worker.py", cfg, tmp_path, "save"]
    out = torchrun(args, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = tmp_path / "out" / "anima"
    assert (run_dir / "anima.safetensors").is_file()  # the main process held the folder lock...
    assert not (run_dir / ".anima-train.lock").exists()  # ...and released it at the end
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # 20 samples / batch 4 = 5 batches -> 3 per rank (Accelerate pads the odd one) -> ceil(3/2) = 2 steps per epoch
    assert r0["steps"] == r1["steps"] == 2 * steps_per_epoch(5, 2, 2) == 4
    assert r0["batches"] != r1["batches"]  # each rank trained on different samples...
    assert r0["digest"] == r1["digest"]  # ...and the gradient all-reduce kept the adapters bit-identical
    assert r0["losses"] == r1["losses"]  # the logged loss is the mean over ranks
    # [validation]: every rank evaluates the same weights, so the numbers agree; only rank 0 reports them
    assert [p[0] for p in r0["validation"]] == [0, 2, 4] and r0["validation"] == r1["validation"]
    assert out.stdout.count("validation step 2: loss ") == 1 and out.stdout.count("validation loss ") == 1

    # the same command again is a fresh run into a folder holding that run: every rank refuses, nothing hangs
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()}
    for r in (0, 1):
        (tmp_path / f"rank{r}.json").unlink()
    again = torchrun(args, cwd=ROOT, timeout=300)
    assert again.returncode != 0
    refused = [json.loads((tmp_path / f"rank{r}.json").read_text())["refused"] for r in (0, 1)]
    assert refused[0] == refused[1] and f"{run_dir} already holds a run named 'anima'" in refused[0]
    assert {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()} == before


@pytest.mark.slow
def test_a_stop_asked_by_one_rank_stops_both_at_the_same_step(tiny_anima, tmp_path):
    # only rank 0 sees a stop file (created while it reports step 2); its vote travels with the next step's loss
    # (one gather, no extra host sync), so both ranks stop after the same step, save once and exit: no rank is left
    # waiting in a collective (a rank-local check would hang rank 1 or stop the ranks apart)
    data = tmp_path / "data"
    make_synthetic_latents(data, n=24, seed=3)
    cfg = tmp_path / "ddp.toml"
    cfg.write_text(small_run_toml(tiny_anima.diffusers_dir, data, tmp_path / "out",
                                  train="epochs = 10\nbatch_size = 2\nsave_optimizer_state = true"))
    out = torchrun([ROOT / "tests" / "ddp_worker.py", cfg, tmp_path, "save", "stop"], cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["stopped"] and r1["stopped"]
    assert r0["steps"] == r1["steps"] and r0["steps"] in (2, 3)  # at most one step after the request
    assert r0["losses"] == r1["losses"] and r0["digest"] == r1["digest"]
    step = r0["steps"]
    run_dir = tmp_path / "out" / "anima"
    assert r0["saved"] == [str(run_dir / f"anima-step{step:06d}.safetensors")]
    assert (run_dir / f"anima-step{step:06d}-state" / "state.json").is_file()
    assert not (run_dir / "anima.safetensors").exists()  # stopped: no final file


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw", "adamw8bit"])
def test_a_bf16_full_finetune_with_kahan_keeps_the_ranks_identical(kind, tiny_anima, tmp_path):
    # use_kahan writes bf16 through stochastic rounding: ranks that draw different noise (their global generators
    # are seeded seed + rank) round the same all-reduced update differently, and their weights drift apart
    data = tmp_path / "data"
    make_synthetic_latents(data, n=8, seed=3)
    text = small_run_toml(tiny_anima.diffusers_dir, data, tmp_path / "out",
                          train="epochs = 2\nmax_steps = 3\nbatch_size = 2",
                          tables=f'[optimizer]\nkind = "{kind}"\nlr = 1e-4\nuse_kahan = true\n')
    text = text.replace('dtype = "float32"', 'dtype = "bfloat16"').replace("rank = 4\nalpha = 4.0\n", 'kind = "none"\n')
    cfg = tmp_path / "kahan.toml"
    cfg.write_text(text)
    out = torchrun([ROOT / "tests" / "ddp_worker.py", cfg, tmp_path], cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["steps"] == r1["steps"] == 3
    assert r0["digest"] == r1["digest"]


@pytest.mark.slow
def test_two_processes_with_swapped_blocks_keep_identical_adapters(tiny_anima, tmp_path):
    """[train] swap_blocks under DDP: DDP's start-up broadcast of the module's state meets the swapped blocks'
    empty placeholders on every rank; the ranks still train the same adapter."""
    data = tmp_path / "data"
    make_synthetic_latents(data, n=8, seed=3)
    cfg = tmp_path / "swap.toml"
    text = small_run_toml(tiny_anima.diffusers_dir, data, tmp_path / "out", train="max_steps = 2\nbatch_size = 2\n"
                          "swap_blocks = 2", tables='[optimizer]\nlr = 1e-2\n')
    cfg.write_text(text.replace("gradient_checkpointing = false", "gradient_checkpointing = true"))
    out = torchrun([ROOT / "tests" / "ddp_worker.py", cfg, tmp_path, "save"], cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "2 of 2 DiT blocks swapped" in out.stdout + out.stderr
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["steps"] == r1["steps"] == 2
    assert r0["digest"] == r1["digest"] and r0["losses"] == r1["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("base", ["bf16", "fp8"])
def test_two_processes_in_bf16_keep_identical_adapters(base, tiny_anima, tmp_path):
    """dtype = "bfloat16" (the default) under DDP: the fp32 masters are made before DDP broadcasts rank 0's
    parameters, so each rank must build the same adapter; they did not (the ranks seeded peft's initialisation with
    seed + rank), and the ranks' LoRA weights differed after one step while every float32 test passed.
    base_matmul = "fp8": the FP8 copies are buffers, which DDP would broadcast at start-up (gloo has no float8 type:
    "Invalid scalar type") and before every forward."""
    data = tmp_path / "data"
    make_synthetic_latents(data, n=8, seed=3)
    cfg = tmp_path / "bf16.toml"
    text = small_run_toml(tiny_anima.diffusers_dir, data, tmp_path / "out", train="max_steps = 2\nbatch_size = 2\n"
                          f'base_matmul = "{base}"', tables='[optimizer]\nlr = 1e-2\n')
    cfg.write_text(text.replace('dtype = "float32"', 'dtype = "bfloat16"'))
    out = torchrun([ROOT / "tests" / "ddp_worker.py", cfg, tmp_path, "save"], cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert ("multiply in FP8" in out.stdout + out.stderr) == (base == "fp8")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["steps"] == r1["steps"] == 2
    assert r0["digest"] == r1["digest"] and r0["losses"] == r1["losses"]
