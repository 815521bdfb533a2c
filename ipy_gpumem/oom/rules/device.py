"""Rules about the device itself: a request larger than it, fragmentation, other processes, the CUDA context, and the shortfall fallback."""
from __future__ import annotations

import keyword
import math
import re
from typing import Mapping, Optional

from ...core.text import clip
from ...core.units import GiB, MiB
from .finding import Finding
from .facts import BATCH, Facts, size_clues
from .words import SIZES_COMMENT, WRONG_SIZE_FIX, b, pct, times

__all__ = ["RULES", "request_exceeds_device", "fragmentation", "other_processes", "cuda_context_and_libraries",
           "shortfall"]

#: A ratio past which nobody meant the size: the number itself is the bug.
ABSURD_RATIO = 1000
_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
_IN_PROCESS = ("the CUDA context, cuBLAS/cuDNN handles, NCCL buffers and other GPU libraries "
               "(TensorFlow, JAX, CuPy)")


def request_exceeds_device(x: Facts) -> Optional[Finding]:
    """The one tensor is larger than the device (or the per-process cap): only its size can change.

    The headline above already states the request and the total, so this finding states the
    consequence and the ratio, never the request again.
    """
    req = x.requested
    if req is None:
        return None
    allowed = x.oom.allowed if x.oom is not None else None
    total = x.memory.total
    if allowed and req > allowed and (total is None or allowed < total):
        limit, what = allowed, f"the {b(allowed)} this process is allowed (set_per_process_memory_fraction)"
    elif total and req > total:
        limit = total
        what = f"all {b(total)} of the machine's RAM" if x.is_host else f"all {b(total)} of {x.memory.label}"
    else:
        return None
    ratio = req / limit
    line = x.user_line()
    clues, _dtype64 = size_clues(x)
    if ratio > ABSURD_RATIO:  # nobody meant to allocate this: the size itself is the bug
        detail = ("A size this far off is a bug in the shape arithmetic (an overflow, a wrong dimension, a "
                  "broadcast)" + (f": `{clip(line, 70)}`." if line else "."))
        fix = WRONG_SIZE_FIX
        names = _operands(line)
        snippet = (f"print([getattr(v, 'shape', v) for v in ({', '.join(names)},)])   {SIZES_COMMENT}"
                   if names else "")
    else:
        pieces = max(2, 2 * math.ceil(ratio))  # each piece at most about half the limit
        detail = ("Check the shape that produced it" + (f" (`{clip(line, 60)}`)" if line else "")
                  + "; if it is right, the work must be split.")
        batch = x.find(BATCH)
        # The request grows with the batch in a forward or backward pass, or when the failing line uses it.
        if batch is not None and (x.phase in ("forward", "backward") or "batch_size" in line):
            detail += (f" If it grows with the batch, batch_size={batch[2].group(1)} must shrink more than "
                       f"{times(ratio)}.")
        # The whole result cannot exist here, so the pieces must never be put back together
        # (``torch.cat`` of them rebuilds exactly the tensor that failed).
        pieces_words = (f"make it in {pieces} pieces and use each piece as it is made (reduce it to what you need, "
                        "or write it to disk), never concatenating them back.")
        if limit == allowed and (total is None or req <= total):
            fix = ("Raise the cap set with torch.cuda.set_per_process_memory_fraction"
                   + (f" ({x.memory.label} has {b(total)})" if total else "") + "; or " + pieces_words)
        else:
            where = "in RAM" if x.is_host else f"on {x.memory.label}"
            fix = f"The full result cannot exist {where}: {pieces_words}"
            if not x.is_host:
                fix += (" If the machine's RAM can hold it, keep the full tensor on the CPU and move one piece at a "
                        "time to the GPU.")
        snippet = (f"total = 0\n"
                   f"for i, piece in enumerate(x.chunk({pieces}, dim=0)):   # x: what the failing line works on\n"
                   f"    out = f(piece)          # the failing operation on one piece: 1/{pieces} of the result\n"
                   "    total += out.sum()      # keep only what you need of it (a sum, a statistic),\n"
                   "    # or write it out: torch.save(out, f\"out_{i}.pt\")\n"
                   "    del out                 # before the next piece")
    if clues:
        detail += " " + " ".join(clues)
    return Finding("request_exceeds_device", f"No amount of freeing helps: the request alone is {times(ratio)} {what}",
                   detail, fix, snippet, None, "certain")


