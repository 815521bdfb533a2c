"""Per-cell GPU memory ledger, ``%%gpumem`` line-by-line reports and OOM explanations for IPython.

    In [1]: %load_ext ipy_gpumem

Importing this package imports neither IPython, torch nor plotly: the extension's work starts
in ``load_ipython_extension`` and every heavy import happens inside the function that needs it.
The public types (``CellRecord``, ``OomReport``, ``WhoReport``, ``Estimate``, ``SnapshotReport``)
and the errors you may catch (``EstimateError``, ``SnapshotError``) are importable from here and
load from their rooms when first named.
"""
from __future__ import annotations

import sys

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "GpuMemWarning",
    "load_ipython_extension",
    "unload_ipython_extension",
    "history",
    "last",
    "history_frame",
    "parse_oom",
    "who",
    "estimate",
    "max_batch_size",
    "snapshot",
    "format_bytes",
    "parse_bytes",
    "CellRecord",
    "OomReport",
    "WhoReport",
    "Estimate",
    "EstimateError",
    "SnapshotReport",
    "SnapshotError",
]


# Defined in a submodule: %reload_ext re-executes this module only, and a class defined here would
# be a new class after each reload (the user's warning filters would stop matching).
from .core.errors import GpuMemWarning  # noqa: E402

#: The public types and where each is defined. They load when first named (PEP 562's module
#: ``__getattr__``), so ``import ipy_gpumem`` and ``%load_ext`` import none of these modules; as
#: the warning above, each is a submodule's class, the same object after ``%reload_ext``.
_TYPES = {
    "CellRecord": ".core.records",
    "OomReport": ".oom.parse.report",
    "WhoReport": ".attribution.who",
    "Estimate": ".preflight.result",
    "EstimateError": ".preflight.result",
    "SnapshotReport": ".snapshots.report",
    "SnapshotError": ".snapshots.stream",
}


def __getattr__(name):
    module = _TYPES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(module, __name__), name)
    globals()[name] = value  # found here from now on, without this function
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython):
    """Register ``%gpumem``, ``%%gpumem`` and the per-cell hooks on ``ipython``."""
    from .extension import load  # the only place IPython-aware code is imported

    load(ipython)


def unload_ipython_extension(ipython):
    """Remove exactly what :func:`load_ipython_extension` added."""
    from .extension import unload

    unload(ipython)


def history():
    """The recorded cells of the running session, oldest first, as a list of ``CellRecord``.

    Empty when the extension is not loaded. Each record's ``to_dict()`` is JSON-serialisable.
    """
    from .extension import current_ledger

    ledger = current_ledger()
    return [] if ledger is None else ledger.records()


def last():
    """The most recent ``CellRecord``, or None when nothing was recorded yet."""
    records = history()
    return records[-1] if records else None


def history_frame():
    """The history as a pandas DataFrame, one row per cell and device (pandas must be installed)."""
    from .core.records import records_frame

    return records_frame(history())


def parse_oom(text):
    """Parse any known out-of-memory message into an ``OomReport``; None if ``text`` is not one."""
    from .oom.parse import parse_oom as _parse_oom

    return _parse_oom(text)


def who(namespace=None, device=None, allocator_total=None):
    """Who holds the memory: parameters, gradients, optimizer state, retained graphs, caches.

    ``namespace`` defaults to the running IPython shell's user namespace. ``device`` narrows it
    to one device ("cuda:0", "cpu"); ``allocator_total`` (bytes) lets the report say how much
    the allocator holds that no variable explains. In the shell's own namespace a name counts as
    IPython's cache only while it holds what IPython put there (``x, _ = f()`` makes ``_`` yours).
    """
    from .attribution.who import who as _who

    refs = None
    if namespace is None or "IPython" in sys.modules:
        from .extension import user_namespace

        try:
            shell_ns, shell_refs = user_namespace()
        except RuntimeError:  # no shell: a plain namespace has no IPython caches
            if namespace is None:
                raise
        else:
            if namespace is None or namespace is shell_ns:
                namespace, refs = shell_ns, shell_refs
    return _who(namespace, device=device, allocator_total=allocator_total, refs=refs)


def estimate(step, *args, device="cuda", gpu=None, **kwargs):
    """The peak memory of ``step(*args, **kwargs)`` as a training step, worked out on fake tensors.

    The step runs twice (the second call is the steady state, with optimizer state) on fake copies
    of every tensor, module and optimizer reachable from its arguments; no memory is used, no GPU
    is needed, and your objects are left exactly as they were. Returns an ``Estimate``
    (``peak_allocated``, ``peak_reserved``, ``total_needed``, ``roles``, ``phases``, ``fits(gpu)``,
    ``to_dict()``); raises ``EstimateError`` naming the line when the step cannot run on fake tensors.
    """
    from .preflight.run import estimate as _estimate

    return _estimate(step, *args, device=device, gpu=gpu, **kwargs)


def max_batch_size(step, *args, gpu="this GPU", batch_dim=0, **kwargs):
    """The largest batch size for which ``step(*args, **kwargs)`` fits ``gpu`` ("T4", "A100-80", "this
    GPU", or bytes), found by re-estimating on fake tensors with the batch arguments resized along
    ``batch_dim``. Returns an ``int`` that also carries what was tried (``.tried``, ``.estimate``)."""
    from .preflight.batch import max_batch_size as _max_batch_size

    return _max_batch_size(step, *args, gpu=gpu, batch_dim=batch_dim, **kwargs)


def snapshot(source, *, max_bytes=None):
    """Read a PyTorch memory snapshot and replay it: a ``SnapshotReport``.

    ``source`` is a path to the pickle ``torch.cuda.memory._dump_snapshot()`` writes (any torch
    version since 2.0, or ``torch.cuda.memory_snapshot()``'s list of segments; gzipped or not; or a
    JSON file of the same data), its bytes, or the dict ``torch.cuda.memory._snapshot()`` returns.
    Only plain data is read: a file with any class reference is refused, and a crafted one (memo
    references, a gzip bomb, a FIFO) in one line, at the cost of its size. The report's ``to_dict()`` has ``peak_allocated`` and
    ``peak_reserved`` as torch's counters had them (block sizes, replayed against the segments),
    ``start`` (the state when recording began), ``oom``, ``sites`` (what was allocated at the peak,
    by file and line; notebook cells as ``In [n]``), ``fragmentation`` and ``annotations``; ``str()``
    is the text view, ``view(start=, end=)`` zooms the chart, ``figure(start=, end=)`` is the chart
    as a plotly figure dict, ``oom_panel()`` explains a recorded out-of-memory as a live one is. Raises ``SnapshotError`` (one line) when it cannot be read.
    """
    from .snapshots.load import MAX_BYTES
    from .snapshots.view import open_snapshot

    cells = None
    if "IPython" in sys.modules:
        from .extension import running_shell
        from .present.shell import cell_files

        shell = running_shell()
        cells = cell_files(shell) if shell is not None else None
    return open_snapshot(source, cells=cells, max_bytes=MAX_BYTES if max_bytes is None else max_bytes)


def format_bytes(size):
    """Format a byte count as PyTorch does: ``format_bytes(1610612736) == "1.50 GiB"``."""
    from .core.units import format_bytes as _format_bytes

    return _format_bytes(size)


def parse_bytes(text):
    """Read a size such as ``"20.00 MiB"`` or ``"0 bytes"`` back into bytes."""
    from .core.units import parse_bytes as _parse_bytes

    return _parse_bytes(text)
