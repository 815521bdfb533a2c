"""Turn an out-of-memory error, the device's state and who holds the memory into ranked, concrete fixes.

``explain()`` reads only plain inputs (an ``OomReport``, a ``MemoryState``, a ``WhoReport``, recent
``CellRecord``s, the failing cell's source and traceback frames as strings, the environment) and
returns ``Finding``s that each cite a number or a line of the user's code. Nothing here imports
IPython, torch, plotly or ipywidgets.
"""
from __future__ import annotations

import math
import os
import re
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .parse import SIZE_FIELDS, OomReport
from ..core.units import GiB, MiB, format_bytes

__all__ = ["MemoryState", "Finding", "FINDING_KEYS", "explain", "host_state"]

#: Every key ``explain()`` can return, roughly in the order they usually rank.
FINDING_KEYS = (
    "request_exceeds_device", "activations", "graphs_kept", "optimizer_state", "gradients",
    "fragmentation", "other_processes", "cuda_context_and_libraries", "checkpoint_on_gpu",
    "ipython_refs", "earlier_cells", "cpu_oom", "cublas_cudnn", "mps", "other_runtime", "shortfall",
)
CONFIDENCES = ("certain", "likely", "possible")
MAX_FINDINGS = 6

#: Set to True (tests do) to let a bug in one rule raise instead of dropping that rule's finding.
RAISE_RULE_ERRORS = False

_GPU_KINDS = ("cuda_allocator", "hip", "xpu")


# ==================================================================================================
# The state at failure
# ==================================================================================================


def _sub(a: Optional[int], b: Optional[int]) -> Optional[int]:
    """``a - b`` clamped at 0 (rounded message numbers can make a true 0 slightly negative)."""
    if a is None or b is None:
        return None
    return max(0, int(a) - int(b))


@dataclass(frozen=True)
class MemoryState:
    """One device's memory at the moment of failure, in bytes (None where unknown).

    Attributes:
        device: ``"cuda:0"``, ``"cpu"``, ``"mps"``...
        total: Capacity (CPU: physical RAM; MPS: the high-watermark limit, "max allowed").
        allocated: Bytes in live tensors, as PyTorch counts them ("allocated").
        reserved: The caching allocator's reservation: allocated plus "reserved but unallocated".
        used: Device-wide bytes in use by every process (CPU: total minus available).
        process_used: This process's bytes (CUDA: NVML's or the message's "this process has";
            CPU: RSS).
        processes: ``((pid, bytes or None, name or None), ...)``: OTHER processes on the device.
        source: Where the numbers came from, e.g. ``"OOM message"``, ``"allocator at OOM"``.
    """

    device: str
    total: Optional[int] = None
    allocated: Optional[int] = None
    reserved: Optional[int] = None
    used: Optional[int] = None
    process_used: Optional[int] = None
    processes: tuple = ()
    source: str = ""

    @property
    def free(self) -> Optional[int]:
        """``total - used``: what the driver (or the OS) could still hand out."""
        return _sub(self.total, self.used)

    @property
    def reserved_unallocated(self) -> Optional[int]:
        """Bytes the caching allocator holds but no tensor uses ("reserved but unallocated")."""
        return _sub(self.reserved, self.allocated)

    @property
    def outside_pytorch(self) -> Optional[int]:
        """``used - reserved``: the CUDA context, other libraries and other processes together."""
        return _sub(self.used, self.reserved)

    @property
    def non_pytorch_in_process(self) -> Optional[int]:
        """``process_used - reserved``: this process's CUDA context, cuBLAS/cuDNN, other libraries."""
        return _sub(self.process_used, self.reserved)

    @property
    def other_processes_bytes(self) -> Optional[int]:
        """Bytes other processes hold: the listed ones, else ``used - process_used``, else None."""
        listed = [b for _pid, b, _name in self.processes if b is not None]
        if listed:
            return sum(listed)
        return _sub(self.used, self.process_used)

    @property
    def device_type(self) -> str:
        """``"cuda"`` for ``"cuda:0"``."""
        return self.device.split(":", 1)[0]

    @property
    def index(self) -> Optional[int]:
        """The device ordinal in ``"cuda:1"``, else None."""
        _, _, tail = self.device.partition(":")
        return int(tail) if tail.isdigit() else None

    @classmethod
    def from_oom(cls, oom: OomReport) -> "MemoryState":
        """Everything an out-of-memory message says about its device.

        ``used`` is ``total - free``, so ``free`` gives back the message's number exactly. When
        NVML listed this very process as ``Process N`` (in a container NVML reports host pids, so
        torch cannot tell its own line), the line is recognised by arithmetic and becomes
        ``process_used`` instead of another process.
        """
        total, used, allocated = oom.total, None, oom.allocated_by_pytorch
        if oom.kind == "mps":
            # MPS: "max allowed" is the limit that failed; "other allocations" are this process's
            # non-tensor Metal buffers.
            total = oom.max_allowed
            if allocated is not None and oom.other_allocations is not None:
                used = allocated + oom.other_allocations
        elif total is not None and oom.free is not None:
            used = max(0, total - oom.free)
        reserved = oom.reserved
        process_used = oom.process_in_use
        others = [(pid, nbytes, None) for pid, nbytes in oom.other_processes]
        if process_used is None and others:
            own = _own_line(others, reserved, used)
            if own is not None:
                process_used = others.pop(own)[1]
        return cls(
            device=oom.device or oom.device_type or "unknown",
            total=total,
            allocated=allocated,
            reserved=reserved,
            used=used,
            process_used=process_used,
            processes=tuple(others),
            source="OOM message",
        )

    def merged(self, other: "MemoryState") -> "MemoryState":
        """This state with every unknown filled from ``other`` (this one's numbers win)."""
        changes: Dict[str, Any] = {}
        for name in ("total", "allocated", "reserved", "used", "process_used"):
            if getattr(self, name) is None and getattr(other, name) is not None:
                changes[name] = getattr(other, name)
        processes = _merge_processes(self.processes, other.processes)
        if processes != self.processes:
            changes["processes"] = processes
        if changes and other.source and other.source not in self.source:
            changes["source"] = f"{self.source} + {other.source}" if self.source else other.source
        if self.device in ("", "unknown") and other.device:
            changes["device"] = other.device
        return replace(self, **changes) if changes else self


def _merge_processes(mine: tuple, theirs: tuple) -> tuple:
    """Processes by pid: unknown bytes and names filled from ``theirs``, its extra pids appended."""
    by_pid = {pid: (b, name) for pid, b, name in theirs}
    out = [(pid, b if b is not None else by_pid.get(pid, (None, None))[0],
            name if name is not None else by_pid.get(pid, (None, None))[1]) for pid, b, name in mine]
    known = {pid for pid, _b, _n in mine}
    out.extend(p for p in theirs if p[0] not in known)
    return tuple(out)


def _own_line(others: List[tuple], reserved: Optional[int], used: Optional[int]) -> Optional[int]:
    """Index of the listed process that must be this one, or None.

    This process holds at least ``reserved``. If ``reserved`` plus every listed process exceeds
    what the whole device uses, one listed line is this process counted twice: the largest one
    that can hold ``reserved``.
    """
    if reserved is None or used is None:
        return None
    listed = sum(b for _pid, b, _n in others if b is not None)
    slack = 16 * MiB + used // 100  # two-decimal rounding in the message
    if reserved + listed <= used + slack:
        return None
    fits = [(b, i) for i, (_pid, b, _n) in enumerate(others) if b is not None and b + slack >= reserved]
    return max(fits)[1] if fits else None


