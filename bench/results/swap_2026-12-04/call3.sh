#!/bin/bash
# Call 3 (fresh machine, cold Inductor cache), from the repository root with wheels in .comfygpu/whl: why the swapped
# batch-1 run under 6 GiB is slow (call 2: 0.502 s/image with the prefetch, 0.2815 resident): the host-to-device
# bandwidth of one block's weights from pinned memory, the same run without the prefetch (weight_swap.PREFETCH =
# False), then both profiled (bench/profile_train_gpu.py: 3 steps after 4 + 1 warm-up, tables by GPU and by host time).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/ind TRITON_CACHE_DIR=/tmp/tri
W=/tmp/b; B=bench/bench_train_gpu.py; P=bench/profile_train_gpu.py; S=$(date +%s)
el() { echo "=== $(( $(date +%s) - S )) s: $*"; }
left() { local l=$(( $1 - ($(date +%s) - S) )); [ $l -gt $2 ] && l=$2; echo $l; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
el bandwidth
python3 - <<'PY'
import torch
n = 69_206_528  # one DiT block's weights (bf16)
dev = torch.empty(n, dtype=torch.bfloat16, device="cuda")
for pinned in (True, False):
    host = torch.randn(n).to(torch.bfloat16)
    host = host.pin_memory() if pinned else host
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); [dev.copy_(host, non_blocking=True) for _ in range(10)]; b.record(); torch.cuda.synchronize()
    ms = a.elapsed_time(b) / 10
    print(f"one block ({n * 2 / 2**30:.3f} GiB) host to device, {'pinned' if pinned else 'pageable'}: {ms:.2f} ms, {n * 2 / ms / 1e6:.1f} GB/s")
PY
el prepare
python3 - <<'PY' 2>&1 | tail -1
import importlib.util, sys, time
from pathlib import Path
sys.argv = ["x"]
spec = importlib.util.spec_from_file_location("b", "bench/bench_train_gpu.py"); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
t = time.time(); m.prepare(Path("/tmp/b")); print("prepared", round(time.time() - t, 1))
PY
NOPF="anima_train.training.weight_swap.PREFETCH=False"
el "ours lora_b1@4 cap 6, no prefetch"
timeout -k 5 $(left 230 190) python3 $B --work $W --only lora_b1@4 --cap-gib 6 --steps 12 --diag --torch-set $NOPF \
  > $OUT/C1_cap6_b1_swap4_noprefetch.log 2>&1; echo rc=$?
grep -E '"who"|checkpointing auto|Error' $OUT/C1_cap6_b1_swap4_noprefetch.log | cut -c1-700 | tail -3
el "profile lora_b1@4 cap 6, prefetch"
timeout -k 5 $(left 380 150) python3 $P --work $W --run lora_b1@4 --cap-gib 6 --compile default --steps 3 --no-trace \
  --out $OUT/C2 > /tmp/C2.log 2>&1; echo rc=$?
tail -5 /tmp/C2.log | cut -c1-400; grep -E "wall_ms|busy_ms|host_bound|memcpy|host_syncs" /tmp/C2.log
el "profile lora_b1@4 cap 6, no prefetch"
timeout -k 5 $(left 500 130) python3 -c "import sys, runpy, anima_train.training.weight_swap as w; w.PREFETCH = False; \
sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')" $P --work $W --run lora_b1@4 --cap-gib 6 \
  --compile default --steps 3 --no-trace --out $OUT/C3 > /tmp/C3.log 2>&1; echo rc=$?
tail -5 /tmp/C3.log | cut -c1-400; grep -E "wall_ms|busy_ms|host_bound|memcpy|host_syncs" /tmp/C3.log
el end
