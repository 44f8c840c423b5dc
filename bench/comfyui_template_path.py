"""The LoRA template's path (example_workflows/, the one with the Train node) through a real ComfyUI server, over its
API: random weights written as ComfyUI single files -> Convert -> Train (the worker) -> Load trained LoRA -> KSampler.
The template samples through ComfyUI's CLIPLoader, which loads a full-size Qwen3 only: --size comfy needs one there.

    python bench/comfyui_template_path.py --comfy-root DIR --out DIR [--size comfy|full] [--python PY] [--cpu]

--size comfy: the small ComfyUI-loadable model of anima_train.model.tiny (CPU rehearsal, 64 px, 6 steps);
--size full:  the full-size configs (CONFIGS["full"]: 2B DiT, Qwen3-0.6B, Wan2.1 VAE) in bf16, 1024 px,
              LoRA r32, 50 steps. Tokenizers are the tiny ones of anima_train.model.tiny (no download).
Records, under --out: server.log, timeline.json (every /system_stats + nvidia-smi sample with the progress phase),
summary.json (times, VRAM before/during/after, worker s/step), and the two sampled images.
Uses the websocket/graph helpers of tests/test_comfyui_pack.py. Nothing is written into the ComfyUI checkout.

The Train node against `anima-train train` (issue #45, point 1): --variants queues the template once per variant
(plain; previews = an extra_toml [sample] table), and after each prompt --cli runs the trainer from the shell on the
very TOML the node wrote (comfyui-job.toml, only run_name changed), in the same call on the same GPU, once per
environment: `plain` = a shell's, `comfy-env` = the environment the node's worker got (read from /proc), `comfy-alloc`
= a shell's plus the allocator ComfyUI sets for itself (backend:cudaMallocAsync), which the worker inherited before
nodes/worker.without_comfy_allocator. Later variants run the first environment only. ComfyUI's models are freed (/free)
before each CLI run, as Train frees them for its worker. Every run is one JSON line in rows.jsonl: call, who
(comfyui/ours), run, cap_gib, base_matmul, s_per_step/s_per_image (median step-to-step delta after the first 3 steps,
from the trainer's own event times), first_step_s (queue or command to the first step), steady_s (to the first step
after which 5 steps in a row run within 10 % of that median).

The warm start (issue #45, point 2b): `--variants plain,plain#2` queues the same template twice (the second run starts
in the worker the first left waiting); `--pause S` waits between them as a user looking at the result would;
`--restart` stops ComfyUI and starts it again before each later prompt, on the same folders; `--worker-ahead S` asks
for the next run's worker before each prompt as the page does when a training workflow opens, then waits S seconds.
"""
from __future__ import annotations

import argparse, json, os, shutil, signal, statistics, subprocess, sys, threading, time, uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.bench_train_gpu import steady_seconds  # noqa: E402  (the bench's statistic, not a copy)
from nodes.worker import ALLOC_VARIABLES, COMFY_ALLOCATOR  # noqa: E402
from tests.test_comfyui_pack import (TRAIN_TEMPLATE, Messages, _free_port, _get, _post, finished,  # noqa: E402
                                     load_workflow, progress_events, set_widgets, to_api, PACK_NAME)


def build_models(work: Path, size: str):
    from anima_train.model import tiny
    if size == "full":  # the full configs through the same writer (diffusers repo + native ComfyUI files)
        tiny.CONFIGS["comfy"] = tiny.CONFIGS["full"]
        orig = tiny.build_qwen_tokenizer
        tiny.build_qwen_tokenizer = lambda vocab_size=300: orig(300)
    return tiny.build_tiny_anima(work / "models_src", size="comfy")


def nvsmi() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return {int(p): int(m) for p, m in (l.split(",") for l in out.strip().splitlines() if l.strip())}
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return {}


def step_stats(events: list[dict], started: float) -> dict:
    """The bench's statistics from one run's events (their `time` is the trainer's wall clock)."""
    times = [e["time"] for e in events if e.get("event") == "step" and isinstance(e.get("time"), (int, float))]
    deltas = [b - a for a, b in zip(times, times[1:])]
    if len(deltas) < 4:
        return {"steps": len(times), "s_per_step": None}
    med = statistics.median(deltas[3:])
    return {"steps": len(times), "s_per_step": round(med, 4), "first_step_s": round(times[0] - started, 1),
            "steady_s": steady_seconds(times, started),
            "wall_to_last_step_s": round(times[-1] - started, 1)}


