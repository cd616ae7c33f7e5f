"""verify: weights load, and evaluate identically on CPU and every device."""
