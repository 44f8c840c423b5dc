"""anchor.attach on tiny diffusers trunks that keep the real block topology (SD1.5, SDXL, Cosmos/Anima)."""
import pytest
import torch

from anchor import AnchorError, SiteMismatch
from anchor.attach import attach, host_sites, s01_from_sigma
from anchor.format import load, save
from anchor.modules import band_weights, fresh_anchor
from anchor.sites import execution_rank, site_names

diffusers = pytest.importorskip("diffusers")

SD15_TRAINING = [320, 320, 640, 640, 1280, 1280, 1280, 1280, 1280, 640, 640, 640, 320, 320, 320, 1280]
SD15_EXECUTION = [320, 320, 640, 640, 1280, 1280, 1280, 1280, 1280, 1280, 640, 640, 640, 320, 320, 320]
SMALL = dict(n_slots=2, K=8, hidden=6, rank=2)


@pytest.fixture(scope="module")
def sd15():
    """SD1.5 block topology, channels /10: (32, 64, 128, 128)."""
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(sample_size=8, block_out_channels=(32, 64, 128, 128), layers_per_block=2,
                                          cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32).eval()


@pytest.fixture(scope="module")
def sdxl():
    """SDXL block topology (no attention at level 0, depths 2 and 10), small channels, no text_time embedding."""
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=8, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), block_out_channels=(32, 32, 64),
        layers_per_block=2, transformer_layers_per_block=(1, 2, 10), cross_attention_dim=32, attention_head_dim=8,
        norm_num_groups=32).eval()


@pytest.fixture(scope="module")
def cosmos():
    torch.manual_seed(0)
    return diffusers.CosmosTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                              attention_head_dim=16, num_layers=4, text_embed_dim=32, adaln_lora_dim=8,
                                              max_size=(2, 16, 16)).eval()


def unet_inputs(t=(500, 20)):
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 4, 8, 8, generator=g), torch.tensor(t), torch.randn(2, 5, 32, generator=g)


def run_unet(unet, t=(500, 20)):
    x, tt, c = unet_inputs(t)
    with torch.no_grad():
        return unet(x, tt, c).sample


def run_cosmos(model, sigma=(0.9, 0.9)):
    g = torch.Generator().manual_seed(2)
    x, ctx = torch.randn(2, 4, 1, 8, 8, generator=g), torch.randn(2, 5, 32, generator=g)
    with torch.no_grad():
        return model(x, torch.tensor(sigma), ctx, padding_mask=torch.zeros(1, 1, 8, 8)).sample


def trained(anchor, seed=0, scale=0.3):
    """Replace the inert init with random weights so the adapter does something (addr.home stays)."""
    g = torch.Generator().manual_seed(seed)
    for k, v in anchor.adapters.items():
        if not k.endswith("addr.home"):
            anchor.adapters[k] = torch.randn(v.shape, generator=g) * scale
    return anchor


def widths_of(model, family, n_sites):
    return [w for _, _, w, _ in host_sites(model, family, n_sites)]


def no_hooks(model):
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_real_size_sd15_unet_has_the_spec_signature_and_rejects_execution_order():
    with torch.device("meta"):  # the real SD1.5 UNet, no memory: only names and shapes are read
        unet = diffusers.UNet2DConditionModel(cross_attention_dim=768)
    assert widths_of(unet, "sd15_unet", 16) == SD15_TRAINING
    assert [n for n, *_ in host_sites(unet, "sd15_unet", 16)] == site_names("sd15_unet")
    zipped = fresh_anchor("multiband3", SD15_EXECUTION, family="sd15_unet", rank=1)
    with pytest.raises(SiteMismatch, match="first differing index 9") as e:
        attach(unet, zipped)
    assert e.value.differing == [9, 12, 15]
    named = fresh_anchor("multiband3", SD15_EXECUTION, family="sd15_unet", rank=1,
                         site_names=sorted(site_names("sd15_unet", "comfy"), key=execution_rank))
    with pytest.raises(AnchorError, match="meta device"):  # mapping and signature pass; weights are not there
        attach(unet, named)


