"""Where an anchor's adapters sit in a trunk: site tables, name mapping, width-signature checks. Pure Python.

Site order is the TRAINING order: diffusers `named_modules()` order, where a UNet registers
down_blocks -> up_blocks -> mid_block (mid is LAST). A denoiser's execution order (input -> middle -> output)
is different; zipping the two positionally misplaces sites and still runs. So: map by site identity (names),
then verify the width signature element by element (docs/anchor.md#sites, #loading-and-attaching).

Names come in two spellings, both accepted wherever a name is read:
    diffusers  down_blocks.0.attentions.0.transformer_blocks.0     transformer_blocks.7
    ComfyUI    input_blocks.1.1.transformer_blocks.0               blocks.7
"""
import math
import re

from . import AnchorError, SiteMismatch

# UNet attention modules (Transformer2DModel / SpatialTransformer) in diffusers order: (name, width, depth).
# Depth = BasicTransformerBlocks per module. SD1.5 and SDXL facts: docs/anchor.md#sites.
_UNET_MODULES = {
    "sd15_unet": [
        ("down_blocks.0.attentions.0", 320, 1), ("down_blocks.0.attentions.1", 320, 1),
        ("down_blocks.1.attentions.0", 640, 1), ("down_blocks.1.attentions.1", 640, 1),
        ("down_blocks.2.attentions.0", 1280, 1), ("down_blocks.2.attentions.1", 1280, 1),
        ("up_blocks.1.attentions.0", 1280, 1), ("up_blocks.1.attentions.1", 1280, 1),
        ("up_blocks.1.attentions.2", 1280, 1),
        ("up_blocks.2.attentions.0", 640, 1), ("up_blocks.2.attentions.1", 640, 1),
        ("up_blocks.2.attentions.2", 640, 1),
        ("up_blocks.3.attentions.0", 320, 1), ("up_blocks.3.attentions.1", 320, 1),
        ("up_blocks.3.attentions.2", 320, 1),
        ("mid_block.attentions.0", 1280, 1),
    ],
    "sdxl_unet": [
        ("down_blocks.1.attentions.0", 640, 2), ("down_blocks.1.attentions.1", 640, 2),
        ("down_blocks.2.attentions.0", 1280, 10), ("down_blocks.2.attentions.1", 1280, 10),
        ("up_blocks.0.attentions.0", 1280, 10), ("up_blocks.0.attentions.1", 1280, 10),
        ("up_blocks.0.attentions.2", 1280, 10),
        ("up_blocks.1.attentions.0", 640, 2), ("up_blocks.1.attentions.1", 640, 2),
        ("up_blocks.1.attentions.2", 640, 2),
        ("mid_block.attentions.0", 1280, 10),
    ],
}
ANIMA_BLOCKS, ANIMA_WIDTH = 28, 2048

_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "net.", "unet.", "transformer.")


def unet_level(family, n_sites):
    """'module' (one site per Transformer2DModel) for 11-site SDXL files, else 'block' (BasicTransformerBlock)."""
    return "module" if family == "sdxl_unet" and n_sites == len(_UNET_MODULES["sdxl_unet"]) else "block"


def _default_n_sites(family, n_blocks):
    if family == "cosmos_dit":
        return n_blocks
    return sum(depth for _, _, depth in _UNET_MODULES[_check_family(family)])


def _check_family(family):
    if family not in ("sd15_unet", "sdxl_unet", "cosmos_dit"):
        raise AnchorError(f"unknown substrate.family {family!r}; expected sd15_unet, sdxl_unet or cosmos_dit")
    return family


def _table(family, n_sites=None, n_blocks=ANIMA_BLOCKS, width=ANIMA_WIDTH):
    """[(diffusers name, width)] in training order for a family at the level implied by n_sites."""
    _check_family(family)
    n_sites = _default_n_sites(family, n_blocks) if n_sites is None else n_sites
    if family == "cosmos_dit":
        step = cosmos_stride(n_sites, n_blocks)
        return [(f"transformer_blocks.{i}", width) for i in range(0, n_blocks, step)]
    modules = _UNET_MODULES[family]
    if unet_level(family, n_sites) == "module":
        rows = [(name, w) for name, w, _ in modules]
    else:
        rows = [(f"{name}.transformer_blocks.{t}", w) for name, w, depth in modules for t in range(depth)]
    if len(rows) != n_sites:
        raise SiteMismatch(f"{family}: the file has {n_sites} sites but this family enumerates {len(rows)} "
                           f"(BasicTransformerBlocks){' or 11 (attention modules)' if family == 'sdxl_unet' else ''}; "
                           "the file was made for a different trunk")
    return rows


