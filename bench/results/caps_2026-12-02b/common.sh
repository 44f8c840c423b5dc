#!/bin/bash
# sourced by callA.sh / callB.sh (run from .gputree, a copy of the repository with the peer kit under peers/)
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
W=/tmp/b; B=bench/bench_train_gpu.py; S=$(date +%s)
el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
left() { local l=$(( $1 - ($(date +%s) - S) )); [ $l -gt $2 ] && l=$2; echo $l; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
prepare() {
python3 - <<'PY' 2>&1 | tail -1
import importlib.util, sys, time
from pathlib import Path
sys.argv = ["x"]
spec = importlib.util.spec_from_file_location("b", "bench/bench_train_gpu.py"); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
t = time.time(); m.prepare(Path("/tmp/b")); print("prepared", round(time.time() - t, 1))
PY
[ -d $W/seed_src ] || { mkdir -p $W/seed_src && tar xzf peers/seed-77605fe.tar.gz -C $W/seed_src; }
}
# ours: NAME CAP LOG TIMEOUT [more bench args]
ours() { local name=$1 cap=$2 log=$3 t=$4; shift 4
  el "ours $name cap $cap $* (limit $t s)"
  timeout -k 5 $t python3 $B --work $W --only $name --cap-gib $cap --steps 12 --diag "$@" > $OUT/$log 2>&1; echo rc=$?
  grep -E '"who"|checkpointing auto|torch_set|Error|error' $OUT/$log | grep -v Warning | cut -c1-600 | tail -6; }
# the seed, unmodified, under the same cap (its own expandable segments through the environment): BATCH CAP LOG TIMEOUT
seed() { local b=$1 cap=$2 log=$3 t=$4
  el "seed b$b cap $cap (limit $t s)"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 5 $t python3 -c "import sys, runpy, torch; \
torch.cuda.set_per_process_memory_fraction($cap * 2**30 / torch.cuda.mem_get_info()[1]); sys.argv = sys.argv[1:]; \
runpy.run_path(sys.argv[0], run_name='__main__')" peers/seed_bench.py --seed-src $W/seed_src/anima-flow-trainer \
    --repo $W/repo --data $W/data --work $W/seed_work --mode lora --batch $b --steps 12 --compile default > $OUT/$log 2>&1
  echo rc=$?; grep -E '^\{' $OUT/$log | tail -2 | cut -c1-600; }
