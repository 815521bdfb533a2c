"""What is known about the failing cell's batch, read from what is already there: the OOM panel runs none of the user's code.

After an out-of-memory error the panel must not run the cell again, on fake tensors or otherwise:
everything in it that is not tensor work would happen again (a checkpoint written, a log appended,
a socket, a sleep), and a cell that builds its own batch defeats any guess at where its batch
comes from. So :func:`read_batch` only reads data that exists:

- an earlier ``%%gpumem --estimate`` of the same cell (``preflight.known``): what it predicted and,
  at its peak, how much of it were activations, the part that grows with the batch;
- earlier runs of the same cell that completed (``records``), the same code or the same code at
  another ``batch_size``: where they started and how far they rose;
- this very run's measurement when it was a ``%%gpumem`` cell: the activations its lines (or its
  forward pass) had kept when it failed;
- the batch size the cell's own text states (``batch_size = 32``), else one it reads from the
  namespace: an exact ``int``, or the leading dimension of an exact ``torch.Tensor`` read as a
  plain attribute (no subclass, no property of a user class: nothing of the user's runs);
- the failing device's memory and who holds it.

What it cannot know stays None, and :class:`BatchKnown` always carries the command that would know
(``%%gpumem --estimate`` as the cell's first line, or ``ipy_gpumem.max_batch_size(step, ...)``),
which runs only when the user runs it. A batch size is named only from the estimate, whose peak
covers the whole step, scaling its activations linearly with the batch; the words for it say
"about" and what it rests on (``oom/rules/training.py``).
"""
from __future__ import annotations

import ast
import math
import re
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

from ..core.memory import DeviceMemory
from ..core.text import clip
from ..core.units import format_bytes
from ..preflight.known import cell_key, recall as recall_estimate

__all__ = ["BatchKnown", "Predicted", "Measured", "Earlier", "read_batch", "estimate_line", "BATCH_NAMES",
           "SIZE_NAMES", "MARGIN"]

#: Names that usually hold a step's input batch, preferred in this order.
BATCH_NAMES = ("inputs", "input", "x", "xb", "batch", "images", "imgs", "input_ids", "data", "features", "X",
               "src", "tokens", "idx")
#: Names that usually hold the batch size itself.
SIZE_NAMES = ("batch_size", "bs", "micro_batch_size", "train_batch_size", "per_device_train_batch_size")
#: Share of the capacity a batch must leave free to be called one that fits: the allocator rounds
#: blocks up (512 bytes; 2 MiB and 20 MiB segments), which a linear scaling of activations does not model.
MARGIN = 0.02

# ``batch_size = 32`` (or ``batch_size=32`` in a call) written in the cell: every run of this text uses it.
_LITERAL = re.compile(r"\bbatch_size\s*=\s*(\d+)\b")
_WORD = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class Predicted:
    """An earlier ``%%gpumem --estimate`` of this cell, set against the failing device (bytes).

    Attributes:
        needed: what it predicted the step needs (``total_needed``: the peak, the fixed costs).
        activations: activations at its peak, the part that grows with the batch (None: unknown).
        device: the device type it estimated for (``"cuda"``, ``"cpu"``).
        capacity: what the failing device has for the step; None when the two cannot be compared
            (an estimate for CUDA against a host failure).
        capacity_from: what ``capacity`` is, in words.
    """

    needed: int
    activations: Optional[int]
    device: str
    capacity: Optional[int] = None
    capacity_from: str = ""

    @property
    def fits(self) -> Optional[bool]:
        return None if self.capacity is None else self.needed <= self.capacity

    @property
    def share(self) -> Optional[float]:
        """The fraction of the estimated batch that should fit, scaling the activations linearly
        (and keeping :data:`MARGIN` free): 1.0 when it fits as it is, 0 or less when not even a
        batch of 1 does; None when the capacity or the activations are unknown."""
        if self.capacity is None:
            return None
        if self.needed <= self.capacity:
            return 1.0
        if not self.activations:
            return None
        room = self.capacity * (1 - MARGIN)
        return 1.0 - (self.needed - room) / self.activations

    def fits_at(self, size: int) -> Optional[int]:
        """The largest batch that should fit, for an estimate made at batch ``size``."""
        share = self.share
        if share is None:
            return None
        return max(0, min(size, math.floor(size * share + 1e-9)))

    def needed_at(self, batch: int, size: int) -> int:
        """What the step should need at ``batch``, estimated at ``size``: activations scale, the rest does not."""
        return self.needed - round((self.activations or 0) * (1 - batch / size))

    @property
    def fixed(self) -> int:
        """What does not grow with the batch: parameters, gradients, optimizer state, fixed costs."""
        return self.needed - (self.activations or 0)


