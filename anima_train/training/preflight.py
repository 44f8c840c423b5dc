"""The files and folders a training run needs, checked before anything heavy happens.

load_config checks what the TOML says; this checks what the config points at, on this machine: the model repo, the
dataset folders, the output folder and `resume_from`. The trainer calls `check_run_paths` before it loads any model
(loading takes from seconds to a minute), the ComfyUI config node calls `path_problems` when it validates. Every
problem is reported at once, each naming the key, the path and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Collection

from anima_train.config import Config, ConfigError
from anima_train.outputs.run_folder import free_run_name


def path_problems(cfg: Config, *, saving: bool = True, skip: Callable[[str], bool] = lambda value: False,
                  refused: Collection[str] = ()) -> list[str]:
    """One message per unusable path of `cfg`. `saving` = the run will write into output_dir; `skip(value)` is
    True for a value not known yet (a ComfyUI input linked from another node); `refused`: dotted keys whose values
    the config's own check refused (left to its message)."""
    # lazy: torch (~4.6 s, through components): `anima-train config` checks paths without it
    from anima_train.model.components import ModelRepoError, check_weights
    from anima_train.model.shape import declared_blocks

    problems = []
    model = cfg.train.model_path
    data_refused = any(k.startswith(("dataset.path", "dataset.subsets")) for k in refused)
    if not skip(model) and "train.model_path" not in refused:
        try:
            check_weights(model)  # the folders, and every config.json and weight header (no weights read)
        except ModelRepoError as exc:
            problems.append(str(exc) if str(exc).startswith("model_path") else f"[train] model_path: {exc}")
        else:
            problems += block_count_problems(cfg, declared_blocks(model))
    for i, sub in enumerate([] if data_refused else cfg.dataset.resolved_subsets()):
        if skip(sub.path):
            continue
        key = "[dataset] path" if cfg.dataset.path is not None else f"[[dataset.subsets]] #{i + 1} path"
        folder = Path(sub.path).expanduser()
        if not folder.exists():
            problems.append(f"{key} = {str(sub.path)!r}: dataset folder not found ({folder.absolute()}); fix the "
                            f"path")
        elif not folder.is_dir():
            problems.append(f"{key} = {str(sub.path)!r} is a file, not a dataset folder of images; give its folder")
    if saving and not skip(cfg.train.output_dir) and not {"train.output_dir", "train.run_name"} & set(refused):
        problems += _output_problems(Path(cfg.train.output_dir).expanduser(), cfg.run_stem)
    resume = cfg.train.resume_from
    if resume is not None and not skip(resume) and "train.resume_from" not in refused:
        # lazy: resume_state reads checkpoints (torch, peft: seconds), which only a resume needs
        from anima_train.outputs import resume_state

        try:
            state = resume_state.resolve_resume(resume)  # its state.json is read and checked there
            info = resume_state.read_state(state)
            resume_state.refuse_adapter_change(state, info, cfg)
            if not skip(model):
                resume_state.refuse_model_change(state, info, cfg)
            if saving:  # a run that writes nothing replaces nothing

                run_dir = Path(cfg.train.output_dir).expanduser() / cfg.run_stem
                resume_state.refuse_older_state(state, info["global_step"], run_dir,
                                               free_run_name(run_dir.parent, cfg.run_stem))
        except resume_state.ResumeError as exc:
            problems.append(f"[train] {exc}")
    return problems


def block_count_problems(cfg: Config, blocks: int | None) -> list[str]:
    """The settings that count DiT blocks, against the `blocks` the model at model_path has (its
    transformer/config.json): more than it has is refused, never cut down to what it has."""
    if blocks is None:
        return []
    head = f"[train] model_path: the model has {blocks} DiT blocks (transformer/config.json num_layers)"
    problems = []
    if isinstance(cfg.train.swap_blocks, int) and cfg.train.swap_blocks > blocks:
        problems.append(f"{head}, fewer than [train] swap_blocks = {cfg.train.swap_blocks}; set swap_blocks to at "
                        f"most {blocks} (0 keeps every block on the GPU)")
    setting = cfg.train.checkpoint_blocks
    if isinstance(setting, int) and setting > blocks:
        problems.append(f"{head}, fewer than [train] checkpoint_blocks = {setting}; set checkpoint_blocks to at most "
                        f"{blocks}, \"all\" or \"auto\"")
    return problems


def _output_problems(output_dir: Path, run_stem: str) -> list[str]:
    run_dir = output_dir / run_stem
    for path, key in ((output_dir, "[train] output_dir"), (run_dir, f"the run folder <output_dir>/{run_stem}")):
        if path.exists() and not path.is_dir():
            return [f"{key} {str(path)!r} is a file, not a folder; set [train] output_dir to a folder (or move the "
                    f"file away)"]
    existing = run_dir if run_dir.exists() else output_dir
    while not existing.exists():  # the folders the run will create: the first one that exists must take them
        existing = existing.parent
    if not existing.is_dir():
        return [f"[train] output_dir {str(output_dir)!r}: {existing} is a file, so the folder cannot be created; "
                f"choose another output_dir"]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"[train] output_dir {str(output_dir)!r}: {existing} is not writable by this user; choose another "
                f"output_dir or fix the folder's permissions"]
    return []


def path_check(*, saving: bool = True, skip: Callable[[str], bool] = lambda value: False):
    """path_problems as load_config's `also`: the paths' problems in the same message as the values'."""

    def check(cfg: Config, refused) -> None:
        if problems := path_problems(cfg, saving=saving, skip=skip, refused=refused):
            _refuse(cfg, problems)

    return check


def check_run_paths(cfg: Config, *, saving: bool = True) -> None:
    """Raise one ConfigError listing every unusable path of `cfg` (see path_problems)."""
    # lazy: torch (~4.6 s): see path_problems
    from anima_train.model.components import ModelRepoError, check_weight_shapes

    problems = path_problems(cfg, saving=saving)
    if not problems:
        try:  # the weights' shapes against their configs: needs diffusers, so not in path_problems (the node's)
            check_weight_shapes(cfg.train.model_path)
        except ModelRepoError as exc:
            problems.append(f"[train] model_path: {exc}")
    if problems:
        _refuse(cfg, problems)


def _refuse(cfg: Config, problems: list[str]) -> None:
    name = str(cfg.source_path) if cfg.source_path is not None else "the config"
    n = len(problems)
    raise ConfigError(f"{name}: {n} path{'s' if n > 1 else ''} cannot be used:\n"
                      + "\n".join(f"  - {p}" for p in problems), problems)
