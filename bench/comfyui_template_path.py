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
"""
from __future__ import annotations

import argparse, json, os, shutil, signal, subprocess, sys, threading, time, uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
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
                              ("text_encoders", "qwen3.safetensors", m.qwen3_file), ("vae", "vae.safetensors", m.vae_file)]:
        (models / folder).mkdir(parents=True, exist_ok=True)
        (models / folder / name).symlink_to(src)
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / PACK_NAME).symlink_to(ROOT, target_is_directory=True)
    res = 1024 if a.size == "full" else 64
    dataset = base / "input" / "dataset"
    make_synthetic_dataset(dataset, n=8 if a.size == "full" else 4, sizes=[(res, res)])
    env = {**os.environ, "ANIMA_TRAIN_ALLOWED_DIRS": str(m.diffusers_dir), "PYTHONUNBUFFERED": "1"}
    port = _free_port()
    cmd = [a.python, "main.py", "--listen", "127.0.0.1", "--port", str(port), "--base-directory", str(base),
           "--database-url", "sqlite:///:memory:", "--disable-api-nodes"] + (["--cpu"] if a.cpu else []) \
        + (["--front-end-root", a.front_end_root] if a.front_end_root else [])
    log = open(out / "server.log", "w")
    t = time.perf_counter()
    server = subprocess.Popen(cmd, cwd=a.comfy_root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env=env)
    stop = threading.Event(); timeline = []; phase = {"p": "start"}
    def poll():
        while not stop.is_set():
            row = {"t": round(time.perf_counter() - S, 2), "phase": phase["p"]}
            try:
                dev = json.loads(_get(port, "/system_stats", timeout=5)[1])["devices"][0]
                row.update({k: dev.get(k) for k in ("vram_total", "vram_free", "torch_vram_total", "torch_vram_free")})
            except Exception:
                pass
            apps = nvsmi()
            row["comfy_mib"] = apps.get(server.pid)
            row["other_mib"] = {p: v for p, v in apps.items() if p != server.pid}
            timeline.append(row)
            stop.wait(1.0)
    try:
        info = None
        while time.perf_counter() - t < 300:
            if server.poll() is not None:
                raise SystemExit("ComfyUI exited:\n" + (out / "server.log").read_text()[-4000:])
            try:
                info = json.loads(_get(port, "/object_info", timeout=60)[1]); break
            except OSError:
                time.sleep(0.5)
        summary["server_start_s"] = round(time.perf_counter() - t, 1); say("server up", summary["server_start_s"])
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
            knobs.update(max_steps=50, dtype="bfloat16", num_workers=2)
        else:
            knobs.update(max_steps=6, dtype="float32", num_workers=0, gradient_checkpointing=False, learning_rate=0.02)
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
            summary["preload"] = {"nodes": sorted(need, key=int), "end": e["type"], "s": round(time.perf_counter() - tp, 1)}
            say("preload", summary["preload"]); phase["p"] = "preloaded"; time.sleep(3)
        phase["p"] = "queued"
        tq = time.perf_counter(); summary["queued_at_s"] = round(tq - S, 2)
        st, body = _post(port, "/prompt", {"prompt": prompt, "client_id": client})
        assert st == 200, body
        pid = body["prompt_id"]
        def watch():
            while not stop.is_set():
                ev = progress_events(msgs)
                steps = [e for e in ev if e.get("event") == "step"]
                if any(e.get("event") == "done" for e in ev):
                    phase["p"] = "after_worker"
                elif steps:
                    phase["p"] = "training"
                    summary.setdefault("queue_to_first_step_s", round(time.perf_counter() - tq, 1))
                elif ev:
                    phase["p"] = "worker_starting"
                time.sleep(0.2)
        threading.Thread(target=watch, daemon=True).start()
        end = msgs.wait(finished(pid), 560 if a.size == "full" else 900, "the prompt")
        summary["prompt_s"] = round(time.perf_counter() - tq, 1); summary["end"] = end["type"]
        time.sleep(2)
        ev = progress_events(msgs)
        steps = [e for e in ev if e.get("event") == "step"]
        summary["steps"] = len(steps)
        summary["s_per_step_events"] = [e.get("s_per_step") for e in steps]
        summary["losses"] = [round(e["loss"], 4) for e in steps if isinstance(e.get("loss"), float)]
        summary["done_event"] = next((e for e in ev if e.get("event") == "done"), None)
        summary["other_events"] = [e for e in ev if e.get("event") not in ("step",)][:20]
        if end["type"] != "execution_success":
            summary["error"] = end
        else:
            hist = json.loads(_get(port, f"/history/{pid}")[1])[pid]
            for node, name in (("13", "lora.png"), ("16", "base.png")):
                img = hist["outputs"][node]["images"][0]
                shutil.copy(base / "output" / img["subfolder"] / img["filename"], out / name)
        say("prompt finished", end["type"], summary["prompt_s"])
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
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL); server.wait()
        log.close()
        say("server stopped; summary", json.dumps(summary)[:3000])


if __name__ == "__main__":
    main()
