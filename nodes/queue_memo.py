"""What one queued prompt computes from the same inputs, kept for that prompt only."""

from __future__ import annotations

import threading

from . import comfy

# One queue parses its config once and walks its dataset once: ComfyUI calls the Training config's validate_inputs,
# fingerprint_inputs and execute, then Train's execute, all for the same queued prompt (comfy.queued_prompt_id), so
# what they compute from the same inputs is kept for that prompt, and dropped when the next one comes. Outside a
# queued prompt nothing is kept.
_QUEUE_MEMO: dict[tuple[str, str, str], object] = {}
_QUEUE_LOCK = threading.Lock()  # validation runs on the server's thread, execution on the prompt worker's


def queued(what: str, key: str):
    """What this queue computed for `key` (None if nothing)."""
    prompt = comfy.queued_prompt_id()
    with _QUEUE_LOCK:
        return _QUEUE_MEMO.get((prompt, what, key)) if prompt is not None else None


def once_per_queue(what: str, key: str, compute):
    """compute(), once per queued prompt and key."""
    prompt = comfy.queued_prompt_id()
    if prompt is None:
        return compute()
    with _QUEUE_LOCK:
        if (prompt, what, key) in _QUEUE_MEMO:
            return _QUEUE_MEMO[(prompt, what, key)]
    value = compute()
    with _QUEUE_LOCK:
        for old in [k for k in _QUEUE_MEMO if k[0] != prompt]:
            del _QUEUE_MEMO[old]
        _QUEUE_MEMO[(prompt, what, key)] = value
    return value
