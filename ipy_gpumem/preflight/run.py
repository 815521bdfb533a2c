"""estimate(): run a step twice on fake copies of its world under the storage tracker, and turn the events into an Estimate.

The work in four parts: fake the world (:mod:`.world`), run the step twice (the second call is the
steady state: optimizer state exists) with :func:`run_steps`, replay the allocations through the
caching allocator model (:mod:`.allocator`) when the device is CUDA, and read the roles, phases
and modules off the events (:func:`analyse`). The same :func:`run_steps` runs a real step in the
tests and the benchmark, so the estimate and its ground truth differ only in the tensors. A CUDA
estimate computes on CPU fakes and emulates where CUDA allocates differently (autocast's CUDA op
lists and weight cache, cuBLAS's workspaces, foreach optimizers: :mod:`.cudalike`); the one fixed
cost on top, the CUDA context, is the named GPU's (:func:`resolve_costs`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Tuple

from ..core.roles import ROLES, clean_table, sub_tables
from .result import Estimate, EstimateError
from ..tensors.tracker import StorageTracker, user_frame

__all__ = ["estimate", "run_steps", "analyse", "device_label", "sealed", "answer_of", "check_timeout", "TIMEOUT_S",
           "line_words"]


def device_label(device) -> str:
    """"cuda" -> "cuda:0", "cpu" -> "cpu" (the labels of role tables)."""
    text = str(device)
    if text == "cuda":
        return "cuda:0"
    if text.startswith(("cuda", "cpu")):
        return text
    raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', not {device!r}")


def _patch_zero_grad(obj, tracker):
    original = obj.zero_grad

    def zero_grad(*args, **kwargs):
        tracker.mark("zero_grad")
        try:
            return original(*args, **kwargs)
        finally:
            tracker.mark("other")

    obj.zero_grad = zero_grad  # an instance attribute of our copy: the user's class is untouched


def run_steps(step, args, kwargs, tracker: StorageTracker, existing, modules=(), optimizers=(), calls: int = 2):
    """Run ``step(*args, **kwargs)`` ``calls`` times under ``tracker``.

    ``existing`` is ``[(tensor, role)]``: the storages that exist before the first call. The value
    returned by one call stays alive during the next (as ``loss = step(...)`` in a loop keeps it).
    """
    for tensor, role in existing:
        tracker.add_existing(tensor, role)
    for tensor, role in existing:
        grad = getattr(tensor, "grad", None) if tensor.is_leaf else None
        if grad is not None:
            tracker.add_existing(grad, "gradients")
    # The list must not keep what exists alive: a step that frees it (zero_grad() clearing the
    # previous gradients, a buffer re-assigned) frees it in the count too.
    if isinstance(existing, list):
        existing.clear()
    tensor = grad = None
    tracker.name_modules(list(modules))
    for obj in list(modules) + list(optimizers):
        _patch_zero_grad(obj, tracker)
    kept = None
    with tracker:
        for call in range(1, calls + 1):
            tracker.start_step(call)
            result = step(*args, **kwargs)
            kept = None
            kept = result
            del result
            tracker.note_grads(modules)
            for optimizer in optimizers:
                tracker.note_optimizer(optimizer)
        # The end of the last call: what follows (its own result freed) is the harness's, not a step's.
        tracker.mark("end")
        del kept


def to_cpu(device):
    import torch

    if device is None:
        return None
    dev = torch.device(device)
    return dev if dev.type in ("cpu", "meta") else torch.device("cpu")


def _where(exc) -> Optional[tuple]:
    """The user's line an exception came through: the innermost frame in the user's own code (the
    cell, their modules), else the innermost outside torch and ipy_gpumem (the standard library's)."""
    import linecache

    from ..tensors.kinds import is_user_file

    tb, mine = exc.__traceback__, None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if is_user_file(filename):
            mine = (filename, tb.tb_lineno, linecache.getline(filename, tb.tb_lineno).strip())
        tb = tb.tb_next
    return mine or user_frame(tb=exc.__traceback__)


def explain_error(exc) -> EstimateError:
    import errno as errnos

    name = type(exc).__name__
    where = _where(exc)
    at = line_words((where[0], where[1], "", where[2])) if where else "the step"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else name
    if name in ("DataDependentOutputException", "DynamicOutputShapeException", "GuardOnDataDependentSymNode",
                "UnsupportedOperatorException") or "data-dependent" in text.lower():
        message = (f"{at} needs the values inside a tensor (an output whose size depends on the data, such "
                   f"as nonzero(), masked_select() or unique()), which a fake tensor does not have ({name}). "
                   "Move it out of the step, or estimate the part before it.")
    elif "convert all Tensors to FakeTensors" in text or "non-Fake Tensor" in text or "real tensor" in text.lower():
        message = (f"{at} uses a real tensor that is not reachable from the step's arguments, globals or "
                   "closure (an attribute of a module-level object?); pass it to estimate() as an argument.")
    elif "out of memory" in text.lower() or "can't allocate memory" in text:
        message = f"{at} ran out of host memory on fake tensors ({text})"
    else:
        message = f"the step failed on fake tensors at {at}: {name}: {text}"
    err = EstimateError(message, where)
    number = getattr(exc, "errno", None)
    # The parent knows what the seal refused: with it, a failure that is a refusal's doing says so (run.sealed).
    err.failure = {"type": name, "text": text, "at": at,
                   "errno": number if type(number) is int and number in errnos.errorcode else None}
    err.original = exc
    return err


def analyse(tracker: StorageTracker, device: str, fixed_costs: Dict[str, int]) -> dict:
    """Peaks, the roles at the peak, the phases and the modules of a tracked run."""
    from .allocator import replay
    from .steady import repeat

    run = tracker.run
    unused = run.unused_existing()
    # What was there before the step and the step never touched (a model in the namespace that it
    # does not use) is not the step's working set: it is left out of its peak.
    # (Kept as zero-byte events, so that the event indices of the phase and line marks still hold.)
    events = [(k, 0) if k in unused and size >= 0 else (k, size) for k, size in run.events] if unused else run.events
    run_sizes = {k: (0 if k in unused else n) for k, n in run.sizes.items()} if unused else run.sizes
    cuda = device.startswith("cuda")
    marks = [m for m in run.phase_marks]
    origin, copies, steady = {}, [], {}
    if cuda:
        # A loop runs the step many times, and the caching allocator can reserve more for a few more
        # steps than for two: the last call is repeated in the allocator model until it settles (.steady).
        repeated = repeat(events, marks)
        if repeated is not None and repeated.settled > 2:
            # Kept through the copy after which nothing grew: fits() replays the steady state too.
            two_calls = replay(repeated.events[:marks[-1][0]], series=False).peak_reserved
            copies = repeated.copies[:repeated.settled - 2]
            last = repeated.copies[repeated.settled - 2][0] if repeated.settled - 2 < len(repeated.copies) \
                else len(repeated.events)
            events, origin = repeated.events[:last], repeated.origin
        rep = replay(events)
        allocated, reserved, sizes = rep.allocated, rep.reserved, rep.block_sizes
        peak_reserved = rep.peak_reserved
        if copies:
            steady = {"steady_calls": repeated.settled, "steady_extra": peak_reserved - two_calls}
    else:
        allocated, total = [], 0
        for key, size in events:
            total += size if size >= 0 else -run_sizes[key]
            allocated.append(total)
        reserved, sizes = allocated, run_sizes
        peak_reserved = max(allocated, default=0)
    first = marks[0][0] if marks else len(events)
    start = allocated[first - 1] if first > 0 else 0
    peak_index = max(range(len(allocated)), key=allocated.__getitem__) if allocated else -1
    peak = allocated[peak_index] if allocated else 0

    def role_of(key, at):
        copied = origin.get(key)
        if copied is not None:  # a copy of the last call's tensor: its role there
            key, at = copied[0], at - copied[1]
        role = run.initial_roles.get(key)
        if role is not None:
            return role
        if key in run.state_keys:
            return "optimizer_state"
        if key in run.grad_keys:
            return "gradients"
        saved = run.saved_at.get(key)
        if saved is not None and saved <= at:
            return "activations"
        return "other_tensors"

    wanted = sorted({peak_index} | {m[0] - 1 for m in marks})
    tables: Dict[int, dict] = {}
    live: Dict[int, int] = {}
    w = 0
    if wanted and wanted[0] < 0:
        tables[wanted[0]] = {}
        w = 1
    for index, (key, size) in enumerate(events):
        if w >= len(wanted):
            break
        if size >= 0:
            live[key] = sizes.get(key, size)
        else:
            live.pop(key, None)
        while w < len(wanted) and wanted[w] == index:
            row = dict.fromkeys(ROLES[:5], 0)
            for k, s in live.items():
                row[role_of(k, index)] += s
            if cuda:
                row["allocator_cache"] = reserved[index] - allocated[index]
            tables[index] = {device: row}
            w += 1
    for index in wanted:
        tables.setdefault(index, {})

    phases, peak_phase, peak_step = [], "other", 1
    for i, (begin, phase, step) in enumerate(marks):
        if phase == "end":
            continue
        end = marks[i + 1][0] if i + 1 < len(marks) else len(events)
        if end <= begin and phase == "other":
            continue
        base = allocated[begin - 1] if begin > 0 else 0
        top = max(allocated[begin:end], default=base)
        if begin <= peak_index < end:
            peak_phase, peak_step = phase, step
        if step == 2:
            for number, (copy_start, shift) in enumerate(copies, start=3):
                copy_end = copies[number - 2][0] if number - 2 < len(copies) else len(events)
                if copy_start <= peak_index < copy_end and begin <= peak_index - shift < end:
                    peak_phase, peak_step = phase, number  # in a copy of the last call: its phase there
        change = sub_tables(tables.get(end - 1, {}), tables.get(begin - 1, {}))
        phases.append({"phase": phase, "step": step, "peak": max(top - base, 0),
                       "roles": clean_table(change)})
    roles = clean_table(tables.get(peak_index, {}))
    if cuda and fixed_costs:
        roles.setdefault(device, {})["outside_pytorch"] = sum(fixed_costs.values())
        roles = clean_table(roles)
    modules = sorted(({"module": name, **{k: v for k, v in row.items() if not k.startswith("_")}}
                      for name, row in run.modules.items()), key=lambda r: -r["activations"])
    return {"peak_allocated": peak, "peak_reserved": peak_reserved, "start_allocated": start, "roles": roles,
            "phases": phases, "modules": modules[:10], "peak_phase": peak_phase, "peak_step": peak_step,
            "events": events, **steady}


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
            raise EstimateError(err.message, line)
        raise EstimateError(f"the estimate failed: {err.type_name}: {err.message}")
    if not outcome.ok:
        raise EstimateError(f"the estimate's sealed copy of this process ended without an answer ({outcome.exit})")
    return outcome.value, notes


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
    from ..tensors.kinds import is_user_file

    frames = [f for f in outcome.stuck_frames if is_user_file(f[0])] or list(outcome.stuck_frames)
    at = line_words(frames[-1]) if frames else "the step"
    names = [n for n in outcome.threads if n]
    held = (f" (one of: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''})" if names else "")
    return (f"{at} waits for a lock that another thread of this process{held} held when the estimate's copy of it "
            "was made; that thread does not exist in the copy, so the wait could never end, and the estimate was "
            f"stopped after {outcome.seconds:.1f} s. Estimate again once that thread is idle (or stopped): a larger "
            "timeout_s would not help")


def line_words(frame) -> str:
    """``line 3 of the cell (`loss.backward()`)`` for a (filename, lineno, function, source line) frame."""
    filename, lineno, _name, source = frame
    where = "the cell" if filename == "<cell>" else filename
    return f"line {lineno} of {where} (`{source.strip()}`)" if source else f"line {lineno} of {where}"


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
    from .child import estimate_here

    timeout_s = check_timeout(timeout_s)
    check_step(step)
    label = device_label(device)
    costs, gpu_name = resolve_costs(label, gpu)
    namespace = _globals_of(step)
    value, notes = sealed(estimate_here, step, args, kwargs, label=label, costs=costs, gpu=gpu_name,
                          namespace=namespace, batch=_batch, timeout_s=timeout_s)
    return answer_of(value, notes)[0]


def _globals_of(step) -> Optional[dict]:
    """The namespace a step's code reads its globals from (a notebook's namespace), if it is the user's."""
    import functools
    import types

    from ..tensors.kinds import is_user_file

    while isinstance(step, (functools.partial, types.MethodType)):
        step = step.func if isinstance(step, functools.partial) else step.__func__
    if isinstance(step, types.FunctionType) and is_user_file(step.__code__.co_filename):
        return step.__globals__
    return None


@contextlib.contextmanager
def warnings_quiet():
    """Torch's warnings about fake tensors and deprecated calls are not the user's business here."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
