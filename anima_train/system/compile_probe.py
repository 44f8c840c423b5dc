"""Whether torch.compile works on this machine, found by running it: a tiny compiled function (forward and
backward) on a device, compared with eager. A property of the machine, so it lives here: the trainer decides compile
with it before the model loads (training/compiling.py) and `anima-train check` reports it (system/check.py)."""

from __future__ import annotations

import re
import types

import torch


def failure_cause(exc: BaseException) -> str:
    """One line out of a compiler failure: the exception's first line, plus the compiler's own line that names the
    error (`fatal error: Python.h: No such file or directory`) when there is one."""
    lines = [ln.strip() for ln in f"{exc}".splitlines() if ln.strip()]
    head = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    detail = None
    for pattern in (r"fatal error", r"No such file|not found|cannot find|cannot open", r"^error:|\berror:"):
        detail = next((ln for ln in lines[1:] if re.search(pattern, ln, re.IGNORECASE)), None)
        if detail:
            break
    cause = f"{head}: {detail}" if detail and detail not in head else head
    return cause if len(cause) <= 300 else cause[:297] + "..."


def _probe_function(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.sin(x) * w + x * x).sum()


_probes = [0]


def probe_compile(device: torch.device | str) -> str | None:
    """Compile and run a tiny function (forward and backward) on `device` with Inductor; None when it works and
    gives the eager numbers, else the cause in one line. Each probe compiles anew: a fresh code object (dynamo
    caches by code object) and no FX graph cache, so an earlier success cannot answer for this machine now."""
    # lazy: torch._inductor, heavy on top of torch (training/compiling.py says how much): only when a probe runs
    import torch._inductor.config as inductor_config

    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, generator=gen).to(device)
    w_eager = torch.randn(64, generator=gen).to(device).requires_grad_(True)
    w = w_eager.detach().clone().requires_grad_(True)
    _probes[0] += 1
    code = _probe_function.__code__.replace(co_name=f"anima_compile_probe_{_probes[0]}")
    fn = types.FunctionType(code, _probe_function.__globals__)
    try:
        with inductor_config.patch(fx_graph_cache=False):
            out = torch.compile(fn, dynamic=False, fullgraph=True)(x, w)
            out.backward()
        ref = _probe_function(x, w_eager)
        ref.backward()
        if not (torch.allclose(out.detach(), ref.detach(), rtol=1e-4, atol=1e-4)
                and torch.allclose(w.grad, w_eager.grad, rtol=1e-4, atol=1e-4)):
            return "the compiled probe gave different numbers from eager"
    except Exception as exc:  # noqa: BLE001 (any failure of the toolchain means: do not compile)
        return failure_cause(exc)
    return None
