"""The thin boundary to ComfyUI: every ComfyUI import of the pack goes through this module.

Unit tests replace this module in `sys.modules` with a double (tests/comfy_double.py) to exercise node logic
without a ComfyUI checkout. `comfy_api.latest` is ComfyUI's current V3 API.

The helpers below import ComfyUI's own modules (folder_paths, comfy.*, server) inside the function: those exist only
in a running ComfyUI, and importing them at start-up would make the pack's import order matter. Tests monkeypatch
the helpers on this module.
"""

import asyncio
import importlib
import os

from comfy_api.latest import ComfyExtension, io  # noqa: F401  (re-exported)

CATEGORY = "Anima Trainer"
PROGRESS_EVENT = "anima_train.progress"  # the websocket event js/anima_train.js listens to


def _module(name: str):
    return importlib.import_module(name)


# -- model folders ---------------------------------------------------------------------------------------------


def model_files(folder: str) -> list[str]:
    """File names ComfyUI lists for a model folder ("diffusion_models", "loras", ...); [] outside ComfyUI."""
    try:
        return list(_module("folder_paths").get_filename_list(folder))
    except (ImportError, KeyError):
        return []


def model_path(folder: str, name: str) -> str:
    """Full path of a listed model file; FileNotFoundError naming the folder when it is not there."""
    return _module("folder_paths").get_full_path_or_raise(folder, name)


def model_folder(folder: str) -> str:
    """The first (default) directory of a model folder: where the pack writes files for the stock loaders."""
    return _module("folder_paths").get_folder_paths(folder)[0]


def add_model_folder(folder: str) -> None:
    """Make models/<folder> a model folder ComfyUI lists (the pack's own kinds: "anchors"). Idempotent:
    add_model_folder_path ignores a path it already has and keeps the ones a user added (extra_model_paths.yaml)."""
    fp = _module("folder_paths")
    fp.add_model_folder_path(folder, os.path.join(fp.models_dir, folder))


def models_directory() -> str:
    return _module("folder_paths").models_dir


def output_directory() -> str:
    return _module("folder_paths").get_output_directory()


def comfy_folders() -> dict[str, list[str]]:
    """ComfyUI's own folders, where nodes/paths.py lets the pack read and write: output, input, temp, and "models":
    the models folder plus every model folder path (extra_model_paths.yaml adds some outside it). The first entry of
    output / input / models is the base of a relative path. "custom_nodes" (code) is listed to be refused."""
    fp = _module("folder_paths")
    models = [fp.models_dir] + [p for name, (paths, _) in fp.folder_names_and_paths.items() if name != "custom_nodes"
                                for p in paths]
    return {"output": [fp.get_output_directory()], "input": [fp.get_input_directory()],
            "temp": [fp.get_temp_directory()], "models": models,
            "custom_nodes": list(fp.folder_names_and_paths.get("custom_nodes", ([], None))[0])}


# -- memory, interrupts, progress, events ------------------------------------------------------------------------


def free_vram() -> None:
    """Unload every model ComfyUI holds and return the cached VRAM, so the worker process can use it."""
    mm = _module("comfy.model_management")
    mm.unload_all_models()
    mm.soft_empty_cache()


def throw_if_interrupted() -> None:
    """Raise ComfyUI's InterruptProcessingException (a BaseException) if Cancel was pressed."""
    _module("comfy.model_management").throw_exception_if_processing_interrupted()


def progress_bar(total: int, node_id: str | None = None):
    return _module("comfy.utils").ProgressBar(total, node_id=node_id)


def prompt_id() -> str | None:
    """The id of the prompt now executing (call it in execute): the one the frontend got back when it queued it, and
    that ComfyUI's own `executing` / `execution_start` messages carry. Sent with every progress event, so a chart
    follows only its own run (js/run_follow.js)."""
    context = _module("comfy_execution.utils").get_executing_context()
    if context is not None and context.prompt_id:
        return str(context.prompt_id)
    return getattr(_module("server").PromptServer.instance, "last_prompt_id", None)


def queued_prompt_id() -> str | None:
    """The id of the queued prompt whose node ComfyUI is calling now, or None outside one (a script or a test calling
    a node). ComfyUI runs validate_inputs (when the prompt is queued), fingerprint_inputs and execute all inside it."""
    try:
        context = _module("comfy_execution.utils").get_executing_context()
    except ImportError:
        return None
    return str(context.prompt_id) if context is not None and context.prompt_id else None


def client_id() -> str | None:
    """The websocket client of the prompt now executing (capture it in execute; threads send later)."""
    return getattr(_module("server").PromptServer.instance, "client_id", None)


def send_event(data: dict, sid: str | None = None, event: str = PROGRESS_EVENT) -> None:
    """Thread-safe custom websocket message (send_sync schedules it on the server's loop)."""
    _module("server").PromptServer.instance.send_sync(event, data, sid)


def add_post_route(path: str, respond) -> None:
    """Serve POST `path` on ComfyUI's server (also under /api, as ComfyUI serves its own routes): `respond()`, run
    off the server's event loop (it may start a process), answers with a JSON object. Before the server starts."""
    from aiohttp import web  # lazy: ComfyUI's web server library, present only where ComfyUI runs

    async def handler(request):
        return web.json_response(await asyncio.get_running_loop().run_in_executor(None, respond))

    _module("server").PromptServer.instance.routes.post(path)(handler)


# -- models ---------------------------------------------------------------------------------------------------


def load_lora(model, clip, path: str, strength_model: float, strength_clip: float):
    """ComfyUI's own LoRA path (what LoraLoader does): (patched MODEL clone, patched CLIP clone or None)."""
    utils, sd = _module("comfy.utils"), _module("comfy.sd")
    lora = utils.load_torch_file(path, safe_load=True)
    return sd.load_lora_for_models(model, clip, lora, strength_model, strength_clip)


def model_sampling_kind(model_sampling) -> tuple[str | None, str]:
    """(objective, name) of a model's `model_sampling`: how its sampler's sigma becomes the anchor band gate's s01.

    objective: "flow" for a CONST (flow-matching) prediction, where s01 = sigma (Anima, SD3, Flux); "eps" / "v" for
    EPS / V_PREDICTION on ModelSamplingDiscrete, whose timestep(sigma) is the 0..999 index, so s01 = t / 1000;
    None for anything else (EDM, whose class derives from V_PREDICTION, or an EDM / continuous schedule, whose
    timestep is a function of log sigma). name: the classes ComfyUI combined, e.g.
    "ModelSamplingDiscreteFlow + CONST", for messages."""
    ms = _module("comfy.model_sampling")
    bases = [b.__name__ for b in type(model_sampling).__bases__ if b.__name__ not in ("object", "Module")]
    name = " + ".join(bases) if bases else type(model_sampling).__name__
    if isinstance(model_sampling, ms.CONST):
        return "flow", name
    discrete = isinstance(model_sampling, ms.ModelSamplingDiscrete) and \
        not isinstance(model_sampling, ms.ModelSamplingDiscreteEDM)
    if discrete and not isinstance(model_sampling, ms.EDM):
        if isinstance(model_sampling, ms.V_PREDICTION):
            return "v", name
        if isinstance(model_sampling, ms.EPS):
            return "eps", name
    return None, name
