"""Load Anchor inside real ComfyUI: a tiny detectable Anima, a HIGH-band-only multiband3 anchor, real sampling.

ComfyUI's code runs in ComfyUI's own python (COMFYUI_PYTHON, its own torch) as a subprocess script; this process
only builds the files and checks the numbers the script reports. The pack is imported the way ComfyUI's loader
does it (the folder's __init__.py as a package), so `nodes/` never shadows ComfyUI's own nodes.py.

What it shows (issue 6, item 5; issue 10, item 4):
  * one-step denoise at each sigma of a grid: patched == unpatched bit for bit below the 0.75 edge's crossfade
    (sigma <= 0.69), different above it — the band gate reads sigma from transformer_options per step;
  * a full 4-step KSampler-style run differs from its first step (sigma 1); a run whose whole schedule is below
    0.69 is bit-identical at every step;
  * strength 0 is bit-exact; the input MODEL is never changed; a wrong-width anchor names both signatures;
  * an eps-tagged anchor is refused on Anima (flow) by default, and gated by sigma with objective "model".
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from anchor.format import save
from anchor.modules import fresh_anchor

pytestmark = [pytest.mark.comfyui, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
WIDTH, BLOCKS = 256, 10  # the tiny ComfyUI-detectable Anima (docs/comfyui.md#model-detection)
GRID = [1.0, 0.85, 0.78, 0.72, 0.68, 0.5, 0.2]
EDGE_LOW = 0.75 - 0.06  # HIGH band weight is exactly 0 at or below this sigma

SCRIPT = textwrap.dedent(r'''
    import importlib.util, json, sys, time
    comfy_root, pack_dir, anima_file, anchor_dir, grid = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    grid = json.loads(grid)
    t0 = time.perf_counter()
    sys.path.insert(0, comfy_root)
    from comfy.cli_args import args
    args.cpu = True  # before anything imports comfy.model_management
    import torch
    import comfy.sample, comfy.samplers, comfy.sd, folder_paths

    # the pack, loaded like ComfyUI's load_custom_node: <folder>/__init__.py as a package
    spec = importlib.util.spec_from_file_location("anima_pack", pack_dir + "/__init__.py",
                                                  submodule_search_locations=[pack_dir])
    pack = importlib.util.module_from_spec(spec)
    sys.modules["anima_pack"] = pack
    spec.loader.exec_module(pack)
    import asyncio
    node_list = asyncio.run(asyncio.run(pack.comfy_entrypoint()).get_node_list())
    Loader = next(n for n in node_list if n.define_schema().node_id == "AnimaAnchorLoader")
    node_module = sys.modules[Loader.__module__]

    folder_paths.add_model_folder_path("anchors", anchor_dir)  # as extra_model_paths.yaml would
    info = Loader.GET_NODE_INFO_V1()  # the real V3 schema machinery accepts the declaration
    combo = info["input"]["required"]["anchor_name"]
    combo = combo[1].get("options") if combo[0] == "COMBO" else combo[0]
    strength_spec = info["input"]["required"]["strength"][1]

    torch.inference_mode().__enter__()  # ComfyUI runs every node and sampler under inference mode
    model = comfy.sd.load_diffusion_model(anima_file, model_options={"dtype": torch.float32})
    t_load = time.perf_counter() - t0

    g = torch.Generator().manual_seed(0)
    def cond(n):
        return [[torch.randn(1, 7, 1024, generator=g), {"t5xxl_ids": torch.randint(0, 32128, (6,), generator=g).int(),
                                                         "t5xxl_weights": torch.ones(6)}]]
    positive, negative = cond(7), cond(6)
    latent = torch.zeros(1, 16, 1, 8, 8)
    noise = torch.randn(1, 16, 1, 8, 8, generator=g)
    euler = comfy.samplers.sampler_object("euler")

    def custom(m, sigmas, start=None, cfg=1.0):
        steps = []
        cb = lambda step, x0, x, total: steps.append(x0.clone())
        out = comfy.sample.sample_custom(m, noise, cfg, euler, torch.tensor(sigmas), positive, negative,
                                         latent if start is None else start, callback=cb, disable_pbar=True, seed=0)
        return out, steps

    def full(m):  # what a KSampler node runs: 4 steps, euler, simple schedule
        steps = []
        cb = lambda step, x0, x, total: steps.append(x0.clone())
        out = comfy.sample.sample(m, noise, 4, 1.0, "euler", "simple", positive, negative, latent,
                                  callback=cb, disable_pbar=True, seed=0)
        return out, steps

    def load(name, strength):
        return Loader.execute(model=model, anchor_name=name, strength=strength)

    res = {"combo": combo, "strength_default": strength_spec.get("default"), "load_s": t_load}
    t1 = time.perf_counter()
    out = load("high_only.safetensors", -1.0)
    high, card_text = out.args[0], out.args[1]
    res["card_text"] = card_text
    ui = out.ui.as_dict() if hasattr(out.ui, "as_dict") else out.ui
    res["ui_card"] = ui["anchor_card"][0]
    res["n_object_patches"] = len(high.object_patches)
    res["input_patches_after"] = len(model.object_patches)
    res["patch_keys"] = sorted(high.object_patches)[:2]
    res["fingerprint"] = Loader.fingerprint_inputs(anchor_name="high_only.safetensors", strength=-1.0)

    # One Euler step from sigma to 0 on the same noised input = the denoised prediction at that sigma.
    # cfg 2 batches cond + uncond: transformer_options["sigmas"] has B entries for 2B rows.
    res["grid"] = {}
    plain_grid = {}
    for s in grid:
        a, _ = custom(model, [s, 0.0], cfg=2.0)
        b, _ = custom(high, [s, 0.0], cfg=2.0)
        plain_grid[s] = a
        res["grid"][str(s)] = {"equal": bool(torch.equal(a, b)), "max_abs": float((a - b).abs().max())}

    plain_full, plain_steps = full(model)
    high_full, high_steps = full(high)
    res["full"] = {"equal": bool(torch.equal(plain_full, high_full)),
                   "sigmas": [float(s) for s in comfy.samplers.calculate_sigmas(
                       model.get_model_object("model_sampling"), "simple", 4)],
                   "step_equal": [bool(torch.equal(p, h)) for p, h in zip(plain_steps, high_steps)]}

    low_sched = [0.6, 0.4, 0.2, 0.0]
    start = 0.4 * noise  # a partly denoised latent, as img2img would start (the sampler adds 0.6 noise)
    pa, pa_steps = custom(model, low_sched, start)
    hb, hb_steps = custom(high, low_sched, start)
    res["low_schedule"] = {"equal": bool(torch.equal(pa, hb)),
                           "step_equal": [bool(torch.equal(p, h)) for p, h in zip(pa_steps, hb_steps)]}

    zero = load("high_only.safetensors", 0.0).args[0]
    zero_full, _ = full(zero)
    res["strength0_equal"] = bool(torch.equal(zero_full, plain_full))

    relay = load("relay.safetensors", 1.0).args[0]
    r_low, _ = custom(relay, [0.3, 0.0])
    p_low, _ = custom(model, [0.3, 0.0])
    res["relay_low_sigma_differs"] = not bool(torch.equal(r_low, p_low))

    try:
        load("wrong_width.safetensors", 1.0)
        res["wrong_width_error"] = None
    except Exception as e:
        res["wrong_width_error"] = f"{type(e).__name__}: {e}"

    try:  # the same HIGH-band weights tagged eps: on Anima (flow) the default refuses it ...
        load("eps_tagged.safetensors", 1.0)
        res["eps_tagged_error"] = None
    except Exception as e:
        res["eps_tagged_error"] = f"{type(e).__name__}: {e}"
    # ... and objective "model" gates it by the model's sigma like the flow-tagged file
    follow = Loader.execute(model=model, anchor_name="eps_tagged.safetensors", strength=1.0, objective="model")
    a, _ = custom(model, [grid[0], 0.0], cfg=2.0)
    b, _ = custom(follow.args[0], [grid[0], 0.0], cfg=2.0)
    res["eps_tagged_model_acts_at_high_sigma"] = not bool(torch.equal(a, b))
    res["eps_tagged_model_text"] = follow.args[1]

    # the input MODEL after three patched clones were made and sampled: same bits as at the start
    again, _ = custom(model, [grid[0], 0.0], cfg=2.0)
    res["input_unchanged"] = bool(torch.equal(again, plain_grid[grid[0]])) and len(model.object_patches) == 0
    res["patched_s"] = time.perf_counter() - t1
    print("RESULT " + json.dumps(res))
''')


def _anchor(kind, width, **spec):
    return fresh_anchor(kind, [width] * BLOCKS, family="cosmos_dit", objective="flow", **spec)


def write_anchors(folder: Path):
    g = torch.Generator().manual_seed(11)
    high = _anchor("multiband3", WIDTH, rank=8)
    for i in range(BLOCKS):  # weights ONLY in the HIGH band (2); LOW/MID keep their zero up-projections
        high.adapters[f"{i}.up.2.weight"] = torch.randn(WIDTH, 8, generator=g) * 0.2
        high.adapters[f"{i}.up.2.bias"] = torch.randn(WIDTH, generator=g) * 0.2
        high.adapters[f"{i}.gates"] = torch.zeros(3)
    high.meta.update(display_name="Tiny HIGH-band anchor", recommended_strength=0.8, nc=True, license="CC-BY-NC-4.0",
                     band_roles=["detail (LOW)", "semantics (MID)", "structure (HIGH)"],
                     evidence="test fixture: random HIGH-band weights, no training")
    save(high, folder / "high_only.safetensors")
    high.meta["objective"] = {"kind": "eps"}
    save(high, folder / "eps_tagged.safetensors")
    relay = _anchor("relay", WIDTH, n_slots=4, K=16, hidden=32)
    for i in range(BLOCKS):
        relay.adapters[f"{i}.consume.3.weight"] = torch.randn(WIDTH, 32, generator=g) * 0.2
    save(relay, folder / "relay.safetensors")
    save(_anchor("multiband3", 512, rank=4), folder / "wrong_width.safetensors")


@pytest.fixture(scope="module")
def comfy_run(tmp_path_factory):
    comfy_root = os.environ["COMFYUI_PATH"]
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    from tests import fixtures_tiny

    anima = fixtures_tiny.tiny_anima(tmp_path_factory, size="comfy")
    anchors = tmp_path_factory.mktemp("anchors")
    write_anchors(anchors)
    script = anchors.parent / "comfy_anchor_probe.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([python, str(script), comfy_root, str(ROOT), str(anima.anima_file), str(anchors),
                           json.dumps(GRID)], capture_output=True, text=True, timeout=600, cwd=str(anchors))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"ComfyUI script failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "unet missing" not in proc.stderr and "unet unexpected" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_node_registers_and_lists_anchor_files(comfy_run):
    assert {"high_only.safetensors", "relay.safetensors", "wrong_width.safetensors"} <= set(comfy_run["combo"])
    assert comfy_run["strength_default"] == -1.0
    assert comfy_run["n_object_patches"] == BLOCKS and comfy_run["input_patches_after"] == 0
    assert comfy_run["patch_keys"][0] == "diffusion_model.blocks.0.forward"
    name, mtime_ns, size, strength = comfy_run["fingerprint"].split("|")  # resolved through folder_paths
    assert name == "high_only.safetensors" and int(mtime_ns) > 0 and int(size) > 0 and strength == "-1.0"


def test_card_reaches_the_ui_and_the_string_output(comfy_run):
    text, card = comfy_run["card_text"], comfy_run["ui_card"]
    assert text.startswith("Tiny HIGH-band anchor   [NON-COMMERCIAL]")
    assert "strength used: 0.8 (the card's recommended value)" in text
    assert "bands gated as flow, s01 = sigma (the file's objective)" in text
    assert f"[{','.join([str(WIDTH)] * BLOCKS)}]" in text
    assert card["nc"] is True and card["strength"] == 0.8 and card["band_roles"][2] == "structure (HIGH)"


def test_high_band_acts_only_above_the_edge(comfy_run):
    for s, r in comfy_run["grid"].items():
        if float(s) <= EDGE_LOW:
            assert r["equal"], f"sigma {s}: the HIGH band leaked below the edge ({r})"
        else:
            assert not r["equal"] and r["max_abs"] > 1e-4, f"sigma {s}: the HIGH band did not act ({r})"


def test_full_sampling_differs_only_through_high_sigma_steps(comfy_run):
    full = comfy_run["full"]
    assert full["sigmas"][0] == pytest.approx(1.0) and not full["equal"]
    assert full["step_equal"][0] is False  # step 0 runs at sigma 1.0: the HIGH band is on
    low = comfy_run["low_schedule"]
    assert low["equal"] and all(low["step_equal"]) and len(low["step_equal"]) == 3


def test_strength_zero_bit_exact_and_input_model_untouched(comfy_run):
    assert comfy_run["strength0_equal"]
    assert comfy_run["input_unchanged"]
    assert comfy_run["relay_low_sigma_differs"]  # relay is not band-gated: it acts at low sigma too


def test_wrong_width_anchor_names_both_signatures(comfy_run):
    err = comfy_run["wrong_width_error"]
    assert err and err.startswith("SiteMismatch")
    assert f"file widths: [{','.join(['512'] * BLOCKS)}]" in err
    assert f"host widths: [{','.join([str(WIDTH)] * BLOCKS)}]" in err


def test_eps_tagged_anchor_on_anima_is_refused_unless_following_the_model(comfy_run):
    # ComfyUI's own model_sampling for Anima (ModelSamplingDiscreteFlow + CONST) is read as flow
    err = comfy_run["eps_tagged_error"]
    assert err and err.startswith("AnchorError") and "eps_tagged.safetensors" in err
    assert "the file's objective is 'eps'" in err and "samples as flow (ModelSamplingDiscreteFlow + CONST)" in err
    assert comfy_run["eps_tagged_model_acts_at_high_sigma"]
    assert "bands gated as flow, s01 = sigma (the model's sampling)" in comfy_run["eps_tagged_model_text"]
