"""``parse_oom``: the real-message corpus, hand-written formats, messy copies, non-OOM errors, errors that
are out-of-memory errors in disguise, long and adversarial text, properties."""
from __future__ import annotations

import dataclasses
import html
import json
import os
import random
import textwrap
from decimal import ROUND_HALF_UP, Decimal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipy_gpumem.oom.parse import CONFIDENCES, KINDS, SIZE_FIELDS, OomReport, parse_oom

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, above this room's folder
SAMPLES_PATH = os.path.join(HERE, "fixtures", "oom-samples.jsonl")

NUMBER_FIELDS = SIZE_FIELDS + ("gpu_index",)
_UNITS = {
    "bytes": 1, "B": 1, "KiB": 1024, "KB": 1024, "MiB": 1024**2, "MB": 1024**2, "GiB": 1024**3, "GB": 1024**3,
}


def B(text: str) -> int:
    """Bytes as the corpus computes them (independently of ipy_gpumem.core.units): binary, half up."""
    number, unit = text.split()
    return int((Decimal(number) * _UNITS[unit]).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def _load_samples():
    with open(SAMPLES_PATH, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


SAMPLES = _load_samples()
SAMPLE_IDS = [f"{s['variant']}@L{i}" for i, s in enumerate(SAMPLES, 1)]


def assert_report(report, kind, **expected):
    """``kind`` and every given number exactly; every number not given is None (or ())."""
    assert report is not None, "expected an OomReport, got None"
    assert isinstance(report, OomReport)
    assert report.kind == kind
    expected_processes = tuple(expected.pop("other_processes", ()))
    assert report.other_processes == expected_processes
    for name in NUMBER_FIELDS:
        assert getattr(report, name) == expected.get(name), name
    unknown = set(expected) - set(NUMBER_FIELDS)
    assert not unknown, f"test asks for unknown fields {unknown}"


# ------------------------------------------------------------------------------------------------
# The corpus: one test per real message.


@pytest.mark.parametrize("sample", SAMPLES, ids=SAMPLE_IDS)
def test_sample(sample):
    expected = dict(sample["expected"])
    kind = expected.pop("kind")
    # Records without a confidence are messages that say they ran out of memory.
    confidence = expected.pop("confidence", "certain")
    if "other_processes" in expected:
        expected["other_processes"] = [(p["pid"], p["in_use"]) for p in expected["other_processes"]]
    report = parse_oom(sample["message"])
    assert_report(report, kind, **expected)
    assert report.kind in KINDS
    assert report.confidence == confidence
    # The message is a contiguous piece of the (whitespace-normalised) input and, since the corpus
    # trims only around the message, runs to its end.
    flat = " ".join(sample["message"].split())
    assert report.message and flat.endswith(report.message)


@pytest.mark.parametrize("sample", SAMPLES, ids=SAMPLE_IDS)
def test_sample_to_dict_matches_corpus(sample):
    data = parse_oom(sample["message"]).to_dict()
    json.dumps(data)  # serialisable, including 2**64
    assert data["confidence"] == sample["expected"].get("confidence", "certain")
    for key, value in sample["expected"].items():
        assert data[key] == value
    for name in NUMBER_FIELDS:
        if name not in sample["expected"]:
            assert data[name] is None
    if "other_processes" not in sample["expected"]:
        assert data["other_processes"] == []


@pytest.mark.parametrize("sample", SAMPLES, ids=SAMPLE_IDS)
def test_sample_inside_traceback_and_bytes(sample):
    """The same message found by search inside surrounding traceback text, and given as bytes."""
    text = (
        "Traceback (most recent call last):\n"
        '  File "/app/run.py", line 12, in <module>\n'
        "    out = model(x)\n"
        + sample["message"]
        + "\n\nDuring handling of the above exception, another exception occurred:\n\nKeyError: 'x'\n"
    )
    direct = parse_oom(sample["message"])
    for variant in (text, text.encode("utf-8")):
        report = parse_oom(variant)
        assert report is not None
        assert report.kind == direct.kind
        for name in NUMBER_FIELDS + ("other_processes",):
            assert getattr(report, name) == getattr(direct, name), name


def test_sample_exception_types_and_prefixes():
    by_line = {i: parse_oom(s["message"]) for i, s in enumerate(SAMPLES, 1)}
    assert by_line[1].exception_type == "RuntimeError"
    assert by_line[8].exception_type == "torch.cuda.OutOfMemoryError"
    assert by_line[14].exception_type == "torch.OutOfMemoryError"
    assert by_line[7].exception_type is None
    assert by_line[29].exception_type == "torch.OutOfMemoryError"  # behind "(EngineCore_0 pid=94) "
    assert by_line[29].message.startswith("HIP out of memory. Tried to allocate 816.00 MiB.")
    assert by_line[41].exception_type == "ResourceExhaustedError"
    assert by_line[38].exception_type == "RuntimeError"  # on the line before the message
    assert by_line[18].message.startswith("[enforce fail at CPUAllocator.cpp:65] . DefaultCPUAllocator")
    assert by_line[36].message == "NCCL WARN Cuda failure 'out of memory'"


def test_sample_backends_pools_hints():
    by_line = {i: parse_oom(s["message"]) for i, s in enumerate(SAMPLES, 1)}
    assert by_line[26].backend == "cudaMallocAsync"
    assert by_line[14].backend == by_line[1].backend == by_line[27].backend == "native"
    assert by_line[24].backend is None and by_line[32].backend is None
    assert by_line[32].pool == "private" and by_line[14].pool is None
    assert by_line[14].hints == ("expandable_segments",)
    assert by_line[9].hints == ("max_split_size_mb",)
    assert by_line[12].hints == ("max_split_size_mb",)
    assert by_line[33].hints == ("PYTORCH_MPS_HIGH_WATERMARK_RATIO",)
    assert by_line[1].hints == ()
    assert by_line[43].hints == ("empty_cache",)


# ------------------------------------------------------------------------------------------------
# Formats documented in oom-formats.md but absent from the corpus.

HINT_V5 = (
    " If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    " to avoid fragmentation.  See documentation for Memory Management "
    " (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
V5_FULL = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacity of "
    "15.99 GiB of which 14.62 GiB is free. Including non-PyTorch memory, this process has 1.35 GiB memory in "
    "use. 1.05 GiB allowed; Of the allocated memory 1.01 GiB is allocated by PyTorch, with 256.00 MiB "
    "allocated in private pools (e.g., CUDA Graphs), and 20.00 MiB is reserved by PyTorch but unallocated."
    + HINT_V5
)
V5_FULL_EXPECTED = dict(
    requested=B("64.00 MiB"), gpu_index=0, total=B("15.99 GiB"), free=B("14.62 GiB"),
    process_in_use=B("1.35 GiB"), allowed=B("1.05 GiB"), allocated_by_pytorch=B("1.01 GiB"),
    allocated_in_private_pools=B("256.00 MiB"), reserved_unallocated=B("20.00 MiB"),
)

# "this process" between two other processes; a 1024.00 MiB boundary value; GPU 1.
V5_PROCS = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB. GPU 1 has a total capacity of "
    "79.15 GiB of which 1.12 GiB is free. Process 1623 has 30.02 GiB memory in use. Including non-PyTorch "
    "memory, this process has 47.99 GiB memory in use. Process 9988 has 1024.00 MiB memory in use. Of the "
    "allocated memory 45.17 GiB is allocated by PyTorch, and 2.01 GiB is reserved by PyTorch but unallocated."
    + HINT_V5
)
V5_BODY = V5_PROCS[len("torch.OutOfMemoryError: "):]
V5_PROCS_EXPECTED = dict(
    requested=B("1.96 GiB"), gpu_index=1, total=B("79.15 GiB"), free=B("1.12 GiB"),
    other_processes=[(1623, B("30.02 GiB")), (9988, 1024**3)], process_in_use=B("47.99 GiB"),
    allocated_by_pytorch=B("45.17 GiB"), reserved_unallocated=B("2.01 GiB"),
)

CUDA_ERROR_NEWEST = (
    "torch.AcceleratorError: CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in "
    "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
    "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)

HAND_WRITTEN = [
    pytest.param(
        "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 31.75 GiB total capacity; "
        "4.73 GiB already allocated; 15.79 GiB free; 2.37 GiB allowed; 5.05 GiB reserved in total by PyTorch)",
        "cuda_allocator",
        dict(requested=B("20.00 MiB"), gpu_index=0, total=B("31.75 GiB"), allocated_by_pytorch=B("4.73 GiB"),
             free=B("15.79 GiB"), allowed=B("2.37 GiB"), reserved_by_pytorch=B("5.05 GiB")),
        id="v2_allowed",
    ),
    pytest.param(V5_FULL, "cuda_allocator", V5_FULL_EXPECTED, id="v5_allowed_private_pools"),
    pytest.param(V5_PROCS, "cuda_allocator", V5_PROCS_EXPECTED, id="v5_this_process_between_others"),
    pytest.param(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity "
        "of 79.25 GiB of which 301.94 MiB is free. Process 12345 has 78.93 GiB memory in use. Of the allocated "
        "memory 77.48 GiB is allocated by PyTorch, and 920.05 MiB is reserved by PyTorch but unallocated."
        + HINT_V5,
        "cuda_allocator",
        dict(requested=B("512.00 MiB"), gpu_index=0, total=B("79.25 GiB"), free=B("301.94 MiB"),
             other_processes=[(12345, B("78.93 GiB"))], allocated_by_pytorch=B("77.48 GiB"),
             reserved_unallocated=B("920.05 MiB")),
        id="v5_container_pid_only",
    ),
    pytest.param(
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of "
        "6.00 GiB of which 0 bytes is free. Process 4321 has 17179869184.00 GiB memory in use. Of the allocated "
        "memory 5.21 GiB is allocated by PyTorch, and 20.24 MiB is reserved by PyTorch but unallocated.",
        "cuda_allocator",
        dict(requested=B("2.00 MiB"), gpu_index=0, total=B("6.00 GiB"), free=0,
             other_processes=[(4321, 2**64)], allocated_by_pytorch=B("5.21 GiB"),
             reserved_unallocated=B("20.24 MiB")),
        id="v5_wddm_not_available_process",
    ),
    pytest.param(
        "RuntimeError: CUDA out of memory. Tried to allocate 1024.00 KiB (GPU 0; 1024.00 MiB total capacity; "
        "1000.00 MiB already allocated; 1024 bytes free; 1022.00 MiB reserved in total by PyTorch)",
        "cuda_allocator",
        dict(requested=1024**2, gpu_index=0, total=1024**3, allocated_by_pytorch=B("1000.00 MiB"), free=1024,
             reserved_by_pytorch=B("1022.00 MiB")),
        id="boundary_1024_forms",
    ),
    pytest.param(
        "RuntimeError: HIP out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.98 GiB total capacity; 13.70 GiB "
        "already allocated; 2.16 GiB free; 13.77 GiB reserved in total by PyTorch) If reserved memory is >> "
        "allocated memory try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory "
        "Management and PYTORCH_HIP_ALLOC_CONF",
        "hip",
        dict(requested=B("2.00 GiB"), gpu_index=0, total=B("15.98 GiB"), allocated_by_pytorch=B("13.70 GiB"),
             free=B("2.16 GiB"), reserved_by_pytorch=B("13.77 GiB")),
        id="hip_v3_old_form",
    ),
    pytest.param(
        "RuntimeError: XPU out of memory. Tried to allocate 1.00 GiB (GPU 0; 15.11 GiB total capacity; "
        "13.94 GiB already allocated; 14.47 GiB reserved in total by PyTorch)",
        "xpu",
        dict(requested=B("1.00 GiB"), gpu_index=0, total=B("15.11 GiB"), allocated_by_pytorch=B("13.94 GiB"),
             reserved_by_pytorch=B("14.47 GiB")),
        id="xpu_ipex",
    ),
    pytest.param(
        "torch.OutOfMemoryError: XPU out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "15.11 GiB of which 1.20 GiB is free. 8.00 GiB allowed; Of the allocated memory 7.50 GiB is allocated "
        "by PyTorch, and 100.00 MiB is reserved by PyTorch but unallocated. Please use `empty_cache` to release "
        "all unoccupied cached memory.",
        "xpu",
        dict(requested=B("2.00 GiB"), gpu_index=0, total=B("15.11 GiB"), free=B("1.20 GiB"), allowed=B("8.00 GiB"),
             allocated_by_pytorch=B("7.50 GiB"), reserved_unallocated=B("100.00 MiB")),
        id="xpu_upstream_allowed",
    ),
    pytest.param(
        "torch.OutOfMemoryError: Allocation on device 1 would exceed allowed memory. (out of memory)\n"
        "Currently allocated     : 7.50 GiB\n"
        "Requested               : 1.00 GiB\n"
        "Device limit            : 23.65 GiB\n"
        "Free (according to CUDA): 14.02 GiB\n"
        "PyTorch limit (set by user-supplied memory fraction)\n"
        "                        : 8.00 GiB",
        "cuda_allocator",
        dict(gpu_index=1, allocated_by_pytorch=B("7.50 GiB"), requested=B("1.00 GiB"), total=B("23.65 GiB"),
             free=B("14.02 GiB"), pytorch_limit=B("8.00 GiB")),
        id="cuda_malloc_async_aligned",
    ),
    pytest.param(
        "RuntimeError: MPS backend out of memory (MPS allocated: 1.20 GiB, other allocations: 300.00 MiB). "
        "Tried to allocate 256.00 MiB on shared pool.",
        "mps",
        dict(allocated_by_pytorch=B("1.20 GiB"), other_allocations=B("300.00 MiB"), requested=B("256.00 MiB")),
        id="mps_no_watermark",
    ),
    pytest.param(
        "RuntimeError: MPS backend out of memory (MPS allocated: 512.00 KB, other allocations: 0 bytes, max "
        "allowed: 1.00 GB). Tried to allocate 20.50 KB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 "
        "to disable upper limit for memory allocations (may cause system failure).",
        "mps",
        dict(allocated_by_pytorch=B("512.00 KB"), other_allocations=0, max_allowed=B("1.00 GB"),
             requested=B("20.50 KB")),
        id="mps_kb_labels",
    ),
    pytest.param("RuntimeError: CUDA driver error: out of memory", "cuda_error", {}, id="cuda_driver_error"),
    pytest.param(CUDA_ERROR_NEWEST, "cuda_error", {}, id="cuda_error_newest_multiline"),
    pytest.param(
        "THCudaCheck FAIL file=/pytorch/aten/src/THC/generic/THCStorage.cu line=58 error=2 : out of memory\n"
        "Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n"
        "RuntimeError: cuda runtime error (2) : out of memory at /pytorch/aten/src/THC/generic/THCStorage.cu:58",
        "cuda_error", {}, id="thc_runtime_error",
    ),
    pytest.param("RuntimeError: HIP error: out of memory\nHIP kernel errors might be asynchronously reported",
                 "hip", {}, id="hip_runtime_error"),
    pytest.param("RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED", "cudnn", {}, id="cudnn_alloc_failed"),
    pytest.param("RuntimeError: cuDNN error: CUDNN_STATUS_NOT_ENOUGH_MEMORY", "cudnn", {}, id="cudnn_not_enough"),
    pytest.param(
        "RuntimeError: CUDA error: HIPBLAS_STATUS_ALLOC_FAILED when calling `hipblasCreate(handle)`",
        "cublas", {}, id="hipblas_alloc_failed",
    ),
    pytest.param(
        "RuntimeError: UR backend failed. UR backend returns:40 (UR_RESULT_ERROR_OUT_OF_RESOURCES)",
        "xpu", {}, id="xpu_unified_runtime",
    ),
    pytest.param(
        "2019-03-01 12:00:00.000000: W tensorflow/core/common_runtime/bfc_allocator.cc:211] Allocator "
        "(GPU_0_bfc) ran out of memory trying to allocate 3.34GiB. The caller indicates that this is not a "
        "failure, but may mean that there could be performance gains if more memory were available.",
        "tensorflow", dict(requested=B("3.34 GiB"), gpu_index=0), id="tf_bfc_allocator",
    ),
    pytest.param(
        "W tensorflow/core/common_runtime/bfc_allocator.cc:267] Allocator (GPU_1_bfc) ran out of memory trying "
        "to allocate 1.00GiB (rounded to 1073741824)requested by op Conv2D",
        "tensorflow", dict(requested=1073741824, gpu_index=1), id="tf_bfc_rounded_to",
    ),
    pytest.param(
        "2018-05-02 10:00:00.000000: E tensorflow/stream_executor/cuda/cuda_driver.cc:903] failed to allocate "
        "17.79G (19104890880 bytes) from device: CUDA_ERROR_OUT_OF_MEMORY",
        "tensorflow", dict(requested=19104890880), id="tf_failed_to_allocate_from_device",
    ),
    pytest.param(
        "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor with "
        "shape[1024,1024,64] and type float on /job:localhost/replica:0/task:0/device:GPU:2 by allocator "
        "GPU_2_bfc [Op:Conv2D]",
        "tensorflow", dict(gpu_index=2), id="tf2_resource_exhausted",
    ),
    pytest.param(
        "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
        "17179869184 bytes.",
        "tensorflow", dict(requested=17179869184), id="xla_resource_exhausted",
    ),
    pytest.param(
        "RuntimeError: Could not allocate tensor with 471859200 bytes. There is not enough GPU video memory "
        "available!",
        "other", dict(requested=471859200), id="directml",
    ),
    pytest.param(
        "onnxruntime.capi.onnxruntime_pybind11_state.RuntimeException: [ONNXRuntimeError] : 6 : "
        "RUNTIME_EXCEPTION : Non-zero status code returned while running Conv node. Name:'Conv_12' Status "
        "Message: /onnxruntime_src/onnxruntime/core/framework/bfc_arena.cc:376 void* "
        "onnxruntime::BFCArena::AllocateRawInternal(size_t, bool, onnxruntime::Stream*, bool, "
        "onnxruntime::WaitNotificationFn) Failed to allocate memory for requested buffer of size 2147483648\n",
        "other", dict(requested=2147483648), id="onnxruntime_bfc_arena",
    ),
    pytest.param(
        "CUDA failure 2: out of memory ; GPU=3 ; hostname=node7 ; file=cuda_allocator.cc ; line=47 ; "
        "expr=cudaMalloc((void**)&p, size);",
        "other", dict(gpu_index=3), id="onnxruntime_cuda_call",
    ),
    pytest.param(
        "node1:123:456 [5] include/alloc.h:48 NCCL WARN Failed to CUDA calloc 10485760 bytes",
        "other", dict(requested=10485760, gpu_index=5), id="nccl_calloc",
    ),
    pytest.param(
        "CUDA error: out of memory\n  current device: 1, in function ggml_cuda_pool_malloc at ggml-cuda.cu:512\n"
        "  cudaMalloc((void **) &ptr, look_ahead_size)",
        "other", dict(gpu_index=1), id="ggml_current_device",
    ),
    pytest.param(
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 4096.00 MiB on device 0: cudaMalloc failed: "
        "out of memory",
        "other", dict(requested=B("4096.00 MiB"), gpu_index=0), id="ggml_alloc_buffer",
    ),
    pytest.param("[torch_memory_saver.cpp] CUresult error result=2 file=csrc/torch_memory_saver.cpp "
                 "func=cu_mem_create line=103", "other", {}, id="torch_memory_saver"),
    pytest.param("[torch_memory_saver.cpp] CUresult error: 2 (out of memory) file=csrc/core.cpp func=malloc",
                 "other", {}, id="torch_memory_saver_new"),
    pytest.param(
        "cupy.cuda.memory.OutOfMemoryError: Out of memory allocating 1,073,741,824 bytes (allocated so far: "
        "2,147,483,648 bytes).",
        "other", dict(requested=1073741824), id="cupy",
    ),
    pytest.param(
        "numpy.core._exceptions._ArrayMemoryError: Unable to allocate 7.45 GiB for an array with shape "
        "(1000000000,) and data type float64",
        "cpu", dict(requested=B("7.45 GiB")), id="numpy_array_memory_error",
    ),
    pytest.param(
        "MemoryError: Unable to allocate 745. MiB for an array with shape (97656250, 2) and data type float32",
        "cpu", dict(requested=B("745.00 MiB")), id="numpy_trailing_dot",
    ),
    pytest.param(
        "MemoryError: Unable to allocate array with shape (100000, 100000) and data type float64",
        "cpu", {}, id="numpy_old_no_size",
    ),
    pytest.param(
        'Traceback (most recent call last):\n  File "<stdin>", line 1, in <module>\nMemoryError\n',
        "cpu", {}, id="bare_memory_error",
    ),
    pytest.param(
        "RuntimeError: [enforce fail at CPUAllocator.cpp:56] posix_memalign(&data, gAlignment, nbytes) == 0. "
        "12 vs 0",
        "cpu", {}, id="cpu_posix_memalign_legacy",
    ),
    pytest.param("OSError: [Errno 12] Cannot allocate memory", "cpu", {}, id="errno_12"),
    pytest.param("terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc",
                 "cpu", {}, id="std_bad_alloc"),
    pytest.param(
        "RuntimeError: [enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 0 bytes. Error code 12 (Cannot allocate memory)",
        "cpu", dict(requested=0), id="cpu_zero_bytes",
    ),
]


@pytest.mark.parametrize("text,kind,expected", HAND_WRITTEN)
def test_hand_written_format(text, kind, expected):
    assert_report(parse_oom(text), kind, **dict(expected))


def test_v5_full_extras_and_derived():
    r = parse_oom(V5_FULL)
    assert r.exception_type == "torch.OutOfMemoryError"
    assert r.backend == "native" and r.device == "cuda:0" and r.device_type == "cuda"
    assert r.hints == ("expandable_segments",)
    assert r.message.startswith("CUDA out of memory. Tried to allocate 64.00 MiB.")
    assert r.message.endswith("#environment-variables)")
    # 2.4+: "allocated by PyTorch" already contains the private pools.
    assert r.reserved == B("1.01 GiB") + B("20.00 MiB")
    assert r.reserved_unallocated_bytes == B("20.00 MiB")
    assert r.non_pytorch_in_process == B("1.35 GiB") - r.reserved
    assert r.used_by_others == 0


def test_derived_old_formats():
    v2 = parse_oom(SAMPLES[4]["message"])  # 8.77 GiB allocated, 13.71 GiB reserved
    assert v2.reserved == B("13.71 GiB")
    assert v2.reserved_unallocated_bytes == B("13.71 GiB") - B("8.77 GiB")
    assert v2.non_pytorch_in_process is None and v2.used_by_others is None
    v1 = parse_oom(SAMPLES[0]["message"])  # "cached" is reserved minus allocated
    assert v1.reserved == B("6.64 GiB") + B("150.86 MiB")
    v3_equal = parse_oom(SAMPLES[7]["message"])
    assert v3_equal.reserved_unallocated_bytes == 0
    procs = parse_oom(V5_PROCS)
    assert procs.used_by_others == B("30.02 GiB") + 1024**3
    assert procs.device == "cuda:1"


def test_device_strings():
    by_line = {i: parse_oom(s["message"]) for i, s in enumerate(SAMPLES, 1)}
    assert by_line[26].device == "cuda:0"
    assert by_line[27].device == "cuda:0"  # ROCm builds use torch's "cuda" device type
    assert by_line[32].device == "mps"
    assert by_line[18].device == "cpu"
    assert by_line[43].device == "xpu:0"
    assert by_line[24].device == "cuda"
    assert by_line[36].device == "cuda:3"
    assert by_line[40].device == "cpu"  # TF's failed host (pinned) allocation
    assert by_line[41].device == "cuda:0"
    assert parse_oom("RuntimeError: Could not allocate tensor with 4 bytes.").device is None
    assert parse_oom("RuntimeError: NPU out of memory. Tried to allocate 2.00 GiB (NPU 3; 60.97 GiB total "
                     "capacity; 1.00 GiB already allocated; 1.17 GiB free; 2.00 GiB reserved in total by "
                     "PyTorch)").device == "npu:3"


def test_report_is_frozen_and_serialisable():
    r = parse_oom(V5_PROCS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.requested = 1  # type: ignore[misc]
    data = r.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["other_processes"] == [{"pid": 1623, "in_use": B("30.02 GiB")}, {"pid": 9988, "in_use": 1024**3}]
    assert data["hints"] == ["expandable_segments"]
    assert data["kind"] == "cuda_allocator"


def test_lowercased_message():
    text = ("runtimeerror: cuda out of memory. tried to allocate 20.00 mib (gpu 0; 4.00 gib total capacity; "
            "3.35 gib already allocated; 0 bytes free; 3.41 gib reserved in total by pytorch)")
    assert_report(parse_oom(text), "cuda_allocator", requested=B("20.00 MiB"), gpu_index=0, total=B("4.00 GiB"),
                  allocated_by_pytorch=B("3.35 GiB"), free=0, reserved_by_pytorch=B("3.41 GiB"))


def test_blank_lines_between_sentences():
    # SGLang re-wraps the message with blank lines; its own advice follows after another blank line.
    text = (
        "Exception: Capture cuda graph failed: CUDA out of memory.\nTried to allocate 672.00 MiB.\n\n"
        "GPU 0 has a total capacity of 140.06 GiB of which 200.75 MiB is free.\n"
        "Process 1939284 has 139.86 GiB memory in use.\n"
        "Of the allocated memory 128.50 GiB is allocated by PyTorch,\n"
        "with 3.23 GiB allocated in private pools (e.g., CUDA Graphs),\n"
        "and 1.01 GiB is reserved by PyTorch but unallocated.\n\n"
        "Possible solutions:\n1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)\n"
    )
    report = parse_oom(text)
    assert_report(report, "cuda_allocator", requested=B("672.00 MiB"), gpu_index=0, total=B("140.06 GiB"),
                  free=B("200.75 MiB"), other_processes=[(1939284, B("139.86 GiB"))],
                  allocated_by_pytorch=B("128.50 GiB"), allocated_in_private_pools=B("3.23 GiB"),
                  reserved_unallocated=B("1.01 GiB"))
    assert report.message.endswith("reserved by PyTorch but unallocated.")


def test_exception_repr():
    text = ("RuntimeError('CUDA out of memory. Tried to allocate 2.00 MiB (GPU 0; 4.00 GiB total capacity; "
            "1.00 GiB already allocated; 1.00 MiB free; 2.00 GiB reserved in total by PyTorch)')")
    report = parse_oom(text)
    assert report.exception_type == "RuntimeError"
    assert report.message.endswith("by PyTorch)")
    assert report.requested == B("2.00 MiB")


@pytest.mark.parametrize(
    "text,expected",
    [
        pytest.param("Tried to allocate 20.00 MiB (GPU 0; 15.75 GiB total capacity; 79.11 MiB already allocated; "
                     "3.62 MiB free; 86.00 MiB reserved in total by PyTorch)",
                     dict(requested=B("20.00 MiB"), gpu_index=0, total=B("15.75 GiB"), free=B("3.62 MiB"),
                          allocated_by_pytorch=B("79.11 MiB"), reserved_by_pytorch=B("86.00 MiB")),
                     id="old_without_first_sentence"),
        pytest.param("Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 4.00 GiB of which 0 bytes is "
                     "free.",
                     dict(requested=B("20.00 MiB"), gpu_index=0, total=B("4.00 GiB"), free=0),
                     id="new_without_first_sentence"),
    ],
)
def test_allocator_fragments(text, expected):
    report = parse_oom(text)
    assert_report(report, "cuda_allocator", **expected)
    assert report.message.startswith("Tried to allocate")


def test_mps_loose_spelling():
    report = parse_oom('raise RuntimeError("MPS backend out of memory (MPS allocated 8 GB)")')
    assert_report(report, "mps", allocated_by_pytorch=8 * 1024**3)
    assert report.exception_type == "RuntimeError"
    assert report.message == "MPS backend out of memory (MPS allocated 8 GB)"


def test_cuda_error_message_extent():
    text = CUDA_ERROR_NEWEST + 'Traceback (most recent call last):\n  File "x.py", line 1\n'
    report = parse_oom(text)
    assert report.kind == "cuda_error" and report.exception_type == "torch.AcceleratorError"
    assert report.message.startswith("CUDA error: out of memory Search for `cudaErrorMemoryAllocation'")
    assert report.message.endswith("to enable device-side assertions.")


def test_tensorflow_traceback_with_hint():
    text = (
        'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n'
        "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor with "
        "shape[64,256,56,56] and type float on /job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc\n"
        "\t [[{{node conv2d_1/Conv2D}}]]\n"
        "Hint: If you want to see a list of allocated tensors when OOM happens, add "
        "report_tensor_allocations_upon_oom to RunOptions for current allocation info.\n\n"
    )
    report = parse_oom(text)
    assert_report(report, "tensorflow", gpu_index=0)
    assert report.exception_type == "tensorflow.python.framework.errors_impl.ResourceExhaustedError"
    assert report.hints == ("report_tensor_allocations_upon_oom",)
    assert report.message.endswith("for current allocation info.")


def test_every_kind_is_covered():
    texts = [s["message"] for s in SAMPLES] + [p.values[0] for p in HAND_WRITTEN]
    assert {parse_oom(t).kind for t in texts} == set(KINDS)


# ------------------------------------------------------------------------------------------------
# Messy copies of one v5 message: every one must give exactly the same numbers.


def _terminal_wrap(text, width=80):
    return "\n".join(text[i:i + width] for i in range(0, len(text), width))


JUPYTER = (
    "\x1b[0;31m---------------------------------------------------------------------------\x1b[0m\n"
    "\x1b[0;31mOutOfMemoryError\x1b[0m                          Traceback (most recent call last)\n"
    "Cell \x1b[0;32mIn[7], line 3\x1b[0m\n"
    "\x1b[1;32m      1\x1b[0m x \x1b[38;5;241m=\x1b[39m torch\x1b[38;5;241m.\x1b[39mrandn("
    "\x1b[38;5;241m1024\x1b[39m)\n"
    "\x1b[0;32m----> 3\x1b[0m y \x1b[38;5;241m=\x1b[39m model(x)\n\n"
    "File \x1b[0;32m/opt/conda/lib/python3.11/site-packages/torch/nn/modules/module.py:1773\x1b[0m, in "
    "\x1b[0;36mModule._wrapped_call_impl\x1b[0;34m(self, *args, **kwargs)\x1b[0m\n\n"
    "\x1b[0;31mOutOfMemoryError\x1b[0m: " + V5_BODY + "\n"
)

MESSY_V5 = [
    pytest.param(textwrap.fill(V5_PROCS, 80), id="textwrap_80"),
    pytest.param(_terminal_wrap(V5_PROCS), id="terminal_wrap_80_mid_word"),
    pytest.param(" ".join(V5_PROCS.split()), id="flattened_one_line"),
    pytest.param(textwrap.fill(V5_PROCS, 80).replace("\n", ""), id="newlines_removed"),
    pytest.param(V5_PROCS.replace(" ", ""), id="all_spaces_removed"),
    pytest.param(V5_PROCS.replace(" ", "  "), id="doubled_spaces"),
    pytest.param(html.escape(V5_PROCS), id="html_escaped"),
    pytest.param("\n".join("&gt; " + line for line in textwrap.wrap(html.escape(V5_PROCS), 70)),
                 id="html_escaped_markdown_quote"),
    pytest.param("\n".join("> " + line for line in textwrap.wrap(V5_PROCS, 60)), id="markdown_quote"),
    pytest.param(JUPYTER, id="jupyter_ansi_traceback"),
    pytest.param(JUPYTER.replace("\x1b", ""), id="jupyter_ansi_lost_escape_byte"),
    pytest.param("(VllmWorker rank=1 pid=4242) ERROR 08-22 10:11:12 [multiproc_executor.py:511] " + V5_PROCS,
                 id="vllm_prefix"),
    pytest.param("2024-05-01 10:00:00.123 | ERROR    | app.worker:run:88 - " + V5_BODY, id="loguru_prefix"),
    pytest.param("!!! Exception during processing !!! " + V5_BODY, id="comfyui_prefix"),
    pytest.param('"' + V5_PROCS + '"', id="quoted"),
    pytest.param(V5_PROCS.replace("\n", "\r\n").replace(" ", "\xa0", 3), id="nbsp_crlf"),
    pytest.param(("x" * 200 + "\n") * 2000 + V5_PROCS, id="long_log_before"),
    pytest.param("<pre><code>" + V5_PROCS + "</code></pre>", id="html_tags"),
]


@pytest.mark.parametrize("text", MESSY_V5)
def test_messy_copies_of_v5(text):
    report = parse_oom(text)
    assert_report(report, "cuda_allocator", **V5_PROCS_EXPECTED)
    assert report.message.startswith("CUDA")


def test_messy_copies_keep_message_and_type():
    clean = parse_oom(V5_PROCS)
    assert clean.message == " ".join(V5_BODY.split())
    for text in (html.escape(V5_PROCS), textwrap.fill(V5_PROCS, 80), " ".join(V5_PROCS.split())):
        r = parse_oom(text)
        assert r.message == clean.message
        assert r.exception_type == "torch.OutOfMemoryError"
        assert r.hints == ("expandable_segments",)
    assert parse_oom(JUPYTER).exception_type == "OutOfMemoryError"
    assert parse_oom('"' + V5_PROCS + '"').message == clean.message
    assert parse_oom("<pre><code>" + V5_PROCS + "</code></pre>").message == clean.message


def test_message_ends_before_following_text():
    text = V5_PROCS + " Sorry, I am new to this, what should I do?"
    assert parse_oom(text).message.endswith("#environment-variables)")
    v2 = SAMPLES[4]["message"]
    assert parse_oom(v2 + "\n\nI have tried a smaller batch size.").message.endswith("by PyTorch)")


# ------------------------------------------------------------------------------------------------
# Truncation: numbers that were cut are dropped, never misread.

V5_HEAD = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
           "79.15 GiB")


@pytest.mark.parametrize(
    "text,expected",
    [
        pytest.param(V5_HEAD + " of which 16.8", dict(requested=B("20.00 MiB"), gpu_index=0, total=B("79.15 GiB")),
                     id="cut_mid_free"),
        pytest.param(V5_HEAD + " of which 16.83 Gi", dict(requested=B("20.00 MiB"), gpu_index=0,
                                                           total=B("79.15 GiB")), id="cut_mid_unit"),
        pytest.param(V5_HEAD + " of which 0 byte", dict(requested=B("20.00 MiB"), gpu_index=0,
                                                         total=B("79.15 GiB")), id="cut_in_bytes"),
        pytest.param(V5_HEAD + " of which 16.83 GiB is free. Process 1623 has 30.0",
                     dict(requested=B("20.00 MiB"), gpu_index=0, total=B("79.15 GiB"), free=B("16.83 GiB")),
                     id="cut_in_process_line"),
        pytest.param("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.9", {}, id="cut_in_request"),
        pytest.param("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 1",
                     dict(requested=B("20.00 MiB")), id="cut_after_gpu_index"),
        pytest.param("RuntimeError: CUDA out of memory. Tried to allocate 12.50 MiB (GPU 0; 10.92 GiB total "
                     "capacity; 8.57 MiB already allocated; 9.28 GiB free; 4.6",
                     dict(requested=B("12.50 MiB"), gpu_index=0, total=B("10.92 GiB"),
                          allocated_by_pytorch=B("8.57 MiB"), free=B("9.28 GiB")), id="v1_cut_in_cached"),
        pytest.param("Allocation on device 0 would exceed allowed memory. (out of memory)\nCurrently allocated : "
                     "15.16 GiB\nRequested : 512.00 KiB\nDevice limit : 15.99 GiB\nFree (according to CUDA): 0 by",
                     dict(gpu_index=0, allocated_by_pytorch=B("15.16 GiB"), requested=B("512.00 KiB"),
                          total=B("15.99 GiB")), id="async_cut_in_free"),
    ],
)
def test_truncated(text, expected):
    assert_report(parse_oom(text), "cuda_allocator", **expected)


# ------------------------------------------------------------------------------------------------
# Tolerance: reordered, missing and extra clauses; several messages in one text.


def test_reordered_and_extra_clauses():
    text = (
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 (NVIDIA A100-SXM4-80GB) has a total capacity of "
        "79.15 GiB of which 1.00 GiB is free. 40.00 GiB allowed; Including non-PyTorch memory, this process has "
        "38.00 GiB memory in use. Peak usage was 39.00 GiB. Process 77 has 40.00 GiB memory in use. Of the "
        "allocated memory 37.00 GiB is allocated by PyTorch, and 200.00 MiB is reserved by PyTorch but "
        "unallocated."
    )
    assert_report(
        parse_oom(text), "cuda_allocator", requested=B("20.00 MiB"), gpu_index=0, total=B("79.15 GiB"),
        free=B("1.00 GiB"), allowed=B("40.00 GiB"), process_in_use=B("38.00 GiB"),
        other_processes=[(77, B("40.00 GiB"))], allocated_by_pytorch=B("37.00 GiB"),
        reserved_unallocated=B("200.00 MiB"),
    )


def test_missing_clauses_lose_only_that_field():
    text = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.15 GiB. Of the "
            "allocated memory 37.00 GiB is allocated by PyTorch.")
    assert_report(parse_oom(text), "cuda_allocator", requested=B("20.00 MiB"), gpu_index=0, total=B("79.15 GiB"),
                  allocated_by_pytorch=B("37.00 GiB"))


def test_last_message_of_richest_family_wins():
    first = SAMPLES[4]["message"]  # v2, 2.87 GiB
    text = first + "\nretrying with a smaller batch\n" + V5_PROCS + "\nRuntimeError: CUDA error: out of memory\n"
    report = parse_oom(text)
    assert report.kind == "cuda_allocator" and report.requested == B("1.96 GiB")
    # The second message's clauses do not leak into the first one's report.
    report = parse_oom(V5_PROCS + "\n" + first)
    assert report.requested == B("2.87 GiB") and report.other_processes == ()


@pytest.mark.slow
def test_message_at_end_of_huge_text_is_found():
    alphabet = "abcdefghij klmnop0123456789.;:()[]\n"
    junk = "".join(random.Random(1234).choices(alphabet, k=5_000_000))
    assert parse_oom(junk + "\n" + V5_PROCS).requested == B("1.96 GiB")
    assert parse_oom(V5_PROCS + "\n" + junk[:1000]).requested == B("1.96 GiB")


@pytest.mark.parametrize(
    "text",
    [
        "9" * 300_000,
        "(GPU 0; " * 40_000,
        "CUDA out of memory. Tried to allocate " * 10_000,
        "[enforce fail at " * 30_000 + "DefaultCPUAllocator: can't allocate memory",
        "THCudaCheck FAIL " * 30_000,
        "1." * 100_000 + "5 GiB",
        "a." * 100_000 + "Error: CUDA out of memory.",
        "Process 1 has " * 30_000,
        "\x1b[" + "0" * 100_000,
        "&" * 100_000 + "amp;gt;",
        "Allocator (" * 30_000,
        "CUDA error 2 at " + "x" * 200_000,
    ],
    ids=lambda t: repr(t[:24]),
)
def test_pathological_inputs_terminate(text):
    # Not timed: the scan caps and literal-led anchors keep every pattern linear by design.
    result = parse_oom(text)
    assert result is None or isinstance(result, OomReport)


# ------------------------------------------------------------------------------------------------
# Confidence, and out-of-memory errors in disguise.


def test_confidence_is_certain_where_the_message_says_so():
    assert CONFIDENCES == ("certain", "likely", "possible")
    texts = [s["message"] for s in SAMPLES if "confidence" not in s["expected"]]
    texts += [p.values[0] for p in HAND_WRITTEN if p.id != "xpu_unified_runtime"]
    for text in texts:
        assert parse_oom(text).confidence == "certain", text


@pytest.mark.parametrize(
    "text,exception_type",
    [
        pytest.param("MemoryError", "MemoryError", id="bare"),
        pytest.param("MemoryError: ", "MemoryError", id="empty_message"),
        pytest.param("MemoryError()", "MemoryError", id="repr"),  # what bytearray(2**46) raises, repr'd
        pytest.param("builtins.MemoryError", "builtins.MemoryError", id="qualified"),
        pytest.param("\x1b[0;31mMemoryError\x1b[0m: ", "MemoryError", id="ansi"),
        pytest.param("Traceback (most recent call last):\n  Cell In[3], line 1\n    bytearray(2**46)\n\n"
                     "MemoryError: \n", "MemoryError", id="ipython_traceback"),
    ],
)
def test_memory_error_without_a_message(text, exception_type):
    report = parse_oom(text)
    assert_report(report, "cpu")
    assert report.confidence == "certain"
    assert report.exception_type == exception_type
    # Raised without a message: the type's name is all it says.
    assert report.device == "cpu" and report.message == exception_type


@pytest.mark.parametrize(
    "text,requested",
    [
        pytest.param("RuntimeError: unable to mmap 1048576 bytes from file </torch_3141_2718_0>: Cannot allocate "
                     "memory (12)", 1048576, id="shared_memory"),
        pytest.param("unable to mmap 23802932552 bytes from file <./flux1-dev.safetensors>: Cannot allocate memory "
                     "(12)", 23802932552, id="no_type"),
    ],
)
def test_mmap_enomem(text, requested):
    report = parse_oom(text)
    assert_report(report, "cpu", requested=requested)
    assert report.confidence == "certain" and report.device == "cpu"
    assert report.message.startswith("unable to mmap") and report.message.endswith("(12)")


DISGUISED = [
    pytest.param("RuntimeError: DataLoader worker (pid 1234) is killed by signal: Killed.", "cpu", "likely",
                 id="dataloader_killed"),
    pytest.param("RuntimeError: DataLoader worker is killed by signal: Killed.", "cpu", "likely",
                 id="dataloader_killed_no_pid"),
    pytest.param("RuntimeError: Unable to find a valid cuDNN algorithm to run convolution", "cudnn", "possible",
                 id="cudnn_no_algorithm"),
    pytest.param("RuntimeError: CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`",
                 "cublas", "likely", id="cublas_not_initialized"),
    pytest.param("RuntimeError: CUDA error: HIPBLAS_STATUS_NOT_INITIALIZED when calling `hipblasCreate(handle)`",
                 "cublas", "likely", id="hipblas_not_initialized"),
    pytest.param("RuntimeError: UR backend failed. UR backend returns:40 (UR_RESULT_ERROR_OUT_OF_RESOURCES)", "xpu",
                 "likely", id="ur_out_of_resources"),
]


@pytest.mark.parametrize("text,kind,confidence", DISGUISED)
def test_out_of_memory_in_disguise(text, kind, confidence):
    report = parse_oom(text)
    assert_report(report, kind)
    assert report.confidence == confidence
    assert report.exception_type == "RuntimeError"
    assert report.to_dict()["confidence"] == confidence


# Messages that say they ran out of memory, from every rank: numbers, a status error, a bare name.
SAYS_SO = [
    pytest.param(V5_PROCS, id="v5"),
    pytest.param(SAMPLES[4]["message"], id="v2"),
    pytest.param("RuntimeError: unable to mmap 136 bytes from file <x>: Cannot allocate memory (12)", id="mmap"),
    pytest.param("RuntimeError: CUDA error: out of memory", id="cuda_error"),
    pytest.param("RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED", id="cudnn_alloc_failed"),
    pytest.param("MemoryError", id="memory_error"),
]


@pytest.mark.parametrize("disguised", [p.values[0] for p in DISGUISED], ids=[p.id for p in DISGUISED])
@pytest.mark.parametrize("says_so", SAYS_SO)
def test_disguised_errors_never_hide_a_message_that_says_so(disguised, says_so):
    reference = parse_oom(says_so)
    log = _log(300_000)
    texts = [
        says_so + "\n" + disguised,
        disguised + "\n" + says_so,
        disguised + "\n\nDuring handling of the above exception, another exception occurred:\n\n" + says_so,
        log[:150_000] + "\n" + says_so + "\n" + log[150_000:] + "\n" + disguised,  # long: screens vs. the tail
    ]
    for text in texts:
        report = parse_oom(text)
        assert report is not None and report.confidence == "certain"
        assert report.kind == reference.kind and report.message == reference.message
        for name in NUMBER_FIELDS:
            assert getattr(report, name) == getattr(reference, name), name


def test_disguised_errors_rank_among_themselves_by_position():
    cudnn, killed = DISGUISED[2].values[0], DISGUISED[0].values[0]
    assert parse_oom(cudnn + "\n" + killed).kind == "cpu"
    assert parse_oom(killed + "\n" + cudnn).kind == "cudnn"


# ------------------------------------------------------------------------------------------------
# Long text: messages anywhere in up to 1 MiB, and adversarial inputs (correct answers only: the speed
# is measured by benchmarks/bench_parse.py, not asserted here).

MiB = 1 << 20


def _log(size):
    """A plausible training log: varied lines, single spaces, every line different."""
    out, total, i = [], 0, 0
    while total < size:
        line = (f"2024-05-01 10:{i // 60 % 60:02d}:{i % 60:02d},{i % 1000:03d} INFO train.py:88 step {i} loss "
                f"0.{(i * 7919) % 10000:04d} lr 3e-4 gpu memory allocated {i % 80}.{i % 100:02d} GiB")
        out.append(line)
        total += len(line) + 1
        i += 1
    return "\n".join(out)[:size]


def _fill(piece, size):
    return (piece * (size // len(piece) + 1))[:size]


LONG_MESSAGES = [pytest.param(s["message"], id=sid) for s, sid in zip(SAMPLES, SAMPLE_IDS)] + [
    pytest.param(p.values[0], id=p.id) for p in HAND_WRITTEN
]


@pytest.mark.parametrize("message", LONG_MESSAGES)
def test_message_anywhere_in_a_long_log(message):
    # Over 64 KiB only the end is read in full; elsewhere the screens must find every family.
    reference = parse_oom(message)
    log = _log(600_000)
    for text in (message + "\n" + log, log[:300_000] + "\n" + message + "\n" + log[300_000:], log + "\n" + message):
        report = parse_oom(text)
        assert report is not None
        assert (report.kind, report.confidence, report.message) == (reference.kind, reference.confidence,
                                                                     reference.message)
        for name in NUMBER_FIELDS + ("other_processes", "exception_type"):
            assert getattr(report, name) == getattr(reference, name), name


def test_long_log_without_a_message():
    assert parse_oom(_log(MiB)) is None
    assert parse_oom(_log(MiB).encode()) is None


def test_text_over_one_mebibyte_keeps_its_head_and_its_end():
    junk = _log(3 * MiB)
    assert parse_oom(V5_PROCS + "\n" + junk).requested == B("1.96 GiB")  # in the first 64 KiB
    assert parse_oom(junk + "\n" + V5_PROCS).requested == B("1.96 GiB")
    assert parse_oom((junk + "\n" + V5_PROCS).encode()).requested == B("1.96 GiB")


# (fragment repeated to 1 MiB, kind of what it says on its own, or None)
FLOODS = [
    ("CUDA out of memory. ", "cuda_allocator"),
    ("Tried to allocate 20.00 MiB ", None),  # the fragment anchors start at its "(GPU 0;" or "GPU 0 has"
    ("GPU 0 has ", None),
    ("Process 123 has ", None),
    ("Process 123 has 1.00 GiB memory in use. ", None),
    ("1234567890", None),
    ("1.", None),
    ("MemoryError\n", "cpu"),
    ("MemoryError ", None),
    ("&amp;", None),
    ("&x", None),
    ("\x1b[0;31mX\x1b[0m", None),
    ("\x1b[", None),
    ("[0;31m", None),
    ("x", None),
    ("\n", None),
    ("\n\n \n", None),
    ("\r\n", None),
    ("\t", None),
    ("\xa0", None),
    ("<br>", None),
    ("<span ", None),
    ("> ", None),
    ("[enforce fail at ", None),
    ("THCudaCheck FAIL ", None),
    ("(GPU 0; ", None),
    ("Allocator (", None),
    ("out of memory ", None),
    ("xcuda out of memory ", None),
    ("error: out of memory ", None),
    ("CUDA error: out of memory\n", "cuda_error"),
    ("memory alloc ", None),
    ("unable to mmap 1 bytes from file <", None),
    ("Unable to allocate ", None),
    ("failed to alloc ", None),
    ("DataLoader worker ", None),
    ("Traceback (most recent call last):\n  File \"x.py\", line 1\n", None),
]


@pytest.mark.parametrize("piece,kind", FLOODS, ids=[repr(p[0][:20]) for p in FLOODS])
def test_megabyte_of_one_fragment(piece, kind):
    report = parse_oom(_fill(piece, MiB))
    assert (report.kind if report is not None else None) == kind
    # A real message in its middle is found, with its numbers, unless the fragment is itself a message
    # of the same family that comes after it. (The exception line after it ends the message: a line
    # such as "Process 123 has 1.00 GiB memory in use." would otherwise continue it, by design.)
    half = MiB // 2 // (len(piece.encode()) // len(piece))  # 1 MiB also as UTF-8 bytes
    text = _fill(piece, half) + "\n" + V5_PROCS + "\nKeyError: 'x'\n" + _fill(piece, half)
    for variant in (text, text.encode()):
        report = parse_oom(variant)
        if kind == "cuda_allocator":
            assert report.kind == "cuda_allocator"
        else:
            assert_report(report, "cuda_allocator", **V5_PROCS_EXPECTED)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sample=st.sampled_from(SAMPLES),
    size=st.integers(70_000, 400_000),
    where=st.floats(0, 1),
    alphabet=st.sampled_from(["abcdefghij klmnop0123456789.;:()[]\n", "ab \n", "x", "&<>;\x1b[m 0\n\t"]),
    seed=st.integers(0, 2**16),
)
def test_property_message_in_long_junk(sample, size, where, alphabet, seed):
    junk = "".join(random.Random(seed).choices(alphabet, k=size))
    at = int(where * size)
    reference = parse_oom(sample["message"])
    report = parse_oom(junk[:at] + "\n" + sample["message"] + "\n" + junk[at:])
    assert report is not None
    assert report.kind == reference.kind and report.requested == reference.requested


def test_flood_of_near_misses_does_not_hide_an_earlier_message():
    # Thousands of lines that look like a richer family's but are not must not use up the search.
    for near_miss in ("xcuda out of memory\n", "RuntimeError: CUDA error: out of memory\n", "MemoryError x\n",
                      "Unable to allocate memory\n", "total capacity\n", "DataLoader worker\n"):
        text = _log(200_000) + "\n" + V5_PROCS + "\n" + _fill(near_miss, 500_000)
        assert_report(parse_oom(text), "cuda_allocator", **V5_PROCS_EXPECTED)


# ------------------------------------------------------------------------------------------------
# Clean-up: the whole-text steps give what cleaning each line on its own gives.


def _reference_normalise(text):
    """The per-line clean-up ``parse_oom`` used to run, kept here as the specification."""
    import re

    if "&" in text:
        for _ in range(2):
            unescaped = html.unescape(text)
            if unescaped == text:
                break
            text = unescaped
    tags = re.compile(r"</?(br|p|div|pre|code|span|b|i|em|strong|tt|kbd|samp)\b[^<>\n]{0,200}>", re.IGNORECASE)
    text = tags.sub(lambda m: "\n" if m.group(1).lower() in ("br", "p", "div") else "", text)
    text = re.sub(r"\x1b\[[0-?]{0,32}[ -/]{0,8}[@-~]|\x1b\][^\x07\x1b\n]{0,512}(?:\x07|\x1b\\)?|\x1b", "", text)
    text = re.sub(r"\[(?:[0-9]{1,3};){0,6}[0-9]{1,3}m", "", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[\x00-\x08\x0e-\x1f\x7f\u200b-\u200d\u2060\ufeff]", "", text)
    lines = []
    for line in text.split("\n"):
        line = re.sub(r"[ \t\x0b\x0c\xa0\u1680\u2000-\u200a\u202f\u205f\u3000]+", " ", line).strip()
        lines.append(re.sub(r"^(?:>(?!>) ?)+", "", line).strip())
    return "\n".join(lines)


_MARKUP = ["&gt;", "&amp;gt;", "&amp;", "&#10;", "&nbsp;", "&", "&x", "&lt;br&gt;", "<br>", "<p>", "</span>", "<b>",
           "\x1b[0;31m", "\x1b]0;t\x07", "\x1b", "[0m", "\r", "\r\n", "\n", " ", "  ", "\t", "\x0b", "\xa0", "\u3000",
           "\x85", "\u2028", "\x01", "\u200b", ">", "> ", ">>", "a", "Z", "0", ";", "İ"]


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(_MARKUP), st.text(max_size=4)), max_size=50))
def test_property_clean_up_matches_per_line_reference(pieces):
    from ipy_gpumem.oom.parse.clean import normalise

    text = "".join(pieces)
    assert normalise(text) == _reference_normalise(text)


