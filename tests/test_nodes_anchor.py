"""The "Load Anchor" node and its block-patching logic, without ComfyUI (tests/comfy_double.py + toy trunks).

The toy DiT mimics ComfyUI's Cosmos loop (blocks get `transformer_options`, which carries the step's sigmas); its
block class is named CosmosTransformerBlock with an attn1.to_q, so anchor.attach recognises it too and the two
paths — ComfyUI object patches and diffusers hooks — can be compared on the same weights.
"""
from __future__ import annotations

import functools
import json
import re

import pytest
import torch
import torch.nn as nn

from anchor import AnchorError, SiteMismatch
from anchor.attach import attach
from anchor.format import AnchorFile, save
from anchor.modules import fresh_anchor
from tests import comfy_double

D, N_BLOCKS = 16, 4
SMALL = dict(n_slots=2, K=8, hidden=6)


class CosmosTransformerBlock(nn.Module):  # the class name anchor.attach looks for
    def __init__(self, d):
        super().__init__()
        self.x_dim = d  # ComfyUI's predict2.Block attribute
        self.attn1 = nn.Module()
        self.attn1.to_q = nn.Linear(d, d, bias=False)
        self.mlp = nn.Linear(d, d)

    def forward(self, x, emb, transformer_options={}):  # noqa: B006 (ComfyUI's signature)
        return x + torch.tanh(self.mlp(x)) * emb


