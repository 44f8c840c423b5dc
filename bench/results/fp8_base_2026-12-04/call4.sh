#!/bin/bash
# Call 4 (the machine of calls 2 and 3 if still warm), from the repository root with wheels in .comfygpu/whl: the
# FP8 base under 16 GiB (b8) and 12 GiB (b4) with the planner's default plan. Compared with the bf16 base's committed
# runs at the same caps (recompute_graph_2026-12-04 B2, A2) and the seed's best (B3 same call there; caps_2026-12-02b B5).
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
el model
ours() { local name=$1 cap=$2 log=$3 t=$4; shift 4
  el "ours $name cap $cap $* (limit $t s)"
  timeout -k 5 $t python3 $B --work $W --only $name --cap-gib $cap --steps 12 --diag "$@" > $OUT/$log 2>&1; echo rc=$?
  grep -E '"who"|checkpointing|plan |Error|error' $OUT/$log | grep -v Warning | cut -c1-1200 | tail -4; }
ours lora_b8 16 D1_cap16_b8_fp8.log $(left 160 150) --base-matmul fp8
ours lora_b4 12 D2_cap12_b4_fp8.log $(left 295 135) --base-matmul fp8
el end