@dataclass(frozen=True)
class Measured:
    """What this very run measured before it failed (a ``%%gpumem`` cell).

    Attributes:
        activations: bytes of activations kept when the failure came.
        where: ``"by line 3"`` or ``"in its forward pass"``.
    """

    activations: int
    where: str


@dataclass(frozen=True)
class Earlier:
    """An earlier run of this cell that completed without error.

    Attributes:
        record: its ``CellRecord``.
        same_code: True for the same code; False for the same code with another ``batch_size``.
        size: its batch size when its text states one.
        start: allocated (host: RSS) before it ran; None when unknown.
        peak: how far above ``start`` it rose at its peak; None when unknown.
        sampled: the peak was sampled, not counted per cell: the true one may be higher.
    """

    record: Any
    same_code: bool
    size: Optional[int] = None
    start: Optional[int] = None
    peak: Optional[int] = None
    sampled: bool = False


@dataclass(frozen=True)
class BatchKnown:
    """What the panel can say about the failing cell's batch, and the command that would say more.

    Attributes:
        line: the header line to put on the cell to estimate it (``%%gpumem --estimate``); always set.
        call: ``ipy_gpumem.max_batch_size(step, ...)`` when the cell calls one plain function with
            its batch tensor, else None.
        size: the failing run's batch size, when the cell's text or its variables state it.
        size_from: where ``size`` was read, in words (``"`batch_size = 32` in the cell"``).
        pinned: ``size`` is written in the cell's own text, so an estimate of this text used it too.
        predicted: an earlier ``%%gpumem --estimate`` of this cell (:class:`Predicted`), or None.
        measured: this run's own measurement (:class:`Measured`), or None.
        earlier: an earlier completed run of this cell (:class:`Earlier`), or None.
        start: allocated (host: RSS) before this run, from its record; None when unknown.
    """

    line: str
    call: Optional[str] = None
    size: Optional[int] = None
    size_from: str = ""
    pinned: bool = False
    predicted: Optional[Predicted] = None
    measured: Optional[Measured] = None
    earlier: Optional[Earlier] = None
    start: Optional[int] = None

    @property
    def known(self) -> bool:
        """True when a batch size that should fit can be named (from an estimate of this very text)."""
        return self.best is not None

    @property
    def best(self) -> Optional[int]:
        """The largest batch that should fit, from the estimate of this cell's text; None when no
        sound number exists (no estimate, no stated batch, or a batch read from a variable that
        may have changed since the estimate)."""
        p = self.predicted
        if p is None or self.size is None or not self.pinned:
            return None
        return p.fits_at(self.size)


def estimate_line(memory: Optional[DeviceMemory] = None) -> str:
    """The header line that estimates the cell against the failing device.

    Without a name ``--estimate`` judges against this GPU (the current CUDA device); a failure on
    another device is judged against that device's capacity instead (``--estimate 15.78GiB``).
    """
    device = memory.device if memory is not None else None
    if device is not None and device.is_cuda and device.index not in (None, 0) and memory.total:
        return f"%%gpumem --estimate {format_bytes(memory.total).replace(' ', '')}"
    return "%%gpumem --estimate"


def read_batch(oom: Any, memory: DeviceMemory, record: Any, records: Sequence[Any] = (), who: Any = None,
               namespace: Optional[dict] = None, *,
               recall: Callable[[str], Any] = recall_estimate) -> Optional[BatchKnown]:
    """What is known about the failing cell's batch; None when there is no cell to speak of.

    Reads, never runs: the failing ``record`` (its ``source``, ``lines``, ``phases``, its device
    records), the other ``records`` (earlier runs of the same cell), ``recall(source)`` (an earlier
    ``%%gpumem --estimate``), ``who`` (``WhoReport``: tensors held beyond the step's own) and, in
    ``namespace``, only exact ``int`` values and the ``shape`` of exact ``torch.Tensor`` values
    whose names the cell reads.
    """
    source = getattr(record, "source", None) or ""
    device = memory.device
    if oom is None or not cell_key(source) or (device is not None and not (device.is_cuda or device.is_host)):
        return None  # mps, xpu: the estimate models CUDA's allocator
    body = _body(source)
    names = _names_read(body)
    size, size_from, pinned = _batch_size(body, names, namespace)
    predicted = _predicted(recall(source), memory, who)
    return BatchKnown(
        line=estimate_line(memory),
        call=_max_batch_call(body, namespace, memory),
        size=size, size_from=size_from, pinned=pinned,
        predicted=predicted,
        measured=_measured(record, memory),
        earlier=_earlier(record, records, memory, size if pinned else None),
        start=_start_peak(record, memory)[0],
    )


