"""Third-party lines a user cannot act on (anima_train/system/third_party_noise.py): gone from what
`python -m anima_train ...` prints, back with `--debug`, and each row still names a line its library says."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures_tiny import anima_train_cli

# the lines as a user sees them (the table's rows are checked against their libraries below)
SDNQ_OPENVINO = "SDNQ: OpenVINO MM kernels are not available!"
CUDA_HOME = "No CUDA runtime is found, using CUDA_HOME="
GUIDERS = "Guiders are currently an experimental feature"
KEEP_FP32 = "There are modules in "


def _quiet_machine(tmp_path: Path) -> dict:
    """The conditions the lines need, on any test machine: no GPU visible and a CUDA toolkit folder named."""
    toolkit = tmp_path / "cuda"
    toolkit.mkdir(exist_ok=True)
    return {"CUDA_HOME": str(toolkit), "CUDA_VISIBLE_DEVICES": ""}


def _both(*args, tmp_path: Path, env: dict):
    quiet = anima_train_cli(*args, cwd=tmp_path, env=env)
    loud = anima_train_cli(*args, "--debug", cwd=tmp_path, env=env)
    return quiet, loud


def test_check_prints_no_sdnq_or_cuda_home_line_and_debug_keeps_them(tmp_path):
    """`anima-train check` (what install.sh ends with) imports sdnq, which says its line at import. The CUDA_HOME line
    comes from whatever imports torch.utils.cpp_extension (Inductor's CPU check does, where it compiles a probe; a
    machine with that probe cached does not): never without --debug here, and the child test below proves the row."""
    if importlib.util.find_spec("openvino") is not None:
        pytest.skip("openvino is installed here, so SDNQ has nothing to say about it")
    quiet, loud = _both("check", tmp_path=tmp_path, env=_quiet_machine(tmp_path))
    for run in (quiet, loud):
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        assert "ok   sdnq" in run.stdout  # the child got as far as importing sdnq
    said, said_debug = quiet.stdout + quiet.stderr, loud.stdout + loud.stderr
    for line in (SDNQ_OPENVINO, CUDA_HOME):
        assert line not in said, f"{line!r} printed without --debug:\n{said[-3000:]}"
    assert SDNQ_OPENVINO in said_debug, \
        f"{SDNQ_OPENVINO!r} not printed with --debug (sdnq changed?):\n{said_debug[-3000:]}"


_CPP_EXTENSION_CHILD = """
import sys
from anima_train.system import third_party_noise
if sys.argv[1] == "filtered":
    with third_party_noise.filtered():
        import torch.utils.cpp_extension
else:
    import torch.utils.cpp_extension
print("imported cpp_extension")
"""


def test_the_cuda_home_line_goes_under_the_filter_and_stays_without_it(tmp_path):
    """The import that says it, in a child with no GPU visible and a toolkit folder named,
    with and without the filter."""
    env = dict(os.environ, **_quiet_machine(tmp_path))
    runs = {how: subprocess.run([sys.executable, "-c", _CPP_EXTENSION_CHILD, how], capture_output=True, text=True,
                                env=env, cwd=Path(__file__).resolve().parents[1], timeout=300)
            for how in ("filtered", "plain")}
    for run in runs.values():
        assert run.returncode == 0 and "imported cpp_extension" in run.stdout, run.stderr[-3000:]
    assert CUDA_HOME in runs["plain"].stderr, f"torch no longer says {CUDA_HOME!r}: {runs['plain'].stderr[-2000:]}"
    assert CUDA_HOME not in runs["filtered"].stdout + runs["filtered"].stderr


def test_tiny_model_prints_no_guiders_line_and_debug_keeps_it(tmp_path):
    quiet = anima_train_cli("tiny-model", tmp_path / "a", cwd=tmp_path)
    loud = anima_train_cli("tiny-model", tmp_path / "b", "--debug", cwd=tmp_path)
    for run in (quiet, loud):
        assert run.returncode == 0, run.stderr[-3000:]
        assert "tiny model (diffusers repo" in run.stdout  # the child built the model
    assert GUIDERS not in quiet.stdout + quiet.stderr
    assert GUIDERS in loud.stdout + loud.stderr
    # what the user needs is still all there: only the library's line went
    assert quiet.stdout == loud.stdout.replace(str(tmp_path / "b"), str(tmp_path / "a"))


def test_a_row_drops_its_message_only_and_is_undone_after_the_block():
    """The row for diffusers' float32 note, on the cast that says it (no command casts an Anima model today:
    tiny.py's bf16 builds and the GPU benches do), and the same logger's other messages kept."""
    import torch
    from diffusers.models.transformers.transformer_cosmos import CosmosTransformer3DModel

    from anima_train.model.tiny import build_models
    from anima_train.system import third_party_noise

    transformer = build_models(seed=0)["transformer"]
    assert isinstance(transformer, CosmosTransformer3DModel)
    records: list[str] = []
    catcher = logging.Handler()
    catcher.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("diffusers.models.modeling_utils")
    logger.addHandler(catcher)
    try:
        with third_party_noise.filtered(environ={}):
            transformer.to(torch.float32)
            logger.warning("a real problem")
        assert not any(r.startswith(KEEP_FP32) for r in records) and "a real problem" in records
        transformer.to(torch.float32)
        assert any(r.startswith(KEEP_FP32) for r in records)  # said again once the block ended
    finally:
        logger.removeHandler(catcher)


def test_every_row_names_a_line_its_library_says():
    """A library that rewords a line or moves it to another logger makes its row dead: the logger's module (or
    package) must still hold the text."""
    from anima_train.system import third_party_noise  # here, so the CLI tests above collect on any version

    for line in third_party_noise.LOG_LINES:
        _said_by_its_library(line)


def _said_by_its_library(line) -> None:
    top = line.logger.split(".")[0]
    spec = importlib.util.find_spec(line.logger) or importlib.util.find_spec(top)
    assert spec is not None and spec.origin, f"{line.logger} is not importable here"
    origin = Path(spec.origin)
    sources = [origin] if origin.name != "__init__.py" else sorted(origin.parent.rglob("*.py"))
    assert any(line.starts in p.read_text(encoding="utf-8", errors="replace") for p in sources), (
        f"{line.starts!r} is no longer said by {line.logger}: drop or update its row ({line.why})")
    assert line.why


def test_a_renamed_variable_moves_to_its_new_name_only_for_versions_that_read_it(monkeypatch):
    from anima_train.system import third_party_noise

    var = third_party_noise.RENAMED_VARIABLES[0]
    environ = {var.old: "backend:cudaMallocAsync"}
    monkeypatch.setattr(third_party_noise, "_version", lambda package: var.since)
    with third_party_noise.filtered(environ=environ):
        assert environ == {var.new: "backend:cudaMallocAsync"}
    # it stays moved: torch 2.9 reads the variable as late as the process's exit, and would say it then
    assert environ == {var.new: "backend:cudaMallocAsync"}
    environ = {var.old: "backend:cudaMallocAsync"}
    monkeypatch.setattr(third_party_noise, "_version", lambda package: (var.since[0], var.since[1] - 1))
    with third_party_noise.filtered(environ=environ):
        assert environ == {var.old: "backend:cudaMallocAsync"}  # an older torch reads only the old name
    both = {var.old: "a", var.new: "b"}  # the user set the new name: theirs, untouched
    monkeypatch.setattr(third_party_noise, "_version", lambda package: var.since)
    with third_party_noise.filtered(environ=both):
        assert both == {var.old: "a", var.new: "b"}
