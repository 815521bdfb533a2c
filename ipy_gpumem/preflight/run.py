"""estimate(): check the step, run it in a sealed copy of this process on fake copies of its world, and rebuild the Estimate it sends back.

This is the parent's side: the child's (:func:`.child.estimate_here`) fakes the world, runs the step
twice and reads the events (:mod:`.steps`), and sends back plain data that :func:`answer_of` checks
as it rebuilds the Estimate. A CUDA estimate computes on CPU fakes and emulates where CUDA allocates
differently (autocast's CUDA op lists and weight cache, cuBLAS's workspaces, foreach optimizers:
:mod:`.cudalike`); the one fixed cost on top, the CUDA context, is the named GPU's
(:func:`resolve_costs`, read here: the sealed child must not touch CUDA).
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

from .result import Estimate, EstimateError
from .steps import line_words

__all__ = ["estimate", "device_label", "sealed", "sealed_estimate", "answer_of", "WHOLE_NOTE", "check_step",
           "check_timeout", "TIMEOUT_S", "resolve_costs", "user_globals_of"]


def device_label(device) -> str:
    """"cuda" -> "cuda:0", "cpu" -> "cpu" (the labels of role tables)."""
    text = str(device)
    if text == "cuda":
        return "cuda:0"
    if text.startswith(("cuda", "cpu")):
        return text
    raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', not {device!r}")


def check_step(step) -> None:
    """A step must be something that runs one step when called: not a generator or coroutine function."""
    import inspect

    name = getattr(step, "__qualname__", None) or type(step).__name__
    if inspect.isgeneratorfunction(step) or inspect.isasyncgenfunction(step):
        raise EstimateError(f"`{name}` is a generator function: calling it runs nothing until it is iterated, so "
                            "there is no step to estimate; pass a function that runs one step")
    if inspect.iscoroutinefunction(step):
        raise EstimateError(f"`{name}` is an async function: calling it runs nothing until it is awaited; pass a "
                            "plain function that runs one step")
    if inspect.isgenerator(step) or inspect.iscoroutine(step):
        raise EstimateError(f"estimate() needs a function, not a {type(step).__name__} object")
    if not callable(step):
        raise EstimateError(f"estimate() needs a function that runs one step, not a {type(step).__name__}")


def resolve_costs(label: str, gpu) -> tuple:
    """``(fixed costs, the GPU's name)`` for a CUDA estimate (read in the user's process: the sealed child
    must not touch CUDA); ``({}, None)`` for the CPU. With no GPU named and none in use here, the card
    is a T4, as for ``%%gpumem --estimate`` (``cell._card``): one step, one total."""
    from .gpus import fixed_costs, resolve_gpu

    if not label.startswith("cuda"):
        return {}, None
    card = resolve_gpu(gpu if gpu is not None else "this GPU", fallback="T4")
    return fixed_costs(card), card.name


def sealed(fn, *args, timeout_s: float, **kwargs) -> Tuple[Any, List[str]]:
    """``fn(*args, **kwargs)`` in a sealed child (``ipy_gpumem.sealed``): (its value, as plain data, and
    the notes on what the seal refused or could not guard), or an EstimateError in one line saying
    what went wrong. The caller rebuilds its objects from the value (nothing else crosses)."""
    from ..sealed import SealedUnavailable, run_sealed

    try:
        outcome = run_sealed(fn, *args, deadline_s=timeout_s, **kwargs)
    except SealedUnavailable as exc:
        raise EstimateError(f"the estimate runs in a sealed copy of this process, which needs os.fork: {exc}; "
                            "nothing was run here") from None
    notes = [f"not done (the estimate runs sealed off from your files, network and processes): {line}"
             for line in outcome.refused]
    if outcome.guard == "python":
        notes.append("sealed by Python-level guards only" + (f" ({outcome.guard_note})" if outcome.guard_note else "")
                     + ": C code in the step (torch's C++ save, numpy's tofile) was not stopped")
    elif outcome.guard_note:
        notes.append(f"the seal: {outcome.guard_note}")
    if outcome.broken is not None:
        raise EstimateError(f"the estimate's sealed copy sent back an answer that was refused ({outcome.broken}); "
                            "nothing of it was used or run here")
    if outcome.stuck:
        raise EstimateError(stuck_message(outcome))
    if outcome.timed_out:
        raise EstimateError(f"the estimate took longer than {timeout_s:g} s and was stopped (nothing of it ran in "
                            "this process); pass a larger timeout_s, or estimate a smaller step")
    if outcome.error is not None:
        err = outcome.error
        if err.type_name == "EstimateError":
            line = err.attrs.get("line")
            line = tuple(line) if isinstance(line, (list, tuple)) and len(line) == 3 else None
            failure = err.attrs.get("failure")
            if isinstance(failure, dict) and outcome.refused and refusal_caused(failure):
                raise EstimateError(refusal_message(failure, outcome.refused), line)
            error = EstimateError(err.message, line)
            error.reach_missed = err.attrs.get("reach_missed") is True
            raise error
        raise EstimateError(f"the estimate failed: {err.type_name}: {err.message}")
    if not outcome.ok:
        raise EstimateError(f"the estimate's sealed copy of this process ended without an answer ({outcome.exit})")
    return outcome.value, notes


#: Said when a step used a tensor its code did not show the way to, and was estimated again.
WHOLE_NOTE = ("the step used a tensor that reading its code did not lead to (a name computed when it runs?): it "
              "was estimated again with every tensor of your namespace faked")


def sealed_estimate(*args, timeout_s: float, **kwargs) -> Tuple[Any, List[str]]:
    """``child.estimate_here(*args, **kwargs)`` in a sealed child, as :func:`sealed`, faking the names the
    step reaches; once more faking every name (within what is left of ``timeout_s``, and said in a note)
    when the step used a real tensor that reach did not find."""
    import time

    from .child import estimate_here

    began = time.monotonic()
    try:
        return sealed(estimate_here, *args, timeout_s=timeout_s, **kwargs)
    except EstimateError as exc:
        if not getattr(exc, "reach_missed", False):
            raise
    left = timeout_s - (time.monotonic() - began)
    if left <= 0:
        raise EstimateError(f"the estimate took longer than {timeout_s:g} s and was stopped (nothing of it ran in "
                            "this process); pass a larger timeout_s, or estimate a smaller step")
    value, notes = sealed(estimate_here, *args, timeout_s=left, whole=True, **kwargs)
    return value, notes + [WHOLE_NOTE]


def answer_of(value, notes: List[str]) -> Tuple[Estimate, List[tuple], Tuple[str, ...]]:
    """(Estimate, the markers' (event, line, call), the names that held tensors) rebuilt from what
    ``child.estimate_here`` sent back as plain data, checked; ``notes`` are added to the Estimate's."""
    try:
        est, flat, names = value
        if not isinstance(flat, list) or len(flat) % 3 or any(type(n) is not int for n in flat):
            raise TypeError("marks")
        if not isinstance(names, list) or any(type(n) is not str for n in names):
            raise TypeError("names")
    except (TypeError, ValueError) as exc:
        raise EstimateError(f"the estimate's sealed copy sent back a malformed answer ({exc}); nothing of it was "
                            "used") from None
    est = Estimate.from_plain(est)
    est.notes.extend(notes)
    return est, list(zip(flat[0::3], flat[1::3], flat[2::3])), tuple(names)


def stuck_message(outcome) -> str:
    """Why an estimate that waited forever was stopped, where, and what to do: one line."""
    from ..tensors.userfiles import is_user_file

    frames = [f for f in outcome.stuck_frames if is_user_file(f[0])] or list(outcome.stuck_frames)
    at = line_words(frames[-1]) if frames else "the step"
    names = [n for n in outcome.threads if n]
    held = (f" (one of: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''})" if names else "")
    return (f"{at} waits for a lock that another thread of this process{held} held when the estimate's copy of it "
            "was made; that thread does not exist in the copy, so the wait could never end, and the estimate was "
            f"stopped after {outcome.seconds:.1f} s. Estimate again once that thread is idle (or stopped): a larger "
            "timeout_s would not help")


#: errno values with which a refused call (or a file the seal made read-only) fails
_REFUSED_ERRNOS = (1, 9, 13, 30)  # EPERM, EBADF, EACCES, EROFS
_REFUSED_TEXTS = ("operation not permitted", "readonly database", "unable to open database file", "disk i/o error",
                  "sealed run")


def refusal_caused(failure: dict) -> bool:
    """Whether the step's failure (``EstimateError.failure``) is what a refused side effect looks like."""
    text = str(failure.get("text", "")).lower()
    return failure.get("errno") in _REFUSED_ERRNOS or failure.get("type") == "PermissionError" or \
        any(t in text for t in _REFUSED_TEXTS)


def refusal_message(failure: dict, refused) -> str:
    tried = "; ".join(refused[-2:])
    return (f"{failure.get('at', 'the step')} failed because the estimate's sealed copy refused what it tried "
            f"({tried}): {failure.get('type')}: {failure.get('text')}. The estimate runs your code sealed off from "
            "your files, network and processes: move that part out of what you estimate")


#: Seconds an estimate may run (in its sealed copy) before it is stopped.
TIMEOUT_S = 120.0


def check_timeout(value, name: str = "timeout_s") -> float:
    """``value`` as seconds above 0 (``inf``: no limit); ValueError in one line for anything else
    (a string, nan, 0, a negative number)."""
    from ..sealed import check_seconds

    return check_seconds(value, name)


def estimate(step, *args, device="cuda", gpu=None, timeout_s: float = TIMEOUT_S, _batch=None, **kwargs) -> Estimate:
    """The memory of ``step(*args, **kwargs)`` as a training step on ``device``, without running it here.

    The step runs twice in a sealed copy of this process (a fork that cannot write files, open
    network connections or start processes, and whose changes die with it), on fake tensors put in
    place of every tensor it can reach (its arguments, its globals and closure, the objects and
    modules they hold), starting from the state that is there (gradients, optimizer state, a
    previous output). Your objects, files, random state and torch settings are exactly as before.

    Args:
        step: the callable to estimate, typically forward, loss, backward and optimizer step.
        *args, **kwargs: its arguments.
        device: "cuda" (or "cuda:N"): torch's CUDA counters, through the caching allocator model;
            "cpu": live tensor bytes.
        gpu: the card whose fixed costs apply: a name ("T4"), "this GPU" or None (this GPU when there
            is one, else a T4); the Estimate names it (``gpu``).
        timeout_s: stop the sealed run after this many seconds (an EstimateError then says so); a
            number above 0, ``inf`` for no limit (Ctrl-C still stops it). A step that waits forever
            on a lock another thread held at the fork is stopped as soon as that is certain.

    Raises:
        EstimateError: the step cannot run on fake tensors (the message names the line), was
            stopped, or cannot be sealed here (no ``os.fork``).
    """
    timeout_s = check_timeout(timeout_s)
    check_step(step)
    label = device_label(device)
    costs, gpu_name = resolve_costs(label, gpu)
    namespace = user_globals_of(step)
    value, notes = sealed_estimate(step, args, kwargs, label=label, costs=costs, gpu=gpu_name,
                                   namespace=namespace, batch=_batch, timeout_s=timeout_s)
    return answer_of(value, notes)[0]


def user_globals_of(step) -> Optional[dict]:
    """The namespace a step's code reads its globals from (a notebook's namespace), if it is the user's."""
    import functools
    import types

    from ..tensors.userfiles import is_user_file

    while isinstance(step, (functools.partial, types.MethodType)):
        step = step.func if isinstance(step, functools.partial) else step.__func__
    if isinstance(step, types.FunctionType) and is_user_file(step.__code__.co_filename):
        return step.__globals__
    return None
