"""``%gpumem free``: release what costs the user nothing (IPython's last error, its cached outputs), never a variable.

IPython keeps the last error (``sys.last_value``, ``sys.last_traceback``, the traceback formatter's
``.tb``, the last ``ExecutionResult``; the traceback's frames pin the failed call's tensors) and
every displayed result (``Out[N]``, ``_``, ``__``, ``___``, ``_N``, plus its own copies in
``user_ns_hidden`` and on the displayhook). Dropping those loses nothing the user asked to keep:
``%tb`` and ``%debug`` will have nothing to show, and ``Out[N]`` entries that held tensors are gone.

:func:`free_memory` is the whole ``%gpumem free``: the plan, then (unless it is a dry run) the
release, ``gc.collect()`` and the accelerator allocator's ``empty_cache()`` (``torch.cuda``'s on CUDA
and ROCm, ``torch.mps``'s, ``torch.xpu``'s, ``torch.accelerator``'s: only once the user's code has
started that device, never on its behalf), with the memory read before and after.

Which names are IPython's is decided by identity (:func:`~ipy_gpumem.attribution.holders.ipython_refs`),
never by spelling: after ``x, _ = torch.max(t, 0)`` the name ``_`` is the user's, and so are a
``_5`` or an ``Out`` the user assigned. The plan is data (:func:`plan_release`), computed from
``who()``'s typed holders in the ``ipython_caches`` category (exactly the bytes only those
references keep alive); :func:`release` carries it out and returns what it did.
"""
from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from typing import Any, Iterable, List, Mapping, MutableMapping, Optional, Tuple

from ..attribution.who import WhoReport, who
from ..attribution.holders import Holder, IPythonRefs, ipython_refs

__all__ = ["FreeOutcome", "ReleasePlan", "ReleaseResult", "free_memory", "kept_errors", "last_error", "plan_release",
           "release"]

_UNDERSCORES = ("_", "__", "___")
_OUT_NAMES = ("Out", "_oh")
_SYS_ERROR = ("last_type", "last_value", "last_traceback", "last_exc")
_EMPTY = ""  # what IPython's own ``%reset out`` leaves in ``_``, ``__`` and ``___``


def _is_output_name(name: str) -> bool:
    """Spelled like one of IPython's output references (``_``, ``__``, ``___``, ``_N``, ``Out``, ``_oh``)."""
    return name in _UNDERSCORES or name in _OUT_NAMES or (
        name[:1] == "_" and name[1:].isdecimal() and name[1:].isascii())


@dataclass(frozen=True)
class ReleasePlan:
    """What ``%gpumem free`` would release, and the tensor bytes only those references keep alive.

    Attributes:
        error: class name of IPython's last error while one is kept (``"RuntimeError"``), else None.
        traceback_bytes: tensor bytes only that error's frames keep alive.
        out_keys: keys of IPython's output cache to drop (the ``N`` of ``Out[N]``).
        names: IPython's own ``_``, ``__``, ``___`` and ``_N`` to clear.
        cache_bytes: tensor bytes only those entries and names keep alive.
        kept: names spelled like IPython's (``_``, ``_5``, ``Out``) that are the user's and hold
            tensors: never touched, named so the user knows why their bytes stay.
        holders: the ``ipython_caches`` rows of ``who()`` behind the numbers.
        complete: False when ``who()`` did not count everything (a budget ran out, or it failed):
            there may be more than these numbers.
        incomplete: why, in who()'s words; None when complete.
        tensors: False when torch is not imported: no tensor exists, so nothing holds any, and the
            numbers are complete (0), not cut short.
    """

    error: Optional[str] = None
    traceback_bytes: int = 0
    out_keys: Tuple[Any, ...] = ()
    names: Tuple[str, ...] = ()
    cache_bytes: int = 0
    kept: Tuple[str, ...] = ()
    holders: Tuple[Holder, ...] = ()
    complete: bool = True
    incomplete: Optional[str] = None
    tensors: bool = True

    @property
    def total(self) -> int:
        """Bytes the plan frees (before garbage collection and the allocator's cache)."""
        return self.traceback_bytes + self.cache_bytes

    @property
    def empty(self) -> bool:
        """True when no IPython reference is worth dropping."""
        return self.error is None and not self.out_keys and not self.names


