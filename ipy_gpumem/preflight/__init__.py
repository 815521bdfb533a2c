"""The pre-flight estimate: a training step's peak memory and the batch size that fits, computed on fake tensors before anything runs on a GPU.

The room is named ``preflight`` rather than ``estimate`` so that importing one of its modules
never replaces the public function ``ipy_gpumem.estimate`` (a subpackage becomes an attribute of
its parent package on import).
"""
