"""Training phases of a cell (forward, backward, optimizer step, zero_grad) with their peaks and roles, recognised
from the modules, autograd graphs and optimizers the cell used, through hooks that exist only while the cell runs.

The loop does not have to be written in the cell: ``train_one_epoch(model, opt, data)`` is seen
from inside, because every hook is global (torch calls it for any module, any optimizer) and is
removed when the cell ends. Which torch mechanism recognises each phase, and why that one:

``forward``
    The outermost module call: ``torch.nn.modules.module.register_module_forward_pre_hook`` and
    ``register_module_forward_hook(always_call=True)`` with a depth count, which is how
    ``torch.utils.module_tracker.ModuleTracker`` follows the module tree. ``always_call`` runs the
    closing hook even when ``forward`` raises (an OOM inside forward closes the phase, marked
    ``incomplete``). Module calls made while autograd runs (activation checkpointing's
    recomputation) belong to the backward and are not phases.
``backward``
    A pre-hook on the ``grad_fn`` of each outermost forward's outputs (``Node.register_prehook``)
    opens it when the engine reaches the model's graph; the end is a callback queued on the engine
    from inside that hook (``Variable._execution_engine.queue_callback``, as ModuleTracker does),
    which the engine runs when the whole graph task is done. Global *full backward* module hooks
    are not used: they wrap every module's outputs in ``BackwardHookFunction``, so an in-place op
    on an output fails ("a view ... is being modified inplace"), which a watcher must not cause.
    The engine runs the loss's few nodes before it reaches the model's outputs, so the backward
    phase starts after them (their bytes fall in the span before it).
``optimizer_step``
    ``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``..._post_hook`` (global, every
    ``Optimizer.step`` goes through ``profile_hook_step``). The outermost step only: an optimizer
    wrapping another, or LBFGS running forward and backward inside ``step(closure)``, is one phase.
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

Layers: during the first outermost forward with autograd on, the autograd nodes each submodule
call creates are walked from its outputs back to its inputs (``next_functions``), and the
tensors they saved for backward are read raw (``_raw_saved_*`` and ``SavedTensor.data``, as the
census and ``who()`` read them: no unpack hook runs). ``saved_tensors_hooks`` is not used: its
docstring says a pack hook returning the tensor itself makes a reference cycle (a saved output
holds its own ``grad_fn``), a detached copy would change how autograd checks versions, and only
the innermost pair of hooks applies, so ours would silently replace a user's. A saved tensor
belongs to the submodule whose call created it: one that is an input of the call that saved it
goes to the call that output it.

Nothing here holds a tensor, an output or a graph past its phase: modules, optimizers,
parameters, inputs and outputs are held by ``weakref``; the engine's node is held from the start
of a backward to its end; hook handles only hold a weak reference to the dict of hooks. No hook
raises into the user's code: every hook body is guarded, and an internal error stops the watching
(hooks go inert at once and are removed by :meth:`PhaseWatcher.stop`) and sets ``reason``.
"""
from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..core.roles import add_tables
from .census import raw_saved_names, saved_tensor_type

__all__ = ["PhaseWatcher", "PHASES"]

#: The phase kinds, in the order a summary lists them.
PHASES = ("forward", "backward", "optimizer_step", "zero_grad")
#: Inputs and outputs of outermost forwards kept (weakly) as census roots.
MAX_ROOTS = 64
#: Autograd nodes walked to find the layers' activations (a model with more is cut there).
MAX_LAYER_NODES = 100_000
#: Phases listed one by one; past this, only censused ones (the others are counted in the summary).
MAX_PHASES = 400
#: Parameters whose gradients are read at each boundary to recognise zero_grad (spread evenly).
GRAD_SAMPLE = 8
#: How many layers :attr:`PhaseWatcher.layers` names.
TOP_LAYERS = 5

Reading = Tuple[float, Dict[str, Tuple[int, int]]]


