"""Gather everything known when a cell fails with out-of-memory into one ``OomAnalysis`` (data, not display).

The sources, best first: the allocator's own numbers captured at the failing allocation (CUDA's
OOM observer), the error message, a reading taken now (probe, NVML's process list, host RAM),
who holds the memory (the user's variables and IPython's caches), the records of earlier cells,
the failing traceback's frames with the shapes of the tensors their lines name (``oom.operands``:
the operation that failed and its phase, ``oom.operation`` and ``oom.stack``), and for a host
failure the process's memory limits (``oom.limits``). Pure assembly: no IPython import; the
extension calls :func:`analyse` from its post-cell hook and shows ``oom.panel.oom_panel(analysis)``.
"""
from __future__ import annotations

import os
import sys
import traceback as _traceback
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ..core.devices import cuda
from ..core.memory import DeviceMemory, Process
from ..core.units import MiB
from .limits import host_limits
from .operands import operands_of
from .rules import Finding, findings_of
from .rules.facts import Facts, cell_deltas

__all__ = ["OomAnalysis", "RecordedOom", "analyse", "analyse_recording", "memory_at_failure", "find_this_process",
           "traceback_frames", "recorded_failure", "with_recorded"]

#: Frames of the failing traceback handed to the diagnosis (innermost last).
MAX_FRAMES = 40


class RecordedOom(NamedTuple):
    """The allocator's own state at one out-of-memory, as a recording kept it (``%%gpumem --trace``, a
    snapshot's ``oom`` event replayed): exact bytes where the message rounds to two decimals.

    Attributes:
        device: the CUDA device index.
        requested: the block size it tried to allocate (what torch's message prints).
        device_free: free on the device, as the driver reported it at the failure (None: not recorded).
        allocated, reserved: the allocator's counters at the failure (block sizes, from the replay).
        free_in_reserved: free bytes inside reserved segments.
        largest_free_block: the largest free range of a plain segment; None when every segment is
            expandable (free pages are unmapped, not split).
        site: where the failing allocation was made (``"In [5], line 3"``), or None without a stack.
        source: where these numbers come from, in words (``"the cell's allocator trace"``).
        frames: the failing allocation's recorded stack as torch keeps it (dicts with ``filename``,
            ``name``, ``line``, innermost first; C++ frames included), () when not recorded: the
            operation and the phase are read from it.
    """

    device: int
    requested: int
    device_free: Optional[int]
    allocated: int
    reserved: int
    free_in_reserved: int
    largest_free_block: Optional[int]
    site: Optional[str]
    source: str
    frames: tuple = ()

    @property
    def reserved_unallocated(self) -> int:
        return self.reserved - self.allocated


def _rounded_equal(printed: Optional[int], exact: int) -> bool:
    """Whether a message's two-decimal size (``4.95 GiB``) can be ``exact`` bytes."""
    return printed is None or abs(printed - exact) <= 0.006 * max(printed, exact) + 1024


def recorded_failure(oom, recorded: Sequence[RecordedOom]) -> Optional[RecordedOom]:
    """The recorded out-of-memory that is this error: the last one on the message's device whose
    request and free memory agree with the message's rounded numbers; None when none does (the
    recording missed it, or the cell caught it and failed differently)."""
    device = getattr(oom, "gpu_index", None)
    if getattr(oom, "device_type", None) not in (None, "cuda"):
        return None
    for rec in reversed(tuple(recorded)):
        if device is not None and rec.device != device:
            continue
        if not _rounded_equal(getattr(oom, "requested", None), rec.requested):
            continue
        if rec.device_free is not None and not _rounded_equal(getattr(oom, "free", None), rec.device_free):
            continue
        return rec
    return None


def with_recorded(oom, recorded: RecordedOom):
    """``oom`` (an ``OomReport``) with the recording's exact numbers in place of the message's rounded ones."""
    exact = dict(requested=recorded.requested, allocated_by_pytorch=recorded.allocated,
                 reserved_unallocated=recorded.reserved_unallocated, reserved_by_pytorch=None,
                 allocated_in_private_pools=None, gpu_index=recorded.device)
    if recorded.device_free is not None:
        exact["free"] = recorded.device_free
    if getattr(oom, "device_type", None) is None:
        exact["device_type"] = "cuda"
    return replace(oom, **exact)


