#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl, the ComfyUI 0.29.0 snapshot tarball in .comfygpu/)
# (issue #45, point 2b after a restart of ComfyUI): call1.sh's `ahead` alone, with the time its two prompts need
# (in call 1 the first prompt, a cold compile and the template's sampling, took 140 s, and the 300 s limit ended the
# second before its timeline was written; call 1's `fresh` half ran out the same way).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind1 TRITON_CACHE_DIR=/tmp/tri1 BENCH_CALL=${BENCH_CALL:-rs-2}
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
drive ahead 430 --variants plain,plain#2 --restart --worker-ahead 20
el end
