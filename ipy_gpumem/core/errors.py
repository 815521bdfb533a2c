"""The one warning class ipy_gpumem raises, defined where ``%reload_ext`` never re-creates it.

``%reload_ext ipy_gpumem`` re-executes the package's top module only; a class defined there would
be a new class after every reload, and a user's ``warnings.filterwarnings(..., GpuMemWarning)``
would silently stop matching. Defined here, it stays the same object for the whole session.
"""
from __future__ import annotations

__all__ = ["GpuMemWarning"]


class GpuMemWarning(UserWarning):
    """Something inside ipy_gpumem went wrong; your code and data are unaffected."""
