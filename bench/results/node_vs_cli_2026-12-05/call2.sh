#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl, the peer kit in peers/): time to the first step,
# cold and warm, ours against the seed in the same call (issue #45, point 2), LoRA r32 b8 1024² under a 24 GiB cap
# (the README's row). Ours twice in one process (--twice: the second run's compile finds the first's Inductor cache,
# as a second run or a restarted ComfyUI would with a kept cache), then the seed, cold, its best at 24 GiB (b8
# checkpointed, compiled, with its own empty Inductor and Triton caches). Each row: first_step_s from train() / the seed's Trainer being built, steady_s.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri BENCH_CALL=${BENCH_CALL:-first-step-1}
W=/tmp/b; S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
left() { local l=$(( $1 - ($(date +%s) - S) )); [ $l -gt $2 ] && l=$2; echo $l; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
el ours; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout -k 5 $(left 420 420) python3 bench/bench_train_gpu.py --work $W --only lora_b8 --cap-gib 24 --steps 12 --twice \
  > $OUT/ours_b8_cap24_twice.log 2>&1; echo rc=$?
grep -E '^\{"(call|device)|error|Error' $OUT/ours_b8_cap24_twice.log | cut -c1-900
el seed
mkdir -p $W/seed_src && tar xzf peers/seed-77605fe.tar.gz -C $W/seed_src
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_seed TRITON_CACHE_DIR=/tmp/tri_seed PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 $(left 585 200) python3 -c "import sys, runpy, torch; \
torch.cuda.set_per_process_memory_fraction(24 * 2**30 / torch.cuda.mem_get_info()[1]); sys.argv = sys.argv[1:]; \
runpy.run_path(sys.argv[0], run_name='__main__')" peers/seed_bench.py --seed-src $W/seed_src/anima-flow-trainer \
  --repo $W/repo --data $W/data --work $W/seed_work --mode lora --batch 8 --steps 12 --compile default \
  > $OUT/seed_b8_cap24.log 2>&1; echo rc=$?
grep -E '^\{|OutOfMemory|out of memory' $OUT/seed_b8_cap24.log | tail -2 | cut -c1-900
el end
