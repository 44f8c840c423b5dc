#!/bin/bash
# NOT RUN (no machine came in time on 2026-12-06; its second half ran as ../standby_attention_2026-12-06/call1.sh).
# One GPU call, from the repository root (wheels in .comfygpu/whl, the ComfyUI 0.29.0 snapshot tarball in .comfygpu/)
# (issue #45, point 2b): the Train node's warm start with and without the waiting worker
# (docs/comfyui.md#the-waiting-worker), in one call. 1. ComfyUI started with ANIMA_TRAIN_STANDBY=0: the LoRA template
# twice (cold, then warm in a fresh process: calls 4-6's measurement). 2. ComfyUI started again without it: twice
# more, 20 s apart (a user looking at the result): the first warm run after a restart (no waiting worker yet), the
# second in the worker the first left. Compare from the Train node's start (`executing` 5 in each timeline) to the
# first step: the second ComfyUI's first prompt also converts the models again (its own work folder). First: whether
# this machine's Python writes bytecode at all (call 6: PYTHONPYCACHEPREFIX changed nothing).
export PYTHONUNBUFFERED=1 BENCH_CALL=${BENCH_CALL:-caps-b7}
S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
el wheels; nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
env | grep -E '^PYTHON' ; python3 -c "import sys; print('dont_write_bytecode', sys.flags.dont_write_bytecode)"
mkdir -p /tmp/comfy /tmp/fe && tar xzf .comfygpu/ComfyUI-*.tar.gz -C /tmp/comfy && echo '<html>api only</html>' > /tmp/fe/index.html
drive() {  # $1 label, $2 time limit, rest: driver arguments
  local label=$1 limit=$2; shift 2; el "$label"
  timeout -k 5 $limit python3 bench/comfyui_template_path.py --size full --comfy-root /tmp/comfy/ComfyUI \
    --python python3 --out $OUT/$label --work /tmp/w_$label --front-end-root /tmp/fe --images 20 --steps 200 "$@" \
    > $OUT/$label.log 2>&1; echo rc=$?
  grep -o '] row {.*' $OUT/$label.log | cut -c1-330
  python3 -c "
import json; s = json.load(open('$OUT/$label/summary.json'))
for v, r in s.get('prompts', {}).items(): print(v, r.get('prompt_s'), [x for x in r.get('timeline', []) if x[1] != 'message'])
" 2>&1 | cut -c1-1500
}
ANIMA_TRAIN_STANDBY=0 drive off 300 --variants plain,plain#2
drive on 270 --variants plain#3,plain#4 --pause 20
el end
