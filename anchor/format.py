"""The amoe.diffusion.anchor file: read/write both containers, verify content hash v2, detect kind, render card().

In memory an anchor is a flat dict "{site}.{param_path}" -> tensor plus a meta dict (docs/anchor.md#file-format):
    .safetensors  tensors "blocks.{site}.{param_path}" (key_layout "amoe", canonical) or
                  "diffusion_model.{site_name}.aleph_relay.{param_path}" (key_layout "comfy", export only);
                  metadata str->str: format, version, key_layout, amoe_meta (meta as JSON), and greppable copies
                  adapter_kind, substrate_family, content_hash_v2
    .pt           {"format", "version", "meta", "adapters"}; read with torch.load(weights_only=True) only,
                  plus the research line's legacy stack shapes ({"relays"}, {"mods"}, {"banks"|"monos"}).
The container is decided by content (safetensors = 8-byte header length, then '{'), never by the file name.
"""
import copy
import datetime
import hashlib
import json
import os
import sys
import warnings
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import ATTACHABLE_KINDS, FORMAT, VERSION, AnchorError
from .atomic import atomic_path
from .readable import damaged, why_unreadable

HASH_PREFIX = "sha256v2:"

# What the research line wrote about its load-only kinds; shown as evidence when a file carries none.
_NEGATIVE_NOTES = {
    "bank": ("routing_negative", "Comparative dispatch banks on diffusion are a falsified routing line "
                                 "(exp007/014/015, 2 seeds): load for analysis, not deployment."),
    "cond": ("law2_negative", "The frozen address beside full text conditioning was redundant in context "
                              "(exp002, Law-2 negative); kept as a negative result, not as an adapter."),
    "mono": ("control_note", "Single-band monolith: the matched control for multiband3, not a deployable adapter."),
}


