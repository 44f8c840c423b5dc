#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl, the ComfyUI 0.29.0 snapshot tarball in .comfygpu/)
# (issue #45, point 2b): call4 again (its two prompts, no CLI runs: device time was short), with a writable home for
# Python's bytecode (PYTHONPYCACHEPREFIX): the device's venv (/opt/torch/.venv) is read-only and every process there
# compiled ~2,000 modules from source (5.5 s of the 12.1 s `import anima_train.training.train` took, call 5b). First
# the compile probe's own time on the GPU, in a fresh process, twice; last the warm CLI start under cProfile (the
# second prompt's job TOML, compile = "default" as auto chose, 3 steps, nothing saved).
export PYTHONUNBUFFERED=1 BENCH_CALL=${BENCH_CALL:-caps-b6} PYTHONPYCACHEPREFIX=/tmp/pyc
S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
el wheels; nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
mkdir -p /tmp/comfy /tmp/fe && tar xzf .comfygpu/ComfyUI-*.tar.gz -C /tmp/comfy && echo '<html>api only</html>' > /tmp/fe/index.html
el driver
for i in 1 2; do python3 -c "
import time, torch; torch.zeros(1, device='cuda'); import torch._inductor.config
from anima_train.system.compile_probe import probe_compile
t = time.perf_counter(); r = probe_compile('cuda'); print('probe', r, round(time.perf_counter() - t, 2), 's')"; done
timeout -k 5 ${T1:-400} python3 bench/comfyui_template_path.py --size full --comfy-root /tmp/comfy/ComfyUI \
  --python python3 --out $OUT/n6 --work /tmp/w6 --front-end-root /tmp/fe --images 20 --steps 200 \
  --variants plain,plain#2 > $OUT/driver.log 2>&1; echo rc=$?
el done
cut -c1-400 $OUT/n6/rows.jsonl
for f in $(find /tmp/w6 -name comfyui-worker.log); do cp $f $OUT/$(basename $(dirname $f)).worker.log; done
python3 -c "
import json; s = json.load(open('$OUT/n6/summary.json'))
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
el end