# ------------------------------------------------------------------------------------------------
# Not out-of-memory errors.

NOT_OOM = [
    "",
    "   \n\t ",
    "RuntimeError: CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported "
    "at some other API call, so the stacktrace below might be incorrect.\nFor debugging consider passing "
    "CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "torch.AcceleratorError: CUDA error: an illegal memory access was encountered\nSearch for "
    "`cudaErrorIllegalAddress' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for "
    "more information.",
    "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
    "ValueError: too many values to unpack (expected 2)",
    "KeyError: 'memory'",
    "RuntimeError: size mismatch, m1: [64 x 512], m2: [256 x 10] at "
    "/pytorch/aten/src/THC/generic/THCTensorMathBlas.cu:290",
    "RuntimeError: CUDA error: invalid device ordinal",
    "RuntimeError: cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
    "non-contiguous input.",
    "RuntimeError: CUDA error: no kernel image is available for execution on the device",
    "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275, "
    "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.18.1\n"
    "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'invalid argument'",
    "IndexError: index out of range in self",
    "IndexError: list index out of range",
    "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling "
    "`cublasSgemm( handle, opa, opb, m, n, k)`",
    # Errors near the disguised ones that are not out-of-memory errors in most reports.
    "RuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR",
    "RuntimeError: cuDNN error: CUDNN_STATUS_EXECUTION_FAILED",
    "RuntimeError: GET was unable to find an engine to execute this computation",
    "RuntimeError: DataLoader worker (pid 1234) is killed by signal: Segmentation fault.",
    "RuntimeError: DataLoader worker (pid 1234) is killed by signal: Aborted.",
    "RuntimeError: DataLoader worker (pid(s) 1234) exited unexpectedly",
    "RuntimeError: unable to mmap 1048576 bytes from file </torch_1_2>: No such device (19)",
    "RuntimeError: unable to open shared memory object </torch_1_2> in read-write mode: Too many open files (24)",
    "RuntimeError: CUDA error: misaligned address",
    "AssertionError: Torch not compiled with CUDA enabled",
    "RuntimeError: The size of tensor a (4) must match the size of tensor b (3) at non-singleton dimension 1",
    "ModuleNotFoundError: No module named 'torch'",
    "RuntimeError: CUDA error: unspecified launch failure",
    "RuntimeError: mat1 and mat2 shapes cannot be multiplied (64x512 and 256x10)",
    "RuntimeError: CUDA driver error: invalid argument",
    "RuntimeError: HIP error: invalid device function",
    "RuntimeError: [enforce fail at inline_container.cc:337] . unexpected pos 64 vs 0",
    "RuntimeError: Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must "
    "use the 'spawn' start method",
    "UserWarning: To avoid running out of memory, reduce the batch size.",
    "torch.cuda.max_memory_allocated() returned 20.00 MiB; 1.00 GiB reserved in total by PyTorch",
    "|===========================================================================|\n"
    "|                  PyTorch CUDA memory summary, device ID: 0                 |\n"
    "|            CUDA OOMs: 0            |        cudaMalloc retries: 0         |",
    "grpc._channel._InactiveRpcError: status = StatusCode.RESOURCE_EXHAUSTED details = \"Quota exceeded\"",
    "RuntimeError: MPS backend is not available",
    "    except torch.OutOfMemoryError:\n        pass\nNameError: name 'x' is not defined",
    "    except MemoryError:\n        pass\nTypeError: unsupported operand",
    "    raise MemoryError()\nKeyError: 'x'",
    "I got a MemoryError() when I ran it",
    "RuntimeError: UR backend failed. UR backend returns:45 (UR_RESULT_ERROR_INVALID_ARGUMENT)",
    "Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n    raise MemoryErrorWrapper()\n"
    "NameError: name 'MemoryErrorWrapper' is not defined",
    "CUDA error: out of range",
    "My GPU 0 has a total capacity of 80 GB, is that enough?",
    b"RuntimeError: CUDA error: device-side assert triggered",
]


