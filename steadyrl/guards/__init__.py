"""Guard math: pure functions and small classes over tensors, no Trainer import."""
