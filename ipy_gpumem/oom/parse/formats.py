"""Field parsers, one per message family: which numbers each family's message prints, read into report fields.

Each field has its own search, so a missing, reordered or extra clause costs only that field. Every
parser takes the message's window, its anchor match and the text before the anchor on its line, and
returns the report's fields (and, under ``"tails"``, the sentences that may end the message).
"""
from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple

from .numbers import bytes_of, regex, MessageWindow

_REQ_TRIED = regex(r"Tried to allocate {SIZE}")
_ALLOC_GPU = regex(r"(?:GPU|NPU|MLU|MUSA|XPU) {INT}(?= (?:;|has|\(|,))")
_TOTAL_NEW = regex(r"total capaci?ty of {SIZE}")  # torch 2.1 printed "capacty"
_TOTAL_OLD = regex(r"{SIZE} total capacity")
_FREE_NEW = regex(r"of which {SIZE} is free")
_FREE_OLD = regex(r"{SIZE} free(?!d)")
_ALLOCATED_NEW = regex(r"allocated memory {SIZE} is allocated")
_ALLOCATED_OLD = regex(r"{SIZE} already allocated")
_RESERVED_OLD = regex(r"{SIZE} reserved in total")
_UNALLOCATED_NEW = regex(r"{SIZE} is reserved by")
_CACHED_OLD = regex(r"{SIZE} cached")  # 0.4-1.3: cached = reserved - allocated
_THIS_PROCESS = regex(r"this process has {SIZE}")
_OTHER_PROCESS = regex(r"(?<![A-Za-z])Process (?P<pid>[0-9]+) has {SIZE}")
_ALLOWED = regex(r"{SIZE} allowed")
_PRIVATE_POOLS = regex(r"{SIZE} allocated in private")
_ALLOC_TAILS = (
    regex(r"environment-(?:\s)?variables\)\.?"),
    regex(r"PYTORCH_[A-Z]+_ALLOC_CONF(?![=\w])\.?"),
    regex(r"cached memory\.?"),
    # v1/v2 end at the parenthesis; v3 goes on with its hint, which a truncation may have cut.
    regex(r"(?:reserved in total by PyTorch|cached|inactive)\)\.?(?! If)"),
)
_DEVICE_TYPES = {"CUDA": "cuda", "HIP": "cuda", "XPU": "xpu", "NPU": "npu", "MLU": "mlu", "MUSA": "musa"}
_ALLOC_KINDS = {"CUDA": "cuda_allocator", "GPU": "cuda_allocator", "HIP": "hip", "XPU": "xpu"}


def parse_allocator(w: MessageWindow, m: re.Match[str], prefix: str) -> Dict[str, Any]:
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


def _processes(w: MessageWindow) -> Tuple[Tuple[int, int], ...]:
    found = []
    for m in _OTHER_PROCESS.finditer(w.text):
        value = bytes_of(m)
        if value is not None:
            found.append((int(m.group("pid")), value))
            w.ends.append(m.end())
    if "\n" in w.text:
        # A terminal wrap inside one line hides only that process from the search above.
        unwrapped = [(int(m.group("pid")), bytes_of(m)) for m in _OTHER_PROCESS.finditer(w.joined)]
        if len(unwrapped) > len(found) and all(value is not None for _, value in unwrapped):
            return tuple(unwrapped)  # type: ignore[arg-type]
    return tuple(found)


_ASYNC_GPU = regex(r"Allocation on device {INT} would")
_ASYNC_ALLOCATED = regex(r"Currently allocated :? {SIZE}")
_ASYNC_REQUESTED = regex(r"Requested :? {SIZE}")
_ASYNC_TOTAL = regex(r"Device limit :? {SIZE}")
_ASYNC_FREE = regex(r"Free \([^)]{0,40}\) : {SIZE}")
_ASYNC_LIMIT = regex(r"PyTorch limit[^:]{0,80}: {SIZE}")  # its label wraps onto a second line


def parse_async(w: MessageWindow, m: re.Match[str], prefix: str) -> Dict[str, Any]:
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


_MPS_ALLOCATED = regex(r"MPS allocated :? {SIZE}")
_MPS_OTHER = regex(r"other allocations :? {SIZE}")
_MPS_MAX = regex(r"max allowed :? {SIZE}")
_MPS_POOL = regex(r"on (?P<pool>shared|private) pool")
_MPS_TAILS = (regex(r"\(may cause system failure\)\.?"), regex(r"on (?:shared|private) pool\.?(?! Use)"))


def parse_mps(w: MessageWindow, m: re.Match[str], prefix: str) -> Dict[str, Any]:
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
    regex(r"you tried to (?:re)?allocate {SIZE}"),  # DefaultCPUAllocator and TH's "72GB" (a floor)
    regex(r"Unable to allocate {SIZE}"),  # numpy's _ArrayMemoryError
    regex(r"unable to mmap (?P<n>[0-9]+)(?![0-9]) (?P<u>bytes)"),  # torch's MapAllocator
)


