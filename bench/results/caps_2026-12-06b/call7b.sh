#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl, the ComfyUI 0.29.0 snapshot tarball in .comfygpu/)
# (issue #45, point 2b through the Train node): call7.sh's second half alone (call7.sh did not get a machine in time,
# and this session's device time left no room for both halves; calls 4-6 measured the first half). One ComfyUI, the
# LoRA template twice, 20 s apart (a user looking at the result): the first prompt compiles cold, and when its run
# has ended the node starts the waiting worker; the second prompt's run starts in it. Compare from the Train node's
# start (`executing` 5 in each timeline) to the first step. First: whether this machine's Python writes bytecode.
export PYTHONUNBUFFERED=1 BENCH_CALL=${BENCH_CALL:-caps-b7b}
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
drive on 330 --variants plain,plain#2 --pause 20
ls $OUT/on
el end
