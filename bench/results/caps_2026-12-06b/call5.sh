#!/bin/bash
# One GPU call, from the repository root (wheels in .comfygpu/whl, the ComfyUI 0.29.0 snapshot tarball in .comfygpu/)
# (issue #45, point 2b): call4 again, now with where the time before the first step goes (each prompt's `timeline`
# in summary.json: ComfyUI's node executions and the trainer's events, seconds after queueing) and the CLI on the job
# TOML each prompt's node wrote, run right after it in the same call (`--cli plain`; its timeline too): the node's
# warm start against a second run from the shell of the same job.
export PYTHONUNBUFFERED=1 BENCH_CALL=${BENCH_CALL:-caps-b5}
S=$(date +%s); el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
el wheels; nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv
mkdir -p /tmp/comfy /tmp/fe && tar xzf .comfygpu/ComfyUI-*.tar.gz -C /tmp/comfy && echo '<html>api only</html>' > /tmp/fe/index.html
el driver
timeout -k 5 ${T1:-560} python3 bench/comfyui_template_path.py --size full --comfy-root /tmp/comfy/ComfyUI \
  --python python3 --out /tmp/n5 --work /tmp/w5 --front-end-root /tmp/fe --images 20 --steps 200 \
  --variants plain,plain#2 --cli plain > $OUT/driver.log 2>&1; echo rc=$?
el done
cp /tmp/n5/rows.jsonl /tmp/n5/summary.json $OUT/ 2>/dev/null; cut -c1-400 $OUT/rows.jsonl
for f in $(find /tmp/w5 -name comfyui-worker.log); do cp $f $OUT/$(basename $(dirname $f)).worker.log; done
cp /tmp/n5/cli_*.log $OUT/ 2>/dev/null
python3 -c "
import json; s = json.load(open('$OUT/summary.json'))
for v, r in s.get('prompts', {}).items(): print(v, r.get('prompt_s'), [x for x in r.get('timeline', []) if x[1] != 'message' or 'speed' in x[2] or 'probed' in x[2]])
for v, t in s.get('cli_timelines', {}).items(): print(v, [x for x in t if x[1] != 'message' or 'speed' in x[2] or 'probed' in x[2]])
" 2>&1 | cut -c1-2500
el end
