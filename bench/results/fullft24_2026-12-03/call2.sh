#!/bin/bash
# Second call (fresh machine), after the planner stopped counting the first optimizer step's new state twice
# (recompute.step_base with the backward's own peak): ours full8bit_b4 under 24 GiB again, and the LoRA b2 under
# 8 GiB of ../caps_2026-12-02b A1 to check that a LoRA's plan is unchanged (26 of 28 recomputed there).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
W=/tmp/b; B=bench/bench_train_gpu.py; S=$(date +%s)
el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
left() { local l=$(( $1 - ($(date +%s) - S) )); [ $l -gt $2 ] && l=$2; echo $l; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
el prepare
python3 - <<'PY' 2>&1 | tail -1
import importlib.util, sys, time
from pathlib import Path
sys.argv = ["x"]
spec = importlib.util.spec_from_file_location("b", "bench/bench_train_gpu.py"); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
t = time.time(); m.prepare(Path("/tmp/b")); print("prepared", round(time.time() - t, 1))
PY
ours() { local name=$1 cap=$2 log=$3 t=$4
  el "ours $name cap $cap (limit $t s)"
  timeout -k 5 $t python3 $B --work $W --only $name --cap-gib $cap --steps 12 > $OUT/$log 2>&1; echo rc=$?
  grep -E '"who"|checkpointing auto|allocator|Error|error' $OUT/$log | grep -v Warning | cut -c1-600 | tail -5; }
ours full8bit_b4 24 F1_cap24_full8bit_b4_ours.log $(left 260 230)
ours lora_b2 8 F2_cap8_lora_b2_ours.log $(left 470 200)
el end
