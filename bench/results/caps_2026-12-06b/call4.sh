#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl, the ComfyUI 0.29.0 snapshot tarball in .comfygpu/)
# (issue #45, point 2b): the Train node's first step cold, then warm. bench/comfyui_template_path.py: full-size random
# weights as ComfyUI single files, the LoRA template queued over the API with 20 synthetic 1024² images and 200 steps
# (LoRA r32, batch 1; compile = "auto" compiles from 200 steps), twice: each prompt's Train node spawns a fresh worker
# process, so the second one starts from the compile cache the first left, as after a restart of ComfyUI. The cache
# is the worker's own default (the per-user folder): a fresh machine's, so the first prompt is cold.
export PYTHONUNBUFFERED=1 BENCH_CALL=${BENCH_CALL:-caps-b4}
S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
el wheels; nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
mkdir -p /tmp/comfy /tmp/fe && tar xzf .comfygpu/ComfyUI-*.tar.gz -C /tmp/comfy && echo '<html>api only</html>' > /tmp/fe/index.html
el driver
timeout -k 5 ${T1:-540} python3 bench/comfyui_template_path.py --size full --comfy-root /tmp/comfy/ComfyUI \
  --python python3 --out /tmp/n4 --work /tmp/w4 --front-end-root /tmp/fe --images 20 --steps 200 \
  --variants plain,plain#2 > $OUT/driver.log 2>&1; echo rc=$?
el done
cp /tmp/n4/rows.jsonl $OUT/ 2>/dev/null; cat $OUT/rows.jsonl 2>/dev/null | cut -c1-700
grep -h "compiled kernels kept in\|torch.compile" /tmp/n4/*.log /tmp/w4/*/*.log 2>/dev/null | sort | uniq -c | head -4
tail -4 $OUT/driver.log | cut -c1-1500
el end
