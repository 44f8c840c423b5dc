#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl, the peer kit in peers/) (issue #45, point 4's
# attention lever): 1. bench/sdpa_backends_gpu.py, torch's attention kernels on the DiT's shapes (sdpa.log also says
# which one torch picks by itself); 2. ours LoRA r32 b8 1024² under 24 GiB with flash attention first, then with
# cuDNN's kernel first (--sdpa-first), then the seed's best at 24 GiB (b8 checkpointed, compiled, torch's own choice)
# in the same call; 3. if time is left, ours b2 under 8 GiB with cuDNN's kernel first.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind1 TRITON_CACHE_DIR=/tmp/tri1 BENCH_CALL=${BENCH_CALL:-attn-1}
W=/tmp/b; S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
left() { local l=$(( $1 - ($(date +%s) - S) )); [ $l -gt $2 ] && l=$2; echo $l; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
el wheels; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout -k 5 90 python3 bench/sdpa_backends_gpu.py > $OUT/sdpa.log 2>&1; echo rc=$?; cut -c1-400 $OUT/sdpa.log
ours() {  # $1 label, rest: bench arguments
  local label=$1; shift; el "$label"
  timeout -k 5 $(left 585 200) python3 bench/bench_train_gpu.py --work $W --steps 12 "$@" > $OUT/$label.log 2>&1
  echo rc=$?; grep -E '^\{"(call|name|sdpa)' $OUT/$label.log | cut -c1-1200
}
seed() {  # $1 label, $2 cap GiB, $3 batch, $4 time limit
  el "$1"; mkdir -p $W/seed_src && tar xzf peers/seed-77605fe.tar.gz -C $W/seed_src
  TORCHINDUCTOR_CACHE_DIR=/tmp/ind_$1 TRITON_CACHE_DIR=/tmp/tri_$1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
  timeout -k 5 $(left 585 $4) python3 -c "import sys, runpy, torch; \
torch.cuda.set_per_process_memory_fraction($2 * 2**30 / torch.cuda.mem_get_info()[1]); sys.argv = sys.argv[1:]; \
runpy.run_path(sys.argv[0], run_name='__main__')" peers/seed_bench.py --seed-src $W/seed_src/anima-flow-trainer \
    --repo $W/repo --data $W/data --work $W/seed_work_$1 --mode lora --batch $3 --steps 12 --compile default \
    > $OUT/$1.log 2>&1; echo rc=$?
  grep -E '^\{|OutOfMemory|out of memory' $OUT/$1.log | tail -2 | cut -c1-900
}
ours ours_b8_cap24_flash --only lora_b8 --cap-gib 24 --sdpa-first flash
ours ours_b8_cap24_cudnn --only lora_b8 --cap-gib 24 --sdpa-first cudnn
seed seed_b8_cap24 24 8 200
ours ours_b2_cap8_cudnn --only lora_b2 --cap-gib 8 --sdpa-first cudnn --latents 16 --steps 40
el end
