"""Find an out-of-memory message in any pasted error text and read its numbers into an ``OomReport``.

Covers every PyTorch allocator generation (CUDA, HIP, XPU, MPS, CPU), the CUDA runtime, cuBLAS and cuDNN
errors, TensorFlow/XLA, and a few neighbouring runtimes (NCCL, ggml, spconv, DirectML, ONNX Runtime).
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..core.units import parse_bytes

__all__ = ["KINDS", "SIZE_FIELDS", "OomReport", "parse_oom"]

KINDS = (
    "cuda_allocator", "cuda_error", "cublas", "cudnn", "hip", "mps", "xpu", "cpu", "tensorflow", "other",
)

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
            type), HTML-unescaped, ANSI-free, every whitespace run collapsed to one space.
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

_SCAN_CAP = 64 * 1024  # scan the first and the last 64 KiB: messages sit at the end of a traceback
_WINDOW_CAP = 8000  # longest plausible message: a v5 message listing dozens of processes
_EXTEND_CAP = 400  # how far a message without a known ending may run on to the end of its line

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
)


def _parse_cpu(w: _Window, m: re.Match[str], prefix: str) -> Dict[str, Any]:
    """Host memory: c10's DefaultCPUAllocator, legacy TH, numpy, the OS."""
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
# Detectors. Each anchor is the most specific phrase of one message shape and starts with a literal,
# so scanning stays linear. ``lead`` (matched against the text just before the anchor on its line)
# moves the message start back over words that belong to the message but are too generic to search
# for. Rank 0 messages carry numbers; rank 1 are status errors; rank 2 are last-resort names.


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
              _parse_allocator, resumes=_ALLOC_RESUMES),
    _Detector("cuda_allocator", 0, _rx(r"(?P<msg>Allocation on device (?:[0-9]+ )?would exceed allowed memory)"),
              _parse_async, "cuda", resumes=_ASYNC_RESUMES),
    _Detector("mps", 0, _rx(r"(?P<msg>MPS backend out of memory)"), _parse_mps, "mps", resumes=_MPS_RESUMES),
    _Detector("cpu", 0, _rx(r"(?P<msg>DefaultCPUAllocator : (?:can.?t allocate memory|not enough memory))"),
              _parse_cpu, "cpu", _lead(_ENFORCE_LEAD)),
    _Detector("cpu", 0, _rx(r"(?P<msg>Torch : not enough memory)"), _parse_cpu, "cpu", _lead(r"\$")),
    _Detector("cpu", 0, _rx(r"(?P<msg>Unable to allocate (?:{SIZE} for an )?array)"), _parse_cpu, "cpu"),
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
              _parse_allocator, lead=_lead(_TRIED_LEAD + r"\."), cuts=False, resumes=_ALLOC_RESUMES),
    _Detector("cuda_error", 1, _rx(r"(?P<msg>CUDA [Ee]rror : out of memory)"), _parse_cuda_error, "cuda",
              resumes=_ERROR_RESUMES),
    _Detector("cuda_error", 1, _rx(r"(?P<msg>cuda runtime error \(2\) : out of memory)"), _parse_cuda_error, "cuda"),
    _Detector("cuda_error", 1, _rx(r"(?P<msg>THCudaCheck FAIL[\s\S]{0,400}?error = 2 : out of memory)"),
              _parse_cuda_error, "cuda"),
    _Detector("cuda_error", 1, _rx(r"(?P<msg>CUDA driver error : out of memory)"), _parse_cuda_error, "cuda"),
    _Detector("cublas", 1, _rx(r"(?P<msg>(?:CUBLAS|HIPBLAS)_STATUS_ALLOC_FAILED)"), _parse_nothing, "cuda",
              _lead(r"CUDA error :")),
    _Detector("cudnn", 1, _rx(r"(?P<msg>CUDNN_STATUS_(?:ALLOC_FAILED|NOT_ENOUGH_MEMORY)|miopenStatusAllocFailed)"),
              _parse_nothing, "cuda", _lead(r"(?:cuDNN|MIOpen) error :")),
    _Detector("other", 1, _rx(r"(?P<msg>(?:CUSOLVER|CUSPARSE|CURAND)_STATUS_ALLOC_FAILED|CUFFT_ALLOC_FAILED)"),
              _parse_nothing, "cuda", _lead(r"(?:cuSOLVER|cuSPARSE|cuRAND|cuFFT) error :")),
    _Detector("hip", 1, _rx(r"(?P<msg>HIP error : out of memory)"), _parse_cuda_error, "cuda",
              resumes=_ERROR_RESUMES),
    _Detector("xpu", 1, _rx(r"(?P<msg>UR_RESULT_ERROR_OUT_OF_(?:RESOURCES|DEVICE_MEMORY|HOST_MEMORY))"),
              _parse_nothing, "xpu", _lead(r"UR backend failed\.[^\n]{0,60}?")),
    _Detector("xpu", 1, _rx(r"(?P<msg>PI_ERROR_OUT_OF_(?:RESOURCES|HOST_MEMORY))"), _parse_nothing, "xpu",
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
    # Python's own MemoryError only as a traceback's exception line, never in prose or source code.
    _Detector("cpu", 2, _rx(r"^(?P<etype>(?:builtins\.)?MemoryError)(?: : (?P<msg>[^\n]*))?$", re.MULTILINE),
              _parse_nothing, "cpu", cuts=False),
), key=lambda det: det.rank))