def test_tiny_sd15_trap_and_identity_mapping(sd15):
    widths = widths_of(sd15, "sd15_unet", 16)
    assert widths == [w // 10 for w in SD15_TRAINING]  # same pattern as the real trunk
    exec_widths = [w // 10 for w in SD15_EXECUTION]
    with pytest.raises(SiteMismatch) as e:
        attach(sd15, fresh_anchor("relay", exec_widths, family="sd15_unet", **SMALL))
    assert e.value.differing == [9, 12, 15]
    exec_names = sorted(site_names("sd15_unet", "comfy"), key=execution_rank)
    anchor = trained(fresh_anchor("relay", exec_widths, family="sd15_unet", site_names=exec_names, **SMALL))
    base = run_unet(sd15)
    with attach(sd15, anchor) as att:
        assert att.site_names[6] == "mid_block.attentions.0.transformer_blocks.0"
        assert att.site_names[15] == "up_blocks.3.attentions.2.transformer_blocks.0"
        assert [a.d for a in att.adapters] == exec_widths
        assert not torch.equal(run_unet(sd15), base)
    assert torch.equal(run_unet(sd15), base) and no_hooks(sd15)


def test_fresh_is_inert_strength_zero_and_detach_are_bit_exact(sd15):
    before = {k: v.clone() for k, v in sd15.state_dict().items()}
    base = run_unet(sd15)
    widths = widths_of(sd15, "sd15_unet", 16)
    with attach(sd15, fresh_anchor("relay", widths, family="sd15_unet", **SMALL)):
        assert torch.equal(run_unet(sd15), base)  # fresh adapters: exactly inert
    anchor = trained(fresh_anchor("multiband3", widths, family="sd15_unet", objective="eps", **SMALL), scale=0.5)
    anchor.meta["recommended_strength"] = 0.6
    att = attach(sd15, anchor)
    assert att.strength == 0.6  # the card's default
    moved = run_unet(sd15)
    assert (moved - base).abs().max() > 1e-4
    assert sd15.state_dict().keys() == before.keys()  # adapters are not in the trunk's state dict
    att.strength = 0.0
    assert torch.equal(run_unet(sd15), base)
    att.strength = 0.6
    assert torch.equal(run_unet(sd15), moved)
    att.detach()
    assert torch.equal(run_unet(sd15), base) and no_hooks(sd15)
    assert all(torch.equal(v, before[k]) for k, v in sd15.state_dict().items())
    att.detach()  # idempotent


def test_eps_trunk_gates_on_timestep_over_1000(sd15):
    widths = widths_of(sd15, "sd15_unet", 16)
    att = attach(sd15, trained(fresh_anchor("multiband3", widths, family="sd15_unet", objective="eps", **SMALL)))
    run_unet(sd15, t=(900, 100))
    assert att.s01.tolist() == pytest.approx([0.9, 0.1])
    att.detach()


def test_hook_adds_strength_times_delta(cosmos):
    anchor = trained(fresh_anchor("multiband3", [32] * 4, family="cosmos_dit", objective="flow", **SMALL))
    seen = {}
    raw = cosmos.transformer_blocks[1].register_forward_hook(lambda m, a, out: seen.__setitem__("raw", out.clone()))
    att = attach(cosmos, anchor, strength=0.7)
    new = cosmos.transformer_blocks[1].register_forward_hook(lambda m, a, out: seen.__setitem__("new", out.clone()))
    try:
        run_cosmos(cosmos, sigma=(0.3, 0.74))
        w = band_weights(torch.tensor([0.3, 0.74]))
        expected = seen["raw"] + 0.7 * att.adapters[1].delta(seen["raw"], w)
        assert torch.allclose(seen["new"], expected, atol=1e-6)
        assert not torch.allclose(seen["new"], seen["raw"])
    finally:
        raw.remove(), new.remove(), att.detach()


def test_flow_trunk_uses_sigma_not_timestep_over_1000(cosmos):
    assert s01_from_sigma("flow", 0.9) == 0.9
    assert s01_from_sigma("eps", 900) == pytest.approx(0.9) and s01_from_sigma("v", 350) == pytest.approx(0.35)
    with pytest.raises(AnchorError, match="pass sigma"):
        s01_from_sigma("flow", torch.tensor([900.0]))
    with pytest.raises(AnchorError, match="objective"):
        s01_from_sigma("x0", 0.5)
    anchor = trained(fresh_anchor("multiband3", [32] * 4, family="cosmos_dit", objective="flow", **SMALL))
    base = run_cosmos(cosmos, sigma=(0.9, 0.9))
    with attach(cosmos, anchor) as att:
        moved = run_cosmos(cosmos, sigma=(0.9, 0.9))
        assert att.s01.tolist() == pytest.approx([0.9, 0.9])  # the DiT's timestep IS sigma
        assert not torch.equal(moved, base)
        att.set_band_enabled(0, False)  # sigma 0.9 is all HIGH: lesioning LOW changes nothing
        assert torch.equal(run_cosmos(cosmos, sigma=(0.9, 0.9)), moved)
        att.set_band_enabled(0, True)
        att.set_band_enabled(2, False)  # ... and lesioning HIGH removes the whole effect
        assert torch.equal(run_cosmos(cosmos, sigma=(0.9, 0.9)), base)
    # Had s01 been timestep/1000 (0.0009), every step would gate LOW:
    assert band_weights(0.9).tolist() == [0.0, 0.0, 1.0] and band_weights(0.0009).tolist() == [1.0, 0.0, 0.0]


def test_manual_noise_level(cosmos):
    anchor = trained(fresh_anchor("multiband3", [32] * 4, family="cosmos_dit", objective="flow", **SMALL))
    with attach(cosmos, anchor, noise_level="manual") as att:
        with pytest.raises(AnchorError, match="set_noise_level"):
            run_cosmos(cosmos)
        att.set_sigma(0.9)
        a = run_cosmos(cosmos, sigma=(0.9, 0.9))
        att.set_noise_level(0.1)  # manual mode: the model's timestep argument is not read
        b = run_cosmos(cosmos, sigma=(0.9, 0.9))
        assert att.s01 == 0.1 and not torch.equal(a, b)


def test_half_stack_path_and_declared_dtype(cosmos, tmp_path):
    anchor = trained(fresh_anchor("relay", [32, 32], family="cosmos_dit", objective="flow", **SMALL))
    save(anchor, tmp_path / "half.safetensors")
    with attach(cosmos, str(tmp_path / "half.safetensors")) as att:
        assert att.site_names == ["transformer_blocks.0", "transformer_blocks.2"]
        assert att.adapters[0].proj.weight.dtype == torch.float32
    with attach(cosmos, load(tmp_path / "half.safetensors"), dtype=torch.bfloat16) as att:
        assert {p.dtype for p in att.adapters.parameters()} == {torch.bfloat16}
        assert run_cosmos(cosmos).dtype == torch.float32  # delta cast back to the block's output dtype
    with pytest.raises(SiteMismatch, match="file is for sd15_unet"):
        attach(cosmos, fresh_anchor("relay", [32] * 4, family="sd15_unet", **SMALL))
    with pytest.raises(SiteMismatch, match="cosmos_dit: the file has 3 sites"):
        attach(cosmos, fresh_anchor("relay", [32] * 3, family="cosmos_dit", **SMALL))


def test_sdxl_block_and_module_levels(sdxl):
    assert len(host_sites(sdxl, "sdxl_unet", 70)) == 70
    module_widths = widths_of(sdxl, "sdxl_unet", 11)
    assert module_widths == [32, 32, 64, 64, 64, 64, 64, 32, 32, 32, 64]  # the SDXL pattern 640/1280 scaled
    base = run_unet(sdxl)
    with attach(sdxl, fresh_anchor("relay", widths_of(sdxl, "sdxl_unet", 70), family="sdxl_unet", **SMALL)) as att:
        assert att.site_names[-1] == "mid_block.attentions.0.transformer_blocks.9"
        assert torch.equal(run_unet(sdxl), base)
    anchor = trained(fresh_anchor("multiband3", module_widths, family="sdxl_unet", objective="eps", **SMALL))
    with attach(sdxl, anchor) as att:  # Transformer2DModel outputs [B, C, H, W]: adapter on the channel axis
        assert att.site_names[0] == "down_blocks.1.attentions.0"
        assert not torch.equal(run_unet(sdxl), base)
    assert torch.equal(run_unet(sdxl), base) and no_hooks(sdxl)


def test_load_only_kinds_are_refused_with_their_evidence(sd15, tmp_path):
    bank = [{"key_proj.weight": torch.randn(4, 32), "down.0.weight": torch.randn(2, 32)} for _ in range(16)]
    torch.save({"banks": bank}, tmp_path / "bank.pt")
    with pytest.raises(AnchorError, match="load-only.*falsified routing"):
        attach(sd15, str(tmp_path / "bank.pt"))
    mono = fresh_anchor("relay", [32], **SMALL)
    mono.adapters = {"0.down.weight": torch.zeros(2, 32), "0.up.weight": torch.zeros(32, 2)}
    mono.meta = {"adapter": {"kind": "mono"}, "evidence": "matched rank-48 control, 2 seeds"}
    with pytest.raises(AnchorError, match="matched rank-48 control"):
        attach(sd15, mono)


def high_band_only(anchor, seed=0):
    """Weights only in the HIGH band (2): the output moves only at sigma above the 0.75 edge's crossfade."""
    g = torch.Generator().manual_seed(seed)
    for k, v in anchor.adapters.items():
        if ".up.2." in k:
            anchor.adapters[k] = torch.randn(v.shape, generator=g) * 0.3
    return anchor


@pytest.mark.parametrize("tag", ["eps", "v"])
def test_eps_v_file_on_a_flow_trunk_is_refused_unless_told_to_follow_the_trunk(cosmos, tag):
    anchor = high_band_only(fresh_anchor("multiband3", [32] * 4, family="cosmos_dit", objective=tag, **SMALL))
    with pytest.raises(AnchorError, match=f"objective is '{tag}' .*samples as flow .*LOW band.*objective='model'"):
        attach(cosmos, anchor)
    assert no_hooks(cosmos)
    base = run_cosmos(cosmos, sigma=(0.9, 0.9))
    with attach(cosmos, anchor, objective="model") as att:
        assert not torch.equal(run_cosmos(cosmos, sigma=(0.9, 0.9)), base)  # σ 0.9 gates HIGH
        assert att.s01.tolist() == pytest.approx([0.9, 0.9])


def test_flow_file_on_a_unet_is_refused(sd15):
    anchor = fresh_anchor("multiband3", widths_of(sd15, "sd15_unet", 16), family="sd15_unet", objective="flow", **SMALL)
    with pytest.raises(AnchorError, match=r"objective is 'flow' .*samples as eps/v \(UNet2DConditionModel\)"):
        attach(sd15, anchor)


def test_legacy_file_on_a_dit_gates_by_sigma(cosmos):
    # no substrate.family, no objective: the Cosmos host is a flow trunk (t/1000 would gate every step LOW)
    legacy = high_band_only(fresh_anchor("multiband3", [32] * 4, **SMALL))
    del legacy.meta["substrate"]
    base = run_cosmos(cosmos, sigma=(0.9, 0.9))
    with attach(cosmos, legacy) as att:
        assert att.objective == "flow"
        assert not torch.equal(run_cosmos(cosmos, sigma=(0.9, 0.9)), base)


def test_legacy_relay_stack_on_odd_blocks(cosmos, tmp_path):
    # {"relays": {idx: sd}} keyed by block: a stack trained on blocks 1 and 3 sits on blocks 1 and 3
    stack = trained(fresh_anchor("relay", [32, 32], **SMALL))
    torch.save({"relays": {"3": stack.per_site(1), "1": stack.per_site(0)}}, tmp_path / "odd.pt")
    legacy = load(tmp_path / "odd.pt")
    with attach(cosmos, legacy) as att:
        assert att.site_names == ["transformer_blocks.1", "transformer_blocks.3"]
        legacy_out = run_cosmos(cosmos)
    stack.meta["substrate"] = {"family": "cosmos_dit", "site_names": ["blocks.1", "blocks.3"]}
    with attach(cosmos, stack) as att:
        assert torch.equal(run_cosmos(cosmos), legacy_out)


def test_adapters_take_the_declared_dtype_not_the_first_parameter():
    torch.manual_seed(0)
    model = diffusers.CosmosTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                               attention_head_dim=16, num_layers=2, text_embed_dim=32,
                                               adaln_lora_dim=8, max_size=(2, 16, 16)).to(torch.bfloat16).eval()
    model.patch_embed.float()  # an input layer kept in fp32 (the model's first parameter); the blocks run in bf16
    assert next(model.parameters()).dtype == torch.float32 and model.dtype == torch.float32
    anchor = trained(fresh_anchor("multiband3", [32] * 2, family="cosmos_dit", objective="flow", **SMALL))
    with attach(model, anchor) as att:
        assert {p.dtype for p in att.adapters.parameters()} == {torch.bfloat16}
    with attach(model, anchor, dtype=torch.float32) as att:  # the caller's declaration wins
        assert {p.dtype for p in att.adapters.parameters()} == {torch.float32}
    # weights stored in fp8, computed in bf16 (diffusers layerwise casting): the compute dtype
    model.float().enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    with attach(model, anchor) as att:
        assert {p.dtype for p in att.adapters.parameters()} == {torch.bfloat16}
