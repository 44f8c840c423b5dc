#!/bin/bash
# call 2: the fix (expandable segments in the trainer, Qwen3 first, last block kept free, retry guard) beside the
# seed's best at 8 GiB (b2, checkpointed) and 12 GiB (b4, checkpointed); each cap one bench invocation
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
W=/tmp/b; B=bench/bench_train_gpu.py; S=$(date +%s)
SEED="--seed-bench peers/seed_bench.py --seed-tar peers/seed-77605fe.tar.gz"
el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
el prepare
python3 - <<'PY' 2>&1 | tail -1
import importlib.util, sys, time
from pathlib import Path
sys.argv = ["x"]
spec = importlib.util.spec_from_file_location("b", "bench/bench_train_gpu.py"); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
t = time.time(); m.prepare(Path("/tmp/b")); print("prepared", round(time.time() - t, 1))
PY
el cap 8 b2
timeout 320 python3 $B --work $W --only lora_b2 --cap-gib 8 --steps 12 --diag $SEED > $OUT/cap8_b2.log 2>&1; echo rc=$?
grep -v Warning $OUT/cap8_b2.log | grep -v '"micro"' | tail -12; cp $W/seed_lora_b2.log $OUT/cap8_seed_b2.log 2>/dev/null
el cap 12 b4
left=$(( 575 - ($(date +%s) - S) )); [ $left -gt 320 ] && left=320
timeout $left python3 $B --work $W --only lora_b4 --cap-gib 12 --steps 12 --diag $SEED > $OUT/cap12_b4.log 2>&1; echo rc=$?
grep -v Warning $OUT/cap12_b4.log | grep -v '"micro"' | tail -12; cp $W/seed_lora_b4.log $OUT/cap12_seed_b4.log 2>/dev/null
el end
