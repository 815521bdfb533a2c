"""Training phases of a cell (forward, backward, optimizer step, zero_grad) with their peaks and roles, recognised
from the modules, autograd graphs and optimizers the cell used, through hooks that exist only while the cell runs.

The loop does not have to be written in the cell: ``train_one_epoch(model, opt, data)`` is seen
from inside, because every hook is global (torch calls it for any module, any optimizer) and is
removed when the cell ends. Which torch mechanism recognises each phase, and why that one:

``forward``, ``backward``, ``optimizer_step``
    The outermost module call, the backward through its outputs' graph, and ``Optimizer.step``,
    marked by the tensors room's global hooks (``tensors.hooks.PhaseHooks``, which says why each
    mechanism was chosen and keeps the hooks off torch's per-module slow path between marks).
``zero_grad``
    ``Optimizer.zero_grad`` and ``Module.zero_grad`` have no hooks (only a profiler
    ``record_function``), and patching the user's objects is off limits, so it is recognised from
    its effect: a span *between* two phases in which the gradients of the parameters seen were
    freed (``set_to_none=True``, the default) or all rewritten in place (their ``_version``
    counters moved) and are now zero. The zero test reads one gradient, the smallest, with
    ``Tensor.any()``: on a GPU that is one small synchronisation, paid only in a span where
    every gradient was rewritten in place (``set_to_none=False``, or clipping, which the zero
    test tells apart). The phase covers the whole span, so it also holds what else ran there
    (the loss, data loading, logging); the final span is checked when the cell ends.

Phases do not nest: while one is open nothing else begins (LBFGS's closure is inside its step).

Roles (``ipy_gpumem.core.roles``) come from the census the caller passes
(``ipy_gpumem.anatomy.census.take``: MemTracker's categories found by reachability), taken at
both ends of a phase on the first ``detail_steps`` iterations and then every ``every``-th, so a
long loop pays for a census only on a few steps; the other phases carry peaks and deltas only
(``roles`` None). The census is given the modules and optimizers seen, the alive inputs and
outputs of the outermost forwards (held by ``weakref`` only), and, during a backward, the node
the engine is running (the only handle on a graph whose output the user no longer holds).

Layers: the first outermost forward with autograd on has its submodule calls reported, and
:class:`~ipy_gpumem.anatomy.layers.LayerTracker` names the heaviest activations.

Nothing here holds a tensor, an output or a graph past its phase: modules, optimizers,
parameters, inputs and outputs are held by ``weakref``; the engine's node is held from the start
of a backward to its end. No hook raises into the user's code: an internal error stops the
watching (the hooks go inert at once and are removed by :meth:`PhaseWatcher.stop`) and sets ``reason``.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..core.roles import add_tables
from ..tensors.holding import instance_attrs, module_parts
from ..tensors.hooks import PhaseHooks
from ..tensors.torch_api import api as torch_api
from ..tensors.walk import GraphHandle, Walk
from .layers import LayerTracker

__all__ = ["PhaseWatcher", "PHASES"]

#: The phase kinds, in the order a summary lists them.
PHASES = ("forward", "backward", "optimizer_step", "zero_grad")
#: Inputs and outputs of outermost forwards kept (weakly) as census roots.
MAX_ROOTS = 64
#: Phases listed one by one; past this, only censused ones (the others are counted in the summary).
MAX_PHASES = 400
#: Parameters whose gradients are read at each boundary to recognise zero_grad (spread evenly).
GRAD_SAMPLE = 8

Reading = Tuple[float, Dict[str, Tuple[int, int]]]




class _Mark:
    """The state at a phase boundary: the memory reading, the census (or None), the gradients."""

    __slots__ = ("reading", "snap", "grads", "step", "detail")

    def __init__(self, reading, snap, grads, step, detail):
        self.reading, self.snap, self.grads, self.step, self.detail = reading, snap, grads, step, detail


class PhaseWatcher:
    """Record the training phases one cell runs, wherever its loop is written.

    Args:
        read: called at each phase boundary (a few times per iteration, never inside a forward);
            returns ``(perf_counter time, {device label: (current bytes, peak bytes since the
            previous read)})``, a new mapping each call (it is kept as given), and resets the peak
            counters it reads.
        census: ``census(modules, optimizers, tensors)``, each an iterable of ``(name, object)``
            pairs, returning a snapshot with ``.totals`` and ``.diff(before).table`` (role
            tables), or None; without it phases carry no roles.
        detail_steps: iterations censused at both ends of every phase, from the first.
        every: after those, every ``every``-th iteration is censused too (0: none).

    Examples:
        >>> w = PhaseWatcher(read, census)        # doctest: +SKIP
        >>> w.start()
        >>> try:
        ...     train_one_epoch(model, opt, data)
        ... finally:
        ...     w.stop()
        >>> [(p["phase"], p["step"]) for p in w.phases][:4]
        [('forward', 1), ('backward', 1), ('optimizer_step', 1), ('zero_grad', 1)]
    """

    def __init__(self, read: Callable[[], Reading], census: Optional[Callable] = None, *, detail_steps: int = 2,
                 every: int = 10):
        self._read = read
        self._census = census
        self.detail_steps = int(detail_steps)
        self.every = int(every)
        #: Why watching stopped early (an internal error, one line), or None.
        self.reason: Optional[str] = None
        self._raw: List[dict] = []
        self._folded: Dict[str, dict] = {}  # per kind: count and worst peak of phases not listed
        self._layers: Optional[List[Tuple[str, int]]] = None
        self._reset()

    # -- state -------------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._on = False
        self._api = None
        self._hooks: Optional[PhaseHooks] = None
        self._open: Optional[dict] = None
        self._mark: Optional[_Mark] = None
        self._modules: List[Tuple[str, Any]] = []  # (census name, weakref)
        self._optims: List[Tuple[str, Any]] = []
        self._module_ids: Dict[int, Any] = {}
        self._optim_ids: Dict[int, Any] = {}
        self._params: List[Any] = []  # weakrefs to the parameters seen (for zero_grad)
        self._sample: List[Any] = []  # the few of them whose gradients are read at each boundary
        self._param_ids: set = set()
        self._roots: List[Tuple[str, Any]] = []  # (name, weakref) inputs/outputs of outermost forwards
        self._names: Dict[str, int] = {}
        self._forwards = 0
        self._steps_done = 0
        self._bw_node = None
        self._lay: Optional[LayerTracker] = None

    # -- start / stop ------------------------------------------------------------------------------
    def start(self) -> None:
        """Register the global hooks for this cell; a no-op without torch or when already watching."""
        if self._hooks is not None or self._on:
            return
        self._open, self._bw_node = None, None
        api = torch_api()
        if api is None or not hasattr(api.torch, "nn") or not hasattr(api.torch, "optim"):
            return  # nothing to watch: a cell that never imported torch runs no module
        self._api = api
        hooks = PhaseHooks(api, self)
        if not hooks.start():
            self.reason = hooks.reason
            return
        self._hooks = hooks
        self._on = True

    def stop(self) -> None:
        """Remove every hook (global, per module and per graph); closes the last span. Idempotent, never raises."""
        try:
            if self._on:
                self._on = False
                self._finish()
        except Exception as exc:  # noqa: BLE001
            self.reason = self.reason or _one_line("stop", exc)
        finally:
            self._on = False
            hooks, self._hooks = self._hooks, None
            if hooks is not None:
                hooks.stop()
                self.reason = self.reason or (f"phases stopped in {hooks.reason}" if hooks.reason else None)
            self._bw_node = None
            self._lay = None
            self._roots = []

    def failed(self, exc: BaseException, where: str) -> None:
        """The hooks met an internal error: stop watching (they go inert; :meth:`stop` removes them)."""
        self._on = False
        self._open = None
        self._bw_node = None
        self._lay = None
        if self.reason is None:
            self.reason = _one_line(f"phases stopped in {where}", exc)

    def _finish(self) -> None:
        """At the end of the cell: close a phase left open (it raised) and a last zero_grad span."""
        if self._open is not None:
            self._end(incomplete=True)
        elif self._mark is not None and self._zeroed(self._mark.grads, self._grads()):
            self._span_phase(self._reading(), self._take() if self._mark.detail else None)

    # -- results -----------------------------------------------------------------------------------
    @property
    def phases(self) -> List[dict]:
        """The phases in the order they ran: dicts ``phase``, ``step``, ``peak``, ``delta``, ``roles``
        (and ``incomplete: True`` for one that raised); past :data:`MAX_PHASES`, the censused ones.

        ``step`` counts optimizer steps when the cell stepped one (forward and backward belong to
        the step that follows them, zero_grad to the phase before it), otherwise outermost forwards.
        """
        stepped = any(p["phase"] == "optimizer_step" for p in self._raw)
        out, previous = [], None
        for p in self._raw:
            if p["phase"] == "zero_grad":
                step = previous if previous is not None else 1
            elif stepped:
                step = p["steps_done"] + 1
            else:
                step = p["forward"] or 1
            previous = step
            # peak: how far the phase rose above its start at its highest (the end reading's peak
            # covers the whole phase: the start reading reset it); delta: end minus start.
            start, end = p["start"], p["end"]
            base = {dev: int(start.get(dev, (cur,))[0]) for dev, (cur, _peak) in end.items()}
            item = {"phase": p["phase"], "step": step,
                    "peak": {dev: max(0, int(peak) - base[dev]) for dev, (_cur, peak) in end.items()},
                    "delta": {dev: int(cur) - base[dev] for dev, (cur, _peak) in end.items()},
                    "roles": p["roles"]}
            if p.get("incomplete"):
                item["incomplete"] = True
            out.append(item)
        return out

    def summary(self) -> Dict[str, dict]:
        """Per phase kind, in :data:`PHASES` order: ``count``, ``peak`` (the worst per device),
        ``first`` (the roles of step 1) and ``steady`` (of step 2); JSON-ready."""
        out: Dict[str, dict] = {}
        phases = self.phases
        for kind in PHASES:
            mine = [p for p in phases if p["phase"] == kind]
            folded = self._folded.get(kind, {"count": 0, "peak": {}})
            if not mine and not folded["count"]:
                continue
            worst: Dict[str, int] = dict(folded["peak"])
            for p in mine:
                for dev, value in p["peak"].items():
                    worst[dev] = max(worst.get(dev, 0), int(value))
            out[kind] = {"count": len(mine) + folded["count"], "peak": worst, "first": _step_roles(mine, 1),
                         "steady": _step_roles(mine, 2)}
        return out

    @property
    def layers(self) -> List[Tuple[str, int]]:
        """``(qualified module name, activation bytes)``, heaviest first, at most five: the bytes
        autograd saved inside each submodule call of the first outermost forward (an empty list
        when that forward built no graph)."""
        return list(self._layers or [])

    # -- boundaries --------------------------------------------------------------------------------
    def _reading(self) -> Dict[str, Tuple[int, int]]:
        return self._read()[1]  # kept as given: a new mapping per call (peaks are worked out on demand)

    def _live_step(self) -> int:
        return self._steps_done + 1 if self._optims else max(self._forwards, 1)

    def _detailed(self, step: int) -> bool:
        if self._census is None:
            return False
        return step <= self.detail_steps or (self.every > 0 and step % self.every == 0)

    def _take(self, extra=()) -> Any:
        modules = [(name, ref()) for name, ref in self._modules]
        optims = [(name, ref()) for name, ref in self._optims]
        tensors = [(name, ref()) for name, ref in self._roots]
        return self._census([m for m in modules if m[1] is not None], [o for o in optims if o[1] is not None],
                            [t for t in tensors if t[1] is not None] + list(extra))

    def _begin(self, kind: str, forward: int = 0, extra=(), register: Optional[Callable[[bool], bool]] = None) -> None:
        """Open a phase: one reading (which also closes the span since the last phase) and, on a
        censused step, a census. ``register`` adds what the phase brings (its module and inputs, an
        optimizer) after the span is closed, so the span is compared with the same objects at both
        ends; a second census is taken only when it added something. ``register(detail)`` is
        told whether this phase is censused: the inputs and outputs of forwards are kept as census
        roots only then (a root added on a step that is not censused would serve no census)."""
        if self._open is not None:  # a phase that raised without its closing hook (a failed backward)
            self._end(incomplete=True)
        reading = self._reading()
        step = self._live_step()
        detail = self._detailed(step)
        mark = self._mark
        zeroed = mark is not None and self._zeroed(mark.grads, self._grads())
        # A zero_grad span after a censused phase gets its roles even when this step is not censused.
        snap = self._take(extra) if detail or (zeroed and mark.detail) else None
        if zeroed:
            self._span_phase(reading, snap)
        snap = snap if detail else None
        if register is not None and register(detail):
            step = self._live_step()
            if detail:
                snap = self._take(extra)
        self._open = {"phase": kind, "forward": forward, "steps_done": self._steps_done,
                      "start": reading, "snap": snap,
                      "detail": detail, "step": step}

    def _end(self, extra=(), incomplete: bool = False) -> None:
        phase, self._open = self._open, None
        if phase is None:
            return
        if phase["phase"] == "backward":
            self._bw_node = None
        reading = self._reading()
        snap = self._take(extra) if phase["detail"] else None
        before = phase.pop("snap")
        phase["end"] = reading  # peak and delta are worked out when `phases` is read, not here
        phase["roles"] = _roles(snap, before)
        if incomplete:
            phase["incomplete"] = True
        self._record(phase)
        self._mark = _Mark(reading, snap, self._grads(), phase["step"], phase["detail"])

    def _span_phase(self, reading, snap) -> None:
        """The span since the last phase freed or zeroed the gradients: record it as zero_grad."""
        mark = self._mark
        self._record({"phase": "zero_grad", "forward": 0, "steps_done": self._steps_done, "step": mark.step,
                      "detail": mark.detail, "start": mark.reading, "end": reading, "roles": _roles(snap, mark.snap)})

    def _record(self, phase: dict) -> None:
        """Keep a phase; past :data:`MAX_PHASES`, only censused ones are kept and the rest are folded
        into per-kind counts and worst peaks (a loop of 100k steps must not grow a list of 400k)."""
        if len(self._raw) < MAX_PHASES or phase["detail"]:
            self._raw.append(phase)
            return
        fold = self._folded.setdefault(phase["phase"], {"count": 0, "peak": {}})
        fold["count"] += 1
        start = phase["start"]
        for dev, (cur, peak) in phase["end"].items():
            rise = max(0, int(peak) - int(start.get(dev, (cur,))[0]))
            fold["peak"][dev] = max(fold["peak"].get(dev, 0), rise)

    # -- zero_grad -----------------------------------------------------------------------------------
    def _grads(self) -> list:
        """``(id, _version)`` of the gradients of a sample of the parameters seen (None where one
        has none). A sample (:data:`GRAD_SAMPLE`, spread over the model) because zero_grad touches
        every gradient, and reading ``.grad`` of each of a large model's parameters at each phase
        boundary would cost more than the rest of the watcher."""
        out = []
        grad, version = self._tensor_reads()
        for ref in self._sample:
            p = ref()
            g = None if p is None else grad(p)
            out.append(None if g is None else (id(g), version(g)))
        return out

    def _tensor_reads(self):
        """``TensorBase``'s C getters of ``.grad`` and ``._version``: a subclass's properties never run."""
        return self._api.tensor_base.grad.__get__, self._api.version_counter()

    def _zeroed(self, before: list, after: list) -> bool:
        if before == after:
            return False
        present = [i for i, b in enumerate(before) if b is not None and i < len(after)]
        if not present:
            return False
        if any(after[i] is None for i in present):
            return True  # freed: zero_grad(set_to_none=True)
        if any(after[i] == before[i] for i in present):
            return False  # some gradient untouched: not a zero_grad of these parameters
        # Every gradient rewritten in place: zero_grad(set_to_none=False) zeroes them, clipping
        # scales them. Read the smallest one to tell which.
        smallest = None
        grad, _version = self._tensor_reads()
        base = self._api.tensor_base
        for i in present:
            p = self._sample[i]()
            g = None if p is None else grad(p)
            if g is not None and (smallest is None or base.numel(g) < base.numel(smallest)):
                smallest = g
        if smallest is None:
            return False
        with self._api.no_torch_function():
            return not bool(base.any(smallest))

    # -- registries --------------------------------------------------------------------------------
    def _name(self, obj) -> str:
        base = type(obj).__name__
        n = self._names.get(base, 0) + 1
        self._names[base] = n
        return base if n == 1 else f"{base}#{n}"

    def _see_params(self, params) -> None:
        for p in params:
            if id(p) not in self._param_ids:
                self._param_ids.add(id(p))
                self._params.append(weakref.ref(p))
        n = len(self._params)
        picks = range(n) if n <= GRAD_SAMPLE else sorted({round(i * (n - 1) / (GRAD_SAMPLE - 1))
                                                          for i in range(GRAD_SAMPLE)})
        self._sample = [self._params[i] for i in picks]

    def _see_module(self, module) -> bool:
        ref = self._module_ids.get(id(module))
        if ref is not None and ref() is module:
            return False
        self._module_ids[id(module)] = weakref.ref(module)
        self._modules.append((self._name(module), weakref.ref(module)))
        # Read from the instance dicts: an overridden parameters() or __getattr__ never runs.
        self._see_params(module_parts(module)[1])
        return True

    def _see_optimizer(self, opt) -> bool:
        ref = self._optim_ids.get(id(opt))
        if ref is not None and ref() is opt:
            return False
        self._optim_ids[id(opt)] = weakref.ref(opt)
        self._optims.append((self._name(opt), weakref.ref(opt)))
        attrs = instance_attrs(opt) or {}  # an optimizer's own dict: no property or __getattr__ of a subclass runs
        groups = dict.get(attrs, "param_groups")
        self._see_params(p for group in (list(groups) if type(groups) is list else ())
                         if type(group) is dict for p in list(dict.get(group, "params", ()) or ()))
        return True

    def _keep_roots(self, name: str, tensors) -> bool:
        roots = [(n, r) for n, r in self._roots if r() is not None]
        have = {id(r()) for _n, r in roots}
        added = False
        for t in tensors:
            if id(t) not in have:
                have.add(id(t))
                roots.append((name, weakref.ref(t)))
                added = True
        self._roots = roots[-MAX_ROOTS:]
        return added

    # -- what the hooks report (tensors.hooks.PhaseHooks calls these) ------------------------------
    def forward_start(self, module, args) -> bool:
        """An outermost forward begins; True asks for its submodule calls (the layers of the first one)."""
        if not self._on:
            return False
        if self._open is not None and self._open["phase"] != "backward":
            return False  # inside another phase (LBFGS's closure): not a phase of its own
        self._forwards += 1
        inputs = self._hooks.tensors(args)

        def register(detail):
            new_module = self._see_module(module)
            return (detail and self._keep_roots("inputs", inputs)) or new_module

        self._begin("forward", forward=self._forwards, register=register)
        self._open["module"] = id(module)
        if self._layers is None and self._lay is None and self._api.torch.is_grad_enabled():
            self._lay = LayerTracker(Walk(self._api, None, caches=False, user_modules=False), module, inputs)
            return True
        return False

    def submodule_enter(self, module, args, depth: int) -> None:
        if self._lay is not None:
            self._lay.enter(module, self._hooks.tensors(args), depth)

    def submodule_exit(self, module, output, depth: int) -> None:
        if self._lay is not None:
            self._lay.exit(module, self._hooks.tensors(output))

    def forward_end(self, module, args, outputs: list, failed: bool) -> None:
        phase = self._open
        if not self._on or phase is None or phase["phase"] != "forward" or phase.get("module") != id(module):
            return
        if phase["detail"]:
            self._keep_roots("outputs", outputs)
        phase.pop("module", None)
        lay, self._lay = self._lay, None
        self._end(incomplete=failed)
        if lay is not None:
            try:
                self._layers = lay.finish(outputs) if not failed else None
            finally:
                lay.walk.store.memo = {}

    def backward_start(self, forward: int) -> bool:
        """A backward reaches an outermost forward's graph; False when it is part of a phase already open."""
        if not self._on or self._open is not None:
            # The same backward reaching another output of ours, one nested in it, or
            # autograd.grad inside a forward or a step: part of the phase already open.
            return False
        # The engine's node is the census's way into a graph whose output the user dropped:
        # fetched (and held until the end of this backward) only on a censused step.
        node = self._api.current_node() if self._detailed(self._live_step()) else None
        extra = [("autograd graph", GraphHandle(node))] if node is not None else []
        self._begin("backward", forward=forward, extra=extra)
        self._bw_node = node
        return True

    def backward_end(self) -> None:
        """The engine's final callback: the graph task is done (gradients accumulated)."""
        node, self._bw_node = self._bw_node, None
        if self._on and self._open is not None and self._open["phase"] == "backward":
            self._end(extra=[("autograd graph", GraphHandle(node))] if node is not None else [])

    def step_start(self, opt) -> None:
        if not self._on or (self._open is not None and self._open["phase"] != "backward"):
            return  # an optimizer stepping inside another (a wrapper): one phase
        self._begin("optimizer_step", register=lambda _detail: self._see_optimizer(opt))
        self._open["optimizer"] = id(opt)

    def step_end(self, opt) -> None:
        phase = self._open
        if not self._on or phase is None or phase["phase"] != "optimizer_step" or phase.get("optimizer") != id(opt):
            return
        phase.pop("optimizer", None)
        self._steps_done += 1
        self._end()


# -- helpers -------------------------------------------------------------------------------------------
def _one_line(where: str, exc: BaseException) -> str:
    text = f"{where}: {type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else f"{where}: {type(exc).__name__}"
    return text[:200]


def _roles(after, before) -> Optional[dict]:
    if after is None or before is None:
        return None
    return after.diff(before).table


def _step_roles(phases: List[dict], step: int) -> Optional[dict]:
    tables = [p["roles"] for p in phases if p["step"] == step]
    if not tables or any(t is None for t in tables):
        return None
    return add_tables(*tables)
