"""The one adapter to torch's private names: each is read here once, with its fallback and the versions it was checked on.

Everything else in the package reaches torch's internals through :func:`api` (an :class:`Api`
bound to the torch the user imported), the way ``torch/cuda/memory.py`` wraps each
``torch._C._cuda_*`` call once for the rest of torch. When torch renames or drops a name, this
is the one file to edit, and :data:`DEPENDENCIES` is the list a test checks against the installed
torch. Nothing here imports torch: the module is read through ``sys.modules`` (the user's), and a
name missing from an older or newer torch resolves to its fallback (None, or a public API), never
to an error.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, NamedTuple, Optional, Tuple

__all__ = ["Api", "api", "Dependency", "DEPENDENCIES", "CHECKED_ON"]

#: The torch releases every entry of :data:`DEPENDENCIES` was checked on (the CPU build here; the
#: CUDA names on a CUDA build through ``tests/whole/test_gpu.py`` when a GPU is lent).
CHECKED_ON = ("2.13.0",)


class Dependency(NamedTuple):
    """One private torch name we use: where it lives, what for, and what happens without it."""

    name: str
    purpose: str
    fallback: str


DEPENDENCIES: Tuple[Dependency, ...] = (
    Dependency("torch._C.TensorBase (torch._C._TensorBase before 2.1)",
               "C descriptors of tensor state (untyped_storage, grad, grad_fn, is_leaf, layout): read without a "
               "subclass's Python overrides or __torch_function__", "required (every torch since 1.0 has one of them)"),
    Dependency("torch._C.StorageBase", "C descriptors of a storage (device, nbytes, data_ptr) for bulk reads",
               "per-tensor reads through the public UntypedStorage methods"),
    Dependency("torch._C._autograd.SavedTensor (.data, .unpack_hook)",
               "what an autograd node saved, read without running saved-tensor unpack hooks; the unpack hook's "
               "closure holds what a pack hook kept elsewhere (non-reentrant checkpointing keeps its inputs there)",
               "no saved tensors are read (activations count as 0, with a note)"),
    Dependency("autograd node attributes _raw_saved_*", "the SavedTensor objects of a node",
               "none: as above"),
    Dependency("torch.autograd.function.BackwardCFunction", "tells a custom Function's node (whose ctx attributes "
               "keep tensors) from a built-in one", "ctx attributes are not read"),
    Dependency("torch._C.DisableTorchFunctionSubclass", "keeps tensor subclasses' __torch_function__ from running "
               "while the walk reads tensors", "torch._C.DisableTorchFunction, else nothing"),
    Dependency("torch._C._current_graph_task_id", "tells code that runs inside backward (checkpoint recomputation) "
               "from the forward", "assumed outside backward"),
    Dependency("torch._C._current_autograd_node", "the node the engine is running: the only handle on a graph "
               "whose output nobody holds any more", "that graph is not counted during its backward"),
    Dependency("torch.autograd.Variable._execution_engine.queue_callback", "a callback when a backward's graph "
               "task ends (how torch.utils.module_tracker finds the end of backward)", "no end of backward: the "
               "phase closes at the next boundary"),
    Dependency("torch.utils._python_dispatch (TorchDispatchMode, _get_current_dispatch_mode_stack, "
               "_disable_current_modes)", "the estimate's storage tracker (wrapper subclasses are recognised by "
               "their class's __tensor_flatten__ and read through their instance attributes: no method of theirs "
               "runs)", "no estimate"),
    Dependency("torch.utils._pytree (tree_leaves, tree_flatten, tree_map)", "tensors inside a module's inputs and "
               "outputs (tuples, dicts, ModelOutput)", "plain tuples, lists and dicts only"),
    Dependency("torch._subclasses.fake_tensor.FakeTensorMode", "tensors with shapes and no memory for the estimate",
               "no estimate"),
    Dependency("FakeTensorMode.fake_tensor_converter.from_real_tensor(make_constant=True)", "a scalar (an "
               "optimizer's step count) faked with its value, so .item() on it is exact", "no estimate"),
    Dependency("TensorBase._version", "a tensor's version counter, which every in-place write bumps: whether "
               "zero_grad(set_to_none=False) rewrote the gradients (a cell's phases)", "required (every torch "
               "since 0.4 has it)"),
    Dependency("aten::_scaled_dot_product_flash_attention, _scaled_dot_product_efficient_attention, "
               "_scaled_dot_product_cudnn_attention, _scaled_dot_product_attention_math",
               "the attention kernel a named GPU picks, run on the estimate's CPU fakes", "the estimate fails on a "
               "CUDA step that calls scaled_dot_product_attention, naming the line"),
    Dependency("Tensor._indices(), Tensor._values() (sparse COO)", "the storages of an uncoalesced sparse tensor "
               "(the public indices() requires a coalesced one)", "coalesced tensors only, through indices()"),
    Dependency("torch._C._has_cuda", "a CPU-only build (public: torch.backends.cuda.is_built())", "the public call"),
    Dependency("torch._C._cuda_hasPrimaryContext", "which devices the user's code touched (reading another would "
               "create a context there)", "the current device, plus devices whose allocator holds memory"),
    Dependency("torch._C._cuda_memoryStats", "the allocator's counters as a nested dict, ~7x cheaper than the "
               "public memory_stats()", "torch.cuda.memory_stats_as_nested_dict"),
    Dependency("torch._C._cuda_attach_out_of_memory_observer", "the allocator's state at the failing allocation",
               "no capture: the panel reads the error message and a reading taken after it"),
    Dependency("torch._C._cuda_getAllocatorBackend", "native caching allocator or cudaMallocAsync (observers exist "
               "only for the native one)", "assumed native"),
    Dependency("torch.cuda._lazy_call", "attach the OOM observer inside CUDA's lazy initialisation, so the first "
               "CUDA cell's OOM is captured", "attach once CUDA is up"),
    Dependency("torch._C._ExcludeDispatchKeyGuard, torch._C.DispatchKeySet, torch._C.DispatchKey.AutocastCPU",
               "the estimate's CUDA autocast emulation: its AutocastCPU kernels run an op below the autocast key "
               "(as torch.library.register_autocast does) or let it fall through to the next key",
               "no emulation: a CUDA autocast region runs as CPU autocast (the CPU's op lists), with a note"),
    Dependency("torch._C._dispatch_get_all_op_names, torch._C._dispatch_has_kernel_for_dispatch_key",
               "the ops CPU autocast casts (those not in CUDA's lists fall through under the emulation) and CUDA's "
               "own list in this torch (a test checks the emulation's table against it)",
               "the CPU-only ops keep the CPU's casts"),
    Dependency("OpOverload._schema.arguments", "where an op takes its optional dtype (CUDA autocast's "
               "fp32_set_opt_dtype policy sets it)", "the dtype is passed by keyword"),
    Dependency("Tensor._is_view()", "autocast's weight cache keeps casts of leaves that are not views",
               "every leaf counts as not a view"),
    Dependency("torch.cuda.memory._record_memory_history, torch.cuda.memory._snapshot, "
               "torch._C._cuda_isHistoryEnabled", "%%gpumem --trace: the allocator's own event history for one "
               "cell, and whether the user's recording was already on (then it is left exactly as it was)",
               "--trace says it is unavailable in one line; the cell is measured without it"),
    Dependency("torch._C._get_sdp_priority_order, torch._C._get_fa3_sdp_enabled",
               "the order in which scaled_dot_product_attention tries its CUDA kernels (torch.nn.attention."
               "sdpa_kernel(..., set_priority=True) changes it) and whether FlashAttention-3 is on, for the "
               "estimate's choice of attention kernel on a named GPU", "torch's default order (flash, "
               "memory-efficient, math, cuDNN) and FlashAttention-3 off"),
    Dependency("torch.library.Library._destroy", "takes the emulation's kernels off the dispatcher when it ends "
               "(the tests; a batch search estimates several times in one child)",
               "the kernels stay registered in the sealed child, which dies with them"),
)


def _get(obj: Any, dotted: str) -> Any:
    """``obj.a.b.c`` or None when any step is missing (never raises)."""
    for part in dotted.split("."):
        try:
            obj = getattr(obj, part)
        except Exception:  # noqa: BLE001 - a missing or broken attribute is a missing name
            return None
    return obj


def _submodule(name: str) -> Any:
    """A torch submodule if torch already imported it (torch imports all of these itself)."""
    return sys.modules.get(name)


class Api:
    """torch's private names, resolved once for one torch module (``api(torch)`` caches it).

    Attributes are the resolved objects (None when this torch has no such name); methods wrap
    the ones that need a guard. Reading an attribute never imports anything.
    """

    def __init__(self, torch: Any):
        self.torch = torch
        C = getattr(torch, "_C", None)
        self.tensor_base = _get(C, "TensorBase") or _get(C, "_TensorBase")
        self.storage_base = _get(C, "StorageBase")
        self.saved_tensor = _get(C, "_autograd.SavedTensor") or _get(C, "_SavedTensor")
        # SavedTensor.data (torch >= 2.4 or so) is what was saved, or what a pack hook returned,
        # without running unpack hooks; SavedTensor.unpack_hook (checked on 2.13) is the hook.
        self.saved_has_data = self.saved_tensor is not None and hasattr(self.saved_tensor, "data")
        self.saved_has_unpack_hook = self.saved_tensor is not None and hasattr(self.saved_tensor, "unpack_hook")
        function = _submodule("torch.autograd.function")
        self.backward_cfunction = getattr(function, "BackwardCFunction", None)
        self.disable_torch_function = _get(C, "DisableTorchFunctionSubclass") or _get(C, "DisableTorchFunction")
        self._task_id = _get(C, "_current_graph_task_id")
        self._current_node = _get(C, "_current_autograd_node")
        self._engine = _get(torch, "autograd.Variable._execution_engine")
        dispatch = _submodule("torch.utils._python_dispatch")
        self.dispatch_mode = getattr(dispatch, "TorchDispatchMode", None)
        self._mode_stack = getattr(dispatch, "_get_current_dispatch_mode_stack", None)
        self.disable_current_modes = getattr(dispatch, "_disable_current_modes", None)
        self._pytree = _submodule("torch.utils._pytree")
        self._has_cuda = _get(C, "_has_cuda")
        self._has_primary_context = _get(C, "_cuda_hasPrimaryContext")
        self._memory_stats = _get(C, "_cuda_memoryStats")
        self._attach_oom = _get(C, "_cuda_attach_out_of_memory_observer")
        self._allocator_backend = _get(C, "_cuda_getAllocatorBackend")
        self._lazy_call = _get(torch, "cuda._lazy_call")
        self._exclude_keys = _get(C, "_ExcludeDispatchKeyGuard")
        self._keyset = _get(C, "DispatchKeySet")
        self._autocast_cpu = _get(C, "DispatchKey.AutocastCPU")
        self._all_ops = _get(C, "_dispatch_get_all_op_names")
        self._has_kernel = _get(C, "_dispatch_has_kernel_for_dispatch_key")
        self._sdp_order = _get(C, "_get_sdp_priority_order")
        self._fa3_enabled = _get(C, "_get_fa3_sdp_enabled")

    # -- autograd --------------------------------------------------------------------------------
    def raw_saved_names(self, node_type: type) -> Tuple[str, ...]:
        """The ``_raw_saved_*`` attributes of an autograd node type (``SavedTensor`` objects)."""
        try:
            return tuple(a for a in dir(node_type) if a.startswith("_raw_saved_"))
        except Exception:  # noqa: BLE001
            return ()

    def graph_task_id(self) -> int:
        """The running backward's graph task id, -1 outside backward."""
        fn = self._task_id
        if fn is None:
            return -1
        try:
            return fn()
        except Exception:  # noqa: BLE001
            return -1

    def in_backward(self) -> bool:
        return self.graph_task_id() != -1

    def current_node(self) -> Any:
        """The autograd node the engine is running now (None outside backward or on an old torch)."""
        fn = self._current_node
        try:
            return fn() if fn is not None else None
        except Exception:  # noqa: BLE001
            return None

    def queue_backward_callback(self, callback: Callable[[], None]) -> bool:
        """Run ``callback`` when the current backward's graph task ends; False if it cannot be queued."""
        engine = self._engine
        if engine is None:
            return False
        engine.queue_callback(callback)
        return True

    def no_torch_function(self) -> Any:
        """A context in which tensor subclasses' ``__torch_function__`` does not run."""
        ctx = self.disable_torch_function
        return ctx() if ctx is not None else _Null()

    # -- dispatch and fake tensors ---------------------------------------------------------------
    def dispatch_modes(self) -> tuple:
        """The dispatch modes active now, outermost first."""
        fn = self._mode_stack
        try:
            return tuple(fn()) if fn is not None else ()
        except Exception:  # noqa: BLE001
            return ()

    def fake_tensor_mode(self) -> Any:
        """The ``FakeTensorMode`` class (importing it, the first time, is the estimate's own cost)."""
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415 - only when estimating

        return FakeTensorMode

    def fake_loggers(self) -> Tuple[str, ...]:
        """The loggers FakeTensorMode writes to (silenced while an estimate runs)."""
        return ("torch._subclasses.fake_tensor", "torch._subclasses.meta_utils", "torch.fx.experimental.symbolic_shapes")

    def fake_constant(self, mode: Any, t: Any) -> Any:
        """A fake of ``t`` under FakeTensorMode ``mode`` that keeps its value (``.item()`` on it is exact)."""
        return mode.fake_tensor_converter.from_real_tensor(mode, t, make_constant=True)

    def is_wrapper_subclass(self, t: Any) -> bool:
        """True for a traceable wrapper subclass (NJT, DTensor, float8), decided by its class's own
        dicts: nothing of the subclass (``__getattr__``, a property) runs."""
        tp = type(t)
        if tp is self.torch.Tensor or not issubclass(tp, self.torch.Tensor):
            return False
        found = set()
        for klass in type.__dict__["__mro__"].__get__(tp):
            found.update(n for n in ("__tensor_flatten__", "__tensor_unflatten__")
                         if n in type.__dict__["__dict__"].__get__(klass))
        return len(found) == 2

    def inner_tensors(self, t: Any) -> list:
        """The tensors a wrapper subclass keeps as attributes (its instance dict, read through the C
        ``__dict__`` getter, and one level into its lists, tuples and dicts): what ``__tensor_flatten__``
        would name, without running it (a user's subclass's method is user code)."""
        tensor = self.torch.Tensor
        desc = None
        for klass in type.__dict__["__mro__"].__get__(type(t)):
            desc = type.__dict__["__dict__"].__get__(klass).get("__dict__")
            if desc is not None:
                break
        if type(desc).__name__ != "getset_descriptor":
            return []
        try:
            attrs = desc.__get__(t, type(t))
        except Exception:  # noqa: BLE001
            return []
        out = []
        for value in list(dict.values(attrs)) if type(attrs) is dict else ():
            if isinstance(value, tensor):
                out.append(value)
            elif type(value) in (list, tuple):
                out.extend(v for v in value if isinstance(v, tensor))
            elif type(value) is dict:
                out.extend(v for v in dict.values(value) if isinstance(v, tensor))
        return out

    def tree_leaves(self, value: Any) -> list:
        """The leaves of a pytree (tuples, lists, dicts, ModelOutput); the value itself without pytree."""
        fn = getattr(self._pytree, "tree_leaves", None)
        if fn is None:
            return list(value) if isinstance(value, (list, tuple)) else [value]
        return fn(value)

    def tree_map(self, fn: Callable, value: Any) -> Any:
        return self._pytree.tree_map(fn, value)

    # -- what a tensor without a storage of its own is made of ------------------------------------
    def component_tensors(self, t: Any, layout: Any) -> tuple:
        """The tensors holding a sparse tensor's memory (empty for a plain one), through
        ``TensorBase``'s C methods (a subclass's overrides never run)."""
        torch, base = self.torch, self.tensor_base
        if layout == torch.sparse_coo:
            try:
                return (base._indices(t), base._values(t))
            except Exception:  # noqa: BLE001 - a torch without the private pair
                return (base.indices(t), base.values(t))
        if layout in (getattr(torch, "sparse_csr", None), getattr(torch, "sparse_bsr", None)):
            return (base.crow_indices(t), base.col_indices(t), base.values(t))
        if layout in (getattr(torch, "sparse_csc", None), getattr(torch, "sparse_bsc", None)):
            return (base.ccol_indices(t), base.row_indices(t), base.values(t))
        return ()

    def version_counter(self) -> Callable[[Any], int]:
        """``f(t)`` -> ``t._version`` (bumped by every in-place write), through ``TensorBase``'s C getter:
        a subclass's property never runs."""
        return self.tensor_base._version.__get__

    def quantizer_tensors(self, t: Any) -> tuple:
        """A per-channel quantized tensor's scales and zero points (stored beside its data), else ()."""
        torch, base = self.torch, self.tensor_base
        try:
            if not base.is_quantized.__get__(t) or base.qscheme(t) not in (
                    torch.per_channel_affine, torch.per_channel_symmetric,
                    getattr(torch, "per_channel_affine_float_qparams", None)):
                return ()
            return (base.q_per_channel_scales(t), base.q_per_channel_zero_points(t))
        except Exception:  # noqa: BLE001
            return ()

    # -- CUDA ---------------------------------------------------------------------------------------
    def cuda_built(self) -> bool:
        """False for a CPU-only build (a build flag: reading it initialises nothing)."""
        flag = self._has_cuda
        return True if flag is None else bool(flag)

    def cuda_has_context(self) -> Optional[Callable[[int], bool]]:
        """``f(index)``: whether a device has a primary context (None on a torch without the call)."""
        return self._has_primary_context

    def cuda_stats(self) -> Callable[[int], dict]:
        """``f(index)`` -> the allocator's counters as a nested dict (the fast private call, else the public one)."""
        return self._memory_stats if self._memory_stats is not None else self.torch.cuda.memory_stats_as_nested_dict

    def allocator_backend(self) -> Optional[str]:
        fn = self._allocator_backend
        try:
            return str(fn()) if fn is not None else None
        except Exception:  # noqa: BLE001
            return None

    def attach_oom_observer(self) -> Optional[Callable[[Callable], None]]:
        return self._attach_oom

    def lazy_cuda_call(self) -> Optional[Callable[[Callable], None]]:
        return self._lazy_call


    # -- the dispatcher (the estimate's CUDA emulation, in its sealed child) ------------------------
    def autocast_kernels_supported(self) -> bool:
        """Whether Python kernels can be put on the AutocastCPU key and run below it."""
        return None not in (self._exclude_keys, self._keyset, self._autocast_cpu)

    def below_autocast_cpu(self) -> Any:
        """A context in which ops skip the AutocastCPU key (what an autocast kernel runs its op in)."""
        return self._exclude_keys(self._keyset(self._autocast_cpu))

    def without_autocast_cpu(self, keyset: Any) -> Any:
        """``keyset`` less AutocastCPU: redispatching with it falls through to the next key."""
        return keyset.remove(self._autocast_cpu)

    def ops_with_kernel(self, key: str) -> Tuple[str, ...]:
        """The qualified names of the operators with a kernel of their own for dispatch key ``key``."""
        if self._all_ops is None or self._has_kernel is None:
            return ()
        try:
            return tuple(n for n in self._all_ops() if self._has_kernel(n, key))
        except Exception:  # noqa: BLE001
            return ()

    def op_argument_names(self, op: Any) -> Tuple[Tuple[str, bool], ...]:
        """``(name, keyword only)`` of an OpOverload's arguments, in order (() when unknown)."""
        try:
            return tuple((a.name, bool(a.kwarg_only)) for a in op._schema.arguments)
        except Exception:  # noqa: BLE001
            return ()

    def attention_kernel(self, kernel: str) -> Any:
        """The aten op of one of scaled_dot_product_attention's kernels: ``"flash"``, ``"efficient"``,
        ``"cudnn"`` or ``"math"`` (AttributeError from torch when this torch has no such op)."""
        return getattr(self.torch.ops.aten, _ATTENTION_OPS[kernel])

    def is_view(self, t: Any) -> bool:
        try:
            return bool(t._is_view())
        except Exception:  # noqa: BLE001
            return False

    def drop_library(self, lib: Any) -> bool:
        """Take a ``torch.library.Library``'s kernels off the dispatcher; False when this torch cannot."""
        destroy = getattr(lib, "_destroy", None)
        if destroy is None:
            return False
        destroy()
        return True

    # -- scaled_dot_product_attention's switches (the estimate's choice of kernel on a named GPU) ---
    def sdp_priority_order(self) -> Tuple[int, ...]:
        """The SDPBackend numbers in the order scaled_dot_product_attention tries them on CUDA (torch's
        default, flash 1, memory-efficient 2, math 0, cuDNN 3, overrideable 4, when this torch cannot say)."""
        try:
            return tuple(int(n) for n in self._sdp_order())
        except Exception:  # noqa: BLE001 - missing or failing: the default order
            return (1, 2, 0, 3, 4)

    def fa3_sdp_enabled(self) -> bool:
        """Whether FlashAttention-3 is switched on for scaled_dot_product_attention (False when unknown)."""
        try:
            return bool(self._fa3_enabled())
        except Exception:  # noqa: BLE001
            return False


    # -- the allocator's history (%%gpumem --trace) ------------------------------------------------
    def history_enabled(self) -> Optional[bool]:
        """Whether the CUDA allocator records its history now; None when this torch cannot say."""
        probe = getattr(getattr(self.torch, "_C", None), "_cuda_isHistoryEnabled", None)
        if probe is None:
            return None
        return bool(probe())

    def record_history(self, max_entries: int) -> None:
        """Start recording allocator events with Python stacks, at most ``max_entries`` kept."""
        memory = self.torch.cuda.memory
        memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=int(max_entries))

    def stop_history(self) -> None:
        """Stop recording (and drop what was recorded: the snapshot was taken before)."""
        self.torch.cuda.memory._record_memory_history(enabled=None)

    def allocator_snapshot(self) -> Any:
        """``torch.cuda.memory._snapshot()``: segments, blocks and the recorded events, as plain data."""
        return self.torch.cuda.memory._snapshot()


_ATTENTION_OPS = {"flash": "_scaled_dot_product_flash_attention", "efficient": "_scaled_dot_product_efficient_attention",
                  "cudnn": "_scaled_dot_product_cudnn_attention", "math": "_scaled_dot_product_attention_math"}


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_CACHE: dict = {}


def api(torch: Any = None) -> Optional[Api]:
    """The adapter for ``torch`` (default: the torch the user imported); None when torch is not imported."""
    if torch is None:
        torch = sys.modules.get("torch")
        if torch is None or not hasattr(torch, "Tensor"):
            return None
    cached = _CACHE.get(id(torch))
    if cached is None or cached.torch is not torch:
        cached = _CACHE[id(torch)] = Api(torch)
    return cached
