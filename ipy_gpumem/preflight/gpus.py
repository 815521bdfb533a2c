"""A small table of GPUs (usable capacity, generation) and the fixed costs a CUDA process pays outside its tensors, per generation.

Capacities are what ``torch.cuda.get_device_properties(i).total_memory`` reports on each card (the
figure in its out-of-memory messages, "... GiB total capacity"), rounded to 10 MiB: a little less
than the marketing size, because the driver keeps some. The fixed costs are stated, not measured
here: the CUDA context created by the first CUDA call (with lazy module loading, the default since
CUDA 11.7 / torch 1.13; eager loading costs several hundred MiB more), and cuBLAS's workspace,
which torch allocates through its caching allocator on the first matrix multiply
(``aten/src/ATen/cuda/CublasHandlePool.cpp``: ``CUBLAS_WORKSPACE_CONFIG`` or, by default,
``4096 * 8 KiB`` = 32 MiB on sm90 (Hopper) and ``4096 KiB * 2 + 16 KiB * 8`` elsewhere). cuDNN's
convolution workspaces depend on the algorithm chosen at run time and are not included.
"""
from __future__ import annotations

import re
from typing import Dict, NamedTuple, Optional, Union

__all__ = ["GPUS", "Gpu", "resolve_gpu", "fixed_costs"]

MiB = 1 << 20
GiB = 1 << 30


class Gpu(NamedTuple):
    """One GPU model: what torch reports as its total memory, and its generation."""

    name: str
    capacity: int          # bytes, torch's total_memory
    generation: str        # "kepler", "pascal", "volta", "turing", "ampere", "ada", "hopper", "blackwell"
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
)}

_ALIASES = {"A100": "A100-40", "V100": "V100-16", "H100": "H100-80", "TESLA T4": "T4", "TESLA P100": "P100",
            "A100-SXM4-40GB": "A100-40", "A100-SXM4-80GB": "A100-80", "A100 80GB PCIE": "A100-80",
            "H100 80GB HBM3": "H100-80", "H100 PCIE": "H100-80", "NVIDIA L4": "L4", "NVIDIA A10G": "A10G"}

#: CUDA context size (bytes) per generation, with lazy module loading; typical figures reported
#: for torch 2.x (nvidia-smi's per-process use minus torch's reserved bytes right after the first
#: CUDA op). They vary by a few tens of MiB with driver and CUDA versions.
CONTEXT_BYTES = {"kepler": 300 * MiB, "pascal": 300 * MiB, "volta": 320 * MiB, "turing": 300 * MiB,
                 "ampere": 420 * MiB, "ada": 420 * MiB, "hopper": 520 * MiB, "blackwell": 560 * MiB}


def _cublas_workspace(sm: Optional[int]) -> int:
    import os

    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 4096 * 8 * 1024 if sm == 90 else 4096 * 1024 * 2 + 16 * 1024 * 8


def fixed_costs(gpu: Optional[Gpu]) -> Dict[str, int]:
    """The bytes a CUDA process needs besides its tensors on ``gpu`` (by name, as stated above)."""
    generation = gpu.generation if gpu is not None else "ampere"
    return {"cuda_context": CONTEXT_BYTES.get(generation, 420 * MiB),
            "cublas_workspace": _cublas_workspace(gpu.sm if gpu is not None else None)}


def _this_gpu() -> Gpu:
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        raise ValueError('"this GPU": no CUDA device is available here; name one (e.g. "T4") or give bytes')
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    sm = props.major * 10 + props.minor
    generation = {3: "kepler", 5: "maxwell", 6: "pascal", 7: "volta" if props.minor < 5 else "turing",
                  8: "ada" if props.minor >= 9 else "ampere", 9: "hopper", 10: "blackwell",
                  12: "blackwell"}.get(props.major, "ampere")
    return Gpu(props.name, int(props.total_memory), generation, sm)


def resolve_gpu(gpu: Union[str, int, Gpu, None]) -> Gpu:
    """A :class:`Gpu` from a name ("T4", "A100-80", "H100"), "this GPU", a size in bytes or a size string."""
    if isinstance(gpu, Gpu):
        return gpu
    if gpu is None or (isinstance(gpu, str) and gpu.strip().lower() in ("this gpu", "this", "current")):
        return _this_gpu()
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
