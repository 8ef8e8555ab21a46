"""Layer 8, run: the loop (trainer, step math, resume decisions, run record and directory, faults, console, metric sinks)."""