_HINTS = tuple(
    (name, re.compile(re.escape(name)))
    for name in ("expandable_segments", "max_split_size_mb", "PYTORCH_MPS_HIGH_WATERMARK_RATIO", "empty_cache",
                 "report_tensor_allocations_upon_oom")
)

# --------------------------------------------------------------------------------------------------
# Text clean-up.

_ANSI = re.compile(r"\x1b\[[0-?]{0,32}[ -/]{0,8}[@-~]|\x1b\][^\x07\x1b\n]{0,512}(?:\x07|\x1b\\)?|\x1b")
# Copies from rendered notebooks often lose the ESC byte but keep "[0;31m".
_BARE_SGR = re.compile(r"\[(?:[0-9]{1,3};){0,6}[0-9]{1,3}m")
_TAGS = re.compile(r"</?(br|p|div|pre|code|span|b|i|em|strong|tt|kbd|samp)\b[^<>\n]{0,200}>", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f\u200b-\u200d\u2060\ufeff]")
_SPACES = re.compile(r"[ \t\x0b\x0c\xa0\u1680\u2000-\u200a\u202f\u205f\u3000]+")
_QUOTE_MARKERS = re.compile(r"^(?:>(?!>) ?)+")  # markdown quotes, but not ">>>" prompts or ">>"

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
    """The text to scan, its middle dropped when huge; None for anything that is not text."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        data = bytes(text)
        if len(data) > 2 * _SCAN_CAP:
            data = data[:_SCAN_CAP] + b"\n\n" + data[-_SCAN_CAP:]
        return data.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        return None
    if len(text) > 2 * _SCAN_CAP:
        # The blank line keeps a message cut in half from being glued to unrelated text.
        text = text[:_SCAN_CAP] + "\n\n" + text[-_SCAN_CAP:]
    return str.__str__(text)  # a plain copy: a str subclass's own __str__ is not ours to call


def _normalise(text: str) -> str:
    """Undo what renderers and terminals did; keep line breaks, collapse every other whitespace run."""
    if "&" in text:
        for _ in range(2):  # twice: issue trackers sometimes escape "&gt;" again as "&amp;gt;"
            unescaped = html.unescape(text)
            if unescaped == text:
                break
            text = unescaped
    if "<" in text:
        text = _TAGS.sub(lambda m: "\n" if m.group(1).lower() in ("br", "p", "div") else "", text)
    text = _ANSI.sub("", text)
    text = _BARE_SGR.sub("", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    lines = []
    for line in text.split("\n"):
        line = _SPACES.sub(" ", line).strip()
        line = _QUOTE_MARKERS.sub("", line).strip()
        lines.append(line)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Finding and reading the message.


def _message_start(m: re.Match[str]) -> int:
    return m.start("msg") if m.group("msg") is not None else m.end()


def _best_anchor(lined: str) -> Optional[Tuple[_Detector, re.Match[str]]]:
    """The richest message family present; within it, the last occurrence (the one finally raised)."""
    best: Optional[Tuple[Tuple[int, int, int], _Detector, re.Match[str]]] = None
    for order, det in enumerate(_DETECTORS):
        if best is not None and det.rank > best[0][0]:
            break  # detectors are sorted by rank
        last = None
        for last in det.anchor.finditer(lined):
            pass
        if last is None:
            continue
        key = (det.rank, -_message_start(last), order)
        if best is None or key < best[0]:
            best = (key, det, last)
    return None if best is None else (best[1], best[2])


def _window_end(lined: str, det: _Detector, start: int, anchor_end: int) -> int:
    """Where the message can end at the latest: a blank line, a traceback line, a new log record or
    the next message."""
    limit = min(len(lined), start + _WINDOW_CAP)
    for other in _DETECTORS:
        if other.cuts:
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


def _build(det: _Detector, m: re.Match[str], lined: str) -> OomReport:
    start = _message_start(m)
    line_start = lined.rfind("\n", 0, start) + 1
    prefix = lined[max(line_start, start - 400): start]
    if det.lead is not None:
        lead = det.lead.search(prefix)
        if lead is not None:
            start -= len(prefix) - lead.start()
            prefix = prefix[: lead.start()]
    anchor_end = max(m.end(), start)
    window = _Window(lined[start: _window_end(lined, det, start, anchor_end)])
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

    hint_positions = sorted((pos, name) for name, rx in _HINTS for pos in [_first(rx, message)] if pos >= 0)
    found.setdefault("kind", det.kind)
    found.setdefault("device_type", det.device_type)
    return OomReport(
        message=message,
        exception_type=exception_type,
        hints=tuple(name for _, name in hint_positions),
        **found,
    )


def _first(rx: re.Pattern[str], text: str) -> int:
    m = rx.search(text)
    return -1 if m is None else m.start()


def _parse(text: Any) -> Optional[OomReport]:
    raw = _coerce(text)
    if not raw:
        return None
    lined = _normalise(raw)
    found = _best_anchor(lined)
    if found is None and "\n" in lined:
        # A terminal copy can wrap inside the anchor words themselves ("CUDA out of mem\nory").
        lined = lined.replace("\n", "")
        found = _best_anchor(lined)
    if found is None:
        return None
    return _build(found[0], found[1], lined)


def parse_oom(text: Any) -> Optional[OomReport]:
    """Find an out-of-memory message anywhere in ``text`` and read what it says.

    ``text`` may be a bare message, a whole traceback or log, with log prefixes, ANSI colours, HTML
    escapes, markdown quotes, hard wraps, collapsed whitespace or a truncated end; only the first and
    last 64 KiB of huge input are scanned. When several messages are present the richest family wins
    (an allocator report over a bare ``CUDA error: out of memory``), and within it the last one.

    Python's ``MemoryError`` counts as a host (``"cpu"``) out-of-memory error: numpy's ``Unable to
    allocate 7.45 GiB for an array with shape ...`` gives ``requested``, and a bare ``MemoryError``
    line (the exception line of a traceback, with or without a message) gives a report without
    numbers. The words "MemoryError" inside prose or source lines are ignored, and errors that merely
    mention memory (``an illegal memory access was encountered``) are not out-of-memory errors.

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
    """
    try:
        return _parse(text)
    except Exception:  # a bug here must never turn the user's one error into two
        return None