def host_state(rss: Optional[int] = None) -> MemoryState:
    """The host's RAM as a ``MemoryState`` (device ``"cpu"``), read with the standard library.

    Args:
        rss: This process's resident set size; read from ``/proc/self/statm`` when None (Linux).
    """
    total = available = None
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = page * os.sysconf("SC_PHYS_PAGES")
        available = _meminfo_available()
        if available is None:
            available = page * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX, or the name is unknown here
        pass
    if rss is None:
        rss = _statm_rss()
    used = None if total is None or available is None else max(0, total - available)
    return MemoryState(device="cpu", total=total, used=used, process_used=rss, source="probe")


def _meminfo_available() -> Optional[int]:
    # MemAvailable counts reclaimable page cache; SC_AVPHYS_PAGES does not and looks far too low.
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _statm_rss() -> Optional[int]:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


# ==================================================================================================
# Findings
# ==================================================================================================


@dataclass(frozen=True)
class Finding:
    """One cause of the failure and the change that addresses it.

    Attributes:
        key: Stable id, one of :data:`FINDING_KEYS`.
        title: One line with the number, e.g. "Adam keeps two buffers the size of the weights: 1.50 GiB".
        detail: Why, with numbers, in torch's vocabulary; 1-3 sentences.
        fix: The concrete change, one sentence.
        snippet: Code the user can paste (may be "").
        frees: Bytes the change would free or avoid, for ranking; None if unknown.
        confidence: ``"certain"``, ``"likely"`` or ``"possible"``.
    """

    key: str
    title: str
    detail: str
    fix: str
    snippet: str = ""
    frees: Optional[int] = None
    confidence: str = "likely"

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-serialisable copy."""
        return {"key": self.key, "title": self.title, "detail": self.detail, "fix": self.fix,
                "snippet": self.snippet, "frees": self.frees, "confidence": self.confidence}


def explain(
    oom: Optional[OomReport],
    state: MemoryState,
    who: Any = None,
    records: Sequence[Any] = (),
    *,
    failing_source: str = "",
    traceback_frames: Sequence[Sequence[str]] = (),
    env: Optional[Mapping[str, str]] = None,
    requested: Optional[int] = None,
    modules: Optional[Iterable[str]] = None,
) -> List[Finding]:
    """Ranked findings, most useful first: certain before likely before possible, then by bytes freed.

    Args:
        oom: The parsed message, or None (e.g. a state probed without an error).
        state: The device's memory at failure (see :meth:`MemoryState.from_oom` and ``merged``).
        who: A ``WhoReport`` for the failing device, or None.
        records: Recent ``CellRecord``s, oldest first; the last may be the failing cell.
        failing_source: The failing cell's source.
        traceback_frames: ``(filename, function, source line)`` of the failing traceback,
            innermost last.
        env: Environment variables (``PYTORCH_CUDA_ALLOC_CONF`` ...); ``os.environ`` when None.
        requested: Bytes that failed; overrides ``oom.requested``.
        modules: Names of imported modules (to recognise TensorFlow or JAX sharing the GPU);
            ``sys.modules`` when None.

    Returns:
        At most :data:`MAX_FINDINGS` findings. Never empty when ``oom`` is given.
    """
    facts = _Facts.build(oom, state, who, records, failing_source, traceback_frames, env,
                         requested, modules)
    found: List[Finding] = []
    for rule in _RULES:
        try:
            finding = rule(facts)
        except Exception:  # one broken rule must not cost the user the other findings
            if RAISE_RULE_ERRORS:
                raise
            continue
        if finding is not None:
            found.append(finding)
    if oom is not None and not _cites_message(found, oom):
        found.append(_shortfall(facts))
    found.sort(key=_rank)
    return found[:MAX_FINDINGS]


def _rank(f: Finding) -> tuple:
    # An impossible request comes first whatever else is true: nothing else can make it fit.
    return (f.key != "request_exceeds_device", CONFIDENCES.index(f.confidence),
            f.frees is None, -(f.frees or 0))


def _cites_message(found: Sequence[Finding], oom: OomReport) -> bool:
    """Whether a finding quotes one of the message's sizes (or, without sizes, any finding exists)."""
    sizes = [format_bytes(getattr(oom, name)) for name in SIZE_FIELDS if getattr(oom, name) is not None]
    if not sizes:
        return bool(found)
    return any(size in f.title or size in f.detail for f in found for size in sizes)


# ==================================================================================================
# What the inputs say, computed once
# ==================================================================================================

_OPTIM_FILE = re.compile(r"torch[/\\]optim[/\\]|[/\\]optim[/\\]\w+\.py$|bitsandbytes[/\\]optim")
_OPTIM_FUNC = re.compile(r"^_(?:single|multi)_tensor_\w+$|^_fused_\w+$")
_AUTOGRAD_FILE = re.compile(r"torch[/\\]autograd[/\\]|torch[/\\]_tensor\.py$")
_NN_FILE = re.compile(r"torch[/\\]nn[/\\]|transformers[/\\]models[/\\]|timm[/\\]")
_FORWARD_LINE = re.compile(r"\bF\.(?:linear|conv\w*|scaled_dot_product_attention|softmax|gelu|relu|"
                           r"layer_norm|batch_norm|embedding|interpolate)\s*\(|scaled_dot_product_attention")
_BACKWARD_CALL = re.compile(r"\.backward\b|autograd\.grad\s*\(")
_STEP_CALL = re.compile(r"\b\w*(?:optim\w*|opt)\.step\s*\(")
_OPTIM_CTOR = re.compile(r"\b((?:torch\.)?optim\.|bnb\.optim\.|bitsandbytes\.optim\.)(\w+)\s*\(")
_OPTIM_BY_FILE = {
    "adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "rmsprop": "RMSprop", "adagrad": "Adagrad",
    "adadelta": "Adadelta", "adamax": "Adamax", "nadam": "NAdam", "radam": "RAdam", "lion": "Lion",
}
_TWO_BUFFERS = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adafactor", "LAMB", "Lamb")
_GRAPH_NAME = re.compile(r"^(.*) \((?:shared )?graph\)$")
_BATCH = re.compile(r"\bbatch_size\s*=\s*(\d+)", re.IGNORECASE)
_LOSSISH = r"\w*loss\w*"  # not "out": ``out += residual`` inside a forward is no accumulation


