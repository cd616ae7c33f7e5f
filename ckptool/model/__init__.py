"""The model of a checkpoint: container, weights, keys, modules, optimizers, casts, devices."""
