#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl, the ComfyUI 0.29.0 snapshot tarball in .comfygpu/)
# (issue #45, point 2b after a restart of ComfyUI). bench/comfyui_template_path.py, a real ComfyUI, the LoRA template
# (batch 1, 20 images at 1024², 200 steps, so `compile = "auto"` compiles), full-size random weights; ComfyUI stopped
# and started again on the same folders before the second prompt (--restart).
# 1. `ahead`: before each prompt the driver asks for the next run's worker as the page does when a Train node
#    appears (POST /anima_train/worker_ahead) and waits 20 s (a user setting widgets): the first prompt compiles cold,
#    the second runs after the restart in the worker the page started.
# 2. `fresh`: the same without the page's request, on the warm compile cache of 1: the second prompt after the
#    restart starts a fresh worker process (the case stop 52 measured at 29.7 s from the Train node's start).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind1 TRITON_CACHE_DIR=/tmp/tri1 BENCH_CALL=${BENCH_CALL:-rs-1}
S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
el wheels; nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
env | grep -E '^PYTHON' ; python3 -c "import sys, torch; print('dont_write_bytecode', sys.flags.dont_write_bytecode, torch.__version__)"
mkdir -p /tmp/comfy /tmp/fe && tar xzf .comfygpu/ComfyUI-*.tar.gz -C /tmp/comfy && echo '<html>api only</html>' > /tmp/fe/index.html
drive() {  # $1 label, $2 time limit, rest: driver arguments
  local label=$1 limit=$2; shift 2; el "$label"
  timeout -k 5 $limit python3 bench/comfyui_template_path.py --size full --comfy-root /tmp/comfy/ComfyUI \
    --python python3 --out $OUT/$label --work /tmp/w_$label --front-end-root /tmp/fe --images 20 --steps 200 \
    --call $BENCH_CALL "$@" > $OUT/$label.log 2>&1; echo rc=$?
  grep -E '] (row|worker ahead|server up|ComfyUI stopped)' $OUT/$label.log | cut -c1-330
  python3 -c "
import json; s = json.load(open('$OUT/$label/summary.json'))
for v, r in s.get('prompts', {}).items(): print(v, r.get('prompt_s'), [x for x in r.get('timeline', []) if x[1] != 'message'])
" 2>&1 | cut -c1-1500
  rm -f $OUT/$label/*.png $OUT/$label/*.jpg; tar czf $OUT/$label.tgz -C $OUT $label && rm -rf $OUT/$label  # 8 files at most
}
drive ahead 300 --variants plain,plain#2 --restart --worker-ahead 20
drive fresh 260 --variants plain,plain#2 --restart
el end
