"""anchor.format and anchor.cli: containers, content hash v2, legacy shapes, kind detection, card, CLI."""
import argparse
import hashlib
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from anchor import AnchorError
from anchor.cli import convert_add_arguments, convert_run, info_add_arguments, info_run
from anchor.format import AnchorFile, content_hash_v2, detect_kind, is_safetensors, load, save
from anchor.modules import fresh_anchor

WORKED_EXAMPLE = {  # the format's published worked example meta (fields: docs/anchor.md#metadata)
    "format": "amoe.diffusion.anchor", "version": 1,
    "display_name": "SD1.5 Multiband — Coarse-to-Fine v1 (seed 0)",
    "adapter": {"kind": "multiband3", "rank": 16},
    "substrate": {"family": "sd15_unet", "n_sites": 2, "base_model_id": "stable-diffusion-v1-5/stable-diffusion-v1-5"},
    "objective": {"kind": "eps"},
    "band_roles": ["fidelity/detail (LOW noise)", "continuity/semantics (MID)", "diversity/structure (HIGH noise)"],
    "usage": "Three sigma-band experts gated per sampling step.",
    "evidence": "exp008, 2 seeds: band lesions surgical 3/3.",
    "recommended_strength": 0.8,
    "caveats": ["Trained on the stock SD1.5 eps trunk; other trunks are untested."],
    "license": "CC-BY-NC-4.0", "nc": True, "dtype": "float32", "seed": 0,
}


def _random_stack(kind, widths, seed=0, **spec):
    """A trained-looking (non-zero) stack; bf16 on one tensor to exercise dtype spelling in the hash."""
    anchor = fresh_anchor(kind, widths, family="cosmos_dit", objective="flow", seed=seed, n_slots=2, K=4, hidden=3,
                          rank=2, **spec)
    g = torch.Generator().manual_seed(seed + 1)
    for k, v in anchor.adapters.items():
        if not k.endswith("addr.home"):
            anchor.adapters[k] = torch.randn(v.shape, generator=g)
    anchor.adapters["0.gate" if kind == "relay" else "0.gates"] = anchor.adapters[
        "0.gate" if kind == "relay" else "0.gates"].bfloat16()
    return anchor


def _site_dicts(anchor):
    return [anchor.per_site(i) for i in range(anchor.n_sites)]


def _same_tensors(a, b):
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["relay", "multiband3"])
def test_round_trip_both_containers_hash_stable(tmp_path, kind):
    anchor = _random_stack(kind, [8, 8, 12])
    anchor.meta.update(display_name="rt", evidence="none measured")
    h_st = save(anchor, tmp_path / "a.safetensors")
    h_pt = save(anchor, tmp_path / "a.pt")
    assert h_st == h_pt == content_hash_v2(anchor.adapters) and h_st.startswith("sha256v2:")
    a_st, a_pt = load(tmp_path / "a.safetensors"), load(tmp_path / "a.pt")
    for back in (a_st, a_pt):
        assert _same_tensors(back.adapters, anchor.adapters)
        assert back.kind == kind and back.widths == [8, 8, 12] and back.meta["content_hash_v2"] == h_st
        assert back.card()["display_name"] == "rt"
    # .pt -> .safetensors -> .pt keeps the hash
    assert save(a_pt, tmp_path / "b.safetensors") == save(load(tmp_path / "b.safetensors"), tmp_path / "b.pt") == h_st
    # The .pt is a plain weights_only payload; the safetensors metadata has the greppable keys.
    blob = torch.load(tmp_path / "a.pt", weights_only=True)
    assert blob["format"] == "amoe.diffusion.anchor" and blob["version"] == 1
    assert ("0.proj.weight" if kind == "relay" else "0.down.0.weight") in blob["adapters"]
    with safe_open(str(tmp_path / "a.safetensors"), "pt") as f:
        md, keys = f.metadata(), list(f.keys())
    assert md["format"] == "amoe.diffusion.anchor" and md["version"] == "1" and md["key_layout"] == "amoe"
    assert md["adapter_kind"] == kind and md["substrate_family"] == "cosmos_dit" and md["content_hash_v2"] == h_st
    assert json.loads(md["amoe_meta"])["display_name"] == "rt"
    assert all(k.startswith("blocks.") for k in keys)