class _GraphRoot:
    """A stand-in the census takes for a tensor: it counts no storage of its own, and its
    ``grad_fn`` is the autograd node the engine is running (the graph's only handle left)."""

    __slots__ = ("grad_fn",)

    def __init__(self, grad_fn):
        self.grad_fn = grad_fn


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
        self._torch = None
        self._thread = None
        self._handles: list = []       # global hook handles
        self._node_handles: list = []  # grad_fn pre-hook handles (each holds only a weakref to its dict)
        self._depth = 0
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
        self._bw_task = None
        self._lay: Optional[dict] = None

    @property
    def watching(self) -> bool:
        """Whether the hooks are registered and live."""
        return self._on

    # -- start / stop ------------------------------------------------------------------------------
    def start(self) -> None:
        """Register the global hooks for this cell; a no-op without torch or when already watching."""
        if self._handles or self._on:
            return
        self._depth, self._open, self._bw_node, self._bw_task = 0, None, None, None
        torch = sys.modules.get("torch")
        if torch is None or not hasattr(torch, "nn") or not hasattr(torch, "optim"):
            return  # nothing to watch: a cell that never imported torch runs no module
        # Imported here, not at module level: the user has already imported torch.
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module

        self._torch = torch
        self._thread = threading.get_ident()
        compiler = getattr(torch, "compiler", None)
        self._compiling = getattr(compiler, "is_compiling", None) or (lambda: False)
        self._task_id = torch._C._current_graph_task_id
        self._current_node = getattr(torch._C, "_current_autograd_node", lambda: None)
        try:
            self._handles = [
                nn_module.register_module_forward_pre_hook(self._forward_pre),
                nn_module.register_module_forward_hook(self._forward_post, always_call=True),
                optim_module.register_optimizer_step_pre_hook(self._step_pre),
                optim_module.register_optimizer_step_post_hook(self._step_post),
            ]
        except Exception as exc:  # noqa: BLE001 - an old torch without one of them: watch nothing
            self._remove_handles()
            self.reason = _one_line("hooks unavailable", exc)
            return
        self._on = True

    def stop(self) -> None:
        """Remove every hook (global and per graph); closes the last span. Idempotent, never raises."""
        try:
            if self._on:
                self._on = False
                self._finish()
        except Exception as exc:  # noqa: BLE001
            self.reason = self.reason or _one_line("stop", exc)
        finally:
            self._on = False
            self._remove_handles()
            self._bw_node = None
            self._lay = None
            self._roots = []

    def _remove_handles(self) -> None:
        for handle in self._handles + self._node_handles:
            try:
                handle.remove()
            except Exception:  # noqa: BLE001 - the graph (and its dict of hooks) is gone already
                pass
        self._handles = []
        self._node_handles = []

    def _fail(self, exc: BaseException, where: str) -> None:
        """Stop watching after an internal error. Hooks are not removed here: torch may be iterating
        over the dict that holds them (``profile_hook_step`` iterates the global step hooks lazily),
        so they go inert and :meth:`stop` removes them."""
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
            self._bw_node, self._bw_task = None, None
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
        for ref in self._sample:
            p = ref()
            g = None if p is None else p.grad
            out.append(None if g is None else (id(g), g._version))
        return out

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
        for i in present:
            p = self._sample[i]()
            g = None if p is None else p.grad
            if g is not None and (smallest is None or g.numel() < smallest.numel()):
                smallest = g
        return smallest is not None and not bool(smallest.any())

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
        self._see_params(module.parameters())
        return True

    def _see_optimizer(self, opt) -> bool:
        ref = self._optim_ids.get(id(opt))
        if ref is not None and ref() is opt:
            return False
        self._optim_ids[id(opt)] = weakref.ref(opt)
        self._optims.append((self._name(opt), weakref.ref(opt)))
        self._see_params(p for group in opt.param_groups for p in group.get("params", ()))
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

    # -- hooks ---------------------------------------------------------------------------------------
    def _ours(self) -> bool:
        """A hook call that concerns us: same thread as the cell, not inside autograd (modules
        recomputed by checkpointing) and not while torch.compile traces."""
        return threading.get_ident() == self._thread and self._task_id() == -1 and not self._compiling()

    def _forward_pre(self, module, args):
        if not self._on:
            return None
        try:
            if not self._ours():
                return None
            self._depth += 1
            if self._depth == 1:
                if self._open is not None and self._open["phase"] != "backward":
                    return None  # inside another phase (LBFGS's closure): not a phase of its own
                self._forwards += 1
                inputs = _tensors(self._torch, args)

                def register(detail):
                    new_module = self._see_module(module)
                    return (detail and self._keep_roots("inputs", inputs)) or new_module

                self._begin("forward", forward=self._forwards, register=register)
                self._open["module"] = id(module)
                if self._layers is None and self._lay is None and self._torch.is_grad_enabled():
                    self._lay = _layers_start(module, inputs)
            elif self._lay is not None and self._open is not None and self._open.get("module") is not None:
                _layers_enter(self._lay, module, args, self._depth, self._torch)
        except Exception as exc:  # noqa: BLE001 - never into the user's forward
            self._fail(exc, "forward pre-hook")
        return None

    def _forward_post(self, module, args, output):
        if not self._on:
            return None
        try:
            if not self._ours():
                return None
            self._depth = max(0, self._depth - 1)
            phase = self._open
            if phase is None or phase["phase"] != "forward" or phase.get("module") is None:
                return None
            if self._depth > 0:
                if self._lay is not None:
                    _layers_exit(self._lay, module, output, self._depth + 1, self._torch)
                return None
            if phase["module"] != id(module):
                return None
            # always_call runs this hook from forward's `except` block too: the forward raised.
            failed = sys.exc_info()[1] is not None
            outputs = [] if failed else _tensors(self._torch, output)
            if phase["detail"]:
                self._keep_roots("outputs", outputs)
            phase.pop("module", None)
            lay, self._lay = self._lay, None
            self._end(incomplete=failed)
            if lay is not None and not failed:
                self._layers = _layers_finish(lay, outputs, self._torch)
            self._watch_backward(outputs, phase["forward"])
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, "forward hook")
        return None

    def _watch_backward(self, outputs, forward: int) -> None:
        """A pre-hook on each output's grad_fn; it holds only a weakref to this watcher."""
        if len(self._node_handles) > 32:  # handles of graphs already freed
            self._node_handles = [h for h in self._node_handles if h.hooks_dict_ref() is not None]
        me = weakref.ref(self)
        seen = set()
        for t in outputs:
            fn = t.grad_fn
            if fn is None or id(fn) in seen:
                continue
            seen.add(id(fn))

            def prehook(grad_outputs, _me=me, _forward=forward):
                watcher = _me()
                if watcher is not None:
                    watcher._backward_pre(_forward)
                return None

            self._node_handles.append(fn.register_prehook(prehook))

    def _backward_pre(self, forward: int) -> None:
        if not self._on:
            return
        try:
            if self._open is not None:
                # The same backward reaching another output of ours, one nested in it, or
                # autograd.grad inside a forward or a step: part of the phase already open.
                return
            # The engine's node is the census's way into a graph whose output the user dropped:
            # fetched (and held until the end of this backward) only on a censused step.
            node = self._current_node() if self._detailed(self._live_step()) else None
            extra = [("autograd graph", _GraphRoot(node))] if node is not None else []
            self._begin("backward", forward=forward, extra=extra)
            self._bw_node, self._bw_task = node, self._task_id()
            me = weakref.ref(self)

            def done(_me=me):
                watcher = _me()
                if watcher is not None:
                    watcher._backward_end()

            self._torch.autograd.Variable._execution_engine.queue_callback(done)
        except Exception as exc:  # noqa: BLE001 - never into the engine
            self._fail(exc, "backward pre-hook")

    def _backward_end(self) -> None:
        """The engine's final callback: the graph task is done (gradients accumulated)."""
        node = self._bw_node
        if not self._on:
            self._bw_node = None
            return
        try:
            if self._open is not None and self._open["phase"] == "backward":
                self._end(extra=[("autograd graph", _GraphRoot(node))] if node is not None else [])
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, "backward end")
        self._bw_node = None

    def _step_pre(self, opt, args, kwargs):
        if not self._on:
            return None
        try:
            if not self._ours():
                return None
            if self._open is not None and self._open["phase"] != "backward":
                return None  # an optimizer stepping inside another (a wrapper): one phase
            self._begin("optimizer_step", register=lambda _detail: self._see_optimizer(opt))
            self._open["optimizer"] = id(opt)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, "optimizer step pre-hook")
        return None

    def _step_post(self, opt, args, kwargs):
        if not self._on:
            return None
        try:
            if not self._ours():
                return None
            phase = self._open
            if phase is None or phase["phase"] != "optimizer_step" or phase.get("optimizer") != id(opt):
                return None
            phase.pop("optimizer", None)
            self._steps_done += 1
            self._end()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, "optimizer step hook")
        return None


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