def content_hash_v2(adapters):
    """sha256 over the adapters sorted by key; per key: key bytes, str(tuple(shape)), str(dtype) in torch's
    spelling, then the raw little-endian bytes of the contiguous CPU tensor. Same value for both containers."""
    if sys.byteorder != "little":  # the definition is little-endian; tensors in memory are native-endian
        raise AnchorError("content_hash_v2 is defined over little-endian bytes; this host is big-endian")
    h = hashlib.sha256()
    for key in sorted(adapters):
        t = adapters[key].detach().cpu().contiguous()
        h.update(key.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return HASH_PREFIX + h.hexdigest()


def detect_kind(site_state):
    """Kind of one site's state dict. Order matters: a bank carries both key_proj.* and down.0.weight."""
    keys = set(site_state)
    if any(k.endswith("addr.codebook") for k in keys):
        return "relay"
    if any(k.startswith("key_proj") for k in keys) or "keys" in keys:
        return "bank"
    if "pos_table" in keys:
        return "cond"
    if "down.0.weight" in keys:
        return "multiband3"
    if "down.weight" in keys:
        return "mono"
    return "unknown"


_WIDTH_KEYS = (("proj.weight", 1), ("down.0.weight", 1), ("down.weight", 1), ("addr_proj.weight", 0))


@dataclass
class AnchorFile:
    """One adapter stack for one trunk: adapters "{site}.{param_path}" -> tensor, and the meta dict."""
    adapters: dict
    meta: dict = field(default_factory=dict)
    path: str = ""  # where it was read from, for messages

    @property
    def kind(self):
        return self.meta.get("adapter", {}).get("kind", "unknown")

    @property
    def family(self):
        return self.meta.get("substrate", {}).get("family")

    @property
    def objective(self):
        return self.meta.get("objective", {}).get("kind")

    @property
    def site_names(self):
        return self.meta.get("substrate", {}).get("site_names")

    @property
    def block_indices(self):
        """The host block each site sits on, as a legacy {"relays": {idx: sd}} save recorded it (else None)."""
        return self.meta.get("imported_indices")

    @property
    def n_sites(self):
        return len({k.split(".", 1)[0] for k in self.adapters})

    def per_site(self, i):
        prefix = f"{i}."
        return {k[len(prefix):]: v for k, v in self.adapters.items() if k.startswith(prefix)}

    @property
    def widths(self):
        """Per-site hidden width read off the tensors: the alignment signature, in training order."""
        out = []
        for i in range(self.n_sites):
            sd = self.per_site(i)
            for key, dim in _WIDTH_KEYS:
                if key in sd:
                    out.append(int(sd[key].shape[dim]))
                    break
            else:
                raise AnchorError(f"{self.path or 'anchor'}: site {i} has none of "
                                  f"{[k for k, _ in _WIDTH_KEYS]} to read its width from (has {sorted(sd)[:6]})")
        return out

    @property
    def attachable(self):
        return self.kind in ATTACHABLE_KINDS

    def refusal(self):
        """Why this file cannot be attached (None when it can): its evidence, in its own words."""
        if self.attachable:
            return None
        if self.kind not in _NEGATIVE_NOTES:
            return f"kind {self.kind!r} is not an adapter this loader knows"
        note_key, _ = _NEGATIVE_NOTES[self.kind]
        text = self.meta.get(note_key) or self.meta.get("evidence") or _NEGATIVE_NOTES[self.kind][1]
        return f"kind {self.kind!r} is load-only by design (only relay and multiband3 attach): {text}"

    def card(self):
        """The usage card (schema v1.1) with safe defaults: what a UI renders about this adapter."""
        m = self.meta
        caveats = list(m.get("caveats", []))
        if m.get("home_reconstructed"):
            caveats.append("addr.home was rebuilt from the codebook at import (pre-amoe save): the drift gauge "
                           "starts at import, not at training init.")
        evidence = m.get("evidence", "")
        if not evidence and self.kind in _NEGATIVE_NOTES:
            evidence = m.get(_NEGATIVE_NOTES[self.kind][0], "")
        return {
            "display_name": m.get("display_name") or m.get("name") or "unnamed",
            "kind": self.kind,
            "attachable": self.attachable,
            "n_sites": self.n_sites,
            "family": self.family or "unknown",
            "trunk": m.get("substrate", {}).get("base_model_id", "unknown"),
            "objective": self.objective or "unknown",
            "usage": m.get("usage", ""),
            "evidence": evidence,
            "recommended_strength": 1.0 if m.get("recommended_strength") is None else float(m["recommended_strength"]),
            "band_roles": list(m.get("band_roles", [])),
            "caveats": caveats,
            "license": m.get("license", ""),
            "nc": bool(m.get("nc", False)),
            "content_hash_v2": m.get("content_hash_v2", ""),
            "imported_from": m.get("imported_from", ""),
        }

    def card_text(self):
        c = self.card()
        lines = [c["display_name"] + ("   [NON-COMMERCIAL]" if c["nc"] else "")]
        lines.append(f"  kind: {c['kind']}{'' if c['attachable'] else ' (load-only, will not attach)'}"
                     f" · sites: {c['n_sites']} · family: {c['family']} · objective: {c['objective']}")
        lines.append(f"  trunk: {c['trunk']}")
        for key in ("usage", "evidence"):
            if c[key]:
                lines.append(f"  {key}: {c[key]}")
        lines.append(f"  recommended strength: {c['recommended_strength']:g}")
        for i, role in enumerate(c["band_roles"]):
            lines.append(f"  band {i}: {role}")
        for cav in c["caveats"]:
            lines.append(f"  caveat: {cav}")
        lines.append(f"  license: {c['license'] or 'unknown'}" + (" (non-commercial)" if c["nc"] else ""))
        if c["imported_from"]:
            lines.append(f"  imported from: {c['imported_from']}")
        if c["content_hash_v2"]:
            lines.append(f"  content hash: {c['content_hash_v2']}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- reading

def is_safetensors(path):
    """True when the file holds safetensors: an 8-byte little-endian header length, then a JSON object."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    if len(head) < 9 or head[8:9] != b"{":
        return False
    return 0 < int.from_bytes(head[:8], "little") <= size - 8


def load(path):
    """Read an anchor file (either container, any legacy shape), verify its hash, check it is usable as data."""
    path = os.fspath(path)
    problem = why_unreadable(path, "an anchor file")
    if problem:
        raise AnchorError(problem)
    anchor = _load_safetensors(path) if is_safetensors(path) else _load_pt(path)
    anchor.path = path
    _validate(anchor)
    return anchor


def _load_safetensors(path):
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            md = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise AnchorError(damaged(path, "safetensors file", str(e), "re-export or re-download it")) from e
    if md.get("format") != FORMAT:
        raise AnchorError(f"{path}: metadata 'format' is {md.get('format')!r}, expected {FORMAT!r}; "
                          "this safetensors file is not an anchor (a LoRA or a checkpoint?)")
    _check_version(path, md.get("version"))
    try:
        meta = json.loads(md["amoe_meta"]) if "amoe_meta" in md else {}
    except json.JSONDecodeError as e:
        raise AnchorError(f"{path}: metadata 'amoe_meta' is not valid JSON ({e})") from e
    if "amoe_meta" not in md:  # rebuild what the greppable copies carry
        if md.get("adapter_kind"):
            meta["adapter"] = {"kind": md["adapter_kind"]}
        if md.get("substrate_family"):
            meta["substrate"] = {"family": md["substrate_family"]}
    if md.get("content_hash_v2"):
        meta["content_hash_v2"] = md["content_hash_v2"]
    layout = md.get("key_layout", "amoe")
    if layout == "amoe":
        bad = [k for k in tensors if not k.startswith("blocks.")]
        if bad:
            raise AnchorError(f"{path}: key_layout 'amoe' needs keys 'blocks.{{site}}.{{param}}', found {bad[:3]}")
        adapters = {k[len("blocks."):]: v for k, v in tensors.items()}
    elif layout == "comfy":
        names = meta.get("substrate", {}).get("site_names")
        if not names:
            raise AnchorError(f"{path}: key_layout 'comfy' needs meta.substrate.site_names to number its sites")
        index = {n: i for i, n in enumerate(names)}
        adapters = {}
        for key, v in tensors.items():
            body = key[len("diffusion_model."):] if key.startswith("diffusion_model.") else None
            if body is None or ".aleph_relay." not in body:
                raise AnchorError(f"{path}: key {key!r} is not 'diffusion_model.{{site_name}}.aleph_relay.{{param}}'")
            site, param = body.split(".aleph_relay.", 1)
            if site not in index:
                raise AnchorError(f"{path}: key {key!r} names site {site!r}, absent from substrate.site_names")
            adapters[f"{index[site]}.{param}"] = v
    else:
        raise AnchorError(f"{path}: unknown key_layout {layout!r} (expected 'amoe' or 'comfy')")
    return AnchorFile(adapters, meta)


def _check_version(path, version):
    if version is None or str(version) != str(VERSION):
        raise AnchorError(f"{path}: format version {version!r} is not supported (this loader reads {VERSION})")


_TORCH_FILE_STARTS = (b"PK\x03\x04", b"\x80\x02\x8a\x0a")  # torch.save's zip container; its legacy pickle


def _looks_like_torch_file(path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) in _TORCH_FILE_STARTS


def _first_line(exc: Exception) -> str:
    """The reader's own first sentence (torch's zip reader goes on with advice for its own developers)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0][:200]


