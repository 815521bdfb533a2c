"""A small table of GPUs (usable capacity, generation), the fixed cost a CUDA process pays outside the caching allocator (its CUDA context), and the size of cuBLAS's workspace on each.

Capacities are what ``torch.cuda.get_device_properties(i).total_memory`` reports on each card (the
figure in its out-of-memory messages, "... GiB total capacity"), rounded to 10 MiB: a little less
than the marketing size, because the driver keeps some. The one fixed cost is the CUDA context the
first CUDA call creates (with lazy module loading, the default since CUDA 11.7 / torch 1.13; eager
loading costs several hundred MiB more): it is stated, from the public readings cited at
:data:`CONTEXT_BYTES`, not measured here. cuBLAS's workspace is not a fixed cost: torch takes it
from its caching allocator at the first matrix multiply of each thread, so it is PyTorch memory
(allocated and reserved) and the estimate replays it as an allocation (``cudalike``);
:func:`cublas_workspace` gives its size. cuDNN's convolution workspaces depend on the algorithm
chosen at run time and are not included.
"""
from __future__ import annotations

import re
from typing import Dict, NamedTuple, Optional, Union

__all__ = ["GPUS", "Gpu", "resolve_gpu", "fixed_costs", "cublas_workspace", "card_named", "CONTEXT_BYTES"]

MiB = 1 << 20
GiB = 1 << 30


class Gpu(NamedTuple):
    """One GPU model: what torch reports as its total memory, and its generation."""

    name: str
    capacity: int          # bytes, torch's total_memory
    #: "kepler", "pascal", "volta", "turing", "ampere", "ada", "hopper", "blackwell"; non-NVIDIA:
    #: "cdna3" (AMD Instinct MI300), "xe-hpc" (Intel Data Center GPU Max), "apple" (Apple silicon, MPS)
    generation: str
    sm: Optional[int] = None


def _g(name, gib, generation, sm):
    return Gpu(name, int(round(gib * 1024)) * MiB, generation, sm)


#: Usable capacity (torch's total_memory, as its OOM messages print it) of common cards.
GPUS: Dict[str, Gpu] = {g.name: g for g in (
    _g("K80", 11.17, "kepler", 37),
    _g("P100", 15.89, "pascal", 60),
    _g("T4", 14.75, "turing", 75),
    _g("V100-16", 15.77, "volta", 70),
    _g("V100-32", 31.74, "volta", 70),
    _g("A10G", 22.19, "ampere", 86),
    _g("A10", 22.06, "ampere", 86),
    _g("RTX3090", 23.69, "ampere", 86),
    _g("RTX4090", 23.64, "ada", 89),
    _g("A6000", 47.53, "ampere", 86),
    _g("L4", 22.03, "ada", 89),
    _g("L40S", 44.39, "ada", 89),
    _g("A100-40", 39.39, "ampere", 80),
    _g("A100-80", 79.15, "ampere", 80),
    _g("H100-80", 79.10, "hopper", 90),
    _g("H200", 139.80, "hopper", 90),
    _g("B200", 178.35, "blackwell", 100),
    # Not NVIDIA (issue 32). MI300X: 191.98 GiB, the "total capacity" of its HIP out-of-memory
    # messages (tests/fixtures/backends/rocm.json). Max 1550: 65,520 MiB per device torch sees (each
    # of its two stacks), torch.xpu.get_device_properties in intel/torch-xpu-ops#3888's CI logs.
    # M3 Max 36GB: what MPS can use without swapping is Metal's recommended working set, which the
    # messages of 8, 16 and 64 GB Macs put at 2/3 of RAM up to 16 GB and 3/4 at 64 GB; for 36 GB
    # 3/4 (27 GiB) is ASSUMED (no public reading of one was found). Its allocator's own limit is
    # 1.7 times that (45.90 GiB, more than the RAM): a step above 27 GiB may still run, swapping.
    _g("MI300X", 191.98, "cdna3", None),
    _g("Max 1550", 65520 / 1024, "xe-hpc", None),
    _g("M3 Max 36GB", 27.00, "apple", None),
)}

