"""estimate(): run a step twice on fake copies of its world under the storage tracker, and turn the events into an Estimate.

The work in four parts: fake the world (:mod:`.fake`), run the step twice (the second call is the
steady state: optimizer state exists) with :func:`run_steps`, replay the allocations through the
caching allocator model (:mod:`.allocator`) when the device is CUDA, and read the roles, phases
and modules off the events (:func:`analyse`). The same :func:`run_steps` runs a real step in the
tests and the benchmark, so the estimate and its ground truth differ only in the tensors.
"""
from __future__ import annotations

import contextlib
import io
import time
from typing import Dict, List, Optional

from ..core.roles import ROLES, clean_table, sub_tables
from .result import Estimate, EstimateError
from .tracker import StorageTracker, user_frame

__all__ = ["estimate", "run_steps", "analyse", "device_label"]


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
        del kept
        tracker.mark("end")


@contextlib.contextmanager
def _cuda_autocast_on_cpu():
    """While faking a CUDA run on the CPU, ``torch.autocast("cuda", dtype)`` casts on the CPU instead."""
    import torch

    cls = torch.amp.autocast_mode.autocast
    original = cls.__init__

    def __init__(self, device_type, *args, **kwargs):
        if str(device_type).startswith("cuda"):
            device_type = "cpu"
            if kwargs.get("dtype") is None and not args:
                kwargs["dtype"] = torch.float16
        original(self, device_type, *args, **kwargs)

    cls.__init__ = __init__
    try:
        yield
    finally:
        cls.__init__ = original


def _like_cuda(optimizers) -> None:
    """Optimizers left to choose (``foreach=None``) take the multi-tensor path on CUDA: make the
    fake copies (computing on the CPU) take it too, since its temporaries differ."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True


def _to_cpu(device):
    import torch

    if device is None:
        return None
    dev = torch.device(device)
    return dev if dev.type in ("cpu", "meta") else torch.device("cpu")


def _where(exc) -> Optional[tuple]:
    return user_frame(tb=exc.__traceback__)


def _explain(exc) -> EstimateError:
    name = type(exc).__name__
    where = _where(exc)
    at = f"line {where[1]} of {where[0]} (`{where[2]}`)" if where else "the step"
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
    err.original = exc
    return err


def analyse(tracker: StorageTracker, device: str, fixed_costs: Dict[str, int]) -> dict:
    """Peaks, the roles at the peak, the phases and the modules of a tracked run."""
    from .allocator import replay

    run = tracker.run
    events = run.events
    cuda = device.startswith("cuda")
    if cuda:
        rep = replay(events)
        allocated, reserved, sizes = rep.allocated, rep.reserved, rep.block_sizes
        peak_reserved = rep.peak_reserved
    else:
        allocated, total = [], 0
        for key, size in events:
            total += size if size >= 0 else -run.sizes[key]
            allocated.append(total)
        reserved, sizes = allocated, run.sizes
        peak_reserved = max(allocated, default=0)
    marks = [m for m in run.phase_marks]
    first = marks[0][0] if marks else len(events)
    start = allocated[first - 1] if first > 0 else 0
    peak_index = max(range(len(allocated)), key=allocated.__getitem__) if allocated else -1
    peak = allocated[peak_index] if allocated else 0

    def role_of(key, at):
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
            "phases": phases, "modules": modules[:10], "peak_phase": peak_phase, "peak_step": peak_step}


def estimate(step, *args, device="cuda", gpu=None, _batch=None, **kwargs) -> Estimate:
    """The memory of ``step(*args, **kwargs)`` as a training step on ``device``, without running it.

    The step runs twice on fake copies of every tensor, module and optimizer reachable from its
    arguments (and the globals and closure variables it names); the user's objects, and torch's
    random number generator, are left exactly as they were.

    Args:
        step: the callable to estimate, typically forward, loss, backward and optimizer step.
        *args, **kwargs: its arguments.
        device: "cuda" (or "cuda:N"): torch's CUDA counters, through the caching allocator model;
            "cpu": live tensor bytes.
        gpu: the card whose fixed costs (CUDA context, cuBLAS workspace) apply: a name ("T4"),
            "this GPU" or None (this GPU when there is one, otherwise an Ampere card's figures).

    Raises:
        EstimateError: the step cannot run on fake tensors; the message names the line.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .fake import FakeWorld
    from .gpus import fixed_costs as _fixed_costs, resolve_gpu

    began = time.perf_counter()
    label = device_label(device)
    cuda = label.startswith("cuda")
    costs: Dict[str, int] = {}
    if cuda:
        card = None
        try:
            card = resolve_gpu(gpu if gpu is not None else "this GPU")
        except ValueError:
            if gpu is not None:
                raise
        costs = _fixed_costs(card)
    rng = torch.random.get_rng_state()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    tracker = StorageTracker(fake=True, redirect=_to_cpu)
    notes: List[str] = []
    try:
        try:
            world = FakeWorld(step, args, kwargs, fake_mode, batch=_batch)
        except Exception as exc:  # noqa: BLE001 - anything odd in the user's objects
            raise EstimateError(f"could not copy the step's objects around fake tensors: {type(exc).__name__}: {exc}") from None
        existing = [(fake, role) for fake, role, _real in world.fakes]
        if cuda:
            _like_cuda(world.optimizers)
        printed = io.StringIO()
        with fake_mode, (_cuda_autocast_on_cpu() if cuda else contextlib.nullcontext()), \
                warnings_quiet(), contextlib.redirect_stdout(printed):
            try:
                run_steps(world.step, world.args, world.kwargs, tracker, existing, world.modules, world.optimizers)
            except EstimateError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported with the user's line, never a raw traceback
                raise _explain(exc) from None
    finally:
        if not torch.equal(torch.random.get_rng_state(), rng):
            torch.random.set_rng_state(rng)
    if printed.getvalue():
        notes.append(f"the step printed {len(printed.getvalue().splitlines())} line(s) on fake values; not shown")
    for filename, line, source in tracker.run.value_reads:
        notes.append(f"line {line} (`{source}`) read a tensor's value (.item(), print, or an `if` on a tensor): a "
                     "fake tensor has none, so 0 was used; a branch on it follows the 0 path")
    if cuda and not torch.cuda.is_available():
        notes.append("computed on fake CPU tensors standing for CUDA ones: kernels that differ by device "
                     "(attention backends, cuDNN workspaces) may use other temporaries on the GPU")
    facts = analyse(tracker, label, costs)
    events = tracker.run.events
    del world, tracker
    return Estimate(device=label, fixed_costs=costs, notes=notes, seconds=time.perf_counter() - began,
                    events=events, **facts)


@contextlib.contextmanager
def warnings_quiet():
    """Torch's warnings about fake tensors and deprecated calls are not the user's business here."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