# ==================================================================================================
# The batch size, from the cell's text or its variables
# ==================================================================================================


def _body(source: str) -> str:
    """The cell's code below its cell-magic header lines (``%%gpumem --lines``, ``%%time``)."""
    lines = source.splitlines()
    k = 0
    while k < len(lines) and (not lines[k].strip() or lines[k].lstrip().startswith("%%")):
        k += 1
    return "\n".join(lines[k:])


def _code_lines(body: str) -> Iterable[str]:
    for line in body.splitlines():
        s = line.strip()
        if s and not s.startswith("#"):
            yield s.split("#", 1)[0]


def _names_read(body: str) -> frozenset:
    """Every plain name the cell's code mentions (its syntax tree; words when IPython syntax stops the parse)."""
    try:
        return frozenset(n.id for n in ast.walk(ast.parse(body)) if isinstance(n, ast.Name))
    except (SyntaxError, ValueError):
        return frozenset(_WORD.findall(" ".join(_code_lines(body))))


def _get(namespace: Any, name: str) -> Any:
    # A plain dict lookup: a mapping of the user's could run code on ``get``.
    return dict.get(namespace, name) if isinstance(namespace, dict) else None


def _exact_tensor_type():
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None) if torch is not None else None
    return tensor if isinstance(tensor, type) else None


def _rows(value: Any, tensor_type: Optional[type]) -> Optional[int]:
    """The leading dimension of an exact ``torch.Tensor`` (a C attribute: no user code), else None."""
    if tensor_type is None or type(value) is not tensor_type:
        return None
    shape = value.shape
    return int(shape[0]) if len(shape) >= 1 and int(shape[0]) > 0 else None


def _batch_size(body: str, names: frozenset, namespace: Any) -> Tuple[Optional[int], str, bool]:
    """``(size, where it was read, pinned)``: the cell's ``batch_size = N``, else a variable it reads."""
    for line in _code_lines(body):
        m = _LITERAL.search(line)
        if m and int(m.group(1)) > 0:
            return int(m.group(1)), f"`{clip(line.strip(), 50)}` in the cell", True
    for name in SIZE_NAMES:
        value = _get(namespace, name) if name in names else None
        if type(value) is int and value > 0:
            return value, f"`{name}` is {value}", False
    tensor_type = _exact_tensor_type()
    for name in BATCH_NAMES:
        rows = _rows(_get(namespace, name), tensor_type) if name in names else None
        if rows:
            return rows, f"`{name}` has {rows} rows", False
    return None, "", False


def _max_batch_call(body: str, namespace: Any, memory: DeviceMemory) -> Optional[str]:
    """``ipy_gpumem.max_batch_size(train_step, model, inputs)`` when the cell calls one plain function
    (a ``def`` of the user's, checked by type only) with a batch tensor among plain-name arguments."""
    device = memory.device
    if device is None or not device.is_cuda:
        return None  # it models a CUDA device; the host's failure is not its question
    try:
        tree = ast.parse(body)
    except (SyntaxError, ValueError):
        return None
    tensor_type = _exact_tensor_type()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if type(_get(namespace, node.func.id)) is not types.FunctionType:
            continue
        if node.keywords or not node.args or not all(isinstance(a, ast.Name) for a in node.args):
            continue
        if not any(_rows(_get(namespace, a.id), tensor_type) for a in node.args):
            continue
        gpu = "" if device.index in (None, 0) or not memory.total else f", gpu={format_bytes(memory.total)!r}"
        return f"ipy_gpumem.max_batch_size({node.func.id}, {', '.join(a.id for a in node.args)}{gpu})"
    return None


# ==================================================================================================
# What an earlier estimate predicted, and what this run measured
# ==================================================================================================


def _predicted(result: Any, memory: DeviceMemory, who: Any) -> Optional[Predicted]:
    """The remembered estimate (an ``Estimate``, a ``CellEstimate`` or an object with the same
    fields), set against the failing device; None when there is none or it is not readable."""
    if result is None:
        return None
    est = getattr(result, "estimate", result)  # a CellEstimate holds its Estimate
    needed = getattr(est, "total_needed", None)
    if not isinstance(needed, int) or needed <= 0:
        return None
    roles = getattr(est, "roles", None) or {}
    acts = sum(int(row.get("activations") or 0) for row in roles.values() if isinstance(row, dict)) \
        if isinstance(roles, dict) else 0
    kind = str(getattr(est, "device", "") or next(iter(roles), "") or "cuda").split(":")[0]
    start = getattr(est, "start_allocated", None)
    capacity, words = _capacity(memory, kind, start if isinstance(start, int) else None, who)
    return Predicted(needed, acts or None, kind, capacity, words)


