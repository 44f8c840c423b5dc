#!/bin/bash
# call B (right after A, on the same machine while it is warm: Inductor's cache holds A's graphs): 12 GiB b4 and
# 24 GiB b8: the fixed planner, the activation budget (0.06: every block keeps its attention output) and, at 12 GiB,
# the seed's best (b4, checkpointed)
source bench/results/caps_2026-12-02b/common.sh
el prepare; prepare
ours lora_b4 12 B1_cap12_b4_planner.log $(left 150 140)
ours lora_b4 12 B2_cap12_b4_budget006.log $(left 300 170) --checkpoint-blocks 0 \
  --torch-set torch._functorch.config.activation_memory_budget=0.06
ours lora_b8 24 B3_cap24_b8_planner.log $(left 410 120)
ours lora_b8 24 B4_cap24_b8_budget006.log $(left 510 120) --checkpoint-blocks 0 \
  --torch-set torch._functorch.config.activation_memory_budget=0.06
seed 4 12 B5_cap12_b4_seed.log $(left 590 150)
el end
