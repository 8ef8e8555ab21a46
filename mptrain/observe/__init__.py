"""Layer 6, observe: what the numbers look like (numerics, stability, float8 cast statistics, dtype audit, alerts, throughput, memory estimates); reads the model and optimizer, changes nothing."""
