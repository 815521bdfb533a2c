"""Rules for failures outside CUDA's caching allocator: host RAM and its process limits, cuBLAS and cuDNN, MPS, other runtimes."""
from __future__ import annotations

import re
from typing import Optional

from ...core.text import clip
from .finding import Finding
from .facts import BROADCAST, FLOAT64, Facts, message_shape, size_clues
from .words import WRONG_SIZE_FIX, b, pct

__all__ = ["RULES", "process_limit", "cpu_oom", "cublas_cudnn", "mps", "other_runtime"]

#: Past this no tensor is meant: 1 PiB.
_ABSURD_BYTES = 2 ** 50
# A file read whole into memory, which a memory map would read on demand.
_LOADS = re.compile(r"\b(?:np|numpy)\.load\s*\(|\btorch\.load\s*\(")


def process_limit(x: Facts) -> Optional[Finding]:
    """A host allocation refused by a process limit (RLIMIT_AS, RLIMIT_DATA, a cgroup's memory.max), not by RAM."""
    lim = x.limit
    if lim is None or not x.is_host:
        return None
    used = f"; this process already used {b(lim.used)} of it" if lim.used is not None else ""
    asked = f", so the {b(x.requested)} request did not fit" if x.requested is not None else ""
    detail = f"{lim.words[0].upper() + lim.words[1:]} is {b(lim.limit)}{used}{asked}."
    free = x.free
    if free is not None:
        detail += f" The machine still had {b(free)} of RAM available: the limit refused it, not the RAM."
    if lim.name == "RLIMIT_AS":
        detail += (" The address-space limit counts every mapping, reserved or not (thread stacks, CUDA's and "
                   "the allocator's reservations), so it is reached long before the memory is used.")
    fix = {"RLIMIT_AS": "Raise the limit (ulimit -v in the shell that starts Jupyter, or resource.setrlimit up to its "
                        "hard limit), or make the allocation smaller.",
           "RLIMIT_DATA": "Raise the limit (ulimit -d in the shell that starts Jupyter, or resource.setrlimit up to its "
                          "hard limit), or make the allocation smaller."}.get(
        lim.name, "Give the container more memory (its memory limit), or make the allocation smaller.")
    snippet = ("import resource\n"
               f"soft, hard = resource.getrlimit(resource.{lim.name})\n"
               f"resource.setrlimit(resource.{lim.name}, (hard, hard))   # up to the hard limit") \
        if lim.name.startswith("RLIMIT") else "!cat /sys/fs/cgroup/memory.max /sys/fs/cgroup/memory.current"
    certain = x.requested is not None and lim.headroom is not None and x.requested > lim.headroom and \
        (free is None or x.requested <= free)
    return Finding("process_limit", f"{lim.name} refused it: {b(lim.limit)} for this process", detail, fix, snippet,
                   None, "certain" if certain else "likely")