def _load_pt(path):
    try:  # a file object, not the path: torch.load would route a '.safetensors' name to safetensors itself
        with open(path, "rb") as f, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols are not the user's business
            blob = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        # not torch's text: it advises weights_only=False, which would run whatever code the file holds
        if _looks_like_torch_file(path):  # damaged (cut short, say), not a file of another kind
            raise AnchorError(damaged(path, "torch (.pt) file", _first_line(e), "re-export or re-download it")) from e
        raise AnchorError(f"{path}: not an anchor file: neither safetensors nor a torch file of plain tensors "
                          f"(random bytes, or a pickle of other objects); give the anchor's .safetensors or .pt "
                          f"file") from e
    if not isinstance(blob, dict):
        raise AnchorError(f"{path}: a torch file holding {type(blob).__name__}, expected a dict")
    if "format" in blob:
        if blob["format"] != FORMAT:
            raise AnchorError(f"{path}: 'format' is {blob['format']!r}, expected {FORMAT!r}"
                              + (" (a block anchor for language models, not a diffusion anchor)"
                                 if blob["format"] == "amoe.anchor" else ""))
        _check_version(path, blob.get("version"))
        if not isinstance(blob.get("adapters"), dict):
            raise AnchorError(f"{path}: an {FORMAT} .pt file needs an 'adapters' dict")
        return AnchorFile(dict(blob["adapters"]), copy.deepcopy(dict(blob.get("meta") or {})))
    # Legacy stack shapes of the research line: a list (or {idx: sd}) of per-site state dicts.
    if "relays" in blob:
        relays = blob["relays"]
        if isinstance(relays, dict):  # diffusion-pipe fork save keyed by BLOCK index (a half stack: 0, 2, 4...)
            indices = _block_indices(path, relays)
            anchor = _from_stack(path, [relays[k] for k in sorted(relays, key=int)], "diffusion_pipe",
                                 rebuild_home=True)
            # Kept even when they are 0..n-1: blocks 0 and 1 of a 4-block trunk are not "every 2nd block".
            anchor.meta["imported_indices"] = indices
            return anchor
        return _from_stack(path, list(relays), "legacy_relays")
    for key in ("mods", "banks", "monos"):
        if key in blob:
            return _from_stack(path, list(blob[key]), f"legacy_{key}")
    raise AnchorError(f"{path}: unrecognised torch file (top-level keys {sorted(map(str, blob))[:8]}); expected "
                      f"'format': {FORMAT!r} or a legacy stack under 'relays', 'mods', 'banks' or 'monos'")


