"""Field parsers, one per message family: which numbers each family's message prints, read into report fields.

Each field has its own search, so a missing, reordered or extra clause costs only that field. Every
parser takes the message's window, its anchor match and the text before the anchor on its line, and
returns the report's fields (and, under ``"tails"``, the sentences that may end the message).
"""
from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple

from .numbers import _bytes_of, _rx, _Window

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
