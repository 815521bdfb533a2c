"""What the rules read, derived once: the numbers, the holders by kind, the phase that failed and the user's code."""
from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple

from ...core.memory import DeviceMemory
from ...core.text import clip
from ..limits import binding_limit
from ..operation import Operation, operation_of
from ..stack import BACKWARD_CALL, OPTIM_FILE, Frame, phase_of, recorded_stack
from .words import b, cap

__all__ = ["Facts", "Frame", "MATTERS", "cell_deltas", "device_record", "call_args", "message_shape", "size_clues",
           "OPTIM_FILE", "BACKWARD_CALL", "BROADCAST", "FLOAT64", "BATCH"]

# Where in the stack the allocation failed: read innermost first (``oom.stack``).
# What makes a request large, read from the user's code: (N,1) against (1,N), float64, a batch size.
BROADCAST = re.compile(r"\[\s*:\s*,\s*None\s*\]|\[\s*None\s*,\s*:\s*\]|\[\s*None\s*\]"
                       r"|unsqueeze\(\s*-?[0-9]\s*\)|\bcdist\(|np\.newaxis")
FLOAT64 = re.compile(r"float64|\.double\(\)|torch\.double|dtype\s*=\s*float\b")
BATCH = re.compile(r"\bbatch_size\s*=\s*(\d+)", re.IGNORECASE)
# The array a numpy or TensorFlow message names, and the bytes per element of its dtype.
_NP_SHAPE = re.compile(r"shape \(([0-9, ]*)\) and data type (\w+)")
_TF_SHAPE = re.compile(r"shape\s?\[([0-9, ]+)\] and type (\w+)")
_ITEMSIZE = {"float64": 8, "double": 8, "float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2,
             "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
             "complex128": 16}
#: The least share of what the request lacked that a change must free to be offered as a fix:
#: several such changes together can make room; less than this cannot matter for this request.
MATTERS = 1 / 8
# A frame in installed code is the library's, not the user's line.
_LIBRARY_FILE = re.compile(r"site-packages|dist-packages|[/\\]lib[/\\]python\d|^<frozen ")


