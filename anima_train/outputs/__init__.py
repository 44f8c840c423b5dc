"""What a run leaves behind: its folder, checkpoint files, progress events, the loss chart, TensorBoard."""
