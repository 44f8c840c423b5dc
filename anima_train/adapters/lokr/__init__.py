"""LoKr: ΔW = kron(w1, w2)·alpha/rank, either factor optionally low-rank (peft `LoKrConfig`; LyCORIS' LoKr).

Files: `diffusion_model.<native module>.lokr_w1[_a/_b] / lokr_w2[_a/_b]` (+ `.alpha` where ComfyUI reads one);
the kohya `lora_unet_*` layout is LoRA-only and refused. Its own keys: lokr_factor, lokr_decompose_both.
"""

from anima_train.adapters.base import AdapterMethod


def check(adapter, rules) -> None:
    if rules.ok("lokr_factor") and adapter.lokr_factor != -1 and adapter.lokr_factor < 1:
        rules.error(f"[adapter] lokr_factor = {adapter.lokr_factor}: use -1 (most balanced) or a factor >= 1",
                    "lokr_factor")


def _factor(dimension: int, factor: int) -> tuple[int, int]:
    """peft's split of a dimension into (m, n), m <= n, m·n = dimension: `factor` when it divides it, else the
    divisor pair nearest the square root with m <= factor (-1: no bound)."""
    if factor > 0 and dimension % factor == 0:
        return factor, dimension // factor
    bound = dimension if factor == -1 else factor
    m, n = 1, dimension
    while m < n:
        new_m = m + 1
        while dimension % new_m:
            new_m += 1
        new_n = dimension // new_m
        if new_m + new_n > 1 + dimension or new_m > bound:
            break
        m, n = new_m, new_n
    return (n, m) if m > n else (m, n)


def parameters(adapter, in_features: int, out_features: int) -> int:
    """The factors peft makes on one Linear: w1 [a, c] (or a rank-r pair with lokr_decompose_both, when r is below
    half of its larger side), w2 [b, d] (a rank-r pair when r is below half of its larger side), out = a·b, in =
    c·d."""
    r, factor = adapter.rank, adapter.lokr_factor
    (a, b), (c, d) = _factor(out_features, factor), _factor(in_features, factor)
    w1 = r * (a + c) if adapter.lokr_decompose_both and r < max(a, c) / 2 else a * c
    w2 = r * (b + d) if r < max(b, d) / 2 else b * d
    return w1 + w2


METHOD = AdapterMethod(
    name="lokr",
    kind="lokr",
    title="LoKr",
    order=1,
    summary="",
    layout="LoKr files use diffusion_model.<module>.lokr_* keys, which ComfyUI loads",
    dropout="rank dropout",
    shape_keys=("rank", "lokr_factor", "lokr_decompose_both"),
    text_encoder=False,
    check=check,
    network_module="lycoris.kohya",
    architecture="/lycoris",
    network_args={"algo": "lokr"},
    parameters=parameters,
    factors=("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "alpha"),
)
