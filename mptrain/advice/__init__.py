"""Layer 10, advice: from a short probe's measurements to a recommended configuration (the pure rules, the probe that measures, the answer written out)."""
