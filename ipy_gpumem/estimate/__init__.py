"""The pre-flight estimate: a training step's peak memory and the batch size that fits, computed on fake tensors before anything runs on a GPU."""
