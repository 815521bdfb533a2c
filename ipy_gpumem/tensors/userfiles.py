"""Whose code a file holds: the user's (a notebook cell, a script, a module of theirs), or Python's, an installed package's or ipy_gpumem's.

The walk reads only the user's code (a library's functions and modules are its own business), and
the estimate names the user's lines; both ask here. The verdict is kept per file name.
"""
from __future__ import annotations

import os
import site
import sys
import sysconfig
from typing import Any, Dict, Optional, Tuple

__all__ = ["is_user_file"]


def _library_prefixes() -> Tuple[str, ...]:
    paths = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        try:
            paths.add(sysconfig.get_paths()[key])
        except Exception:  # noqa: BLE001
            pass
    try:
        paths.update(site.getsitepackages())
    except Exception:  # noqa: BLE001 - some virtualenvs' site module lacks it
        pass
    try:
        paths.add(site.getusersitepackages())
    except Exception:  # noqa: BLE001
        pass
    for prefix in (sys.prefix, sys.base_prefix, sys.exec_prefix):
        paths.add(os.path.join(prefix, "lib"))
    return tuple(sorted(os.path.realpath(p) + os.sep for p in paths if p))


_PREFIXES: Optional[Tuple[str, ...]] = None
_USER_FILES: Dict[str, bool] = {}


def is_user_file(filename: Any) -> bool:
    """Whether code from ``filename`` is the user's: a notebook cell, a script, a module of theirs,
    not the standard library or an installed package (and never ipy_gpumem)."""
    global _PREFIXES
    if not isinstance(filename, str) or not filename:
        return False
    known = _USER_FILES.get(filename)
    if known is not None:
        return known
    if filename.startswith("<"):
        # "<ipython-input-3-...>", "<cell>", "<string>"; "<frozen ...>" is Python's own.
        verdict = not filename.startswith(("<frozen", "<built"))
    else:
        if _PREFIXES is None:
            _PREFIXES = _library_prefixes()
        real = os.path.realpath(filename)
        verdict = not real.startswith(_PREFIXES) and f"{os.sep}ipy_gpumem{os.sep}" not in real
    if len(_USER_FILES) > 10_000:
        _USER_FILES.clear()
    _USER_FILES[filename] = verdict
    return verdict
