#!/bin/bash
# Call 1 (fresh machine, cold Inductor cache), from the repository root with the peer kit in peers/ and wheels in
# .comfygpu/whl: swap_blocks on a GPU for the first time. Ours LoRA r32 b1 under a 6 GiB cap with the swap that
# `anima-train plan --vram 6` names (3), the same run resident with every block recomputed under 8 GiB (its trainable
# digest must equal the swapped run's), ours b4 under 8 GiB with the swap the plan names there (11), and the seed b1
# (checkpointed, its smallest) under 6 GiB.
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
ours() { local name=$1 cap=$2 log=$3 t=$4
  el "ours $name cap $cap (limit $t s)"
  timeout -k 5 $t python3 $B --work $W --only $name --cap-gib $cap --steps 12 --diag > $OUT/$log 2>&1; echo rc=$?
  grep -E '"who"|checkpointing auto|swap|Error|error' $OUT/$log | grep -v Warning | cut -c1-900 | tail -5; }
seed() { local b=$1 cap=$2 log=$3 t=$4
  el "seed lora b$b cap $cap (limit $t s)"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 $t python3 -c "import sys, runpy, torch; \
torch.cuda.set_per_process_memory_fraction($cap * 2**30 / torch.cuda.mem_get_info()[1]); sys.argv = sys.argv[1:]; \
runpy.run_path(sys.argv[0], run_name='__main__')" peers/seed_bench.py --seed-src $W/seed_src/anima-flow-trainer \
    --repo $W/repo --data $W/data --work $W/seed_work --mode lora --batch $b --steps 12 --compile default > $OUT/$log 2>&1
  echo rc=$?; grep -E '^\{|OutOfMemory|out of memory' $OUT/$log | tail -3 | cut -c1-600; }
ours lora_b1@3 6 A1_cap6_b1_swap3.log $(left 250 230)
ours lora_b1:all 8 A2_cap8_b1_all_resident.log $(left 320 90)
ours lora_b4@11 8 A3_cap8_b4_swap11.log $(left 430 130)
seed 1 6 A4_cap6_b1_seed.log $(left 580 170)
el end
