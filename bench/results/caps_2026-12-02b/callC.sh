#!/bin/bash
# call C (a fresh machine): compile's activation memory budget 0 for every block (the compiler recomputes everything
# in the backward graph, torch.utils.checkpoint unused): does the in-graph recompute alone give call A's 8 GiB gain,
# and at what memory? 8 GiB b2 (cold), then 12 GiB b4 (warm)
source bench/results/caps_2026-12-02b/common.sh
el prepare; prepare
ours lora_b2 8 C1_cap8_b2_budget0.log $(left 250 225) --checkpoint-blocks 0 \
  --torch-set torch._functorch.config.activation_memory_budget=0.0
ours lora_b4 12 C2_cap12_b4_budget0.log $(left 350 110) --checkpoint-blocks 0 \
  --torch-set torch._functorch.config.activation_memory_budget=0.0
el end
