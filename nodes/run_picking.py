"""Which run folder a Train job uses: a finished run of the same inputs (re-used), a cancelled one (resumed), the
run being resumed, or the first free name; and the node's lock on it until its worker has ended."""

from __future__ import annotations

import copy
from pathlib import Path

import tomlkit

from anima_train.outputs import run_folder

from . import run_records

JOB_CONFIG_NAME = "comfyui-job.toml"
JOB_LOCK_NAME = ".comfyui-job.lock"  # held by the node from picking a run folder until its worker has ended


def pick_run(cfg, toml: str, key: str):
    """(cfg, toml, run_dir, manifest, note, job_lock) of the folder this job uses: a finished run of these exact
    inputs (re-used: manifest), a run of these exact inputs that Cancel stopped with a resume state (resumed there:
    the TOML gets its resume_from), the folder of the run being resumed, or else the first of run_name,
    run_name-2, run_name-3, ... that holds no other run and no running job — a new run never replaces another run's
    files. When that is not run_name itself, the TOML and config get the new name and `note` says so.

    job_lock (None when re-used) is the node's lock on the folder, held until the caller releases it: the trainer
    locks the folder only once its worker has started (seconds later), and in that gap another ComfyUI's node
    (same output folder) would otherwise pick the same free name and overwrite this job's files. A folder
    resumed while another job holds it is refused (RunRefused, naming the holder)."""
    output_dir = Path(cfg.train.output_dir)
    resumed = Path(cfg.train.resume_from).expanduser().resolve().parent if cfg.train.resume_from else None
    job_lock, cancelled = None, None
    for stem in run_folder.run_names(cfg.run_stem):
        run_dir = output_dir / stem
        manifest = run_records.reusable_result(run_dir, key)
        if manifest is not None:
            break
        cancelled = None if resumed is not None else run_records.resumable_cancel(run_dir, key)
        resuming = cancelled is not None or (resumed is not None and resumed == run_dir.resolve())
        if resuming or run_folder.holds_no_run(run_dir, stem):
            job_lock = run_folder.RunLock(run_dir, JOB_LOCK_NAME)
            try:
                job_lock.acquire(say=lambda _note: None)  # a lock left by a crashed ComfyUI is simply taken over
                break
            except run_folder.RunRefused:
                job_lock = None
                if resuming:
                    raise
    notes = []
    if stem != cfg.run_stem:
        notes.append(f"run name {cfg.run_stem!r}: {output_dir / cfg.run_stem} holds an earlier run or a running "
                     f"job, so this one is {stem!r} ({run_dir})")
    if cancelled is not None:
        notes.append(f"resuming the run cancelled at step {cancelled['step']} of {cancelled['total']} "
                     f"(from {cancelled['state']})")
    if not notes:
        return cfg, toml, run_dir, manifest, None, job_lock

    doc = tomlkit.parse(toml)
    if "train" not in doc:
        doc["train"] = tomlkit.table()
    doc["train"]["run_name"] = stem
    if cancelled is not None:
        doc["train"]["resume_from"] = cancelled["state"]
    toml = tomlkit.dumps(doc)
    cfg = copy.deepcopy(cfg)  # what parse_config(toml) gives, without parsing it again; the queue's Config stays as is
    cfg.train.run_name = stem
    if cancelled is not None:
        cfg.train.resume_from = cancelled["state"]
    cfg.source_text = toml
    return cfg, toml, run_dir, manifest, "\n".join(notes), job_lock
