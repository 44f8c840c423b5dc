#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl, the peer kit in peers/), on this commit (issue #45,
# point 4): LoRA r32 b4 1024² under 12 GiB, 16 latents, 16 steps: ours cold, then the seed cold (b4 checkpointed,
# compiled, its own caches). Made to fit the session's last 400 s of device time.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind4 TRITON_CACHE_DIR=/tmp/tri4 BENCH_CALL=${BENCH_CALL:-caps-4}
W=/tmp/b; S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
left() { local l=$(( $1 - ($(date +%s) - S) )); [ $l -gt $2 ] && l=$2; echo $l; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
el wheels; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
ours() {  # $1 label, rest: bench arguments
  local label=$1; shift; el "$label"
  TORCH_LOGS=recompiles timeout -k 5 $(left 330 160) python3 bench/bench_train_gpu.py --work $W --steps 16 \
    --latents 16 --compile-report "$@" > $OUT/$label.log 2>&1; echo rc=$?
  grep -E '^\{"(call|name)|^(swap|checkpointing)' $OUT/$label.log | cut -c1-2200
  echo "recompiles: $(grep -c 'Recompiling function' $OUT/$label.log)"
}
seed() {  # $1 label, $2 cap GiB, $3 batch, $4 data folder, $5 time limit
  el "$1"; mkdir -p $W/seed_src && tar xzf peers/seed-77605fe.tar.gz -C $W/seed_src
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$1 TRITON_CACHE_DIR=/tmp/tri_$1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  timeout -k 5 $(left 335 $5) python3 -c "import sys, runpy, torch; \
torch.cuda.set_per_process_memory_fraction($2 * 2**30 / torch.cuda.mem_get_info()[1]); sys.argv = sys.argv[1:]; \
runpy.run_path(sys.argv[0], run_name='__main__')" peers/seed_bench.py --seed-src $W/seed_src/anima-flow-trainer \
    --repo $W/repo --data $W/$4 --work $W/seed_work_$1 --mode lora --batch $3 --steps 16 --compile default \
    > $OUT/$1.log 2>&1; echo rc=$?
  grep -E '^\{|OutOfMemory|out of memory' $OUT/$1.log | tail -2 | cut -c1-900
}
ours ours_b4_cap12 --only lora_b4 --cap-gib 12
seed seed_b4_cap12 12 4 data_16 170
el end
