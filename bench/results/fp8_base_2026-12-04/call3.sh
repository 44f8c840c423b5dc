#!/bin/bash
# Call 3 (fresh machine, cold Inductor cache), from the repository root with wheels in .comfygpu/whl: the FP8 base
# under the caps, with the planner's default plan (checkpoint_blocks = "auto", recompute = "graph"): LoRA r32 b2 under
# 8 GiB (call 2's run did not finish its cold compile in the 110 s left) and b8 under 24 GiB. Compared with the
# bf16 base's committed runs at the same caps (recompute_graph_2026-12-04 C2, B1) and the seed's best
# (caps_2026-12-02b A3, D2).
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
ours lora_b2 8 C1_cap8_b2_fp8.log $(left 310 290) --base-matmul fp8
ours lora_b8 24 C2_cap24_b8_fp8.log $(left 585 270) --base-matmul fp8
el end