@dataclass(frozen=True)
class OomAnalysis:
    """Everything known about one out-of-memory failure: what the panel shows, as data.

    Attributes:
        oom: the parsed message (``OomReport``).
        memory: the failing device's memory (``DeviceMemory``), best source first; its
            ``processes`` are other processes (this kernel's line, when recognised, is
            ``process_used``).
        who: who held the memory on that device (``WhoReport``), or None.
        findings: the ranked diagnosis.
        failing: the failing cell's ``CellRecord``, or None.
        earlier: ``(record, bytes left behind)`` of the cells before the failing one that grew
            memory, largest first; never the failing cell.
        maybe_own: pids in ``memory.processes`` that may be this kernel (a container's NVML
            reports host pids and several candidates fit).
        errors: what failed while gathering, in words (``"the fragmentation rule: KeyError: 'x'"``,
            ``"who(): RuntimeError: ..."``): that part is missing, the rest is complete.
        batch: what is known about the failing cell's batch (``oom.batch.BatchKnown``), read
            from data already there (an earlier estimate or run of the cell, its record); None
            when there is no failing cell to speak of.
        recorded: the allocator's recorded state at this failure (:class:`RecordedOom`), when a
            recording of it was kept; ``oom`` and ``memory`` then carry its exact numbers.
    """

    oom: Any
    memory: DeviceMemory
    who: Any = None
    findings: Tuple[Finding, ...] = ()
    failing: Any = None
    earlier: Tuple[Tuple[Any, int], ...] = ()
    maybe_own: Tuple[int, ...] = ()
    errors: Tuple[str, ...] = ()
    batch: Any = None
    recorded: Optional[RecordedOom] = None
    #: The launched process that failed (``core.records.RankFailure``), when the error came back
    #: through its launcher: the memory and the message are that process's, not this kernel's.
    rank: Any = None
    #: The operation whose allocation failed (``oom.operation.Operation``), when its frames name one.
    operation: Any = None
    #: The process limit that refused a host request (``oom.limits.HostLimit``), when one did.
    limit: Any = None
    #: Where the allocation failed: ``"forward"``, ``"backward"``, ``"step"`` (the optimizer's own update) or None.
    phase: Optional[str] = None
    #: The frame that says so (``(filename, function, line)``), or None.
    phase_frame: Optional[Tuple[str, str, str]] = None
    #: The failing request in bytes as the analysis knows it: the message's, a recording's, or read from the
    #: failing line's literals (a ``MemoryError``); None when unknown.
    requested: Optional[int] = None


def analyse(oom, record, *, namespace: Optional[dict], records: Sequence[Any] = (), probe=None,
            capture=None, tb=None, refs=None, env: Optional[Mapping[str, str]] = None,
            modules: Optional[Iterable[str]] = None, who_fn: Optional[Callable[..., Any]] = None,
            pid: Optional[int] = None, executable: Optional[str] = None,
            recorded: Sequence[RecordedOom] = (), rank=None, rank_rss: Optional[int] = None) -> OomAnalysis:
    """Everything known about a cell that failed with ``oom`` (an ``OomReport``).

    It only reads: none of the user's code runs, on fake tensors or otherwise (the batch finding
    comes from ``oom.batch``, which reads records and an earlier estimate), so its cost is the
    who() walk's budget plus a few milliseconds, whatever the cell did.

    Args:
        oom: the parsed message.
        record: the failing cell's ``CellRecord`` (its source, its deltas), or None.
        namespace: the user's namespace, for who holds the memory (None skips that section).
        records: recent records, oldest first; the failing cell among them is left out.
        probe: the ``MemoryProbe``, for a reading now (device, NVML processes, host RAM).
        capture: an ``OomCapture`` from the allocator's observer, if one fired in this cell.
        tb: the failing traceback (``sys.last_traceback``).
        refs: IPython's own references (``attribution.holders.ipython_refs``), handed to ``who_fn``.
        env: environment variables for the diagnosis (default ``os.environ``).
        modules: imported module names (default ``sys.modules``).
        who_fn: ``who(namespace, device=..., allocator_total=..., refs=...)``; the attribution room's by default.
        pid, executable: this process, as NVML would list it (default ``os.getpid()``, ``sys.executable``).
        recorded: the out-of-memory events a recording of the cell kept (``%%gpumem --trace``); the
            one that is this error (:func:`recorded_failure`) gives the exact request, free memory,
            allocated and reserved, and the fragmentation at the failure. Best source of all.
        rank: the launched process that failed (a ``RankFailure``), when ``oom`` is its message: the
            kernel's names, frames, allocator and reading are then not asked (they are not that
            process's); its pid is "this process" among NVML's, ``rank_rss`` (its peak RSS, when
            known) its host memory.
    """
    errors: List[str] = []
    if rank is not None:
        namespace, tb, capture, probe = None, None, None, None
        pid = rank.pid if rank.pid is not None else pid
    found = recorded_failure(oom, recorded) if recorded else None
    if found is not None:
        oom = with_recorded(oom, found)
    memory, maybe_own = memory_at_failure(oom, probe, capture, pid=pid, executable=executable)
    if rank is not None and memory.is_host:
        memory = replace(memory, process_used=rank_rss,
                         source=f"the message; RSS of rank {rank.rank} at its peak" if rank_rss is not None else memory.source)
    if found is not None:
        # The recording is exact and from the very moment: it wins over the observer and a reading now.
        memory = replace(memory, allocated=found.allocated, reserved=found.reserved,
                         source=f"{found.source} at the failure" + (f" + {memory.source}" if memory.source else ""))
    who_report = _who(namespace, memory, refs, who_fn, errors)
    earlier = tuple(r for r in records if not _same_cell(r, record))
    batch = _batch(oom, memory, record, records, who_report, namespace, errors)
    # A launched process's limits are its own: only this kernel's are read.
    limits = host_limits() if rank is None and (memory.is_host or oom.kind == "cpu") else ()
    facts = Facts.build(oom, memory, who_report, earlier, failing=record, frames=traceback_frames(tb),
                        env=os.environ if env is None else env, modules=modules, maybe_own=maybe_own,
                        batch=batch, recorded=found, operands=operands_of(tb), limits=limits)
    findings = findings_of(facts, lambda rule, exc: errors.append(f"the {rule} rule: {type(exc).__name__}: {exc}"))
    return OomAnalysis(oom, memory, who_report, tuple(findings), record, tuple(cell_deltas(earlier, memory)),
                       maybe_own, tuple(errors), batch, found, rank, facts.operation, facts.limit, facts.phase,
                       facts.phase_frame, facts.requested)


