"""anchor.sites: site tables in both namings, name mapping, the positional-zip trap (pure Python, no models)."""
import pytest

from anchor import AnchorError, SiteMismatch
from anchor.sites import (check_widths, execution_rank, reference_widths, resolve_sites, site_names,
                          to_comfy_name, to_diffusers_name)

# SD1.5 width signature in training (diffusers) and execution order (docs/anchor.md#sites).
SD15_TRAINING = [320, 320, 640, 640, 1280, 1280, 1280, 1280, 1280, 640, 640, 640, 320, 320, 320, 1280]
SD15_EXECUTION = [320, 320, 640, 640, 1280, 1280, 1280, 1280, 1280, 1280, 640, 640, 640, 320, 320, 320]


def test_sd15_table_both_namings():
    assert reference_widths("sd15_unet") == SD15_TRAINING
    diff, comfy = site_names("sd15_unet"), site_names("sd15_unet", "comfy")
    assert diff[0] == "down_blocks.0.attentions.0.transformer_blocks.0"
    assert diff[15] == "mid_block.attentions.0.transformer_blocks.0"
    assert [n.rsplit(".transformer_blocks", 1)[0] for n in comfy] == [
        "input_blocks.1.1", "input_blocks.2.1", "input_blocks.4.1", "input_blocks.5.1", "input_blocks.7.1",
        "input_blocks.8.1", "output_blocks.3.1", "output_blocks.4.1", "output_blocks.5.1", "output_blocks.6.1",
        "output_blocks.7.1", "output_blocks.8.1", "output_blocks.9.1", "output_blocks.10.1", "output_blocks.11.1",
        "middle_block.1"]
    assert all(n.endswith(".transformer_blocks.0") for n in comfy)
    assert [to_diffusers_name(n) for n in comfy] == diff and [to_comfy_name(n) for n in diff] == comfy


def test_sdxl_tables_70_and_11():
    blocks, modules = site_names("sdxl_unet"), site_names("sdxl_unet", "comfy", n_sites=11)
    assert len(blocks) == 70 and len(reference_widths("sdxl_unet")) == 70
    assert modules == ["input_blocks.4.1", "input_blocks.5.1", "input_blocks.7.1", "input_blocks.8.1",
                       "output_blocks.0.1", "output_blocks.1.1", "output_blocks.2.1", "output_blocks.3.1",
                       "output_blocks.4.1", "output_blocks.5.1", "middle_block.1"]
    assert reference_widths("sdxl_unet", 11) == [640, 640, 1280, 1280, 1280, 1280, 1280, 640, 640, 640, 1280]
    # 4 + 20 down, 30 + 6 up, 10 mid; blocks within a module in index order
    assert blocks[3] == "down_blocks.1.attentions.1.transformer_blocks.1"
    assert blocks[4] == "down_blocks.2.attentions.0.transformer_blocks.0"
    assert blocks[60:] == [f"mid_block.attentions.0.transformer_blocks.{t}" for t in range(10)]
    assert site_names("sdxl_unet", "comfy")[24] == "output_blocks.0.1.transformer_blocks.0"
    with pytest.raises(SiteMismatch, match="sdxl_unet.*16 sites"):
        site_names("sdxl_unet", n_sites=16)


def test_cosmos_full_and_half_stack():
    assert site_names("cosmos_dit")[:2] == ["transformer_blocks.0", "transformer_blocks.1"]
    assert site_names("cosmos_dit", "comfy", n_sites=14)[:3] == ["blocks.0", "blocks.2", "blocks.4"]
    assert reference_widths("cosmos_dit") == [2048] * 28
    assert to_diffusers_name("diffusion_model.blocks.7") == "transformer_blocks.7"
    with pytest.raises(SiteMismatch, match="cosmos_dit.*13 sites"):
        site_names("cosmos_dit", n_sites=13)


def test_execution_order_signature_matches_spec():
    names = site_names("sd15_unet")
    widths = dict(zip(names, SD15_TRAINING))
    assert [widths[n] for n in sorted(names, key=execution_rank)] == SD15_EXECUTION
    assert sorted(names, key=execution_rank)[6] == "mid_block.attentions.0.transformer_blocks.0"


