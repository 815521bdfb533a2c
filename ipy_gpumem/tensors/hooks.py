"""The global hooks that mark training phases while one cell runs: the outermost forward's start and end, a backward's start and end, an optimizer step.

Which torch mechanism marks each, and why that one:

``forward``
    ``torch.nn.modules.module.register_module_forward_pre_hook`` (global: every module call of any
    model) finds the outermost call of a forward. A global module hook costs every module call
    torch's slow path (a 300-module model runs 1.3x slower with two no-op global hooks), so it is
    registered only *between* forwards: at an outermost call it is removed, and the end of that
    call is marked by a forward hook registered on that one module instance for that one call
    (``always_call=True``: it also runs when forward raises), which takes itself off and puts the
    global pre-hook back. The module's submodules therefore run torch's fast path. When the
    listener wants the submodule calls of a forward (the first one, to name its heaviest layers),
    the global pre- and post-hooks stay for that forward instead, counting the depth as
    ``torch.utils.module_tracker.ModuleTracker`` does.

    The instance hook is taken off inside its own call when the forward returned (torch then
    iterates over a copy of the hooks). When the forward raised, torch iterates the live dict, so
    it is taken off at the next event or when watching stops; until then a module whose forward
    just raised holds one inert hook of ours.
``backward``
    A pre-hook on the ``grad_fn`` of each outermost forward's outputs (``Node.register_prehook``)
    marks the start when the engine reaches the model's graph; the end is a callback queued on the
    engine from inside that hook, which the engine runs when the whole graph task is done. Global
    *full backward* module hooks are not used: they wrap every module's outputs in
    ``BackwardHookFunction``, so an in-place op on an output fails, which a watcher must not cause.
``optimizer_step``
    ``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``..._post_hook`` (global, cheap:
    one call per step).

Calls from other threads, from inside a backward (checkpointing's recomputed forwards) or while
``torch.compile`` traces are not ours. No hook raises into the user's code: the listener's
methods are called through :meth:`PhaseHooks._call`, which turns an exception into
``listener.failed(exc, where)`` and goes inert. Nothing here holds a tensor, an output or a graph:
node pre-hooks hold a weak reference to this object.
"""
from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, List, Optional

__all__ = ["PhaseHooks"]

#: Graph pre-hook handles kept before the handles of freed graphs are dropped.
_HANDLES = 32


