#!/bin/bash
# Call 1 (fresh machine, cold Inductor cache), from the repository root with wheels in .comfygpu/whl:
# `[train] base_matmul = "fp8"` for the first time on a GPU. The layer per DiT shape against an fp32 reference and
# bf16 (bench/fp8_check_gpu.py), then the A/B the issue asks for: LoRA r32 b8 uncapped, 30 steps, same data and
# seed, bf16 base against FP8 base (every step's loss in the JSON lines; the learned updates compared by
# bench/compare_adapters.py on the machine: the adapter files stay there).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
W=/tmp/b; B=bench/bench_train_gpu.py; S=$(date +%s); A=/tmp/adapters
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
el model
timeout -k 5 $(left 140 100) python3 bench/fp8_check_gpu.py > $OUT/A0_fp8_layers.log 2>&1; echo rc=$?; tail -6 $OUT/A0_fp8_layers.log
ours() { local name=$1 log=$2 t=$3; shift 3
  el "ours $name uncapped $* (limit $t s)"
  timeout -k 5 $t python3 $B --work $W --only $name --steps 30 --save-adapter $A "$@" > $OUT/$log 2>&1; echo rc=$?
  grep -E '"who"|checkpointing|plan |base  |Error|error' $OUT/$log | grep -v Warning | cut -c1-900 | tail -4; }
ours lora_b8 A1_b8_bf16.log $(left 350 240) --base-matmul bf16
ours lora_b8 A2_b8_fp8.log $(left 585 240) --base-matmul fp8
el compare
python3 bench/compare_adapters.py $A/lora_b8_compiled_base-bf16.safetensors $A/lora_b8_compiled_base-fp8.safetensors \
  | tee $OUT/A3_compare_bf16_fp8.json
el end
