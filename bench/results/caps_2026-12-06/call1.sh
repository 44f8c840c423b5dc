#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl, the peer kit in peers/), on this commit (issue #45,
# points 2 and 4): LoRA r32 b8 1024² under 24 GiB. Ours cold (empty Inductor cache; the planner now charges a
# recomputed block's extra as max(kept blocks, extra), not their sum), the seed cold (its best at 24 GiB: b8
# checkpointed, compiled, its own empty caches), then ours warm in a fresh process (the cache the cold run left).
# Dynamo's shape guards are checked in Python now (compiling.python_shape_guards); a last warm run turns its C++
# shape guards back on (--torch-set, after the trainer's settings), as this torch may have them by default. Every run
# of ours with --trace-cpu-kernels: each C++ source a CUDA run builds or loads, and the stack of Inductor's CPU ISA
# check (~30 s of a warm start in first_step_2026-12-06, call 3).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind1 TRITON_CACHE_DIR=/tmp/tri1 BENCH_CALL=${BENCH_CALL:-caps-1}
W=/tmp/b; S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
left() { local l=$(( $1 - ($(date +%s) - S) )); [ $l -gt $2 ] && l=$2; echo $l; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
el wheels; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
python3 -c "import torch, torch._dynamo.config as c; print('torch', torch.__version__, 'cpp shape guards by default:', getattr(c, 'enable_cpp_symbolic_shape_guards', None))"
ours() {  # $1 label, rest: bench arguments
  local label=$1; shift; el "$label"
  TORCH_LOGS=recompiles timeout -k 5 $(left 585 230) python3 bench/bench_train_gpu.py --work $W --steps 12 \
    --compile-report --trace-cpu-kernels "$@" > $OUT/$label.log 2>&1; echo rc=$?
  grep -E '^\{"(call|name)|^(swap|checkpointing)' $OUT/$label.log | cut -c1-2200
  grep -E '^\{"diag": "cpu_' $OUT/$label.log | cut -c1-3000 | head -4
  echo "recompiles: $(grep -c 'Recompiling function' $OUT/$label.log)"
}
seed() {  # $1 label, $2 cap GiB, $3 batch, $4 data folder, $5 time limit
  el "$1"; mkdir -p $W/seed_src && tar xzf peers/seed-77605fe.tar.gz -C $W/seed_src
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$1 TRITON_CACHE_DIR=/tmp/tri_$1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  timeout -k 5 $(left 585 $5) python3 -c "import sys, runpy, torch; \
torch.cuda.set_per_process_memory_fraction($2 * 2**30 / torch.cuda.mem_get_info()[1]); sys.argv = sys.argv[1:]; \
runpy.run_path(sys.argv[0], run_name='__main__')" peers/seed_bench.py --seed-src $W/seed_src/anima-flow-trainer \
    --repo $W/repo --data $W/$4 --work $W/seed_work_$1 --mode lora --batch $3 --steps 12 --compile default \
    > $OUT/$1.log 2>&1; echo rc=$?
  grep -E '^\{|OutOfMemory|out of memory' $OUT/$1.log | tail -2 | cut -c1-900
}
ours ours_b8_cap24_cold --only lora_b8 --cap-gib 24
seed seed_b8_cap24_cold 24 8 data 250
ours ours_b8_cap24_warm --only lora_b8 --cap-gib 24
ours ours_b8_cap24_warm_cpp_guards --only lora_b8 --cap-gib 24 --torch-set torch._dynamo.config.enable_cpp_symbolic_shape_guards=True
el end
