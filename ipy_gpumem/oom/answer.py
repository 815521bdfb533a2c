"""The OOM panel's first line: one sentence that says what needed the memory and why it did not fit, with the numbers.

``Out of memory on cuda:0: attention scores of 16 x 12 x 2048² in fp32 need 3.00 GiB; 1.12 GiB was free
(14.75 GiB total)``. What needed it is the operation the frames name (sized by its own arithmetic when
the request matches it), else the phase that made the request (the forward pass, the backward pass,
the optimizer's update), else the request alone. Why it did not fit is what the numbers say: a process
limit, a request larger than the device, memory split into pieces too small, or simply what was free.
When nothing is known beyond the error's own numbers, the line is those numbers (:func:`restated`),
and the panel does not repeat them below it.
"""
from __future__ import annotations

import re
from typing import Optional

from ..core.memory import DeviceMemory
from ..core.units import format_bytes

__all__ = ["answer", "restated", "where_words"]

_PHASE = {"forward": "the forward pass", "backward": "the backward pass", "step": "the optimizer's update"}
_COMMON = frozenset({"The", "A", "An", "Attention", "Cross-entropy's", "Autograd's"})
_PLURAL = re.compile(r"^(?:Attention scores|Cross-entropy's log-probabilities)")


def where_words(memory: DeviceMemory) -> str:
    """``cuda:0``, ``the host (cpu)`` or ``an unknown device``."""
    return "the host (cpu)" if memory.is_host else ("an unknown device" if memory.device is None else memory.label)


def _words(memory: DeviceMemory):
    kind = memory.device.type if memory.device is not None else ""
    return {"cpu": ("available", "RAM"), "mps": ("free below the limit", "max allowed")}.get(kind, ("free", "total"))


def restated(memory: DeviceMemory, requested: Optional[int], free: Optional[int]) -> str:
    """The error's own numbers: ``tried to allocate 2.32 GiB with 182.75 MiB free (15.78 GiB total)``."""
    free_word, total_word = _words(memory)
    what = f"tried to allocate {format_bytes(requested)}" if requested is not None \
        else "an allocation of unknown size failed"
    have = f" with {format_bytes(free)} {free_word}" if free is not None else f" with unknown {free_word} memory"
    total = f" ({format_bytes(memory.total)} {total_word})" if memory.total is not None else f" ({total_word} unknown)"
    return what + have + total


_AUTOGRAD = re.compile(r"torch[/\\](?:autograd[/\\]|_tensor\.py$)")


def _frame_words(frame) -> str:
    if not frame or _AUTOGRAD.search(frame[0]):  # autograd's own frame says no more than "the backward pass"
        return ""
    base = re.split(r"[/\\]", frame[0])[-1] or frame[0]
    return f" ({base} {frame[1]}())" if frame[1] and not frame[1].startswith("<") else f" ({base})"


def _what(analysis, requested: Optional[int]) -> Optional[str]:
    op = getattr(analysis, "operation", None)
    phase = getattr(analysis, "phase", None)
    if op is not None:
        what = op.what + (f", in {_PHASE[phase]}," if phase is not None else "")
        if op.sized:
            verb = "need" if _PLURAL.match(op.what) else "needs"
            return f"{what} {verb} {format_bytes(op.needs)}"
        if requested is not None:
            return f"{what} asked for {format_bytes(requested)}"
        return f"{what} failed to allocate"
    if phase is not None:
        at = _frame_words(getattr(analysis, "phase_frame", None))
        size = f"A {format_bytes(requested)} allocation" if requested is not None else "An allocation"
        return f"{size} in {_PHASE[phase]}{at}"
    return None


def _why(analysis, requested: Optional[int], free: Optional[int]) -> str:
    """Why it did not fit: :func:`_special`, else what was free."""
    special = _special(analysis, requested, free)
    if special is not None:
        return special
    memory = analysis.memory
    free_word, _total_word = _words(memory)
    total = memory.total
    if free is None:
        return f"{free_word} memory unknown"
    of = f" of {format_bytes(total)}" if total is not None else ""
    return f"{format_bytes(free)}{of} was {free_word}"


def _special(analysis, requested: Optional[int], free: Optional[int]) -> Optional[str]:
    """A reason beyond "too little was free": a process limit, more than the device or the cap, pieces too small."""
    memory = analysis.memory
    free_word, total_word = _words(memory)
    limit = getattr(analysis, "limit", None)
    if limit is not None:
        used = f", of which this process had {format_bytes(limit.used)}" if limit.used is not None else ""
        ram = f" ({format_bytes(free)} of RAM was still available)" if free is not None else ""
        return f"{limit.words} is {format_bytes(limit.limit)}{used}{ram}"
    allowed = getattr(analysis.oom, "allowed", None)
    total = memory.total
    if requested is not None and allowed and requested > allowed and (total is None or allowed < total):
        return f"that is more than the {format_bytes(allowed)} this process is allowed"
    if requested is not None and total and requested > total:
        whole = f"the machine's {format_bytes(total)} of RAM" if memory.is_host else \
            f"all {format_bytes(total)} of {where_words(memory)}"
        return f"that is more than {whole}"
    frag = next((f for f in analysis.findings if f.key == "fragmentation" and f.confidence == "certain"), None)
    recorded = getattr(analysis, "recorded", None)
    if frag is not None and recorded is not None and recorded.largest_free_block is not None:
        return (f"{format_bytes(free)} was {free_word} and the {format_bytes(memory.reserved_unallocated)} reserved but "
                f"unallocated is in pieces too small (the largest {format_bytes(recorded.largest_free_block)})")
    return None


def answer(analysis, free: Optional[int], sure: bool = True, process: Optional[str] = None) -> str:
    """The first line for an ``OomAnalysis``: what needed the memory and why it did not fit.

    ``free`` is the free memory the error saw; ``sure=False`` starts it with "Probably out of memory"
    (a message that is out-of-memory only in most reports); ``process`` names a launched process
    (``rank 1 (pid 4242)``).
    """
    requested = getattr(analysis, "requested", None)
    if requested is None:
        requested = getattr(analysis.oom, "requested", None)
    memory = analysis.memory
    start = f"{'Out' if sure else 'Probably out'} of memory" + (f" in {process}" if process else "") \
        + f" on {where_words(memory)}: "
    what = _what(analysis, requested)
    if what is None:
        if _special(analysis, requested, free) is None:
            return start + restated(memory, requested, free)
        what = f"A {format_bytes(requested)} allocation" if requested is not None else "An allocation"
    return start + _lower(what) + "; " + _why(analysis, requested, free)


def _lower(what: str) -> str:
    """A sentence's start inside the line: "The output ..." -> "the output ...", a name stays as it is."""
    first = what.split(" ", 1)[0]
    return what[0].lower() + what[1:] if first in _COMMON else what