_ALIASES = {"A100": "A100-40", "V100": "V100-16", "H100": "H100-80", "TESLA T4": "T4", "TESLA P100": "P100",
            "A100-SXM4-40GB": "A100-40", "A100-SXM4-80GB": "A100-80", "A100 80GB PCIE": "A100-80",
            "H100 80GB HBM3": "H100-80", "H100 PCIE": "H100-80", "NVIDIA L4": "L4", "NVIDIA A10G": "A10G",
            "AMD-INSTINCT-MI300X": "MI300X", "AMD INSTINCT MI300X": "MI300X",
            "MAX-1550": "Max 1550", "INTEL-MAX-1550": "Max 1550", "INTEL(R)-DATA-CENTER-GPU-MAX-1550": "Max 1550",
            "INTEL(R) DATA CENTER GPU MAX 1550": "Max 1550",
            "M3-MAX-36GB": "M3 Max 36GB", "APPLE-M3-MAX-36GB": "M3 Max 36GB", "M3-MAX-36": "M3 Max 36GB"}

#: CUDA context size (bytes) per generation, with lazy module loading: what nvidia-smi shows for a
#: process beyond torch's reserved bytes once it has run a step. Public readings (they move by tens
#: of MiB with the driver, the CUDA version and the kernels a step loads):
#: - "~300MB" with lazy loading, ptrblck in pytorch/pytorch#107667 (2023-08): kepler to turing;
#: - "around 400MB if CUDA >= 11.7 is used and lazy module loading enabled", ptrblck in
#:   pytorch/pytorch#109888 (2023-09); a bare context of 256 MiB before any kernel is loaded on an
#:   RTX 3090 with torch 2.7.1+cu128 (invoke-ai/InvokeAI#9413, 2025): ampere and ada;
#: - 0.33 GiB "non_torch_memory" after a profiling run on an RTX 5090 (vllm-project/vllm#14452, 2025);
#: - before lazy loading the same context took 721 MB on a GTX 1080 and 1687 MB on an RTX 3090
#:   (pytorch/pytorch#55277): it grows with the kernels built for the architecture.
#: No public H100 or B200 reading was found: hopper and blackwell are extrapolated (more kernels
#: per architecture), and ``%%gpumem`` on the card itself measures it.
#: Not NVIDIA, all ASSUMED (no public reading of the size was found): a HIP context on MI300X as
#: Hopper's (ROCm's start-up overhead is larger than CUDA's, vllm-project/vllm#43236, unmeasured);
#: a Level Zero context on a Max 1550 as Turing's; none on Apple silicon (unified memory: MPS keeps no
#: device context, and MPSGraph's buffers are counted in torch.mps.driver_allocated_memory()).
CONTEXT_BYTES = {"kepler": 300 * MiB, "pascal": 300 * MiB, "volta": 320 * MiB, "turing": 300 * MiB,
                 "ampere": 420 * MiB, "ada": 420 * MiB, "hopper": 520 * MiB, "blackwell": 560 * MiB,
                 "cdna3": 520 * MiB, "xe-hpc": 300 * MiB, "apple": 0}


def cublas_workspace(gpu: Optional[Gpu]) -> int:
    """Bytes of one cuBLAS workspace on ``gpu``: torch's ``getChosenWorkspaceSize()``.

    ``aten/src/ATen/cuda/CublasHandlePool.cpp`` (torch 2.13): ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT``
    pairs, SIZE in KiB, summed as SIZE * COUNT) or, by default, ``4096 * 8`` KiB = 32 MiB on compute
    capability 9.x, 10.x and 12.x (Hopper, Blackwell) and ``:4096:2:16:8`` = 8,519,680 bytes elsewhere
    (the size the real captures in ``../shared/gpu-captures`` show). cuBLASLt shares it by default
    (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``). A card of unknown architecture counts as the default.
    """
    import os

    if gpu is not None and gpu.generation in ("apple", "xe-hpc"):
        return 0  # no cuBLAS on MPS or XPU (oneDNN and MPSGraph keep their own scratch)
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    sm = gpu.sm if gpu is not None else None
    return 4096 * 8 * 1024 if sm is not None and sm // 10 in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8