@dataclass
class Facts:
    """Everything the rules read, computed once per failure.

    Attributes:
        oom: the parsed message (``OomReport``), or None for a state without a message.
        memory: the failing device's memory (``DeviceMemory``).
        who: the ``WhoReport`` for that device, or None.
        earlier: the cells before the failing one, oldest first (never the failing cell).
        failing: the failing cell's ``CellRecord``, or None.
        failing_source: the failing cell's source.
        frames: the failing traceback, innermost last.
        env: environment variables (``PYTORCH_CUDA_ALLOC_CONF`` ...).
        requested: bytes that failed.
        modules: names of imported modules (TensorFlow or JAX sharing the GPU).
        maybe_own: pids in ``memory.processes`` that may be this kernel (NVML gave host pids).
        kind: the message family (``OomReport.kind``), ``"cpu"`` for a host state without one.
        phase: ``"step"``, ``"backward"``, ``"forward"`` or None: where the allocation failed.
        phase_frame: the frame that says so.
        cats: bytes per ``who()`` category.
        holders: ``who()``'s typed ``Holder`` rows that hold bytes, largest first.
        model_names: how the user reaches each ``nn.Module`` (``model``, ``trainer.model``).
        batch: what is known about the failing cell's batch (``oom.batch.BatchKnown``), or None.
        recorded: the allocator's recorded state at the failure (``oom.analysis.RecordedOom``), or None.
        stack: the recorded failing allocation's frames with their C++ ones (a snapshot, ``--trace``),
            innermost last; () without a recording.
        operation: the operation whose allocation failed (``oom.operation.Operation``), or None.
        limit: the process limit that refused host memory (``oom.limits.HostLimit``), or None.
    """

    oom: Any
    memory: DeviceMemory
    who: Any = None
    earlier: Tuple[Any, ...] = ()
    failing: Any = None
    failing_source: str = ""
    frames: Tuple[Frame, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    requested: Optional[int] = None
    modules: FrozenSet[str] = frozenset()
    maybe_own: FrozenSet[int] = frozenset()
    kind: str = ""
    phase: Optional[str] = None
    phase_frame: Optional[Frame] = None
    cats: Dict[str, int] = field(default_factory=dict)
    holders: Tuple[Any, ...] = ()
    model_names: Tuple[str, ...] = ()
    batch: Any = None
    recorded: Any = None
    stack: Tuple[Frame, ...] = ()
    operation: Optional[Operation] = None
    limit: Any = None

    @classmethod
    def build(cls, oom, memory: DeviceMemory, who=None, earlier: Sequence[Any] = (), *, failing=None,
              failing_source: Optional[str] = None, frames: Sequence[Sequence[str]] = (),
              env: Optional[Mapping[str, str]] = None, requested: Optional[int] = None,
              modules: Optional[Iterable[str]] = None, maybe_own: Iterable[int] = (), batch=None,
              recorded=None, operands: Sequence[Any] = (), limits: Sequence[Any] = ()) -> "Facts":
        """Derive the facts; ``env`` and ``modules`` default to this process's.

        ``operands`` are the shapes the traceback's frames name (``oom.operands.operands_of``), parallel
        to ``frames``; ``limits`` the process's memory limits (``oom.limits.host_limits``), of which the
        one that refused a host request becomes :attr:`limit`.
        """
        if failing_source is None:
            failing_source = getattr(failing, "source", "") or ""
        facts = cls(
            oom=oom, memory=memory, who=who, earlier=tuple(earlier or ()), failing=failing,
            failing_source=failing_source or "",
            frames=tuple(_frame(f) for f in (frames or ())),
            env=os.environ if env is None else env,
            requested=requested if requested is not None else (oom.requested if oom is not None else None),
            modules=frozenset(sys.modules if modules is None else modules),
            maybe_own=frozenset(maybe_own or ()),
            kind=oom.kind if oom is not None else ("cpu" if memory.is_host else ""),
            batch=batch, recorded=recorded,
            stack=recorded_stack(getattr(recorded, "frames", None) or ()),
        )
        if who is not None:
            facts.cats = {k: int(v) for k, v in (who.categories or {}).items() if v is not None}
            facts.holders = tuple(h for h in (who.holders or ()) if h.bytes)
            facts.model_names = tuple(h.expr for h in facts.holders if h.kind == "module" and h.expr)
        facts.phase, facts.phase_frame = phase_of(facts.frames, facts.model_names)
        if facts.phase is None and facts.stack:
            facts.phase, facts.phase_frame = phase_of(facts.stack, facts.model_names)
        if facts.requested is None and oom is not None and getattr(recorded, "requested", None):
            facts.requested = recorded.requested
        facts.operation = operation_of(facts.frames, operands, facts.stack, facts.requested,
                                       cuda=facts.is_cuda and facts.kind in ("", "cuda_allocator", "hip"),
                                       host=facts.is_host)
        if facts.requested is None and facts.operation is not None and facts.operation.key == "literal":
            facts.requested = facts.operation.needs  # a MemoryError's size, written in the failing line
        if facts.is_host and limits:
            facts.limit = binding_limit(limits, facts.requested, facts.free)
        return facts

    # ---- numbers

    def cat(self, name: str) -> int:
        """Bytes ``who()`` put in category ``name`` (0 when absent)."""
        return self.cats.get(name, 0)

    @property
    def unattributed(self) -> int:
        return max(0, self.cats.get("unattributed", 0))

    @property
    def free(self) -> Optional[int]:
        """Free memory: the message's own number when it has one (it is what the allocator saw)."""
        if self.oom is not None and getattr(self.oom, "free", None) is not None:
            return self.oom.free
        return self.memory.free

    @property
    def shortfall(self) -> Optional[int]:
        """How much more than free the request needed (None when either is unknown)."""
        if self.requested is None or self.free is None:
            return None
        return max(0, self.requested - self.free)

    @property
    def is_host(self) -> bool:
        return self.kind == "cpu" or self.memory.is_host

    @property
    def is_cuda(self) -> bool:
        return self.memory.device is not None and self.memory.device.is_cuda

    @property
    def device_label(self) -> str:
        return "the host" if self.is_host else self.memory.label

    # ---- what freeing can do for this request

    def covers(self, nbytes: Optional[int]) -> Optional[bool]:
        """Whether freeing ``nbytes`` alone makes room for the failing request; None when unknown."""
        if nbytes is None or self.shortfall is None or self.shortfall == 0:
            return None
        return nbytes >= self.shortfall

    def matters(self, nbytes: Optional[int]) -> bool:
        """Whether freeing ``nbytes`` could matter for this request, so that a finding may offer it.

        With the shortfall known, at least :data:`MATTERS` of it. With the request's size unknown
        (a bare ``MemoryError``), the request was larger than what was free, so freeing must be at
        least that share of the free memory: 64 MiB cannot matter next to 20 GiB available. A size
        that is itself unknown (None) may matter: the finding then says what to check.
        """
        if nbytes is None:
            return True
        if nbytes <= 0:
            return False
        if self.shortfall is not None:
            # A request that fitted in "free" failed for another reason (a limit, the driver): any help counts.
            return self.shortfall == 0 or nbytes >= self.shortfall * MATTERS
        if self.requested is None and self.free:
            return nbytes >= self.free * MATTERS
        return True

    def room(self, nbytes: Optional[int]) -> str:
        """``"enough for the 2.14 GiB the request lacked"`` or ``"not enough alone for the 2.14 GiB
        the request lacked"``; "" when either is unknown."""
        enough = self.covers(nbytes)
        if enough is None:
            return ""
        return f"{'enough' if enough else 'not enough alone'} for the {b(self.shortfall)} the request lacked"

    def holders_of(self, *kinds: str) -> List[Any]:
        return [h for h in self.holders if h.kind in kinds]

    # ---- the user's code

    def sources(self) -> List[Tuple[str, str]]:
        """``(label, source)``: the failing cell first, then earlier cells, newest first."""
        out = []
        if self.failing_source.strip():
            out.append(("the failing cell", self.failing_source))
        for rec in reversed(self.earlier):
            src = getattr(rec, "source", "") or ""
            if src.strip() and all(src != s for _, s in out):
                out.append((getattr(rec, "label", "an earlier cell"), src))
        return out

    def code_lines(self) -> List[Tuple[str, str]]:
        """``(label, stripped line)`` of every non-comment line in :meth:`sources`."""
        out = []
        for label, src in self.sources():
            for line in src.splitlines():
                s = line.strip()
                if s and not s.startswith("#"):
                    out.append((label, s))
        return out

    def find(self, rx: "re.Pattern[str]") -> Optional[Tuple[str, str, "re.Match[str]"]]:
        """``(label, line, match)`` of the first code line ``rx`` matches, failing cell first."""
        for label, line in self.code_lines():
            m = rx.search(line)
            if m is not None:
                return label, line, m
        return None

    def user_line(self) -> str:
        """The line of the user's code that failed: the innermost traceback frame outside installed
        libraries, else the failing cell's last code line, else ""."""
        for filename, _func, line in reversed(self.frames):
            if not _LIBRARY_FILE.search(filename):
                if line.strip():
                    return line.strip()
                break  # the user's frame without its text (no linecache entry): not an outer frame's line
        code = [s.strip() for s in self.failing_source.splitlines() if s.strip() and not s.strip().startswith("#")]
        return code[-1] if code else ""

    def device_records(self) -> List[Tuple[Any, Any]]:
        """``(cell record, its record of the failing device)``, the failing cell first, then newest first."""
        out = []
        for rec in ((self.failing,) if self.failing is not None else ()) + tuple(reversed(self.earlier)):
            dev = device_record(rec, self.memory)
            if dev is not None:
                out.append((rec, dev))
        return out


def _frame(f: Sequence[str]) -> Frame:
    parts = [str(x) if x is not None else "" for x in tuple(f)[:3]]
    return tuple(parts + [""] * (3 - len(parts)))  # type: ignore[return-value]


def device_record(rec: Any, memory: DeviceMemory) -> Any:
    """The record's ``DeviceRecord`` for the failing CUDA device (records keep CUDA devices only)."""
    device = memory.device
    if rec is None or device is None or not device.is_cuda:
        return None
    for dev in getattr(rec, "devices", ()) or ():
        if device.index is None or dev.index == device.index:
            return dev
    return None


def cell_deltas(records: Sequence[Any], memory: DeviceMemory) -> List[Tuple[Any, int]]:
    """``(record, bytes left behind)`` for the cells that grew memory, largest first.

    ``allocated`` on the failing CUDA device; host RSS when the host ran out.
    """
    out = []
    for rec in records:
        if memory.is_host:
            host = getattr(rec, "host", None)
            delta = host.rss_delta if host is not None else None
        else:
            dev = device_record(rec, memory)
            delta = dev.allocated_delta if dev is not None else None
        if delta is not None and delta > 0:
            out.append((rec, int(delta)))
    out.sort(key=lambda item: -item[1])
    return out


def call_args(text: str, open_paren: int) -> Optional[str]:
    """The text inside the parentheses that open at ``open_paren`` (quotes respected), or None."""
    depth, quote = 0, ""
    for i in range(open_paren, len(text)):
        ch = text[i]
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return text[open_paren + 1: i]
    return None


def message_shape(oom: Any) -> Optional[Tuple[str, str, int]]:
    """``(dims, dtype, bytes)`` of the array a numpy or TensorFlow message names, or None."""
    if oom is None:
        return None
    for rx in (_NP_SHAPE, _TF_SHAPE):
        m = rx.search(oom.message)
        if m:
            dims = [int(d) for d in re.findall(r"[0-9]+", m.group(1))]
            size = _ITEMSIZE.get(m.group(2).lower())
            if size is None or not dims:
                return None
            return ", ".join(map(str, dims)), m.group(2), math.prod(dims) * size
    return None


def size_clues(x: "Facts") -> Tuple[List[str], bool]:
    """Sentences on what made the request this large, and whether float64 is one of the reasons.

    Read from the message (the array numpy or TensorFlow names) and the user's code (a broadcast of
    (N,1) against (1,N), float64).
    """
    out = []
    shape = message_shape(x.oom)
    if shape is not None:
        out.append(f"The message names the array: shape ({shape[0]}) of {shape[1]}, {b(shape[2])}.")
    bcast = x.find(BROADCAST)
    if bcast is not None:
        out.append(f"{cap(bcast[0])} broadcasts `{clip(bcast[1], 50)}`: combining (N,1) with (1,N) makes "
                   "an N×N result.")
    f64 = x.find(FLOAT64)
    dtype64 = (shape is not None and shape[1] in ("float64", "double")) or f64 is not None
    if dtype64:
        out.append("float64 takes twice the bytes of float32" + (f" (`{clip(f64[1], 40)}`)." if f64 else "."))
    return out, dtype64