class ToyDiT(nn.Module):
    def __init__(self, d=D, n=N_BLOCKS, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(CosmosTransformerBlock(d) for _ in range(n))

    def forward(self, x, timestep, transformer_options=None):
        emb = timestep.to(x.dtype).view(-1, *([1] * (x.ndim - 1)))
        for block in self.blocks:
            x = block(x, emb, transformer_options=transformer_options or {})
        return x


class ToyBaseModel(nn.Module):
    """What a ModelPatcher wraps: `.diffusion_model`, `.model_sampling`, get_dtype_inference()."""

    def __init__(self, dit, model_sampling=None):
        super().__init__()
        self.diffusion_model = dit
        # Anima's by default: flow (CONST), timestep(σ) == σ
        self.model_sampling = model_sampling if model_sampling is not None else comfy_double.anima_sampling()

    def get_dtype_inference(self):
        return torch.float32


class FakePatcher:
    """The ModelPatcher surface the node uses: clone, get_model_object (patches first), add_object_patch."""

    def __init__(self, base, object_patches=None):
        self.model, self.object_patches = base, dict(object_patches or {})

    def clone(self):
        return FakePatcher(self.model, self.object_patches)

    def get_model_object(self, name):
        if name in self.object_patches:
            return self.object_patches[name]
        return functools.reduce(getattr, name.split("."), self.model)

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj

    def run(self, x, sigmas):
        """Like ModelPatcher.patch_model + a sampler call: install the object patches, run, restore."""
        installed = []
        for key, obj in self.object_patches.items():
            owner_path, attr = key.rsplit(".", 1)
            owner = functools.reduce(getattr, owner_path.split("."), self.model)
            installed.append((owner, attr))
            setattr(owner, attr, obj)
        try:
            with torch.no_grad():
                return self.model.diffusion_model(x, sigmas, transformer_options={"sigmas": sigmas})
        finally:
            for owner, attr in installed:
                delattr(owner, attr)  # back to the class's forward


def latents(batch=2, seed=3):
    return torch.randn(batch, 1, 2, 2, D, generator=torch.Generator().manual_seed(seed))


def randomised(anchor, seed=7, only=None):
    """Give the zero-initialised output layers non-zero weights (only: param-name fragments to touch)."""
    g = torch.Generator().manual_seed(seed)
    for key, t in anchor.adapters.items():
        param = key.split(".", 1)[1]
        if param.startswith(("up.", "consume.3.")) and (only is None or any(o in param for o in only)):
            anchor.adapters[key] = torch.randn(t.shape, generator=g) * 0.5
        if param in ("gates", "gate"):
            anchor.adapters[key] = torch.zeros_like(t)  # sigmoid 0.5: a clearly visible delta
    return anchor


def multiband(widths=(D,) * N_BLOCKS, **kw):
    return randomised(fresh_anchor("multiband3", list(widths), family="cosmos_dit", objective="flow", rank=2), **kw)


@pytest.fixture
def node(monkeypatch):
    comfy_double.install(monkeypatch)
    comfy_double.install_model_sampling(monkeypatch)
    import nodes.nodes_anchor as mod

    return mod


def test_schema_strength_sentinel_and_file_combo(node, monkeypatch):
    monkeypatch.setattr(node, "anchor_files", lambda: ["a.safetensors", "sub/b.pt"])
    schema = node.AnimaAnchorLoader.define_schema()
    assert schema.node_id == "AnimaAnchorLoader" and schema.display_name == "Anima: Load anchor"
    kinds = {p.id: p.kind for p in schema.inputs}
    assert kinds == {"model": "MODEL", "anchor_name": "COMBO", "strength": "FLOAT", "objective": "COMBO"}
    objective = next(p for p in schema.inputs if p.id == "objective")  # optional: older workflows lack it
    assert objective.options["options"] == ["file", "model"] and objective.options["default"] == "file"
    assert objective.options["optional"] is True
    combo = next(p for p in schema.inputs if p.id == "anchor_name")
    assert combo.options["options"] == ["a.safetensors", "sub/b.pt"]
    strength = next(p for p in schema.inputs if p.id == "strength")
    assert strength.options["default"] == -1.0 and strength.options["min"] == -1.0
    assert "recommended_strength" in strength.options["tooltip"]
    assert [p.kind for p in schema.outputs] == ["MODEL", "STRING"]
    assert node.NODES == [node.AnimaAnchorLoader]


def test_anchor_files_is_empty_outside_comfyui(node):
    assert node.anchor_files() == []


def test_resolve_strength_sentinel():
    from nodes.anchor_patch import resolve_strength

    a = fresh_anchor("multiband3", [D], rank=2)
    assert resolve_strength(-1.0, a) == 1.0  # no recommended_strength in the file: the card default
    a.meta["recommended_strength"] = 0.6
    assert resolve_strength(-1.0, a) == 0.6 and resolve_strength(-0.25, a) == 0.6
    assert resolve_strength(0.0, a) == 0.0 and resolve_strength(1.5, a) == 1.5


@pytest.mark.parametrize("kind", ["multiband3", "relay"])
@pytest.mark.parametrize("strength", [1.0, 0.7])
def test_object_patches_match_anchor_attach(kind, strength):
    # Same weights, same sigmas: ComfyUI-style object patches == anchor.attach's hooks, bit for bit.
    if kind == "multiband3":
        anchor = multiband()
    else:
        anchor = randomised(fresh_anchor("relay", [D] * N_BLOCKS, family="cosmos_dit", objective="flow", **SMALL))
    from nodes.anchor_patch import block_patches

    dit = ToyDiT()
    x, sigmas = latents(), torch.tensor([0.95, 0.5])  # one HIGH-band and one MID-band sample
    with torch.no_grad():
        plain = dit(x, sigmas)
        with attach(dit, anchor, strength=strength):
            hooked = dit(x, sigmas)
        assert torch.equal(dit(x, sigmas), plain)  # detached again: the plain trunk

    patcher = FakePatcher(ToyBaseModel(dit))
    for key, patch in block_patches(anchor, dit, strength, patcher.get_model_object).items():
        patcher.add_object_patch(key, patch)
    assert sorted(patcher.object_patches) == [f"diffusion_model.blocks.{i}.forward" for i in range(N_BLOCKS)]
    patched = patcher.run(x, sigmas)
    assert not torch.equal(patched, plain)
    assert torch.equal(patched, hooked)
    assert torch.equal(patcher.clone().run(x, sigmas), patched)
    assert torch.equal(FakePatcher(ToyBaseModel(dit)).run(x, sigmas), plain)  # patches gone: the plain trunk


def test_band_gating_reads_sigma_per_step():
    # Only the HIGH band carries weights: sigma below the 0.75 edge's crossfade leaves the output bit-exact.
    from nodes.anchor_patch import block_patches

    dit = ToyDiT()
    patcher = FakePatcher(ToyBaseModel(dit))
    patcher.object_patches.update(block_patches(multiband(only=["up.2."]), dit, 1.0, patcher.get_model_object))
    plain = FakePatcher(ToyBaseModel(dit))
    x = latents()
    for sigma in (0.0, 0.3, 0.5, 0.68):
        s = torch.tensor([sigma, sigma])
        assert torch.equal(patcher.run(x, s), plain.run(x, s)), sigma
    for sigma in (0.72, 0.8, 0.95, 1.0):  # a flow trunk reads sigma itself: sigma/1000 would never reach HIGH
        s = torch.tensor([sigma, sigma])
        assert not torch.equal(patcher.run(x, s), plain.run(x, s)), sigma
    # per sample: [HIGH, LOW] -> only the first sample moves
    mixed = patcher.run(x, torch.tensor([0.95, 0.2]))
    ref = plain.run(x, torch.tensor([0.95, 0.2]))
    assert not torch.equal(mixed[0], ref[0]) and torch.equal(mixed[1], ref[1])


def test_noise_level_per_objective():
    from nodes.anchor_patch import NoiseLevel

    flow = NoiseLevel("flow")
    s = torch.tensor([0.9, 0.4], dtype=torch.float32)
    got = flow({"sigmas": s})
    assert got.dtype == torch.float64 and torch.equal(got, s.double())
    assert flow({"sigmas": s}) is got  # computed once per model call, shared by every block
    assert flow({}) is None
    with pytest.raises(AnchorError, match="pass sigma, not a 0..1000 timestep"):
        flow({"sigmas": torch.tensor([900.0])})
    eps = NoiseLevel("eps", timestep_fn=lambda sigma: torch.tensor([900.0, 20.0]))  # model_sampling.timestep
    assert torch.allclose(eps({"sigmas": torch.tensor([14.6, 0.03])}), torch.tensor([0.9, 0.02], dtype=torch.float64))
    with pytest.raises(AnchorError, match="model_sampling.timestep"):
        NoiseLevel("v")


def test_multiband_outside_a_sampler_is_a_clear_error():
    from nodes.anchor_patch import block_patches

    dit = ToyDiT()
    patches = block_patches(multiband(), dit, 1.0, lambda k: functools.reduce(getattr, k.split("."),
                                                                               ToyBaseModel(dit)))
    block_forward = patches["diffusion_model.blocks.0.forward"]
    with pytest.raises(AnchorError, match="no 'sigmas'"):
        block_forward(latents(), torch.ones(2, 1, 1, 1, 1), transformer_options={})


def test_transformer_options_found_positionally():
    # A SpatialTransformer is called as layer(x, context, transformer_options): positional.
    from nodes.anchor_patch import _transformer_options

    opts = {"sigmas": torch.tensor([0.5])}
    assert _transformer_options((1, None, opts), {}) is opts
    assert _transformer_options((1,), {"transformer_options": opts}) is opts
    assert _transformer_options((1, {"other": 1}), {}) is None


def test_wrong_width_names_both_signatures():
    from nodes.anchor_patch import block_patches

    dit = ToyDiT()
    wrong = multiband(widths=(32,) * N_BLOCKS)
    with pytest.raises(SiteMismatch) as e:
        block_patches(wrong, dit, 1.0, lambda k: None)
    msg = str(e.value)
    assert "file widths: [32,32,32,32]" in msg and "host widths: [16,16,16,16]" in msg
    assert e.value.differing == [0, 1, 2, 3]
    with pytest.raises(SiteMismatch, match="3 sites but the trunk has 4 blocks"):
        block_patches(multiband(widths=(D,) * 3), dit, 1.0, lambda k: None)


def test_half_stack_patches_every_second_block():
    from nodes.anchor_patch import block_patches

    patches = block_patches(multiband(widths=(D, D)), ToyDiT(), 1.0, lambda k: None)
    assert sorted(patches) == ["diffusion_model.blocks.0.forward", "diffusion_model.blocks.2.forward"]


def test_legacy_file_on_a_dit_gates_by_sigma():
    # No substrate.family, no objective: the host (a DiT) makes it cosmos_dit, hence a flow trunk reading sigma.
    from nodes.anchor_patch import block_patches

    legacy = multiband()
    del legacy.meta["substrate"], legacy.meta["objective"]
    patches = block_patches(legacy, ToyDiT(), 1.0, lambda k: None)  # no timestep_fn needed for flow
    level = next(iter(patches.values())).noise_level
    assert level.objective == "flow" and float(level({"sigmas": torch.tensor([0.9])})[0]) == pytest.approx(0.9)


def test_wrong_family_and_load_only_kind_are_refused():
    from nodes.anchor_patch import block_patches

    sd = fresh_anchor("multiband3", [320] * 16, family="sd15_unet", rank=2)
    with pytest.raises(SiteMismatch, match="the file is for sd15_unet"):
        block_patches(sd, ToyDiT(), 1.0, lambda k: None)
    tensors = {"0.down.weight": torch.zeros(2, D), "0.up.weight": torch.zeros(D, 2), "0.up.bias": torch.zeros(D)}
    mono = AnchorFile(tensors, {"adapter": {"kind": "mono"}, "substrate": {"family": "cosmos_dit"}})
    with pytest.raises(AnchorError, match="load-only by design"):
        block_patches(mono, ToyDiT(n=1), 1.0, lambda k: None)


def _toy_sd15():
    """SD1.5's module tree in ComfyUI naming (registration = execution order: input, middle, output)."""
    def transformer(w):
        st = nn.Module()
        st.in_channels = w
        block = nn.Module()
        block.attn1 = nn.Module()
        block.attn1.to_q = nn.Linear(w, 1, bias=False)
        st.transformer_blocks = nn.ModuleList([block])
        return nn.ModuleList([nn.Identity(), st])

    unet = nn.Module()
    widths_in = {1: 320, 2: 320, 4: 640, 5: 640, 7: 1280, 8: 1280}
    unet.input_blocks = nn.ModuleList(transformer(widths_in[i]) if i in widths_in else nn.Identity()
                                      for i in range(12))
    unet.middle_block = transformer(1280)
    widths_out = {3: 1280, 4: 1280, 5: 1280, 6: 640, 7: 640, 8: 640, 9: 320, 10: 320, 11: 320}
    unet.output_blocks = nn.ModuleList(transformer(widths_out[i]) if i in widths_out else nn.Identity()
                                       for i in range(12))
    return unet


def test_unet_sites_come_in_training_order():
    from nodes.anchor_patch import block_patches, comfy_host_sites

    unet = _toy_sd15()
    host = comfy_host_sites(unet, "sd15_unet", 16)
    assert [w for _, w, _ in host] == [320, 320, 640, 640, 1280, 1280, 1280, 1280, 1280, 640, 640, 640,
                                       320, 320, 320, 1280]
    assert host[-1][0] == "middle_block.1.transformer_blocks.0" and {a for _, _, a in host} == {-1}
    # a legacy file without a family: the host's UNet with 16 sites is SD1.5, and the widths confirm it
    legacy = fresh_anchor("multiband3", [w for _, w, _ in host], rank=2)
    del legacy.meta["substrate"]
    patches = block_patches(legacy, unet, 1.0, lambda k: None, timestep_fn=lambda sigma: sigma)
    assert list(patches)[6] == "diffusion_model.output_blocks.3.1.transformer_blocks.0.forward"
    assert list(patches)[-1] == "diffusion_model.middle_block.1.transformer_blocks.0.forward"


def write_anchor(tmp_path, anchor, name="a.safetensors"):
    anchor.meta.update(display_name="Toy Multiband — test", recommended_strength=0.6, nc=True,
                       license="CC-BY-NC-4.0", evidence="exp-test, 1 seed: made up for a unit test",
                       band_roles=["LOW detail", "MID semantics", "HIGH structure"], caveats=["toy only"])
    anchor.meta["substrate"]["base_model_id"] = "toy/dit"
    path = tmp_path / name
    save(anchor, path)
    return path


def test_node_execute_returns_patched_clone_and_card(node, monkeypatch, tmp_path):
    path = write_anchor(tmp_path, multiband())
    monkeypatch.setattr(node, "anchor_path", lambda name: str(tmp_path / name))
    dit = ToyDiT()
    model = FakePatcher(ToyBaseModel(dit))
    out = node.AnimaAnchorLoader.execute(model=model, anchor_name=path.name, strength=-1.0)
    patched, text = out.values
    assert patched is not model and model.object_patches == {}  # the input MODEL is untouched
    assert len(patched.object_patches) == N_BLOCKS
    assert all(p.strength == 0.6 for p in patched.object_patches.values())  # -1 -> the card's 0.6
    assert text.startswith("Toy Multiband — test   [NON-COMMERCIAL]")
    for piece in ("kind: multiband3", "trunk: toy/dit", "evidence: exp-test, 1 seed", "band 2: HIGH structure",
                  "caveat: toy only", "license: CC-BY-NC-4.0 (non-commercial)",
                  "strength used: 0.6 (the card's recommended value)", "width signature (4 sites): [16,16,16,16]"):
        assert piece in text, piece
    card = out.ui["anchor_card"][0]
    json.dumps(card)  # it travels in the `executed` websocket message
    assert card["nc"] is True and card["kind"] == "multiband3" and card["strength"] == 0.6
    assert card["band_roles"][2] == "HIGH structure" and card["file"] == path.name
    x, s = latents(), torch.tensor([0.9, 0.9])
    assert not torch.equal(patched.run(x, s), model.run(x, s))

    explicit = node.AnimaAnchorLoader.execute(model=model, anchor_name=path.name, strength=0.25)
    assert "strength used: 0.25 (card recommends 0.6)" in explicit.values[1]


def test_node_strength_zero_is_bit_exact(node, monkeypatch, tmp_path):
    path = write_anchor(tmp_path, multiband())
    monkeypatch.setattr(node, "anchor_path", lambda name: str(tmp_path / name))
    model = FakePatcher(ToyBaseModel(ToyDiT()))
    patched = node.AnimaAnchorLoader.execute(model=model, anchor_name=path.name, strength=0.0).values[0]
    x = latents()
    for sigma in (1.0, 0.8, 0.5, 0.1):
        s = torch.tensor([sigma, sigma])
        assert torch.equal(patched.run(x, s), model.run(x, s))


def test_node_wrong_width_anchor_fails_before_cloning(node, monkeypatch, tmp_path):
    path = write_anchor(tmp_path, multiband(widths=(24,) * N_BLOCKS))
    monkeypatch.setattr(node, "anchor_path", lambda name: str(tmp_path / name))
    model = FakePatcher(ToyBaseModel(ToyDiT()))
    model.clone = lambda: pytest.fail("cloned before the width check")
    with pytest.raises(SiteMismatch, match=r"file widths: \[24,24,24,24\]\n  host widths: \[16,16,16,16\]"):
        node.AnimaAnchorLoader.execute(model=model, anchor_name=path.name, strength=1.0)


def test_node_missing_file_names_the_folder(node, monkeypatch):
    def missing(name):
        raise FileNotFoundError(f"Model in folder 'anchors' with filename '{name}' not found.")

    monkeypatch.setattr(node, "anchor_path", missing)
    with pytest.raises(AnchorError, match="'gone.safetensors' is not in models/anchors"):
        node.AnimaAnchorLoader.execute(model=None, anchor_name="gone.safetensors", strength=-1.0)


def test_fingerprint_changes_with_the_file(node, monkeypatch, tmp_path):
    path = write_anchor(tmp_path, multiband())
    monkeypatch.setattr(node, "anchor_path", lambda name: str(tmp_path / name))
    before = node.AnimaAnchorLoader.fingerprint_inputs(anchor_name=path.name, strength=-1.0)
    path.unlink()
    write_anchor(tmp_path, multiband(seed=8))
    import os
    os.utime(path, ns=(1, 1))
    assert node.AnimaAnchorLoader.fingerprint_inputs(anchor_name=path.name, strength=-1.0) != before


def test_card_js_targets_this_node_and_never_injects_markup(node):
    from pathlib import Path

    js = (Path(__file__).resolve().parents[1] / "js" / "anchor_card.js").read_text()
    assert f'const NODE_ID = "{node.AnimaAnchorLoader.define_schema().node_id}";' in js
    assert "message?.anchor_card" in js and "NON-COMMERCIAL" in js
    assert "innerHTML" not in js  # card values come from a downloaded file: textContent only


# -- the file's objective against the model's sampling (issue 10, item 4) ------------------------------------------

def sampled(patcher, plain, sigma):
    """(patched, plain) outputs of one model call at `sigma` for both samples."""
    x, s = latents(), torch.tensor([sigma, sigma])
    return patcher.run(x, s), plain.run(x, s)


@pytest.mark.parametrize("tag", ["eps", "v"])
def test_node_refuses_an_eps_v_file_on_a_flow_model(node, monkeypatch, tmp_path, tag):
    # On Anima (flow, timestep(σ) == σ) an eps/v rule would give s01 = σ/1000: every step in the LOW band, so a
    # HIGH-band anchor would silently do nothing. The default refuses, naming both objectives and the fix.
    anchor = multiband(only=["up.2."])
    anchor.meta["objective"] = {"kind": tag}
    path = write_anchor(tmp_path, anchor)
    monkeypatch.setattr(node, "anchor_path", lambda name: str(tmp_path / name))
    model = FakePatcher(ToyBaseModel(ToyDiT()))
    model.clone = lambda: pytest.fail("cloned before the objective check")
    with pytest.raises(AnchorError) as e:
        node.AnimaAnchorLoader.execute(model=model, anchor_name=path.name, strength=1.0)
    msg = str(e.value)
    assert str(path) in msg and f"the file's objective is {tag!r}" in msg
    assert "the model samples as flow (ModelSamplingDiscreteFlow + CONST)" in msg
    assert "every step would land in the LOW band" in msg and "objective input to 'model'" in msg


def test_node_objective_model_follows_the_models_sampling(node, monkeypatch, tmp_path):
    anchor = multiband(only=["up.2."])  # weights only in the HIGH band
    anchor.meta["objective"] = {"kind": "eps"}  # tagged wrongly
    path = write_anchor(tmp_path, anchor)
    monkeypatch.setattr(node, "anchor_path", lambda name: str(tmp_path / name))
    dit = ToyDiT()
    model = FakePatcher(ToyBaseModel(dit))
    out = node.AnimaAnchorLoader.execute(model=model, anchor_name=path.name, strength=1.0, objective="model")
    patched, text = out.values
    assert "bands gated as flow, s01 = sigma (the model's sampling)" in text
    high, plain = sampled(patched, model, 0.9)
    assert not torch.equal(high, plain)  # σ 0.9 is in the HIGH band: the anchor acts
    low, plain = sampled(patched, model, 0.5)
    assert torch.equal(low, plain)


def test_node_flow_file_gates_by_sigma_and_says_so(node, monkeypatch, tmp_path):
    path = write_anchor(tmp_path, multiband(only=["up.2."]))
    monkeypatch.setattr(node, "anchor_path", lambda name: str(tmp_path / name))
    model = FakePatcher(ToyBaseModel(ToyDiT()))
    patched, text = node.AnimaAnchorLoader.execute(model=model, anchor_name=path.name, strength=1.0).values
    assert "bands gated as flow, s01 = sigma (the file's objective)" in text
    high, plain = sampled(patched, model, 0.9)
    assert not torch.equal(high, plain)


def _unet_model(sampling):
    return FakePatcher(ToyBaseModel(_toy_sd15(), sampling))


def _sd15_anchor(kind="multiband3", objective=None):
    widths = [320, 320, 640, 640, 1280, 1280, 1280, 1280, 1280, 640, 640, 640, 320, 320, 320, 1280]
    spec = dict(rank=2) if kind == "multiband3" else SMALL
    return fresh_anchor(kind, widths, family="sd15_unet", objective=objective, **spec)


def test_node_refuses_a_flow_file_on_an_eps_model(node, monkeypatch, tmp_path):
    path = write_anchor(tmp_path, _sd15_anchor(objective="flow"))
    monkeypatch.setattr(node, "anchor_path", lambda name: str(tmp_path / name))
    cd = comfy_double
    model = _unet_model(cd.model_sampling(cd.ModelSamplingDiscrete, cd.EPS))
    with pytest.raises(AnchorError, match=r"objective is 'flow' .* samples as eps \(ModelSamplingDiscrete \+ EPS\)"):
        node.AnimaAnchorLoader.execute(model=model, anchor_name=path.name, strength=1.0)


@pytest.mark.parametrize("file_objective", ["eps", "v", None])
@pytest.mark.parametrize("prediction", ["EPS", "V_PREDICTION"])
def test_node_eps_and_v_gate_alike_and_untagged_files_follow_the_model(node, monkeypatch, tmp_path, file_objective,
                                                                       prediction):
    path = write_anchor(tmp_path, _sd15_anchor(objective=file_objective))
    monkeypatch.setattr(node, "anchor_path", lambda name: str(tmp_path / name))
    cd = comfy_double
    model = _unet_model(cd.model_sampling(cd.ModelSamplingDiscrete, getattr(cd, prediction)))
    patched, text = node.AnimaAnchorLoader.execute(model=model, anchor_name=path.name, strength=1.0).values
    assert "bands gated as eps/v, s01 = t/1000" in text
    level = next(iter(patched.object_patches.values())).noise_level
    sigmas = torch.tensor([14.6, 0.03])  # model_sampling.timestep -> t, then t / 1000
    expected = model.model.model_sampling.timestep(sigmas).double() / 1000
    assert torch.equal(level({"sigmas": sigmas}), expected)


@pytest.mark.parametrize("schedule,prediction,name", [
    ("ModelSamplingContinuousEDM", "V_PREDICTION", "ModelSamplingContinuousEDM + V_PREDICTION"),
    ("ModelSamplingDiscrete", "EDM", "ModelSamplingDiscrete + EDM"),
    ("ModelSamplingDiscreteEDM", "EPS", "ModelSamplingDiscreteEDM + EPS"),
])
def test_node_refuses_multiband_on_a_sampling_it_cannot_gate(node, monkeypatch, tmp_path, schedule, prediction, name):
    # timestep(σ) of these is 0.25·log σ, not a 0..999 index: t/1000 would be meaningless. A relay reads no noise
    # level and still attaches.
    cd = comfy_double
    sampling = cd.model_sampling(getattr(cd, schedule), getattr(cd, prediction))
    monkeypatch.setattr(node, "anchor_path", lambda name: str(tmp_path / name))
    path = write_anchor(tmp_path, _sd15_anchor(objective="eps"))
    for objective in ("file", "model"):
        with pytest.raises(AnchorError, match=f"samples with {re.escape(name)}, which is neither flow"):
            node.AnimaAnchorLoader.execute(model=_unet_model(sampling), anchor_name=path.name, strength=1.0,
                                           objective=objective)
    relay = write_anchor(tmp_path, _sd15_anchor("relay", objective="eps"), name="relay.safetensors")
    patched = node.AnimaAnchorLoader.execute(model=_unet_model(sampling), anchor_name=relay.name, strength=1.0)
    assert len(patched.values[0].object_patches) == 16


# -- legacy {"relays": {idx: sd}} stacks sit on the blocks they record (issue 10, item 4) --------------------------

def test_legacy_stack_on_odd_blocks_patches_those_blocks(tmp_path):
    from anchor.format import load
    from nodes.anchor_patch import block_patches

    stack = multiband(widths=(D, D))  # two sites, trained on blocks 1 and 3 of a 4-block trunk
    torch.save({"relays": {"1": stack.per_site(0), "3": stack.per_site(1)}}, tmp_path / "odd.pt")
    legacy = load(tmp_path / "odd.pt")
    assert "substrate" not in legacy.meta  # no site names: only the recorded indices say where the sites go

    dit = ToyDiT()
    patcher = FakePatcher(ToyBaseModel(dit))
    patcher.object_patches.update(block_patches(legacy, dit, 1.0, patcher.get_model_object))
    assert sorted(patcher.object_patches) == ["diffusion_model.blocks.1.forward", "diffusion_model.blocks.3.forward"]
    assert legacy.block_indices == [1, 3]
    # the same adapters placed by name: same output, bit for bit
    stack.meta["substrate"]["site_names"] = ["blocks.1", "blocks.3"]
    named = FakePatcher(ToyBaseModel(dit))
    named.object_patches.update(block_patches(stack, dit, 1.0, named.get_model_object))
    x, s = latents(), torch.tensor([0.9, 0.3])
    assert torch.equal(patcher.run(x, s), named.run(x, s))
    assert not torch.equal(patcher.run(x, s), FakePatcher(ToyBaseModel(dit)).run(x, s))
    with pytest.raises(SiteMismatch, match=r"sit on blocks \[1, 3\], but this cosmos_dit trunk has 3"):
        block_patches(legacy, ToyDiT(n=3), 1.0, lambda k: None)
