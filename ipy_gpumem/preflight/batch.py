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
    """``(size, [input tensors])``: the batch size and the tensors that carry it.

    The inputs are the tensors among the arguments (in lists, tuples and dicts, a few levels deep)
    that are not parameters or tensors being trained (leaves that require grad); the first of them
    in argument order sets the size, and every input of that size along ``batch_dim`` carries it.
    """
    import torch

    flat = []

    def walk(obj, depth):
        if isinstance(obj, torch.Tensor):
            if not isinstance(obj, torch.nn.Parameter) and not (obj.is_leaf and obj.requires_grad) \
                    and obj.dim() > batch_dim and all(obj is not t for t in flat):
                flat.append(obj)
        elif depth < 4 and isinstance(obj, (list, tuple)):
            for o in obj:
                walk(o, depth + 1)
        elif depth < 4 and isinstance(obj, dict):
            for o in list(obj.values()):
                walk(o, depth + 1)

    walk(args, 0)
    walk(kwargs, 0)
    if not flat:
        return None, []
    size = flat[0].shape[batch_dim]
    return size, [t for t in flat if t.shape[batch_dim] == size]


def max_batch_size(step, *args, gpu="this GPU", batch_dim: int = 0, limit: int = 1 << 20,
                   timeout_s: float = 300.0, **kwargs) -> MaxBatch:
    """The largest batch size for which ``step(*args, **kwargs)`` fits ``gpu``, estimated without a GPU.

    The search runs in one sealed copy of this process (warmed once), and each size it tries in a
    fresh sealed copy of that one (a trial changes the world it runs in: the next must not see it).

    Args:
        step, args, kwargs: as for :func:`~.run.estimate`; the batch tensors are resized along ``batch_dim``.
        gpu: a name ("T4", "A100-80", ...), "this GPU" (a T4 when no GPU is in use here), or bytes.
        limit: the largest batch size considered.
        timeout_s: stop the whole search after this many seconds.

    Raises:
        EstimateError: the step cannot be estimated, or no argument carries a batch dimension.
    """
    import time

    from .gpus import fixed_costs, resolve_gpu
    from .result import Estimate, EstimateError
    from .run import _globals_of, check_step, check_timeout, sealed

    began = time.perf_counter()
    timeout_s = check_timeout(timeout_s)
    check_step(step)
    card = resolve_gpu(gpu, fallback="T4")
    base, tensors = batch_tensors(args, kwargs, batch_dim)
    if not tensors:
        raise EstimateError(f"no tensor argument has a dimension {batch_dim} to resize; pass the batch as an argument")
    shapes = [(id(t), tuple(t.shape)) for t in tensors]
    value, notes = sealed(_search, step, args, kwargs, card, fixed_costs(card), base, shapes, batch_dim, limit,
                          _globals_of(step), began + timeout_s, timeout_s=timeout_s, allow_fork=True)
    try:  # plain data from the sealed zygote, checked as it is rebuilt
        size, tried, plain_estimate = value
        if type(size) is not int or type(tried) is not dict:
            raise TypeError(f"a {type(size).__name__} for the size, a {type(tried).__name__} for what was tried")
        result = MaxBatch(size)
        result.tried = {int(n): (bool(fits), int(need)) for n, (fits, need) in tried.items()}
    except (TypeError, ValueError, AttributeError) as exc:
        raise EstimateError(f"the batch search's sealed copy sent back a malformed answer ({exc}); nothing of it "
                            "was used") from None
    result.gpu, result.capacity = card.name, card.capacity
    result.estimate = Estimate.from_plain(plain_estimate) if plain_estimate is not None else None
    if result.estimate is not None:
        result.estimate.notes.extend(notes)
    result.seconds = time.perf_counter() - began
    return result


def _search(step, args, kwargs, card, costs, base, shapes, batch_dim, limit, namespace, deadline) -> tuple:
    """In the sealed zygote: warm the fake tensors once, then estimate each size in a fresh sealed copy;
    (the largest size that fits, {size: (fits, bytes needed)}, that size's Estimate.to_plain() or None)."""
    import time

    from ..sealed import run_sealed, unreported
    from ..tensors.torch_api import api
    from .child import estimate_here
    from .result import EstimateError
    from .run import answer_of

    with unreported(), api().fake_tensor_mode()():
        # FakeTensorMode's first use costs about a second: paid here, once, for every trial (what it
        # touches on the way, torch's compiler config, is torch's doing and not reported).
        (api().torch.ones(2, 2) @ api().torch.ones(2, 2)).sum()
    tried: Dict[int, tuple] = {}
    estimates: Dict[int, object] = {}

    def at(n: int):
        if n not in tried:
            batch = {}
            for key, shape in shapes:
                new = list(shape)
                new[batch_dim] = n
                batch[key] = tuple(new)
            left = deadline - time.perf_counter()
            if left <= 0:
                raise EstimateError(f"the batch search ran out of time after trying {sorted(tried)}")
            outcome = run_sealed(estimate_here, step, args, kwargs, label="cuda:0", costs=costs, gpu=card.name,
                                 namespace=namespace, batch=batch, deadline_s=left)
            if not outcome.ok:
                if outcome.error is not None:
                    raise EstimateError(outcome.error.message, outcome.error.attrs.get("line"))
                why = outcome.exit or outcome.broken or ("it waited forever on a lock" if outcome.stuck else
                                                         "out of time")
                raise EstimateError(f"the estimate at batch {n} did not finish ({why})")
            est, _marks, _names = answer_of(outcome.value, [])
            fit = est.fits(card)
            tried[n] = (bool(fit), est.total_needed)
            estimates[n] = est.to_plain() if fit else None
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
    return good or 0, tried, estimates.get(good) if good else None
