"""What a user coming from sd-scripts (or another trainer) types, and what it is called here.

An unknown config key is answered with the closest real key (validate.unknown_key). Spelling is not enough: the
names users actually type are other trainers' names (`learning_rate`, `network_dim`, `max_train_steps`), which share
few letters with ours (`lr`, `rank`, `max_steps`). So the suggestion looks, in order, at

  1. ALIASES: a foreign name -> our `table.key` (same meaning, maybe another unit or table);
  2. NO_EQUIVALENT: a foreign name with no counterpart here -> what to do instead;
  3. LOCAL_SYNONYMS: `type` in a table that calls it `kind`;
  4. spelling: the closest key of the same table, unless an alias (a typo of `learning_rate`) or a key of another
     table (a key written in the wrong table, maybe with a typo) is clearly closer.

The tables are listed in docs/config.md (reference.py) so a user can look a name up before typing it.
No imports of the config's own modules: validate.py imports this one.
"""

from __future__ import annotations

import difflib

from anima_train.fixes import ref

# sd-scripts' name (or a common synonym) -> our dotted key. Keys whose name is already the same here (seed,
# output_dir, gradient_checkpointing, max_grad_norm, ...) need no entry: a same-named key in another table is found
# by the loader itself.
ALIASES: dict[str, str] = {
    # [train]
    "pretrained_model_name_or_path": "train.model_path",
    "output_name": "train.run_name",
    "max_train_epochs": "train.epochs",
    "max_epochs": "train.epochs",
    "epoch": "train.epochs",
    "max_train_steps": "train.max_steps",
    "steps": "train.max_steps",
    "train_batch_size": "train.batch_size",
    "mixed_precision": "train.dtype",
    "save_precision": "train.dtype",
    "full_bf16": "train.dtype",
    "full_fp16": "train.dtype",
    "precision": "train.dtype",
    "max_data_loader_n_workers": "train.num_workers",
    "save_every_n_steps": "train.save_every_steps",
    # [validation] (sd-scripts: validation_split, validation_seed, validate_every_n_steps/epochs)
    "validation_split": "validation.fraction",
    "validation_seed": "validation.seed",
    "validate_every_n_steps": "validation.every_n_steps",
    "validate_every_n_epochs": "validation.every_n_epochs",
    "save_every_n_epochs": "train.save_every_epochs",
    "save_last_n_steps": "train.keep_last_n",
    "save_last_n_epochs": "train.keep_last_n",
    "save_state": "train.save_optimizer_state",
    "resume": "train.resume_from",
    "torch_compile": "train.compile",
    # [dataset]
    "train_data_dir": "dataset.path",
    "image_dir": "dataset.path",
    "dataset_repeats": "dataset.num_repeats",
    "shuffle_caption": "dataset.caption.shuffle_tags",
    "keep_tokens": "dataset.caption.shuffle_keep_first_n",
    "caption_dropout_rate": "dataset.caption.caption_dropout_percent",
    "caption_tag_dropout_rate": "dataset.caption.tag_dropout_percent",
    # [flow]
    "timestep_sampling": "flow.timestep_sample_method",
    "discrete_flow_shift": "flow.shift",
    # [optimizer]
    "learning_rate": "optimizer.lr",
    "unet_lr": "optimizer.lr",
    "optimizer_type": "optimizer.kind",
    "optimizer": "optimizer.kind",
    # [schedule]
    "lr_scheduler": "schedule.kind",
    "scheduler": "schedule.kind",
    "lr_warmup_steps": "schedule.warmup_steps",
    "lr_scheduler_min_lr_ratio": "schedule.min_lr_ratio",
    # [component_lr]
    "text_encoder_lr": "component_lr.text_encoder",
    # [adapter]
    "network_module": "adapter.kind",
    "network_dim": "adapter.rank",
    "network_alpha": "adapter.alpha",
    "network_dropout": "adapter.dropout",
    "dim": "adapter.rank",
    "lora_rank": "adapter.rank",
    "lora_dim": "adapter.rank",
    "lora_alpha": "adapter.alpha",
    # [dataset] (sd-scripts writes the cache to disk; here it lives in host memory)
    "cache_text_encoder_outputs_to_disk": "dataset.cache_text_encoder_outputs",
}

