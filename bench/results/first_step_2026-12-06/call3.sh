#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl, the peer kit in peers/), on this commit: every
# block of a compiled run runs one graph per way it runs (the first block's input asks for its gradient; a trunk
# that swaps gives every block the swapping class), on top of call 2's first step that recomputes as the run will
# (issue #45, point 2). LoRA r32 b8 1024² under 24 GiB: ours cold, the seed cold (b8 checkpointed, compiled, its own
# empty caches), ours warm in a fresh process under cProfile (where a warm start's time goes), then ours under 6 GiB b1.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri BENCH_CALL=${BENCH_CALL:-first-step-4}
W=/tmp/b; S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
left() { local l=$(( $1 - ($(date +%s) - S) )); [ $l -gt $2 ] && l=$2; echo $l; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
el wheels; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
ours() {  # $1 label, rest: python arguments before the bench's
  local label=$1; shift; el "$label"
  TORCH_LOGS=recompiles timeout -k 5 $(left 560 240) python3 "$@" --work $W --steps 12 --compile-report \
    > $OUT/$label.log 2>&1; echo rc=$?
  grep -E '^\{"(call|name)|^(swap|checkpointing)' $OUT/$label.log | cut -c1-1600
  echo "recompiles: $(grep -c 'Recompiling function' $OUT/$label.log)"
}
ours ours_b8_cap24_cold bench/bench_train_gpu.py --only lora_b8 --cap-gib 24
el seed
mkdir -p $W/seed_src && tar xzf peers/seed-77605fe.tar.gz -C $W/seed_src
TORCHINDUCTOR_CACHE_DIR=/tmp/ind_seed TRITON_CACHE_DIR=/tmp/tri_seed PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 $(left 330 200) python3 -c "import sys, runpy, torch; \
torch.cuda.set_per_process_memory_fraction(24 * 2**30 / torch.cuda.mem_get_info()[1]); sys.argv = sys.argv[1:]; \
runpy.run_path(sys.argv[0], run_name='__main__')" peers/seed_bench.py --seed-src $W/seed_src/anima-flow-trainer \
  --repo $W/repo --data $W/data --work $W/seed_work --mode lora --batch 8 --steps 12 --compile default \
  > $OUT/seed_b8_cap24_cold.log 2>&1; echo rc=$?
grep -E '^\{|OutOfMemory|out of memory' $OUT/seed_b8_cap24_cold.log | tail -2 | cut -c1-900
ours ours_b8_cap24_warm_profiled -m cProfile -o /tmp/warm.prof bench/bench_train_gpu.py --only lora_b8 --cap-gib 24
python3 -c "import pstats; p = pstats.Stats('/tmp/warm.prof'); p.sort_stats('cumulative').print_stats(45)" 2>&1 \
  | grep -vE '^\s*$' | cut -c1-230 > $OUT/warm_profile.txt; sed -n 1,60p $OUT/warm_profile.txt | cut -c1-200
python3 -c "import pstats; p = pstats.Stats('/tmp/warm.prof'); p.sort_stats('tottime').print_stats(25)" 2>&1 \
  | grep -vE '^\s*$' | cut -c1-230 > $OUT/warm_profile_self.txt; sed -n 1,40p $OUT/warm_profile_self.txt | cut -c1-200
ours ours_b1_cap6 bench/bench_train_gpu.py --only lora_b1 --cap-gib 6
el end
