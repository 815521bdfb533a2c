"""Exact live-storage accounting of a run (real or fake tensors): every allocation and free in order, with its role, phase and module.

A :class:`StorageTracker` is a ``TorchDispatchMode``: each operator's outputs are looked at, a
storage seen for the first time is an allocation (views share their base's storage, so a storage
is counted once, by its untyped storage), and a ``weakref.finalize`` on the storage is its free.
The same tracker measures a real CPU run (the ground truth of the tests and the benchmark) and the
fake run of an estimate, so the two are compared like for like.

Alongside the events it notes what tells the roles apart (tensors autograd saves for backward,
through ``torch.autograd.graph.saved_tensors_hooks``) and the phases (global module forward
hooks, optimizer step hooks, autograd's current graph task), all removed when the run ends.
"""
from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Dict, List, Optional

__all__ = ["StorageTracker", "Run", "user_frame"]

_OWN = ("/torch/", "/ipy_gpumem/", "/contextlib.py", "/copy.py", "/functools.py")


def user_frame(frame=None, tb=None):
    """(filename, line number, source line) of the innermost frame of the user's code, or None.

    The user's code is any frame outside torch, this package's preflight room and the standard
    library helpers it runs through.
    """
    import linecache

    frames = []
    if tb is not None:
        while tb is not None:
            frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
            tb = tb.tb_next
        frames.reverse()
    else:
        f = frame or sys._getframe(1)
        while f is not None:
            frames.append((f.f_code.co_filename, f.f_lineno))
            f = f.f_back
    for filename, lineno in frames:
        name = filename.replace("\\", "/")
        if any(part in name for part in _OWN) or "/site-packages/pytest" in name or "/_pytest/" in name:
            continue
        return filename, lineno, linecache.getline(filename, lineno).strip()
    return None


class Run:
    """The record of one tracked run: events, tags and the phase and module marks."""

    def __init__(self):
        #: (key, size): size >= 0 allocates a storage under a new key, -1 frees it
        self.events: List[tuple] = []
        #: key -> role for storages that existed before the run ("parameters", ...)
        self.initial_roles: Dict[int, str] = {}
        #: key -> event index at which autograd first saved it for backward
        self.saved_at: Dict[int, int] = {}
        #: keys of storages found as a parameter's .grad / in optimizer state at some hook
        self.grad_keys: set = set()
        self.state_keys: set = set()
        #: (event index, phase, step) marks, in order: the phase that starts at that event
        self.phase_marks: List[tuple] = []
        #: per module name: {"type", "activations", "calls", "peak"} (bytes)
        self.modules: Dict[str, dict] = {}
        #: user lines that asked for a tensor's value (fake runs): (filename, line, source)
        self.value_reads: List[tuple] = []
        self.sizes: Dict[int, int] = {}
        #: keys of storages that existed before the run and that an op of the run read or wrote, or
        #: that the run freed: the step's own state. What it never touched is not its working set.
        self.touched: set = set()

    def unused_existing(self) -> set:
        """Keys of storages there before the run that the run never touched."""
        return set(self.initial_roles) - self.touched


def _make_mode_class():
    from .torch_api import api

    adapter = api()
    torch = adapter.torch
    TorchDispatchMode = adapter.dispatch_mode
    tree_leaves = adapter.tree_leaves
    aten = torch.ops.aten
    _graph_task = adapter.graph_task_id
    # Ops whose meta kernel reports an empty workspace that the real CPU kernel does allocate
    # (oneDNN's RNN keeps one for backward): sized by running the real kernel once per shape.
    real_sized = {getattr(aten, name).default for name in ("mkldnn_rnn_layer",) if hasattr(aten, name)}
    Tensor = torch.Tensor

    class _Mode(TorchDispatchMode):
        def __init__(self, tracker):
            super().__init__()
            self.tracker = tracker

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tracker = self.tracker
            if tracker.fake and func is aten._local_scalar_dense.default:
                try:  # a fake tensor that knows its value (a scalar made by torch.tensor) gives it
                    return func(*args, **kwargs)
                except Exception:  # noqa: BLE001 - DataDependentOutputException and kin
                    return tracker.value_needed(args[0])
            if _graph_task() != -1:
                if tracker._phase != "backward":
                    tracker.mark("backward")
            elif tracker._phase == "backward":
                tracker.mark("other")
            if tracker.redirect is not None and "device" in kwargs:
                kwargs = dict(kwargs)
                kwargs["device"] = tracker.redirect(kwargs["device"])
            if tracker.run.initial_roles:
                tracker.touch(args)
            out = func(*args, **kwargs)
            if tracker.fake and func in real_sized:
                out = tracker.real_workspace(func, args, kwargs, out)
            if isinstance(out, Tensor):
                tracker.saw(out)
            elif isinstance(out, (tuple, list)):
                for t in tree_leaves(out):
                    if isinstance(t, Tensor):
                        tracker.saw(t)
            if tracker.after_op is not None:
                tracker.after_op(func, out)
            return out

    return _Mode