def _capacity(memory: DeviceMemory, kind: str, start: Optional[int], who: Any) -> Tuple[Optional[int], str]:
    """What the failing device has for the estimated step, and how that was worked out."""
    device = memory.device
    b = format_bytes
    if device is not None and device.is_cuda and kind == "cuda" and memory.total:
        # The estimate is a fresh process holding the step's objects: the device less other
        # processes, less the tensors this kernel holds that the step does not start from.
        capacity, words = memory.total, [f"{memory.label}'s {b(memory.total)}"]
        others = memory.other_processes_bytes or 0
        if others:
            capacity -= others
            words.append(f"less {b(others)} other processes use")
        held = getattr(who, "total", None)
        if start is not None and isinstance(held, int) and held > start:
            capacity -= held - start
            words.append(f"less {b(held - start)} of tensors this kernel holds beyond the step's")
        return max(0, capacity), " ".join(words)
    if device is not None and device.is_host and kind == "cpu" and memory.free is not None and start is not None:
        # The step's own tensors are resident already and part of the prediction.
        return memory.free + start, f"the {b(memory.free)} available plus the {b(start)} the step starts from"
    return None, ""


def _measured(record: Any, memory: DeviceMemory) -> Optional[Measured]:
    """Activations the failing run had kept, from its ``--lines`` rows (a cell without loops) or its phases."""
    label = memory.label
    lines = getattr(record, "lines", None)
    if lines and not getattr(record, "loops", ()):
        kept, best, at = 0, 0, None
        for row in sorted(lines, key=lambda r: r.lineno):
            if not row.hits:
                break
            kept += int(((row.roles or {}).get(label) or {}).get("activations") or 0)
            if kept > best:
                best, at = kept, row.lineno
        if best > 0:
            return Measured(best, f"by line {at}")
    forward = [int(((p.get("roles") or {}).get(label) or {}).get("activations") or 0)
               for p in getattr(record, "phases", None) or () if isinstance(p, dict) and p.get("phase") == "forward"]
    if forward and max(forward) > 0:
        return Measured(max(forward), "in its forward pass")
    return None


# ==================================================================================================
# Earlier runs of the same cell
# ==================================================================================================


def _start_peak(record: Any, memory: DeviceMemory) -> Tuple[Optional[int], Optional[int]]:
    """``(start, rise to the peak)`` of a record on the failing device (host: RSS)."""
    if record is None:
        return None, None
    if memory.is_host:
        host = getattr(record, "host", None)
        start, peak = getattr(host, "rss_before", None), getattr(host, "peak_rss", None)
        return start, (peak - start if start is not None and peak is not None else None)
    device = memory.device
    for dev in getattr(record, "devices", ()) or ():
        if device is not None and device.is_cuda and (device.index is None or dev.index == device.index):
            rise = dev.peak_increase if dev.peak_increase is not None else None
            return dev.allocated_before, rise
    return None, None


def _mask(key: str) -> str:
    return _LITERAL.sub("batch_size=N", key)


def _literal(source: str) -> Optional[int]:
    m = next((m for m in (_LITERAL.search(s) for s in _code_lines(_body(source))) if m), None)
    return int(m.group(1)) if m else None


def _earlier(record: Any, records: Sequence[Any], memory: DeviceMemory, size: Optional[int]) -> Optional[Earlier]:
    """The latest earlier run of this cell that completed: the same code, else (when the cell's text
    states its batch) the same code with another ``batch_size``. Runs of the same cell id come first."""
    key = cell_key(record.source)
    masked = _mask(key)
    cell_id = getattr(record, "cell_id", None)
    count = getattr(record, "execution_count", None)
    candidates: List[Any] = [r for r in reversed(records) if r is not record and getattr(r, "error", None) is None
                             and (count is None or getattr(r, "execution_count", None) != count)]
    candidates.sort(key=lambda r: cell_id is None or getattr(r, "cell_id", None) != cell_id)  # stable: newest first
    for rec in candidates:
        other = cell_key(getattr(rec, "source", "") or "")
        if other == key:
            same, then = True, size
        elif size is not None and _mask(other) == masked:
            same, then = False, _literal(rec.source)
        else:
            continue
        start, peak = _start_peak(rec, memory)
        if peak is None:
            continue
        return Earlier(rec, same, then, start, peak, getattr(rec, "peaks", "") != "per cell")
    return None
