"""Find an out-of-memory message in any pasted error text and read its numbers into an ``OomReport``.

Covers every PyTorch allocator generation (CUDA, HIP, XPU, MPS, CPU), the CUDA runtime, cuBLAS and cuDNN
errors, TensorFlow/XLA, and a few neighbouring runtimes (NCCL, ggml, spconv, DirectML, ONNX Runtime).
Errors that are out-of-memory errors in disguise in most public reports (a DataLoader worker killed by
the kernel, cuDNN finding no usable algorithm, a cuBLAS handle that cannot be created) are reported too,
with ``confidence`` saying how sure that reading is; they never hide a message that says it ran out of
memory.

Speed (at most 20 ms for any input up to 1 MiB; benchmarks/bench_parse.py measures it). The old
parser took 55-115 ms on most megabyte inputs, though it read only their first and last 64 KiB: it
cleaned that text up (one Python call per line and per HTML entity), then ran about 45
case-insensitive regexes over it, twice when nothing matched. A
case-insensitive pattern, or one that starts with a lookbehind or ``^``, gives the regex engine no
literal to skip to, so it tries every position, about 15 ns each. Now:

- Every detector has a finder: its pattern with the literals lower-cased, compiled without IGNORECASE,
  run on a lower-cased copy of the text, and starting with a literal (written by hand where the anchor
  does not), so the engine skips to candidates at the speed of a substring search. The anchor itself
  only checks what a finder found.
- Text is cleaned up as a whole (each step over all of it at once, never line by line) only when it
  is short: up to 32 KiB, or up to 128 KiB when it holds little markup; within those sizes it is
  searched as before, step for step. In longer text only the last 16 KiB is read that way; elsewhere
  screens (literals found with ``str.rfind`` from the end) point at candidates, and a window around
  each is cleaned up and read. Screens see the raw text with its newlines as spaces, so they find a
  message wherever its words are separated by single spaces or hard wraps, which is how messages are
  printed; a message split inside a word, wrapped behind quote markers, or with markup inside it is
  found in long text only in its last 16 KiB.
"""
from __future__ import annotations

import html
import re
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from ..core.units import parse_bytes

__all__ = ["CONFIDENCES", "KINDS", "SIZE_FIELDS", "OomReport", "parse_oom"]

KINDS = (
    "cuda_allocator", "cuda_error", "cublas", "cudnn", "hip", "mps", "xpu", "cpu", "tensorflow", "other",
)

# "certain": the message says it ran out of memory (or gives the out-of-memory status code);
# "likely" / "possible": an error that is an out-of-memory error in most / many public reports.
CONFIDENCES = ("certain", "likely", "possible")

# The byte-valued fields, named like the ``expected`` keys of the sample corpus.
SIZE_FIELDS = (
    "requested", "total", "free", "allocated_by_pytorch", "reserved_by_pytorch", "reserved_unallocated",
    "process_in_use", "allowed", "allocated_in_private_pools", "other_allocations", "max_allowed",
    "pytorch_limit",
)