_MODE_CLASS = None


def _adapter():
    from .torch_api import api

    return api()


def _tensor_type():
    from .torch_api import api

    return api().torch.Tensor


class StorageTracker:
    """Counts live storage bytes while a run executes under it (a context manager).

    Args:
        fake: the run uses fake tensors (a value read, ``.item()``, is answered with 0 and noted).
        redirect: maps a ``device=`` argument of a factory or copy to the device the run really
            uses (a fake run computes on the CPU whatever device it stands for).
    """

    def __init__(self, fake: bool = False, redirect: Optional[Callable[[Any], Any]] = None):
        global _MODE_CLASS
        if _MODE_CLASS is None:
            _MODE_CLASS = _make_mode_class()
        self._mode = _MODE_CLASS(self)
        self.fake = fake
        self.redirect = redirect
        self.run = Run()
        self._keys: Dict[int, int] = {}     # storage _cdata -> key of the live storage
        self._next_key = 0
        self.live = 0
        self.peak = 0
        self._stack: List[list] = []        # module forward frames: [name, saved bytes, start live, peak]
        self._handles: List[Any] = []
        self._module_names: Dict[int, str] = {}
        self.current_step = 0  # the call of the step running now (1, 2): a cell's line markers read it
        self._phase = None
        self._saved_hooks = None
        self._tensor_type = _tensor_type()
        self._workspace_sizes: Dict[str, int] = {}
        #: called as ``after_op(func, out)`` once each operator has run and its outputs are counted (a
        #: CUDA estimate adds cuBLAS's workspace at the first matrix multiply there, and the scratch a
        #: kernel takes from the allocator for the time of the call: :meth:`allocate`, :meth:`release`)
        self.after_op: Optional[Callable[[Any, Any], None]] = None

    # -- storages ----------------------------------------------------------------------------
    def key_of(self, tensor) -> Optional[int]:
        """The key of a tensor's storage if it is tracked (None otherwise)."""
        try:
            return self._keys.get(tensor.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return None

    def add_existing(self, tensor, role: str) -> None:
        """Count a storage that exists before the run (a parameter, optimizer state, an input)."""
        key = self._track(tensor)
        if key is not None and key not in self.run.initial_roles:
            self.run.initial_roles[key] = role

    def touch(self, args) -> None:
        """Mark the existing storages among an op's arguments (tensors, and lists of them) as used."""
        initial, touched, tensor = self.run.initial_roles, self.run.touched, self._tensor_type
        for arg in args:
            items = arg if type(arg) in (list, tuple) else (arg,)
            for item in items:
                if isinstance(item, tensor):
                    key = self.key_of(item)
                    if key is not None and key in initial:
                        touched.add(key)

    def saw(self, tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers: not counted
            return
        cdata = storage._cdata
        key = self._keys.get(cdata)
        if key is None:
            self._track(tensor, storage)
        else:
            size = storage.nbytes()
            if size != self.run.sizes[key]:  # resized in place (resize_, out= arguments)
                self._free(cdata, key)
                self._track(tensor, storage)

    def _track(self, tensor, storage=None):
        if storage is None:
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return None
        cdata = storage._cdata
        key = self._keys.get(cdata)
        if key is not None:
            return key
        key = self._next_key
        self._next_key += 1
        size = storage.nbytes()
        self._keys[cdata] = key
        self.run.sizes[key] = size
        self.run.events.append((key, size))
        self.live += size
        if self.live > self.peak:
            self.peak = self.live
        if self._stack and self.live > self._stack[-1][3]:
            self._stack[-1][3] = self.live  # folded into the enclosing module when this one returns
        weakref.finalize(storage, self._free, cdata, key)
        return key

    def allocate(self, size: int) -> int:
        """Count ``size`` bytes the run allocates outside any tensor and keeps to its end (cuBLAS's
        workspace, which torch takes from the caching allocator): an allocation never freed. Its key."""
        key = self._next_key
        self._next_key += 1
        self.run.sizes[key] = size
        self.run.events.append((key, size))
        self.live += size
        self.peak = max(self.peak, self.live)
        if self._stack and self.live > self._stack[-1][3]:
            self._stack[-1][3] = self.live
        return key

    def release(self, key: int) -> None:
        """Count the free of what :meth:`allocate` counted (a kernel's scratch, given back before it returns)."""
        size = self.run.sizes.get(key)
        if size is None:
            return
        self.run.events.append((key, -1))
        self.live -= size

    def _free(self, cdata, key):
        if self._keys.get(cdata) != key:
            return
        if key in self.run.initial_roles:
            self.run.touched.add(key)  # the step freed something that was there: part of its world
        del self._keys[cdata]
        self.run.events.append((key, -1))
        self.live -= self.run.sizes[key]

    def real_workspace(self, func, args, kwargs, out):
        """``out`` with its last output (the workspace) resized to what the real CPU kernel allocates."""
        from .torch_api import api

        adapter = api()
        torch = adapter.torch
        _disable_current_modes = adapter.disable_current_modes

        def tree_map(fn, value):
            return adapter.tree_map(fn, value)

        key = (str(func), repr(tree_map(lambda a: (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a,
                                        (args, kwargs))))
        size = self._workspace_sizes.get(key)
        if size is None:
            def real(a):
                return torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a
            try:
                with _disable_current_modes():  # grad mode on: the kernel keeps a workspace only when training
                    real_out = func(*tree_map(real, args), **tree_map(real, kwargs))
                size = real_out[-1].numel()
            except Exception:  # noqa: BLE001 - keep the meta kernel's answer
                size = out[-1].numel()
            self._workspace_sizes[key] = size
        if size == out[-1].numel():
            return out
        workspace = torch.empty(size, dtype=out[-1].dtype, device=out[-1].device)
        return tuple(out[:-1]) + (workspace,)

    # -- values a fake tensor cannot give ----------------------------------------------------
    def value_needed(self, tensor):
        where = user_frame(sys._getframe(2))
        if where is not None and where not in self.run.value_reads:
            self.run.value_reads.append(where)
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            return 0.0
        if str(tensor.dtype) == "torch.bool":
            return False
        return 0

    # -- phases, saved tensors, modules ------------------------------------------------------
    def mark(self, phase: str) -> None:
        """Start ``phase`` at the current event (a repeated phase is one phase)."""
        if phase != self._phase:
            self._phase = phase
            self.run.phase_marks.append((len(self.run.events), phase, self.current_step))

    def start_step(self, step: int) -> None:
        self.current_step = step
        self._phase = None
        self.mark("other")

    def name_modules(self, modules) -> None:
        """Name every submodule of ``modules`` as ``named_modules`` does (the roots by their index)."""
        for i, module in enumerate(modules):
            prefix = module.__class__.__name__ if len(modules) == 1 else f"{i}.{module.__class__.__name__}"
            for name, sub in module.named_modules():
                self._module_names.setdefault(id(sub), f"{prefix}.{name}" if name else prefix)

    def note_optimizer(self, optimizer) -> None:
        """Remember which storages are optimizer state and gradients (called at its step hooks)."""
        import torch

        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    key = self.key_of(p.grad)
                    if key is not None:
                        self.run.grad_keys.add(key)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    key = self.key_of(value)
                    if key is not None:
                        self.run.state_keys.add(key)

    def note_grads(self, modules) -> None:
        for module in modules:
            for p in module.parameters():
                if p.grad is not None:
                    key = self.key_of(p.grad)
                    if key is not None:
                        self.run.grad_keys.add(key)

    def _pack(self, tensor):
        """Note when autograd saves a storage (an activation from then on), and save a detached alias:
        saving the tensor itself would make an output saved by its own op (``relu``, ``sigmoid``,
        ``softmax``) hold its own ``grad_fn``, a cycle that keeps a dropped graph alive until a garbage
        collection, so a forward called twice would count its first graph into the second."""
        key = self.key_of(tensor)
        if key is not None and key not in self.run.saved_at and key not in self.run.initial_roles:
            self.run.saved_at[key] = len(self.run.events)
            size = self.run.sizes[key]
            for frame in self._stack:
                frame[1] += size
        return tensor.detach()

    def _pre_forward(self, module, args):
        if _adapter().in_backward():
            return  # a forward recomputed during backward (checkpointing) stays in backward
        self.mark("forward")
        self._stack.append([self._module_names.get(id(module), type(module).__name__), 0, self.live, self.live])

    def _post_forward(self, module, args, output):
        if _adapter().in_backward() or not self._stack:
            return
        name, saved, start, peak = self._stack.pop()
        if self._stack and peak > self._stack[-1][3]:
            self._stack[-1][3] = peak
        row = self.run.modules.setdefault(name, {"type": type(module).__name__, "activations": 0,
                                                 "calls": 0, "peak": 0})
        if self.current_step == 2 or not row.get("_seen2"):
            if self.current_step == 2 and not row.get("_seen2"):
                row.update(activations=0, calls=0, peak=0, _seen2=True)
            row["activations"] += saved
            row["calls"] += 1
            row["peak"] = max(row["peak"], peak - start)

    def __enter__(self):
        import torch
        from torch.nn.modules.module import (register_module_forward_hook,
                                             register_module_forward_pre_hook)
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)

        def pre_step(optimizer, args, kwargs):
            self.note_optimizer(optimizer)
            self.mark("optimizer_step")

        def post_step(optimizer, args, kwargs):
            self.note_optimizer(optimizer)
            self.mark("other")

        self._handles = [register_module_forward_pre_hook(self._pre_forward),
                         register_module_forward_hook(self._post_forward),
                         register_optimizer_step_pre_hook(pre_step),
                         register_optimizer_step_post_hook(post_step)]
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved_hooks.__enter__()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self._mode.__exit__(*exc)
        finally:
            self._saved_hooks.__exit__(*exc)
            for handle in self._handles:
                handle.remove()
            self._handles = []
        return False

    def in_backward(self) -> bool:
        return _adapter().in_backward()