def _tensors(torch, value) -> list:
    """The tensors in a module's inputs or outputs (tuples, lists, dicts, ``ModelOutput``)."""
    tensor = torch.Tensor
    if isinstance(value, tensor):
        return [value]
    if type(value) is tuple and all(isinstance(v, tensor) for v in value):
        return list(value)  # the common case (a module's positional args), without pytree's walk
    try:
        from torch.utils._pytree import tree_flatten  # what ModuleTracker uses for the same job

        leaves, _spec = tree_flatten(value)
    except Exception:  # noqa: BLE001
        leaves = list(value) if isinstance(value, (list, tuple)) else []
    return [t for t in leaves if isinstance(t, tensor)]


# -- layers ------------------------------------------------------------------------------------------
# The first outermost forward's submodule calls (depth 2 = the root's own calls, depth 3 = theirs),
# each walked at its end from its outputs back to its inputs. ``keep`` holds the node objects seen
# until the root's forward ends, so ``id()`` stays unique while they are compared; they are all
# reachable from the forward's live outputs anyway, and the whole record is dropped at its end.

def _storage_key(t):
    """``((data pointer, device), bytes)`` of a tensor's storage, or None (sparse, nested, fake)."""
    try:
        st = t.untyped_storage()
        return (st.data_ptr(), str(t.device)), st.nbytes()
    except Exception:  # noqa: BLE001
        return None