@dataclass(frozen=True)
class OomReport:
    """What one out-of-memory message says, in bytes; every number is None when the message omits it.

    Attributes:
        kind: Message family, one of :data:`KINDS`.
        message: The message as found: from the start of the OOM sentence (no log prefix, no exception
            type), HTML-unescaped, ANSI-free, every whitespace run collapsed to one space. An exception
            raised without a message (a bare ``MemoryError``) has its type's name here.
        confidence: How sure it is that this is an out-of-memory error, one of :data:`CONFIDENCES`:
            ``"certain"`` when the message says so, ``"likely"`` or ``"possible"`` for errors that only
            usually mean it (a DataLoader worker killed by signal, cuDNN finding no algorithm).
        exception_type: The exception name printed before the message (``"torch.OutOfMemoryError"``),
            or None.
        backend: ``"native"`` for caching-allocator messages, ``"cudaMallocAsync"`` for the async
            allocator's message, else None.
        device_type: Torch-style device type (``"cuda"`` also on ROCm, ``"xpu"``, ``"mps"``, ``"cpu"``,
            ``"npu"``...), or None when the message does not tell.
        gpu_index: Device ordinal the message names.
        requested: Size that failed (for the caching allocator its rounded block size).
        total: Device capacity ("total capacity", async "Device limit").
        free: Free device memory as the driver reported it.
        allocated_by_pytorch: Bytes in live tensors (since torch 2.4 including private pools).
        reserved_by_pytorch: Old-format total reserved by the caching allocator (allocated included).
        reserved_unallocated: Cached but unused ("reserved by PyTorch but unallocated", old "cached").
        process_in_use: Everything this process holds on the device, CUDA context included.
        other_processes: ``(pid, bytes)`` for every "Process N has X memory in use" line.
        allowed: Per-process cap set by ``torch.cuda.set_per_process_memory_fraction``.
        allocated_in_private_pools: Bytes held by CUDA-graph private pools.
        other_allocations: MPS "other allocations".
        max_allowed: MPS high-watermark limit.
        pytorch_limit: cudaMallocAsync "PyTorch limit" (2**64 when no fraction is set).
        pool: MPS pool, ``"shared"`` or ``"private"``.
        hints: Remedies the message itself names, in order of appearance: ``"expandable_segments"``,
            ``"max_split_size_mb"``, ``"PYTORCH_MPS_HIGH_WATERMARK_RATIO"``, ``"empty_cache"``,
            ``"report_tensor_allocations_upon_oom"``.
    """

    kind: str
    message: str
    confidence: str = "certain"
    exception_type: Optional[str] = None
    backend: Optional[str] = None
    device_type: Optional[str] = None
    gpu_index: Optional[int] = None
    requested: Optional[int] = None
    total: Optional[int] = None
    free: Optional[int] = None
    allocated_by_pytorch: Optional[int] = None
    reserved_by_pytorch: Optional[int] = None
    reserved_unallocated: Optional[int] = None
    process_in_use: Optional[int] = None
    other_processes: Tuple[Tuple[int, int], ...] = ()
    allowed: Optional[int] = None
    allocated_in_private_pools: Optional[int] = None
    other_allocations: Optional[int] = None
    max_allowed: Optional[int] = None
    pytorch_limit: Optional[int] = None
    pool: Optional[str] = None
    hints: Tuple[str, ...] = ()

    def to_dict(self) -> Dict[str, Any]:
        """Every field as JSON-serialisable data; ``other_processes`` becomes ``[{"pid", "in_use"}]``."""
        out: Dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "other_processes":
                value = [{"pid": pid, "in_use": in_use} for pid, in_use in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @property
    def reserved(self) -> Optional[int]:
        """Bytes the caching allocator holds (allocated + cached), or None.

        New-format messages print ``allocated + private pools`` and ``reserved - that``, so the sum
        is the reservation without adding the private pools a second time.
        """
        if self.reserved_by_pytorch is not None:
            return self.reserved_by_pytorch
        if self.allocated_by_pytorch is not None and self.reserved_unallocated is not None:
            return self.allocated_by_pytorch + self.reserved_unallocated
        return None

    @property
    def reserved_unallocated_bytes(self) -> Optional[int]:
        """Cached-but-unused bytes, also derived for the 1.4-2.0 format that prints only totals."""
        if self.reserved_unallocated is not None:
            return self.reserved_unallocated
        if self.reserved_by_pytorch is not None and self.allocated_by_pytorch is not None:
            # Both are rounded to two decimals, which can flip the sign of a zero difference.
            return max(0, self.reserved_by_pytorch - self.allocated_by_pytorch)
        return None

    @property
    def used_by_others(self) -> Optional[int]:
        """Bytes held by the other listed processes.

        0 when NVML answered (this process's own line is there) and listed nobody else; None when the
        message has no process list at all.
        """
        if self.other_processes:
            return sum(in_use for _, in_use in self.other_processes)
        return 0 if self.process_in_use is not None else None

    @property
    def non_pytorch_in_process(self) -> Optional[int]:
        """This process's device memory outside the caching allocator (CUDA context, cuBLAS, NCCL...)."""
        reserved = self.reserved
        if self.process_in_use is None or reserved is None:
            return None
        return max(0, self.process_in_use - reserved)

    @property
    def device(self) -> Optional[str]:
        """``"cuda:0"``, ``"xpu:1"``, ``"cpu"``, ``"mps"``, bare ``"cuda"`` without an index, or None."""
        if self.device_type is None:
            return None
        if self.device_type in ("cpu", "mps") or self.gpu_index is None:
            return self.device_type
        return f"{self.device_type}:{self.gpu_index}"


# --------------------------------------------------------------------------------------------------
# Regex building blocks. Every pattern is written with single spaces that compile to ``\s?``: the
# input has its whitespace runs collapsed, so this accepts normal text, hard-wrapped text (a newline
# instead of the space) and text whose spaces a renderer dropped ("out of memorySearch for").

_WINDOW_CAP = 8000  # longest plausible message: a v5 message listing dozens of processes
_EXTEND_CAP = 400  # how far a message without a known ending may run on to the end of its line
_READ_CAP = 1 << 20  # text read at most: the first 64 KiB and the rest from the end
_HEAD_CAP = 64 * 1024
_EXACT_ALL = 32 * 1024  # text up to this size is cleaned up and searched as a whole
_EXACT_PLAIN = 128 * 1024  # and up to this size when it holds little markup (_MARKUP_CAP at most)
_MARKUP_CAP = 8192  # substitutions at about 0.3 us each: a few ms of clean-up at most
_TAIL = 16 * 1024  # longer text: its end is read in full, where a traceback's last message sits
_CONTEXT_BEFORE = 2048  # cleaned up before a candidate: the lead, the exception type on the line above
_CONTEXT_AFTER = 9 * 1024  # and after it: _WINDOW_CAP and the line that stops the message
_LINE_SLACK = 2048  # how far to look for a newline to cut at
_WINDOWS = 6  # candidates read in full per text, beyond its end; each costs at most about 1.5 ms
_RANKS = 4
_SCREEN_CHUNK = 64 * 1024
_SCREEN_OVERLAP = 2048  # longer than any screen match (a MapAllocator file name may take 1000)
_SCREEN_BACK = 160  # a screen may match this far into its message

# The lookbehinds keep a match from starting inside a number ("16.83" must not be read as "6.83"
# or "83", not even when a terminal wrapped the line inside it) and make a digit run cost linear time.
# A size at the very end of truncated text has no unit yet, so it never matches: a cut number is
# dropped rather than misread. A bare unit must be an upper-case "B" (TensorFlow's "256B"); a
# lower-case "b" is what is left of a cut "bytes".
_SIZE = (
    r"(?<![0-9])(?<![0-9]\.)(?<![0-9]\n)(?<![0-9]\.\n)"
    r"(?P<n>[0-9]+(?:\.[0-9]*)?)\s?(?P<u>bytes|[KMGTPE]i?B|(?-i:B))"
)
_INT = r"(?P<i>[0-9]+)(?![0-9])"


def _rx(template: str, flags: int = 0) -> re.Pattern[str]:
    # Case-insensitive because log aggregators and user code lowercase messages; parse_bytes reads
    # "mib" and "MiB" alike.
    pattern = template.replace("{SIZE}", _SIZE).replace("{INT}", _INT).replace(" ", r"\s?")
    return re.compile(pattern, re.ASCII | re.IGNORECASE | flags)


def _bytes_of(match: re.Match[str]) -> Optional[int]:
    number = match.group("n").replace(",", "")
    unit = match.group("u") or ""
    try:
        return parse_bytes(f"{number} {unit}")
    except (ValueError, ArithmeticError):  # decimal.InvalidOperation is an ArithmeticError
        return None


class _Window:
    """The text from the message start to where the message can end, and what was found in it."""

    def __init__(self, text: str):
        self.text = text
        self.ends: List[int] = []
        self.tail_end: Optional[int] = None
        self._joined: Optional[str] = None

    @property
    def joined(self) -> str:
        # Terminal copies wrap at a fixed column, even inside words and numbers.
        if self._joined is None:
            self._joined = self.text.replace("\n", "")
        return self._joined

    def search(self, rx: re.Pattern[str]) -> Optional[re.Match[str]]:
        """First match; its end counts towards the message's extent. Falls back to the unwrapped text."""
        m = rx.search(self.text)
        if m is not None:
            self.ends.append(m.end())
            return m
        if "\n" in self.text:
            return rx.search(self.joined)
        return None

    def peek(self, rx: re.Pattern[str]) -> bool:
        """Whether ``rx`` occurs, without letting it stretch the message."""
        return rx.search(self.text) is not None

    def size(self, *rxs: re.Pattern[str]) -> Optional[int]:
        for rx in rxs:
            m = self.search(rx)
            if m is not None:
                value = _bytes_of(m)
                if value is not None:
                    return value
        return None

    def integer(self, *rxs: re.Pattern[str]) -> Optional[int]:
        for rx in rxs:
            m = self.search(rx)
            if m is not None:
                return int(m.group("i"))
        return None

    def tails(self, *rxs: re.Pattern[str]) -> None:
        """Known last sentences: when one is present the message ends exactly there."""
        for rx in rxs:
            m = rx.search(self.text)
            if m is not None and (self.tail_end is None or m.end() > self.tail_end):
                self.tail_end = m.end()


# --------------------------------------------------------------------------------------------------
# Field parsers, one per message family. Each field has its own search, so a missing, reordered or
# extra clause costs only that field.

_REQ_TRIED = _rx(r"Tried to allocate {SIZE}")
_ALLOC_GPU = _rx(r"(?:GPU|NPU|MLU|MUSA|XPU) {INT}(?= (?:;|has|\(|,))")
_TOTAL_NEW = _rx(r"total capaci?ty of {SIZE}")  # torch 2.1 printed "capacty"
_TOTAL_OLD = _rx(r"{SIZE} total capacity")
_FREE_NEW = _rx(r"of which {SIZE} is free")
_FREE_OLD = _rx(r"{SIZE} free(?!d)")
_ALLOCATED_NEW = _rx(r"allocated memory {SIZE} is allocated")
_ALLOCATED_OLD = _rx(r"{SIZE} already allocated")
_RESERVED_OLD = _rx(r"{SIZE} reserved in total")
_UNALLOCATED_NEW = _rx(r"{SIZE} is reserved by")
_CACHED_OLD = _rx(r"{SIZE} cached")  # 0.4-1.3: cached = reserved - allocated
_THIS_PROCESS = _rx(r"this process has {SIZE}")
_OTHER_PROCESS = _rx(r"(?<![A-Za-z])Process (?P<pid>[0-9]+) has {SIZE}")
_ALLOWED = _rx(r"{SIZE} allowed")
_PRIVATE_POOLS = _rx(r"{SIZE} allocated in private")
_ALLOC_TAILS = (
    _rx(r"environment-(?:\s)?variables\)\.?"),
    _rx(r"PYTORCH_[A-Z]+_ALLOC_CONF(?![=\w])\.?"),
    _rx(r"cached memory\.?"),
    # v1/v2 end at the parenthesis; v3 goes on with its hint, which a truncation may have cut.
    _rx(r"(?:reserved in total by PyTorch|cached|inactive)\)\.?(?! If)"),
)
_DEVICE_TYPES = {"CUDA": "cuda", "HIP": "cuda", "XPU": "xpu", "NPU": "npu", "MLU": "mlu", "MUSA": "musa"}
_ALLOC_KINDS = {"CUDA": "cuda_allocator", "GPU": "cuda_allocator", "HIP": "hip", "XPU": "xpu"}


def _parse_allocator(w: _Window, m: re.Match[str], prefix: str) -> Dict[str, Any]:
    """Caching allocator, every generation: 0.4 "cached" to 2.4+ private pools; HIP, XPU and forks."""
    dev = m.group("dev").upper()
    return {
        "kind": _ALLOC_KINDS.get(dev, "other"),
        "device_type": _DEVICE_TYPES.get(dev, "cuda" if dev == "GPU" else dev.lower()),
        "backend": "native",
        "requested": w.size(_REQ_TRIED),
        "gpu_index": w.integer(_ALLOC_GPU),
        "total": w.size(_TOTAL_NEW, _TOTAL_OLD),
        "free": w.size(_FREE_NEW, _FREE_OLD),
        "allocated_by_pytorch": w.size(_ALLOCATED_NEW, _ALLOCATED_OLD),
        "reserved_by_pytorch": w.size(_RESERVED_OLD),
        "reserved_unallocated": w.size(_UNALLOCATED_NEW, _CACHED_OLD),
        "process_in_use": w.size(_THIS_PROCESS),
        "other_processes": _processes(w),
        "allowed": w.size(_ALLOWED),
        "allocated_in_private_pools": w.size(_PRIVATE_POOLS),
        "tails": _ALLOC_TAILS,
    }


def _processes(w: _Window) -> Tuple[Tuple[int, int], ...]:
    found = []
    for m in _OTHER_PROCESS.finditer(w.text):
        value = _bytes_of(m)
        if value is not None:
            found.append((int(m.group("pid")), value))
            w.ends.append(m.end())
    if "\n" in w.text:
        # A terminal wrap inside one line hides only that process from the search above.
        unwrapped = [(int(m.group("pid")), _bytes_of(m)) for m in _OTHER_PROCESS.finditer(w.joined)]
        if len(unwrapped) > len(found) and all(value is not None for _, value in unwrapped):
            return tuple(unwrapped)  # type: ignore[arg-type]
    return tuple(found)


_ASYNC_GPU = _rx(r"Allocation on device {INT} would")
_ASYNC_ALLOCATED = _rx(r"Currently allocated :? {SIZE}")
_ASYNC_REQUESTED = _rx(r"Requested :? {SIZE}")
_ASYNC_TOTAL = _rx(r"Device limit :? {SIZE}")
_ASYNC_FREE = _rx(r"Free \([^)]{0,40}\) : {SIZE}")
_ASYNC_LIMIT = _rx(r"PyTorch limit[^:]{0,80}: {SIZE}")  # its label wraps onto a second line


def _parse_async(w: _Window, m: re.Match[str], prefix: str) -> Dict[str, Any]:
    """cudaMallocAsync backend: a multi-line table whose alignment spaces renderers often collapse."""
    return {
        "backend": "cudaMallocAsync",
        "gpu_index": w.integer(_ASYNC_GPU),
        "allocated_by_pytorch": w.size(_ASYNC_ALLOCATED),
        "requested": w.size(_ASYNC_REQUESTED),
        "total": w.size(_ASYNC_TOTAL),
        "free": w.size(_ASYNC_FREE),
        "pytorch_limit": w.size(_ASYNC_LIMIT),
        "tails": (_ASYNC_LIMIT,),
    }


_MPS_ALLOCATED = _rx(r"MPS allocated :? {SIZE}")
_MPS_OTHER = _rx(r"other allocations :? {SIZE}")
_MPS_MAX = _rx(r"max allowed :? {SIZE}")
_MPS_POOL = _rx(r"on (?P<pool>shared|private) pool")
_MPS_TAILS = (_rx(r"\(may cause system failure\)\.?"), _rx(r"on (?:shared|private) pool\.?(?! Use)"))


def _parse_mps(w: _Window, m: re.Match[str], prefix: str) -> Dict[str, Any]:
    """MPS allocator; before 2025 its own format_size printed binary values labelled KB/MB/GB."""
    pool = w.search(_MPS_POOL)
    return {
        "allocated_by_pytorch": w.size(_MPS_ALLOCATED),
        "other_allocations": w.size(_MPS_OTHER),
        "max_allowed": w.size(_MPS_MAX),
        "requested": w.size(_REQ_TRIED),
        "pool": pool.group("pool").lower() if pool is not None else None,
        "tails": _MPS_TAILS,
    }


_CPU_REQUESTED = (
    _rx(r"you tried to (?:re)?allocate {SIZE}"),  # DefaultCPUAllocator and TH's "72GB" (a floor)
    _rx(r"Unable to allocate {SIZE}"),  # numpy's _ArrayMemoryError
    _rx(r"unable to mmap (?P<n>[0-9]+)(?![0-9]) (?P<u>bytes)"),  # torch's MapAllocator
)


def _parse_cpu(w: _Window, m: re.Match[str], prefix: str) -> Dict[str, Any]:
    """Host memory: c10's DefaultCPUAllocator, legacy TH, MapAllocator, numpy, the OS."""
    return {"requested": w.size(*_CPU_REQUESTED)}


_TF_REQUESTED = (
    _rx(r"\(rounded to (?P<n>[0-9]+)(?P<u>)\)"),  # the exact bin size beats the 3-digit label
    _rx(r"ran out of memory trying to allocate {SIZE}"),
    _rx(r"failed to alloc {SIZE} on"),
    _rx(r"\((?P<n>[0-9]+) (?P<u>bytes)\) from device"),
    _rx(r"failed to allocate (?P<n>[0-9]+(?:\.[0-9]*)?)(?P<u>[KMGTPE]i?B?|B)(?= [(:])"),
    _rx(r"Out of memory while trying to allocate {SIZE}"),
    _rx(r"Failed to allocate request for [^(]{0,24}\((?P<n>[0-9]+)(?P<u>B)\)"),
)
_TF_GPU = (_rx(r"device:GPU:{INT}"), _rx(r"GPU_{INT}_bfc"), _rx(r"device ordinal {INT}"))
_TF_HOST = _rx(r"on host|device:CPU:|by allocator (?:cpu|mklcpu)|Allocator \((?:cpu|mklcpu|\w*host\w*)\)")
_TF_GPU_WORD = _rx(r"GPU|from device")
_TF_HINT = _rx(r"report_tensor_allocations_upon_oom[^.\n]{0,80}\.?")


def _parse_tensorflow(w: _Window, m: re.Match[str], prefix: str) -> Dict[str, Any]:
    """TensorFlow and XLA/JAX: ResourceExhaustedError, BFC allocator and stream-executor log lines."""
    w.search(_TF_HINT)  # two lines below the message, after the failing node
    gpu_index = w.integer(*_TF_GPU)
    if w.peek(_TF_HOST):
        device_type: Optional[str] = "cpu"
    elif gpu_index is not None or w.peek(_TF_GPU_WORD):
        device_type = "cuda"
    else:
        device_type = None
    return {
        "requested": w.size(*_TF_REQUESTED),
        "gpu_index": gpu_index,
        "device_type": device_type,
    }


_OTHER_REQUESTED = (
    _rx(r"Could not allocate tensor with {SIZE}"),  # torch-directml
    _rx(r"requested buffer of size (?P<n>[0-9]+)(?P<u>)(?![0-9.])"),  # ONNX Runtime BFCArena
    _rx(r"CUDA calloc(?: async)? {SIZE}"),  # NCCL
    _rx(r"allocating {SIZE} on device"),  # ggml
    _rx(r"Out of memory allocating (?P<n>[0-9][0-9,]*) (?P<u>bytes)"),  # CuPy
)
_OTHER_GPU = (
    _rx(r"current device : {INT} ,"),  # ggml >= 2024
    _rx(r"on device {INT} :"),  # ggml buffer allocation
    _rx(r"GPU = {INT}"),  # ONNX Runtime CUDA_CALL
)
# NCCL's log line is "host:pid:tid [dev] file:line NCCL WARN ...": the device sits before the anchor.
_NCCL_DEVICE = re.compile(r"\[([0-9]+)\]\s?[^\s\[\]]*:[0-9]+\s?$", re.ASCII)


def _parse_other(w: _Window, m: re.Match[str], prefix: str) -> Dict[str, Any]:
    """Other runtimes: NCCL, ggml, spconv, DirectML, ONNX Runtime, CuPy, torch_memory_saver..."""
    gpu_index = w.integer(*_OTHER_GPU)
    if gpu_index is None and m.group("msg").upper().startswith("NCCL"):
        nccl = _NCCL_DEVICE.search(prefix)
        gpu_index = int(nccl.group(1)) if nccl is not None else None
    return {"requested": w.size(*_OTHER_REQUESTED), "gpu_index": gpu_index}


# Sentences that may close a CUDA status error. None is reliably the last (each torch version adds or
# drops one), so they only stretch the message; the rest of their line is then taken as well.
_CUDA_ERROR_ENDINGS = (
    _rx(r"Compile with .?TORCH_USE_CUDA_DSA.? to enable device-side assertions\.?"),
    _rx(r"consider passing CUDA_LAUNCH_BLOCKING=1\.?"),
    _rx(r"for more information\."),
    _rx(r"CUDA_LOG_FILE=stderr\.?"),
)
_GGML_DEVICE = _rx(r"current device : {INT} , in function")


def _parse_cuda_error(w: _Window, m: re.Match[str], prefix: str) -> Dict[str, Any]:
    """``cudaErrorMemoryAllocation`` as reported by C10_CUDA_CHECK, THC or the driver API."""
    found = _parse_nothing(w, m, prefix)
    gpu_index = w.integer(_GGML_DEVICE)
    if gpu_index is not None:
        # ggml prints the same "CUDA error: out of memory" line, then names the device.
        found.update(kind="other", gpu_index=gpu_index)
    return found


def _parse_nothing(w: _Window, m: re.Match[str], prefix: str) -> Dict[str, Any]:
    """Status-code errors (cuBLAS, cuDNN, HIP, UR...) carry no numbers."""
    for rx in _CUDA_ERROR_ENDINGS:
        w.search(rx)
    return {}


# --------------------------------------------------------------------------------------------------
# Detectors. Each anchor is the most specific phrase of one message shape. ``lead`` (matched against
# the text just before the anchor on its line) moves the message start back over words that belong
# to the message but are too generic to search for. Rank 0 messages carry numbers; rank 1 are status
# errors; rank 2 are last-resort names; rank 3 are errors that only usually mean out-of-memory, so any
# message that says it ran out of memory wins over them.
#
# Every anchor also gets a finder: the same pattern with its literals lower-cased, compiled without
# IGNORECASE, run on a lower-cased copy of the text. Where an anchor does not start with a literal (a
# lookbehind, ``^``), the finder is written by hand so that it does; without a literal to skip to,
# the regex engine tries every position, which is what made the old parser slow.


def _lowered(pattern: str) -> str:
    """``pattern`` for ASCII-lower-cased text: literals lower-cased (escapes kept), groups unnamed."""
    pattern = re.sub(r"\(\?P<[A-Za-z_][A-Za-z0-9_]*>", "(?:", pattern)
    out = []
    i = 0
    while i < len(pattern):
        if pattern[i] == "\\":
            out.append(pattern[i:i + 2])
            i += 2
        else:
            out.append(pattern[i].lower())
            i += 1
    return "".join(out)


@dataclass(frozen=True)
class _Detector:
    kind: str
    rank: int
    anchor: re.Pattern[str]
    parse: Callable[[_Window, re.Match[str], str], Dict[str, Any]]
    device_type: Optional[str] = None
    lead: Optional[re.Pattern[str]] = None
    cuts: bool = True  # a later match of this anchor ends the current message
    resumes: Optional[re.Pattern[str]] = None  # a line that continues the message after a blank line
    confidence: str = "certain"
    finder_source: Optional[str] = None  # hand-written finder, for anchors that do not start with a literal
    back: int = 0  # how far before a finder match the anchor may start (hand-written finders only)
    finder: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        source = self.finder_source or _lowered(self.anchor.pattern)
        # A finder matches wherever the anchor does (and, rarely, a little more: "(?-i:B)" cannot tell
        # "B" from "b" once the text is lower-cased); every finder match is checked with the anchor.
        object.__setattr__(self, "finder", re.compile(source, re.ASCII | (self.anchor.flags & re.MULTILINE)))


def _lead(template: str) -> re.Pattern[str]:
    return _rx(f"(?:{template}) $")


# Some frameworks re-wrap a message with blank lines between its sentences (SGLang's "Capture cuda
# graph failed: CUDA out of memory.\nTried to allocate ...\n\nGPU 0 has ..."); a blank line followed
# by one of the family's own clauses does not end the message.
_ALLOC_RESUMES = _rx(
    r"(?:Tried to allocate|(?:GPU|NPU|XPU) [0-9]+ has|\((?:GPU|NPU) [0-9]+ ;|Process [0-9]+ has"
    r"|Including non-PyTorch|Of the allocated memory|with [0-9.]+ [A-Za-z]+ allocated in"
    r"|and [0-9.]+ [A-Za-z]+ is reserved|[0-9.]+ [A-Za-z]+ allowed|If reserved|Please use)"
)
_ASYNC_RESUMES = _rx(r"(?:Currently allocated|Requested :|Device limit|Free \(|PyTorch limit|: [0-9])")
_MPS_RESUMES = _rx(r"(?:Tried to allocate|Use PYTORCH_MPS)")
_ERROR_RESUMES = _rx(r"(?:Search for|(?:CUDA|HIP) kernel errors|For debugging|Compile with|For more detailed)")
_ENFORCE_LEAD = r"\[enforce fail at [^\]\n]{1,300}\][^\n]{0,80}?"
_TRIED_LEAD = r"Tried to allocate [0-9]+(?:\.[0-9]*)? (?:bytes|[KMGTPE]i?B|B)"
_DETECTORS: Tuple[_Detector, ...] = tuple(sorted((  # stable: the order below breaks ties within a rank
    # ---- rank 0: messages with numbers
    _Detector("cuda_allocator", 0, _rx(r"(?<![A-Za-z])(?P<msg>(?P<dev>CUDA|HIP|XPU|NPU|MLU|MUSA) out of memory)"),
              _parse_allocator, resumes=_ALLOC_RESUMES,
              # A finder must start with a literal: this one starts at "out" and checks the device
              # word before it with lookbehinds.
              finder_source=r"out(?:(?<=[apu]out)|(?<=[apu]\sout))(?:" + "|".join(
                  rf"(?<={dev}out)(?<![a-z]{dev}out)|(?<={dev}\sout)(?<![a-z]{dev}\sout)"
                  for dev in ("cuda", "hip", "xpu", "npu", "mlu", "musa")) + r")\s?of\s?memory",
              back=len("musa ")),
    _Detector("cuda_allocator", 0, _rx(r"(?P<msg>Allocation on device (?:[0-9]+ )?would exceed allowed memory)"),
              _parse_async, "cuda", resumes=_ASYNC_RESUMES),
    _Detector("mps", 0, _rx(r"(?P<msg>MPS backend out of memory)"), _parse_mps, "mps", resumes=_MPS_RESUMES),
    _Detector("cpu", 0, _rx(r"(?P<msg>DefaultCPUAllocator : (?:can.?t allocate memory|not enough memory))"),
              _parse_cpu, "cpu", _lead(_ENFORCE_LEAD)),
    _Detector("cpu", 0, _rx(r"(?P<msg>Torch : not enough memory)"), _parse_cpu, "cpu", _lead(r"\$")),
    _Detector("cpu", 0, _rx(r"(?P<msg>Unable to allocate (?:{SIZE} for an )?array)"), _parse_cpu, "cpu"),
    # torch's MapAllocator (shared memory, DataLoader workers, mmap'd checkpoints); only errno 12, ENOMEM.
    _Detector("cpu", 0, _rx(r"(?P<msg>unable to mmap [0-9]+ bytes from file <[^\n<>]{0,1000}> : "
                            r"Cannot allocate memory)"),
              _parse_cpu, "cpu"),
    _Detector("tensorflow", 0, _rx(r"(?P<msg>OOM when allocating)"), _parse_tensorflow, None,
              _lead(r"Resource exhausted :|RESOURCE_EXHAUSTED :")),
    _Detector("tensorflow", 0, _rx(r"(?P<msg>(?:Resource exhausted|RESOURCE_EXHAUSTED) : (?:OOM|Out of memory))"),
              _parse_tensorflow),
    _Detector("tensorflow", 0, _rx(r"(?P<msg>Allocator \([^)]{1,40}\) ran out of memory)"), _parse_tensorflow),
    _Detector("tensorflow", 0, _rx(r"(?P<msg>failed to alloc {SIZE} on (?:host|device)[\s\S]{0,40}?"
                                   r"(?:CUDA_ERROR_OUT_OF_MEMORY|out of memory))"), _parse_tensorflow),
    _Detector("tensorflow", 0, _rx(r"(?P<msg>failed to allocate [0-9.]+ [KMGTPE]?i?B? \([0-9]+ bytes\) from device)"),
              _parse_tensorflow),
    _Detector("tensorflow", 0, _rx(r"ResourceExhaustedError[^:]{0,40}: (?P<msg>failed to allocate memory)"),
              _parse_tensorflow),
    _Detector("tensorflow", 0, _rx(r"(?P<msg>Failed to allocate request for)"), _parse_tensorflow),
    _Detector("other", 0, _rx(r"(?P<msg>NCCL WARN (?:Cuda failure (?:[0-9]+ )?'out of memory'|Failed to CUDA calloc))"),
              _parse_other, "cuda"),
    _Detector("other", 0, _rx(r"(?P<msg>CUDA error 2 at [^\s]{1,200}? : out of memory)"), _parse_other, "cuda"),
    _Detector("other", 0, _rx(r"(?P<msg>allocating {SIZE} on device [0-9]+ : cudaMalloc failed : out of memory)"),
              _parse_other, "cuda"),
    _Detector("other", 0, _rx(r"(?P<msg>cuda failed with error 2 :? out of memory)"), _parse_other, "cuda"),
    _Detector("other", 0, _rx(r"(?P<msg>Could not allocate tensor with {SIZE})"), _parse_other),
    _Detector("other", 0, _rx(r"(?P<msg>Failed to allocate memory for requested buffer of size)"), _parse_other),
    _Detector("other", 0, _rx(r"(?P<msg>CUDA failure 2 : out of memory)"), _parse_other, "cuda"),
    _Detector("other", 0, _rx(r"(?P<msg>Out of memory allocating [0-9][0-9,]* bytes)"), _parse_other, "cuda"),
    _Detector("other", 0, _rx(r"(?P<msg>cuMem[A-Za-z_0-9]{0,20} failed : out of memory)"), _parse_other, "cuda"),
    _Detector("other", 0, _rx(r"(?P<msg>CUresult error(?: result =| :) 2)(?![0-9])"), _parse_other, "cuda"),
    # ---- rank 1: status errors without numbers
    # Allocator messages pasted without their first words: anchored on the device clause, which is
    # also inside every full message (where the rank-0 anchor wins), extended back over "Tried to ...".
    _Detector("cuda_allocator", 1, _rx(r"(?P<msg>\((?P<dev>GPU|NPU) [0-9]+ ; {SIZE} total capacity)"),
              _parse_allocator, lead=_lead(_TRIED_LEAD), cuts=False, resumes=_ALLOC_RESUMES),
    _Detector("cuda_allocator", 1, _rx(r"(?P<msg>(?P<dev>GPU|NPU) [0-9]+ has a total capaci?ty of {SIZE} of which)"),
              _parse_allocator, lead=_lead(_TRIED_LEAD + r"\."), cuts=False, resumes=_ALLOC_RESUMES,
              finder_source=r"has\s?a\s?total\s?capaci?ty\s?of", back=32),
    _Detector("cuda_error", 1, _rx(r"(?P<msg>CUDA [Ee]rror : out of memory)"), _parse_cuda_error, "cuda",
              resumes=_ERROR_RESUMES),
    _Detector("cuda_error", 1, _rx(r"(?P<msg>cuda runtime error \(2\) : out of memory)"), _parse_cuda_error, "cuda"),
    # The gap may not run over another "THCudaCheck": without that, every "THCudaCheck FAIL" in a long
    # log made the lazy gap scan 400 characters, and a message never starts one THC line too early.
    _Detector("cuda_error", 1, _rx(r"(?P<msg>THCudaCheck FAIL(?:(?!THCudaCheck)[\s\S]){0,400}?"
                                   r"error = 2 : out of memory)"),
              _parse_cuda_error, "cuda"),
    _Detector("cuda_error", 1, _rx(r"(?P<msg>CUDA driver error : out of memory)"), _parse_cuda_error, "cuda"),
    _Detector("cublas", 1, _rx(r"(?P<msg>(?:CUBLAS|HIPBLAS)_STATUS_ALLOC_FAILED)"), _parse_nothing, "cuda",
              _lead(r"CUDA error :"),
              finder_source=r"blas_status_alloc_failed(?:(?<=cublas_status_alloc_failed)"
                            r"|(?<=hipblas_status_alloc_failed))", back=len("hip")),
    _Detector("cudnn", 1, _rx(r"(?P<msg>CUDNN_STATUS_(?:ALLOC_FAILED|NOT_ENOUGH_MEMORY)|miopenStatusAllocFailed)"),
              _parse_nothing, "cuda", _lead(r"(?:cuDNN|MIOpen) error :"),
              finder_source=r"status(?:(?<=cudnn_status)_(?:alloc_failed|not_enough_memory)"
                            r"|(?<=miopenstatus)allocfailed)", back=len("miopen")),
    _Detector("other", 1, _rx(r"(?P<msg>(?:CUSOLVER|CUSPARSE|CURAND)_STATUS_ALLOC_FAILED|CUFFT_ALLOC_FAILED)"),
              _parse_nothing, "cuda", _lead(r"(?:cuSOLVER|cuSPARSE|cuRAND|cuFFT) error :")),
    _Detector("hip", 1, _rx(r"(?P<msg>HIP error : out of memory)"), _parse_cuda_error, "cuda",
              resumes=_ERROR_RESUMES),
    _Detector("xpu", 1, _rx(r"(?P<msg>UR_RESULT_ERROR_OUT_OF_(?:DEVICE|HOST)_MEMORY)"),
              _parse_nothing, "xpu", _lead(r"UR backend failed\.[^\n]{0,60}?")),
    _Detector("xpu", 1, _rx(r"(?P<msg>PI_ERROR_OUT_OF_HOST_MEMORY)"), _parse_nothing, "xpu",
              _lead(r"Native API failed\.[^\n]{0,60}?")),
    _Detector("xpu", 1, _rx(r"(?P<msg>ZE_RESULT_ERROR_OUT_OF_(?:DEVICE|HOST)_MEMORY)"), _parse_nothing, "xpu"),
    _Detector("cpu", 1, _rx(r"(?P<msg>posix_memalign\(&data, gAlignment, nbytes\) == 0\. 12 vs 0)"),
              _parse_nothing, "cpu", _lead(_ENFORCE_LEAD)),  # before torch 1.2; 12 is ENOMEM
    _Detector("cpu", 1, _rx(r"(?P<msg>\[Errno 12\] Cannot allocate memory)"), _parse_nothing, "cpu"),
    _Detector("cpu", 1, _rx(r"(?P<msg>Out of memory : Kill(?:ed)? process [0-9]+)"), _parse_nothing, "cpu"),
    # ---- rank 2: bare error names, also printed as the tail of richer messages
    _Detector("cuda_error", 2, _rx(r"(?P<msg>cudaErrorMemoryAllocation)"), _parse_cuda_error, "cuda", cuts=False),
    _Detector("hip", 2, _rx(r"(?P<msg>hipErrorOutOfMemory)"), _parse_cuda_error, "cuda", cuts=False),
    _Detector("other", 2, _rx(r"(?P<msg>CUDA_ERROR_OUT_OF_MEMORY)"), _parse_nothing, "cuda",
              _lead(r"Call to [A-Za-z_0-9]{1,40} results in"), cuts=False),
    _Detector("cpu", 2, _rx(r"(?P<msg>std::bad_alloc)"), _parse_nothing, "cpu", cuts=False),
    # Python's own MemoryError only as a traceback's exception line (or its repr, "MemoryError()", which
    # is what an empty MemoryError such as bytearray(2**46)'s prints as), never in prose or source code.
    _Detector("cpu", 2, _rx(r"^(?P<etype>(?:builtins\.)?MemoryError)(?:\(\)|(?: : (?P<msg>[^\n]*)))?$", re.MULTILINE),
              _parse_nothing, "cpu", cuts=False,
              finder_source=r"memoryerror(?:(?<![^\n]memoryerror)|(?<![^\n]builtins\.memoryerror)"
                            r"(?<=builtins\.memoryerror))(?=\s?:|\(\)|\n|\Z)", back=len("builtins.")),
    # ---- rank 3: out-of-memory errors in disguise. Their confidence is what the public reports say.
    # The kernel's OOM killer sends SIGKILL ("Killed"); in the reports found (pytorch/pytorch#8976,
    # open-mmlab/mmrotate#501, hezhangsprinter/DCPDN#12, mittagessen/kraken#266...) the fix was more RAM,
    # fewer workers or a smaller batch. Other signals (Segmentation fault, Aborted, Bus error) are not
    # out of memory and are not matched.
    _Detector("cpu", 3, _rx(r"(?P<msg>DataLoader worker (?:\(pid [0-9]+\) )?is killed by signal : Killed)"),
              _parse_nothing, "cpu", confidence="likely"),
    # cuDNN's try_all raises this once every candidate algorithm failed, and it swallows both
    # CUDAOutOfMemoryError (the workspace did not fit) and CuDNNError on the way. The reports split:
    # a smaller batch fixed marqo-ai/marqo#101, XPixelGroup/DiffBIR#59, TQTQliu/MVSGaussian#18 and
    # ultralytics/yolov5#11250; a cuDNN that does not support the GPU (cuDNN 7 on RTX 30xx) caused
    # gml16/rl-medical#13, CGCL-codes/pFedSD#2 and deepakn97/relationPrediction#37, where a smaller
    # batch did not help. Hence "possible".
    _Detector("cudnn", 3, _rx(r"(?P<msg>Unable to find a valid cuDNN algorithm to run convolution)"),
              _parse_nothing, "cuda", confidence="possible"),
    # Intel's runtimes say "out of resources", not memory; on XPU that is how a device allocation that
    # does not fit surfaces in the IPEX and torch-xpu-ops reports, but the words do not say so.
    _Detector("xpu", 3, _rx(r"(?P<msg>UR_RESULT_ERROR_OUT_OF_RESOURCES)"), _parse_nothing, "xpu",
              _lead(r"UR backend failed\.[^\n]{0,60}?"), confidence="likely"),
    _Detector("xpu", 3, _rx(r"(?P<msg>PI_ERROR_OUT_OF_RESOURCES)"), _parse_nothing, "xpu",
              _lead(r"Native API failed\.[^\n]{0,60}?"), confidence="likely"),
    # cublasCreate allocates the handle's workspace on the device; when that fails cuBLAS reports
    # NOT_INITIALIZED rather than ALLOC_FAILED. Most reports (tensorflow/tensorflow#9489,
    # EleutherAI/lm-evaluation-harness#1689, IBM/aihwkit#479, awslabs/sockeye#897, OpenBMB/VisCPM#3)
    # end in "not enough GPU memory"; a minority are an embedding index out of range
    # (SkyworkAI/Skywork#38) or a CUDA/driver mismatch (mlcommons/algorithmic-efficiency#185).
    _Detector("cublas", 3, _rx(r"(?P<msg>(?:CUBLAS|HIPBLAS)_STATUS_NOT_INITIALIZED)"), _parse_nothing, "cuda",
              _lead(r"CUDA error :"), confidence="likely",
              finder_source=r"blas_status_not_initialized(?:(?<=cublas_status_not_initialized)"
                            r"|(?<=hipblas_status_not_initialized))", back=len("hip")),
), key=lambda det: det.rank))

_HINTS = tuple(
    (name, re.compile(re.escape(name)))
    for name in ("expandable_segments", "max_split_size_mb", "PYTORCH_MPS_HIGH_WATERMARK_RATIO", "empty_cache",
                 "report_tensor_allocations_upon_oom")
)

# --------------------------------------------------------------------------------------------------
# Text clean-up. Line by line, the result is the same as cleaning each line on its own (the old
# per-line loop), but every step runs over the whole text at once: a loop over lines cost half a
# microsecond per line, and one callback per HTML entity cost 0.3 us per entity.

_ANSI = re.compile(r"\x1b\[[0-?]{0,32}[ -/]{0,8}[@-~]|\x1b\][^\x07\x1b\n]{0,512}(?:\x07|\x1b\\)?|\x1b")
# Copies from rendered notebooks often lose the ESC byte but keep "[0;31m".
_BARE_SGR = re.compile(r"\[(?:[0-9]{1,3};){0,6}[0-9]{1,3}m")
# Tags never contain "<", ">" or a newline, so removing line-breaking tags first and the others second
# gives what one pass with a callback gave.
_TAG_BREAKS = re.compile(r"</?(?:br|p|div)\b[^<>\n]{0,200}>", re.IGNORECASE)
_TAG_OTHERS = re.compile(r"</?(?:pre|code|span|b|i|em|strong|tt|kbd|samp)\b[^<>\n]{0,200}>", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f\u200b-\u200d\u2060\ufeff]")
_SPACES = re.compile(r"[ \t\x0b\x0c\xa0\u1680\u2000-\u200a\u202f\u205f\u3000]+")
_WIDE_SPACES = re.compile(r"[\xa0\u1680\u2000-\u200a\u202f\u205f\u3000]")
# What str.strip() still finds at a line's ends once _SPACES and _CONTROL have run.
_EDGE_SPACES = re.compile(r"^[ \x85\u2028\u2029]+|[ \x85\u2028\u2029]+$", re.MULTILINE)
_QUOTE_MARKERS = re.compile(r"^(?:>(?!>) ?)+")  # markdown quotes, but not ">>>" prompts or ">>"
_LINE_QUOTE_MARKERS = re.compile(r"\n(?:>(?!>) ?)+")

_STOP_LINE = re.compile(
    r"(?:Traceback \(most recent call last\)|During handling of the above exception"
    r"|The above exception was the direct cause|File \"|In \[[0-9 ]*\]:"
    r"|\[?[0-9]{4}-[0-9]{2}-[0-9]{2}[ T][0-9]{2}:[0-9]{2}|\[?[0-9]{2}:[0-9]{2}:[0-9]{2}"
    r"|(?:INFO|WARNING|WARN|ERROR|DEBUG|CRITICAL|FATAL)\b"
    r"|(?:[A-Za-z_][A-Za-z0-9_]*\.)*[A-Za-z_][A-Za-z0-9_]*(?:Error|Exception|Warning) ?:)",
    re.ASCII,
)
_EXTEND_STOP = re.compile(r"Traceback \(most recent call last\)|During handling of the above| File \"")
_EXCEPTION_BEFORE = re.compile(
    r"(?<![\w.])((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception))"
    r"(?:(?: ?\(see above for traceback\))? ?: ?|\([\"'])$",  # "Type: msg" or repr's "Type('msg')"
    re.ASCII,
)
_EXCEPTION_LINE = re.compile(r"((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)) ?:", re.ASCII)
_WHITESPACE = re.compile(r"\s+")


def _coerce(text: Any) -> Optional[str]:
    """The text to read, its middle dropped beyond 1 MiB; None for anything that is not text."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        data = bytes(text)
        if len(data) > _READ_CAP:
            data = data[:_HEAD_CAP] + b"\n\n" + data[-(_READ_CAP - _HEAD_CAP - 2):]
        return data.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        return None
    if len(text) > _READ_CAP:
        # The blank line keeps a message cut in half from being glued to unrelated text.
        text = text[:_HEAD_CAP] + "\n\n" + text[-(_READ_CAP - _HEAD_CAP - 2):]
    return str.__str__(text)  # a plain copy: a str subclass's own __str__ is not ours to call


def _unescape(text: str) -> str:
    """``html.unescape(text)``, without a Python call per entity when the same few repeat."""
    count = text.count("&")
    if count <= 256:
        return html.unescape(text)
    # An entity starts at an "&" and never contains another, so each piece between two "&" unescapes
    # on its own; a text with thousands of entities holds few distinct pieces.
    pieces = text.split("&")
    first = pieces.pop(0)
    distinct = set(pieces)
    if 3 * len(distinct) > count:
        return html.unescape(text)
    done = {piece: html.unescape("&" + piece) for piece in distinct}
    return first + "".join(map(done.__getitem__, pieces))


def _strip_lines(text: str) -> str:
    """``"\\n".join(line.strip() for line in text.split("\\n"))`` once _SPACES has collapsed every run."""
    if "\x85" in text or "\u2028" in text or "\u2029" in text:
        return _EDGE_SPACES.sub("", text)
    if " " not in text:
        return text
    # A space run is a single space by now, so at most one sits on each side of a newline.
    return text.replace(" \n", "\n").replace("\n ", "\n").strip(" ")


def _normalise(text: str) -> str:
    """Undo what renderers and terminals did; keep line breaks, collapse every other whitespace run."""
    if "&" in text:
        for _ in range(2):  # twice: issue trackers sometimes escape "&gt;" again as "&amp;gt;"
            unescaped = _unescape(text)
            if unescaped == text:
                break
            text = unescaped
    if "<" in text:
        text = _TAG_OTHERS.sub("", _TAG_BREAKS.sub("\n", text))
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    if "m" in text:
        text = _BARE_SGR.sub("", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    # Most text has single spaces only; a substitution that replaces each of them with itself costs
    # 30 ms per MiB for nothing.
    if "  " in text or "\t" in text or "\x0b" in text or "\x0c" in text or (
        not text.isascii() and _WIDE_SPACES.search(text) is not None
    ):
        text = _SPACES.sub(" ", text)
    text = _strip_lines(text)
    if ">" in text:
        start = _QUOTE_MARKERS.match(text)
        if start is not None:
            text = text[start.end():]
        text = _strip_lines(_LINE_QUOTE_MARKERS.sub("\n", text))
    return text


def _lower(text: str) -> str:
    """A lower-cased copy of the same length, for the finders and screens.

    The anchors fold case for ASCII letters only. Two other characters need care: the Kelvin sign
    lower-cases to an ASCII "k" (and would then fail a finder's "no letter before" check that its
    anchor passes), and "İ" lower-cases to two characters; both stand in as NUL, which no anchor
    treats as a letter either.
    """
    if text.isascii():
        return text.lower()
    if "\u212a" in text or "\u0130" in text:
        text = text.replace("\u212a", "\x00").replace("\u0130", "\x00")
    return text.lower()


# --------------------------------------------------------------------------------------------------
# Finding and reading the message.


def _message_start(m: re.Match[str]) -> int:
    return m.start("msg") if m.group("msg") is not None else m.end()


def _verify(det: _Detector, lined: str, hit: re.Match[str]) -> Optional[re.Match[str]]:
    """The anchor's match for one finder match, or None where the finder matched more than the anchor."""
    if not det.back:
        return det.anchor.match(lined, hit.start())
    end = lined.find("\n", hit.end())
    found = None
    for m in det.anchor.finditer(lined, max(0, hit.start() - det.back), len(lined) if end < 0 else end):
        if m.start() > hit.start():
            break
        found = m
    return found


def _last_match(det: _Detector, lined: str, low: str, lo: int, hi: int) -> Optional[re.Match[str]]:
    """The anchor's last match starting in [lo, hi): the one ``finditer`` would list last."""
    recent: Deque[re.Match[str]] = deque(maxlen=8)
    for hit in det.finder.finditer(low, lo):
        if hit.start() >= hi:
            break
        recent.append(hit)
    seen_all = len(recent) < 8
    while recent:
        m = _verify(det, lined, recent.pop())
        if m is not None and lo <= m.start() < hi:
            return m
    if seen_all:
        return None
    # Eight finder matches in a row that the anchor rejects: settle it with the anchor itself.
    last = None
    for m in det.anchor.finditer(lined, lo):
        if m.start() >= hi:
            break
        last = m
    return last


def _best_anchor(lined: str, low: str, lo: int, hi: int) -> Optional[Tuple[_Detector, re.Match[str]]]:
    """The richest message family starting in [lo, hi); within it, the last occurrence (the one finally
    raised)."""
    best: Optional[Tuple[Tuple[int, int, int], _Detector, re.Match[str]]] = None
    for order, det in enumerate(_DETECTORS):
        if best is not None and det.rank > best[0][0]:
            break  # detectors are sorted by rank
        last = _last_match(det, lined, low, lo, hi)
        if last is None:
            continue
        key = (det.rank, -_message_start(last), order)
        if best is None or key < best[0]:
            best = (key, det, last)
    return None if best is None else (best[1], best[2])


def _window_end(lined: str, low: str, det: _Detector, start: int, anchor_end: int) -> int:
    """Where the message can end at the latest: a blank line, a traceback line, a new log record or
    the next message."""
    limit = min(len(lined), start + _WINDOW_CAP)
    for other in _DETECTORS:
        # The finder only rules detectors out cheaply; the cut itself comes from the anchor.
        if other.cuts and other.finder.search(low, anchor_end, limit) is not None:
            nxt = other.anchor.search(lined, anchor_end, limit)
            if nxt is not None:
                limit = min(limit, nxt.start())
    pos = lined.find("\n", anchor_end, limit)
    while pos != -1:
        nxt_nl = lined.find("\n", pos + 1, limit)
        line = lined[pos + 1: nxt_nl if nxt_nl != -1 else limit]
        if not line:
            resumed = _resume_after_blank(lined, det, pos, limit)
            if resumed is None:
                return pos
            nxt_nl = resumed
        elif _STOP_LINE.match(line[:200]):
            return pos
        pos = nxt_nl
    return limit


def _resume_after_blank(lined: str, det: _Detector, pos: int, limit: int) -> Optional[int]:
    """The newline before the next text line when that line continues ``det``'s message, else None."""
    if det.resumes is None:
        return None
    blank = pos + 1
    for _ in range(3):  # at most two blank lines in a row
        if blank >= limit or lined[blank] != "\n":
            break
        blank += 1
    else:
        return None
    if blank >= limit or not det.resumes.match(lined, blank, min(limit, blank + 200)):
        return None
    return blank - 1


def _exception_type(lined: str, line_start: int, start: int) -> Optional[str]:
    before = lined[max(line_start, start - 200): start]
    m = _EXCEPTION_BEFORE.search(before)
    if m is not None:
        return m.group(1)
    if before.strip() or line_start == 0:
        return None
    # The message may start on the line after its type: "RuntimeError: TensorStorage ...\ncuda failed".
    prev_start = lined.rfind("\n", 0, line_start - 1) + 1
    m = _EXCEPTION_LINE.match(lined[prev_start: min(line_start, prev_start + 200)])
    return m.group(1) if m is not None else None


def _build(det: _Detector, m: re.Match[str], lined: str, low: str) -> OomReport:
    start = _message_start(m)
    line_start = lined.rfind("\n", 0, start) + 1
    prefix = lined[max(line_start, start - 400): start]
    if det.lead is not None:
        lead = det.lead.search(prefix)
        if lead is not None:
            start -= len(prefix) - lead.start()
            prefix = prefix[: lead.start()]
    anchor_end = max(m.end(), start)
    window = _Window(lined[start: _window_end(lined, low, det, start, anchor_end)])
    found = det.parse(window, m, prefix)

    end = max([anchor_end - start] + window.ends)
    window.tails(*found.pop("tails", ()))
    if window.tail_end is not None:
        end = max(end, window.tail_end)
    else:  # unknown ending: the rest of the line still belongs to the message
        eol = window.text.find("\n", end)
        eol = min(len(window.text) if eol == -1 else eol, end + _EXTEND_CAP)
        stop = _EXTEND_STOP.search(window.text, end, eol)
        end = stop.start() if stop is not None else eol
    message = _WHITESPACE.sub(" ", window.text[:end]).strip()
    opener = lined[start - 1] if start > 0 else ""
    if opener and opener in "\"'`":  # quoted, or a repr such as RuntimeError('...')
        for closing in (opener + ")", opener):
            if message.endswith(closing):
                message = message[: -len(closing)].rstrip()
                break

    exception_type = m.group("etype") if "etype" in m.re.groupindex else None
    if exception_type is None:
        exception_type = _exception_type(lined, line_start, start)
    if not message and exception_type:  # "MemoryError", "MemoryError: ", "MemoryError()": the name is all
        message = exception_type

    hint_positions = sorted((pos, name) for name, rx in _HINTS for pos in [_first(rx, message)] if pos >= 0)
    found.setdefault("kind", det.kind)
    found.setdefault("device_type", det.device_type)
    found.setdefault("confidence", det.confidence)
    return OomReport(
        message=message,
        exception_type=exception_type,
        hints=tuple(name for _, name in hint_positions),
        **found,
    )


def _first(rx: re.Pattern[str], text: str) -> int:
    m = rx.search(text)
    return -1 if m is None else m.start()


class _Region:
    """Part of the raw text, cleaned up with some context around it, and the best message in it.

    The cuts fall just after a newline wherever one is near, so cleaning the parts one by one gives
    the same text as cleaning them together; ``lo:hi`` is where the part itself lies in ``lined``.
    """

    def __init__(self, raw: str, core_lo: int, core_hi: int):
        self.core_lo = core_lo
        ctx_lo = _line_start(raw, core_lo - _CONTEXT_BEFORE)
        ctx_hi = _line_end(raw, core_hi + _CONTEXT_AFTER)
        before = _normalise(raw[ctx_lo:core_lo])
        core = _normalise(raw[core_lo:core_hi])
        self.lined = before + core + _normalise(raw[core_hi:ctx_hi])
        self.lo, self.hi = len(before), len(before) + len(core)
        self.low = _lower(self.lined)
        self.found = _best_anchor(self.lined, self.low, self.lo, self.hi)

    def key(self) -> Tuple[int, int, int]:
        """Smaller is better: the richer family, then the later message in the whole text."""
        assert self.found is not None
        det, m = self.found
        return (det.rank, -self.core_lo, -_message_start(m))

    def report(self) -> OomReport:
        assert self.found is not None
        return _build(self.found[0], self.found[1], self.lined, self.low)

    def joined(self) -> Optional[OomReport]:
        """A terminal copy can wrap inside the anchor words themselves ("CUDA out of mem\\nory")."""
        if "\n" not in self.lined:
            return None
        lined = self.lined.replace("\n", "")
        low = _lower(lined)
        found = _best_anchor(lined, low, 0, len(lined))
        return None if found is None else _build(found[0], found[1], lined, low)


def _line_start(raw: str, pos: int) -> int:
    """The start of the line holding ``pos``, or ``pos`` itself when that line is very long."""
    if pos <= 0:
        return 0
    nl = raw.rfind("\n", max(0, pos - _LINE_SLACK), pos)
    return nl + 1 if nl >= 0 else (0 if pos <= _LINE_SLACK else pos)


def _line_end(raw: str, pos: int) -> int:
    """Just past the end of the line holding ``pos``, or ``pos`` itself when that line is very long."""
    if pos >= len(raw):
        return len(raw)
    nl = raw.find("\n", pos, pos + _LINE_SLACK)
    return nl + 1 if nl >= 0 else min(len(raw), pos)


# --------------------------------------------------------------------------------------------------
# Screens for long text: where a message may be, found without reading the text closely. Each is a
# literal searched for from the end with str.rfind (0.1-0.6 ms per MiB), and for some a regex that
# checks the words around it. They run on a lower-cased copy of the raw text in which newlines, tabs
# and carriage returns are spaces, so a hard-wrapped message still reads "out of memory". They check
# about as much as the anchors do, so that a megabyte of near misses ("xcuda out of memory") cannot
# use up the candidates read per text (_WINDOWS), and they are grouped by rank, so that a log full of
# one family's lines never stops the search for a richer family further up.
#
# Every family has a screen. What no screen finds is a message spelled with other than single spaces
# between its words (or none), split inside a word, or with markup inside it; the text is read in full
# where those copies come from: all of it up to 32 KiB (128 KiB with little markup), and the last
# 16 KiB of longer text. A screen that ``needs`` a word is skipped, after one substring test, in text
# without it.


@dataclass(frozen=True)
class _ScreenDef:
    literal: str
    check: Optional[re.Pattern[str]] = None  # starts with the literal; None: the literal is enough
    # The same check for the reversed text, so that a run of occurrences that the check rejects (a
    # megabyte of "error: out of memory" for the rank-0 screen) costs one regex search, not a Python
    # call per occurrence.
    reverse: Optional[re.Pattern[str]] = None
    # Or the check split by the words before the literal: each alternative starts with a literal of its
    # own, and one that is not "memoryerror" skips a megabyte of inline "MemoryError" in no time.
    spelled: Tuple[re.Pattern[str], ...] = ()
    lines: bool = False  # search the lower-cased copy that keeps its newlines
    needs: Tuple[str, ...] = ()  # skip unless the text holds one of these (one cheap test, many screens)
    # Skip unless the text holds each of the literal's characters. A one-character test is a memchr
    # (0.01 ms per MiB), while searching a megabyte made of the literal's own letters ("ooo...") for
    # the literal takes up to 0.6 ms, for each screen.
    chars: Tuple[str, ...] = ()


def _screen(literal: str, check: Optional[str] = None, reverse: Optional[str] = None,
            spelled: Tuple[str, ...] = (), lines: bool = False, needs: Tuple[str, ...] = ()) -> _ScreenDef:
    return _ScreenDef(literal, None if check is None else re.compile(check, re.ASCII),
                      None if reverse is None else re.compile(reverse, re.ASCII),
                      tuple(re.compile(source, re.ASCII) for source in spelled), lines, needs,
                      tuple(sorted(set(literal))))


_MEM = ("memory",)
_ALLOC = ("alloc",)


def _after(words: Tuple[str, ...], literal: str) -> str:
    """Lookbehinds: ``literal`` right after one of ``words``; a final colon in one is spelled ": ", ":"
    or " : ", the spacings seen in real messages."""
    spelled = [w[:-1] + sep if w.endswith(":") else w for w in words
               for sep in ((": ", ":", " : ") if w.endswith(":") else ("",))]
    return "|".join(f"(?<={re.escape(w + literal)})" for w in spelled)


_SCREENS: Tuple[Tuple[_ScreenDef, ...], ...] = (
    (  # rank 0
        # "CUDA out of memory" and the other allocators (not "xcuda out of memory"), MPS, ggml's
        # "cudaMalloc failed: out of memory", ONNX Runtime's "CUDA failure 2: out of memory", spconv's
        # "cuda failed with error 2 out of memory", XLA's "RESOURCE_EXHAUSTED: Out of memory".
        _screen(
            "out of memory",
            r"out of memory(?:" + "|".join(
                rf"(?<={dev} out of memory)(?<![a-z]{dev} out of memory)"
                for dev in ("cuda", "hip", "xpu", "npu", "mlu", "musa"))
            + "|" + _after(("mps backend ", "cudamalloc failed:", "failure 2:", "with error 2 ", "with error 2:",
                            "resource exhausted:", "resource_exhausted:"), "out of memory") + ")",
            r"yromem fo tuo(?: (?:(?:aduc|pih|upx|upn|ulm|asum)(?![a-z])|dnekcab spm|2 rorre htiw)"
            r"|(?: :| : |:)(?:deliaf collamaduc|2 eruliaf|2 rorre htiw|detsuahxe[ _]ecruoser))",
            needs=_MEM,
        ),
        _screen("out of memory allocating", r"out of memory allocating [0-9]", needs=_MEM),  # CuPy
        _screen("allocation on device", r"allocation on device (?:[0-9]+ )?would exceed allowed memory",
                needs=_MEM),  # cudaMallocAsync
        _screen("allocator (", r"allocator \([^)]{1,40}\) ran out of memory", needs=_MEM),  # TensorFlow's BFC
        _screen("cuda error 2 at", r"cuda error 2 at [^ ]{1,200}? ?: ?out of memory", needs=_MEM),  # ggml
        _screen("cumem", r"cumem[a-z_0-9]{0,20} ?failed ?: ?out of memory", needs=_MEM),  # the driver API
        _screen("defaultcpuallocator", r"defaultcpuallocator ?: ?(?:can.?t allocate memory|not enough memory)"),
        _screen("not enough memory", r"not enough memory(?:" + _after(("torch:",), "not enough memory") + ")",
                needs=_MEM),  # TH
        _screen("unable to ", r"unable to (?:allocate (?:[0-9][0-9.]* ?[a-z]{0,5} for an )?array"
                r"|mmap [0-9]+ bytes from file <[^<>]{0,1000}> ?: ?cannot allocate memory)"),  # numpy, MapAllocator
        _screen("oom when allocating", needs=_ALLOC),  # TensorFlow, also behind "Resource exhausted: OOM"
        _screen("failed to alloc", r"failed to alloc(?:ate)? (?:[0-9][0-9.]* ?[a-z]{0,5} (?:on |\([0-9]+ bytes\) from)"
                r"|request for|memory for requested|memory(?<=: failed to allocate memory))", needs=_ALLOC),
        _screen("nccl warn ", r"nccl warn (?:cuda failure (?:[0-9]+ )?[^ ]{0,6}out of memory|failed to cuda calloc)",
                needs=_MEM + _ALLOC),
        _screen("could not allocate tensor with", r"could not allocate tensor with [0-9]", needs=_ALLOC),  # DirectML
        _screen("curesult error", r"curesult error(?: result ?=| ?:) ?2(?![0-9])"),  # torch_memory_saver
    ),
    (  # rank 1
        # An allocator message without its first sentence.
        _screen("has a total capac", r"has a total capaci?ty of [0-9][0-9.]* ?[a-z]{0,5} of which"),
        _screen("(gpu ", r"\(gpu [0-9]+ ?; ?[0-9][0-9.]* ?[a-z]{0,5} total capacity"),
        _screen("(npu ", r"\(npu [0-9]+ ?; ?[0-9][0-9.]* ?[a-z]{0,5} total capacity"),
        # "CUDA error: out of memory" (HIP, the driver API), THC's "cuda runtime error (2) : out of
        # memory" and "THCudaCheck FAIL ... error=2 : out of memory".
        _screen(
            "out of memory",
            r"out of memory(?:" + _after(("cuda error:", "hip error:", "driver error:", "(2):", "error=2:",
                                          "error = 2:"), "out of memory") + ")",
            r"yromem fo tuo(?: :| : |:)(?:rorre (?:aduc|pih|revird)|\)2\( rorre emitnur|2=rorre|2 = rorre)",
            needs=_MEM,
        ),
        _screen("out of memory: kill", r"out of memory: kill(?:ed)? process [0-9]", needs=_MEM),  # the OOM killer
        _screen("allocate memory", r"allocate memory(?:" + _after(("errno 12] cannot ", "errno 12]cannot "),
                                                                 "allocate memory") + ")", needs=_MEM),
        # cuBLAS, hipBLAS, cuDNN, cuSOLVER, cuSPARSE, cuRAND, cuFFT.
        _screen("alloc_failed", r"alloc_failed(?:(?<=status_alloc_failed)|(?<=cufft_alloc_failed))", needs=_ALLOC),
        _screen("statusallocfailed", needs=_ALLOC),  # MIOpen
        _screen("status_not_enough_memory", needs=_MEM),  # cuDNN
        _screen("posix_memalign(", r"posix_memalign\(&data, ?galignment, ?nbytes\) ?== ?0\. ?12 vs 0"),  # torch < 1.2
        _screen("error_out_of_", r"error_out_of_(?:(?<=ur_result_error_out_of_)(?:device|host)_memory"
                r"|(?<=pi_error_out_of_)host_memory|(?<=ze_result_error_out_of_)(?:device|host)_memory)"),  # Intel
    ),
    (  # rank 2
        _screen("std::bad_alloc", needs=_ALLOC),
        _screen("cuda_error_out_of_memory", needs=_MEM),
        _screen("cudaerrormemoryallocation", needs=_MEM),
        _screen("hiperroroutofmemory", needs=_MEM),
        # An exception line: at a line's start, or after the indentation of a code block or a quote.
        _screen("memoryerror",
                r"memoryerror(?:(?<![^\n]memoryerror)|(?<=\n    memoryerror)|(?<=\n> memoryerror)"
                r"|(?<=\nbuiltins\.memoryerror))(?: ?:|\(\)|[ \t\r]*(?:\n|\Z))",
                spelled=tuple(re.escape(line_start) + r"memoryerror(?: ?:|\(\)|[ \t\r]*(?:\n|\Z))"
                              for line_start in ("\n", "\n    ", "\n> ", "\nbuiltins.")),
                lines=True, needs=_MEM),
    ),
    (  # rank 3
        _screen("dataloader worker", r"dataloader worker (?:\(pid [0-9]+\) )?is killed by signal ?: ?killed"),
        _screen("valid cudnn algorithm to run convolution"),
        _screen("blas_status_not_initialized"),
        _screen("error_out_of_resources", r"error_out_of_resources(?:(?<=ur_result_error_out_of_resources)"
                r"|(?<=pi_error_out_of_resources))"),
    ),
)
_SKELETON = str.maketrans({**{c: c.lower() for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"},
                           "\n": " ", "\r": " ", "\t": " ", "\x0b": " ", "\x0c": " "})
_NEAR_MISSES = 16  # occurrences a check may reject one by one before a regex takes over


class _Screen:
    """Candidates in ``raw[:end]``, searched from the end; what each screen found is kept, since the
    search only ever moves towards the start. Once one screen of a rank has a candidate, the others
    only search the text after it (their floor), where they could still beat it."""

    def __init__(self, raw: str, end: int):
        self.raw = raw
        self.end = end
        self._texts: Dict[Tuple[bool, bool], str] = {}
        self._has: Dict[Tuple[str, bool], bool] = {}
        # screen -> (its last match below the ``hi`` asked for, or None for none at or above ``floor``)
        self._last: Dict[_ScreenDef, Tuple[Optional[Tuple[int, int]], int]] = {}

    def _text(self, lines: bool, reverse: bool = False) -> str:
        text = self._texts.get((lines, reverse))
        if text is None:
            if reverse:
                text = self._text(lines)[::-1]
            elif lines:
                text = _lower(self.raw[: self.end])
            else:
                part = self.raw[: self.end]
                if part.isascii():  # one pass: translate has a fast path for ASCII, and only for it
                    text = part.translate(_SKELETON)
                else:
                    text = self._text(True).replace("\n", " ").replace("\r", " ").replace("\t", " ")
            self._texts[(lines, reverse)] = text
        return text

    def last(self, rank: int, hi: int) -> Optional[Tuple[int, int]]:
        """The last candidate of ``rank`` starting before ``hi``, as (start, end)."""
        best = None
        for screen in _SCREENS[rank]:
            hit = self._last_of(screen, hi, 0 if best is None else best[0] + 1)
            if hit is not None and hit[0] < hi and (best is None or hit[0] > best[0]):
                best = hit
        return best

    def _holds(self, needle: str, lines: bool) -> bool:
        key = (needle, lines)
        if key not in self._has:
            # Its letters first: a missing one is found at memchr speed, the word itself can take 2 ms
            # in a megabyte made of its other letters.
            self._has[key] = all(self._holds(c, lines) for c in set(needle)) if len(needle) > 1 else True
            self._has[key] = self._has[key] and needle in self._text(lines)
        return self._has[key]

    def _needed(self, screen: _ScreenDef) -> bool:
        if not all(self._holds(char, screen.lines) for char in screen.chars):
            return False
        return not screen.needs or any(self._holds(needle, False) for needle in screen.needs)

    def _last_of(self, screen: _ScreenDef, hi: int, floor: int) -> Optional[Tuple[int, int]]:
        """The screen's last match starting before ``hi``; None if there is none at or above ``floor``."""
        if screen in self._last:
            known, known_floor = self._last[screen]
            if known is not None and known[0] < hi:
                return known
            if known is None and known_floor <= floor:
                return None
        found = None
        if self._needed(screen):
            text = self._text(screen.lines)
            literal, check = screen.literal, screen.check
            end = min(len(text), hi - 1 + len(literal))  # an occurrence must start before hi
            for _ in range(_NEAR_MISSES):
                pos = text.rfind(literal, floor, end)
                if pos < 0:
                    break
                m = None if check is None else check.match(text, pos)
                if check is None or m is not None:
                    found = (pos, pos + len(literal) if m is None else m.end())
                    break
                end = pos + len(literal) - 1
            else:  # a run of near misses: let the regex engine reject the rest
                found = self._scan_back(screen, text, end - len(literal) + 1, floor)
        self._last[screen] = (found, floor)
        return found

    def _scan_back(self, screen: _ScreenDef, text: str, stop: int, floor: int) -> Optional[Tuple[int, int]]:
        """The last match of the screen's check starting in [floor, stop)."""
        if screen.spelled:
            hits = [hit for hit in (self._scan_forward(rx, text, stop, floor) for rx in screen.spelled) if hit]
            return max(hits) if hits else None
        if screen.reverse is not None:
            rev = self._text(screen.lines, reverse=True)
            # In the reversed text the check reads the words before the literal; its first match from
            # where ``stop`` lands is the last one before ``stop``.
            m = screen.reverse.search(rev, len(text) - stop - len(screen.literal) + 1, len(text) - floor)
            if m is None:
                return None
            return len(text) - m.start() - len(screen.literal), len(text) - m.start()
        assert screen.check is not None
        return self._scan_forward(screen.check, text, stop, floor)

    @staticmethod
    def _scan_forward(rx: re.Pattern[str], text: str, stop: int, floor: int = 0) -> Optional[Tuple[int, int]]:
        """The last match of ``rx`` starting in [floor, stop), read forwards a chunk at a time from the end."""
        while stop > floor:
            lo = max(floor, stop - _SCREEN_CHUNK)
            last = None
            for m in rx.finditer(text, lo, min(len(text), stop + _SCREEN_OVERLAP)):
                if m.start() >= stop:
                    break
                last = m
            if last is not None:
                return last.start(), last.end()
            stop = lo
        return None


def _parse_long(raw: str) -> Optional[OomReport]:
    """Long text: the last 16 KiB in full, then the screens' candidates from the end, richest family
    first, until one is a message of the family searched for or _WINDOWS candidates have been read."""
    tail_lo = _line_start(raw, len(raw) - _TAIL)
    tail = _Region(raw, tail_lo, len(raw))
    best = tail if tail.found is not None else None
    screen = _Screen(raw, tail_lo)
    windows = _WINDOWS
    for rank in range(best.found[0].rank if best is not None else _RANKS):
        hi = tail_lo
        while windows > 0:
            hit = screen.last(rank, hi)
            if hit is None:
                break
            windows -= 1
            # From the line before the candidate (a hard-wrapped anchor starts up there) to the end of
            # its own line; the region adds the context the message and its type need.
            core_lo = _line_start(raw, max(0, hit[0] - _SCREEN_BACK))
            window = _Region(raw, core_lo, min(hi, _line_end(raw, hit[1])))
            if window.found is not None and (best is None or window.key() < best.key()):
                best = window
            if best is not None and best.found[0].rank <= rank:
                break
            hi = core_lo
        if best is not None and best.found[0].rank <= rank:
            break
    if best is not None:
        return best.report()
    return tail.joined()


def _markup(text: str) -> int:
    """About how many substitutions cleaning ``text`` up takes: the cost that grows with markup."""
    return (text.count("&") + text.count("<") + text.count("\x1b") + text.count("[") + text.count("\t")
            + text.count("  ") + text.count("\n>"))


def _parse(text: Any) -> Optional[OomReport]:
    raw = _coerce(text)
    if not raw:
        return None
    # Text up to 128 KiB is read as a whole, as the old parser read it, unless cleaning it up would
    # take a substitution per character or two (a flood of entities, tags or colour codes).
    if len(raw) > _EXACT_PLAIN or (len(raw) > _EXACT_ALL and _markup(raw) > _MARKUP_CAP):
        return _parse_long(raw)
    region = _Region(raw, 0, len(raw))
    if region.found is not None:
        return region.report()
    return region.joined()


def parse_oom(text: Any) -> Optional[OomReport]:
    """Find an out-of-memory message anywhere in ``text`` and read what it says.

    ``text`` may be a bare message, a whole traceback or log, with log prefixes, ANSI colours, HTML
    escapes, markdown quotes, hard wraps, collapsed whitespace or a truncated end. Up to 1 MiB is read
    (beyond that, the first 64 KiB and the rest from the end); see the module docstring for which
    copies are found in the middle of long text. When several messages are present the richest family
    wins (an allocator report over a bare ``CUDA error: out of memory``, any message that says it ran
    out of memory over one that only usually means it), and within it the last one.

    Python's ``MemoryError`` counts as a host (``"cpu"``) out-of-memory error: numpy's ``Unable to
    allocate 7.45 GiB for an array with shape ...`` gives ``requested``, and a bare ``MemoryError``
    line (the exception line of a traceback, with or without a message, or ``MemoryError()``) gives a
    report without numbers. The words "MemoryError" inside prose or source lines are ignored, and
    errors that merely mention memory (``an illegal memory access was encountered``) are not
    out-of-memory errors. ``DataLoader worker (pid N) is killed by signal: Killed.``, cuDNN's ``Unable
    to find a valid cuDNN algorithm to run convolution`` and ``CUBLAS_STATUS_NOT_INITIALIZED`` are
    reported with ``confidence`` ``"likely"`` or ``"possible"``.

    Args:
        text: Error text as ``str``, or ``bytes`` (decoded as UTF-8 with replacement).

    Returns:
        An :class:`OomReport`, or None when ``text`` is not text or holds no out-of-memory message.
        Never raises.

    Examples:
        >>> r = parse_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. "
        ...               "GPU 0 has a total capacity of 4.00 GiB of which 0 bytes is free.")
        >>> r.kind, r.requested, r.total, r.free, r.device, r.exception_type
        ('cuda_allocator', 20971520, 4294967296, 0, 'cuda:0', 'torch.OutOfMemoryError')
        >>> parse_oom("RuntimeError: CUDA error: an illegal memory access was encountered") is None
        True
        >>> parse_oom("RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed.").confidence
        'likely'
    """
    try:
        return _parse(text)
    except Exception:  # a bug here must never turn the user's one error into two
        return None
