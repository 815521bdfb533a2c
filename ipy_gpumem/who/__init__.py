"""Who holds the memory: every tensor byte in the user's namespace attributed to a category and a typed holder.

    holders.py      Holder rows (kind, roots, expr, frame, keys) and IPython's own references, by identity
    claims.py       the categories and the claim that each storage's holders make for it
    walk.py         the breadth-first walk over the namespace, IPython's caches and the last error, on a budget
    graphs.py       its autograd half: what the graphs of the tensors it found keep alive
    attribution.py  who() and WhoReport
    view.py         %gpumem who and the OOM panel's "who holds it" section

Importing this package imports none of them: the extension loads them when first used.

The package shares its name with the public function ``ipy_gpumem.who()``, and importing a
submodule makes Python set ``ipy_gpumem.who`` to this package (after the first ``%gpumem who`` or
OOM panel, ``ipy_gpumem.who()`` would raise "'module' object is not callable"). So this package,
when ``ipy_gpumem.who`` was that function, answers calls by passing them on to it.
"""
import sys
import types

_parent = sys.modules.get(__name__.rpartition(".")[0])
_public = getattr(_parent, "who", None)  # ipy_gpumem.who(), about to be replaced by this package


class _CallableRoom(types.ModuleType):
    """This package, callable as the ``ipy_gpumem.who()`` it stands in for."""

    def __call__(self, *args, **kwargs):
        return _public(*args, **kwargs)


if callable(_public) and not isinstance(_public, types.ModuleType):
    sys.modules[__name__].__class__ = _CallableRoom
