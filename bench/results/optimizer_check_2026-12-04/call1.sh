#!/bin/bash
# One GPU call, from the repository root with wheels in .comfygpu/whl: AdamWKahan compiled against its eager
# arithmetic on the DiT's shapes (bench/optimizer_check_gpu.py), without and with Inductor's combo kernels.
export PYTHONUNBUFFERED=1 PYTHONPATH=. TORCHINDUCTOR_CACHE_DIR=/tmp/ind2 TRITON_CACHE_DIR=/tmp/tri2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=.:/tmp/site || exit 1
timeout -k 5 ${T:-110} python3 bench/optimizer_check_gpu.py > $OUT/plain.log 2>&1; echo rc=$?; tail -3 $OUT/plain.log | cut -c1-1500
timeout -k 5 ${T:-110} python3 bench/optimizer_check_gpu.py --combo > $OUT/combo.log 2>&1; echo rc=$?; tail -3 $OUT/combo.log | cut -c1-1500
