#!/bin/bash
# Call 3 (on call 2's machine, still warm: its Inductor cache held the block graphs), from the repository root with
# wheels in .comfygpu/whl: the A/B of
# `[train] recompute` in one call, LoRA r32 b2 under 8 GiB (where call 1 measured the largest gain), planner on:
# "block" (torch.utils.checkpoint, cold compile) then "graph" (its kept-block graph now cached). Every step's loss
# is printed by both.
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
ours lora_b2 8 C1_cap8_b2_block.log $(left 230 200) --recompute block
ours lora_b2 8 C2_cap8_b2_graph.log $(left 400 160) --recompute graph
el end
