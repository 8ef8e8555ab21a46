"""Layer 5, distributed: the process group's life cycle, wrap(model) for none|ddp|fsdp|fsdp1, and the launch agreement between torchrun ranks."""
