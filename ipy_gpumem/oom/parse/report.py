"""What one out-of-memory message says: :class:`OomReport`, and the names its fields take.

A frozen dataclass with one field per number a message can print, each None when the message omits
it, so that a report reads the same whatever generation of message it came from; what several
generations print differently (reserved memory, the cached bytes) is derived by its properties.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Tuple

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