def test_positional_zip_trap_rejected_at_9_12_15():
    host = list(zip(site_names("sd15_unet"), SD15_TRAINING))
    with pytest.raises(SiteMismatch) as e:
        resolve_sites("sd15_unet", SD15_EXECUTION, host)  # a stack saved in execution order, zipped
    err = e.value
    assert err.differing == [9, 12, 15]
    msg = str(err)
    assert "first differing index 9" in msg and "[9, 12, 15]" in msg
    assert "320,320,640,640,1280,1280,1280,1280,1280,1280,640" in msg  # both signatures printed
    assert "320,320,640,640,1280,1280,1280,1280,1280,640,640" in msg
    # The same stack carrying its site names (native spelling, execution order) maps by identity.
    exec_names = sorted(site_names("sd15_unet", "comfy"), key=execution_rank)
    mapped = resolve_sites("sd15_unet", SD15_EXECUTION, host, file_site_names=exec_names)
    assert mapped == [to_diffusers_name(n) for n in exec_names]
    assert mapped[6] == "mid_block.attentions.0.transformer_blocks.0"


def test_resolve_errors_name_the_problem():
    host = list(zip(site_names("sd15_unet"), SD15_TRAINING))
    with pytest.raises(SiteMismatch, match="n_sites mismatch for sd15_unet.*15 sites"):
        resolve_sites("sd15_unet", SD15_TRAINING[:15], host)
    with pytest.raises(SiteMismatch, match="not in this sd15_unet trunk"):
        resolve_sites("sd15_unet", [320], host, file_site_names=["output_blocks.12.1.transformer_blocks.0"])
    with pytest.raises(AnchorError, match="input_blocks.3 holds no attention module"):
        resolve_sites("sd15_unet", [320], host, file_site_names=["input_blocks.3.1"])
    with pytest.raises(SiteMismatch, match="first differing index 0"):
        check_widths([2048], [1024])
    cosmos = [(f"blocks.{i}", 64) for i in range(6)]
    assert resolve_sites("cosmos_dit", [64] * 3, cosmos) == ["blocks.0", "blocks.2", "blocks.4"]
    assert resolve_sites("cosmos_dit", [64] * 2, cosmos, ["transformer_blocks.1", "blocks.5"]) == ["blocks.1",
                                                                                                   "blocks.5"]


def test_recorded_block_indices_pick_those_blocks():
    # a legacy {"relays": {idx: sd}} half stack on the odd blocks: indices decide, not "every 2nd from 0"
    cosmos = [(f"blocks.{i}", 64) for i in range(6)]
    assert resolve_sites("cosmos_dit", [64] * 3, cosmos, file_block_indices=[1, 3, 5]) == ["blocks.1", "blocks.3",
                                                                                           "blocks.5"]
    assert resolve_sites("cosmos_dit", [64] * 2, cosmos, file_block_indices=[0, 1]) == ["blocks.0", "blocks.1"]
    mixed = [(f"blocks.{i}", 64 if i % 2 else 32) for i in range(6)]  # the width check still runs on them
    with pytest.raises(SiteMismatch, match="first differing index 0"):
        resolve_sites("cosmos_dit", [64] * 3, mixed, file_block_indices=[0, 2, 4])
    with pytest.raises(SiteMismatch, match=r"sit on blocks \[1, 3, 7\], but this cosmos_dit trunk has 6 \(0..5\)"):
        resolve_sites("cosmos_dit", [64] * 3, cosmos, file_block_indices=[1, 3, 7])
    with pytest.raises(SiteMismatch, match="2 block indices for 3 sites"):
        resolve_sites("cosmos_dit", [64] * 3, cosmos, file_block_indices=[1, 3])
    # site names, when a file has them, win over indices
    assert resolve_sites("cosmos_dit", [64], cosmos, ["blocks.4"], file_block_indices=[1]) == ["blocks.4"]