@dataclass(frozen=True)
class ReleaseResult:
    """What :func:`release` did.

    Attributes:
        plan: the plan it carried out.
        error: class name of the last error whose references were dropped, else None.
        out_keys: output-cache entries dropped.
        names: names of the user namespace cleared (``_`` and friends set to ``""`` as IPython's
            ``%reset out`` does, ``_N`` deleted).
        hidden: IPython's own copies in ``user_ns_hidden`` dropped with them.
        displayhook: the displayhook's ``_``/``__``/``___`` reset.
        skipped: planned names that were no longer IPython's when it ran: left alone.
    """

    plan: ReleasePlan
    error: Optional[str] = None
    out_keys: Tuple[Any, ...] = ()
    names: Tuple[str, ...] = ()
    hidden: Tuple[str, ...] = ()
    displayhook: Tuple[str, ...] = ()
    skipped: Tuple[str, ...] = ()

    @property
    def released(self) -> bool:
        """True when anything was dropped."""
        return bool(self.error or self.out_keys or self.names or self.hidden or self.displayhook)


def last_error(last_result: Any = None, tb_formatters: Iterable[Any] = ()) -> Optional[str]:
    """Class name of the error IPython keeps (``sys.last_*``, the formatter's ``.tb``, the last
    result); ``"an error"`` when only a traceback is left; None when none is kept.

    Reads types and identities only: an exception whose ``__str__`` or ``__bool__`` raises is fine.
    """
    for name in ("last_exc", "last_value"):
        value = getattr(sys, name, None)
        if value is not None:
            return type(value).__name__
    for name in ("error_in_exec", "error_before_exec"):
        value = getattr(last_result, name, None) if last_result is not None else None
        if value is not None:
            return type(value).__name__
    if getattr(sys, "last_traceback", None) is not None or any(
            getattr(f, "tb", None) is not None for f in tb_formatters):
        return "an error"
    return None


def kept_errors(last_result: Any = None, tb_formatters: Iterable[Any] = ()) -> Tuple[Any, ...]:
    """The exceptions and tracebacks IPython keeps besides ``sys.last_*``, for ``who(errors=...)``."""
    kept = [getattr(last_result, name, None) for name in ("error_in_exec", "error_before_exec")]
    kept.extend(getattr(formatter, "tb", None) for formatter in tb_formatters)
    return tuple(k for k in kept if k is not None)


def plan_release(namespace: Mapping[str, Any], refs: Optional[IPythonRefs] = None, *,
                 report: Optional[WhoReport] = None, last_result: Any = None,
                 tb_formatters: Iterable[Any] = ()) -> ReleasePlan:
    """The plan for ``namespace`` (``shell.user_ns``); releases nothing.

    Args:
        namespace: the user's namespace.
        refs: ``ipython_refs(shell.user_ns, shell.user_ns_hidden, shell.displayhook)``; without
            it no name is IPython's and only the last error is planned.
        report: ``who(namespace, refs=refs, errors=kept_errors(last_result, tb_formatters))``
            if already computed (computed here otherwise).
        last_result: ``shell.last_execution_result`` (it holds the last error too).
        tb_formatters: IPython's traceback formatters (``(shell.InteractiveTB,)``), which keep
            the last traceback they printed as ``.tb``.
    """
    tb_formatters = tuple(tb_formatters)
    if report is None and isinstance(namespace, dict):
        report = who(namespace, refs=refs, errors=kept_errors(last_result, tb_formatters))
    holders = tuple(h for h in (report.holders if report is not None else ()) if h.category == "ipython_caches")
    owns = refs.owns if refs is not None else (lambda name: False)
    traceback_bytes = cache_bytes = 0
    keys: List[Any] = []
    names: List[str] = []
    for h in holders:
        if not h.keys and not h.roots:
            traceback_bytes += h.bytes  # a traceback local, its graph, or a graph they share
            continue
        cache_bytes += h.bytes
        keys.extend(k for k in h.keys if k not in keys)
        names.extend(r for r in h.roots if r not in names and r not in _OUT_NAMES and owns(r))
    names.extend(_aliases(namespace, refs, keys, names))
    kept = sorted({r for h in (report.holders if report is not None else ())
                   if h.category != "ipython_caches" for r in h.roots if _is_output_name(r) and not owns(r)})
    # Without torch no tensor exists: who() returns at once and says so, which is a complete
    # answer (nothing holds tensors), not a walk cut short.
    tensors = sys.modules.get("torch") is not None
    if not tensors:
        why = None
    elif report is None:
        why = "the namespace is not a dict"
    else:
        why = report.stopped or report.reason
    return ReleasePlan(error=last_error(last_result, tb_formatters), traceback_bytes=traceback_bytes,
                       out_keys=tuple(keys), names=tuple(names), cache_bytes=cache_bytes, kept=tuple(kept),
                       holders=holders, complete=why is None, incomplete=why, tensors=tensors)