def cpu_oom(x: Facts) -> Optional[Finding]:
    """The host ran out of RAM: what made the request large (a shape, a broadcast, float64), and chunks."""
    if not x.is_host or x.kind not in ("cpu", ""):
        return None
    req, ram = x.requested, x.memory.total
    shape = message_shape(x.oom)
    if req is None and shape is None:
        return None
    if req is None:
        req = shape[2]
    clues, dtype64 = size_clues(x)
    bcast, f64 = x.find(BROADCAST), x.find(FLOAT64)
    limited = x.limit is not None  # a process limit refused it (process_limit says which): RAM did not run out
    if limited and not (bcast or dtype64 or shape is not None or req >= _ABSURD_BYTES):
        return None
    parts = list(clues)
    if ram and not limited:
        parts.insert(0, f"The request is {pct(req, ram)} of the machine's {b(ram)} of RAM"
                     + (f", {b(x.shortfall)} more than was available." if x.shortfall else "."))
    line = x.user_line()
    if req >= _ABSURD_BYTES:
        # Without the user's line, the size itself is the only thing to point at.
        parts.append("A size this large is almost always a wrong number: an overflowed or mixed-up shape"
                     + (f" in `{clip(line, 60)}`." if line else f" ({b(req)})."))
    # The title names the strongest clue; the headline above already says what was asked.
    if bcast is not None:
        title = f"A broadcast builds an N×N result: `{clip(bcast[1], 50)}`"
    elif dtype64:
        title = "float64 doubles the request" + (f": `{clip(f64[1], 50)}`" if f64 else "")
    elif shape is not None:
        title = f"The array the message names: shape ({clip(shape[0], 40)}) of {shape[1]}, {b(shape[2])}"
    elif req >= _ABSURD_BYTES:
        title = (f"`{clip(line, 40)}` asks" if line else "The request asks") + " for more RAM than any machine has"
    elif x.shortfall:
        title = f"Host RAM: {b(x.shortfall)} more than was available"
    else:
        title = "Host RAM ran out" + (f" ({b(ram)} in all)" if ram else "")
    # Each change offered must be able to shrink this request: float32 only where float64 is in
    # play, memory-mapping only where the code loads a file, and chunks whose results are used as
    # they come (concatenating them would rebuild the very array that did not fit).
    load = x.find(_LOADS)
    free = x.free
    half = ""
    if dtype64 and free is not None and req // 2 > free:
        half = (f" (float32 halves the request, still {b(req // 2 - free)} more than was available: chunks are "
                "needed too)")
    fix = ("Check that the failing line's shapes are what you meant"
           + (f"; use torch.float32 or bfloat16 instead of float64{half}" if dtype64 else "")
           + "; process the data in chunks and keep only what you need of each (a sum, a statistic, a file), never "
           "the whole result" + ("; memory-map the file instead of loading it whole" if load else "") + ".")
    lines = ["print(x.shape, x.dtype)            # is this the size you meant?"]
    if req >= _ABSURD_BYTES:  # a wrong number: no chunking makes it right
        fix = WRONG_SIZE_FIX
        load = None
    elif dtype64:
        lines.append("x = x.to(torch.float32)            # float64 doubles memory")
    if req < _ABSURD_BYTES:
        lines += ["total = 0",
                  "for piece in x.split(4096):         # in chunks: one piece's result at a time",
                  "    total += f(piece).sum()         # keep what you need of it, never concatenate the pieces"]
    if load:
        lines.append("data = np.load(path, mmap_mode=\"r\")   # memory-mapped, read on demand"
                     if "np" in load[2].group(0) or "numpy" in load[2].group(0) else
                     "state = torch.load(path, mmap=True)   # memory-mapped, read on demand (torch >= 2.1)")
    snippet = "\n".join(lines)
    detail = " ".join(parts) or f"The CPU allocator could not provide {b(req)}."
    return Finding("cpu_oom", title, detail, fix, snippet, req // 2 if dtype64 else None,
                   "likely" if (bcast or dtype64 or shape or (ram and req > ram)) else "possible")


def cublas_cudnn(x: Facts) -> Optional[Finding]:
    """cuBLAS, cuDNN or the CUDA runtime could not allocate: the device was nearly full before PyTorch's cache gave back."""
    if x.kind not in ("cublas", "cudnn", "cuda_error"):
        return None
    name = clip(x.oom.message, 60) if x.oom is not None else x.kind
    lib = {"cublas": "cuBLAS", "cudnn": "cuDNN"}.get(x.kind, "The CUDA runtime")
    numbers = _device_fullness(x)
    ru = x.memory.reserved_unallocated
    detail = (f'"{name}": {lib} needed memory of its own (handles, workspaces) outside PyTorch\'s caching allocator. '
              "These errors fire when the device is already nearly full" + (f": {numbers}." if numbers else "."))
    if ru:
        detail += (f" PyTorch's cache holds {b(ru)} reserved but unallocated that {lib} cannot use until "
                   "empty_cache() returns it.")
    if x.kind == "cuda_error":
        detail += " Kernel errors are reported asynchronously: run with CUDA_LAUNCH_BLOCKING=1 to see the real line."
    # Only what bears on this library: giving the cache back helps when there is a cache to give,
    # autotuning's workspaces are cuDNN's, the workspace variable is cuBLAS's.
    fix = ["Treat it like a regular OOM (smaller batch, free tensors, check other processes with nvidia-smi)"]
    snippet = []
    if ru and x.matters(ru):
        fix.append(f"torch.cuda.empty_cache() before the failing op gives the {b(ru)} cache back")
        snippet.append("torch.cuda.empty_cache()                  # return PyTorch's cache to the driver")
    if x.kind == "cudnn":
        fix.append("torch.backends.cudnn.benchmark = False avoids large workspaces")
        snippet.append("torch.backends.cudnn.benchmark = False     # no workspace-hungry autotuning")
    if x.kind == "cublas":
        snippet.append("# last resort, before CUDA starts (slower): os.environ[\"CUBLAS_WORKSPACE_CONFIG\"] = \":0:0\"")
    return Finding(
        key="cublas_cudnn",
        title=f"{lib} could not allocate: the device was nearly full" + (f" ({numbers})" if numbers else ""),
        detail=detail,
        fix="; ".join(fix) + ".",
        snippet="\n".join(snippet),
        frees=ru if ru and x.matters(ru) else None,
        confidence="likely",
    )


