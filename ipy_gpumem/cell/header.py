"""The ``%%gpumem`` header, read in one place: what it asks for, and where the cell's own code starts.

The input transformer (which blanks the header so the cell runs as an ordinary cell), the cell
watcher (which measures it) and the magic itself (called programmatically) all read the header
through :func:`find_header` / :func:`parse_args`, so they cannot disagree about a cell. Bad
arguments raise :class:`HeaderError` with a one-line message that says the fix; the extension
turns it into IPython's ``UsageError``.
"""
from __future__ import annotations

import argparse
import builtins
import keyword
import os
import re
import shlex
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

from ..core.devices import ACCELERATOR_TYPES, HOST, SINGLE_DEVICE_TYPES, Device, parse_device

__all__ = ["CellPlan", "CellHeader", "HeaderError", "parse_args", "header_args", "find_header", "strip_header",
           "USAGE", "OPTIONS_HELP", "PROG"]

PROG = "%%gpumem"
USAGE = "%%gpumem [-l] [-o NAME] [-d DEVICE] [--estimate [GPU]] [--trace [PATH]]"

# IPython's own names in every user namespace, and its numbered caches (_5, _i5): storing a record
# there would break IPython (``-o get_ipython`` breaks every later magic) or be overwritten by it.
_IPYTHON_NAMES = frozenset(("In", "Out", "get_ipython", "exit", "quit", "_ih", "_oh", "_dh", "_i", "_ii", "_iii",
                            "_", "__", "___"))
_IPYTHON_NUMBERED = re.compile(r"^_i?[0-9]+$")


class HeaderError(ValueError):
    """A ``%%gpumem`` line that cannot be read; the message is one line and says the fix."""


class CellPlan(NamedTuple):
    """What one ``%%gpumem`` line asks for.

    Attributes:
        lines: measure every line of the cell (``-l`` / ``--lines``).
        output: the name to store the ``CellRecord`` under (``-o NAME``), or None.
        device: ``-d``: one accelerator device (``cuda:1``, ``mps``, ``xpu:0``), every device of
            one (``cuda``, ``xpu``) or the host only; None means the configured devices
            (``GpuMemMagics.devices``).
        estimate: ``--estimate [GPU]``: the GPU to judge the cell against ("T4", "this GPU"); the
            cell is not run, its code is estimated on fake copies of your objects. None: run it.
        trace: ``--trace [PATH]``: record the CUDA allocator's history for the cell and show it as
            a snapshot report; ``""`` without a path, the path to keep the snapshot in; None: off.
    """

    lines: bool = False
    output: Optional[str] = None
    device: Optional[Device] = None
    estimate: Optional[str] = None
    trace: Optional[str] = None

    @property
    def device_indices(self) -> Optional[Tuple[int, ...]]:
        """The accelerator's devices to measure (torch's indices, for the one accelerator a process uses):
        ``()`` for host only, ``(n,)``, ``(0,)`` for ``mps``, or None (configured/all)."""
        device = self.device
        if device is None:
            return None
        if device.is_host:
            return ()
        if device.index is None:
            return (0,) if device.type in SINGLE_DEVICE_TYPES else None
        return (device.index,)


