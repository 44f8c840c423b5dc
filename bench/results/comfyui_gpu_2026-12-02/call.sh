#!/bin/bash
# One GPU call (run from a copy of this repository at .comfygpu/repo, wheels in .comfygpu/whl, the ComfyUI snapshot
# tarball in .comfygpu/): the template's path through ComfyUI at full size, then the bench's same configuration
# (lora_b1 = LoRA r32, batch 1, 1024 px, 50 steps) for the s/step comparison.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
el wheels; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
mkdir -p /tmp/comfy /tmp/fe && tar xzf ../ComfyUI-*.tar.gz -C /tmp/comfy && echo '<html>api only</html>' > /tmp/fe/index.html
el comfy-path
timeout -k 5 ${T1:-400} python3 bench/comfyui_template_path.py --size full --comfy-root /tmp/comfy/ComfyUI \
  --python python3 ${PRELOAD:+--preload} --out $OUT/path --work /tmp/w --front-end-root /tmp/fe > $OUT/path_driver.log 2>&1; echo rc=$?
tail -3 $OUT/path_driver.log | cut -c1-3000
rm -rf /tmp/w
el bench; L=$(( ${TOTAL:-575} - ($(date +%s) - S) ))
timeout -k 5 $L python3 bench/bench_train_gpu.py --work /tmp/b --only lora_b1 --steps 50 ${BENCH_ARGS:-} > $OUT/bench_lora_b1.log 2>&1
echo rc=$?; grep -E '"who"|s_per_step|Error' $OUT/bench_lora_b1.log | cut -c1-800 | tail -4
el end
