#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl), on this commit (issue #45, point 4): selective
# saving in the in-graph recompute. LoRA r32 b8 1024². The default plan under 24 GiB (kept blocks + the rest
# recomputed in the graph saving their inputs only), then every block recomputed in the graph saving a share of what a
# kept block saves (recompute.IN_GRAPH_BUDGET, torch's activation_memory_budget: 0, 0.1 under 24 GiB; 0.25 uncapped),
# each cold (a budget is another graph). Peak and s/image say whether a budget spread over all blocks beats whole
# kept blocks for the same memory.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind2 TRITON_CACHE_DIR=/tmp/tri2 BENCH_CALL=${BENCH_CALL:-caps-b2}
W=/tmp/b; S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
left() { local l=$(( $1 - ($(date +%s) - S) )); [ $l -gt $2 ] && l=$2; echo $l; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
el wheels; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
ours() {  # $1 label, $2 steps, rest: bench arguments
  local label=$1 steps=$2; shift 2; el "$label"
  TORCH_LOGS=recompiles timeout -k 5 $(left 585 200) python3 bench/bench_train_gpu.py --work $W --steps $steps \
    --compile-report --trace-cpu-kernels "$@" > $OUT/$label.log 2>&1; echo rc=$?
  grep -E '^\{"(call|name)|^(swap|checkpointing)' $OUT/$label.log | cut -c1-2200
  grep -E '^\{"diag": "cpu_' $OUT/$label.log | cut -c1-3000 | head -4
  echo "recompiles: $(grep -c 'Recompiling function' $OUT/$label.log)"
}
TORCHINDUCTOR_CACHE_DIR=/tmp/ind1 TRITON_CACHE_DIR=/tmp/tri1 ours ours_b8_cap24_default 12 --only lora_b8 --cap-gib 24
B=anima_train.training.recompute.IN_GRAPH_BUDGET
ours ours_b8_cap24_all_graph_b0 12 --only lora_b8 --cap-gib 24 --checkpoint-blocks all
ours ours_b8_cap24_all_graph_b010 12 --only lora_b8 --cap-gib 24 --checkpoint-blocks all --torch-set $B=0.1
ours ours_b8_all_graph_b025 12 --only lora_b8 --checkpoint-blocks all --torch-set $B=0.25
el end
