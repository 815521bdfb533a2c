"""max_batch_size(): the largest batch a step fits on a GPU, found by re-estimating on fake tensors at other batch sizes.

The batch arguments are the input tensors (not parameters, gradients or optimizer state) whose size
along ``batch_dim`` equals the first such tensor's: each estimate fakes them at the trial size.
Memory grows almost linearly with the batch, so two estimates give a line, the line a guess, and a
few more estimates (a secant search between a size that fits and one that does not) pin it down.
"""
from __future__ import annotations

from typing import Dict, Optional

__all__ = ["MaxBatch", "max_batch_size", "batch_tensors"]


class MaxBatch(int):
    """The largest batch size that fits (an ``int``), with what the search tried.

    Attributes:
        gpu: the card's name; capacity: its bytes.
        tried: ``{batch size: (fits, total bytes needed)}`` for every size estimated.
        estimate: the :class:`Estimate` at the returned size (None when not even 1 fits).
    """

    gpu: str
    capacity: int
    tried: Dict[int, tuple]
    estimate: object
    seconds: float

    def __repr__(self) -> str:
        return f"MaxBatch({int(self)}, gpu={self.gpu!r}, tried={sorted(self.tried)})"


def batch_tensors(args, kwargs, batch_dim: int = 0):
    """``(size, [input tensors])``: the batch size and the tensors that carry it."""
    import torch

    from .fake import collect_tensors

    found = collect_tensors([args, kwargs])
    inputs = [t for t, role in found.values() if role == "other_tensors" and t.dim() > batch_dim]
    if not inputs:
        return None, []
    # The first tensor argument in order sets the size.
    flat = []

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            flat.append(obj)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                walk(o)
        elif isinstance(obj, dict):
            for o in obj.values():
                walk(o)

    walk(args)
    walk(kwargs)
    first = next((t for t in flat if any(t is i for i in inputs)), inputs[0])
    size = first.shape[batch_dim]
    return size, [t for t in inputs if t.shape[batch_dim] == size]


def max_batch_size(step, *args, gpu="this GPU", batch_dim: int = 0, limit: int = 1 << 20,
                   **kwargs) -> MaxBatch:
    """The largest batch size for which ``step(*args, **kwargs)`` fits ``gpu``, estimated without a GPU.

    Args:
        step, args, kwargs: as for :func:`estimate`; the batch tensors are resized along ``batch_dim``.
        gpu: a name ("T4", "A100-80", ...), "this GPU", or a capacity in bytes.
        limit: the largest batch size considered.

    Raises:
        EstimateError: the step cannot be estimated, or no argument carries a batch dimension.
    """
    import time

    from .gpus import resolve_gpu
    from .result import EstimateError
    from .run import estimate

    began = time.perf_counter()
    card = resolve_gpu(gpu)
    base, tensors = batch_tensors(args, kwargs, batch_dim)
    if not tensors:
        raise EstimateError(f"no tensor argument has a dimension {batch_dim} to resize; pass the batch as an argument")
    tried: Dict[int, tuple] = {}
    estimates: Dict[int, object] = {}

    def at(n: int):
        if n not in tried:
            shapes = {}
            for t in tensors:
                shape = list(t.shape)
                shape[batch_dim] = n
                shapes[id(t)] = tuple(shape)
            est = estimate(step, *args, device="cuda", gpu=card, _batch=shapes, **kwargs)
            fit = est.fits(card)
            tried[n] = (bool(fit), est.total_needed)
            estimates[n] = est if fit else None
        return tried[n]

    good: Optional[int] = None
    bad: Optional[int] = None
    first = max(1, min(base, limit))
    ok, need = at(first)
    if ok:
        good = first
    else:
        bad = first
    # A second point for the line.
    second = min(limit, first * 2) if ok else max(1, first // 2)
    if second != first:
        ok2, need2 = at(second)
        if ok2:
            good = max(good or 0, second)
        else:
            bad = second if bad is None else min(bad, second)
    for turn in range(40):
        if good is not None and bad is not None and bad - good <= 1:
            break
        if (good is None and bad == 1) or good == limit:
            break
        if bad is None:  # no size fails yet: extrapolate along the line through the two largest
            (n1, (_f1, y1)), (n2, (_f2, y2)) = sorted(tried.items())[-2:]
            slope = (y2 - y1) / (n2 - n1) if n2 != n1 else 0
            guess = int(n2 + (card.capacity - y2) / slope * 1.05) if slope > 0 else 2 * good
            guess = min(limit, max(guess, good + 1))
        elif good is None:  # not even the given size fits: halve
            guess = max(1, bad // 2)
        elif turn % 2 == 0:  # secant between the bracket's ends, kept inside it
            y_good, y_bad = tried[good][1], tried[bad][1]
            slope = (y_bad - y_good) / (bad - good)
            guess = int(good + (card.capacity - y_good) / slope) if slope > 0 else (good + bad) // 2
            guess = max(good + 1, min(bad - 1, guess))
        else:  # bisection, so the bracket at least halves every second estimate
            guess = (good + bad) // 2
        if at(guess)[0]:
            good = guess
        else:
            bad = guess
    result = MaxBatch(good or 0)
    result.gpu, result.capacity, result.tried = card.name, card.capacity, tried
    result.estimate = estimates.get(good) if good else None
    result.seconds = time.perf_counter() - began
    return result
