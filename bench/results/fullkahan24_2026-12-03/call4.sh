#!/bin/bash
# Call 4 (fresh machine, cold Inductor cache), from the repository root with wheels in .comfygpu/whl: the optimizer
# step alone, AdamWKahan as in call 3 (tensors of one length together, up to 16 per compiled call) beside torch's
# fused AdamW on bf16. Call 3's run of this gave it 84 s and the compile of its graphs did not finish in that time.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
S=$(date +%s)
timeout -k 5 300 python3 bench/optimizer_step_gpu.py --only adamw_kahan,adamw_bf16 \
  --out $OUT/N1_optimizer_step.jsonl > $OUT/N1_optimizer_step.log 2>&1; echo rc=$? after $(( $(date +%s) - S )) s
grep -E '^\{' $OUT/N1_optimizer_step.log | cut -c1-260
