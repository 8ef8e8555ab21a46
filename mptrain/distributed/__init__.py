"""Layer 5, distributed: the process group's life cycle, wrap(model) for none|ddp|fsdp|fsdp1, and torchrun's key-value store for what the ranks share before any process group exists."""
