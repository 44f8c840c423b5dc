#!/bin/bash
# call 4: main after the merge (the final small-cap planner), ours alone at 8 GiB b2 (the seed's b2 checkpointed
# figure at 8 GiB, 0.1742 s/image, was measured on this day's lease: call3_seed_cap8_b2.log)
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
W=/tmp/b; B=bench/bench_train_gpu.py; S=$(date +%s)
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
left=$(( 330 - ($(date +%s) - S) ))
timeout $left python3 $B --work $W --only lora_b2 --cap-gib 8 --steps 12 --diag > $OUT/cap8_b2_final.log 2>&1; echo rc=$?
grep -v Warning $OUT/cap8_b2_final.log | grep -v '"micro"' | tail -14
el end