def cosmos_stride(n_sites, n_blocks):
    """1 for a full stack (one site per DiT block), 2 for a half stack (every 2nd block, starting at 0)."""
    if n_sites == n_blocks:
        return 1
    if n_sites == math.ceil(n_blocks / 2):
        return 2
    raise SiteMismatch(f"cosmos_dit: the file has {n_sites} sites but the trunk has {n_blocks} blocks "
                       f"(a full stack has {n_blocks}, a half stack {math.ceil(n_blocks / 2)})")


def site_names(family, naming="diffusers", n_sites=None, n_blocks=ANIMA_BLOCKS):
    """Site names in training order. naming: 'diffusers' or 'comfy' (ComfyUI's native module paths, relative to
    `diffusion_model`). n_sites picks the level (SDXL 70 blocks or 11 modules; Cosmos full or half stack)."""
    names = [name for name, _ in _table(family, n_sites, n_blocks)]
    if naming == "diffusers":
        return names
    if naming == "comfy":
        return [to_comfy_name(n) for n in names]
    raise AnchorError(f"naming must be 'diffusers' or 'comfy', got {naming!r}")


def reference_widths(family, n_sites=None, n_blocks=ANIMA_BLOCKS, width=ANIMA_WIDTH):
    """The width signature of the stock trunk in training order (Cosmos: `width` per block, 2048 for Anima)."""
    return [w for _, w in _table(family, n_sites, n_blocks, width)]


def _strip(name):
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name


def to_diffusers_name(name):
    """ComfyUI native -> diffusers spelling (diffusers names pass through). Prefixes like `diffusion_model.` drop.

    UNet rule (SD1.5 and SDXL, 2 resnets per down level, 3 per up level):
    input_blocks.{3i+j+1}.1 <-> down_blocks.i.attentions.j; output_blocks.{3i+j}.1 <-> up_blocks.i.attentions.j;
    middle_block.1 <-> mid_block.attentions.0; Cosmos blocks.i <-> transformer_blocks.i."""
    name = _strip(name)
    if m := re.fullmatch(r"input_blocks\.(\d+)\.1(\..+)?", name):
        n, rest = int(m[1]), m[2] or ""
        if n < 1 or (n - 1) % 3 == 2:
            raise AnchorError(f"site name {name!r}: input_blocks.{n} holds no attention module")
        return f"down_blocks.{(n - 1) // 3}.attentions.{(n - 1) % 3}{rest}"
    if m := re.fullmatch(r"output_blocks\.(\d+)\.1(\..+)?", name):
        n, rest = int(m[1]), m[2] or ""
        return f"up_blocks.{n // 3}.attentions.{n % 3}{rest}"
    if m := re.fullmatch(r"middle_block\.1(\..+)?", name):
        return f"mid_block.attentions.0{m[1] or ''}"
    if m := re.fullmatch(r"blocks\.(\d+)", name):
        return f"transformer_blocks.{m[1]}"
    return name


def to_comfy_name(name):
    """diffusers -> ComfyUI native spelling (native names pass through)."""
    name = _strip(name)
    if m := re.fullmatch(r"down_blocks\.(\d+)\.attentions\.(\d+)(\..+)?", name):
        return f"input_blocks.{3 * int(m[1]) + int(m[2]) + 1}.1{m[3] or ''}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.attentions\.(\d+)(\..+)?", name):
        return f"output_blocks.{3 * int(m[1]) + int(m[2])}.1{m[3] or ''}"
    if m := re.fullmatch(r"mid_block\.attentions\.0(\..+)?", name):
        return f"middle_block.1{m[1] or ''}"
    if m := re.fullmatch(r"transformer_blocks\.(\d+)", name):
        return f"blocks.{m[1]}"
    return name


def execution_rank(name):
    """Sort key giving a UNet denoiser's EXECUTION order (input -> middle -> output) for a site name in either
    spelling; Cosmos blocks execute in index order. Only for showing/testing the positional-zip trap."""
    native = to_comfy_name(name)
    m = re.match(r"(input_blocks|middle_block|output_blocks|blocks)\.?(\d*)", native)
    if not m:
        raise AnchorError(f"site name {name!r} is not a UNet or Cosmos site")
    stage = {"input_blocks": 0, "middle_block": 1, "output_blocks": 2, "blocks": 0}[m[1]]
    block = int(m[2]) if m[2] else 0
    t = re.search(r"transformer_blocks\.(\d+)$", native)
    return (stage, block, int(t[1]) if t else 0)


def site_width(module, name):
    """Output width of a site module, diffusers or ComfyUI: Cosmos Block.x_dim (ComfyUI), Transformer2DModel /
    SpatialTransformer in_channels (their output has the input's channels), a transformer block's attn1 query
    width (BasicTransformerBlock, diffusers' CosmosTransformerBlock)."""
    for attr in ("x_dim", "in_channels"):
        if isinstance(getattr(module, attr, None), int):
            return getattr(module, attr)
    to_q = getattr(getattr(module, "attn1", None), "to_q", None)
    if to_q is not None and hasattr(to_q, "in_features"):
        return int(to_q.in_features)
    raise AnchorError(f"cannot read the width of site {name} ({type(module).__name__})")


