"""Two checkouts, the same tiny runs: equal losses, weights and events? For refactors that must change no number.

    python bench/compare_trees.py BEFORE_PYTHON AFTER_PYTHON [--work DIR]

Each PYTHON is an interpreter whose `anima_train` is one checkout (e.g. a venv with that checkout installed
editable). One tiny model and dataset are built and cached once (with BEFORE); then three CPU runs go through the
command line of each checkout: a LoRA with periodic saves and resume states, the same LoRA resumed from its step-4
state, and a LoKr. Compared: every event of `--events` (timings, paths and versions masked), every tensor and metadata
value of every checkpoint file, and every file of every resume state. Exit status 0 when all are equal.

Where an issue asked for a record's format to change, the older tree's records are translated into the newer format
before the comparison (FORMAT_CHANGES), and the output says how many were: a value that changed still differs. The
runs name every setting whose default an issue changed (DEFAULTS_CHANGED), so both trees train the same configuration.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

RUNS = {  # name -> (extra TOML, extra CLI args, resume from (run, state))
    "lora": ('[adapter]\nkind = "lora"\nrank = 4\n', [], None),
    "lora_resumed": ('[adapter]\nkind = "lora"\nrank = 4\n', [], ("lora", "lora-step000004-state")),
    "lokr": ('[adapter]\nkind = "lokr"\nrank = 4\n', [], None),
}
MASK_KEYS = {"seconds", "time", "t", "elapsed", "eta", "eta_s", "s_per_step", "it_s", "run_dir", "path", "final",
             "saved", "state", "log", "versions"}
SUFFIXES = (".safetensors", ".json", ".pt")  # checkpoints, states (their JSON, optimizer, scheduler), events aside
# Settings whose default an issue changed, written into every run's [train] table: the config recorded in each file
# (ss_training_config) is then the same on both sides.
DEFAULTS_CHANGED = {
    "swap_blocks": "0",  # issue #45: the default became "auto", which swaps no block off CUDA
}


def step_terms(event: dict) -> dict:
    """Issue #44 (named loss parts from the loss function to the chart): a step event's "mse" and "hf" fields became
    one "terms" mapping of the parts present."""
    if event.get("event") != "step" or "terms" in event or not {"mse", "hf"} & event.keys():
        return event
    event = dict(event)
    parts = {name: event.pop(name) for name in ("mse", "hf") if name in event}
    event["terms"] = {name: value for name, value in parts.items() if value is not None}
    return event


FORMAT_CHANGES = {"step events: mse/hf -> terms (issue #44)": step_terms}
TRANSLATED = {name: 0 for name in FORMAT_CHANGES}
TIME_TEXT = re.compile(r"\d+(\.\d+)? ?s\b|/tmp/\S+|" + r"\d{4}-\d\d-\d\dT\S+")


def sh(python: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([python, "-m", "anima_train", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{python} anima_train {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def mask(value, key=""):
    if key in MASK_KEYS:
        return "<masked>"
    if isinstance(value, dict):
        return {k: mask(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [mask(v) for v in value]
    if isinstance(value, str):
        return TIME_TEXT.sub("<t>", value)
    return value


def events(path: Path) -> list:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            event = json.loads(line)
            for name, translate in FORMAT_CHANGES.items():
                translated = translate(event)
                TRANSLATED[name] += translated is not event
                event = translated
            out.append(mask(event))
    return out


def tensors(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items()
                if k not in ("ss_training_started_at", "ss_training_finished_at", "ss_output_name", "modelspec.date")}
        if "ss_training_config" in meta:
            meta["ss_training_config"] = re.sub(r'"(output_dir|resume_from|source_path|path|model_path)": "[^"]*"',
                                                r'"\1": "<p>"', meta["ss_training_config"])
        return {k: f.get_tensor(k) for k in f.keys()}, meta


def compare_files(a: Path, b: Path, problems: list[str], what: str) -> None:
    if a.suffix == ".safetensors":
        (ta, ma), (tb, mb) = tensors(a), tensors(b)
        if ta.keys() != tb.keys():
            problems.append(f"{what}: tensor names differ")
        for k in ta.keys() & tb.keys():
            if ta[k].dtype != tb[k].dtype or not (ta[k] == tb[k]).all():
                problems.append(f"{what}: tensor {k} differs")
        if ma != mb:
            diff = {k for k in ma.keys() | mb.keys() if ma.get(k) != mb.get(k)}
            problems.append(f"{what}: metadata differs in {sorted(diff)}")
    elif a.suffix == ".json":
        if mask(json.loads(a.read_text())) != mask(json.loads(b.read_text())):
            problems.append(f"{what}: JSON differs")
    elif a.suffix == ".pt":
        import torch

        sa, sb = (torch.load(p, weights_only=True, map_location="cpu") for p in (a, b))
        if repr(sa) != repr(sb):
            problems.append(f"{what}: {a.name} differs")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--work", default="/tmp/compare-trees")
    ap.add_argument("--compare-only", action="store_true", help="compare the runs already in --work")
    args = ap.parse_args()
    work = Path(args.work)
    problems: list[str] = []
    if not args.compare_only:
        run_both(args, work)
    compare(work, problems)
    for name, count in TRANSLATED.items():
        if count:
            print(f"translated into the newer format: {count} record(s), {name}")
    for p in problems:
        print("DIFFERS:", p)
    print("equal" if not problems else f"{len(problems)} difference(s)")
    return 0 if not problems else 1


def run_both(args, work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)
    sh(args.before, "demo", "--out", str(work / "base"), "--steps", "1", "--images", "12", "--cpu", cwd=Path("/"))
    demo = (work / "base" / "demo.toml").read_text()
    demo = re.sub(r"(?m)^\[adapter\][^\[]*", "", demo)
    for side, python in (("before", args.before), ("after", args.after)):
        for name, (extra, cli, resume) in RUNS.items():
            out = work / side / name
            toml = re.sub(r'output_dir = "[^"]*"', f'output_dir = "{out.as_posix()}"', demo)
            toml = re.sub(r"max_steps = \d+", "max_steps = 8", toml)
            # enough epochs for 8 steps (the demo's config trains 1 epoch): the resumed run starts from step 4's state
            toml = re.sub(r"(?m)^epochs = \d+.*\n", "", toml).replace("[train]\n", "[train]\nepochs = 100\n", 1)
            toml = re.sub(r'run_name = "[^"]*"', f'run_name = "{name}"', toml)
            toml = toml.replace("[train]\n", "[train]\nsave_every_steps = 4\nsave_optimizer_state = true\n", 1)
            toml = toml.replace("[train]\n", "[train]\n" + "".join(f"{key} = {value}\n"
                                                                  for key, value in DEFAULTS_CHANGED.items()), 1)
            out.mkdir(parents=True)
            if resume:  # a branch off the first run's step-4 state (a new run name: its own folder)
                src = work / side / resume[0] / resume[0] / resume[1]
                toml = toml.replace("[train]\n", f'[train]\nresume_from = "{src.as_posix()}"\n', 1)
            (out / "cfg.toml").write_text(toml + extra)
            sh(python, "train", str(out / "cfg.toml"), "--cpu", "--events", str(out / "events.jsonl"), *cli, cwd=out)


def compare(work: Path, problems: list[str]) -> None:
    for name in RUNS:
        a, b = work / "before" / name, work / "after" / name
        ea, eb = events(a / "events.jsonl"), events(b / "events.jsonl")
        if ea != eb:
            first = next((i for i, (x, y) in enumerate(zip(ea, eb)) if x != y), min(len(ea), len(eb)))
            problems.append(f"{name}: events differ from #{first}: {ea[first:first + 1]} vs {eb[first:first + 1]}")
        losses = [e["loss"] for e in ea if e.get("event") == "step"]
        files_a, files_b = (sorted(p.relative_to(d) for p in d.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
                            for d in (a, b))
        if files_a != files_b:
            problems.append(f"{name}: files differ: {sorted(set(files_a) ^ set(files_b))}")
        for rel in set(files_a) & set(files_b):
            compare_files(a / rel, b / rel, problems, f"{name}/{rel}")
        print(f"{name}: {len(ea)} events, {len(files_a)} files, losses {[round(x, 6) for x in losses]}")


if __name__ == "__main__":
    sys.exit(main())
