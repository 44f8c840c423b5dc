#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl, the ComfyUI 0.29.0 snapshot tarball in .comfygpu/):
# the Train node against `anima-train train` on the same TOML, same GPU, same call (issue #45, point 1), validation
# off and on. bench/comfyui_template_path.py: full-size random weights as ComfyUI single files, the LoRA template
# queued over the API with 20 synthetic 1024² images and 50 steps (LoRA r32, batch 1, the template's defaults
# otherwise), once plain and once with validation (extra_toml [validation]: 10 % of the images held out, their loss
# every 10 steps and at the end). After each prompt the CLI trains the node's comfyui-job.toml (run_name changed) in a
# plain shell's environment. rows.jsonl: one line per run.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind3 TRITON_CACHE_DIR=/tmp/tri3 BENCH_CALL=${BENCH_CALL:-caps-3}
S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
el wheels; nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
python3 -c "import torch, diffusers, transformers, peft, accelerate; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__)"
mkdir -p /tmp/comfy /tmp/fe $OUT/n && tar xzf .comfygpu/ComfyUI-*.tar.gz -C /tmp/comfy && echo '<html>api only</html>' > /tmp/fe/index.html
el driver
timeout -k 5 ${T1:-545} python3 bench/comfyui_template_path.py --size full --comfy-root /tmp/comfy/ComfyUI \
  --python python3 --out /tmp/n3 --work /tmp/w3 --front-end-root /tmp/fe --images 20 --steps 50 \
  --variants plain,validation --cli plain > $OUT/driver.log 2>&1; echo rc=$?
el done
cp /tmp/n3/rows.jsonl $OUT/ 2>/dev/null; cat $OUT/rows.jsonl 2>/dev/null | cut -c1-700
tail -4 $OUT/driver.log | cut -c1-1500
rm -f /tmp/n3/*.png; tar czf $OUT/files.tgz -C /tmp/n3 . 2>/dev/null
el end