def analyse_recording(oom, memory: DeviceMemory, recorded: RecordedOom, *,
                      env: Optional[Mapping[str, str]] = None) -> OomAnalysis:
    """The analysis of an out-of-memory a recording kept (a snapshot's ``oom`` event), without a session:
    the allocator's state and the failing allocation's recorded stack (its C++ frames name the operation
    and the phase); no names, traceback or reading now."""
    errors: List[str] = []
    facts = Facts.build(oom, memory, None, (), env={} if env is None else env, modules=(), recorded=recorded)
    findings = findings_of(facts, lambda rule, exc: errors.append(f"the {rule} rule: {type(exc).__name__}: {exc}"))
    return OomAnalysis(oom, memory, findings=tuple(findings), errors=tuple(errors), recorded=recorded,
                       operation=facts.operation, phase=facts.phase, phase_frame=facts.phase_frame,
                       requested=facts.requested)


def _batch(oom, memory: DeviceMemory, record, records, who_report, namespace, errors: List[str]):
    """What is known about the failing cell's batch (a ``BatchKnown``), or None; never raises."""
    try:
        from .batch import read_batch

        return read_batch(oom, memory, record, records, who_report, namespace)
    except Exception as exc:  # noqa: BLE001 - the panel still explains the failure without it
        errors.append(f"the batch finding: {type(exc).__name__}: {exc}")
        return None


def _same_cell(rec: Any, failing: Any) -> bool:
    # The extension records the failing cell before it asks for the panel, so the ledger's last
    # record is usually this very cell; an execution count names one cell of the session.
    if failing is None:
        return False
    if rec is failing:
        return True
    count = getattr(failing, "execution_count", None)
    return count is not None and getattr(rec, "execution_count", None) == count


def _who(namespace, memory: DeviceMemory, refs, who_fn, errors: List[str]):
    if namespace is None:
        return None
    if who_fn is None:
        from ..attribution.who import who as who_fn
    device = memory.device
    if device is not None and device.type not in ("cuda", "cpu"):
        device = None  # mps/xpu tensors: who() counts every device rather than guess their storages
    # The allocator's total lets who() say how much no variable explains; only CUDA has one.
    total = memory.allocated if device is not None and device.is_cuda else None
    extra = {} if refs is None else {"refs": refs}
    try:
        return who_fn(namespace, device=device, allocator_total=total, **extra)
    except Exception as exc:  # noqa: BLE001 - the panel still explains the message without it
        errors.append(f"who(): {type(exc).__name__}: {exc}")
        return None


def traceback_frames(tb) -> tuple:
    """``((filename, function, source line), ...)`` of a traceback, innermost last; never raises."""
    if tb is None:
        return ()
    try:
        summary = _traceback.extract_tb(tb, limit=None)[-MAX_FRAMES:]
        return tuple((fs.filename, fs.name, fs.line or "") for fs in summary)
    except Exception:  # noqa: BLE001 - a broken frame must not cost the panel
        return ()


# ==================================================================================================
# The device's memory at the failure
# ==================================================================================================


