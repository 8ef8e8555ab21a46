"""Layer 1, config: the typed schema of every key, its ConfigStore registration, and the checks that need only the config (command-line keys and values, ranges, cross-field rules)."""
