"""Anima: Load anchor: attach an `amoe.diffusion.anchor` adapter stack (relay / multiband3) to a MODEL.

The file comes from `models/anchors/` (registered here as the model folder "anchors"; extra_model_paths.yaml may
add more with an `anchors:` entry). The node returns a patched clone of the MODEL — the input model is never
touched, so other branches of the graph keep the plain trunk — and the file's usage card as a STRING; the card is
also drawn on the node by js/anchor_card.js (ui key "anchor_card").

Strength: the widget default -1 (any negative value) means "the card's recommended_strength", since a widget
default cannot depend on the chosen file. 0 leaves every block output bit-exact.

The patching logic is in anchor_patch.py (no ComfyUI import); ComfyUI's model folders are reached through
nodes/comfy.py, the pack's one door to ComfyUI.
"""
from __future__ import annotations

import os

from anchor import OBJECTIVE_SOURCES, AnchorError
from anchor.format import load
from anchor.sites import signature_text

from . import comfy
from .anchor_patch import block_patches, resolve_strength
from .comfy import CATEGORY, io

ANCHOR_FOLDER = "anchors"
LISTED_EXTENSIONS = (".safetensors", ".pt", ".pth", ".sft")  # the content decides the container, not the name
STRENGTH_FROM_CARD = -1.0
GATE_TEXT = {"flow": "flow, s01 = sigma", "eps": "eps/v, s01 = t/1000", "v": "eps/v, s01 = t/1000"}


def anchor_files():
    """Anchor files ComfyUI can see, for the combo; [] outside ComfyUI."""
    try:
        comfy.add_model_folder(ANCHOR_FOLDER)
    except ImportError:
        return []
    return [f for f in comfy.model_files(ANCHOR_FOLDER) if f.lower().endswith(LISTED_EXTENSIONS)]


def anchor_path(name):
    comfy.add_model_folder(ANCHOR_FOLDER)
    return comfy.model_path(ANCHOR_FOLDER, name)


def _declared_dtype(model):
    """The trunk's compute dtype as configured (manual cast included), not a sniffed parameter
    (docs/anchor.md#declared-dtype)."""
    base = model.model
    if hasattr(base, "get_dtype_inference"):
        return base.get_dtype_inference()
    return model.model_dtype()


def apply_anchor(model, anchor, strength, objective="file"):
    """(patched clone of a ComfyUI ModelPatcher, strength used, objective gating the bands). Everything is checked
    before the clone exists, including the file's objective against the model's sampling (flow vs eps/v)."""
    strength = resolve_strength(strength, anchor)
    model_sampling = model.get_model_object("model_sampling")
    patches = block_patches(anchor, model.get_model_object("diffusion_model"), strength,
                            get_forward=model.get_model_object, dtype=_declared_dtype(model),
                            timestep_fn=getattr(model_sampling, "timestep", None),
                            sampling=comfy.model_sampling_kind(model_sampling), objective=objective)
    patched = model.clone()
    for key, patch in patches.items():
        patched.add_object_patch(key, patch)
    gate = next(iter(patches.values())).noise_level.objective
    return patched, strength, gate


def card_for_ui(anchor, name, strength):
    """The card plus what this node did, JSON-serialisable for the `executed` message."""
    card = anchor.card()
    card.update(file=name, strength=strength, widths=signature_text(anchor.widths))
    return card


def card_text(anchor, strength, gate=None):
    recommended = anchor.card()["recommended_strength"]
    note = "the card's recommended value" if strength == recommended else f"card recommends {recommended:g}"
    text = (anchor.card_text() + f"\n  strength used: {strength:g} ({note})"
            + f"\n  width signature ({anchor.n_sites} sites): {signature_text(anchor.widths)}")
    if gate and anchor.kind == "multiband3":
        source = "the file's objective" if anchor.objective == gate else "the model's sampling"
        text += f"\n  bands gated as {GATE_TEXT[gate]} ({source})"
    return text


class AnimaAnchorLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="AnimaAnchorLoader",
            display_name="Anima: Load anchor",
            category=CATEGORY,
            description="Attach an amoe.diffusion.anchor block adapter (relay or multiband3) to a model. Returns "
                        "a patched copy of the model (the input stays unpatched) and the file's usage card. "
                        "multiband3 anchors read each sampling step's noise level and gate their three bands.",
            inputs=[
                io.Model.Input("model"),
                io.Combo.Input("anchor_name", options=anchor_files(),
                               tooltip="an anchor file in models/anchors (.safetensors, or .pt saved by the "
                                       "research line)"),
                io.Float.Input("strength", default=STRENGTH_FROM_CARD, min=-1.0, max=5.0, step=0.05,
                               tooltip="scale of the adapter's change to each block output. -1 (any negative "
                                       "value) = the card's recommended_strength; 0 = no effect (bit-exact)."),
                io.Combo.Input("objective", options=list(OBJECTIVE_SOURCES), default="file", optional=True,
                               tooltip="which noise level gates a multiband anchor's bands. file: the file's "
                                       "objective (flow, eps or v); a model that samples the other way (flow vs "
                                       "eps/v) is refused. model: follow the model's own sampling whatever the "
                                       "file says; only for a file whose objective is tagged wrongly."),
            ],
            outputs=[io.Model.Output(display_name="MODEL"), io.String.Output(display_name="card")],
        )

    @classmethod
    def fingerprint_inputs(cls, anchor_name=None, strength=None, **_):
        # Re-run when the file itself changes under the same name (a re-trained anchor copied over the old one).
        try:
            st = os.stat(anchor_path(anchor_name))
            return f"{anchor_name}|{st.st_mtime_ns}|{st.st_size}|{strength}"
        except Exception:  # unresolvable here: execute() reports it properly
            return f"{anchor_name}|{strength}"

    @classmethod
    def execute(cls, model, anchor_name, strength=STRENGTH_FROM_CARD, objective="file"):
        try:
            path = anchor_path(anchor_name)
        except FileNotFoundError as e:
            raise AnchorError(f"anchor {anchor_name!r} is not in models/{ANCHOR_FOLDER} ({e})") from e
        anchor = load(path)
        patched, used, gate = apply_anchor(model, anchor, strength, objective)
        card = card_for_ui(anchor, anchor_name, used)
        return io.NodeOutput(patched, card_text(anchor, used, gate), ui={"anchor_card": [card]})


NODES = [AnimaAnchorLoader]
