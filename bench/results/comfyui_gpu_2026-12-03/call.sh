#!/bin/bash
# One GPU call (from this repository's root; wheels in .comfygpu/whl, the ComfyUI snapshot tarball in .comfygpu/):
# 1. the template's path through ComfyUI at full size with --preload: the base branch first, so ComfyUI holds its
#    models on the GPU when Train starts (shows them freed while the worker trains, and loaded again after);
# 2. the bench's configuration of the template's worker (encode_b1 = LoRA r32, batch 1, 1024², source = "encode",
#    50 steps, compile off as compile = "auto" picks for 50 steps) for a like-for-like s/step;
# 3. if time is left, the same compiled (what a run of 200+ steps would get).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
el wheels; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
mkdir -p /tmp/comfy /tmp/fe && tar xzf .comfygpu/ComfyUI-*.tar.gz -C /tmp/comfy && echo '<html>api only</html>' > /tmp/fe/index.html
el comfy-path
timeout -k 5 ${T1:-330} python3 bench/comfyui_template_path.py --size full --comfy-root /tmp/comfy/ComfyUI \
  --python python3 --preload --out $OUT/path --work /tmp/w --front-end-root /tmp/fe > $OUT/path_driver.log 2>&1; echo rc=$?
tail -3 $OUT/path_driver.log | cut -c1-3000
rm -rf /tmp/w
el bench-eager
timeout -k 5 ${T2:-150} python3 bench/bench_train_gpu.py --work /tmp/b --only encode_b1 --steps 50 --compile off \
  > $OUT/bench_encode_b1_eager.log 2>&1
echo rc=$?; grep -E '"who"|s_per_step|Error' $OUT/bench_encode_b1_eager.log | cut -c1-800 | tail -4
el bench-compiled; L=$(( ${TOTAL:-575} - ($(date +%s) - S) ))
timeout -k 5 $L python3 bench/bench_train_gpu.py --work /tmp/b --only encode_b1 --steps 50 --compile default \
  > $OUT/bench_encode_b1_compiled.log 2>&1
echo rc=$?; grep -E '"who"|s_per_step|Error' $OUT/bench_encode_b1_compiled.log | cut -c1-800 | tail -4
el end
