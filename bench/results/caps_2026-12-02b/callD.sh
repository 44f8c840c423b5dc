#!/bin/bash
# call D (a fresh machine, cold Inductor cache): 24 GiB b8, the planner (checkpoint_blocks auto, same command as B3)
# and the seed's best there (b8, its gradient checkpointing on, its default) in the same call, for a matched ratio;
# the whole call within 560 s
source bench/results/caps_2026-12-02b/common.sh
el prepare; prepare
ours lora_b8 24 D1_cap24_b8_planner.log $(left 290 260)
seed 8 24 D2_cap24_b8_seed.log $(left 555 330)
el end
