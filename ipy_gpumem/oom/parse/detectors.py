"""Detectors: one anchor per message shape, with its family, rank, field parser and finder.

Each anchor is the most specific phrase of one message shape. ``lead`` (matched against the text just
before the anchor on its line) moves the message start back over words that belong to the message but
are too generic to search for. Rank 0 messages carry numbers; rank 1 are status errors; rank 2 are
last-resort names; rank 3 are errors that only usually mean out-of-memory, so any message that says it
ran out of memory wins over them.

Every anchor also gets a finder: the same pattern with its literals lower-cased, compiled without
IGNORECASE, run on a lower-cased copy of the text. Where an anchor does not start with a literal (a
lookbehind, ``^``), the finder is written by hand so that it does; without a literal to skip to, the
regex engine tries every position, which is what made the old parser slow.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from .formats import (parse_allocator, parse_async, parse_cpu, parse_cuda_error, parse_mps, parse_nothing,
                     parse_other, parse_tensorflow)
from .numbers import MessageWindow, regex


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
class Detector:
    kind: str
    rank: int
    anchor: re.Pattern[str]
    parse: Callable[[MessageWindow, re.Match[str], str], Dict[str, Any]]
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
    return regex(f"(?:{template}) $")


# Some frameworks re-wrap a message with blank lines between its sentences (SGLang's "Capture cuda
# graph failed: CUDA out of memory.\nTried to allocate ...\n\nGPU 0 has ..."); a blank line followed
# by one of the family's own clauses does not end the message.
_ALLOC_RESUMES = regex(
    r"(?:Tried to allocate|(?:GPU|NPU|XPU) [0-9]+ has|\((?:GPU|NPU) [0-9]+ ;|Process [0-9]+ has"
    r"|Including non-PyTorch|Of the allocated memory|with [0-9.]+ [A-Za-z]+ allocated in"
    r"|and [0-9.]+ [A-Za-z]+ is reserved|[0-9.]+ [A-Za-z]+ allowed|If reserved|Please use)"
)
_ASYNC_RESUMES = regex(r"(?:Currently allocated|Requested :|Device limit|Free \(|PyTorch limit|: [0-9])")
_MPS_RESUMES = regex(r"(?:Tried to allocate|Use PYTORCH_MPS)")
_ERROR_RESUMES = regex(r"(?:Search for|(?:CUDA|HIP) kernel errors|For debugging|Compile with|For more detailed)")
_ENFORCE_LEAD = r"\[enforce fail at [^\]\n]{1,300}\][^\n]{0,80}?"
_TRIED_LEAD = r"Tried to allocate [0-9]+(?:\.[0-9]*)? (?:bytes|[KMGTPE]i?B|B)"
DETECTORS: Tuple[Detector, ...] = tuple(sorted((  # stable: the order below breaks ties within a rank
    # ---- rank 0: messages with numbers
    Detector("cuda_allocator", 0, regex(r"(?<![A-Za-z])(?P<msg>(?P<dev>CUDA|HIP|XPU|NPU|MLU|MUSA) out of memory)"),
             parse_allocator, resumes=_ALLOC_RESUMES,
             # A finder must start with a literal: this one starts at "out" and checks the device
             # word before it with lookbehinds.
             finder_source=r"out(?:(?<=[apu]out)|(?<=[apu]\sout))(?:" + "|".join(
                 rf"(?<={dev}out)(?<![a-z]{dev}out)|(?<={dev}\sout)(?<![a-z]{dev}\sout)"
                 for dev in ("cuda", "hip", "xpu", "npu", "mlu", "musa")) + r")\s?of\s?memory",
             back=len("musa ")),
    Detector("cuda_allocator", 0, regex(r"(?P<msg>Allocation on device (?:[0-9]+ )?would exceed allowed memory)"),
             parse_async, "cuda", resumes=_ASYNC_RESUMES),
    Detector("mps", 0, regex(r"(?P<msg>MPS backend out of memory)"), parse_mps, "mps", resumes=_MPS_RESUMES),
    Detector("cpu", 0, regex(r"(?P<msg>DefaultCPUAllocator : (?:can.?t allocate memory|not enough memory))"),
             parse_cpu, "cpu", _lead(_ENFORCE_LEAD)),
    Detector("cpu", 0, regex(r"(?P<msg>Torch : not enough memory)"), parse_cpu, "cpu", _lead(r"\$")),
    Detector("cpu", 0, regex(r"(?P<msg>Unable to allocate (?:{SIZE} for an )?array)"), parse_cpu, "cpu"),
    # torch's MapAllocator (shared memory, DataLoader workers, mmap'd checkpoints); only errno 12, ENOMEM.
    Detector("cpu", 0, regex(r"(?P<msg>unable to mmap [0-9]+ bytes from file <[^\n<>]{0,1000}> : "
                             r"Cannot allocate memory)"),
             parse_cpu, "cpu"),
    Detector("tensorflow", 0, regex(r"(?P<msg>OOM when allocating)"), parse_tensorflow, None,
             _lead(r"Resource exhausted :|RESOURCE_EXHAUSTED :")),
    Detector("tensorflow", 0, regex(r"(?P<msg>(?:Resource exhausted|RESOURCE_EXHAUSTED) : (?:OOM|Out of memory))"),
             parse_tensorflow),
    Detector("tensorflow", 0, regex(r"(?P<msg>Allocator \([^)]{1,40}\) ran out of memory)"), parse_tensorflow),
    Detector("tensorflow", 0, regex(r"(?P<msg>failed to alloc {SIZE} on (?:host|device)[\s\S]{0,40}?"
                                    r"(?:CUDA_ERROR_OUT_OF_MEMORY|out of memory))"), parse_tensorflow),
    Detector("tensorflow", 0, regex(r"(?P<msg>failed to allocate [0-9.]+ [KMGTPE]?i?B? \([0-9]+ bytes\) from device)"),
             parse_tensorflow),
    Detector("tensorflow", 0, regex(r"ResourceExhaustedError[^:]{0,40}: (?P<msg>failed to allocate memory)"),
             parse_tensorflow),
    Detector("tensorflow", 0, regex(r"(?P<msg>Failed to allocate request for)"), parse_tensorflow),
    Detector("other", 0, regex(r"(?P<msg>NCCL WARN (?:Cuda failure (?:[0-9]+ )?'out of memory'|Failed to CUDA calloc))"),
             parse_other, "cuda"),
    Detector("other", 0, regex(r"(?P<msg>CUDA error 2 at [^\s]{1,200}? : out of memory)"), parse_other, "cuda"),
    Detector("other", 0, regex(r"(?P<msg>allocating {SIZE} on device [0-9]+ : cudaMalloc failed : out of memory)"),
             parse_other, "cuda"),
    Detector("other", 0, regex(r"(?P<msg>cuda failed with error 2 :? out of memory)"), parse_other, "cuda"),
    Detector("other", 0, regex(r"(?P<msg>Could not allocate tensor with {SIZE})"), parse_other),
    Detector("other", 0, regex(r"(?P<msg>Failed to allocate memory for requested buffer of size)"), parse_other),
    Detector("other", 0, regex(r"(?P<msg>CUDA failure 2 : out of memory)"), parse_other, "cuda"),
    Detector("other", 0, regex(r"(?P<msg>Out of memory allocating [0-9][0-9,]* bytes)"), parse_other, "cuda"),
    Detector("other", 0, regex(r"(?P<msg>cuMem[A-Za-z_0-9]{0,20} failed : out of memory)"), parse_other, "cuda"),
    Detector("other", 0, regex(r"(?P<msg>CUresult error(?: result =| :) 2)(?![0-9])"), parse_other, "cuda"),
    # ---- rank 1: status errors without numbers
    # Allocator messages pasted without their first words: anchored on the device clause, which is
    # also inside every full message (where the rank-0 anchor wins), extended back over "Tried to ...".
    Detector("cuda_allocator", 1, regex(r"(?P<msg>\((?P<dev>GPU|NPU) [0-9]+ ; {SIZE} total capacity)"),
             parse_allocator, lead=_lead(_TRIED_LEAD), cuts=False, resumes=_ALLOC_RESUMES),
    Detector("cuda_allocator", 1, regex(r"(?P<msg>(?P<dev>GPU|NPU) [0-9]+ has a total capaci?ty of {SIZE} of which)"),
             parse_allocator, lead=_lead(_TRIED_LEAD + r"\."), cuts=False, resumes=_ALLOC_RESUMES,
             finder_source=r"has\s?a\s?total\s?capaci?ty\s?of", back=32),
    Detector("cuda_error", 1, regex(r"(?P<msg>CUDA [Ee]rror : out of memory)"), parse_cuda_error, "cuda",
             resumes=_ERROR_RESUMES),
    Detector("cuda_error", 1, regex(r"(?P<msg>cuda runtime error \(2\) : out of memory)"), parse_cuda_error, "cuda"),
    # The gap may not run over another "THCudaCheck": without that, every "THCudaCheck FAIL" in a long
    # log made the lazy gap scan 400 characters, and a message never starts one THC line too early.
    Detector("cuda_error", 1, regex(r"(?P<msg>THCudaCheck FAIL(?:(?!THCudaCheck)[\s\S]){0,400}?"
                                    r"error = 2 : out of memory)"),
             parse_cuda_error, "cuda"),
    Detector("cuda_error", 1, regex(r"(?P<msg>CUDA driver error : out of memory)"), parse_cuda_error, "cuda"),
    Detector("cublas", 1, regex(r"(?P<msg>(?:CUBLAS|HIPBLAS)_STATUS_ALLOC_FAILED)"), parse_nothing, "cuda",
             _lead(r"CUDA error :"),
             finder_source=r"blas_status_alloc_failed(?:(?<=cublas_status_alloc_failed)"
                           r"|(?<=hipblas_status_alloc_failed))", back=len("hip")),
    Detector("cudnn", 1, regex(r"(?P<msg>CUDNN_STATUS_(?:ALLOC_FAILED|NOT_ENOUGH_MEMORY)|miopenStatusAllocFailed)"),
             parse_nothing, "cuda", _lead(r"(?:cuDNN|MIOpen) error :"),
             finder_source=r"status(?:(?<=cudnn_status)_(?:alloc_failed|not_enough_memory)"
                           r"|(?<=miopenstatus)allocfailed)", back=len("miopen")),
    Detector("other", 1, regex(r"(?P<msg>(?:CUSOLVER|CUSPARSE|CURAND)_STATUS_ALLOC_FAILED|CUFFT_ALLOC_FAILED)"),
             parse_nothing, "cuda", _lead(r"(?:cuSOLVER|cuSPARSE|cuRAND|cuFFT) error :")),
    Detector("hip", 1, regex(r"(?P<msg>HIP error : out of memory)"), parse_cuda_error, "cuda",
             resumes=_ERROR_RESUMES),
    Detector("xpu", 1, regex(r"(?P<msg>UR_RESULT_ERROR_OUT_OF_(?:DEVICE|HOST)_MEMORY)"),
             parse_nothing, "xpu", _lead(r"UR backend failed\.[^\n]{0,60}?")),
    Detector("xpu", 1, regex(r"(?P<msg>PI_ERROR_OUT_OF_HOST_MEMORY)"), parse_nothing, "xpu",
             _lead(r"Native API failed\.[^\n]{0,60}?")),
    Detector("xpu", 1, regex(r"(?P<msg>ZE_RESULT_ERROR_OUT_OF_(?:DEVICE|HOST)_MEMORY)"), parse_nothing, "xpu"),
    Detector("cpu", 1, regex(r"(?P<msg>posix_memalign\(&data, gAlignment, nbytes\) == 0\. 12 vs 0)"),
             parse_nothing, "cpu", _lead(_ENFORCE_LEAD)),  # before torch 1.2; 12 is ENOMEM
    Detector("cpu", 1, regex(r"(?P<msg>\[Errno 12\] Cannot allocate memory)"), parse_nothing, "cpu"),
    Detector("cpu", 1, regex(r"(?P<msg>Out of memory : Kill(?:ed)? process [0-9]+)"), parse_nothing, "cpu"),
    # ---- rank 2: bare error names, also printed as the tail of richer messages
    Detector("cuda_error", 2, regex(r"(?P<msg>cudaErrorMemoryAllocation)"), parse_cuda_error, "cuda", cuts=False),
    Detector("hip", 2, regex(r"(?P<msg>hipErrorOutOfMemory)"), parse_cuda_error, "cuda", cuts=False),
    Detector("other", 2, regex(r"(?P<msg>CUDA_ERROR_OUT_OF_MEMORY)"), parse_nothing, "cuda",
             _lead(r"Call to [A-Za-z_0-9]{1,40} results in"), cuts=False),
    Detector("cpu", 2, regex(r"(?P<msg>std::bad_alloc)"), parse_nothing, "cpu", cuts=False),
    # Python's own MemoryError only as a traceback's exception line (or its repr, "MemoryError()", which
    # is what an empty MemoryError such as bytearray(2**46)'s prints as), never in prose or source code.
    Detector("cpu", 2, regex(r"^(?P<etype>(?:builtins\.)?MemoryError)(?:\(\)|(?: : (?P<msg>[^\n]*)))?$", re.MULTILINE),
             parse_nothing, "cpu", cuts=False,
             finder_source=r"memoryerror(?:(?<![^\n]memoryerror)|(?<![^\n]builtins\.memoryerror)"
                           r"(?<=builtins\.memoryerror))(?=\s?:|\(\)|\n|\Z)", back=len("builtins.")),
    # ---- rank 3: out-of-memory errors in disguise. Their confidence is what the public reports say.
    # The kernel's OOM killer sends SIGKILL ("Killed"); in the reports found (pytorch/pytorch#8976,
    # open-mmlab/mmrotate#501, hezhangsprinter/DCPDN#12, mittagessen/kraken#266...) the fix was more RAM,
    # fewer workers or a smaller batch. Other signals (Segmentation fault, Aborted, Bus error) are not
    # out of memory and are not matched.
    Detector("cpu", 3, regex(r"(?P<msg>DataLoader worker (?:\(pid [0-9]+\) )?is killed by signal : Killed)"),
             parse_nothing, "cpu", confidence="likely"),
    # cuDNN's try_all raises this once every candidate algorithm failed, and it swallows both
    # CUDAOutOfMemoryError (the workspace did not fit) and CuDNNError on the way. The reports split:
    # a smaller batch fixed marqo-ai/marqo#101, XPixelGroup/DiffBIR#59, TQTQliu/MVSGaussian#18 and
    # ultralytics/yolov5#11250; a cuDNN that does not support the GPU (cuDNN 7 on RTX 30xx) caused
    # gml16/rl-medical#13, CGCL-codes/pFedSD#2 and deepakn97/relationPrediction#37, where a smaller
    # batch did not help. Hence "possible".
    Detector("cudnn", 3, regex(r"(?P<msg>Unable to find a valid cuDNN algorithm to run convolution)"),
             parse_nothing, "cuda", confidence="possible"),
    # Intel's runtimes say "out of resources", not memory; on XPU that is how a device allocation that
    # does not fit surfaces in the IPEX and torch-xpu-ops reports, but the words do not say so.
    Detector("xpu", 3, regex(r"(?P<msg>UR_RESULT_ERROR_OUT_OF_RESOURCES)"), parse_nothing, "xpu",
             _lead(r"UR backend failed\.[^\n]{0,60}?"), confidence="likely"),
    Detector("xpu", 3, regex(r"(?P<msg>PI_ERROR_OUT_OF_RESOURCES)"), parse_nothing, "xpu",
             _lead(r"Native API failed\.[^\n]{0,60}?"), confidence="likely"),
    # cublasCreate allocates the handle's workspace on the device; when that fails cuBLAS reports
    # NOT_INITIALIZED rather than ALLOC_FAILED. Most reports (tensorflow/tensorflow#9489,
    # EleutherAI/lm-evaluation-harness#1689, IBM/aihwkit#479, awslabs/sockeye#897, OpenBMB/VisCPM#3)
    # end in "not enough GPU memory"; a minority are an embedding index out of range
    # (SkyworkAI/Skywork#38) or a CUDA/driver mismatch (mlcommons/algorithmic-efficiency#185).
    Detector("cublas", 3, regex(r"(?P<msg>(?:CUBLAS|HIPBLAS)_STATUS_NOT_INITIALIZED)"), parse_nothing, "cuda",
             _lead(r"CUDA error :"), confidence="likely",
             finder_source=r"blas_status_not_initialized(?:(?<=cublas_status_not_initialized)"
                           r"|(?<=hipblas_status_not_initialized))", back=len("hip")),
), key=lambda det: det.rank))
