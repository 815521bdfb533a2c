"""The caching allocator after many steps: a run's last call repeated (its allocations renumbered) until the modelled reserved bytes stop growing.

A training loop runs the same step many times, and the caching allocator's reserved bytes do not
settle after two: each step frees and takes blocks of the same sizes in a slightly different
layout of cached segments, and until that layout repeats a step may find no free block large
enough and reserve a new segment. With small tensors (batch 1) the layout settles at once; with
large ones it can take a few more steps, and the reserved bytes an estimate of two calls gives
were up to 8% under the steady state's for a BERT-base fine-tune at batch 2 to 4
(``tests/preflight/test_estimate_batch.py``): the "right at batch 1, under at batch 4" of a table measured
after a whole training run (nvidia-smi reads reserved bytes).

The estimate runs the step twice; the last call is the steady step. :func:`repeat` appends copies
of its events, each freeing what the previous copy left alive where the second call freed what the
first left (the previous loss, the gradients ``zero_grad(set_to_none=True)`` drops), and replays
them through the allocator model until two copies in a row reserve nothing new. Replaying the
copies gives what running the step that many times gives (the tests compare them event for event).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Tuple

from .allocator import CachingAllocatorModel

__all__ = ["MAX_CALLS", "Repeated", "repeat", "words"]

#: At most this many calls in all (the two run for real and the copies).
MAX_CALLS = 16


class Repeated(NamedTuple):
    """The run's events through its last call, followed by copies of that call."""

    events: List[Tuple[int, int]]
    #: copied key -> (the key it copies in the last call, the distance in events between them)
    origin: Dict[int, Tuple[int, int]]
    #: (index in ``events`` where copy n starts, its distance from the last call), one per copy
    copies: List[Tuple[int, int]]
    #: calls in all, the two run for real included
    calls: int
    #: the call after which the peaks stopped growing (2: they never grew)
    settled: int


def _template(events, marks) -> Optional[tuple]:
    """(start, end) of the last call and the pairs (what it freed that an earlier call left alive, what
    it leaves alive in turn), matched by order and size; None when the call is not a repeatable step."""
    last = max((step for _index, phase, step in marks if phase != "end"), default=0)
    starts = [index for index, _phase, step in marks if step == last and last >= 2]
    ends = [index for index, phase, _step in marks if phase == "end"]
    if not starts or not ends or not starts[0] < ends[-1] <= len(events):
        return None
    start, end = starts[0], ends[-1]
    made_at: Dict[int, int] = {}
    sizes: Dict[int, int] = {}
    for index in range(end):
        key, size = events[index]
        if size >= 0:
            made_at[key] = index
            sizes[key] = size
    freed = {key for key, size in events[start:end] if size < 0}
    before = sorted((key for key in freed if made_at.get(key, start) < start), key=made_at.__getitem__)
    left = [key for key, size in events[start:end] if size >= 0 and key not in freed]
    if len(before) != len(left) or any(sizes[a] != sizes[b] for a, b in zip(before, left)):
        return None
    return start, end, before, left


def repeat(events, marks, limit: int = MAX_CALLS) -> Optional[Repeated]:
    """``events`` (a tracked run's ``(key, size)``, size -1 a free) through the end of its last call, then
    copies of that call until the allocator model's peaks stop growing for two copies (``limit`` calls
    at most). None when the run's last call does not free what its previous call left alive as a
    repeated step would (then the two calls are all there is)."""
    found = _template(events, marks)
    if found is None:
        return None
    start, end, before, left = found
    template = events[start:end]
    out = list(events[:end])
    model = CachingAllocatorModel()
    handles: Dict[int, object] = {}

    def apply(key: int, size: int) -> None:
        if size >= 0:
            handles[key] = model.malloc(size)
        else:
            model.free(handles.pop(key, None))

    for key, size in out:
        apply(key, size)
    slot = {key: i for i, key in enumerate(before)}
    alive = list(left)
    next_key = max((key for key, _size in events), default=-1) + 1
    origin: Dict[int, Tuple[int, int]] = {}
    copies: List[Tuple[int, int]] = []
    calls, quiet, settled = 2, 0, 2
    while calls < limit and quiet < 2:
        peaks = (model.peak_reserved, model.peak_allocated)
        shift = len(out) - start
        copies.append((len(out), shift))
        new: Dict[int, int] = {}
        for key, size in template:
            if size >= 0:
                new[key] = next_key
                origin[next_key] = (key, shift)
                out.append((next_key, size))
                next_key += 1
            else:
                out.append((new[key] if key in new else alive[slot[key]], -1))
            apply(*out[-1])
        alive = [new[key] for key in left]
        calls += 1
        if (model.peak_reserved, model.peak_allocated) == peaks:
            quiet += 1
        else:
            quiet, settled = 0, calls
    return Repeated(out, origin, copies, calls, settled)


def words(facts: dict) -> str:
    """The sentence saying that the figures are the steady state's, and how far they moved."""
    from ..core.units import format_bytes

    settled, extra = facts.get("steady_calls", 2), facts.get("steady_extra", 0)
    if extra > 0:
        return (f"the caching allocator's reserved bytes keep growing after two steps as its cached blocks settle "
                f"into a new layout: {format_bytes(extra)} more by step {settled}, after which they hold (the step "
                "repeated in the allocator model); the peaks are those of the steady state (a card with less room "
                "still fits it if emptying the cache makes room, as torch does before it gives up: fits() replays "
                "that)")
    return (f"the caching allocator's peaks grow after two steps and hold from step {settled} (the step repeated "
            "in the allocator model); the peaks are those of the steady state")
