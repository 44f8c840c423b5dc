"""One training run: the loop, its math (flow matching, optimizers, schedules), memory and speed, previews."""
