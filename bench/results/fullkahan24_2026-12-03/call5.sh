#!/bin/bash
# Call 5 (fresh machine, cold Inductor cache), from the repository root with the peer kit in peers/ and wheels in
# .comfygpu/whl, after AdamWKahan sent its per-step numbers to the GPU before launching any kernel, from pinned memory
# (call 4's 11 copies from pageable memory between launches made the host wait for the GPU each time): the optimizer
# step alone beside torch's fused AdamW on bf16, then ours `fullkahan_b8` and the seed's best (b8, its checkpointing
# on) under a 24 GiB cap, in the same call.
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
mkdir -p $W/seed_src && tar xzf peers/seed-77605fe.tar.gz -C $W/seed_src
ours() { local name=$1 log=$2 t=$3
  el "ours $name cap 24 (limit $t s)"
  timeout -k 5 $t python3 $B --work $W --only $name --cap-gib 24 --steps 12 --diag > $OUT/$log 2>&1; echo rc=$?
  grep -E '"who"|checkpointing auto|Error|error' $OUT/$log | grep -v Warning | cut -c1-700 | tail -4; }
seed() { local b=$1 log=$2 t=$3
  el "seed full b$b cap 24 (limit $t s)"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 $t python3 -c "import sys, runpy, torch; \
torch.cuda.set_per_process_memory_fraction(24 * 2**30 / torch.cuda.mem_get_info()[1]); sys.argv = sys.argv[1:]; \
runpy.run_path(sys.argv[0], run_name='__main__')" peers/seed_bench.py --seed-src $W/seed_src/anima-flow-trainer \
    --repo $W/repo --data $W/data --work $W/seed_work --mode full --batch $b --steps 12 --compile default > $OUT/$log 2>&1
  echo rc=$?; grep -E '^\{' $OUT/$log | tail -2 | cut -c1-600; }
el "optimizer step alone"
timeout -k 5 $(left 160 160) python3 bench/optimizer_step_gpu.py --only adamw_kahan,adamw_bf16 \
  --out $OUT/P1_optimizer_step.jsonl > $OUT/P1_optimizer_step.log 2>&1; echo rc=$?
grep -E '^\{' $OUT/P1_optimizer_step.log | cut -c1-260
ours fullkahan_b8 P2_cap24_fullkahan_b8_ours.log $(left 390 200)
seed 8 P3_cap24_full_b8_seed.log $(left 540 140)
el end
