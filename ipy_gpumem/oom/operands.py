"""The shapes of the tensors a failing line names, read from the traceback's frames without running the user's code.

For the innermost frames of a failing traceback, each name (or dotted name, ``self.stride``) that the
frame's source line mentions is looked up in the frame's locals and reduced to plain data at once:
an exact ``torch.Tensor`` or ``nn.Parameter`` to its shape, dtype and size (:class:`TensorInfo`), a
list or tuple of them to a tuple of those, a number, string, None or tuple of numbers to itself.
Nothing else is read: an attribute is taken only from an instance's own ``__dict__`` (and a
module's ``_parameters``/``_buffers``), never through ``getattr``, a property or ``__getattr__``,
and a tensor subclass is skipped (its ``shape`` could run Python). No tensor is kept.
"""
from __future__ import annotations

import re
import sys
from typing import Any, Dict, NamedTuple, Optional, Tuple

from ..tensors.module_tables import member_tables

__all__ = ["TensorInfo", "Operands", "FrameOperands", "operands_of", "statement_at", "MAX_FRAMES", "MAX_ITEMS"]

#: Innermost frames read: the failing line, the library frames around it, the user's line that called them.
MAX_FRAMES = 12
#: Items of one list read (``torch.cat(pieces)``); a longer list is skipped.
MAX_ITEMS = 100_000
_NAME = re.compile(r"(?<![\w.'\"])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
_SCALAR = (int, float, str, bool, type(None))


class TensorInfo(NamedTuple):
    """One tensor, as plain data: ``shape``, ``dtype`` (``"float32"``), ``itemsize`` and ``nbytes`` of its elements."""

    shape: Tuple[int, ...]
    dtype: str
    itemsize: int
    device: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


#: ``{name: value}`` for one frame, the values plain data (:class:`TensorInfo`, tuples, numbers, strings).
Operands = Dict[str, Any]


class FrameOperands(NamedTuple):
    """One frame's whole statement (a call over several lines included) and the values it names."""

    statement: str
    values: Operands


def operands_of(tb, max_frames: int = MAX_FRAMES) -> Tuple[FrameOperands, ...]:
    """One :class:`FrameOperands` per frame of ``tb`` (innermost last, as ``traceback.extract_tb`` lists
    them; empty for all but the ``max_frames`` innermost); ``()`` without torch or a traceback. Never raises."""
    torch = sys.modules.get("torch")
    if tb is None or torch is None:
        return ()
    try:
        exact = (torch.Tensor, torch.nn.Parameter)
        frames = []
        while tb is not None:
            frames.append((tb.tb_frame, tb.tb_lineno))
            tb = tb.tb_next
        out = []
        for i, (frame, lineno) in enumerate(frames):
            if len(frames) - i > max_frames:
                out.append(FrameOperands("", {}))
                continue
            out.append(_frame_operands(frame, lineno, exact))
        return tuple(out)
    except Exception:  # noqa: BLE001 - what cannot be read stays unknown; the panel goes on
        return ()


def statement_at(filename: str, lineno: int, module_globals=None, max_lines: int = 12) -> str:
    """The statement that starts at ``lineno``: that line, and the next ones while its brackets are open."""
    import linecache

    out, depth = [], 0
    for n in range(lineno, lineno + max_lines):
        line = linecache.getline(filename, n, module_globals)
        if not line:
            break
        out.append(line.rstrip())
        code = re.sub(r"'[^']*'|\"[^\"]*\"", "", line.split("#", 1)[0])
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        if depth <= 0:
            break
    return "\n".join(out).strip()


def _frame_operands(frame, lineno: int, exact) -> FrameOperands:
    try:
        line = statement_at(frame.f_code.co_filename, lineno, frame.f_globals)
    except Exception:  # noqa: BLE001
        return FrameOperands("", {})
    if not line:
        return FrameOperands("", {})
    try:
        local = frame.f_locals
    except Exception:  # noqa: BLE001
        return FrameOperands(line, {})
    found: Operands = {}
    code = "\n".join(part.split("#", 1)[0] for part in line.splitlines())
    for dotted in dict.fromkeys(_NAME.findall(code)):
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):  # self.stride, and self on its own
            name = ".".join(parts[:n])
            if name in found:
                break
            value = _resolve(local, parts[:n])
            if value is _MISSING:
                continue
            info = _plain(value, exact)
            if info is not _MISSING:
                found[name] = info
            break
    return FrameOperands(line, found)


_MISSING = object()


def _resolve(local, parts):
    try:
        if parts[0] not in local:
            return _MISSING
        value = local[parts[0]]
    except Exception:  # noqa: BLE001
        return _MISSING
    for attr in parts[1:]:
        try:
            own = object.__getattribute__(value, "__dict__")
        except Exception:  # noqa: BLE001 - no instance dict: nothing we may read
            return _MISSING
        if not isinstance(own, dict):
            return _MISSING
        if attr in own:
            value = own[attr]
            continue
        for inner in member_tables(own):  # an nn.Module's own tables
            if attr in inner:
                value = inner[attr]
                break
        else:
            return _MISSING
    return value


def _plain(value, exact):
    kind = type(value)
    if kind in exact:
        info = _tensor(value)
        return _MISSING if info is None else info
    if kind in _SCALAR:
        return value if not isinstance(value, str) or len(value) <= 64 else _MISSING
    if kind in (list, tuple) and len(value) <= MAX_ITEMS:
        if value and all(type(v) in exact for v in value):
            infos = tuple(_tensor(v) for v in value)
            return _MISSING if any(i is None for i in infos) else infos
        if all(type(v) is int for v in value) and len(value) <= 16:
            return tuple(value)
    return _MISSING


def _tensor(t) -> Optional[TensorInfo]:
    try:
        dtype = t.dtype
        return TensorInfo(tuple(int(d) for d in t.shape), str(dtype).replace("torch.", ""), int(dtype.itemsize),
                          str(t.device.type))
    except Exception:  # noqa: BLE001 - a meta or broken tensor: unknown
        return None
