"""The machine: the environment check, Windows specifics, and the watch on the parent process."""