def test_content_hash_v2_definition():
    t = {"1.b": torch.arange(3, dtype=torch.int16), "0.a": torch.tensor(1.5, dtype=torch.bfloat16)}
    h = hashlib.sha256()
    h.update(b"0.a" + b"()" + b"torch.bfloat16" + bytes([0xC0, 0x3F]))  # bf16 1.5 = 0x3FC0, little-endian
    h.update(b"1.b" + b"(3,)" + b"torch.int16" + bytes([0, 0, 1, 0, 2, 0]))
    assert content_hash_v2(t) == "sha256v2:" + h.hexdigest()
    # a non-contiguous view hashes as its contiguous copy
    m = torch.arange(6.0).view(2, 3)
    assert content_hash_v2({"0.x": m.T}) == content_hash_v2({"0.x": m.T.contiguous()})


def test_flipped_byte_is_detected(tmp_path):
    anchor = _random_stack("relay", [8, 8])
    path = tmp_path / "a.safetensors"
    save(anchor, path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(AnchorError, match="content hash mismatch"):
        load(path)
    # .pt: a tensor edited after the hash was written
    save(anchor, tmp_path / "a.pt")
    blob = torch.load(tmp_path / "a.pt", weights_only=True)
    blob["adapters"]["1.gate"] = blob["adapters"]["1.gate"] + 1e-3
    torch.save(blob, tmp_path / "edited.pt")
    with pytest.raises(AnchorError, match="corrupt or edited"):
        load(tmp_path / "edited.pt")


def test_container_is_decided_by_content(tmp_path):
    anchor = _random_stack("multiband3", [4])
    save(anchor, tmp_path / "a.safetensors")
    os.rename(tmp_path / "a.safetensors", tmp_path / "misnamed.pt")
    assert is_safetensors(tmp_path / "misnamed.pt")
    assert load(tmp_path / "misnamed.pt").kind == "multiband3"
    save(anchor, tmp_path / "b.pt")
    assert not is_safetensors(tmp_path / "b.pt")
    os.rename(tmp_path / "b.pt", tmp_path / "b.safetensors")
    assert load(tmp_path / "b.safetensors").widths == [4]


def test_comfy_export_layout_reads_back(tmp_path):
    anchor = _random_stack("relay", [8, 8, 8])
    anchor.meta["substrate"]["site_names"] = ["blocks.0", "blocks.2", "blocks.4"]
    h = save(anchor, tmp_path / "c.safetensors", key_layout="comfy")
    with safe_open(str(tmp_path / "c.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata()["key_layout"] == "comfy"
    assert "diffusion_model.blocks.2.aleph_relay.addr.codebook" in keys
    back = load(tmp_path / "c.safetensors")
    assert _same_tensors(back.adapters, anchor.adapters) and back.meta["content_hash_v2"] == h
    del anchor.meta["substrate"]["site_names"]
    with pytest.raises(AnchorError, match="site_names"):
        save(anchor, tmp_path / "d.safetensors", key_layout="comfy")


def test_legacy_shapes_all_load(tmp_path):
    relay = _random_stack("relay", [8, 8, 16])
    mb = _random_stack("multiband3", [8, 16])
    relay_sites, mb_sites = _site_dicts(relay), _site_dicts(mb)

    def put(name, blob):
        torch.save(blob, tmp_path / name)
        return load(tmp_path / name)

    a = put("relays_list.pt", {"relays": relay_sites})
    assert (a.kind, a.meta["imported_from"], a.widths) == ("relay", "legacy_relays", [8, 8, 16])
    assert _same_tensors(a.adapters, relay.adapters) and "home_reconstructed" not in a.meta

    no_home = [{k: v for k, v in sd.items() if k != "addr.home"} for sd in relay_sites]
    with pytest.raises(AnchorError, match="lacks addr.home"):
        put("relays_list_nohome.pt", {"relays": no_home})

    b = put("relays_dict.pt", {"relays": {"0": no_home[0], "2": no_home[1], "4": no_home[2]}})  # fork half stack
    assert b.kind == "relay" and b.meta["imported_from"] == "diffusion_pipe"
    assert b.meta["home_reconstructed"] is True and b.meta["imported_indices"] == [0, 2, 4]
    assert torch.allclose(b.adapters["1.addr.home"], torch.nn.functional.normalize(no_home[1]["addr.codebook"], dim=-1))
    assert any("drift gauge" in c for c in b.card()["caveats"])

    c = put("relays_dict_mb.pt", {"relays": {"0": mb_sites[0], "1": mb_sites[1]}})
    assert c.kind == "multiband3" and c.meta["imported_indices"] == [0, 1]  # blocks 0 and 1, not every 2nd block
    assert c.block_indices == [0, 1]
    with pytest.raises(AnchorError, match="keyed by block index, found keys .*'first'.*whole number"):
        put("relays_dict_bad.pt", {"relays": {"0": mb_sites[0], "first": mb_sites[1]}})
    with pytest.raises(AnchorError, match="distinct and >= 0"):
        put("relays_dict_dup.pt", {"relays": {"1": mb_sites[0], "01": mb_sites[1]}})

    d = put("mods.pt", {"mods": mb_sites})
    assert (d.kind, d.meta["imported_from"], d.widths) == ("multiband3", "legacy_mods", [8, 16])
    assert put("mods_relay.pt", {"mods": relay_sites}).kind == "relay"

    bank = [{"key_proj.weight": torch.randn(4, 8), "keys": torch.randn(3, 4), "down.0.weight": torch.randn(2, 8),
             "up.0.weight": torch.randn(8, 2)} for _ in range(2)]
    e = put("banks.pt", {"banks": bank})
    assert e.kind == "bank" and e.widths == [8, 8] and not e.attachable  # bank before multiband3
    assert "falsified" in e.card()["evidence"] and "load-only" in e.refusal()

    monos = [{"down.weight": torch.randn(2, 12), "up.weight": torch.randn(12, 2), "up.bias": torch.zeros(12)}]
    f = put("monos.pt", {"monos": monos})
    assert (f.kind, f.widths, f.meta["imported_from"]) == ("mono", [12], "legacy_monos")

    # The fork writes both shapes in one blob: the versioned fields win.
    g = put("dual.pt", {"format": "amoe.diffusion.anchor", "version": 1, "adapters": dict(mb.adapters),
                        "meta": {"adapter": {"kind": "multiband3"}, "imported_from": "diffusion_pipe"},
                        "relays": {"0": relay_sites[0]}})
    assert g.kind == "multiband3" and g.n_sites == 2

    # cond: kind from the tensors when meta has none; width from addr_proj.weight dim 0.
    h = put("cond.pt", {"format": "amoe.diffusion.anchor", "version": 1, "meta": {},
                        "adapters": {"0.pos_table": torch.randn(5, 4), "0.addr_proj.weight": torch.randn(24, 4)}})
    assert (h.kind, h.widths, h.attachable) == ("cond", [24], False)


def test_detect_kind_order():
    assert detect_kind({"addr.codebook": 0, "proj.weight": 0}) == "relay"
    assert detect_kind({"key_proj.weight": 0, "down.0.weight": 0}) == "bank"
    assert detect_kind({"keys": 0}) == "bank"
    assert detect_kind({"pos_table": 0, "down.0.weight": 0}) == "cond"
    assert detect_kind({"down.0.weight": 0}) == "multiband3"
    assert detect_kind({"down.weight": 0}) == "mono"
    assert detect_kind({"lora_A.weight": 0}) == "unknown"


def test_bad_inputs_are_named(tmp_path):
    save_file({"x": torch.zeros(2)}, str(tmp_path / "lora.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AnchorError, match="lora.safetensors.*'pt'.*not an anchor"):
        load(tmp_path / "lora.safetensors")
    save_file({"blocks.0.down.0.weight": torch.zeros(2, 4)}, str(tmp_path / "v2.safetensors"),
              metadata={"format": "amoe.diffusion.anchor", "version": "2"})
    with pytest.raises(AnchorError, match="version '2'"):
        load(tmp_path / "v2.safetensors")
    torch.save({"format": "amoe.anchor", "adapters": {}}, tmp_path / "block.pt")
    with pytest.raises(AnchorError, match="block anchor"):
        load(tmp_path / "block.pt")
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(AnchorError, match="unrecognised torch file"):
        load(tmp_path / "other.pt")
    (tmp_path / "junk.bin").write_bytes(b"not a model at all")
    with pytest.raises(AnchorError, match="junk.bin: not an anchor file"):
        load(tmp_path / "junk.bin")
    anchor = _random_stack("multiband3", [4, 4])
    anchor.meta["substrate"]["n_sites"] = 3
    save(anchor, tmp_path / "n.safetensors")
    with pytest.raises(AnchorError, match="n_sites says 3"):
        load(tmp_path / "n.safetensors")


def test_card_defaults_and_worked_example():
    anchor = AnchorFile({"0.down.0.weight": torch.zeros(2, 8), "1.down.0.weight": torch.zeros(2, 8)},
                        dict(WORKED_EXAMPLE))
    card = anchor.card()
    assert card["display_name"].startswith("SD1.5 Multiband") and card["kind"] == "multiband3"
    assert card["trunk"] == "stable-diffusion-v1-5/stable-diffusion-v1-5" and card["objective"] == "eps"
    assert card["recommended_strength"] == 0.8 and card["nc"] is True and len(card["band_roles"]) == 3
    assert card["license"] == "CC-BY-NC-4.0" and card["caveats"] and card["evidence"].startswith("exp008")
    assert "[NON-COMMERCIAL]" in anchor.card_text()
    bare = AnchorFile({"0.down.weight": torch.zeros(2, 8)}, {"adapter": {"kind": "mono"}}).card()
    assert bare["display_name"] == "unnamed" and bare["recommended_strength"] == 1.0 and bare["nc"] is False
    assert bare["trunk"] == "unknown" and bare["band_roles"] == [] and bare["caveats"] == []
    named = AnchorFile({}, {"name": "legacy name"}).card()
    assert named["display_name"] == "legacy name"


def test_save_is_atomic_and_never_overwrites(tmp_path):
    anchor = _random_stack("relay", [8])
    path = tmp_path / "a.safetensors"
    path.write_bytes(b"user data")
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        save(anchor, path)
    assert path.read_bytes() == b"user data"
    save(anchor, path, overwrite=True)
    assert load(path).widths == [8]
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors"]  # no temp files left behind


def _cli(add, argv):
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


def test_cli_info_and_convert(tmp_path, capsys):
    anchor = _random_stack("multiband3", [8, 16])
    anchor.meta.update({k: v for k, v in WORKED_EXAMPLE.items() if k in ("display_name", "nc", "band_roles")})
    torch.save({"mods": _site_dicts(anchor)}, tmp_path / "legacy.pt")
    out = tmp_path / "out.safetensors"
    assert convert_run(_cli(convert_add_arguments, [str(tmp_path / "legacy.pt"), str(out)])) == 0
    assert load(out).meta["imported_from"] == "legacy_mods"
    before = out.read_bytes()
    assert convert_run(_cli(convert_add_arguments, [str(tmp_path / "legacy.pt"), str(out)])) == 2  # bad input
    assert out.read_bytes() == before and "already exists; give a new output name" in capsys.readouterr().err

    save(anchor, tmp_path / "card.safetensors")
    assert info_run(_cli(info_add_arguments, [str(tmp_path / "card.safetensors")])) == 0
    text = capsys.readouterr().out
    assert "SD1.5 Multiband" in text and "[NON-COMMERCIAL]" in text and "[8,16]" in text and "verified" in text
    assert info_run(_cli(info_add_arguments, ["--json", str(tmp_path / "card.safetensors")])) == 0
    assert json.loads(capsys.readouterr().out)["widths"] == [8, 16]
    assert info_run(_cli(info_add_arguments, [str(tmp_path / "missing.pt")])) == 2
