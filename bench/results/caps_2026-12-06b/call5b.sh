#!/bin/bash
# Right after call 5, the machine still warm (issue #45, point 2b: the 13 s from spawning the worker to its first event
# in call 5): how long Python takes to import torch, to start CUDA, and to import the trainer, twice each in fresh
# processes; then Python's own import timings (-X importtime: call5/import_times_top150.txt) and a cProfile of that
# import (cumulative, printed). The wheels are those of call 5, installed the same way (--no-compile).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .comfygpu/whl/*.whl; export PYTHONPATH=/tmp/site:$PWD; for i in 1 2; do /usr/bin/time -f "torch %e s" python3 -c "import torch"; /usr/bin/time -f "torch+cuda %e s" python3 -c "import torch; torch.zeros(1, device='cuda')"; /usr/bin/time -f "train module %e s" python3 -c "import anima_train.training.train"; done; python3 -X importtime -c "import anima_train.training.train" 2> $OUT/imp.txt; sort -t'|' -k2 -n -r $OUT/imp.txt | head -40; python3 -c "
import cProfile, pstats, sys
cProfile.run('import anima_train.training.train', '/tmp/p')
pstats.Stats('/tmp/p').sort_stats('cumulative').print_stats(25)" 2>&1 | tail -45
