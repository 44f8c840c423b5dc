#!/bin/bash
# Call 2: the same machine right after call1.sh (its wheels, ComfyUI and Inductor cache still there), the command as
# sent (one line there): a second ComfyUI with a work folder of its own, the LoRA template three times, 20 s apart. Its
# first prompt is the first run after a restart of ComfyUI with a warm compile cache (the Convert node converts again:
# a new work folder); the second runs in the waiting worker the first left. The third did not finish in the 300 s.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind1 TRITON_CACHE_DIR=/tmp/tri1 BENCH_CALL=sa-2
export PYTHONPATH=/tmp/site:$PWD
rm -rf /tmp/w_on2 && timeout -k 5 300 python3 bench/comfyui_template_path.py --size full --comfy-root /tmp/comfy/ComfyUI \
  --python python3 --out $OUT/on2 --work /tmp/w_on2 --front-end-root /tmp/fe --images 20 --steps 200 \
  --variants plain,plain#2,plain#3 --pause 20 > $OUT/on2.log 2>&1; echo rc=$?
