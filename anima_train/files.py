"""Atomic file writes for the trainer: the pack's one helper lives in `anchor/atomic.py` (which `anchor` may use
without depending on the trainer); this module is the trainer's name for it."""

from anchor.atomic import atomic_path, publish, publish_dir, temp_path, write_json, write_text

__all__ = ["atomic_path", "publish", "publish_dir", "temp_path", "write_json", "write_text"]
