#!/bin/bash
# Call 1 (fresh machine, cold Inductor cache), from the repository root with wheels in .comfygpu/whl: kernel profiles
# of the default plan (checkpoint_blocks = "auto", recompute = "graph", compile "default") for the rows of issue #26
# that are not met: LoRA r32 b2 under 8 GiB, b4 under 12, b8 under 16 and 24, and the full finetune (fullkahan_b8)
# under 24 GiB. The five compile side by side on the one GPU (each under its own cap) and take their profiled
# windows one at a time (`profile_train_gpu.py --turn`), so no window overlaps another process's work.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
W=/tmp/b; S=$(date +%s)
el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
el prepare
python3 - <<'PY' 2>&1 | tail -1
import importlib.util, sys, time
from pathlib import Path
sys.argv = ["x"]
spec = importlib.util.spec_from_file_location("b", "bench/bench_train_gpu.py"); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
t = time.time(); m.prepare(Path("/tmp/b")); print("prepared", round(time.time() - t, 1))
PY
el profiles
i=0; N=5
for spec in "lora_b2 8 P1_cap8_b2" "lora_b8 24 P2_cap24_b8" "lora_b4 12 P3_cap12_b4" "fullkahan_b8 24 P4_cap24_fullkahan_b8" "lora_b8 16 P5_cap16_b8"; do
  set -- $spec
  ( timeout -k 5 $(( 585 - ($(date +%s) - S) )) python3 bench/profile_train_gpu.py --work $W --run $1 --cap-gib $2 \
      --compile default --steps 3 --no-trace --turn /tmp/turns:$i:$N --turn-timeout 420 --out $OUT/$3 > $OUT/$3.log 2>&1
    echo "=== $(( $(date +%s) - S )) s: $3 rc=$?" ) &
  i=$((i + 1))
done
wait
for f in $OUT/P*.log; do echo "--- $f"; grep -E "checkpointing|wall_ms|busy_ms|host_bound|turn_wait|peak_gib|Error" $f | grep -v Warning | cut -c1-300; done
el end