@pytest.mark.parametrize("text", NOT_OOM, ids=lambda t: repr(t[:40]))
def test_not_an_oom(text):
    assert parse_oom(text) is None


@pytest.mark.parametrize("value", [None, 0, 1.5, [], ["CUDA out of memory"], {"message": "x"}, object(), b"",
                                   bytearray(b"\xff\xfe\x00"), True])
def test_non_text_input(value):
    assert parse_oom(value) is None


def test_bytes_input_decoded():
    raw = SAMPLES[13]["message"].encode("utf-8")
    assert parse_oom(raw) == parse_oom(SAMPLES[13]["message"])
    assert parse_oom(bytearray(raw)).requested == B("26.00 MiB")
    assert parse_oom(b"\xff\xfe" + raw + b"\x80").requested == B("26.00 MiB")


# ------------------------------------------------------------------------------------------------
# Properties.

ANCHOR_PIECES = [
    "CUDA out of memory.", " Tried to allocate ", "20.00 MiB", "(GPU 0; ", " total capacity; ", "16.8",
    " GiB", " is free. ", "Process 12 has ", " memory in use. ", "this process has ", "allowed; ",
    "Allocation on device 0 would exceed allowed memory.", "\nRequested : ", "MPS backend out of memory",
    "DefaultCPUAllocator: can't allocate memory", "you tried to allocate ", "OOM when allocating",
    "NCCL WARN Cuda failure 'out of memory'", "[3] ", "CUDA error: out of memory", "MemoryError", "\n",
    "&gt;", "\x1b[0m", "  ", "bytes", "17179869184.00 GiB", "rounded to ", "(", ")", ":", "Error: ",
]


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(), st.binary(), st.none(), st.integers(), st.floats(), st.lists(st.text(max_size=5))))
def test_property_never_raises(value):
    result = parse_oom(value)
    assert result is None or isinstance(result, OomReport)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.sampled_from(ANCHOR_PIECES), st.text(max_size=6)), max_size=40))