def _aliases(namespace: Mapping[str, Any], refs: Optional[IPythonRefs], keys: List[Any],
             names: List[str]) -> List[str]:
    """IPython's other names for the same objects: ``_N`` for ``Out[N]``, and ``_``/``__``/``___``
    when they are one of them. Without this, dropping ``Out[3]`` would free nothing while ``_3``
    and ``_`` still hold it."""
    if refs is None:
        return []
    out = _output_cache(namespace, refs)
    targets = {id(dict.get(out, k)) for k in keys if out is not None and k in out}
    targets.update(id(namespace.get(n)) for n in names)
    extra = []
    for key in keys:
        name = f"_{key}"
        if refs.owns(name) and name not in names:
            extra.append(name)
    for name in sorted(refs.names):
        if name in names or name in extra or name in _OUT_NAMES or not _is_output_name(name):
            continue
        if id(namespace.get(name)) in targets:
            extra.append(name)
    return extra


def _output_cache(namespace: Mapping[str, Any], refs: IPythonRefs) -> Optional[dict]:
    """IPython's output-cache dict, through whichever of ``Out``/``_oh`` still names it; never a user's dict."""
    for name in _OUT_NAMES:
        if refs.owns(name):
            value = namespace.get(name)
            if isinstance(value, dict):
                return value
    return None


def release(plan: ReleasePlan, namespace: MutableMapping[str, Any], *, hidden: Optional[MutableMapping[str, Any]] = None,
            displayhook: Any = None, last_result: Any = None, tb_formatters: Iterable[Any] = ()) -> ReleaseResult:
    """Drop the references in ``plan``; never a user variable.

    Whether a name is IPython's is checked again here, by identity: a name the user rebound since
    the plan was made is left alone (``skipped``).

    Args:
        plan: from :func:`plan_release`.
        namespace: ``shell.user_ns``.
        hidden: ``shell.user_ns_hidden``: IPython keeps a second reference to every ``_N`` (and
            ``_``) there; its own ``%reset out`` drops them too.
        displayhook: ``shell.displayhook``, which keeps its own ``_``, ``__`` and ``___``.
        last_result: ``shell.last_execution_result`` (its ``result`` and its error).
        tb_formatters: ``(shell.InteractiveTB,)``: each keeps the last traceback as ``.tb``.
    """
    refs = ipython_refs(namespace, hidden, displayhook)
    out_keys: List[Any] = []
    out_values: List[Any] = []
    out = _output_cache(namespace, refs)
    if out is not None:
        for key in plan.out_keys:
            if key in out:
                out_values.append(out.pop(key))
                out_keys.append(key)
    dropped = list(out_values)
    names, hidden_names, skipped = [], [], []
    for name in plan.names:
        if not refs.owns(name):
            skipped.append(name)  # the user rebound it since the plan: theirs now
            continue
        dropped.append(namespace.get(name))
        names.append(name)
        if name in _UNDERSCORES:
            namespace[name] = _EMPTY
            if hidden is not None and name in hidden:
                hidden[name] = _EMPTY  # IPython compares the two to tell whether the user rebound it
        else:
            namespace.pop(name, None)
            if hidden is not None and hidden.pop(name, None) is not None:
                hidden_names.append(name)
    if hidden is not None:  # IPython's copies of _N for dropped entries, even when the user owns ``_N``
        for key, value in zip(out_keys, out_values):
            name = f"_{key}"
            if name not in names and hidden.get(name) is value:
                del hidden[name]
                hidden_names.append(name)
    ids = {id(value) for value in dropped if value is not None}
    reset = []
    if displayhook is not None:
        for name in _UNDERSCORES:
            if id(getattr(displayhook, name, None)) in ids:
                setattr(displayhook, name, _EMPTY)
                reset.append(name)
    if last_result is not None and id(getattr(last_result, "result", None)) in ids:
        last_result.result = None
    error = None
    if plan.error is not None:
        error = plan.error
        for name in _SYS_ERROR:
            if getattr(sys, name, None) is not None:
                setattr(sys, name, None)
        for formatter in tb_formatters:
            if getattr(formatter, "tb", None) is not None:
                formatter.tb = None
        if last_result is not None:
            for name in ("error_in_exec", "error_before_exec"):
                if getattr(last_result, name, None) is not None:
                    setattr(last_result, name, None)
    return ReleaseResult(plan=plan, error=error, out_keys=tuple(out_keys), names=tuple(names),
                         hidden=tuple(hidden_names), displayhook=tuple(reset), skipped=tuple(skipped))