def _said(event: dict) -> str:
    """A trainer event's text, shortened for a timeline."""
    return str(event.get("text") or event.get("message") or "")[:120]


def queue_timeline(msgs, since: int, queued: float) -> list[list]:
    """Where the time from queue to the first step went: seconds after queueing of each websocket message of the
    prompt (ComfyUI's `executing` per node, the trainer's events other than steps; the first step closes it)."""
    with msgs.lock:
        items = msgs.items[since:]
    out = []
    for t, m in items:
        kind, data = m.get("type"), m.get("data") or {}
        if kind == "executing":
            out.append([round(t - queued, 2), "executing", data.get("node")])
        elif kind == "anima_train.progress":
            what = data.get("event")
            out.append([round(t - queued, 2), what, _said(data)])
            if what == "step":
                break
    return out


def event_timeline(events: list[dict], started: float) -> list[list]:
    """The same from a CLI run's own events (their `time`, seconds after the command started)."""
    out = []
    for e in events:
        if isinstance(e.get("time"), (int, float)):
            out.append([round(e["time"] - started, 2), e.get("event"), _said(e)])
        if e.get("event") == "step":
            break
    return out


def read_worker_env(into: dict, summary: dict) -> None:
    """The environment of the node's running worker (`... anima_train train .../comfyui-job.toml`, or a worker
    started ahead, `... anima_train.standby`, running in a run folder), from /proc."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            started = b"anima_train" in cmd and any(x.endswith(b"comfyui-job.toml") for x in cmd)
            if not (started or b"anima_train.standby" in cmd and (proc / "cwd" / "comfyui-job.toml").is_file()):
                continue
            raw = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        into.update(dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x))
        summary["worker_env"] = {k: v for k, v in into.items()
                                 if k.startswith(("PYTORCH", "CUDA", "TORCH", "OMP", "ANIMA", "MIMALLOC"))}
        return


def cli_run(python: str, job_toml: Path, name: str, env: dict, log: Path) -> tuple[list[dict], float, int]:
    """`anima-train train` on a copy of the node's job TOML (run_name changed): (events, start time, exit code)."""
    text = job_toml.read_text(encoding="utf-8")
    lines = [f'run_name = "{name}"' if line.startswith("run_name = ") else line for line in text.splitlines()]
    assert any(line == f'run_name = "{name}"' for line in lines), "the job TOML has no top-level-table run_name line"
    copy = job_toml.parent.parent / f"{name}.toml"
    copy.write_text("\n".join(lines) + "\n", encoding="utf-8")
    events = copy.with_suffix(".events.jsonl")
    started = time.time()
    with open(log, "w") as f:
        rc = subprocess.run([python, "-m", "anima_train", "train", str(copy), "--events", str(events)], cwd=str(ROOT),
                            env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    rows = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    return rows, started, rc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--comfy-root", required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=None)
    ap.add_argument("--size", choices=["comfy", "full"], default="comfy")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--preload", action="store_true",
                    help="first queue the base-image branch alone (ComfyUI loads its models), then the whole graph")
    ap.add_argument("--front-end-root", default=None, help="a folder with an index.html (API-only server)")
    ap.add_argument("--images", type=int, default=None, help="dataset size (default 8 full, 4 comfy)")
    ap.add_argument("--steps", type=int, default=None, help="max_steps (default 50 full, 6 comfy)")
    ap.add_argument("--variants", default="plain", help="comma list of plain, previews, validation: one prompt each "
                                                        "(NAME#2: the same again)")
    ap.add_argument("--cli", default="", help="after the first prompt, anima-train train on the node's TOML: comma "
                                              "list of plain, comfy-env, comfy-alloc (later prompts: the first only)")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds between one prompt's end and the next queue "
                                                               "(a user looking at the result before queueing again)")
    ap.add_argument("--call", default=os.environ.get("BENCH_CALL", ""), help="this GPU call's id (rows' `call`)")
    ap.add_argument("--restart", action="store_true", help="before each prompt after the first, stop ComfyUI and "
                    "start it again on the same folders (a user's restart: the converted repo is re-used)")
    ap.add_argument("--worker-ahead", type=float, default=None, metavar="S",
                    help="before each prompt, ask for the next run's worker as the page does when a Train node "
                         "appears (POST /anima_train/worker_ahead), then wait S seconds (a user setting widgets)")
    a = ap.parse_args()
    out = Path(a.out); out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work or out / "work"); work.mkdir(parents=True, exist_ok=True)
    summary: dict = {"size": a.size}
    S = time.perf_counter()
    def save():
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    def say(*x):
        print(f"[{time.perf_counter() - S:7.1f} s]", *x, flush=True)

    t = time.perf_counter(); m = build_models(work, a.size); summary["build_s"] = round(time.perf_counter() - t, 1)
    say("models built", summary["build_s"]); save()
    from anima_train.model.tiny import make_synthetic_dataset
    base = work / "comfy_base"; models = base / "models"
    for folder, name, src in [("diffusion_models", "anima.safetensors", m.anima_file),
                              ("text_encoders", "qwen3.safetensors", m.qwen3_file),
                              ("vae", "vae.safetensors", m.vae_file)]:
        (models / folder).mkdir(parents=True, exist_ok=True)
        (models / folder / name).symlink_to(src)
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / PACK_NAME).symlink_to(ROOT, target_is_directory=True)
    res = 1024 if a.size == "full" else 64
    dataset = base / "input" / "dataset"
    make_synthetic_dataset(dataset, n=a.images or (8 if a.size == "full" else 4), sizes=[(res, res)])
    env = {**os.environ, "ANIMA_TRAIN_ALLOWED_DIRS": str(m.diffusers_dir), "PYTHONUNBUFFERED": "1"}
    port = _free_port()
    cmd = [a.python, "main.py", "--listen", "127.0.0.1", "--port", str(port), "--base-directory", str(base),
           "--database-url", "sqlite:///:memory:", "--disable-api-nodes"] + (["--cpu"] if a.cpu else []) \
        + (["--front-end-root", a.front_end_root] if a.front_end_root else [])
    log = open(out / "server.log", "w")
    serving: dict = {}  # "server": the ComfyUI process now (--restart starts another)

    def start_server() -> dict:
        t = time.perf_counter()
        server = serving["server"] = subprocess.Popen(cmd, cwd=a.comfy_root, stdout=log, stderr=subprocess.STDOUT,
                                                      start_new_session=True, env=env)
        while time.perf_counter() - t < 300:
            if server.poll() is not None:
                raise SystemExit("ComfyUI exited:\n" + (out / "server.log").read_text()[-4000:])
            try:
                info = json.loads(_get(port, "/object_info", timeout=60)[1])
                summary.setdefault("server_start_s", round(time.perf_counter() - t, 1))
                say("server up", round(time.perf_counter() - t, 1))
                return info
            except OSError:
                time.sleep(0.5)
        raise SystemExit("ComfyUI did not answer in 300 s")

    def stop_server() -> None:
        server = serving["server"]
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL); server.wait()

    stop = threading.Event(); timeline = []; phase = {"p": "start"}; worker_env_seen: dict = {}
    def poll():
        while not stop.is_set():
            row = {"t": round(time.perf_counter() - S, 2), "phase": phase["p"]}
            try:
                dev = json.loads(_get(port, "/system_stats", timeout=5)[1])["devices"][0]
                row.update({k: dev.get(k) for k in ("vram_total", "vram_free", "torch_vram_total", "torch_vram_free")})
            except Exception:
                pass
            apps = nvsmi()
            if not worker_env_seen:
                read_worker_env(worker_env_seen, summary)
            row["comfy_mib"] = apps.get(serving["server"].pid)
            row["other_mib"] = {p: v for p, v in apps.items() if p != serving["server"].pid}
            timeline.append(row)
            stop.wait(1.0)
    try:
        info = start_server()
        threading.Thread(target=poll, daemon=True).start()
        wf = load_workflow(TRAIN_TEMPLATE)
        set_widgets(wf, info, 1, unet_name="anima.safetensors")
        set_widgets(wf, info, 2, vae_name="vae.safetensors")
        set_widgets(wf, info, 17, clip_name="qwen3.safetensors")
        set_widgets(wf, info, 3, anima="anima.safetensors", qwen="qwen3.safetensors", vae="vae.safetensors",
                    out_dir="anima_repo", tokenizers=str(m.diffusers_dir))
        knobs = dict(dataset_path=str(dataset), run_name="gpu_path", epochs=100, resolution=res, rank=32, alpha=32.0,
                     source="encode", save_every_epochs=0)
        if a.size == "full":
            knobs.update(max_steps=a.steps or 50, dtype="bfloat16", num_workers=2)
        else:
            knobs.update(max_steps=a.steps or 6, dtype="float32", num_workers=0, gradient_checkpointing=False,
                         learning_rate=0.02)
        set_widgets(wf, info, 4, **knobs)
        set_widgets(wf, info, 8, text="red circle, white background"); set_widgets(wf, info, 9, text="")
        set_widgets(wf, info, 10, width=res, height=res)
        if a.size != "full":
            for ks in (11, 14):
                set_widgets(wf, info, ks, steps=4, cfg=2.0, sampler_name="euler", scheduler="simple")
        prompt = to_api(wf, info)
        (out / "prompt.json").write_text(json.dumps(prompt, indent=1))
        client = uuid.uuid4().hex
        msgs = Messages(port, client)
        time.sleep(3)
        if a.preload:  # the base branch (SaveImage 16 and what it needs, Convert included) as its own prompt
            need, todo = set(), ["16"]
            while todo:
                n = todo.pop()
                if n not in need:
                    need.add(n)
                    todo += [v[0] for v in prompt[n]["inputs"].values() if isinstance(v, list) and len(v) == 2
                             and isinstance(v[0], str)]
            phase["p"] = "preload"
            tp = time.perf_counter()
            st, body = _post(port, "/prompt", {"prompt": {k: prompt[k] for k in need}, "client_id": client})
            assert st == 200, body
            e = msgs.wait(finished(body["prompt_id"]), 300, "the preload prompt")
            summary["preload"] = {"nodes": sorted(need, key=int), "end": e["type"],
                                  "s": round(time.perf_counter() - tp, 1)}
            say("preload", summary["preload"]); phase["p"] = "preloaded"; time.sleep(3)
        variants = [v for v in a.variants.split(",") if v]
        rows_file = out / "rows.jsonl"

        def row(**r) -> None:  # one run's line, written as it comes (a cut call keeps what it measured)
            r = {"call": a.call, "cap_gib": None, "base_matmul": "bf16", **r}
            if r.get("s_per_step"):
                r["s_per_image"] = round(r["s_per_step"] / int(r.get("batch", 1)), 4)
            with open(rows_file, "a") as f:
                f.write(json.dumps(r) + "\n")
            say("row", json.dumps(r)[:600])

        for index, variant in enumerate(variants):
            if index and a.pause:
                time.sleep(a.pause)
            if index and a.restart:
                msgs.ws.close(); stop_server(); say("ComfyUI stopped")
                start_server(); msgs = Messages(port, client); time.sleep(3)
            if a.worker_ahead is not None:
                st, body = _post(port, "/anima_train/worker_ahead", {})
                say("worker ahead", st, body); time.sleep(a.worker_ahead)
            run_name = f"node_{variant.replace('#', '_')}"
            kind = variant.partition("#")[0]  # plain#2: plain again, its own run (a warm start: a fresh worker)
            extra = ""
            if kind == "previews":  # 2 previews every 25 steps and at the end, as the bench's --previews
                extra = ('[sample]\nprompts = ["red circle, white background", "blue square, black background"]\n'
                         f'every_n_steps = 25\nsteps = 20\nwidth = {res}\nheight = {res}\n')
            elif kind == "validation":  # 10 % of the images held out, their loss every 10 steps and at the end
                extra = '[validation]\nfraction = 0.1\nevery_n_steps = 10\n'
            elif kind != "plain":
                raise SystemExit(f"--variants: unknown {variant!r}")
            set_widgets(wf, info, 4, run_name=run_name, extra_toml=extra)
            prompt = to_api(wf, info)
            (out / f"prompt_{variant}.json").write_text(json.dumps(prompt, indent=1))
            since = len(msgs.items)
            phase["p"] = f"queued_{variant}"
            tq, tq_wall, tq_mono = time.perf_counter(), time.time(), time.monotonic()
            st, body = _post(port, "/prompt", {"prompt": prompt, "client_id": client})
            assert st == 200, body
            pid = body["prompt_id"]

            def watch(since=since, variant=variant, tq=tq):
                while not stop.is_set() and phase["p"].endswith(variant):
                    ev = progress_events(msgs, since)
                    if any(e.get("event") == "done" for e in ev):
                        phase["p"] = f"after_worker_{variant}"
                    elif any(e.get("event") == "step" for e in ev):
                        phase["p"] = f"training_{variant}"
                    time.sleep(0.2)
            threading.Thread(target=watch, daemon=True).start()
            end = msgs.wait(finished(pid), 560 if a.size == "full" else 900, "the prompt")
            rec = summary.setdefault("prompts", {}).setdefault(variant, {})
            rec["prompt_s"] = round(time.perf_counter() - tq, 1); rec["end"] = end["type"]
            time.sleep(2)
            ev = [e for e in progress_events(msgs, since) if e.get("prompt_id") in (pid, None)]
            steps = [e for e in ev if e.get("event") == "step"]
            rec["losses"] = [round(e["loss"], 4) for e in steps if isinstance(e.get("loss"), float)]
            rec["messages"] = [e.get("text") for e in ev if e.get("event") in ("message", "warning")][:20]
            rec["timeline"] = queue_timeline(msgs, since, tq_mono)
            if end["type"] != "execution_success":
                rec["error"] = end
            elif variant == variants[0]:
                hist = json.loads(_get(port, f"/history/{pid}")[1])[pid]
                for node, name in (("13", "lora.png"), ("16", "base.png")):
                    img = hist["outputs"][node]["images"][0]
                    shutil.copy(base / "output" / img["subfolder"] / img["filename"], out / name)
            say("prompt finished", variant, end["type"], rec["prompt_s"])
            save()
            row(who="comfyui", run=run_name, variant=variant, batch=1, env="the node's worker",
                **step_stats(ev, tq_wall), loss_first=rec["losses"][0] if rec["losses"] else None,
                loss_last=rec["losses"][-1] if rec["losses"] else None)
            job = next((base / "output").rglob(f"{run_name}/comfyui-job.toml"), None)
            if job is None or not a.cli:
                continue
            if not worker_env_seen:
                raise SystemExit("--cli comfy-env: the worker's environment was not read (/proc/PID/environ)")
            hows = [c for c in a.cli.split(",") if c]
            for how in hows if variant == variants[0] else hows[:1]:  # later variants: the first environment only
                if how == "comfy-env":  # what the worker had, less the parent watch (its parent is not ComfyUI)
                    cli_env = {k: v for k, v in worker_env_seen.items() if k != "ANIMA_TRAIN_PARENT_PID"}
                elif how in ("plain", "comfy-alloc"):  # a shell's; comfy-alloc adds the allocator ComfyUI sets for
                    # itself (and gave the worker until nodes/worker.without_comfy_allocator)
                    cli_env = {k: v for k, v in env.items() if k not in ALLOC_VARIABLES}
                    cli_env["PYTHONPATH"] = os.pathsep.join(
                        [str(ROOT)] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
                    if how == "comfy-alloc":
                        cli_env["PYTORCH_ALLOC_CONF"] = COMFY_ALLOCATOR
                else:
                    raise SystemExit(f"--cli: unknown {how!r}")
                _post(port, "/free", {"unload_models": True, "free_memory": True})
                time.sleep(2)
                phase["p"] = f"cli_{variant}_{how}"
                name = f"cli_{variant}_{how.replace('-', '_')}"
                events, started, rc = cli_run(a.python, job, name, cli_env, out / f"{name}.log")
                summary.setdefault("cli_timelines", {})[name] = event_timeline(events, started)
                losses = [round(e["loss"], 4) for e in events
                          if e.get("event") == "step" and isinstance(e.get("loss"), float)]
                row(who="ours", run=name, variant=variant, batch=1, env=how, rc=rc,
                    alloc=cli_env.get("PYTORCH_ALLOC_CONF") or cli_env.get("PYTORCH_CUDA_ALLOC_CONF"),
                    **step_stats(events, started), loss_first=losses[0] if losses else None,
                    loss_last=losses[-1] if losses else None)
    finally:
        stop.set(); time.sleep(1.2)
        (out / "timeline.json").write_text(json.dumps(timeline))
        by = {}
        for r in timeline:
            if r.get("comfy_mib") is not None:
                by.setdefault(r["phase"], []).append(r["comfy_mib"])
        summary["comfy_mib_by_phase"] = {k: {"min": min(v), "max": max(v), "last": v[-1]} for k, v in by.items()}
        work_mib = [max(r["other_mib"].values()) for r in timeline if r.get("other_mib")]
        summary["worker_mib_max"] = max(work_mib) if work_mib else None
        save()
        stop_server()
        log.close()
        say("server stopped; summary", json.dumps(summary)[:3000])


if __name__ == "__main__":
    main()
