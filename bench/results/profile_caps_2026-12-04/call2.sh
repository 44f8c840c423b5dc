#!/bin/bash
# Call 2 (fresh machine, cold Inductor cache): the profile of the FP8 base uncapped (LoRA r32 b8, the issue's
# 0.065 s/image row), and whether Inductor's `emulate_precision_casts` (every bf16 result rounded where eager rounds
# it, fused or not) makes the in-graph recompute give the whole-block recompute's losses: LoRA r32 b2 under 8 GiB,
# recompute "graph" and "block", each with and without it, same data and seed. Five processes side by side, the
# profiled windows in turn (`--turn`); every step's loss is in each summary.
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
i=0; N=5
for spec in "Q1_uncapped_b8_fp8 0 lora_b8 0 --base-matmul fp8" "Q2_cap8_b2_graph 0 lora_b2 8 --recompute graph" \
    "Q3_cap8_b2_block 0 lora_b2 8 --recompute block" "Q4_cap8_b2_graph_emulate 1 lora_b2 8 --recompute graph" \
    "Q5_cap8_b2_block_emulate 1 lora_b2 8 --recompute block"; do
  set -- $spec; name=$1 emulate=$2 run=$3 cap=$4; shift 4
  caparg=""; [ "$cap" != 0 ] && caparg="--cap-gib $cap"
  ( TORCHINDUCTOR_EMULATE_PRECISION_CASTS=$emulate timeout -k 5 $(( 580 - ($(date +%s) - S) )) python3 \
      bench/profile_train_gpu.py --work $W --run $run $caparg --compile default --steps 3 --no-trace "$@" \
      --turn /tmp/turns:$i:$N --turn-timeout 420 --out $OUT/$name > $OUT/$name.log 2>&1
    echo "=== $(( $(date +%s) - S )) s: $name rc=$?" ) &
  i=$((i + 1))
done
wait
tar czf $OUT/call2_profiles.tgz -C $OUT Q1_uncapped_b8_fp8 Q2_cap8_b2_graph Q3_cap8_b2_block Q4_cap8_b2_graph_emulate \
  Q5_cap8_b2_block_emulate && rm -rf $OUT/Q?_*/
for f in $OUT/Q*.log; do echo "--- $f"; grep -E "checkpointing|wall_ms|busy_ms|host_bound|turn_wait|peak_gib|emulate|Error" $f | grep -v Warning | cut -c1-300
  python3 -c "import json,sys; t=open(sys.argv[1]).read(); i=t.rfind('\n{\n'); print(json.loads(t[i+1:])['losses'])" $f 2>/dev/null; done
el end