@dataclass(frozen=True)
class FreeOutcome:
    """One ``%gpumem free``: the plan, what was released, and the memory before and after.

    Attributes:
        plan: what was (or, in a dry run, would be) released.
        result: what :func:`release` did; None in a dry run.
        before, after: probe ``Sample``s read before the release and after the collection and
            the cache release (None when unknown; ``after`` is None in a dry run).
        dry_run: nothing was released.
        collected: objects ``gc.collect()`` found unreachable.
        cache_emptied: the accelerator's ``empty_cache()`` ran (the user's code had started it).
    """

    plan: ReleasePlan
    result: Optional[ReleaseResult] = None
    before: Any = None
    after: Any = None
    dry_run: bool = False
    collected: int = 0
    cache_emptied: bool = False


def free_memory(namespace: MutableMapping[str, Any], refs: Optional[IPythonRefs], probe: Any = None, *,
                dry_run: bool = False, last_result: Any = None, tb_formatters: Iterable[Any] = (),
                displayhook: Any = None, hidden: Optional[MutableMapping[str, Any]] = None) -> FreeOutcome:
    """``%gpumem free [--dry-run]``: plan, release, collect, give the accelerator's cache back, measure.

    The only state it changes is IPython's own references (see :func:`release`), the garbage
    collector's run and the accelerator allocator's cache (CUDA, ROCm, MPS, XPU: the probe's
    backend), all asked for by the user; a dry run changes nothing.

    Args:
        namespace, refs: ``shell.user_ns`` and ``ipython_refs(shell.user_ns, shell.user_ns_hidden,
            shell.displayhook)``.
        probe: a ``MemoryProbe`` for the readings before and after and the backend whose cache is
            emptied (None: no readings, and torch.cuda's cache).
        dry_run: plan and read only.
        last_result, tb_formatters, displayhook, hidden: IPython's other references, as for
            :func:`plan_release` and :func:`release`.
    """
    tb_formatters = tuple(tb_formatters)
    plan = plan_release(namespace, refs, last_result=last_result, tb_formatters=tb_formatters)
    before = _sample(probe)
    if dry_run:
        return FreeOutcome(plan, before=before, dry_run=True)
    result = release(plan, namespace, hidden=hidden, displayhook=displayhook, last_result=last_result,
                     tb_formatters=tb_formatters)
    collected = gc.collect()  # asked for by the user: %gpumem free
    emptied = _empty_cache(probe)
    return FreeOutcome(plan, result, before, _sample(probe), collected=collected, cache_emptied=emptied)


def _sample(probe: Any) -> Any:
    if probe is None:
        return None
    try:
        return probe.sample()
    except Exception:  # a reading is a nicety here; the release stands without it
        return None


def _empty_cache(probe: Any) -> bool:
    """The probe's backend's ``empty_cache()`` (it runs only on a device the user's code started);
    without a probe, torch.cuda's."""
    cuda_probe = getattr(probe, "cuda", None)
    if cuda_probe is not None and hasattr(cuda_probe, "empty_cache"):
        try:
            return bool(cuda_probe.empty_cache())
        except Exception:  # the release stands without it
            return False
    return _empty_cuda_cache()


def _empty_cuda_cache() -> bool:
    """``torch.cuda.empty_cache()`` when torch is imported and CUDA already initialized; never imports or initializes."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_initialized():
            return False
        cuda.empty_cache()
        return True
    except Exception:
        return False
