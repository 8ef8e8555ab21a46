"""Layer 3, data: sources -> tokenizer -> token store -> batches (and prefetch), each module using only the ones before it."""
