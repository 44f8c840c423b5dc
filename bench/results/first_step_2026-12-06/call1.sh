#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl): where the time to the first step goes (issue #45,
# point 2), and the default config under a 6 GiB cap (point 3). LoRA r32 b8 1024² under 24 GiB: a cold process (empty
# Inductor cache), then a fresh process on the cache it left (a second run, a restarted ComfyUI), each with
# torch.compile's own account (--compile-report) and its recompile / graph-break log; then LoRA r32 b1 under 6 GiB
# with the default config (swap_blocks = "auto", checkpoint_blocks = "auto").
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri BENCH_CALL=${BENCH_CALL:-first-step-2}
W=/tmp/b; S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
left() { local l=$(( $1 - ($(date +%s) - S) )); [ $l -gt $2 ] && l=$2; echo $l; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
el wheels; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for run in cold warm; do
  el $run
  TORCH_LOGS=recompiles,graph_breaks timeout -k 5 $(left 400 300) python3 bench/bench_train_gpu.py --work $W \
    --only lora_b8 --cap-gib 24 --steps 12 --compile-report > $OUT/ours_b8_cap24_$run.log 2>&1; echo rc=$?
  grep -E '^\{"(call|device|name)' $OUT/ours_b8_cap24_$run.log | cut -c1-2500
  grep -ciE 'recompil|graph break' $OUT/ours_b8_cap24_$run.log
done
el cap6
timeout -k 5 $(left 585 300) python3 bench/bench_train_gpu.py --work $W --only lora_b1 --cap-gib 6 --steps 12 \
  --compile-report > $OUT/ours_b1_cap6.log 2>&1; echo rc=$?
grep -E '^\{"(call|name)|^(swap|checkpointing)|rror' $OUT/ours_b1_cap6.log | cut -c1-1500
el end
