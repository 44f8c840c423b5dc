#!/bin/bash
# The waiting worker (docs/comfyui.md#the-waiting-worker) through a real ComfyUI 0.29.0 on this repository's CI
# machine (2 CPU cores, no GPU): the LoRA template queued three times (`--size comfy --cpu`, 6 steps each), first with
# ANIMA_TRAIN_STANDBY=0 in ComfyUI's environment (every run starts its own process, as before), then without it.
# Arguments: the ComfyUI checkout and the Python of its venv. Writes off/ and on/ beside this script.
set -e
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../../.." && pwd)
for mode in off on; do
  rm -rf /tmp/standby_$mode; mkdir -p "$HERE/$mode"
  if [ $mode = off ]; then export ANIMA_TRAIN_STANDBY=0; else unset ANIMA_TRAIN_STANDBY; fi
  "$ROOT/venv/bin/python" "$ROOT/bench/comfyui_template_path.py" --size comfy --cpu --comfy-root "$1" --python "$2" \
    --out /tmp/standby_$mode/out --work /tmp/standby_$mode/w --variants plain,plain#2,plain#3 > "$HERE/$mode/driver.log" 2>&1
  cp /tmp/standby_$mode/out/rows.jsonl /tmp/standby_$mode/out/summary.json "$HERE/$mode/"
done