def signature_text(widths):
    return "[" + ",".join(str(w) for w in widths) + "]"


def check_widths(expected, got, where="anchor", count=None):
    """Refuse unless the file's width signature equals the host's, element by element. The message prints both
    signatures, the first differing index and every differing index. Of two signatures of different lengths the
    first differing index is the first site only one of them has; `count` says what the counts mean."""
    expected, got = [int(w) for w in expected], [int(w) for w in got]
    if len(expected) != len(got):
        first = min(len(expected), len(got))
        raise SiteMismatch(f"{where}: {count or f'the file has {len(expected)} sites, the host {len(got)}'}; width "
                           f"signature mismatch, first differing index {first} (sites {first}.."
                           f"{max(len(expected), len(got)) - 1} are on one side only).\n"
                           f"  file widths: {signature_text(expected)}\n  host widths: {signature_text(got)}\n"
                           "The file was made for a trunk of another depth; load one made for this model.",
                           expected, got, range(first, max(len(expected), len(got))))
    differing = [i for i, (a, b) in enumerate(zip(expected, got)) if a != b]
    if differing:
        raise SiteMismatch(
            f"{where}: width signature mismatch, first differing index {differing[0]} "
            f"(all differing indices: {differing}).\n"
            f"  file widths: {signature_text(expected)}\n  host widths: {signature_text(got)}\n"
            "The sites are in a different order or belong to another trunk. Sites are matched in training order "
            "(diffusers named_modules: down -> up -> mid); never zip a denoiser's execution order positionally.",
            expected, got, differing)


def resolve_sites(family, widths, host, file_site_names=None, where="anchor", file_block_indices=None):
    """Match a file's sites to a host's sites. Returns the host names in the file's site order.

    family              the file's substrate.family
    widths              the file's width signature (AnchorFile.widths)
    host                [(name, width)] of the host's candidate sites in training order, either spelling
                        (for Cosmos: every block; a half-stack file without names or indices takes every 2nd one)
    file_site_names     meta.substrate.site_names when the file has it: then sites are mapped by name
    file_block_indices  the block indices a legacy {"relays": {idx: sd}} save recorded (AnchorFile.block_indices):
                        site i sits on host candidate number indices[i]. Names win when a file has both.
    """
    n_sites = len(widths)
    host = list(host)
    if file_site_names:
        if len(file_site_names) != n_sites:
            raise SiteMismatch(f"{where}: substrate.site_names lists {len(file_site_names)} names for {n_sites} sites")
        index = {to_diffusers_name(name): i for i, (name, _) in enumerate(host)}
        missing = [n for n in file_site_names if to_diffusers_name(n) not in index]
        if missing:
            raise SiteMismatch(f"{where}: {len(missing)} site names of the file are not in this {family} trunk, "
                               f"e.g. {missing[:3]}; host sites look like {[n for n, _ in host[:2]]}")
        chosen = [host[index[to_diffusers_name(n)]] for n in file_site_names]
    elif file_block_indices is not None:
        indices = [int(i) for i in file_block_indices]
        if len(indices) != n_sites:
            raise SiteMismatch(f"{where}: the file records {len(indices)} block indices for {n_sites} sites")
        outside = [i for i in indices if not 0 <= i < len(host)]
        if outside:
            raise SiteMismatch(f"{where}: the file's sites sit on blocks {indices}, but this {family} trunk has "
                               f"{len(host)} (0..{len(host) - 1}); the file was made for a different trunk",
                               widths, [w for _, w in host])
        chosen = [host[i] for i in indices]
    else:
        if family == "cosmos_dit" and n_sites not in (len(host), math.ceil(len(host) / 2)):
            # neither a full nor a half stack of this trunk (a 28-site Anima-2B file on a 40-block 2.9B): the
            # signature check refuses it, with both signatures
            check_widths(widths, [w for _, w in host], where,
                         count=f"cosmos_dit: the file has {n_sites} sites but the trunk has {len(host)} blocks (a full "
                               f"stack has {len(host)}, a half stack {math.ceil(len(host) / 2)})")
        if family == "cosmos_dit" and n_sites != len(host):
            host = host[::cosmos_stride(n_sites, len(host))]
        if len(host) != n_sites:
            raise SiteMismatch(f"{where}: n_sites mismatch for {family}: the file has {n_sites} sites, the host "
                               f"enumerates {len(host)}; the file was made for a different trunk or level",
                               widths, [w for _, w in host])
        chosen = host
    check_widths(widths, [w for _, w in chosen], where)
    return [name for name, _ in chosen]