_NAME = re.compile(r"(?<![\w.])([A-Za-z_]\w*)(?![\w(]|\s*=(?!=)|\s*\()")
# Modules and keywords a line names are not what sizes it.
_NOT_OPERANDS = frozenset(keyword.kwlist) | {"torch", "np", "numpy", "math", "F", "nn", "device", "dtype"}


def _operands(line: str) -> list:
    """The plain names a line computes with (``batch_size``, ``x``): not calls, modules, keyword
    arguments or the assigned name."""
    _target, eq, rest = line.partition("=")
    body = rest if eq and not rest.startswith("=") and re.fullmatch(r"\s*[\w.\[\], ]+\s*", _target) else line
    body = body.split("#", 1)[0]
    return list(dict.fromkeys(n for n in _NAME.findall(body) if n not in _NOT_OPERANDS))[:4]


def fragmentation(x: Facts) -> Optional[Finding]:
    """PyTorch holds "reserved but unallocated" memory it cannot hand out in one piece."""
    if not x.is_cuda or x.kind not in ("", "cuda_allocator", "hip"):
        return None
    if (x.oom is not None and x.oom.backend == "cudaMallocAsync") or _conf_has(x.env, "backend", "cudamallocasync"):
        return None  # the async allocator has no "reserved but unallocated" to defragment
    ru, reserved, req, free = x.memory.reserved_unallocated, x.memory.reserved, x.requested, x.free
    if ru is None or ru < 16 * MiB:
        return None
    fits = req is not None and ru >= req
    if not fits and not (reserved and ru > reserved // 5):
        return None
    # Defragmenting makes at most the cached bytes usable, next to what the driver still has free:
    # when even both are short of the request, expandable segments cannot make this one fit.
    short = req - ru - free if req is not None and free is not None and ru + free < req else None
    if short is not None and not x.matters(ru):
        return None
    var = _conf_var(x)
    # A recording of the failure knows the largest free piece: split for certain when it is too small.
    largest = x.recorded.largest_free_block if x.recorded is not None else None
    split = fits and largest is not None and req is not None and largest < req
    detail = (f"PyTorch has {b(ru)} reserved but unallocated"
              + (f" ({pct(ru, reserved)} of {b(reserved)} reserved)" if reserved else "")
              + (f", more than the {b(req)} it tried to allocate: the free pieces are split across "
                 "segments and none is large enough" if fits else ": cached blocks that are too small to reuse")
              + (f" (the largest is {b(largest)}, recorded at the failure)." if split else "."))
    if short is not None:
        detail += (f" Even all of it with the {b(free)} free is {b(short)} short of the request: defragmenting "
                   "helps only together with freeing more.")
    if _conf_has(x.env, "expandable_segments", "true"):
        fix = ("expandable_segments is already on: call torch.cuda.empty_cache() between phases (after "
               "evaluation, before training) or cap block splitting with max_split_size_mb.")
        snippet = "torch.cuda.empty_cache()   # return cached blocks to the driver between phases"
        conf = "possible"
    else:
        current = _conf_value(x.env)
        value = f"{current},expandable_segments:True" if current else "expandable_segments:True"
        # The allocator reads the variable once, when CUDA initializes: hence the restart.
        fix = (f"Set {var}=expandable_segments:True (torch >= 2.1; older: max_split_size_mb:128) in the first "
               "cell, before CUDA initializes: restart the kernel first.")
        snippet = f'import os\nos.environ["{var}"] = "{value}"   # first cell, before torch uses the GPU\nimport torch'
        conf = ("certain" if split else "likely") if fits and short is None else "possible"
    return Finding("fragmentation", f"Fragmentation: {b(ru)} reserved but unallocated", detail, fix, snippet,
                   ru, conf)


def _conf_var(x: Facts) -> str:
    if x.oom is not None:
        m = re.search(r"(PYTORCH_\w*ALLOC_CONF)=expandable", x.oom.message)
        if m:
            return m.group(1)
    return "PYTORCH_HIP_ALLOC_CONF" if x.kind == "hip" else "PYTORCH_CUDA_ALLOC_CONF"


def _conf_value(env: Mapping[str, str]) -> str:
    for var in _CONF_VARS:
        value = env.get(var)
        if value:
            return value
    return ""


def _conf_has(env: Mapping[str, str], key: str, value: str) -> bool:
    for var in _CONF_VARS:
        for item in (env.get(var) or "").split(","):
            k, _, v = item.partition(":")
            if k.strip().lower() == key and v.strip().lower() == value:
                return True
    return False


def other_processes(x: Facts) -> Optional[Finding]:
    """Other processes hold memory on the device; a process that may be this kernel is never offered for kill."""
    if x.is_host:
        return None
    listed = [(pid, n, name) for pid, n, name in x.memory.processes if n]
    mine = [p for p in listed if p[0] in x.maybe_own]
    theirs = [p for p in listed if p[0] not in x.maybe_own]
    if listed:
        others = sum(n for _pid, n, _name in theirs)
        if mine:  # exactly one of these is this kernel; the others hold at least all but the largest
            others += sum(n for _pid, n, _name in mine) - max(n for _pid, n, _name in mine)
    else:
        others = x.memory.other_processes_bytes
    if not others or others < 64 * MiB or not x.matters(others):
        return None
    label = x.memory.label
    if listed:
        named = [_process(p) for p in theirs[:4]]
        if mine:
            named.append(" and ".join(_process(p) for p in mine[:4]) + ": one of these is this kernel")
        count = len(theirs) + max(0, len(mine) - 1)
        title = (f"{count} other process{'es' if count > 1 else ''} hold {b(others)} on {label}" if not mine
                 else f"Other processes hold at least {b(others)} on {label}")
        detail = "; ".join(named) + "."
    else:
        detail = f"{b(others)} is in use beyond this process's {b(x.memory.process_used)}."
        title = f"Other processes hold {b(others)} on {label}"
    detail += " That memory is not PyTorch's to free"
    enough = x.covers(others)
    if enough:
        detail += f"; stopping them would leave room for the {b(x.requested)} request."
    elif enough is False:
        detail += f"; stopping all of them is {x.room(others)}."
    else:
        detail += "."
    if mine:
        # In a container NVML reports host pids: os.getpid() matches none of them, so the
        # kernel's own line cannot be told from another kernel of the same size and program.
        detail += (" This container sees host PIDs, so which one cannot be told, and stopping this kernel would "
                   "lose every variable of the session.")
    else:
        detail += " In containers NVML reports host PIDs, which `kill` inside the container may not see."
    snippet = "!nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv"
    target = _kill_target(x, theirs)
    if target is not None:
        snippet += f"\n!kill {target[0]}   # {b(target[1])}; check the name first"
    fix = ("Stop what you do not need: another notebook's kernel (Jupyter: Kernel > Shut Down in that notebook), "
           "or a stale process after checking nvidia-smi"
           + (", never a PID that may be this kernel." if mine else " (`kill PID`)."))
    return Finding("other_processes", title, detail, fix, snippet, others, "possible" if enough is False else "likely")


def _kill_target(x: Facts, theirs):
    """The process to offer for ``kill``: the smallest one whose memory alone makes room for the
    request, else the largest (the first listed when the shortfall is unknown); never this kernel."""
    sized = [p for p in theirs if p[1]]
    if not sized:
        return None
    if x.shortfall is None:
        return sized[0]
    enough = [p for p in sized if p[1] >= x.shortfall]
    return min(enough, key=lambda p: p[1]) if enough else max(sized, key=lambda p: p[1])


def _process(p) -> str:
    pid, nbytes, name = p
    return f"PID {pid}" + (f" ({name})" if name else "") + f" {b(nbytes)}"


def cuda_context_and_libraries(x: Facts) -> Optional[Finding]:
    """More than a CUDA context's worth of this process's device memory is outside PyTorch's allocator."""
    m = x.memory
    if x.is_host or x.kind == "mps" or m.total is None:
        return None
    total = m.total
    inside = m.non_pytorch_in_process
    split_known = inside is not None
    upto = False
    if inside is None and m.processes and m.outside_pytorch is not None:
        mine = [n for pid, n, _name in m.processes if pid in x.maybe_own and n is not None]
        if mine and m.reserved is not None:
            # This kernel is one of these lines: its share outside PyTorch is at most the largest's.
            inside, split_known, upto = max(0, max(mine) - m.reserved), True, True
        elif not x.maybe_own:
            # Every other process is listed: the rest of "outside PyTorch" is this one's.
            inside, split_known = max(0, m.outside_pytorch - (m.other_processes_bytes or 0)), True
    amount = inside if split_known else m.outside_pytorch
    # A CUDA context alone takes a few hundred MiB: only more than that is worth a finding.
    if amount is None or not (amount >= GiB or (amount >= 512 * MiB and amount >= total // 10)):
        return None
    mostly_others = not split_known and amount > total // 2
    xla = sorted(name for name in ("tensorflow", "jax") if name in x.modules)
    if split_known:
        title = f"{'Up to ' if upto else ''}{b(amount)} of this process's {m.label} memory is outside PyTorch's allocator"
        if upto:
            detail = (f"This kernel is one of the listed processes and PyTorch reserved {b(m.reserved)}: the rest of "
                      f"its line, {_IN_PROCESS}, is at most {b(amount)}.")
        elif m.process_used is not None:
            detail = (f"This process uses {b(m.process_used)} but PyTorch reserved {b(m.reserved)}: "
                      f"the rest is {_IN_PROCESS}.")
        else:
            detail = (f"{b(m.used)} is in use; PyTorch reserved {b(m.reserved)} and other processes "
                      f"hold {b(m.other_processes_bytes)}: the rest is {_IN_PROCESS}.")
    elif mostly_others:
        title = f"{b(amount)} of {m.label} is used outside PyTorch's allocator"
        detail = (f"{b(m.used)} is in use but PyTorch reserved only {b(m.reserved)}: "
                  f"{pct(amount, total)} of the device is held by another process or another framework in this "
                  "kernel (a CUDA context alone is a few hundred MiB).")
    else:
        title = f"{b(amount)} of {m.label} is used outside PyTorch's allocator"
        detail = (f"{b(m.used)} is in use but PyTorch reserved {b(m.reserved)}: the rest is the CUDA "
                  "context, other libraries or other processes (the message does not say which).")
    if xla:
        detail += (f" {' and '.join(xla)} is imported in this kernel: JAX preallocates 75% of the GPU by default "
                   "(90% in older versions) and TensorFlow maps nearly all of it.")
        room = x.room(amount)
        if room:
            detail += f" Stopping the preallocation frees up to {b(amount)}: {room}."
        fix = ("Stop TensorFlow/JAX from preallocating (set the variables before importing them), or use one "
               "framework per kernel.")
        snippet = ('import os\nos.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"   # JAX, before import jax\n'
                   "import tensorflow as tf\n"
                   "for gpu in tf.config.list_physical_devices('GPU'):\n"
                   "    tf.config.experimental.set_memory_growth(gpu, True)")
    else:
        fix = ("Check nvidia-smi and the imported GPU libraries for what holds it: move TensorFlow, JAX or CuPy work "
               "to its own process or stop it preallocating (the CUDA context itself cannot be freed).")
        snippet = ("!nvidia-smi\n"
                   "import sys; print([m for m in ('tensorflow', 'jax', 'cupy', 'tensorrt') if m in sys.modules])")
    return Finding("cuda_context_and_libraries", title, detail, fix, snippet, amount if xla else None,
                   "likely" if (split_known and not upto) or mostly_others else "possible")


def shortfall(x: Facts) -> Finding:
    """The fallback when no rule found a cause: how far short the request fell, and which layers hold the memory.

    The headline already says what was asked and what was free, so the title says what to free.
    On the host, a request of unknown size or one that fitted in what was available gets what is
    known and what to check instead: freeing memory is not shown to be the fix there.
    """
    m, req, free = x.memory, x.requested, x.free
    where = x.device_label
    if x.is_host and (req is None or (free is not None and req <= free)):
        return _host_limit(x)
    if req is not None and free is not None and req <= free:
        title = f"The request fits in the {b(free)} free on {where}: the total is not the problem"
        detail = ("The request is smaller than the free memory the driver reported, so the failure is not about the "
                  "total: a per-allocation size limit of the driver (Intel GPUs cap single allocations), fragmentation "
                  "of the driver's free memory, or another process taking memory between the check and the allocation.")
        fix = "Split the tensor into smaller pieces (x.chunk(...)) and retry after torch.cuda.empty_cache()."
        return Finding("shortfall", title, detail, fix, "", None, "possible")
    if x.shortfall is not None:
        title = f"Free at least {b(x.shortfall)} on {where}"
    elif m.total:
        title = f"Out of memory on {where} ({b(m.total)} total)"
    else:
        title = f"Out of memory on {where}"
    layers = _layer_words(x)
    detail = ("Of the memory: " + ", ".join(layers) + ". ") if layers else ""
    said = (x.oom.message or x.oom.exception_type or x.oom.kind) if x.oom is not None else ""
    if said and (req is None or not layers):
        detail += f'The error says: "{clip(said, 80)}".'
    if x.is_host:
        fix = ("Free " + (f"at least {b(x.shortfall)} of " if x.shortfall else "") + "what you no longer need "
               "(`del` large arrays, then gc.collect()), process the data in chunks, or use a machine with more RAM.")
    elif req is None:
        fix = ("The error does not say how much was asked: `del` tensors you no longer need (ipy_gpumem.who() shows "
               "which) or lower the batch size, then torch.cuda.empty_cache(), and retry.")
    else:
        fix = ("Free " + (f"at least {b(x.shortfall)}" if x.shortfall else "memory") + ": `del` tensors you no "
               "longer need (ipy_gpumem.who() shows which) or lower the batch size, then call "
               "torch.cuda.empty_cache().")
    return Finding("shortfall", title, detail.strip() or title, fix, "", None, "possible")


#: How to read the limits that refuse host memory before RAM runs out.
_HOST_LIMITS = ("import resource; print(resource.getrlimit(resource.RLIMIT_AS))   # ulimit -v: (-1, -1) is none\n"
                "!cat /sys/fs/cgroup/memory.max /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null"
                "   # a container's limit")


def _host_limit(x: Facts) -> Finding:
    """The host refused a request of unknown size, or one smaller than what was available: what is
    known, and what to check (the failing line's sizes, the process's and the container's limits)."""
    req, free, rss = x.requested, x.free, x.memory.process_used
    line = x.user_line()
    names = _operands(line)
    sizes = (f"print([getattr(v, 'shape', v) for v in ({', '.join(names)},)])   {SIZES_COMMENT}\n"
             if names else "")
    limits = ("a container's memory limit (cgroup: /proc/meminfo shows the whole machine, not the container), the "
              "address-space limit (ulimit -v) or the kernel's overcommit policy")
    said = clip(x.oom.message or x.oom.exception_type or "", 80) if x.oom is not None else ""
    if req is None:
        title = "The request's size is unknown" + (f": more than the {b(free)} available, or a limit" if free else "")
        detail = ((f'The error says "{said}", not how much was asked' if said else
                   "The error does not say how much was asked")
                  + (f"; {b(free)} was available, so the allocation asked for more than that, or {limits} refused it "
                     "first." if free else f": RAM ran out, or {limits} refused it."))
        if "DataLoader worker" in said:
            detail += (" Each DataLoader worker is a process with its own memory: fewer workers (num_workers) or a "
                       "smaller prefetch_factor use less.")
        if rss and free and not x.matters(rss):
            detail += (f" This process holds {b(rss)} in all, little next to a request larger than {b(free)}: "
                       "freeing it is not the fix.")
        fix = ("Find what the failing line asks for" + (f" (`{clip(line, 60)}`)" if line else "")
               + " and check its sizes; if they are what you meant, check the limits.")
    else:
        title = f"The request fits in the {b(free)} available: a limit refused it"
        detail = f"The host had more RAM available than the request, so the allocation was refused by {limits}."
        fix = "Check the limits: raise the container's memory limit or ulimit -v, or make the allocation smaller."
    return Finding("shortfall", title, detail, fix, sizes + _HOST_LIMITS, None, "possible")


def _layer_words(x: Facts):
    """``["11.91 GiB allocated by PyTorch", ...]`` for the layers the memory model knows."""
    m = x.memory
    if x.is_host:
        pairs = ((m.process_used, "used by this process (RSS)"),
                 (m.used - m.process_used if m.used is not None and m.process_used is not None else None,
                  "by other processes and the OS"))
    else:
        pairs = ((m.allocated, "allocated by PyTorch"), (m.reserved_unallocated, "reserved but unallocated"),
                 (m.outside_pytorch, "used outside PyTorch"))
    return [f"{b(max(0, v))} {label}" for v, label in pairs if v is not None]


RULES = (request_exceeds_device, fragmentation, other_processes, cuda_context_and_libraries)