def memory_at_failure(oom, probe=None, capture=None, *, pid: Optional[int] = None,
                      executable: Optional[str] = None) -> Tuple[DeviceMemory, Tuple[int, ...]]:
    """The failing device's memory, and the pids that may be this kernel.

    The allocator's capture is exact and from the very moment, the message is rounded to two
    decimals, and a reading now comes after the failing cell's frames were unwound: each source
    only fills what the better ones left unknown.
    """
    memory = DeviceMemory.from_message(oom)
    if oom.process_in_use is None and oom.other_processes:
        # Torch did not find this process among NVML's lines (a container's host pids), and the
        # message's arithmetic keeps the largest line that can hold PyTorch's reservation as this
        # process, even when several can: every line goes back, and find_this_process decides,
        # saying "may be this kernel" when it cannot.
        memory = replace(memory, processes=tuple((pid, n, None) for pid, n in oom.other_processes),
                         process_used=None)
    device = memory.device
    if capture is not None and (device is None or (device.is_cuda and device.index in (None, capture.device))):
        memory = DeviceMemory.from_capture(capture, capped=oom.allowed is not None).merged(memory)
    if memory.is_host or oom.kind == "cpu":
        rss = probe.host.rss() if probe is not None else None
        memory = memory.merged(DeviceMemory.host(rss))
    elif probe is not None and memory.device is not None and memory.device.is_cuda and memory.device.index is not None:
        memory = memory.merged(_device_now(probe, memory.device.index))
    return find_this_process(memory, (os.getpid() if pid is None else pid,),
                             sys.executable if executable is None else executable,
                             torch_found_it=oom.process_in_use is not None)


def _device_now(probe, index: int) -> DeviceMemory:
    """A reading of CUDA device ``index`` now, with NVML's process list (slow: ~5 ms, so only at an OOM)."""
    try:
        samples, _reason = probe.cuda.sample([index])
    except Exception:  # noqa: BLE001 - a failing probe costs this reading, not the panel
        samples = ()
    now = DeviceMemory.from_sample(samples[0], source="probe after the error") if samples else \
        DeviceMemory(device=cuda(index))
    try:
        uuid = probe.cuda.properties(index)[2]
        processes = tuple(probe.cuda.nvml.processes(index, uuid))
    except Exception:  # noqa: BLE001 - no NVML: the message's process list, if any, stays
        processes = ()
    return replace(now, processes=processes) if processes else now


def find_this_process(memory: DeviceMemory, own_pids: Iterable[int], executable: str, *,
                      torch_found_it: bool = False) -> Tuple[DeviceMemory, Tuple[int, ...]]:
    """Take this kernel's line out of ``memory.processes``; return the pids that may still be it.

    NVML lists every process with a context on the device, this kernel included, but in a
    container under its host pid, which ``os.getpid()`` never equals. So, in order:

    1. a listed pid in ``own_pids`` (``os.getpid()``) is this kernel;
    2. when torch itself found this process (``torch_found_it``: the message says "this process
       has"), every listed process is another one;
    3. otherwise this kernel is one of the listed processes that can hold PyTorch's reservation
       (this process holds at least that, plus its CUDA context: no upper bound, since JAX or
       TensorFlow in the same kernel may hold far more) and runs the same program as
       ``executable`` (a known name that differs rules a process out). One such candidate is
       this kernel; several are each "may be this kernel".

    Returns:
        ``(memory, maybe_own)``: the memory with this kernel's line moved to ``process_used``
        when recognised, and the pids that may be this kernel otherwise.
    """
    procs = list(memory.processes)
    own_pids = set(own_pids)
    mine = [p for p in procs if p[0] in own_pids]
    if mine:
        return _as_own(memory, procs, mine[0]), ()
    if torch_found_it or not procs or memory.device is None or not memory.device.is_cuda:
        return memory, ()
    candidates = [p for p in procs if _could_be_this(p, memory.reserved, executable)]
    if len(candidates) == 1:
        return _as_own(memory, procs, candidates[0]), ()
    return memory, tuple(p[0] for p in candidates)


def _as_own(memory: DeviceMemory, procs, own: Process) -> DeviceMemory:
    rest = tuple(p for p in procs if p[0] != own[0])
    used = memory.process_used if memory.process_used is not None else own[1]
    return replace(memory, processes=rest, process_used=used)


def _could_be_this(p: Process, reserved: Optional[int], executable: str) -> bool:
    _pid, nbytes, name = p
    if reserved is not None and nbytes is not None:
        slack = 16 * MiB + reserved // 100  # the message's two-decimal rounding
        if nbytes + slack < reserved:
            return False  # this kernel holds at least what PyTorch reserved
    return _same_program(name, executable)


def _same_program(name: Optional[str], executable: str) -> bool:
    """Whether NVML's process name can be this interpreter (an unknown name can be anything)."""
    if not name or not name.strip() or name.strip().startswith("["):  # "[Not Found]": no name
        return True
    theirs = os.path.basename(name.strip().split()[0]).lower()
    ours = {os.path.basename(executable).lower(), os.path.basename(os.path.realpath(executable)).lower()}
    # python, python3, python3.11: a venv's symlink and the binary NVML names are one interpreter.
    return theirs in ours or (theirs.startswith("python") and any(o.startswith("python") for o in ours))
