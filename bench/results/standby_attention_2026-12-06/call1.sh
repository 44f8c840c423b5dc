#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl, the ComfyUI 0.29.0 snapshot tarball in .comfygpu/)
# (issue #45): two questions in one call, as this session's device time allowed only one (four tries found no
# machine). 1. Point 4's attention lever: bench/sdpa_backends_gpu.py, torch's attention kernels on the DiT's shapes,
# and which one torch picks by itself. 2. Point 2b through the Train node (../caps_2026-12-06b/call7b.sh): one
# ComfyUI, the LoRA template twice, 20 s apart: the first prompt compiles cold, and when its run has ended the node
# starts the waiting worker; the second prompt's run starts in it. Compare from the Train node's start (`executing`
# 5 in each timeline) to the first step. 3. With the time left: ours LoRA r32 b8 1024² under 24 GiB with flash
# attention first, then with cuDNN's first (--sdpa-first); no seed run (not enough time), so no ratio to the seed.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind1 TRITON_CACHE_DIR=/tmp/tri1 BENCH_CALL=${BENCH_CALL:-sa-1}
W=/tmp/b; S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
left() { local l=$(( $1 - ($(date +%s) - S) )); [ $l -gt $2 ] && l=$2; echo $l; }
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
timeout -k 5 60 python3 bench/sdpa_backends_gpu.py --iters 10 > $OUT/sdpa.log 2>&1; echo rc=$?; cut -c1-400 $OUT/sdpa.log
drive on 330 --variants plain,plain#2 --pause 20
ls $OUT/on; rm -f $OUT/on/*.png $OUT/on/*.jpg; tar czf $OUT/on.tgz -C $OUT on && rm -rf $OUT/on  # 8 files come back at most
ours() {  # $1 label, rest: bench arguments
  local label=$1; shift; el "$label"
  timeout -k 5 $(left 580 200) python3 bench/bench_train_gpu.py --work $W --steps 12 "$@" > $OUT/$label.log 2>&1
  echo rc=$?; grep -E '^\{"(call|name|sdpa)' $OUT/$label.log | cut -c1-1200
}
ours ours_b8_cap24_flash --only lora_b8 --cap-gib 24 --sdpa-first flash
ours ours_b8_cap24_cudnn --only lora_b8 --cap-gib 24 --sdpa-first cudnn
el end
