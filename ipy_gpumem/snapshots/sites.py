"""Where an allocation came from: the innermost frame of the user's own code, a notebook cell named as that cell."""
from __future__ import annotations

import re
from typing import Any, Mapping, NamedTuple, Optional, Sequence

__all__ = ["Site", "site_of", "cell_label", "UNKNOWN"]

# ipykernel names a cell's code /tmp/ipykernel_<pid>/<hash>.py; terminal IPython <ipython-input-N-hash>.
_KERNEL_CELL = re.compile(r"ipykernel_(\d+)[/\\](\d+)\.py$")
_INPUT_CELL = re.compile(r"<ipython-input-(\d+)-[0-9a-f]+>$")
# Library code: installed packages and the interpreter's own modules.
_LIBRARY = re.compile(r"[/\\](?:site|dist)-packages[/\\]|[/\\]lib[/\\]python\d[\d.]*[/\\]|^<frozen |[/\\]Lib[/\\]")


# The recorder's and the allocator's own C++ frames, innermost in every C++ stack: never the site.
_ALLOCATOR = re.compile(r"torch::unwind|torch::CapturedTraceback|torch::cuda::|c10::cuda::|c10::(?:Storage|Tensor)Impl|"
                        r"c10::intrusive_ptr|at::detail::empty|at::empty|at::native::empty")


class Site(NamedTuple):
    """One allocation site: a file, line and function; ``label`` is how a person reads it."""

    file: str
    line: int
    function: str
    label: str
    user: bool  # the user's own code (a cell or their file), not a library frame


#: The site of blocks recorded without stacks (``record_context=False``, or before recording began).
UNKNOWN = Site("", 0, "", "(no stack recorded)", False)


def cell_label(filename: str, cells: Optional[Mapping[str, int]] = None) -> Optional[str]:
    """``"In [7]"`` for a cell of this session, ``"cell 3105878423.py"`` for another kernel's, None for a file."""
    if cells and filename in cells:
        return f"In [{cells[filename]}]"
    m = _INPUT_CELL.search(filename)
    if m:
        return f"In [{m.group(1)}]"
    m = _KERNEL_CELL.search(filename)
    if m:
        return f"cell {m.group(2)}.py"
    return None


def _text(frame: Mapping[str, Any], key: str) -> str:
    value = frame.get(key)
    return value if type(value) is str else ""  # a file's frames are data: anything else reads as nothing


def _python(frame: Mapping[str, Any]) -> bool:
    name = _text(frame, "filename")
    return name.endswith(".py") or name.startswith("<ipython-input-")


def _site(frame: Mapping[str, Any], user: bool, cells) -> Site:
    filename = _text(frame, "filename")
    line = frame.get("line")
    line = line if type(line) is int else 0
    function = _text(frame, "name")
    cell = cell_label(filename, cells)
    if cell is not None:
        label = f"{cell}, line {line}"
    else:
        short = filename.replace("\\", "/").rsplit("/", 2)
        label = f"{'/'.join(short[-2:])}:{line} ({function})"
    return Site(filename, line, function, label, user)


def site_of(frames: Optional[Sequence[Mapping[str, Any]]], cells: Optional[Mapping[str, int]] = None) -> Site:
    """The site of one allocation from its frames (innermost first, as torch records them).

    The innermost frame of code outside installed packages and the standard library (a notebook
    cell, the user's script); failing that the innermost Python frame; :data:`UNKNOWN` without any.
    """
    if not frames:
        return UNKNOWN
    first_python = None
    for frame in frames:
        if not isinstance(frame, Mapping) or not _python(frame):
            continue
        if first_python is None:
            first_python = frame
        if not _LIBRARY.search(_text(frame, "filename")):
            return _site(frame, True, cells)
    if first_python is not None:
        return _site(first_python, False, cells)
    name = next((_text(f, "name") for f in frames if isinstance(f, Mapping) and _text(f, "name")
                 and not _ALLOCATOR.match(_text(f, "name"))), "")
    return Site("", 0, name, f"(C++ only) {name[:60]}" if name else UNKNOWN.label, False)
