"""max_batch_size(): the largest batch a step fits on a GPU, found by re-estimating on fake tensors at other batch sizes.

The batch arguments are the input tensors (not parameters, gradients or optimizer state) whose size
along ``batch_dim`` equals the first such tensor's: each estimate fakes them at the trial size.
Memory grows almost linearly with the batch, and so does each allocation the step makes: two
estimates at two sizes with the same allocations (one per tensor, in the same order) give each
one's size at any batch, and replaying those through the allocator model says where the step stops
fitting without estimating it there. Two more estimates confirm the answer: the size that fits and
the one above it. Where the allocations do not line up (a kernel that picks another algorithm at
another size), a line through the least room each size fits in (the allocator model replayed at
smaller capacities) guides a secant search, with a bisection where the secant does not halve the
bracket. The answer is always one estimated size that fits and the next that does not.
"""
from __future__ import annotations

from typing import Dict, Optional

__all__ = ["MaxBatch", "max_batch_size", "batch_tensors", "Growth", "least_room"]


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
    from .run import check_step, check_timeout, sealed, user_globals_of

    began = time.perf_counter()
    timeout_s = check_timeout(timeout_s)
    check_step(step)
    card = resolve_gpu(gpu, fallback="T4")
    base, tensors = batch_tensors(args, kwargs, batch_dim)
    if not tensors:
        raise EstimateError(f"no tensor argument has a dimension {batch_dim} to resize; pass the batch as an argument")
    shapes = [(id(t), tuple(t.shape)) for t in tensors]
    value, notes = sealed(_search, step, args, kwargs, card, fixed_costs(card), base, shapes, batch_dim, limit,
                          user_globals_of(step), began + timeout_s, timeout_s=timeout_s, allow_fork=True)
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
    from .run import WHOLE_NOTE, answer_of

    with unreported(), api().fake_tensor_mode()():
        # FakeTensorMode's first use costs about a second: paid here, once, for every trial (what it
        # touches on the way, torch's compiler config, is torch's doing and not reported).
        (api().torch.ones(2, 2) @ api().torch.ones(2, 2)).sum()
    tried: Dict[int, tuple] = {}
    events: Dict[int, list] = {}  # the allocations of the sizes the next turn may read
    needs: Dict[int, tuple] = {}  # the least room each fits in, where asked (least_room)
    estimates: Dict[int, object] = {}
    room = card.capacity - sum(costs.values())  # what fits() gives the allocator model
    whole = []  # set once a size's step used a tensor the reach did not find: every name is faked from then on

    def trial(batch: dict):
        left = deadline - time.perf_counter()
        if left <= 0:
            raise EstimateError(f"the batch search ran out of time after trying {sorted(tried)}")
        return run_sealed(estimate_here, step, args, kwargs, label="cuda:0", costs=costs, gpu=card.name,
                          namespace=namespace, batch=batch, deadline_s=left, whole=bool(whole))

    def at(n: int):
        if n not in tried:
            batch = {}
            for key, shape in shapes:
                new = list(shape)
                new[batch_dim] = n
                batch[key] = tuple(new)
            outcome = trial(batch)
            if not whole and outcome.error is not None and outcome.error.attrs.get("reach_missed") is True:
                whole.append(True)
                outcome = trial(batch)
            if not outcome.ok:
                if outcome.error is not None:
                    raise EstimateError(outcome.error.message, outcome.error.attrs.get("line"))
                why = outcome.exit or outcome.broken or ("it waited forever on a lock" if outcome.stuck else
                                                         "out of time")
                raise EstimateError(f"the estimate at batch {n} did not finish ({why})")
            est, _marks, _names = answer_of(outcome.value, [WHOLE_NOTE] if whole else [])
            fit = est.fits(card)
            tried[n] = (bool(fit), est.total_needed)
            events[n] = est.events
            estimates[n] = est.to_plain() if fit else None
        return tried[n]

    good: Optional[int] = None
    bad: Optional[int] = None
    first = max(1, min(base, limit))
    if at(first)[0]:
        good = first
    else:
        bad = first
    # A second size, for each allocation's growth.
    second = min(limit, first * 2) if good else max(1, first // 2)
    if second != first:
        if at(second)[0]:
            good = max(good or 0, second)
        else:
            bad = second if bad is None else min(bad, second)
    stride = 1  # the least move past the known end: doubled each time a move of that size was not enough
    widths = []
    for _turn in range(40):
        if good is not None and bad is not None and bad - good <= 1:
            break
        if (good is None and bad == 1) or good == limit:
            break
        low, high = good or 0, bad or limit + 1  # fits at low (0: nothing known), fails at high
        near = sorted(tried, key=lambda n: (abs(n - low) if good else abs(n - high)))
        a, b = sorted(((good, bad) if good and bad else near[:2]))
        for n in [n for n in events if n not in (a, b)]:  # what a later turn reads is (a, b) or the new size
            del events[n]
        for n in [n for n in estimates if n != good]:
            del estimates[n]
        growth = Growth.of(a, events[a], b, events[b])
        guess = growth.largest_fit(low, high, room) if growth is not None else None
        if guess is None:
            for n in (a, b):
                if n not in needs:
                    needs[n] = least_room(events[n])
            guess = secant(a, needs[a], b, needs[b], room, low, high)
        if bad is None:
            guess = min(limit, max(guess, good + stride))
        elif good is None:
            guess = max(1, min(guess, bad - stride))
        else:
            widths.append(bad - good)
            if len(widths) >= 2 and widths[-1] * 2 > widths[-2]:  # the last estimate did not halve it
                guess = (good + bad) // 2
            # the size that fits at the boundary is confirmed by the one above it failing
            guess = max(good + 1, min(bad - 1, guess if guess > good else good + 1))
        if at(guess)[0]:
            stride = stride * 2 if bad is None and guess == good + stride else 1
            good = guess
        else:
            stride = stride * 2 if good is None and guess == bad - stride else 1
            bad = guess
    return good or 0, tried, estimates.get(good) if good else None


class Growth:
    """Each allocation of a step as ``size = constant + slope * batch``, from its allocations at two batch sizes."""

    def __init__(self, keys: list, constant: list, slope: list):
        self.keys, self.constant, self.slope = keys, constant, slope  # a free: constant and slope None

    @classmethod
    def of(cls, a: int, at_a: list, b: int, at_b: list) -> Optional["Growth"]:
        """None unless the two runs made the same allocations and frees in the same order, each allocation
        growing by a whole number of bytes a batch (then it is that run at any other size)."""
        if a == b or len(at_a) != len(at_b):
            return None
        keys, constant, slope = [], [], []
        for (key, size_a), (other, size_b) in zip(at_a, at_b):
            if key != other or (size_a < 0) != (size_b < 0):
                return None
            grows, rest = divmod(size_b - size_a, b - a) if size_a >= 0 else (None, 0)
            if rest:
                return None
            keys.append(key)
            slope.append(grows)
            constant.append(size_a - grows * a if grows is not None else None)
        return cls(keys, constant, slope)

    def events(self, n: int) -> Optional[list]:
        """The step's ``(key, size)`` events at batch size ``n`` (None where an allocation would be negative)."""
        out = [(k, -1 if d is None else c + d * n) for k, c, d in zip(self.keys, self.constant, self.slope)]
        if any(size < 0 and d is not None for (_k, size), d in zip(out, self.slope)):
            return None
        return out

    def fits(self, n: int, room: int) -> Optional[bool]:
        """Whether the allocations at batch size ``n`` replay within ``room`` (None: the growth cannot say)."""
        from .allocator import replay

        events = self.events(n)
        return None if events is None else replay(events, capacity=room, series=False).oom_at is None

    def largest_fit(self, low: int, high: int, room: int) -> Optional[int]:
        """The largest size in ``[low, high)`` whose allocations fit ``room``, by bisection (``low`` taken
        to fit, ``high`` to fail); None where the growth cannot say."""
        while high - low > 1:
            middle = (low + high) // 2
            fit = self.fits(middle, room)
            if fit is None:
                return None
            if fit:
                low = middle
            else:
                high = middle
        return low


def secant(a: int, need_a: tuple, b: int, need_b: tuple, room: int, low: int, high: int) -> int:
    """Where the line through the least rooms of sizes ``a`` and ``b`` (``least_room``'s) reaches ``room``;
    where it does not rise by several times their precision (a staircase of 2 MiB segments, on which
    a secant only creeps), twice ``low``, or the middle of ``(low, high)`` when that is nearer."""
    (y_a, close_a), (y_b, close_b) = need_a, need_b
    if y_b - y_a <= 4 * max(close_a, close_b):
        return min(2 * low, (low + high) // 2) if low else high // 2
    return int(a + (room - y_a) * (b - a) / (y_b - y_a))


def least_room(events) -> tuple:
    """``(bytes, precision)``: the least capacity (to 2 MiB, or 1/64 of the span between the peaks) in which
    the allocator model replays ``events`` without running out of memory; between the peak allocated and
    the peak reserved bytes, where emptying the cache before a new segment lets the step fit with less
    than it reserves."""
    from .allocator import ROUND_LARGE, replay

    whole = replay(events, series=False)
    low, high = whole.peak_allocated, whole.peak_reserved  # high always fits (nothing is released below it)
    close = max(ROUND_LARGE, (high - low) // 64)
    while high - low > close:
        middle = (low + high) // 2
        if replay(events, capacity=middle, series=False).oom_at is None:
            high = middle
        else:
            low = middle
    return high, close
