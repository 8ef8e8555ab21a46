"""Layer 0, core: leaf helpers every layer may use (the user-error family, atomic files, a tensor's local shard, text formatting, third-party import noise); imports no other layer."""
