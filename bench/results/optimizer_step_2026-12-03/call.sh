#!/bin/bash
# One GPU call (fresh machine), from the repository root, wheels in .comfygpu/whl (diffusers 0.42.1, sdnq 0.2.8, peft,
# tomlkit, toml, importlib_metadata: what the GPU image lacks): the optimizer step of a full finetune alone, timed for
# each optimizer a full finetune can use (bench/optimizer_step_gpu.py); ONLY picks some (call 2: ONLY=adamw_kahan,adamw_bf16,adamw8bit_kahan).
export PYTHONUNBUFFERED=1
S=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
echo "=== $(( $(date +%s) - S )) s: prepared"
timeout -k 5 ${T:-200} python3 bench/optimizer_step_gpu.py ${ONLY:+--only $ONLY} --out $OUT/optimizer_step.jsonl > $OUT/optimizer_step.log 2>&1; echo rc=$?
grep -v '^USDT\|OpenVINO' $OUT/optimizer_step.log | cut -c1-1500
echo "=== $(( $(date +%s) - S )) s: end"
