#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl, the ComfyUI 0.29.0 snapshot tarball in .comfygpu/)
# (issue #45, point 2b): call5 again with Python's bytecode kept between processes, as on an installed machine. The
# device's venv (/opt/torch/.venv) is read-only, so without a pycache prefix every process compiles ~2,000 modules
# from source (5.5 s of the 12.1 s `import anima_train.training.train` took there, call 5b); PYTHONPYCACHEPREFIX gives
# the bytecode a writable home. Then the warm CLI start under cProfile (the second prompt's job TOML, compile =
# "default" as auto chose, 3 steps, nothing saved), and the compile probe's own time on the GPU, twice.
export PYTHONUNBUFFERED=1 BENCH_CALL=${BENCH_CALL:-caps-b6} PYTHONPYCACHEPREFIX=/tmp/pyc
S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
el wheels; nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
mkdir -p /tmp/comfy /tmp/fe && tar xzf .comfygpu/ComfyUI-*.tar.gz -C /tmp/comfy && echo '<html>api only</html>' > /tmp/fe/index.html
el driver
timeout -k 5 ${T1:-470} python3 bench/comfyui_template_path.py --size full --comfy-root /tmp/comfy/ComfyUI \
  --python python3 --out /tmp/n6 --work /tmp/w6 --front-end-root /tmp/fe --images 20 --steps 200 \
  --variants plain,plain#2 --cli plain > $OUT/driver.log 2>&1; echo rc=$?
el done
cp /tmp/n6/rows.jsonl /tmp/n6/summary.json $OUT/ 2>/dev/null; cut -c1-400 $OUT/rows.jsonl
for f in $(find /tmp/w6 -name comfyui-worker.log); do cp $f $OUT/$(basename $(dirname $f)).worker.log; done
cp /tmp/n6/cli_*.log $OUT/ 2>/dev/null
python3 -c "
import json; s = json.load(open('$OUT/summary.json'))
for v, r in s.get('prompts', {}).items(): print(v, r.get('prompt_s'), [x for x in r.get('timeline', []) if x[1] != 'message' or 'speed' in x[2] or 'probed' in x[2]])
for v, t in s.get('cli_timelines', {}).items(): print(v, [x for x in t if x[1] != 'message' or 'speed' in x[2] or 'probed' in x[2]])
" 2>&1 | cut -c1-2500
el profile
sed -e 's/^run_name = .*/run_name = "prof"/' -e '/^\[train\]/a compile = "default"' \
  /tmp/w6/comfy_base/output/anima_train/node_plain_2/comfyui-job.toml > /tmp/prof.toml
timeout -k 5 90 python3 -m cProfile -o $OUT/warm.prof -m anima_train train /tmp/prof.toml --max-steps 3 --no-save \
  > $OUT/prof.log 2>&1; echo rc=$?; tail -3 $OUT/prof.log | cut -c1-300
python3 -c "import pstats; s = pstats.Stats('$OUT/warm.prof'); s.sort_stats('cumulative').print_stats(90)" \
  | cut -c1-250 > $OUT/prof_cum.txt; head -60 $OUT/prof_cum.txt | tail -50
for i in 1 2; do python3 -c "
import time, torch; torch.zeros(1, device='cuda'); import torch._inductor.config
from anima_train.system.compile_probe import probe_compile
t = time.perf_counter(); r = probe_compile('cuda'); print('probe', r, round(time.perf_counter() - t, 2), 's')"; done
el end
