#!/bin/bash
# call 1: ours at 8 GiB b2 (as main has it, then with expandable segments, then checkpointing every block), 12 GiB b4
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
W=/tmp/b; B=bench/bench_train_gpu.py; S=$(date +%s)
el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
el prepare
python3 - <<'PY' 2>&1 | tail -3
import importlib.util, sys, time
from pathlib import Path
sys.argv = ["x"]
spec = importlib.util.spec_from_file_location("b", "bench/bench_train_gpu.py"); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
t = time.time(); m.prepare(Path("/tmp/b")); print("prepared", round(time.time() - t, 1))
PY
el s1 8GiB b2 auto, no alloc conf
timeout 190 python3 $B --work $W --only lora_b2 --cap-gib 8 --steps 8 --diag > $OUT/s1_8g_b2_auto.log 2>&1; echo rc=$?
grep -v Warning $OUT/s1_8g_b2_auto.log | tail -25
el s2 8GiB b2 auto + all, expandable
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 170 python3 $B --work $W --only lora_b2,lora_b2:all --cap-gib 8 --steps 8 --diag > $OUT/s2_8g_b2_expandable.log 2>&1; echo rc=$?
grep -v Warning $OUT/s2_8g_b2_expandable.log | tail -30
el s3 12GiB b4 auto expandable
left=$(( 560 - ($(date +%s) - S) )); [ $left -gt 150 ] && left=150
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $left python3 $B --work $W --only lora_b4 --cap-gib 12 --steps 8 --diag > $OUT/s3_12g_b4_expandable.log 2>&1; echo rc=$?
grep -v Warning $OUT/s3_12g_b4_expandable.log | tail -20
el end