def _keys(tensors) -> set:
    return {k[0] for k in map(_storage_key, tensors) if k is not None}


def _layers_start(root, inputs) -> dict:
    names = {}
    try:
        names = {id(m): name for name, m in root.named_modules() if name}
    except Exception:  # noqa: BLE001
        pass
    exclude = set()
    try:
        for t in list(root.parameters()) + list(root.buffers()):
            key = _storage_key(t)
            if key is not None:
                exclude.add(key[0])
    except Exception:  # noqa: BLE001
        pass
    lay = {"root": type(root).__name__, "names": names, "exclude": exclude, "visited": set(), "keep": [],
           "stack": [], "owner": {}, "sizes": {}, "pending": {}, "outs": {}, "parent": {}, "budget": MAX_LAYER_NODES}
    lay["root_stop"] = _stop_set(lay, inputs)
    lay["root_inputs"] = _keys(inputs)
    return lay


def _stop_set(lay, tensors) -> set:
    stop = set()
    for t in tensors:
        fn = t.grad_fn
        if fn is not None:
            lay["keep"].append(fn)
            stop.add(id(fn))
    return stop


def _layers_enter(lay, module, args, depth, torch) -> None:
    if depth > 3:
        return
    inputs = _tensors(torch, args)
    name = lay["names"].get(id(module)) or type(module).__name__
    if depth == 3 and lay["stack"]:
        lay["parent"].setdefault(name, lay["stack"][-1]["name"])
    lay["stack"].append({"module": id(module), "name": name, "depth": depth, "stop": _stop_set(lay, inputs),
                         "inputs": _keys(inputs)})


