"""The pre-flight estimate: a training step's peak memory and the batch size that fits, computed on fake tensors before anything runs on a GPU.

``ipy_gpumem.estimate(step, ...)`` is the public function, and this room has the same name: once a
module of the room is imported, Python sets the package attribute ``ipy_gpumem.estimate`` to this
module, replacing the function. The module is therefore callable too, with the same signature, so
``ipy_gpumem.estimate(step, *args)`` works whatever was imported first.
"""
import sys as _sys
import types as _types


class _CallableRoom(_types.ModuleType):
    def __call__(self, step, *args, **kwargs):
        from .run import estimate

        return estimate(step, *args, **kwargs)


_sys.modules[__name__].__class__ = _CallableRoom
