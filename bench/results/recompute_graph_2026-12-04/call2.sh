#!/bin/bash
# Call 2 (fresh machine, cold Inductor cache), from the repository root with the peer kit in peers/ and wheels in
# .comfygpu/whl: `[train] recompute = "graph"` at 24 GiB (call 1 ran out of time there) and at 16 GiB (a cap of issue
# #26 never measured), LoRA r32 b8 under the planner; the seed's best at 16 GiB (b8 checkpointed: its peak at b8 is
# 13.3 GiB, so b8 is the largest batch that fits) in the same call.
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
mkdir -p $W/seed_src && tar xzf peers/seed-77605fe.tar.gz -C $W/seed_src
seed() { local b=$1 cap=$2 log=$3 t=$4
  el "seed lora b$b cap $cap (limit $t s)"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 $t python3 -c "import sys, runpy, torch; \
torch.cuda.set_per_process_memory_fraction($cap * 2**30 / torch.cuda.mem_get_info()[1]); sys.argv = sys.argv[1:]; \
runpy.run_path(sys.argv[0], run_name='__main__')" peers/seed_bench.py --seed-src $W/seed_src/anima-flow-trainer \
    --repo $W/repo --data $W/data --work $W/seed_work --mode lora --batch $b --steps 12 --compile default > $OUT/$log 2>&1
  echo rc=$?; grep -E '^\{|OutOfMemory|out of memory' $OUT/$log | tail -3 | cut -c1-600; }
ours lora_b8 24 B1_cap24_b8_graph.log $(left 290 270) --recompute graph
ours lora_b8 16 B2_cap16_b8_graph.log $(left 400 130) --recompute graph
seed 8 16 B3_cap16_b8_seed.log $(left 585 190)
el end
