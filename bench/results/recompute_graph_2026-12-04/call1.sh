#!/bin/bash
# Call 1 (fresh machine, cold Inductor cache), from the repository root with the peer kit in peers/ and wheels in
# .comfygpu/whl: `[train] recompute = "graph"` (the recomputed blocks recompute inside a second compiled graph of the
# block) under the planner (`checkpoint_blocks = "auto"`) for the first time, at the caps of issue #26: LoRA r32 b2
# under 8 GiB, b4 under 12, b8 under 24, and b4 with 12 blocks swapped under 8 GiB. The seed's best at each cap is
# committed in caps_2026-12-02b (measured once per cap, as the issue allows).
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
ours() { local name=$1 cap=$2 log=$3 t=$4; shift 4
  el "ours $name cap $cap $* (limit $t s)"
  timeout -k 5 $t python3 $B --work $W --only $name --cap-gib $cap --steps 12 --diag "$@" > $OUT/$log 2>&1; echo rc=$?
  grep -E '"who"|checkpointing|plan |Error|error' $OUT/$log | grep -v Warning | cut -c1-1200 | tail -4; }
ours lora_b2 8 A1_cap8_b2_graph.log $(left 300 280) --recompute graph
ours lora_b4 12 A2_cap12_b4_graph.log $(left 400 110) --recompute graph
ours lora_b8 24 A3_cap24_b8_graph.log $(left 500 110) --recompute graph
ours lora_b4@12 8 A4_cap8_b4_swap12_graph.log $(left 580 90) --recompute graph
el end