def _block_indices(path, relays):
    """The sorted block indices of a {"relays": {idx: sd}} save; a key that is no block number is refused."""
    try:
        indices = sorted(int(k) for k in relays)
    except (TypeError, ValueError):
        raise AnchorError(f"{path}: 'relays' is keyed by block index, found keys {sorted(map(str, relays))[:8]}; "
                          "every key must be a whole number") from None
    if len(set(indices)) != len(indices) or (indices and indices[0] < 0):
        raise AnchorError(f"{path}: 'relays' block indices must be distinct and >= 0, "
                          f"found {sorted(map(str, relays))[:8]}")
    return indices


def _from_stack(path, stack, imported_from, rebuild_home=False):
    if not stack or not all(isinstance(sd, dict) for sd in stack):
        raise AnchorError(f"{path}: {imported_from} stack must be a non-empty list of per-site state dicts")
    kind = detect_kind(stack[0])
    if kind == "unknown":
        raise AnchorError(f"{path}: cannot tell the adapter kind of site 0 from its keys {sorted(stack[0])[:6]}")
    adapters, rebuilt = {}, False
    for i, sd in enumerate(stack):
        sd = dict(sd)
        if kind == "relay" and "addr.home" not in sd:
            if not rebuild_home:
                raise AnchorError(f"{path}: relay site {i} lacks addr.home (the drift gauge); this legacy shape "
                                  "must carry it — load the original save that has it")
            # The fork's pre-amoe saves: home = row-normalised codebook, flagged (never silent).
            sd["addr.home"] = torch.nn.functional.normalize(sd["addr.codebook"].detach().float(), dim=-1)
            rebuilt = True
        adapters.update({f"{i}.{k}": v for k, v in sd.items()})
    meta = {"adapter": {"kind": kind}, "imported_from": imported_from}
    if rebuilt:
        meta["home_reconstructed"] = True
    return AnchorFile(adapters, meta)