@dataclass
class _Facts:
    """Everything the rules read, derived once from the raw inputs."""

    oom: Optional[OomReport]
    state: MemoryState
    who: Any
    records: Tuple[Any, ...]
    failing_source: str
    frames: Tuple[Tuple[str, str, str], ...]
    env: Mapping[str, str]
    requested: Optional[int]
    modules: frozenset
    kind: str = ""
    phase: Optional[str] = None  # "step", "backward", "forward" or None
    phase_frame: Optional[Tuple[str, str, str]] = None
    cats: Dict[str, int] = field(default_factory=dict)
    holders: Tuple[Dict[str, Any], ...] = ()
    model_names: Tuple[str, ...] = ()

    @classmethod
    def build(cls, oom, state, who, records, failing_source, frames, env, requested, modules) -> "_Facts":
        facts = cls(
            oom=oom, state=state, who=who, records=tuple(records or ()),
            failing_source=failing_source or "",
            frames=tuple(_frame(f) for f in (frames or ())),
            env=os.environ if env is None else env,
            requested=requested if requested is not None else (oom.requested if oom else None),
            modules=frozenset(sys.modules if modules is None else modules),
            kind=oom.kind if oom is not None else ("cpu" if state.device_type == "cpu" else ""),
        )
        if who is not None:
            facts.cats = {k: int(v) for k, v in (who.categories or {}).items() if v is not None}
            facts.holders = tuple(h for h in (who.holders or ()) if h.get("bytes"))
            facts.model_names = tuple(h["name"] for h in facts.holders if h.get("category") == "parameters"
                                      and re.fullmatch(r"[\w.\[\]'\"]+", h["name"]))
        facts.phase, facts.phase_frame = _phase(facts.frames, facts.model_names)
        return facts

    # ---- derived numbers
    def cat(self, name: str) -> int:
        return self.cats.get(name, 0)

    @property
    def unattributed(self) -> int:
        return max(0, self.cats.get("unattributed", 0))

    @property
    def shortfall(self) -> Optional[int]:
        """How much more than free the request needed (None when either is unknown)."""
        free = self.free
        if self.requested is None or free is None:
            return None
        return max(0, self.requested - free)

    @property
    def free(self) -> Optional[int]:
        if self.oom is not None and self.oom.free is not None:
            return self.oom.free
        return self.state.free

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu" or self.state.device_type == "cpu"

    # ---- the user's code
    def sources(self) -> List[Tuple[str, str]]:
        """``(label, source)``: the failing cell first, then recent cells, newest first."""
        out = []
        if self.failing_source.strip():
            out.append(("the failing cell", self.failing_source))
        for rec in reversed(self.records):
            src = getattr(rec, "source", "") or ""
            if src.strip() and all(src != s for _, s in out):
                out.append((getattr(rec, "label", "a recent cell"), src))
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
        for label, line in self.code_lines():
            m = rx.search(line)
            if m is not None:
                return label, line, m
        return None

    def optimizer_name(self) -> Optional[str]:
        for filename, func, _line in reversed(self.frames):
            base = re.sub(r"\.py$", "", re.split(r"[/\\]", filename)[-1]).lower()
            if _OPTIM_FILE.search(filename) and base in _OPTIM_BY_FILE:
                return _OPTIM_BY_FILE[base]
            m = re.match(r"^_(?:single_tensor|multi_tensor|fused)_(\w+)$", func)
            if m and m.group(1).lower() in _OPTIM_BY_FILE:
                return _OPTIM_BY_FILE[m.group(1).lower()]
        hit = self.find(_OPTIM_CTOR)
        return hit[2].group(2) if hit else None

    def graph_roots(self) -> List[Tuple[str, int, List[str]]]:
        """``(holder name, bytes, variable names)`` for every ``x (graph)``/shared-graph holder."""
        out = []
        for h in self.holders:
            m = _GRAPH_NAME.match(h["name"]) if h.get("category") == "retained_graphs" else None
            if m:
                names = [n for n in m.group(1).split(" + ") if n != "more"]
                out.append((h["name"], int(h["bytes"]), names))
        return out


def _frame(f: Sequence[str]) -> Tuple[str, str, str]:
    parts = [str(x) if x is not None else "" for x in tuple(f)[:3]]
    return tuple(parts + [""] * (3 - len(parts)))  # type: ignore[return-value]


def _phase(frames: Sequence[Tuple[str, str, str]], model_names: Sequence[str]):
    """Where the allocation failed: the optimizer step, backward, forward, or None (unknown)."""
    for filename, func, line in reversed(frames):  # innermost first: the frame that allocated
        if _OPTIM_FILE.search(filename) or _OPTIM_FUNC.match(func):
            return "step", (filename, func, line)
    for filename, func, line in reversed(frames):
        if _AUTOGRAD_FILE.search(filename) and ("backward" in func or "grad" in func):
            return "backward", (filename, func, line)
    calls = [re.compile(r"(?<![\w.])" + re.escape(n) + r"\s*\(") for n in model_names]
    calls.append(re.compile(r"(?<![\w.])(?:model|net|network|module)\s*\("))
    for filename, func, line in reversed(frames):
        if func == "forward" or _NN_FILE.search(filename) or _FORWARD_LINE.search(line) \
                or func in ("_call_impl", "_wrapped_call_impl"):
            return "forward", (filename, func, line)
    for filename, func, line in frames:
        if _BACKWARD_CALL.search(line):
            return "backward", (filename, func, line)
        if _STEP_CALL.search(line):
            return "step", (filename, func, line)
        if any(c.search(line) for c in calls):
            return "forward", (filename, func, line)
    return None, None


def _where(frame: Optional[Tuple[str, str, str]]) -> str:
    """``adam.py step()`` for a frame."""
    if frame is None:
        return ""
    base = re.split(r"[/\\]", frame[0])[-1] or frame[0]
    return f"{base} {frame[1]}()" if frame[1] else base


def _clip(text: str, width: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _cap(text: str) -> str:
    """``"the failing cell"`` -> ``"The failing cell"`` at the start of a sentence."""
    return text[:1].upper() + text[1:]


def _times(ratio: float) -> str:
    """``"2.3x"``, ``"45x"``, ``"182,449,534x"``."""
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:,.0f}x"


def _pct(part: int, whole: Optional[int]) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "?"


def _b(n: Optional[int]) -> str:
    return format_bytes(n)


# ==================================================================================================
# Rules: each returns one Finding or None
# ==================================================================================================


def _request_exceeds_device(x: _Facts) -> Optional[Finding]:
    req = x.requested
    if req is None:
        return None
    allowed = x.oom.allowed if x.oom is not None else None
    if allowed and req > allowed and (x.state.total is None or allowed < x.state.total):
        limit, what = allowed, "this process is allowed (torch.cuda.set_per_process_memory_fraction)"
    elif x.state.total and req > x.state.total:
        limit = x.state.total
        what = "the machine's RAM" if x.is_cpu else f"{x.state.device}'s total capacity"
    else:
        return None
    ratio = req / limit
    empty = "with nothing else in RAM the machine has" if x.is_cpu else "an empty GPU has"
    detail = (f"No amount of freeing helps: even {empty} only {_b(limit)}, and this one tensor needs "
              f"{_times(ratio)} that.")
    if ratio > 1000:  # nobody meant to allocate this: the size itself is the bug
        detail += " A size this far off is a bug in the shape arithmetic (an overflow, a wrong dimension, a broadcast)."
        fix = "Find the shape that produced this size and fix it: print the shapes of the operands of the failing line."
        snippet = "print(a.shape, a.dtype, b.shape, b.dtype)   # the operands of the failing line"
    else:
        pieces = max(2, 2 * math.ceil(ratio))  # each piece at most about half the limit
        detail += " Check the shape that produced it; if it is right, the work must be split."
        where = "memory-map the data (numpy.memmap)" if x.is_cpu else \
            "shard it across devices, or keep it on the CPU and move only slices to the GPU"
        fix = f"Make the tensor smaller: process it in {pieces} chunks, or {where}."
        snippet = (f"# {_b(req)} cannot fit in {_b(limit)}: work in {pieces} pieces\n"
                   f"out = torch.cat([f(piece) for piece in x.chunk({pieces}, dim=0)])")
    return Finding("request_exceeds_device",
                   f"The request alone ({_b(req)}) is larger than {what}: {_b(limit)}",
                   detail, fix, snippet, None, "certain")