def _device_fullness(x: Facts) -> str:
    """``"15.60 GiB of 15.78 GiB in use"`` from the memory model, else from the latest record, else ""."""
    m = x.memory
    if m.used is not None and m.total:
        return f"{b(m.used)} of {b(m.total)} in use"
    if m.reserved is not None and m.total:
        return f"PyTorch reserved {b(m.reserved)} of {b(m.total)}"
    for rec, dev in x.device_records():
        if dev.total:
            used = dev.used_after if dev.used_after is not None else dev.reserved_after
            if used is not None:
                return f"{b(used)} of {b(dev.total)} in use after {rec.label}"
    return ""


def mps(x: Facts) -> Optional[Finding]:
    """Apple's MPS allocator hit its high watermark: allocated + other + requested > max allowed."""
    if x.kind != "mps" or x.oom is None:
        return None
    o = x.oom
    parts = [p for p in (o.allocated_by_pytorch, o.other_allocations, x.requested) if p is not None]
    if not parts:
        return None
    need = sum(parts)
    title = (f"MPS limit: {b(o.allocated_by_pytorch)} allocated + {b(o.other_allocations)} other + "
             f"{b(x.requested)} requested > {b(o.max_allowed)} max allowed")
    return Finding(
        key="mps",
        title=title,
        detail=(f"The MPS allocator caps memory at the high watermark ({b(o.max_allowed)}); this allocation would "
                f"bring it to {b(need)}. Unified memory is shared with macOS and every other app."),
        fix=("Free tensors and call torch.mps.empty_cache(), lower the batch size; only as a last resort raise the "
             "limit with PYTORCH_MPS_HIGH_WATERMARK_RATIO (0.0 removes it and can freeze the system)."),
        snippet=("torch.mps.empty_cache()\n"
                 "# last resort, before import torch (0.0 = no limit: macOS may swap hard or freeze):\n"
                 "# os.environ[\"PYTORCH_MPS_HIGH_WATERMARK_RATIO\"] = \"0.0\""),
        frees=None,
        confidence="likely",
    )


def other_runtime(x: Facts) -> Optional[Finding]:
    """TensorFlow or another runtime with its own buffers (NCCL, llama.cpp, an extension) ran out."""
    if x.oom is None or x.kind not in ("tensorflow", "other"):
        return None
    o = x.oom
    shape = message_shape(o)
    quoted = clip(o.message, 80)
    if x.kind == "tensorflow":
        what = f'"{quoted}": TensorFlow\'s allocator failed' + (
            f" on a tensor of shape [{shape[0]}] ({shape[1]}), {b(shape[2])}." if shape else ".")
        return Finding(
            key="other_runtime",
            title="TensorFlow ran out of memory" + (f": a {b(shape[2])} tensor" if shape else ""),
            detail=what + " TensorFlow maps nearly all GPU memory at start unless memory growth is on.",
            fix="Lower the batch size, and turn on memory growth so TensorFlow leaves room for other work.",
            snippet=("for gpu in tf.config.list_physical_devices('GPU'):\n"
                     "    tf.config.experimental.set_memory_growth(gpu, True)   # before any op"),
            frees=None, confidence="possible")
    return Finding(
        key="other_runtime",
        title=f'A library outside PyTorch ran out of device memory: "{clip(o.message, 50)}"',
        detail=(f'"{quoted}" comes from a runtime with its own buffers (NCCL, llama.cpp, a CUDA extension). It fails '
                "when PyTorch's cache and tensors already fill the device."),
        fix=("Give memory back before that call: free tensors, torch.cuda.empty_cache(), or a smaller batch; "
             "check nvidia-smi for other processes."),
        snippet=("torch.cuda.empty_cache()   # return PyTorch's unused cache to the driver\n"
                 if x.memory.reserved_unallocated else "") + "!nvidia-smi",
        frees=x.memory.reserved_unallocated or None, confidence="possible")


RULES = (process_limit, cpu_oom, cublas_cudnn, mps, other_runtime)
