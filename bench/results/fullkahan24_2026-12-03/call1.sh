#!/bin/bash
# Call 1 (fresh machine, cold Inductor cache), from the repository root with the peer kit in peers/ and wheels in
# .comfygpu/whl: our lean AdamW (`[optimizer] kind = "adamw"`, `use_kahan = true`) for a full finetune under a 24 GiB
# cap, beside the seed's full finetune under the same cap in the same call (unmodified, its checkpointing on, b4 and
# b8), then the optimizer step alone (bench/optimizer_step_gpu.py). Setup as ../fullft24_2026-12-03.
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
  timeout -k 5 $t python3 $B --work $W --only $name --cap-gib 24 --steps 12 > $OUT/$log 2>&1; echo rc=$?
  grep -E '"who"|checkpointing auto|Error|error' $OUT/$log | grep -v Warning | cut -c1-700 | tail -4; }
seed() { local mode=$1 b=$2 log=$3 t=$4
  el "seed $mode b$b cap 24 (limit $t s)"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 $t python3 -c "import sys, runpy, torch; \
torch.cuda.set_per_process_memory_fraction(24 * 2**30 / torch.cuda.mem_get_info()[1]); sys.argv = sys.argv[1:]; \
runpy.run_path(sys.argv[0], run_name='__main__')" peers/seed_bench.py --seed-src $W/seed_src/anima-flow-trainer \
    --repo $W/repo --data $W/data --work $W/seed_work --mode $mode --batch $b --steps 12 --compile default > $OUT/$log 2>&1
  echo rc=$?; grep -E '^\{' $OUT/$log | tail -2 | cut -c1-600; }
ours fullkahan_b4 K1_cap24_fullkahan_b4_ours.log $(left 250 240)
seed full 4 K2_cap24_full_b4_seed.log $(left 440 200)
el "optimizer step alone"
timeout -k 5 $(left 500 80) python3 bench/optimizer_step_gpu.py --only adamw_kahan,adamw_bf16 --out $OUT/K3_optimizer_step.jsonl > $OUT/K3_optimizer_step.log 2>&1; echo rc=$?
grep -v '^USDT\|OpenVINO' $OUT/K3_optimizer_step.log | grep -E 'adamw|s/step' | cut -c1-400 | tail -6
seed full 8 K4_cap24_full_b8_seed.log $(left 590 150)
el end
