"""What ``%gpumem`` is asked to do, read from its line: a typed ``Command``, one-line errors, and the help texts.

The magics' own help (``%gpumem?``, ``%%gpumem?``) lives here beside the parser it documents, so
the two cannot drift; the extension only turns :class:`CommandError` into IPython's
``UsageError``. Export (``%gpumem export PATH``) lives here too: it is the one mode that writes a
file, and it needs nothing from IPython. So does what ``%%gpumem --estimate`` needs before it
starts (torch installed), said in one line instead of a traceback.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import sys
from typing import NamedTuple, Optional, Sequence

from ..core.devices import ACCELERATOR_TYPES, Device, parse_device
from . import header

__all__ = ["Command", "CommandError", "MODES", "parse_command", "export", "estimate_unavailable", "NO_TORCH",
           "LINE_HELP", "CELL_HELP"]

MODES = ("status", "history", "chart", "sidebar", "who", "free", "on", "off", "clear", "export", "snapshot")
TIERS = ("plotly", "widget", "html", "text")  # the chart's kinds (chart/views.py checks it uses the same)
_MODES_HELP = "status, history [N], chart [plotly|widget|html|text], sidebar, who [DEVICE], free [--dry-run], on, off, clear, export PATH, snapshot PATH"


class CommandError(ValueError):
    """A ``%gpumem`` line that cannot be read; the message is one line and says the fix."""


class Command(NamedTuple):
    """One ``%gpumem`` request: the mode and its one argument, typed."""

    mode: str
    limit: Optional[int] = None  # history N
    tier: Optional[str] = None  # chart KIND
    device: Optional[Device] = None  # who DEVICE
    dry_run: bool = False  # free --dry-run
    path: Optional[str] = None  # export PATH, snapshot PATH
    start: Optional[float] = None  # snapshot --from SECONDS
    end: Optional[float] = None  # snapshot --to SECONDS


def _no_args(mode: str, rest: Sequence[str]) -> None:
    if rest:
        raise CommandError(f"%gpumem {mode} takes no arguments (got {' '.join(rest)!r})")


def parse_command(line: str) -> Command:
    """The command of a ``%gpumem`` line (empty: ``status``).

    Raises:
        CommandError: the line cannot be read; the message says the fix.

    Examples:
        >>> parse_command("history 20"), parse_command("who cuda:1").device
        (Command(mode='history', limit=20, tier=None, device=None, dry_run=False, path=None, start=None, end=None), Device(type='cuda', index=1))
    """
    try:
        words = shlex.split(line or "")
    except ValueError as exc:
        raise CommandError(f"%gpumem: cannot read {line.strip()!r}: {exc}") from None
    mode = words[0].lower() if words else "status"
    rest = words[1:]
    if mode not in MODES:
        raise CommandError(f"%gpumem: unknown mode {mode!r}; use one of: {_MODES_HELP} (see %gpumem?)")
    if mode == "history":
        # ASCII digits only: "²".isdigit() is True and int("²") fails.
        if len(rest) > 1 or rest and not (rest[0].isdecimal() and rest[0].isascii()):
            raise CommandError("%gpumem history takes an optional number of cells, e.g. %gpumem history 20")
        return Command(mode, limit=int(rest[0]) if rest else None)
    if mode == "chart":
        if len(rest) > 1 or (rest and rest[0].lower() not in TIERS):
            raise CommandError(f"%gpumem chart takes an optional kind: {', '.join(TIERS)} (e.g. %gpumem chart html)")
        return Command(mode, tier=rest[0].lower() if rest else None)
    if mode == "who":
        if len(rest) > 1:
            raise CommandError("%gpumem who takes an optional device: cuda:N, cuda or cpu (e.g. %gpumem who cuda:0)")
        if not rest:
            return Command(mode)
        try:
            return Command(mode, device=parse_device(rest[0]))
        except ValueError:
            raise CommandError(f"%gpumem who: unknown device {rest[0]!r}: use cuda:N, cuda or cpu") from None
    if mode == "free":
        if rest and rest != ["--dry-run"]:
            raise CommandError("%gpumem free takes only --dry-run (show what would be released, release nothing)")
        return Command(mode, dry_run=bool(rest))
    if mode == "export":
        if len(rest) != 1:
            raise CommandError("%gpumem export needs one path ending in .json or .csv, e.g. %gpumem export cells.json")
        suffix = os.path.splitext(rest[0])[1].lower()
        if suffix not in (".json", ".csv"):
            raise CommandError(f"%gpumem export: unknown format {suffix or '(none)'!r}; the path must end in .json or .csv")
        return Command(mode, path=os.path.expanduser(rest[0]))
    if mode == "snapshot":
        return _snapshot_command(rest)
    _no_args(mode, rest)
    return Command(mode)


_SNAPSHOT_USAGE = "%gpumem snapshot PATH [--from SECONDS] [--to SECONDS] [--device N]"


def _seconds(flag: str, value: Optional[str]) -> float:
    try:
        number = float(value) if value is not None else None
    except ValueError:
        number = None
    if number is None or number != number or number in (float("inf"), float("-inf")) or number < 0:
        raise CommandError(f"%gpumem snapshot {flag} takes seconds from the first event, e.g. {flag} 1.5 "
                           f"(got {value!r})")
    return number


def _snapshot_command(rest: Sequence[str]) -> Command:
    path = start = end = device = None
    words = list(rest)
    while words:
        word = words.pop(0)
        if word in ("--from", "--to", "--device"):
            value = words.pop(0) if words else None
            if word == "--from":
                start = _seconds(word, value)
            elif word == "--to":
                end = _seconds(word, value)
            else:
                try:
                    device = parse_device(value) if value is not None else None
                except ValueError:
                    device = None
                # A snapshot holds one accelerator's allocator (CUDA's, ROCm's, XPU's): its devices by index.
                if device is None or device.type not in ACCELERATOR_TYPES or device.index is None or device.type == "mps":
                    raise CommandError(f"%gpumem snapshot --device takes a device of the snapshot, e.g. --device 1, "
                                       f"--device cuda:1 or --device xpu:1 (got {value!r})")
        elif word.startswith("-"):
            raise CommandError(f"%gpumem snapshot: unknown option {word!r}; usage: {_SNAPSHOT_USAGE}")
        elif path is None:
            path = os.path.expanduser(word)
        else:
            raise CommandError(f"%gpumem snapshot takes one path (got {word!r} too); usage: {_SNAPSHOT_USAGE}")
    if path is None:
        raise CommandError(f"%gpumem snapshot needs the path of a snapshot file; usage: {_SNAPSHOT_USAGE}")
    if start is not None and end is not None and end <= start:
        raise CommandError(f"%gpumem snapshot: --to {end:g} is not after --from {start:g}")
    return Command("snapshot", device=device, path=path, start=start, end=end)


def export(path: str, records) -> str:
    """Write ``records`` to ``path`` (``.json``: ``to_dict()`` each; ``.csv``: the flat rows); the message to show.

    Raises:
        CommandError: the file cannot be written.
    """
    try:
        if path.lower().endswith(".json"):
            with open(path, "w", encoding="utf-8") as fh:
                json.dump([r.to_dict() for r in records], fh, indent=1)
        else:
            from ..core.records import write_csv  # noqa: PLC0415 - the records load when first shown

            write_csv(path, records)
    except OSError as exc:
        raise CommandError(f"%gpumem export: cannot write {path!r}: {exc.strerror or exc}") from None
    return f"ipy_gpumem: wrote {len(records)} cell record{'s' if len(records) != 1 else ''} to {path}"


LINE_HELP = """Inspect and control ipy_gpumem's per-cell memory ledger.

    Usage::

        %gpumem                 same as %gpumem status
        %gpumem status          memory now: per device, allocated by PyTorch, reserved but
                                unallocated, used outside PyTorch (CUDA context, other
                                processes), free and total; and this process's host RSS
        %gpumem history [N]     a table of the recorded cells (the last N)
        %gpumem chart [KIND]    a live chart of the session: per device allocated, reserved
                                and device used (host RSS without a GPU), each cell marked
                                [n] (hover: its first line, deltas, peak), a peak the samples
                                missed, the running cell highlighted, the capacity drawn.
                                KIND is plotly (a live plotly figure: zoom, pan, legend, range
                                slider; the default in a notebook), html (the SVG picture updated
                                in place; Colab's default), widget (that picture in an
                                ipywidgets.HTML) or text (terminal IPython). One chart is live at
                                a time: asking again moves it, the old one stays as a static
                                plotly figure.
        %gpumem sidebar         the live chart in JupyterLab's right sidebar (sidecar), with
                                a live line of numbers left inline; elsewhere, shown inline
        %gpumem who [DEVICE]    who holds the memory: parameters, gradients, optimizer
                                state, graphs kept by your variables, other tensors,
                                IPython's caches, and the variables holding them
        %gpumem free [--dry-run]  release what costs you nothing: IPython's last error and
                                its frames, cached outputs holding tensors, then garbage
                                collection and the CUDA cache; shows the plan first and
                                what was freed after. Never touches a name of yours.
        %gpumem on | off        resume / pause recording (``on`` also recovers after an
                                internal error; ``off`` also stops the chart's sampler)
        %gpumem clear           forget the recorded cells
        %gpumem export PATH     write the records to PATH as .json or .csv
        %gpumem snapshot PATH [--from S] [--to S] [--device N]
                                read a PyTorch memory snapshot (the pickle that
                                torch.cuda.memory._dump_snapshot writes, any version): peak
                                allocated and reserved replayed exactly, the chart with the
                                peak marked (zoom with --from/--to seconds), what was live at
                                the peak by site (cells named In [n]), fragmentation, and at
                                an out-of-memory the same panel as a live one. Loads plain
                                data only: a pickle with any class in it is refused.

    Example::

        In [3]: %gpumem status
        device                allocated by PyTorch  reserved but unallocated  ...
        cuda:0 (Tesla P100)               3.68 GiB                 20.00 MiB  ...

    Configuration: ``%config GpuMemMagics`` (threshold, track_peaks, quiet, devices,
    history_size, sample_rate, oom_panel). When a cell fails with out-of-memory, a panel
    after its traceback explains it (``oom_panel``). From Python: ``ipy_gpumem.history()``,
    ``ipy_gpumem.last()``, ``ipy_gpumem.who()``, ``ipy_gpumem.snapshot(path)``.
    """

CELL_HELP = f"""Measure one cell in detail: before / after / peak per device and host, what the change is made of by role, optionally per line; or predict it.

    Usage: {header.USAGE}

{header.OPTIONS_HELP}

    The cell runs exactly as it would without the magic (its output, its last expression and its
    error are unchanged); the report follows it: the change by role (parameters, gradients,
    optimizer state, activations, other tensors) with a sentence naming your objects, and, without
    --lines, the training phases it ran (forward, backward, optimizer step, zero_grad), also inside
    the functions it calls. It combines with other
    cell magics in either order. With ``--estimate [GPU]`` the cell does NOT run: its code runs
    twice on fake copies of the objects it reads (no memory, no GPU), and the report predicts its
    peak per line and says whether it fits on GPU.

    Example::

        In [4]: %%gpumem --lines -o rec
           ...: x = torch.ones(2**28, device="cuda")
           ...: y = x * 2
           ...: del x
        %%gpumem [4] · 12 ms
                              before     after         Δ      peak     peak Δ
        cuda:0 allocated     0 bytes  1.00 GiB  +1.00 GiB  2.00 GiB  +2.00 GiB
        ...
        line  hits  Δallocated  Δreserved  peak in line  ...  source
           2     1   +1.00 GiB  +1.00 GiB     +1.00 GiB  ...  x = torch.ones(2**28, device="cuda")

        In [5]: rec.devices[0].peak_increase
        Out[5]: 2147483648

    Per-line changes are summed over a line's executions (hits); for a loop, the report also
    says what the loop as a whole kept, apart from what its lines allocated and freed again.
    """


#: What ``%%gpumem --estimate`` says, in one line, where torch is not installed.
NO_TORCH = ("%%gpumem --estimate needs PyTorch, which is not installed here (the estimate runs the cell's code on "
            "torch's fake tensors): pip install torch. Nothing ran.")


def estimate_unavailable() -> Optional[str]:
    """Why ``%%gpumem --estimate`` cannot run here (torch is not installed), or None; imports nothing."""
    if sys.modules.get("torch") is not None:
        return None
    try:
        found = importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # sys.modules["torch"] is None, or a broken entry
        found = False
    return None if found else NO_TORCH