def test_property_fragments_never_raise(pieces):
    result = parse_oom("".join(pieces))
    if result is not None:
        assert result.kind in KINDS
        json.dumps(result.to_dict())
        for name in SIZE_FIELDS:
            value = getattr(result, name)
            assert value is None or (isinstance(value, int) and value >= 0)


_JUNK = st.text(st.characters(blacklist_characters="\x1b", blacklist_categories=("Cs",)), max_size=120)
_GAPS = st.sampled_from([" ", "  ", "\t", "\n", " \n", "\xa0", "\u3000", ""])


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(
    sample=st.sampled_from(SAMPLES),
    prefix=_JUNK,
    suffix=_JUNK,
    left=st.sampled_from(["\n", " ", "\n\n", ": "]),
    right=st.sampled_from(["\n", " ", "\n\n"]),
    data=st.data(),
)
def test_property_splice_keeps_kind_and_request(sample, prefix, suffix, left, right, data):
    if sample["variant"].startswith("python_memory_error/"):
        # A bare "MemoryError" counts only as a traceback's exception line, on a line of its own.
        left, right = "\n", "\n"
    reference = parse_oom(sample["message"])
    words = sample["message"].split()
    gaps = data.draw(st.lists(_GAPS, min_size=len(words) - 1, max_size=len(words) - 1))
    message = words[0] + "".join(gap + word for gap, word in zip(gaps, words[1:]))
    report = parse_oom(prefix + left + message + right + suffix)
    assert report is not None
    assert report.kind == reference.kind
    assert report.requested == reference.requested
