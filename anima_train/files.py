"""Atomic file writes and the reader policy for the trainer: the pack's helpers live in `anchor/atomic.py` and
`anchor/readable.py` (which `anchor` may use without depending on the trainer); this module is the trainer's name
for them."""

from anchor.atomic import atomic_path, publish, publish_dir, temp_dir, temp_path, write_json, write_text
from anchor.readable import damaged, why_unreadable

__all__ = ["atomic_path", "damaged", "publish", "publish_dir", "temp_dir", "temp_path", "why_unreadable", "write_json",
           "write_text"]
