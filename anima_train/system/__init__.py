"""The machine: the environment check, Windows specifics, the watch on the parent process, the filter of
third-party lines a user cannot act on, and the interrupt policy."""
