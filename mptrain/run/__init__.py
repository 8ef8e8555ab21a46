"""Layer 7, run: the loop (trainer, step math, resume, run record and directory, checkpoints and their integrity, faults, console, metric sinks)."""