# Foreign names with no counterpart here, and what to do instead (the cache command as the front says it: suggestion).
CACHE_COMMAND = "`anima-train cache`"
NO_EQUIVALENT: dict[str, str] = {
    "enable_bucket": "bucketing is always on here; remove the key",
    "caption_extension": "captions are always <stem>.txt (tags) and <stem>_nl.txt (natural language); remove the key",
    "cache_latents": "latents are cached by `anima-train cache` (or encoded in the loop with [dataset] source = "
                     '"encode"); remove the key',
    "cache_latents_to_disk": "latents are cached by `anima-train cache` (or encoded in the loop with [dataset] "
                             'source = "encode"); remove the key',
    "network_train_unet_only": "only the DiT is trained unless [adapter] train_text_encoder = true (default "
                               "false); remove the key",
    "logging_dir": "progress goes to the terminal and, with --events PATH, to a JSON-lines file; remove the key",
}

# Generic words for "which one" -> this table's own word for it (the first of these the table has).
LOCAL_SYNONYMS: dict[str, tuple[str, ...]] = {
    "type": ("kind", "mode"),
    "algo": ("kind",),
    "method": ("kind", "mode"),
}


def _normal(key: str) -> str:
    return key.strip().lower().replace("-", "_")


def _split(dotted: str) -> tuple[str, str]:
    table, _, name = dotted.rpartition(".")
    return table, name


def suggestion(key: str, table: str, keys_by_table: dict[str, list[str]]) -> tuple[str, str] | str | None:
    """The key a user most likely meant by unknown `key` in `table` ("" = outside any table).

    Returns (table, key) of a real key, a sentence (a foreign name with no counterpart here), or None.
    `keys_by_table` maps every table name ("train", "dataset.caption", ...) to its key names.
    """
    norm = _normal(key)
    if norm in ALIASES:
        return _split(ALIASES[norm])
    if norm in NO_EQUIVALENT:
        return NO_EQUIVALENT[norm].replace(CACHE_COMMAND, ref("name cache", CACHE_COMMAND))
    # spelling: the closest key of this table, unless a key of another table is clearly closer (`warmup_step`
    # in [train] is [schedule] warmup_steps, not [train] max_steps)
    for word in LOCAL_SYNONYMS.get(norm, ()):
        if word in keys_by_table.get(table, []):
            return table, word
    here = _closest(norm, {f"{table}.{k}": k for k in keys_by_table.get(table, [])}, cutoff=0.6)
    elsewhere = _closest(norm, {f"{t}.{k}": k for t, ks in keys_by_table.items() if t != table for k in ks},
                         cutoff=0.8)
    alias = _closest(norm, {a: a for a in ALIASES}, cutoff=0.8)
    if alias is not None:
        alias = (ALIASES[alias[0]], alias[1])
    ranked = sorted((c for c in (here, alias, elsewhere) if c is not None), key=lambda c: -c[1])
    if not ranked:
        return None
    best = ranked[0] if here is None or ranked[0][1] > here[1] + 0.05 else here
    return _split(best[0])


def _closest(word: str, candidates: dict[str, str], cutoff: float) -> tuple[str, float] | None:
    """(dotted name, similarity) of the candidate whose name is most like `word`, if any reaches `cutoff`."""
    best = None
    for dotted, name in candidates.items():
        ratio = difflib.SequenceMatcher(None, word, name).ratio()
        if ratio >= cutoff and (best is None or ratio > best[1] or (ratio == best[1] and name == word)):
            best = (dotted, ratio)
    return best