class CellHeader(NamedTuple):
    """Where ``%%gpumem`` sits in a cell.

    Attributes:
        plan: what it asks for.
        offset: how many of the cell's lines come before the first line of code that runs
            (leading blank lines and cell-magic lines), as the code will be numbered after the
            transformer blanked (not removed) a last ``%%gpumem`` line.
        source_lines: the cell's lines as the user typed them (the report numbers them so).
    """

    plan: CellPlan
    offset: int
    source_lines: Tuple[str, ...] = ()

    def __repr__(self) -> str:  # the source lines are the cell itself: not repeated
        return f"CellHeader(plan={self.plan!r}, offset={self.offset!r})"


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting (a magic must never exit the kernel)."""

    def error(self, message):  # noqa: D401 - argparse's hook
        raise HeaderError(f"{PROG}: {message} (usage: {USAGE}; see %%gpumem?)")

    def exit(self, status=0, message=None):  # -h would exit the process
        raise HeaderError(f"{PROG}: use %%gpumem? for help")


def _make_parser() -> _Parser:
    parser = _Parser(prog=PROG, usage=USAGE, add_help=False, allow_abbrev=False)
    parser.add_argument("-l", "--lines", action="store_true",
                        help="also measure every line of the cell: hits, Δallocated, Δreserved, the peak within "
                             "the line, Δhost RSS, and for loops the net change apart from the churn")
    parser.add_argument("-o", "--output", metavar="NAME",
                        help="store the CellRecord in your namespace as NAME")
    parser.add_argument("-d", "--device", metavar="DEVICE",
                        help="measure only this device: cuda:N, cuda (every GPU), mps, xpu:N, or host")
    parser.add_argument("--estimate", metavar="GPU", nargs="?", const=THIS_GPU,
                        help="do not run the cell: predict its peak by running its code twice on fake copies of "
                             "your objects, per line, with the verdict against GPU (T4, A100-80, ...; default: "
                             "this GPU); -o stores the Estimate")
    parser.add_argument("--trace", metavar="PATH", nargs="?", const="",
                        help="on a GPU: record the CUDA allocator's events during the cell (at most 100,000, "
                             "with Python stacks) and show them as a snapshot report: the peak's sites by line "
                             "of the cell, fragmentation, the state at an out-of-memory; PATH keeps the snapshot "
                             "for memory_viz. Your own recording, if on, is left as it was")
    return parser


#: What ``--estimate`` without a GPU name judges against.
THIS_GPU = "this GPU"

_PARSER = _make_parser()


def _options_help() -> str:
    lines = []
    for action in _PARSER._actions:  # noqa: SLF001 - argparse keeps no public list
        flags = ", ".join(action.option_strings) + (f" {action.metavar}" if action.metavar else "")
        lines.append(f"  {flags:<20}{action.help}")
    return "\n".join(lines)


#: The options, one per line, for the magic's docstring (``%%gpumem?``).
OPTIONS_HELP = _options_help()


def _check_output(name: str) -> str:
    if not name.isidentifier():
        raise HeaderError(f"-o needs a Python name to store the record in, not {name!r}")
    if keyword.iskeyword(name):  # soft keywords (match, case, type) are fine as variable names
        raise HeaderError(f"-o {name}: {name!r} is a Python keyword; pick another name, e.g. -o rec")
    if name in _IPYTHON_NAMES or _IPYTHON_NUMBERED.match(name):
        raise HeaderError(f"-o {name}: IPython uses {name!r} itself; pick another name, e.g. -o rec")
    if hasattr(builtins, name):
        raise HeaderError(f"-o {name}: {name!r} is a Python builtin and storing the record there would hide it; "
                          "pick another name, e.g. -o rec")
    if name.startswith("__") and name.endswith("__"):
        raise HeaderError(f"-o {name}: names like {name!r} are Python's own; pick another name, e.g. -o rec")
    return name


_DEVICE_HELP = "use cuda:N (e.g. -d cuda:0), cuda for every GPU, mps, xpu:N, or host"


def _check_device(text: str) -> Device:
    try:
        device = parse_device(text)
    except ValueError:
        raise HeaderError(f"-d {text}: unknown device; {_DEVICE_HELP}") from None
    if device.is_host:
        return HOST
    if device.type not in ACCELERATOR_TYPES:  # which one this process has is checked when the cell runs
        raise HeaderError(f"-d {text}: ipy_gpumem measures accelerators torch knows and the host; {_DEVICE_HELP}")
    return device


def _check_gpu(text: str) -> str:
    from ..preflight.gpus import GPUS, resolve_gpu  # only when --estimate is asked for

    if text.strip().lower() in ("this gpu", "this", "current"):
        return THIS_GPU
    try:
        card = resolve_gpu(text)
    except ValueError:
        raise HeaderError(f"--estimate {text}: unknown GPU; name one of {', '.join(GPUS)}, or give a size "
                          "such as 16GiB (without a name: this GPU)") from None
    if card.capacity <= 0:  # "0", "-5", "0 MiB": a size, but no GPU has it
        raise HeaderError(f"--estimate {text}: a GPU's memory must be a positive size, such as 16GiB; or name one "
                          "(T4, A100-80, ...)")
    return text


def parse_args(arg: str) -> CellPlan:
    """The plan of a ``%%gpumem`` argument string (``"--lines -o rec"``).

    Raises:
        HeaderError: the arguments cannot be read; the message says the fix.

    Examples:
        >>> parse_args("-l -o rec -d cuda:1")
        CellPlan(lines=True, output='rec', device=Device(type='cuda', index=1), estimate=None, trace=None)
    """
    try:
        words = shlex.split(arg or "")
    except ValueError as exc:  # No closing quotation, No escaped character
        raise HeaderError(f"{PROG}: cannot read {arg.strip()!r}: {exc} (usage: {USAGE})") from None
    for word, following in zip(words, words[1:]):
        if word == "--estimate" and re.match(r"-\.?[0-9]", following):  # argparse would take "-5GiB" for an option
            raise HeaderError(f"--estimate {following}: a GPU's memory must be a positive size, such as 16GiB; or "
                              "name one (T4, A100-80, ...)")
    args = _PARSER.parse_args(words)
    output = None if args.output is None else _check_output(args.output)
    device = None if args.device is None else _check_device(args.device)
    estimate = None if args.estimate is None else _check_gpu(args.estimate)
    if estimate is not None and device is not None:
        raise HeaderError("--estimate and -d do not combine: the estimate runs on no device; name the GPU to "
                          "judge against instead (--estimate T4)")
    trace = None if args.trace is None else os.path.expanduser(args.trace)
    if trace is not None and estimate is not None:
        raise HeaderError("--trace and --estimate do not combine: --estimate does not run the cell, so there is "
                          "nothing to trace")
    return CellPlan(bool(args.lines), output, device, estimate, trace)


def header_args(line: str) -> Optional[str]:
    """The argument string of a ``%%gpumem ...`` line, or None for any other line (``%%gpumem?``,
    ``%%gpumemx``)."""
    if not line.startswith(PROG):
        return None
    rest = line[len(PROG):].rstrip("\r\n")
    if rest and not rest[0].isspace():
        return None
    return rest.strip()


def find_header(raw_cell: str, check: Optional[Callable[[CellPlan], None]] = None) -> Optional[CellHeader]:
    """The ``%%gpumem`` header among a cell's leading cell-magic lines, or None.

    Returns None as well when the header's arguments are bad, or ``check(plan)`` raises
    :class:`HeaderError` (a device that does not exist): the magic itself then raises the
    ``UsageError`` when IPython runs it, and the cell is not measured. And for ``--estimate``: the
    magic estimates the cell instead of running it, so there is nothing to measure.
    """
    if PROG not in raw_cell[:4096]:
        return None
    lines = raw_cell.splitlines()
    blank = 0
    while blank < len(lines) and not lines[blank].strip():
        blank += 1
    magics: List[str] = []
    for line in lines[blank:]:
        if not line.startswith("%%"):
            break
        magics.append(line)
    for k, line in enumerate(magics):
        arg = header_args(line)
        if arg is None:
            continue
        plan = _measured_plan(arg, check)
        if plan is None:
            return None
        # The measured code starts after the magic lines, except that the transformer blanks
        # (rather than removes) the %%gpumem line when it is the last one, keeping numbering.
        offset = blank + len(magics) - (1 if k == len(magics) - 1 else 0)
        return CellHeader(plan, offset, tuple(lines))
    return None


def _measured_plan(arg: str, check: Optional[Callable[[CellPlan], None]] = None) -> Optional[CellPlan]:
    """The plan of a header whose cell runs measured; None when its arguments are bad (the magic
    reports them) or it asks for ``--estimate`` (the magic predicts the cell instead of running it)."""
    try:
        plan = parse_args(arg)
        if check is not None:
            check(plan)
    except HeaderError:
        return None
    return None if plan.estimate is not None else plan


def _dedent(lines: Sequence[str]) -> List[str]:
    """Remove the first code line's indentation from every line that has it, as IPython does for a
    cell whose first line is indented (its ``leading_indent`` transformer, which saw our header
    line first and so left an indented body alone)."""
    first = next((line for line in lines if line.strip()), None)
    if first is None:
        return list(lines)
    indent = first[: len(first) - len(first.lstrip(" \t"))]
    if not indent:
        return list(lines)
    return [line[len(indent):] if line.startswith(indent) else line for line in lines]


def strip_header(lines: List[str], check: Optional[Callable[[CellPlan], None]] = None) -> List[str]:
    """The cleanup transform: blank a leading ``%%gpumem`` line so the cell runs as an ordinary cell.

    The line is blanked rather than removed so the code keeps the line numbers the user sees. A
    header with bad arguments is left in place: the magic then raises the ``UsageError``; so is an
    ``--estimate`` header: the magic estimates the body instead of running it. When
    another cell magic follows, the header is removed instead (a cell magic must come first), and
    the measurement applies to the whole cell.
    """
    if not lines or not lines[0].startswith(PROG):
        return lines
    arg = header_args(lines[0])
    if arg is None:
        return lines
    if _measured_plan(arg, check) is None:
        return lines
    if len(lines) > 1 and lines[1].startswith("%%"):
        return lines[1:]
    return ["\n"] + _dedent(lines[1:])