#: The driver context each vendor's generations pay, by the key :func:`fixed_costs` gives it (the
#: words are ``result.COST_WORDS``): a HIP context on AMD (ROCm, through the same torch.cuda), a
#: Level Zero context on Intel; NVIDIA's and any card not listed here is a CUDA context.
CONTEXT_KIND = {"cdna3": "hip_context", "xe-hpc": "level_zero_context"}


def fixed_costs(gpu: Optional[Gpu]) -> Dict[str, int]:
    """The bytes a process needs outside the caching allocator on ``gpu``: its driver context (CUDA's,
    HIP's on ROCm, Level Zero's on an Intel GPU; none on Apple silicon)."""
    generation = gpu.generation if gpu is not None else "ampere"
    context = CONTEXT_BYTES.get(generation, 420 * MiB)
    return {CONTEXT_KIND.get(generation, "cuda_context"): context} if context else {}


#: Cards met as "this GPU" in this process, by name: the sealed child (a fork) finds them by the
#: name the estimate passes it (:func:`card_named`).
_SEEN: Dict[str, Gpu] = {}


def card_named(name: Optional[str]) -> Optional[Gpu]:
    """The :class:`Gpu` an estimate was given by name (a table name, an alias, or "this GPU"'s), or None."""
    if not name:
        return None
    if name in _SEEN:
        return _SEEN[name]
    try:
        return resolve_gpu(name)
    except ValueError:
        return None


def _this_gpu() -> Gpu:
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        # Reading a device's properties would initialise CUDA (a context of hundreds of MiB) in a
        # process that has not asked for it.
        raise ValueError('"this GPU": no CUDA device is in use here; name one (e.g. "T4") or give bytes')
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    sm = props.major * 10 + props.minor
    generation = {3: "kepler", 5: "maxwell", 6: "pascal", 7: "volta" if props.minor < 5 else "turing",
                  8: "ada" if props.minor >= 9 else "ampere", 9: "hopper", 10: "blackwell",
                  12: "blackwell"}.get(props.major, "ampere")
    card = _SEEN[props.name] = Gpu(props.name, int(props.total_memory), generation, sm)
    return card


def resolve_gpu(gpu: Union[str, int, Gpu, None], fallback: Optional[str] = None) -> Gpu:
    """A :class:`Gpu` from a name ("T4", "A100-80", "H100"), "this GPU", a size in bytes or a size string.

    ``fallback`` names the card to use for "this GPU" (or None) when no CUDA device is in use here.
    """
    if isinstance(gpu, Gpu):
        return gpu
    if gpu is None or (isinstance(gpu, str) and gpu.strip().lower() in ("this gpu", "this", "current")):
        try:
            return _this_gpu()
        except ValueError:
            if fallback is None:
                raise
            return GPUS[fallback]
    if isinstance(gpu, (int, float)) and not isinstance(gpu, bool):
        return Gpu(f"{int(gpu)} bytes", int(gpu), "ampere", None)
    if isinstance(gpu, str):
        key = gpu.strip().upper().replace("NVIDIA ", "").replace("_", "-").replace(" ", "-")
        for name in (key, key.replace("-", " "), _ALIASES.get(key), _ALIASES.get(key.replace("-", " ")),
                     _ALIASES.get(gpu.strip().upper())):
            if name and name in GPUS:
                return GPUS[name]
        m = re.fullmatch(r"(?:A100|H100|V100)-?(\d+)(?:GB?)?", key)
        if m:
            for name in GPUS:
                if name.startswith(key[:4]) and name.endswith(m.group(1)):
                    return GPUS[name]
        try:
            from ..core.units import parse_bytes

            return Gpu(gpu, parse_bytes(gpu), "ampere", None)
        except (ValueError, TypeError):
            pass
    raise ValueError(f"unknown GPU {gpu!r}: name one of {', '.join(GPUS)}, say \"this GPU\", or give a size in bytes")
