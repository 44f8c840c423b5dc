#!/bin/bash
# call A: 8 GiB, batch 2: the fixed planner (checkpoint_blocks auto), selective saving by compile's activation memory
# budget for every block instead (checkpoint_blocks 0, budget 0.04: what fits beside the all-checkpointed step), and
# the seed's best there (b2, checkpointed), each in its own process, one after the other
source bench/results/caps_2026-12-02b/common.sh
el prepare; prepare
ours lora_b2 8 A1_cap8_b2_planner.log $(left 250 210)
ours lora_b2 8 A2_cap8_b2_budget004.log $(left 430 180) --checkpoint-blocks 0 \
  --torch-set torch._functorch.config.activation_memory_budget=0.04
seed 2 8 A3_cap8_b2_seed.log $(left 585 240)
el end
