"""What a run will not honour as written: one report from the config and the scanned dataset, built before the model
loads and said once, by `train` and `config` alike (the ComfyUI Train node runs `train`, so its node shows the same
lines). The scan itself says what it leaves out of a folder (data/scan.py: unread image formats, links), and `cache`
and `audit` run the config's own [dataset] rules on their flags (data/latent_cache.py), so every front meets the
same findings.

A finding is a refusal when none of the setting would happen (it can only be a mistake, and a run that ignores it
wastes the GPU time), a warning when part of it does or the input is read in a way its author may not expect:

| finding                                                     | said as | why                                          |
|-------------------------------------------------------------|---------|----------------------------------------------|
| a caption mode that needs `<stem>_nl.txt`, and none has one | refusal | every caption would be the tags              |
| ... and only some sources have one                          | warning | those without train on their tags            |
| caption_mode = "mixed" with every weight 0                  | refusal | no variant can be drawn: tags only           |
| warmup_steps >= the run's steps                             | refusal | the lr never reaches [optimizer] lr          |
| a tags file on several lines                                | warning | each line break separates tags               |
| a caption longer than the text encoder's 512 tokens         | warning | the tokenizers cut it: its tail never trains |
| batch_size no bucket fills, max_steps past the epochs       | warning | data/batches.settings_not_followed           |
"""

from __future__ import annotations

from pathlib import Path

from anima_train.config import ConfigError
from anima_train.data.batches import settings_not_followed
from anima_train.data.captions import CAPTION_VARIANTS, NL_SUFFIX, read_caption_files


def report(cfg, data, per_epoch: int) -> list[str]:
    """The warnings (one line each) for a run of `cfg` on `data` (build_training_data's); raises one ConfigError that
    lists every refusal."""
    warnings = settings_not_followed(cfg, data.sampler, per_epoch)
    refusals: list[str] = []
    texts = _caption_texts(data)
    _caption_variants(cfg, texts, warnings, refusals)
    _line_breaks(texts, warnings)
    _warmup(cfg, per_epoch, refusals)
    if not refusals:  # the tokenizers load only for a run that will go ahead
        _too_long(cfg, texts, warnings)
    if refusals:
        name = str(cfg.source_path) if getattr(cfg, "source_path", None) is not None else "the config"
        raise ConfigError(f"{name}: {refusals[0]}" if len(refusals) == 1 else
                          f"{name}: {len(refusals)} settings would not be honoured:\n"
                          + "\n".join(f"  - {r}" for r in refusals), refusals)
    return warnings


def _caption_texts(data) -> dict[Path, tuple[str, str | None]]:
    """(tags text, NL text or None) per captioned source stem (build_training_data has read them all once)."""
    out = {}
    for src in data.sources:
        if src.stem not in data.dataset.uncaptioned:
            out[src.stem] = read_caption_files(src.stem)
    return out


def _caption_variants(cfg, texts: dict, warnings: list, refusals: list) -> None:
    c = cfg.dataset.caption
    if c.caption_mode == "mixed":
        drawn = [v for v in CAPTION_VARIANTS if float((c.mixed_weights or {}).get(v, 0.0)) > 0]
        if not drawn:
            refusals.append('[dataset.caption] caption_mode = "mixed" with every mixed_weights entry 0: no variant '
                            'can be drawn, so every caption would be the tags; give the variants to mix a weight > 0 '
                            '(e.g. mixed_weights = { tags = 1, nl = 1 }), or set caption_mode = "tags"')
            return
        key = f'caption_mode = "mixed" (mixed_weights {", ".join(v for v in drawn if v != "tags")})'
    else:
        drawn, key = [c.caption_mode], f'caption_mode = "{c.caption_mode}"'
    if all(v == "tags" for v in drawn) or not texts:
        return
    without = sorted(str(stem) for stem, (_, nl) in texts.items() if not (nl or "").strip())
    example = f"{Path(without[0]).name}{NL_SUFFIX}.txt" if without else ""
    if len(without) == len(texts):
        refusals.append(f"[dataset.caption] {key} needs natural-language captions (<stem>{NL_SUFFIX}.txt beside "
                        f"<stem>.txt), but none of the {len(texts)} source(s) has one (e.g. {example}), so every "
                        f"caption would be the tags: write the {NL_SUFFIX}.txt files, or set caption_mode = \"tags\"")
    elif without:
        warnings.append(f"[dataset.caption] {key}: {len(without)} of {len(texts)} source(s) have no (or an empty) "
                        f"<stem>{NL_SUFFIX}.txt and train on their tags instead (e.g. {example})")


def _line_breaks(texts: dict, warnings: list) -> None:
    several = sorted(str(stem) for stem, (tags, _) in texts.items() if len(tags.strip().splitlines()) > 1)
    if several:
        warnings.append(f"{len(several)} tags file(s) hold several lines (e.g. {Path(several[0]).name}.txt): each "
                        f"line break separates tags, as a delimiter does; a natural-language caption goes in "
                        f"<stem>{NL_SUFFIX}.txt")


def _warmup(cfg, per_epoch: int, refusals: list) -> None:
    epochs_total = per_epoch * cfg.train.epochs
    total = min(cfg.train.max_steps, epochs_total) if cfg.train.max_steps else epochs_total
    warmup = cfg.schedule.warmup_steps
    if warmup >= total > 0 and warmup > 1:
        limit = f"max_steps = {cfg.train.max_steps}" if total == cfg.train.max_steps else \
            f"epochs = {cfg.train.epochs} x {per_epoch} step(s)"
        refusals.append(f"[schedule] warmup_steps = {warmup} is not below the run's {total} step(s) ({limit}): the "
                        f"learning rate would still be warming up when the run ends (it reaches "
                        f"{100 * total / warmup:.0f}% of [optimizer] lr at the last step); set warmup_steps below "
                        f"{total} (e.g. {max(0, total // 10)}), or train longer")


def _too_long(cfg, texts: dict, warnings: list) -> None:
    """Captions (tags and NL together, the longest variant) that the tokenizers cut at MAX_SEQUENCE_LENGTH."""
    if not texts:
        return
    # lazy: transformers and torch (several s; model.prompts imports torch): `anima-train config --reference` imports
    # this module and needs neither
    from transformers import AutoTokenizer
    from anima_train.model.prompts import MAX_SEQUENCE_LENGTH

    root = cfg.train.model_path
    longest = {stem: f"{tags.strip()}. {nl.strip()}" if nl and nl.strip() else tags.strip()
               for stem, (tags, nl) in texts.items()}
    stems = sorted(longest, key=str)
    counts = [0] * len(stems)
    for sub in ("tokenizer", "t5_tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(root, subfolder=sub)
        ids = tokenizer([longest[s] for s in stems], add_special_tokens=True, verbose=False)["input_ids"]
        counts = [max(n, len(i)) for n, i in zip(counts, ids)]
    over = [(n, s) for n, s in zip(counts, stems) if n > MAX_SEQUENCE_LENGTH]
    if over:
        n, stem = max(over, key=lambda x: x[0])
        warnings.append(f"{len(over)} caption(s) are longer than the text encoder's {MAX_SEQUENCE_LENGTH} tokens, and "
                        f"their tail is cut off in training (the longest: {stem}.txt, {n} tokens); shorten them or "
                        f"move detail into fewer tags")