def _activations(x: _Facts) -> Optional[Finding]:
    if x.phase not in ("forward", "backward"):
        return None
    traceback_held = sum(int(h["bytes"]) for h in x.holders
                         if h.get("category") == "ipython_caches" and h["name"].startswith("last traceback"))
    acts: Optional[int] = None
    basis = ""
    if x.who is not None:
        acts = x.cat("retained_graphs") + x.unattributed + traceback_held
        basis = (f"retained graphs {_b(x.cat('retained_graphs'))}"
                 + (f" + unattributed {_b(x.unattributed)}" if x.unattributed else "")
                 + (f" + held by the last traceback {_b(traceback_held)}" if traceback_held else ""))
    else:
        peak = _failing_peak(x)
        if peak:
            acts, basis = peak, "how far allocated memory rose in the failing cell"
    if acts is not None and acts <= 0:
        return None
    big = acts is None or x.requested is None or acts >= x.requested or (
        x.state.allocated and acts >= x.state.allocated // 10)
    evaluating = _looks_like_eval(x)
    if not big and not evaluating:  # when evaluating, any kept graph is pure waste
        return None
    where = _where(x.phase_frame)
    line = x.phase_frame[2].strip() if x.phase_frame else ""
    model_line = _model_call_line(x) or "output = model(inputs)"
    title = (f"Activations of the {x.phase} pass: {_b(acts)}" if acts is not None
             else f"Out of memory in the {x.phase} pass ({where})")
    detail = (f"The {x.phase} pass failed in {where}" + (f" at `{_clip(line, 60)}`" if line else "")
              + ". Autograd keeps every layer's inputs for backward, so activations grow with the batch"
              + (f" ({basis})." if acts is not None else "."))
    batch = x.find(_BATCH)
    frees = acts // 2 if acts else None
    if batch and acts:
        size = int(batch[2].group(1))
        new = _fitting_batch(size, acts, x.requested, x.free)
        detail += f" Halving batch_size={size} frees about {_b(acts // 2)}"
        detail += f"; batch_size={new} would fit." if new and new < size else "."
    elif acts:
        detail += f" Halving the batch size frees about {_b(acts // 2)}."
    if evaluating:
        fix = ("This looks like evaluation (no .backward() in the cell): run it under torch.inference_mode() "
               "so no graph is kept, and lower the batch size if it still does not fit.")
        snippet = ("model.eval()\nwith torch.inference_mode():    # no graph: each activation is freed after use\n"
                   f"    {model_line}")
        frees = acts
    else:
        dev = x.state.device_type if x.state.device_type in ("cuda", "cpu", "mps", "xpu") else "cuda"
        fix = ("Lower the batch size (accumulate gradients over several smaller batches to keep the effective "
               "size), run the forward pass under torch.autocast, or recompute activations in backward with "
               "torch.utils.checkpoint.")
        snippet = (f'with torch.autocast(device_type="{dev}", dtype=torch.bfloat16):  # float16 before Ampere\n'
                   f"    {model_line}\n"
                   "# or keep only block boundaries and recompute the rest during backward:\n"
                   "from torch.utils.checkpoint import checkpoint\n"
                   "h = checkpoint(block, h, use_reentrant=False)")
    return Finding("activations", title, detail, fix, snippet, frees,
                   "likely" if acts is not None else "possible")


def _fitting_batch(size: int, acts: int, requested: Optional[int], free: Optional[int]) -> Optional[int]:
    """The largest power-of-two batch size whose activations and request fit, or None.

    Activations and the failing request both scale with the batch, so a batch ``k`` times the
    size needs ``k * (acts + requested)``, and ``acts + free`` is what there is.
    """
    if requested is None or free is None or requested <= free:
        return None
    target = int(size * (acts + free) / (acts + requested))
    if target < 1:
        return None
    return 2 ** int(math.log2(target))


def _failing_peak(x: _Facts) -> Optional[int]:
    rec = _failing_record(x)
    dev = _device_record(rec, x.state) if rec is not None else None
    return dev.peak_increase if dev is not None and dev.peak_increase and dev.peak_increase > 0 else None


def _looks_like_eval(x: _Facts) -> bool:
    src = x.failing_source
    if not src.strip() or re.search(r"no_grad|inference_mode", src):
        return False
    return bool(re.search(r"\.eval\s*\(\s*\)", src)) or not _BACKWARD_CALL.search(src)


def _model_call_line(x: _Facts) -> Optional[str]:
    names = list(x.model_names) + ["model", "net"]
    for _label, line in x.code_lines():
        for n in names:
            if re.search(r"(?<![\w.])" + re.escape(n) + r"\s*\(", line) and "=" in line:
                return _clip(line, 70)
    return None


_ACCUM = re.compile(r"^([A-Za-z_][\w.\[\]'\"]*)\s*\+=\s*(.+)$")
_APPEND = re.compile(r"^([A-Za-z_][\w.]*)\.(?:append|extend)\(\s*(.+)\)\s*$")
_DETACHED = re.compile(r"\.item\(\)|\.detach\(\)|\.tolist\(\)|\bfloat\(|\bint\(|\.numpy\(\)")


def _graphs_kept(x: _Facts) -> Optional[Finding]:
    roots = x.graph_roots()
    names = list(dict.fromkeys(n for _h, _b2, ns in roots for n in ns))  # first-seen order
    graph_bytes = x.cat("retained_graphs")
    name_rx = "|".join([re.escape(n) for n in names if re.fullmatch(r"\w+", n)] + [_LOSSISH])
    accum = _accumulation(x, name_rx)
    if not (graph_bytes > 0 and roots) and accum is None:
        return None
    own = sum(int(h["bytes"]) for h in x.holders if h.get("category") == "other_tensors" and h["name"] in names)
    parts = []
    if roots:
        shown = ", ".join(f"`{h}` {_b(b)}" for h, b, _ in roots[:3])
        parts.append(f"Tensors from an earlier forward pass still hold their autograd graphs: {shown}. "
                     "Deleting them frees the saved activations"
                     + (f" (plus {_b(own)} of their own data)." if own else "."))
    if accum is not None:
        label, line = accum
        parts.append(f"{_cap(label)} accumulates a tensor with its graph: `{_clip(line, 60)}` keeps every "
                     "iteration's graph alive.")
    target = accum[1] if accum else None
    fixed = _detached(target) if target else None
    plain = [n for n in names if re.fullmatch(r"[A-Za-z_][\w.]*", n)]  # not Out[3] or traceback locals
    del_names = ", ".join(plain) if plain else "output, loss"
    snippet = ""
    if fixed:
        snippet += f"{fixed}    # a Python number: no graph\n"
    snippet += f"del {del_names}    # before the next forward pass"
    title = (f"Graphs kept alive by {', '.join(names)}: {_b(graph_bytes)}" if roots
             else f"A graph accumulates across iterations: `{_clip(target or '', 50)}`")
    return Finding(
        key="graphs_kept",
        title=title,
        detail=" ".join(parts),
        fix=(f"Take numbers with .item() (or .detach()) when you keep them, and `del {del_names}` before "
             "the next forward pass."),
        snippet=snippet,
        frees=(graph_bytes + own) if roots else None,
        confidence="certain" if roots else "likely",
    )


def _accumulation(x: _Facts, name_rx: str) -> Optional[Tuple[str, str]]:
    """``(label, line)`` of ``total += loss`` / ``losses.append(loss)`` without .item()/.detach()."""
    graphish = re.compile(r"(?<![\w.])(?:" + name_rx + r")(?![\w(])")
    for label, line in x.code_lines():
        for rx in (_ACCUM, _APPEND):
            m = rx.match(line)
            if m and graphish.search(m.group(2)) and not _DETACHED.search(m.group(2)):
                return label, line
    return None


def _detached(line: str) -> Optional[str]:
    m = _ACCUM.match(line)
    if m:
        return f"{m.group(1)} += ({m.group(2).strip()}).item()" if not re.fullmatch(r"[\w.]+", m.group(2).strip()) \
            else f"{m.group(1)} += {m.group(2).strip()}.item()"
    m = _APPEND.match(line)
    if m:
        item = m.group(2).strip()
        how = ".item()" if re.search(_LOSSISH, item) else ".detach()"
        return f"{m.group(1)}.append({item}{how})"
    return None


def _optimizer_state(x: _Facts) -> Optional[Finding]:
    opt = x.optimizer_name()
    state_bytes, params = x.cat("optimizer_state"), x.cat("parameters")
    in_step = x.phase == "step"
    share = state_bytes / x.who.total if x.who is not None and x.who.total else 0.0
    if not in_step and not (state_bytes >= MiB and share >= 0.25):
        return None  # neither the failing frame nor the numbers point at the optimizer
    two = opt in _TWO_BUFFERS
    name = opt or "The optimizer"
    if state_bytes:
        title = (f"{name} keeps two buffers the size of the weights: {_b(state_bytes)}" if two
                 else f"{name}'s state holds {_b(state_bytes)}")
    else:
        title = f"Out of memory inside the optimizer step ({_where(x.phase_frame)})"
    detail = ""
    if state_bytes and params:
        detail = (f"Optimizer state is {_b(state_bytes)}, {state_bytes / params:.1f}x the {_b(params)} of "
                  "parameters" + (" (exp_avg and exp_avg_sq per weight)." if two else "."))
        grads = x.cat("gradients")
        footprint = params + grads + state_bytes
        if x.state.total and footprint * 100 >= x.state.total:
            detail += (f" Weights + gradients + optimizer state take {_b(footprint)}, "
                       f"{_pct(footprint, x.state.total)} of the {_b(x.state.total)} device, before any activation.")
    if in_step:
        detail += (f" The allocation failed in {_where(x.phase_frame)}"
                   + (f" while allocating {_b(x.requested)}" if x.requested else "") + _step_temporaries(x))
    args = _optimizer_args(x)
    ctor = f"torch.optim.{opt if opt in _OPTIM_BY_FILE.values() else 'Adam'}({args}, foreach=False)"
    if two or opt is None:
        fix = ("Use an optimizer with less state (8-bit Adam keeps 2 bytes per weight instead of 8; SGD with "
               "momentum one buffer, without momentum none), or pass foreach=False (fused=True on CUDA) to avoid "
               "the step's temporary copies.")
        snippet = ("import bitsandbytes as bnb          # pip install bitsandbytes\n"
                   f"optimizer = bnb.optim.Adam8bit({args})\n"
                   "# or one buffer per weight:  torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)\n"
                   f"# or no step temporaries:   {ctor}")
    else:
        fix = ("Pass foreach=False to avoid the step's temporaries for all parameters at once; without momentum "
               "SGD keeps no state at all.")
        snippet = f"optimizer = {ctor}"
    frees = state_bytes * 3 // 4 if two and state_bytes else (state_bytes // 2 if state_bytes else None)
    confident = in_step and (state_bytes > 0 or opt is not None)
    return Finding("optimizer_state", title, detail.strip() or f"{name} allocates in its step.", fix, snippet,
                   frees, "certain" if confident else "likely")


def _step_temporaries(x: _Facts) -> str:
    """What the frames say about the step's implementation and its temporary tensors."""
    funcs = " ".join(f[1] + " " + f[2] for f in x.frames)
    if "_multi_tensor_" in funcs or "_foreach_" in funcs:
        return ("; the foreach implementation allocates per-parameter temporaries for all parameters at "
                "once (foreach=False does one parameter at a time).")
    if "_single_tensor_" in funcs or any(f[0].endswith("_functional.py") for f in x.frames):
        return ("; this single-tensor step allocates temporaries one parameter at a time, so the request is "
                "about one parameter's size.")
    return ("; on CUDA the default foreach implementation allocates per-parameter temporaries for all "
            "parameters at once.")


def _optimizer_args(x: _Facts) -> str:
    """The arguments the user built the optimizer with (``model.parameters(), lr=1e-3``)."""
    hit = x.find(_OPTIM_CTOR)
    if hit:
        label, line, m = hit
        inner = _call_args(line, m.end() - 1)
        if inner is not None and inner.strip():
            return _clip(inner.strip(), 60)
    return "model.parameters(), lr=1e-3"


def _call_args(text: str, open_paren: int) -> Optional[str]:
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


_SET_TO_NONE_FALSE = re.compile(r"zero_grad\(\s*(?:set_to_none\s*=\s*)?False\s*\)")


def _gradients(x: _Facts) -> Optional[Finding]:
    grads = x.cat("gradients")
    keep_zeros = x.find(_SET_TO_NONE_FALSE)
    held = grads > 0 and x.phase not in ("step", "backward")
    if not held and keep_zeros is None:
        return None
    holders = [h["name"] for h in x.holders if h.get("category") == "gradients"][:3]
    parts = []
    if held:
        parts.append(f"{_b(grads)} of gradients ({', '.join(f'`{h}`' for h in holders) or 'parameters'}) are "
                     "still allocated at the failure, outside backward and the optimizer step.")
    if keep_zeros is not None:
        parts.append(f"{_cap(keep_zeros[0])} calls `{_clip(keep_zeros[1], 60)}`: gradients stay allocated as zeros "
                     "between steps instead of being freed.")
    parts.append("With gradient accumulation they live across micro-batches by design.")
    title = (f"Gradients held between steps: {_b(grads)}" if grads
             else f"zero_grad(set_to_none=False) keeps gradients allocated: `{_clip(keep_zeros[1], 50)}`")
    return Finding(
        key="gradients",
        title=title,
        detail=" ".join(parts),
        fix=("Call optimizer.zero_grad(set_to_none=True) (the default since torch 2.0) right after "
             "optimizer.step(), so the next forward pass runs without last step's gradients."),
        snippet=("optimizer.step()\n"
                 "optimizer.zero_grad(set_to_none=True)   # frees .grad now, not after the next forward"),
        frees=grads or None,
        confidence="likely",
    )


_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def _fragmentation(x: _Facts) -> Optional[Finding]:
    if x.state.device_type != "cuda" or x.kind not in ("", "cuda_allocator", "hip"):
        return None
    if (x.oom is not None and x.oom.backend == "cudaMallocAsync") or _conf_has(x.env, "backend", "cudamallocasync"):
        return None  # the async allocator has no "reserved but unallocated" to defragment
    ru, reserved, req = x.state.reserved_unallocated, x.state.reserved, x.requested
    if ru is None or ru < 16 * MiB:
        return None
    fits = req is not None and ru >= req
    if not fits and not (reserved and ru > reserved // 5):
        return None
    var = _conf_var(x)
    detail = (f"PyTorch has {_b(ru)} reserved but unallocated"
              + (f" ({_pct(ru, reserved)} of {_b(reserved)} reserved)" if reserved else "")
              + (f", more than the {_b(req)} it tried to allocate: the free pieces are split across "
                 "segments and none is large enough." if fits else ": cached blocks that are too small to reuse."))
    if _conf_has(x.env, "expandable_segments", "true"):
        fix = ("expandable_segments is already on: call torch.cuda.empty_cache() between phases (after "
               "evaluation, before training) or cap block splitting with max_split_size_mb.")
        snippet = "torch.cuda.empty_cache()   # return cached blocks to the driver between phases"
        conf = "possible"
    else:
        current = _conf_value(x.env)
        value = f"{current},expandable_segments:True" if current else "expandable_segments:True"
        fix = (f"Set {var}=expandable_segments:True (torch >= 2.1; older: max_split_size_mb:128) in the first "
               "cell, before CUDA initializes: restart the kernel first.")
        snippet = f'import os\nos.environ["{var}"] = "{value}"   # first cell, before torch uses the GPU\nimport torch'
        conf = "likely" if fits else "possible"
    return Finding("fragmentation", f"Fragmentation: {_b(ru)} reserved but unallocated", detail, fix, snippet,
                   ru, conf)


def _conf_var(x: _Facts) -> str:
    if x.oom is not None:
        m = re.search(r"(PYTORCH_\w*ALLOC_CONF)=expandable", x.oom.message)
        if m:
            return m.group(1)
    return "PYTORCH_HIP_ALLOC_CONF" if x.kind == "hip" else "PYTORCH_CUDA_ALLOC_CONF"


def _conf_value(env: Mapping[str, str]) -> str:
    for var in _CONF_VARS:
        value = env.get(var)
        if value:
            return value
    return ""


def _conf_has(env: Mapping[str, str], key: str, value: str) -> bool:
    for var in _CONF_VARS:
        for item in (env.get(var) or "").split(","):
            k, _, v = item.partition(":")
            if k.strip().lower() == key and v.strip().lower() == value:
                return True
    return False


def _other_processes(x: _Facts) -> Optional[Finding]:
    if x.is_cpu:
        return None
    listed = [(pid, b, name) for pid, b, name in x.state.processes if b]
    others = x.state.other_processes_bytes
    if not others or others < 64 * MiB:
        return None
    if listed:
        names = ", ".join(f"PID {pid}" + (f" ({name})" if name else "") + f" {_b(b)}" for pid, b, name in listed[:4])
        title = f"{len(listed)} other process{'es' if len(listed) > 1 else ''} hold {_b(others)} on {x.state.device}"
        first = listed[0][0]
    else:
        names = f"{_b(others)} in use beyond this process's {_b(x.state.process_used)}"
        title = f"Other processes hold {_b(others)} on {x.state.device}"
        first = "PID"
    detail = (f"{names}. That memory is not PyTorch's to free"
              + (f"; stopping them would leave room for the {_b(x.requested)} request." if x.requested and
                 others >= (x.shortfall or 0) else ".")
              + " In containers NVML reports host PIDs, which `kill` inside the container may not see.")
    return Finding(
        key="other_processes",
        title=title,
        detail=detail,
        fix=("Stop what you do not need: another notebook's kernel (Jupyter: Kernel > Shut Down in that notebook; "
             "Colab: Runtime > Restart session), or a stale process with `kill PID` after checking nvidia-smi."),
        snippet=("!nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv\n"
                 f"!kill {first}   # check the name first"),
        frees=others,
        confidence="likely",
    )


def _cuda_context_and_libraries(x: _Facts) -> Optional[Finding]:
    if x.is_cpu or x.kind == "mps" or x.state.total is None:
        return None
    total = x.state.total
    inside = x.state.non_pytorch_in_process
    split_known = inside is not None
    if inside is None and x.state.processes and x.state.outside_pytorch is not None:
        inside = _sub(x.state.outside_pytorch, x.state.other_processes_bytes)
        split_known = True
    amount = inside if split_known else x.state.outside_pytorch
    # A CUDA context alone takes a few hundred MiB: only more than that is worth a finding.
    if amount is None or not (amount >= GiB or (amount >= 512 * MiB and amount >= total // 10)):
        return None
    mostly_others = not split_known and amount > total // 2
    xla = sorted(m for m in ("tensorflow", "jax") if m in x.modules)
    if split_known:
        title = f"{_b(amount)} of this process's {x.state.device} memory is outside PyTorch's allocator"
        if x.state.process_used is not None:
            detail = (f"This process uses {_b(x.state.process_used)} but PyTorch reserved {_b(x.state.reserved)}: "
                      f"the rest is {_IN_PROCESS}.")
        else:
            detail = (f"{_b(x.state.used)} is in use; PyTorch reserved {_b(x.state.reserved)} and other processes "
                      f"hold {_b(x.state.other_processes_bytes)}: the rest is {_IN_PROCESS}.")
    elif mostly_others:
        title = f"{_b(amount)} of {x.state.device} is used outside PyTorch's allocator"
        detail = (f"{_b(x.state.used)} is in use but PyTorch reserved only {_b(x.state.reserved)}: "
                  f"{_pct(amount, total)} of the device is held by another process or another framework in this "
                  "kernel (a CUDA context alone is a few hundred MiB).")
    else:
        title = f"{_b(amount)} of {x.state.device} is used outside PyTorch's allocator"
        detail = (f"{_b(x.state.used)} is in use but PyTorch reserved {_b(x.state.reserved)}: the rest is the CUDA "
                  "context, other libraries or other processes (the message does not say which).")
    if xla:
        detail += (f" {' and '.join(xla)} is imported in this kernel: JAX preallocates 75% of the GPU by default "
                   "(90% in older versions) and TensorFlow maps nearly all of it.")
        fix = ("Stop TensorFlow/JAX from preallocating (set the variables before importing them), or use one "
               "framework per kernel.")
        snippet = ('import os\nos.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"   # JAX, before import jax\n'
                   "import tensorflow as tf\n"
                   "for gpu in tf.config.list_physical_devices('GPU'):\n"
                   "    tf.config.experimental.set_memory_growth(gpu, True)")
    else:
        fix = ("Check nvidia-smi and the imported GPU libraries for what holds it: move TensorFlow, JAX or CuPy work "
               "to its own process or stop it preallocating (the CUDA context itself cannot be freed).")
        snippet = ("!nvidia-smi\n"
                   "import sys; print([m for m in ('tensorflow', 'jax', 'cupy', 'tensorrt') if m in sys.modules])")
    return Finding("cuda_context_and_libraries", title, detail, fix, snippet, amount if xla else None,
                   "likely" if split_known or mostly_others else "possible")


_IN_PROCESS = ("the CUDA context, cuBLAS/cuDNN handles, NCCL buffers and other GPU libraries "
               "(TensorFlow, JAX, CuPy)")
_TORCH_LOAD = re.compile(r"\btorch\.load\s*\(")
_CKPT_NAME = re.compile(r"(?i)(?:^|[^a-z])(?:ckpt|checkpoint|state_dict|sd)(?:[^a-z]|$)"
                        r"|model_state_dict|optimizer_state_dict")


def _checkpoint_on_gpu(x: _Facts) -> Optional[Finding]:
    loads = []
    for label, line in x.code_lines():
        for m in _TORCH_LOAD.finditer(line):
            args = _call_args(line, m.end() - 1)
            if args is not None and "map_location" not in args:
                loads.append((label, line, args))
    holders = [h for h in x.holders if _CKPT_NAME.search(h["name"].split(" (")[0])
               and h.get("category") in ("other_tensors", "ipython_caches")]
    held = sum(int(h["bytes"]) for h in holders)
    if not loads and not held:
        return None
    roots = sorted({re.split(r"[\[.]", h["name"], 1)[0] for h in holders})
    parts = []
    if loads:
        label, line, _args = loads[0]
        parts.append(f"{_cap(label)} calls `{_clip(line, 70)}` without map_location: every tensor comes back on the "
                     "device it was saved from, before load_state_dict copies it again.")
    if held:
        parts.append(f"{', '.join(f'`{r}`' for r in roots)} still hold{'s' if len(roots) == 1 else ''} "
                     f"{_b(held)} of checkpoint tensors after loading.")
    assigned = re.match(r"(\w+)\s*=(?!=)", loads[0][1]) if loads else None
    var = roots[0] if roots else (assigned.group(1) if assigned else "checkpoint")
    if loads:
        _label, line, args = loads[0]
        load_line = line.replace(f"({args})", f'({args.strip()}, map_location="cpu")', 1)
    else:
        load_line = f'{var} = torch.load(path, map_location="cpu")'
    snippet = (f"{load_line}\nmodel.load_state_dict({var}{_state_dict_key(holders)})   # copies to the model's device\n"
               f"del {var}")
    title = (f"Checkpoint tensors still held: {_b(held)}" if held
             else f"torch.load without map_location: `{_clip(loads[0][1], 50)}`")
    return Finding(
        key="checkpoint_on_gpu",
        title=title,
        detail=" ".join(parts),
        fix=f'Load with map_location="cpu" and `del {var}` once load_state_dict has copied it.',
        snippet=snippet,
        frees=held or None,
        confidence="likely" if held else "possible",
    )


def _state_dict_key(holders: Sequence[Dict[str, Any]]) -> str:
    """``['model_state_dict']`` when the held checkpoint nests the weights under that key, else ""."""
    for key in ("model_state_dict", "state_dict", "model"):
        if any(f"['{key}']" in h["name"] for h in holders):
            return f'["{key}"]'
    return "" if holders else '["model_state_dict"]'


def _ipython_refs(x: _Facts) -> Optional[Finding]:
    cached = x.cat("ipython_caches")
    if cached <= 0:
        return None
    rows = [h for h in x.holders if h.get("category") == "ipython_caches"]
    shown = ", ".join(f"`{h['name']}` {_b(h['bytes'])}" for h in rows[:3])
    return Finding(
        key="ipython_refs",
        title=f"IPython keeps {_b(cached)} alive (Out cache, last traceback)",
        detail=(f"{shown}. IPython keeps displayed results in Out/_N and the failed call's frames in "
                "sys.last_traceback, so their tensors stay allocated after the error."),
        fix=("Run %gpumem free (drops the last traceback and Out entries holding tensors, then gc and the "
             "allocator cache), or clear them by hand."),
        snippet="%gpumem free\n# or by hand:\n%reset -f out\nimport sys; sys.last_traceback = sys.last_value = None",
        frees=cached,
        confidence="certain",
    )


def _earlier_cells(x: _Facts) -> Optional[Finding]:
    rows = cell_deltas(x.records, x.state)
    if not rows:
        return None
    top = rows[:3]
    left = sum(d for _rec, d in top)
    whole = x.state.process_used if x.is_cpu else x.state.allocated
    if whole:
        if left < whole // 5:
            return None
    elif left < 256 * MiB:
        return None
    what = "host RSS" if x.is_cpu else "allocated"
    named = "; ".join(f"{_cell_label(rec)} `{_clip(rec.first_line, 40)}` +{_b(d)}" for rec, d in top)
    return Finding(
        key="earlier_cells",
        title=f"Earlier cells left {_b(left)} {what} behind",
        detail=(f"{named}" + (f": {_pct(left, whole)} of the {_b(whole)} {what} at the failure." if whole else ".")
                + " What a cell creates stays allocated as long as a variable refers to it."),
        fix=("Delete what those cells created and no longer need (`del name`), or restart the kernel and rerun "
             "only the cells you need."),
        snippet=_release_snippet([rec for rec, _d in top], x),
        frees=left,
        confidence="possible",
    )


def cell_deltas(records: Sequence[Any], state: MemoryState) -> List[Tuple[Any, int]]:
    """``(record, bytes left behind)`` for cells that grew memory, largest first.

    Device memory (``allocated_delta`` of the state's device) for GPUs, host RSS for the CPU.
    """
    out = []
    for rec in records:
        if state.device_type == "cpu":
            delta = rec.host.rss_delta if getattr(rec, "host", None) is not None else None
        else:
            dev = _device_record(rec, state)
            delta = dev.allocated_delta if dev is not None else None
        if delta is not None and delta > 0:
            out.append((rec, int(delta)))
    out.sort(key=lambda item: -item[1])
    return out


def _device_record(rec: Any, state: MemoryState) -> Any:
    devices = getattr(rec, "devices", ()) or ()
    index = state.index
    for dev in devices:
        if index is None or dev.index == index:
            return dev
    return None


def _failing_record(x: _Facts) -> Any:
    if not x.records:
        return None
    last = x.records[-1]
    if getattr(last, "error", None) or (x.failing_source and last.source == x.failing_source):
        return last
    return None


def _cell_label(rec: Any) -> str:
    return getattr(rec, "label", "[ ]")


def _release_snippet(records: Sequence[Any], x: _Facts) -> str:
    """``del`` of the tensor-holding names those cells assigned, or a pointer to who() when unknown."""
    holding = {re.split(r"[\[. ]", h["name"], 1)[0] for h in x.holders}
    names: List[str] = []
    for rec in records:
        for line in (rec.source or "").splitlines():
            m = re.match(r"([A-Za-z_]\w*)\s*=(?!=)\s*(.*)", line)  # top-level assignments only
            if not m or m.group(1) in names:
                continue
            if holding and m.group(1) not in holding:
                continue  # who() knows which names hold tensors
            if not holding and re.fullmatch(r"[-+0-9.e_]+|['\"].*|True|False|None", m.group(2).strip()):
                continue  # a number or a string holds no device memory
            names.append(m.group(1))
    if not names:
        return "import ipy_gpumem\nprint(ipy_gpumem.who().summary())   # which variables hold the memory"
    tail = "" if x.is_cpu else "\ntorch.cuda.empty_cache()   # give the cached blocks back"
    return f"del {', '.join(names[:4])}   # only what you no longer need\nimport gc; gc.collect(){tail}"


_NP_SHAPE = re.compile(r"shape \(([0-9, ]*)\) and data type (\w+)")
_TF_SHAPE = re.compile(r"shape\s?\[([0-9, ]+)\] and type (\w+)")
_ITEMSIZE = {"float64": 8, "double": 8, "float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2,
             "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
             "complex128": 16}
_BROADCAST = re.compile(r"\[\s*:\s*,\s*None\s*\]|\[\s*None\s*,\s*:\s*\]|\[\s*None\s*\]"
                        r"|unsqueeze\(\s*-?[0-9]\s*\)|\bcdist\(|np\.newaxis")
_FLOAT64 = re.compile(r"float64|\.double\(\)|torch\.double|dtype\s*=\s*float\b")


def _cpu_oom(x: _Facts) -> Optional[Finding]:
    if not x.is_cpu or x.kind not in ("cpu", ""):
        return None
    req, ram = x.requested, x.state.total
    shape = _message_shape(x.oom)
    if req is None and shape is None:
        return None
    if req is None and shape is not None:
        req = shape[2]
    parts = [f"The CPU allocator was asked for {_b(req)}"
             + (f", {_times(req / ram)} the machine's {_b(ram)} of RAM" if ram else "") + "."]
    if shape is not None:
        parts.append(f"The message names the array: shape ({shape[0]}) of {shape[1]}.")
    if req >= 2 ** 50:
        parts.append("A size this large is almost always a wrong number: an overflowed or mixed-up shape.")
    bcast = x.find(_BROADCAST)
    if bcast is not None:
        parts.append(f"{_cap(bcast[0])} broadcasts `{_clip(bcast[1], 50)}`: combining (N,1) with (1,N) makes "
                     "an N×N result.")
    f64 = x.find(_FLOAT64)
    dtype64 = (shape is not None and shape[1] in ("float64", "double")) or f64 is not None
    if dtype64:
        parts.append("float64 takes twice the bytes of float32" + (f" (`{_clip(f64[1], 40)}`)." if f64 else "."))
    fix = ("Check the shape and dtype before the big op; use torch.float32 or bfloat16 instead of float64, "
           "process the data in chunks, and memory-map large datasets instead of loading them whole.")
    snippet = ("print(x.shape, x.dtype)            # is this the size you meant?\n"
               "x = x.to(torch.float32)            # float64 doubles memory\n"
               "out = torch.cat([f(c) for c in x.split(4096)])   # in chunks\n"
               "data = np.load(path, mmap_mode=\"r\")   # memory-mapped, read on demand")
    return Finding("cpu_oom", f"Host out of memory: tried to allocate {_b(req)}"
                   + (f" with {_b(ram)} of RAM" if ram else ""),
                   " ".join(parts), fix, snippet, req // 2 if dtype64 else None,
                   "likely" if (bcast or dtype64 or shape or (ram and req > ram)) else "possible")


def _message_shape(oom: Optional[OomReport]) -> Optional[Tuple[str, str, int]]:
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


def _cublas_cudnn(x: _Facts) -> Optional[Finding]:
    if x.kind not in ("cublas", "cudnn", "cuda_error"):
        return None
    name = _clip(x.oom.message, 60) if x.oom is not None else x.kind
    lib = {"cublas": "cuBLAS", "cudnn": "cuDNN"}.get(x.kind, "The CUDA runtime")
    numbers = _device_fullness(x)
    ru = x.state.reserved_unallocated
    detail = (f'"{name}": {lib} needed memory of its own (handles, workspaces) outside PyTorch\'s caching allocator. '
              "These errors fire when the device is already nearly full" + (f": {numbers}." if numbers else "."))
    if ru:
        detail += (f" PyTorch's cache holds {_b(ru)} reserved but unallocated that {lib} cannot use until "
                   "empty_cache() returns it.")
    if x.kind == "cuda_error":
        detail += " Kernel errors are reported asynchronously: run with CUDA_LAUNCH_BLOCKING=1 to see the real line."
    return Finding(
        key="cublas_cudnn",
        title=f"{lib} could not allocate: the device was nearly full" + (f" ({numbers})" if numbers else ""),
        detail=detail,
        fix=("Treat it like a regular OOM (smaller batch, free tensors, check other processes with nvidia-smi); "
             "torch.cuda.empty_cache() before the failing op gives the cache back, and "
             "torch.backends.cudnn.benchmark = False avoids large workspaces."),
        snippet=("torch.cuda.empty_cache()                  # return PyTorch's cache to the driver\n"
                 "torch.backends.cudnn.benchmark = False     # no workspace-hungry autotuning\n"
                 "# last resort, before CUDA starts (slower): os.environ[\"CUBLAS_WORKSPACE_CONFIG\"] = \":0:0\""),
        frees=ru or None,
        confidence="likely",
    )


def _device_fullness(x: _Facts) -> str:
    """``"15.60 GiB of 15.78 GiB in use"`` from the state, else from the last record, else ""."""
    s = x.state
    if s.used is not None and s.total:
        return f"{_b(s.used)} of {_b(s.total)} in use"
    if s.reserved is not None and s.total:
        return f"PyTorch reserved {_b(s.reserved)} of {_b(s.total)}"
    for rec in reversed(x.records):
        dev = _device_record(rec, s)
        if dev is not None and dev.total:
            used = dev.used_after if dev.used_after is not None else dev.reserved_after
            if used is not None:
                return f"{_b(used)} of {_b(dev.total)} in use after {_cell_label(rec)}"
    return ""


def _mps(x: _Facts) -> Optional[Finding]:
    if x.kind != "mps" or x.oom is None:
        return None
    o = x.oom
    parts = [p for p in (o.allocated_by_pytorch, o.other_allocations, x.requested) if p is not None]
    if not parts:
        return None
    need = sum(parts)
    title = (f"MPS limit: {_b(o.allocated_by_pytorch)} allocated + {_b(o.other_allocations)} other + "
             f"{_b(x.requested)} requested > {_b(o.max_allowed)} max allowed")
    return Finding(
        key="mps",
        title=title,
        detail=(f"The MPS allocator caps memory at the high watermark ({_b(o.max_allowed)}); this allocation would "
                f"bring it to {_b(need)}. Unified memory is shared with macOS and every other app."),
        fix=("Free tensors and call torch.mps.empty_cache(), lower the batch size; only as a last resort raise the "
             "limit with PYTORCH_MPS_HIGH_WATERMARK_RATIO (0.0 removes it and can freeze the system)."),
        snippet=("torch.mps.empty_cache()\n"
                 "# last resort, before import torch (0.0 = no limit: macOS may swap hard or freeze):\n"
                 "# os.environ[\"PYTORCH_MPS_HIGH_WATERMARK_RATIO\"] = \"0.0\""),
        frees=None,
        confidence="likely",
    )


def _other_runtime(x: _Facts) -> Optional[Finding]:
    if x.oom is None or x.kind not in ("tensorflow", "other"):
        return None
    o = x.oom
    shape = _message_shape(o)
    quoted = _clip(o.message, 80)
    if x.kind == "tensorflow":
        what = f'"{quoted}": TensorFlow\'s allocator failed' + (
            f" on a tensor of shape [{shape[0]}] ({shape[1]}), {_b(shape[2])}." if shape else ".")
        return Finding(
            key="other_runtime",
            title="TensorFlow ran out of memory" + (f": a {_b(shape[2])} tensor" if shape else ""),
            detail=what + " TensorFlow maps nearly all GPU memory at start unless memory growth is on.",
            fix="Lower the batch size, and turn on memory growth so TensorFlow leaves room for other work.",
            snippet=("for gpu in tf.config.list_physical_devices('GPU'):\n"
                     "    tf.config.experimental.set_memory_growth(gpu, True)   # before any op"),
            frees=None, confidence="possible")
    return Finding(
        key="other_runtime",
        title=f'A library outside PyTorch ran out of device memory: "{_clip(o.message, 50)}"',
        detail=(f'"{quoted}" comes from a runtime with its own buffers (NCCL, llama.cpp, a CUDA extension). It fails '
                "when PyTorch's cache and tensors already fill the device."),
        fix=("Give memory back before that call: free tensors, torch.cuda.empty_cache(), or a smaller batch; "
             "check nvidia-smi for other processes."),
        snippet="torch.cuda.empty_cache()   # return PyTorch's unused cache to the driver\n!nvidia-smi",
        frees=x.state.reserved_unallocated or None, confidence="possible")


def _shortfall(x: _Facts) -> Finding:
    """The fallback: how far short the request fell, and which layers hold the memory."""
    s, req, free = x.state, x.requested, x.free
    where = "the host" if x.is_cpu else s.device
    if req is not None and free is not None and req <= free:
        title = f"Tried to allocate {_b(req)} with {_b(free)} free on {where}"
        detail = ("The request is smaller than the free memory the driver reported, so the failure is not about the "
                  "total: a per-allocation size limit of the driver (Intel GPUs cap single allocations), fragmentation "
                  "of the driver's free memory, or another process taking memory between the check and the allocation.")
        fix = "Split the tensor into smaller pieces (x.chunk(...)) and retry after torch.cuda.empty_cache()."
        return Finding("shortfall", title, detail, fix, "", None, "possible")
    total = f" ({_b(s.total)} total)" if s.total else ""
    if x.shortfall is not None:
        title = f"Short by {_b(x.shortfall)} on {where}: tried to allocate {_b(req)} with {_b(free)} free"
    elif req is not None:
        title = f"Tried to allocate {_b(req)} on {where}{total}"
    else:
        title = f"Out of memory on {where}{total}"
    layers = _layer_words(x)
    detail = ("Of the memory: " + ", ".join(layers) + ". ") if layers else ""
    said = (x.oom.message or x.oom.exception_type or x.oom.kind) if x.oom is not None else ""
    if said and (req is None or not layers):
        detail += f'The error says: "{_clip(said, 80)}".'
    fix = ("Free at least the shortfall: `del` tensors you no longer need (ipy_gpumem.who() shows which), lower the "
           "batch size, then torch.cuda.empty_cache()." if not x.is_cpu else
           "Free what you no longer need (`del` large arrays, then gc.collect()), process the data in chunks, "
           "or use a machine with more RAM.")
    return Finding("shortfall", title, detail.strip() or title, fix, "", None, "possible")


def _layer_words(x: _Facts) -> List[str]:
    """``["11.91 GiB allocated by PyTorch", ...]`` for the layers the state knows."""
    s = x.state
    if x.is_cpu:
        pairs = ((s.process_used, "used by this process (RSS)"),
                 (_sub(s.used, s.process_used), "by other processes and the OS"))
    else:
        pairs = ((s.allocated, "allocated by PyTorch"), (s.reserved_unallocated, "reserved but unallocated"),
                 (s.outside_pytorch, "used outside PyTorch"))
    return [f"{_b(v)} {label}" for v, label in pairs if v is not None]


_RULES = (
    _request_exceeds_device, _activations, _graphs_kept, _optimizer_state, _gradients, _fragmentation,
    _other_processes, _cuda_context_and_libraries, _checkpoint_on_gpu, _ipython_refs, _earlier_cells,
    _cpu_oom, _cublas_cudnn, _mps, _other_runtime,
)
