#!/bin/bash
# Call 3 (fresh machine, cold Inductor cache), with the trainer emulating eager's bf16 casts by default
# (`compiling.round_like_eager`): LoRA r32 b8 under 24 GiB, where the step is bound by its kernels: recompute "graph"
# with the emulated casts (the new default) and without them (TORCHINDUCTOR_EMULATE_PRECISION_CASTS=0, the old
# default), and "block" with them; kernel time and every step's loss. Side by side, windows in turn (`--turn`).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
W=/tmp/b; S=$(date +%s)
el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
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
el profiles
i=0; N=3
for spec in "R1_cap24_b8_graph_emulate - --recompute graph" "R2_cap24_b8_graph_plain 0 --recompute graph" \
    "R3_cap24_b8_block_emulate - --recompute block"; do
  set -- $spec; name=$1 emulate=$2; shift 2
  ( [ "$emulate" = 0 ] && export TORCHINDUCTOR_EMULATE_PRECISION_CASTS=0
    timeout -k 5 $(( 445 - ($(date +%s) - S) )) python3 bench/profile_train_gpu.py --work $W --run lora_b8 --cap-gib 24 \
      --compile default --steps 3 --no-trace "$@" --turn /tmp/turns:$i:$N --turn-timeout 330 --out $OUT/$name \
      > $OUT/$name.log 2>&1
    echo "=== $(( $(date +%s) - S )) s: $name rc=$?" ) &
  i=$((i + 1))
done
wait
tar czf $OUT/call3_profiles.tgz -C $OUT R1_cap24_b8_graph_emulate R2_cap24_b8_graph_plain R3_cap24_b8_block_emulate \
  && rm -rf $OUT/R?_*/
for f in $OUT/R*.log; do echo "--- $f"; grep -E "checkpointing|wall_ms|busy_ms|host_bound|turn_wait|peak_gib|emulate|Error" $f | grep -v Warning | cut -c1-300
  python3 -c "import json,sys; t=open(sys.argv[1]).read(); i=t.rfind('\n{\n'); print(json.loads(t[i+1:])['losses'])" $f 2>/dev/null; done
el end
