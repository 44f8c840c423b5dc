"""Shared test setup: marker gating, so the default `pytest` run is everything that can run on this machine."""

from __future__ import annotations

import getpass
import os
import tempfile

import pytest

# A compiled run keeps its kernels in a per-user cache folder unless TORCHINDUCTOR_CACHE_DIR names another
# (training/compiling.compile_cache_dir; torch's own default, which torch itself puts there, does not count); the
# tests and their child processes name one in the temp folder, so a test machine's home folder collects nothing.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"anima-train-tests-torchinductor_{getpass.getuser()}"))
# The tests compare runs by their trained tensors and batches (TrainResult.trainable_digest, batches_seen), which a run
# records only when asked (training/run_state.py); children the tests start inherit it.
os.environ["ANIMA_TRAIN_RECORD"] = "1"

COMFYUI_SKIP = ("needs ComfyUI: set COMFYUI_PATH to a ComfyUI checkout with Anima support "
                "(and COMFYUI_PYTHON to its venv's python) to run it")


def _marked(item, name: str) -> bool:
    # A marker, not a keyword: `item.keywords` also holds the names of the folders above the test, so a checkout in a
    # folder called `gpu` or `comfyui` would skip the whole suite.
    return item.get_closest_marker(name) is not None


def _cuda_available() -> bool:
    try:
        import torch
    except Exception:
        return False
    return torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption("--require-comfyui", action="store_true",
                     help="a comfyui-marked test that would be skipped fails instead (CI: .ci/comfyui.sh)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and not hasattr(report, "wasxfail") and _marked(item, "comfyui")
            and item.config.getoption("--require-comfyui")):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"--require-comfyui: this ComfyUI test would have been skipped: {reason}"


def pytest_collection_modifyitems(config, items):
    need_gpu = [item for item in items if _marked(item, "gpu")]
    gpu_ok = _cuda_available() if need_gpu else False
    for item in items:
        if _marked(item, "comfyui") and not os.environ.get("COMFYUI_PATH"):
            item.add_marker(pytest.mark.skip(reason=COMFYUI_SKIP))
        if _marked(item, "gpu") and not gpu_ok:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (run it on the GPU machine)"))


@pytest.fixture(scope="session")
def tiny_anima(tmp_path_factory):
    """The tiny random Anima (diffusers repo + native single files), built once per session; read-only."""
    from tests import fixtures_tiny

    return fixtures_tiny.tiny_anima(tmp_path_factory)


@pytest.fixture(scope="session")
def synthetic_dataset(tmp_path_factory):
    """16 generated images with tag captions, built once per session; read-only."""
    from tests import fixtures_tiny

    return fixtures_tiny.synthetic_dataset(tmp_path_factory)


@pytest.fixture(scope="module")
def latents_dir(tmp_path_factory):
    """12 synthetic latent caches (the tiny model's), made once per test module: a module may add files to it."""
    from anima_train.data.synthetic import make_synthetic_latents

    out = tmp_path_factory.mktemp("latents")
    make_synthetic_latents(out, n=12, seed=0)
    return out
