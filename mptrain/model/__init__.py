"""Layer 2, model: the model families as plain nn.Modules (no distributed or precision code), their names and layer groups, and text generation."""