def _layers_exit(lay, module, output, depth, torch) -> None:
    if depth > 3 or not lay["stack"] or lay["stack"][-1]["module"] != id(module):
        return
    frame = lay["stack"].pop()
    outputs = _tensors(torch, output)
    for key in _keys(outputs):
        lay["outs"].setdefault(key, frame["name"])
    for key, nbytes in _walk_saved(lay, outputs, frame["stop"] | lay["root_stop"], torch):
        if key in frame["inputs"]:
            lay["pending"][key] = nbytes  # created before this call: goes to the call that output it
        else:
            _attribute(lay, key, nbytes, frame["name"])


def _attribute(lay, key, nbytes, name) -> None:
    if key in lay["exclude"] or key in lay["owner"]:
        return
    lay["owner"][key] = name
    lay["sizes"][name] = lay["sizes"].get(name, 0) + nbytes


def _layers_finish(lay, outputs, torch) -> List[Tuple[str, int]]:
    own = f"({lay['root']}.forward)"  # ops the root's own forward ran outside any submodule
    for key, nbytes in _walk_saved(lay, outputs, lay["root_stop"], torch):
        if key not in lay["root_inputs"]:
            lay["pending"].setdefault(key, nbytes)
    for key, nbytes in lay["pending"].items():
        if key in lay["root_inputs"]:
            continue  # the caller's input, saved by the first layer: no layer made it
        _attribute(lay, key, nbytes, lay["outs"].get(key, own))
    sizes, parent = lay["sizes"], lay["parent"]
    lay["keep"].clear()
    top: Dict[str, int] = {}
    for name, nbytes in sizes.items():
        top[parent.get(name, name)] = top.get(parent.get(name, name), 0) + nbytes
    total = sum(top.values())
    if len(top) == 1 and total:
        # One submodule holds it all (a wrapper such as ``model.backbone``): name what is inside it.
        only = next(iter(top))
        inner = {name: n for name, n in sizes.items() if parent.get(name) == only}
        if inner:
            inner_total = sum(inner.values())
            if sizes.get(only, 0) or inner_total < total:
                inner[only] = total - inner_total
            top = inner
    ranked = sorted(((name, n) for name, n in top.items() if n > 0), key=lambda kv: -kv[1])
    return ranked[:TOP_LAYERS]


def _walk_saved(lay, outputs, stop, torch):
    """``(storage key, bytes)`` of the tensors saved by the nodes new since the last walk, from
    ``outputs`` back to ``stop`` (the grad_fns of the call's inputs)."""
    visited, keep = lay["visited"], lay["keep"]
    saved_type = saved_tensor_type(torch)
    stack = []
    for t in outputs:
        fn = t.grad_fn
        if fn is not None:
            stack.append(fn)
    found = []
    while stack:
        node = stack.pop()
        if id(node) in visited or id(node) in stop:
            continue
        lay["budget"] -= 1
        if lay["budget"] < 0:
            break
        visited.add(id(node))
        keep.append(node)
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in visited and id(nxt) not in stop:
                stack.append(nxt)
        for attr in raw_saved_names(type(node)):
            try:
                raw = getattr(node, attr)
            except Exception:  # noqa: BLE001
                continue
            for item in raw if type(raw) in (list, tuple) else (raw,):
                if item is None or (saved_type is not None and type(item) is not saved_type):
                    continue
                try:
                    data = item.data
                    key = _storage_key(data) if isinstance(data, torch.Tensor) else None
                    if key is not None:
                        found.append(key)
                except Exception:  # noqa: BLE001 - released, or no storage (a checkpoint placeholder)
                    continue
    return found
