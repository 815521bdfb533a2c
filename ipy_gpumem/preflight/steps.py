"""Run a step twice under the storage tracker and read the events: the peaks, the roles at the peak, the phases and the modules.

This is the estimate's work inside its sealed child (:func:`.child.estimate_here`), after the world
is faked (:mod:`.world`): run the step twice with :func:`run_steps` (the second call is the steady
state: optimizer state exists), replay the allocations through the caching allocator model
(:mod:`.allocator`) when the device is CUDA, and read the roles, phases and modules off the events
(:func:`analyse`). The same :func:`run_steps` runs a real step in the tests and the benchmark, so
the estimate and its ground truth differ only in the tensors. A failure is told with the user's
line (:func:`explain_error`).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional

from ..core.roles import ROLES, clean_table, sub_tables
from ..tensors.tracker import StorageTracker, user_frame
from .result import EstimateError

__all__ = ["run_steps", "analyse", "explain_error", "line_words", "to_cpu", "warnings_quiet"]


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

    from ..tensors.userfiles import is_user_file

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
    real = False  # the step used a real tensor: one the world did not fake
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
        real = True
    elif "out of memory" in text.lower() or "can't allocate memory" in text:
        message = f"{at} ran out of host memory on fake tensors ({text})"
    else:
        message = f"the step failed on fake tensors at {at}: {name}: {text}"
    err = EstimateError(message, where)
    err.real_tensor = real
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


def line_words(frame) -> str:
    """``line 3 of the cell (`loss.backward()`)`` for a (filename, lineno, function, source line) frame."""
    filename, lineno, _name, source = frame
    where = "the cell" if filename == "<cell>" else filename
    return f"line {lineno} of {where} (`{source.strip()}`)" if source else f"line {lineno} of {where}"


@contextlib.contextmanager
def warnings_quiet():
    """Torch's warnings about fake tensors and deprecated calls are not the user's business here."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