class PhaseHooks:
    """The hooks of one watched cell; ``listener`` receives the events.

    The listener's methods: ``forward_start(module, args) -> bool`` (True: report this forward's
    submodule calls), ``forward_end(module, args, output, failed)``, ``submodule_enter(module,
    args, depth)``, ``submodule_exit(module, output, depth)``, ``backward_start(forward)``,
    ``backward_end()``, ``step_start(optimizer)``, ``step_end(optimizer)``, ``failed(exc, where)``.
    """

    def __init__(self, api: Any, listener: Any):
        self.api = api
        self.listener = listener
        self.on = False
        self.reason: Optional[str] = None
        self._thread = None
        self._compiling = lambda: False
        self._pre = None  # the global pre-hook's handle, while registered
        self._post = None  # the global post-hook's handle (deep forwards)
        self._instance = None  # (module, handle) of the per-call post hook
        self._dead: List[Any] = []  # handles to take off at the next event (a forward that raised)
        self._step_handles: List[Any] = []
        self._node_handles: List[Any] = []
        self._depth = 0
        self._root = None  # id of the module whose outermost call is running
        self._deep = False
        self._forwards = 0

    # -- start / stop -----------------------------------------------------------------------------
    def start(self) -> bool:
        """Register the global hooks for this cell; False when this torch lacks them."""
        torch = self.api.torch
        try:
            from torch.nn.modules import module as nn_module  # noqa: PLC0415 - the user imported torch
            from torch.optim import optimizer as optim_module  # noqa: PLC0415
        except Exception as exc:  # noqa: BLE001
            self.reason = f"hooks unavailable: {type(exc).__name__}"
            return False
        self._nn = nn_module
        self._thread = threading.get_ident()
        compiler = getattr(torch, "compiler", None)
        self._compiling = getattr(compiler, "is_compiling", None) or (lambda: False)
        try:
            self._step_handles = [optim_module.register_optimizer_step_pre_hook(self._step_pre),
                                  optim_module.register_optimizer_step_post_hook(self._step_post)]
            self._pre = nn_module.register_module_forward_pre_hook(self._forward_pre)
        except Exception as exc:  # noqa: BLE001 - an old torch without one of them: watch nothing
            self.stop()
            self.reason = f"hooks unavailable: {type(exc).__name__}: {exc}"
            return False
        self.on = True
        return True

    def stop(self) -> None:
        """Take every hook off (global, per module, per graph). Idempotent, never raises."""
        self.on = False
        handles = self._step_handles + self._node_handles + self._dead
        handles += [h for h in (self._pre, self._post) if h is not None]
        if self._instance is not None:
            handles.append(self._instance[1])
        for handle in handles:
            try:
                handle.remove()
            except Exception:  # noqa: BLE001 - a graph (and its dict of hooks) already freed
                pass
        self._step_handles, self._node_handles, self._dead = [], [], []
        self._pre = self._post = self._instance = None
        self._root = None
        self._depth = 0

    def _fail(self, exc: BaseException, where: str) -> None:
        """Go inert after an internal error (hooks stay registered but do nothing until stop())."""
        self.on = False
        if self.reason is None:
            self.reason = f"{where}: {type(exc).__name__}: {exc}".splitlines()[0][:200]
        try:
            self.listener.failed(exc, where)
        except Exception:  # noqa: BLE001
            pass

    def _ours(self) -> bool:
        """A call that concerns us: the cell's thread, not inside autograd, not while compiling."""
        return threading.get_ident() == self._thread and not self.api.in_backward() and not self._compiling()

    def _sweep(self) -> None:
        for handle in self._dead:
            try:
                handle.remove()
            except Exception:  # noqa: BLE001
                pass
        self._dead = []

    # -- forward ----------------------------------------------------------------------------------
    def _forward_pre(self, module, args):
        if not self.on:
            return None
        try:
            if not self._ours():
                return None
            if self._root is not None:  # inside a deep forward: a submodule call
                self._depth += 1
                if self._depth <= 3:
                    self.listener.submodule_enter(module, args, self._depth)
                return None
            if self._dead:
                self._sweep()
            self._forwards += 1
            deep = bool(self.listener.forward_start(module, args))
            self._root = id(module)
            self._depth = 1
            self._deep = deep
            if deep:
                self._post = self._nn.register_module_forward_hook(self._forward_post, always_call=True)
            else:
                # Off the global path for the rest of this call: the submodules run torch's fast path.
                self._pre.remove()
                self._pre = None
                self._instance = (module, module.register_forward_hook(self._root_done, always_call=True))
        except Exception as exc:  # noqa: BLE001 - never into the user's forward
            self._fail(exc, "forward pre-hook")
        return None

    def _forward_post(self, module, args, output):
        """The global post-hook of a deep forward: submodule exits, then the root's end."""
        if not self.on:
            return None
        try:
            if not self._ours() or self._root is None:
                return None
            self._depth -= 1
            if self._depth > 0:
                if self._depth < 3:
                    self.listener.submodule_exit(module, output, self._depth + 1)
                return None
            if id(module) != self._root:
                return None
            failed = sys.exc_info()[1] is not None
            post, self._post = self._post, None
            if failed:
                self._dead.append(post)  # torch is iterating the live dict: taken off at the next event
            else:
                post.remove()
            self._ended(module, args, output, failed)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, "forward hook")
        return None

    def _root_done(self, module, args, output):
        """The per-call post-hook on the outermost module: take itself off, put the global pre-hook back."""
        if not self.on:
            return None
        try:
            if self._instance is None or self._instance[0] is not module:
                return None
            handle = self._instance[1]
            self._instance = None
            failed = sys.exc_info()[1] is not None
            if failed:
                self._dead.append(handle)
            else:
                handle.remove()
            self._ended(module, args, output, failed)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, "forward hook")
        return None

    def _ended(self, module, args, output, failed: bool) -> None:
        self._root = None
        self._depth = 0
        if self._pre is None and self.on:
            self._pre = self._nn.register_module_forward_pre_hook(self._forward_pre)
        outputs = [] if failed else self.tensors(output)
        self.listener.forward_end(module, args, outputs, failed)
        if not failed:
            self._watch_backward(outputs, self._forwards)

    def tensors(self, value: Any) -> list:
        """The tensors in a module's inputs or outputs (tuples, lists, dicts, ``ModelOutput``)."""
        tensor = self.api.torch.Tensor
        if isinstance(value, tensor):
            return [value]
        if type(value) is tuple and all(isinstance(v, tensor) for v in value):
            return list(value)  # the common case (a module's positional args), without pytree's walk
        try:
            leaves = self.api.tree_leaves(value)
        except Exception:  # noqa: BLE001
            leaves = list(value) if isinstance(value, (list, tuple)) else []
        return [t for t in leaves if isinstance(t, tensor)]

    # -- backward ---------------------------------------------------------------------------------
    def _watch_backward(self, outputs, forward: int) -> None:
        """A pre-hook on each output's grad_fn; it holds only a weakref to these hooks."""
        if len(self._node_handles) > _HANDLES:  # handles of graphs already freed
            self._node_handles = [h for h in self._node_handles if h.hooks_dict_ref() is not None]
        me = weakref.ref(self)
        seen = set()
        for t in outputs:
            fn = t.grad_fn
            if fn is None or id(fn) in seen:
                continue
            seen.add(id(fn))

            def prehook(grad_outputs, _me=me, _forward=forward):
                hooks = _me()
                if hooks is not None:
                    hooks._backward_pre(_forward)
                return None

            self._node_handles.append(fn.register_prehook(prehook))

    def _backward_pre(self, forward: int) -> None:
        if not self.on:
            return
        try:
            if not self.listener.backward_start(forward):
                return  # part of a backward already open
            me = weakref.ref(self)

            def done(_me=me):
                hooks = _me()
                if hooks is not None and hooks.on:
                    try:
                        hooks.listener.backward_end()
                    except Exception as exc:  # noqa: BLE001
                        hooks._fail(exc, "backward end")

            self.api.queue_backward_callback(done)
        except Exception as exc:  # noqa: BLE001 - never into the engine
            self._fail(exc, "backward pre-hook")

    # -- optimizer ----------------------------------------------------------------------------------
    def _step_pre(self, opt, args, kwargs):
        if not self.on:
            return None
        try:
            if self._ours():
                if self._dead:
                    self._sweep()
                self.listener.step_start(opt)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, "optimizer step pre-hook")
        return None

    def _step_post(self, opt, args, kwargs):
        if not self.on:
            return None
        try:
            if self._ours():
                self.listener.step_end(opt)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, "optimizer step hook")
        return None
