"""The anatomy of a cell's memory: which bytes are parameters, gradients, optimizer state, activations or other tensors, line by line and phase by phase."""
