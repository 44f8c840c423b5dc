"""Profile a few optimizer steps of the real trainer (`anima_train.training.train.train`) with torch.profiler.

Same model, data and TOML as bench/bench_train_gpu.py (full-size random Anima, synthetic 1024x1024 latents, bf16,
gradient checkpointing). The profiler schedule advances once per optimizer step (wrapped `Progress.step`), skips
`--wait` steps (the first step, compile), warms up one and records `--steps`.

    python3 bench/profile_train_gpu.py --run lora_b8 [--compile default] --steps 3 --work /tmp/bench --out DIR
    python3 bench/profile_train_gpu.py --tiny --steps 6 --out /tmp/prof     # CPU smoke run on the tiny model

Several profiles can share one GPU (`--turn DIR:I:N`, one process each): they compile side by side, which is most
of a cold run's time, and then take the profiled window one at a time, so no window overlaps another's work.

Writes into --out: `<label>_ops.txt` (key_averages, top 40 by self CUDA time), `<label>_summary.json` (printed too)
and `<label>_trace.json.gz` (chrome trace, only when it is under 16 MB compressed).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anima_train.config import parse_config  # noqa: E402
from anima_train.outputs.progress import Progress  # noqa: E402
from anima_train.data.synthetic import make_synthetic_latents  # noqa: E402
from anima_train.model.tiny import build_tiny_anima  # noqa: E402
from anima_train.training.train import train  # noqa: E402
from bench.bench_train_gpu import parse_run, prepare, run_config_text, split_name  # noqa: E402

TRACE_LIMIT = 16 * 2**20
HOST_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
SCALAR_READS = ("aten::_local_scalar_dense",)  # .item(), float(tensor), bool(tensor) on a device tensor


def kernel_group(name: str) -> str:
    """Coarse bucket of a device kernel by its name (order matters: the first match wins)."""
    n = name.lower()
    if n.startswith("memcpy"):
        return "memcpy_" + ("htod" if "htod" in n else "dtoh" if "dtoh" in n else "other")
    if n.startswith("memset"):
        return "memset"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "efficient", "cudnn_attn")):
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "wgmma")):
        return "matmul"
    # 'fused' alone also names Inductor's triton kernels (triton_poi_fused_...), which are elementwise/norm work
    if any(k in n for k in ("adam", "foreach", "multi_tensor")) or ("fused" in n and not n.startswith("triton")):
        return "optimizer"
    return "elementwise_norm_other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: time the device was busy with at least one kernel."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def summarise(prof, active: int, cuda: bool) -> dict:
    events = list(prof.events())
    # "ProfilerStep*" (name) / "#N" (trace_name); on CUDA each step also has a GPU-side span of the same name
    steps = [e for e in events if e.name.startswith("ProfilerStep") and e.device_type == DeviceType.CPU]
    if len(steps) != active:
        raise SystemExit(f"expected {active} ProfilerStep spans in the window, got {len(steps)}")
    wall_us = sum(e.time_range.elapsed_us() for e in steps)
    n = active
    # kernels only: GPU-side spans of annotations (ProfilerStep#N, Inductor's named graph kernels' record_function
    # twins) have device_type CUDA too, and counting them doubled the elementwise share in the first profile
    device = [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
              and not e.name.startswith("ProfilerStep")]
    groups: dict[str, float] = {}
    for e in device:
        g = kernel_group(e.name)
        groups[g] = groups.get(g, 0.0) + e.time_range.elapsed_us()
    kernel_sum = sum(groups.values())
    busy = union_us([(e.time_range.start, e.time_range.end) for e in device])
    syncs = sum(1 for e in events if e.name in HOST_SYNCS)
    scalar_events = [e for e in events if e.name in SCALAR_READS]
    scalars = len(scalar_events)
    callers: dict[str, int] = {}  # who reads scalars: the nearest enclosing op that is not item/scalar plumbing
    for e in scalar_events:
        parent = e.cpu_parent
        while parent is not None and parent.name in ("aten::item", "aten::_local_scalar_dense"):
            parent = parent.cpu_parent
        key = parent.name if parent is not None else "(top level: python float()/item())"
        callers[key] = callers.get(key, 0) + 1
    cpu_ops = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
    rec = dict(
        profiled_steps=len(steps), device=torch.cuda.get_device_name() if cuda else "cpu",
        wall_ms_per_step=round(wall_us / n / 1e3, 2),
        cuda_kernel_ms_per_step=round(kernel_sum / n / 1e3, 2),  # sum of kernel durations (streams may overlap)
        cuda_busy_ms_per_step=round(busy / n / 1e3, 2),  # union of kernel intervals
        host_bound_gap_ms_per_step=round((wall_us - busy) / n / 1e3, 2) if cuda else None,
        cuda_busy_share_of_wall=round(busy / wall_us, 3) if cuda and wall_us else None,
        group_ms_per_step={g: round(v / n / 1e3, 2) for g, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        group_share={g: round(v / kernel_sum, 3) for g, v in sorted(groups.items(), key=lambda kv: -kv[1])}
        if kernel_sum else {},
        kernels_per_step=round(len(device) / n, 1),
        aten_ops_per_step=round(len(cpu_ops) / n, 1),
        host_syncs_per_step=round(syncs / n, 2),  # cuda{Stream,Device,Event}Synchronize calls
        scalar_reads_per_step=round(scalars / n, 2),  # aten::_local_scalar_dense (.item() / float(t))
        scalar_read_callers_per_step={k: round(v / n, 2)
                                      for k, v in sorted(callers.items(), key=lambda kv: -kv[1])[:10]},
    )
    return rec


class Turns:
    """N processes on one GPU take their profiled windows in turn, ordered by I. Each marks `ready_I` in DIR when its
    window is next, waits until all N are ready or ended and 0..I-1 have ended, and marks `ended_I` when it stops
    (also on failure). A process killed from outside marks nothing: the others go on after `timeout_s`."""

    def __init__(self, spec: str, timeout_s: float):
        folder, i, n = spec.rsplit(":", 2)
        self.dir, self.i, self.n, self.timeout_s = Path(folder), int(i), int(n), timeout_s
        self.dir.mkdir(parents=True, exist_ok=True)

    def _marked(self, what: str) -> set[int]:
        return {int(p.name.rsplit("_", 1)[1]) for p in self.dir.glob(f"{what}_*")}

    def wait(self) -> float:
        (self.dir / f"ready_{self.i}").touch()
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.timeout_s:
            ended = self._marked("ended")
            if len(self._marked("ready") | ended) >= self.n and ended >= set(range(self.i)):
                break
            time.sleep(0.2)
        return round(time.monotonic() - t0, 1)

    def end(self) -> None:
        (self.dir / f"ended_{self.i}").touch()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="lora_b8",
                    help="lora_bN, full_bN, full8bit_bN or fullkahan_bN; NAME:BLOCKS with that checkpoint_blocks, "
                         "NAME@K with swap_blocks = K")
    ap.add_argument("--cap-gib", type=float, default=None, help="cap this process's CUDA memory to this many GiB")
    ap.add_argument("--checkpoint-blocks", default=None, help="train.checkpoint_blocks (default: auto)")
    ap.add_argument("--compile", default=None, help="train.compile = MODE (e.g. default)")
    ap.add_argument("--recompute", default=None, choices=("block", "graph"), help="train.recompute (default: graph)")
    ap.add_argument("--base-matmul", default=None, choices=("bf16", "fp8"), help="train.base_matmul (default: bf16)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps recorded (the profiler's active window)")
    ap.add_argument("--wait", type=int, default=None,
                    help="steps skipped before the one warm-up step (default 3 eager, 4 compiled)")
    ap.add_argument("--work", default="/tmp/anima-bench", help="model repo + dataset (shared with bench_train_gpu)")
    ap.add_argument("--out", required=True, help="folder for the table, summary and trace")
    ap.add_argument("--no-trace", action="store_true", help="skip the chrome trace")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test of this script)")
    ap.add_argument("--turn", default=None, metavar="DIR:I:N",
                    help="profile I of N sharing this GPU: take the window in turn (see the module's docstring)")
    ap.add_argument("--turn-timeout", type=float, default=300.0, help="the longest wait for a turn, seconds")
    args = ap.parse_args()
    turns = Turns(args.turn, args.turn_timeout) if args.turn else None
    try:
        return profile_run(args, turns)
    finally:
        if turns:
            turns.end()


def profile_run(args: argparse.Namespace, turns: Turns | None) -> int:
    run, own_blocks, swap = split_name(args.run)
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = not args.tiny
    wait = args.wait if args.wait is not None else (4 if args.compile else 3)
    total = wait + 1 + args.steps + 1  # one spare step so the trainer is still running when the window closes
    t0 = time.perf_counter()
    if args.tiny:
        work = work / "tiny"
        repo, data = work / "repo" / "diffusers", work / "data"
        if not repo.exists():
            build_tiny_anima(work / "repo")
        if not data.exists():
            make_synthetic_latents(data, n=16, latent_hw=(16, 16))  # 128x128 buckets
        label, text = run_config_text(run, repo, data, work, total, args.compile, resolution=128,
                                      dtype="float32", num_workers=0, recompute=args.recompute,
                                      base_matmul=args.base_matmul)
    else:
        repo, data = prepare(work)
        label, text = run_config_text(run, repo, data, work, total, args.compile,
                                      checkpoint_blocks=own_blocks or args.checkpoint_blocks, swap_blocks=swap,
                                      recompute=args.recompute, base_matmul=args.base_matmul)
        if args.cap_gib:
            torch.cuda.set_per_process_memory_fraction(args.cap_gib * 2**30 / torch.cuda.mem_get_info()[1])
    setup_s = round(time.perf_counter() - t0, 1)
    cfg = parse_config(text)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort_key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    summary: dict = {}

    def on_ready(prof) -> None:  # called once, when the active window closes
        (out / f"{label}_ops.txt").write_text(prof.key_averages().table(sort_by=sort_key, row_limit=40,
                                                                         max_name_column_width=90))
        if cuda:  # where the host's time goes (a host-bound step: the device waits for it)
            (out / f"{label}_cpu_ops.txt").write_text(prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90))
        summary.update(summarise(prof, args.steps, cuda))
        if args.no_trace:
            return
        raw = work / f"{label}_trace.json"
        prof.export_chrome_trace(str(raw))
        packed = out / f"{label}_trace.json.gz"
        with raw.open("rb") as src, gzip.open(packed, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        summary["trace_mb"] = round(packed.stat().st_size / 2**20, 1)
        if packed.stat().st_size > TRACE_LIMIT:
            packed.unlink()
            summary["trace_mb"] = f"{summary['trace_mb']} (over 16 MB: not kept)"

    prof = profile(activities=activities, schedule=schedule(wait=wait, warmup=1, active=args.steps, repeat=1),
                   on_trace_ready=on_ready)
    original_step = Progress.step

    waited, losses = [None], []  # losses: one per optimizer step done

    def step_then_advance(self, stats, **kw):  # one profiler step per optimizer step
        original_step(self, stats, **kw)
        losses.append(stats.loss)
        if turns and len(losses) == wait:  # the next step starts the profiler's warm-up
            waited[0] = turns.wait()
        prof.step()

    Progress.step = step_then_advance
    t1 = time.perf_counter()
    try:
        with prof:
            result = train(cfg, cpu=not cuda, no_save=True)
    finally:
        Progress.step = original_step
    summary = dict(name=label, run=args.run, cap_gib=args.cap_gib, compile=args.compile, batch=parse_run(run)[1],
                   tiny=args.tiny, torch=torch.__version__, setup_s=setup_s,
                   train_wall_s=round(time.perf_counter() - t1, 1),
                   steps_trained=result.global_step, wait=wait, turn_wait_s=waited[0],
                   emulate_precision_casts=torch._inductor.config.emulate_precision_casts,
                   recompute=args.recompute, base_matmul=args.base_matmul,
                   losses=[round(x, 6) if x is not None else None for x in losses],
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None, **summary)
    if "profiled_steps" not in summary:
        raise SystemExit(f"the profiler window never closed: {result.global_step} steps trained, "
                         f"{wait + 1 + args.steps} needed")
    (out / f"{label}_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