def parse_cpu(w: MessageWindow, m: re.Match[str], prefix: str) -> Dict[str, Any]:
    """Host memory: c10's DefaultCPUAllocator, legacy TH, MapAllocator, numpy, the OS."""
    return {"requested": w.size(*_CPU_REQUESTED)}


_TF_REQUESTED = (
    regex(r"\(rounded to (?P<n>[0-9]+)(?P<u>)\)"),  # the exact bin size beats the 3-digit label
    regex(r"ran out of memory trying to allocate {SIZE}"),
    regex(r"failed to alloc {SIZE} on"),
    regex(r"\((?P<n>[0-9]+) (?P<u>bytes)\) from device"),
    regex(r"failed to allocate (?P<n>[0-9]+(?:\.[0-9]*)?)(?P<u>[KMGTPE]i?B?|B)(?= [(:])"),
    regex(r"Out of memory while trying to allocate {SIZE}"),
    regex(r"Failed to allocate request for [^(]{0,24}\((?P<n>[0-9]+)(?P<u>B)\)"),
)
_TF_GPU = (regex(r"device:GPU:{INT}"), regex(r"GPU_{INT}_bfc"), regex(r"device ordinal {INT}"))
_TF_HOST = regex(r"on host|device:CPU:|by allocator (?:cpu|mklcpu)|Allocator \((?:cpu|mklcpu|\w*host\w*)\)")
_TF_GPU_WORD = regex(r"GPU|from device")
_TF_HINT = regex(r"report_tensor_allocations_upon_oom[^.\n]{0,80}\.?")


def parse_tensorflow(w: MessageWindow, m: re.Match[str], prefix: str) -> Dict[str, Any]:
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
    regex(r"Could not allocate tensor with {SIZE}"),  # torch-directml
    regex(r"requested buffer of size (?P<n>[0-9]+)(?P<u>)(?![0-9.])"),  # ONNX Runtime BFCArena
    regex(r"CUDA calloc(?: async)? {SIZE}"),  # NCCL
    regex(r"allocating {SIZE} on device"),  # ggml
    regex(r"Out of memory allocating (?P<n>[0-9][0-9,]*) (?P<u>bytes)"),  # CuPy
)
_OTHER_GPU = (
    regex(r"current device : {INT} ,"),  # ggml >= 2024
    regex(r"on device {INT} :"),  # ggml buffer allocation
    regex(r"GPU = {INT}"),  # ONNX Runtime CUDA_CALL
)
# NCCL's log line is "host:pid:tid [dev] file:line NCCL WARN ...": the device sits before the anchor.
_NCCL_DEVICE = re.compile(r"\[([0-9]+)\]\s?[^\s\[\]]*:[0-9]+\s?$", re.ASCII)


def parse_other(w: MessageWindow, m: re.Match[str], prefix: str) -> Dict[str, Any]:
    """Other runtimes: NCCL, ggml, spconv, DirectML, ONNX Runtime, CuPy, torch_memory_saver..."""
    gpu_index = w.integer(*_OTHER_GPU)
    if gpu_index is None and m.group("msg").upper().startswith("NCCL"):
        nccl = _NCCL_DEVICE.search(prefix)
        gpu_index = int(nccl.group(1)) if nccl is not None else None
    return {"requested": w.size(*_OTHER_REQUESTED), "gpu_index": gpu_index}


# Sentences that may close a CUDA status error. None is reliably the last (each torch version adds or
# drops one), so they only stretch the message; the rest of their line is then taken as well.
_CUDA_ERROR_ENDINGS = (
    regex(r"Compile with .?TORCH_USE_CUDA_DSA.? to enable device-side assertions\.?"),
    regex(r"consider passing CUDA_LAUNCH_BLOCKING=1\.?"),
    regex(r"for more information\."),
    regex(r"CUDA_LOG_FILE=stderr\.?"),
)
_GGML_DEVICE = regex(r"current device : {INT} , in function")


def parse_cuda_error(w: MessageWindow, m: re.Match[str], prefix: str) -> Dict[str, Any]:
    """``cudaErrorMemoryAllocation`` as reported by C10_CUDA_CHECK, THC or the driver API."""
    found = parse_nothing(w, m, prefix)
    gpu_index = w.integer(_GGML_DEVICE)
    if gpu_index is not None:
        # ggml prints the same "CUDA error: out of memory" line, then names the device.
        found.update(kind="other", gpu_index=gpu_index)
    return found


def parse_nothing(w: MessageWindow, m: re.Match[str], prefix: str) -> Dict[str, Any]:
    """Status-code errors (cuBLAS, cuDNN, HIP, UR...) carry no numbers."""
    for rx in _CUDA_ERROR_ENDINGS:
        w.search(rx)
    return {}
