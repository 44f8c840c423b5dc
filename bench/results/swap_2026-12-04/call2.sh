#!/bin/bash
# Call 2 (fresh machine, cold Inductor cache), from the repository root with wheels in .comfygpu/whl, after the swap
# moved each block as one copy per dtype and copied the next block in on a side stream while the current one runs:
# ours LoRA r32 b1 under 6 GiB with the swap `anima-train plan --vram 6` now names (4), the same run resident with
# every block recomputed (its trainable digest must equal the swapped runs'), b4 under 8 GiB with the swap the plan
# names there (12), and that run again with the prefetch off (weight_swap.PREFETCH = False) for an A/B.
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
  timeout -k 5 $t python3 $B --work $W --only $name --cap-gib $cap --steps 12 --diag $TS > $OUT/$log 2>&1; echo rc=$?
  grep -E '"who"|checkpointing auto|swap|Error|error' $OUT/$log | grep -v Warning | cut -c1-900 | tail -5; }
ours lora_b1@4 6 B1_cap6_b1_swap4.log $(left 230 210)
ours lora_b1:all 8 B2_cap8_b1_all_resident.log $(left 360 130)
ours lora_b4@12 8 B3_cap8_b4_swap12.log $(left 550 190)
TS="--torch-set anima_train.training.weight_swap.PREFETCH=False" ours lora_b4@12 8 B4_cap8_b4_swap12_noprefetch.log $(left 590 150)
el end