def _validate(anchor):
    where = anchor.path or "anchor"
    if not anchor.adapters:
        raise AnchorError(f"{where}: the file holds no adapter tensors")
    sites = sorted({k.split(".", 1)[0] for k in anchor.adapters})
    if not all(s.isdigit() for s in sites) or sorted(map(int, sites)) != list(range(len(sites))):
        raise AnchorError(f"{where}: site indices must be 0..n-1, found {sites[:8]}")
    want = anchor.meta.get("content_hash_v2")
    if want:
        got = content_hash_v2(anchor.adapters)
        if got != want:
            raise AnchorError(f"{where}: content hash mismatch — the tensors were changed after the file was "
                              f"written (corrupt or edited file).\n  stored:   {want}\n  computed: {got}")
    adapter = anchor.meta.setdefault("adapter", {})
    if "kind" not in adapter:  # meta.adapter.kind is authoritative when present; otherwise read the tensors
        adapter["kind"] = detect_kind(anchor.per_site(0))
    if anchor.kind in _NEGATIVE_NOTES:  # load-only kinds carry what they refuted; attach() shows it
        note_key, note = _NEGATIVE_NOTES[anchor.kind]
        anchor.meta.setdefault(note_key, note)
    if anchor.kind == "relay":
        missing = [i for i in range(anchor.n_sites) if f"{i}.addr.home" not in anchor.adapters]
        if missing:
            raise AnchorError(f"{where}: relay sites {missing[:8]} lack addr.home (the drift gauge is required)")
    n_declared = anchor.meta.get("substrate", {}).get("n_sites")
    if n_declared is not None and int(n_declared) != anchor.n_sites:
        raise AnchorError(f"{where}: substrate.n_sites says {n_declared} but the tensors hold {anchor.n_sites} sites")


# ---------------------------------------------------------------------------------------------------- writing

def save(anchor, path, key_layout="amoe", overwrite=False):
    """Write `anchor` atomically. `.safetensors` (by name) gets the safetensors container, anything else `.pt`.
    Refuses to replace an existing file unless overwrite=True. Returns the content hash v2."""
    path = os.fspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; refusing to overwrite it (choose another name or delete it first)")
    adapters = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in anchor.adapters.items()}
    chash = content_hash_v2(adapters)
    meta = copy.deepcopy(anchor.meta)
    meta.setdefault("format", FORMAT)
    meta.setdefault("version", VERSION)
    meta.setdefault("adapter", {}).setdefault("kind", anchor.kind)
    meta.setdefault("created", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    meta["content_hash_v2"] = chash
    if path.endswith(".safetensors"):
        try:
            meta_json = json.dumps(meta)
        except (TypeError, ValueError) as e:
            raise AnchorError(f"{path}: meta must be JSON-serialisable for safetensors ({e})") from e
        if key_layout == "amoe":
            tensors = {f"blocks.{k}": v for k, v in adapters.items()}
        elif key_layout == "comfy":
            names = meta.get("substrate", {}).get("site_names")
            if not names:
                raise AnchorError(f"{path}: key_layout 'comfy' needs meta.substrate.site_names; "
                                  "write the canonical 'amoe' layout instead")
            tensors = {}
            for k, v in adapters.items():
                site, param = k.split(".", 1)
                tensors[f"diffusion_model.{names[int(site)]}.aleph_relay.{param}"] = v
        else:
            raise AnchorError(f"unknown key_layout {key_layout!r} (expected 'amoe' or 'comfy')")
        metadata = {"format": FORMAT, "version": str(VERSION), "key_layout": key_layout, "amoe_meta": meta_json,
                    "adapter_kind": str(meta["adapter"]["kind"]),
                    "substrate_family": str(meta.get("substrate", {}).get("family", "")),
                    "content_hash_v2": chash}
        with atomic_path(path, overwrite) as tmp:
            save_file(tensors, str(tmp), metadata=metadata)
    else:
        if key_layout != "amoe":
            raise AnchorError(f"{path}: key_layout {key_layout!r} exists only for .safetensors")
        blob = {"format": FORMAT, "version": VERSION, "meta": meta, "adapters": adapters}
        with atomic_path(path, overwrite) as tmp:
            torch.save(blob, tmp)
    anchor.meta["content_hash_v2"] = chash
    return chash
