"""Inside the sealed child: a CUDA step's memory where it differs from the CPU's, emulated on the CPU fakes that stand for its tensors.

Without a GPU the estimate computes on CPU fakes (a fake "cuda" tensor on a CPU-only torch aborts
in autocast's weight cache), so wherever a CUDA run allocates differently the CPU's answer would
be the wrong one. Three places do, in torch 2.13:

- **Autocast.** ``torch.autocast("cuda", dtype)`` casts other ops than CPU autocast does: CUDA runs
  ``bmm``, ``einsum``, ``linear``... in the low dtype and ``softmax``, ``exp``, ``sum``, the norms and
  the losses in fp32, where the CPU keeps ``softmax`` in its input dtype and casts ``cat`` or
  ``mse_loss``. CUDA also keeps a low-precision copy of every fp32 leaf that requires grad (a
  weight) until the outermost autocast region exits: real memory. :class:`CudaAutocast` runs a
  CUDA region as a CPU one whose ``AutocastCPU`` kernels apply CUDA's lists (torch's
  ``aten/src/ATen/autocast_mode.h``) and its weight cache, and lets the CPU-only casts fall through.
- **cuBLAS's workspace.** The first matrix multiply of each cuBLAS handle (one per thread) and
  stream takes a workspace from the caching allocator and keeps it (``CublasHandlePool.cpp``,
  ``getCurrentCUDABlasHandle``; cuBLASLt shares it by default). Backward runs on the autograd
  engine's device thread, so a training step takes two: a real capture shows both
  (``sil_mem_snapshot.pickle``: 8,519,680 bytes at the forward's first ``bmm``, again at the
  backward's). :class:`CublasWorkspaces` adds them to the tracked allocations.
- **Foreach optimizers.** Left to choose, most of ``torch.optim`` takes the multi-tensor path on
  CUDA and the for-loop on the CPU; the two differ in temporaries (:func:`like_cuda`).
- **Dropout.** ``dropout`` in training runs CUDA's fused ``native_dropout``, which keeps a one-byte
  mask for backward; the CPU draws a mask of the input's dtype and keeps that (``Dropout.cpp``,
  ``is_fused_kernel_acceptable``): 4 bytes an element in fp32 where CUDA keeps 1 (:class:`CudaDropout`).
- **Attention.** ``scaled_dot_product_attention`` picks its kernel by the GPU's rules
  (:mod:`.attention`), and a fused kernel's backward takes scratch for the time of its call.
- **Convolutions.** cuDNN picks each convolution's algorithm when it runs and takes its workspace
  from the caching allocator for the call; its size is not known without the card, so the
  estimate counts the convolutions it saw and says so (:class:`Convolutions`).

All of it changes torch's dispatcher or classes, so it runs in the sealed child, whose changes
die with it (the tests run it in-process and undo it on exit).
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Dict, Iterable, Iterator, NamedTuple

__all__ = ["POLICIES", "GEMMS", "FOREACH_BY_DEFAULT", "CudaAutocast", "CublasWorkspaces", "like_cuda",
           "CudaDropout", "AttentionScratch", "Convolutions", "AfterOps", "CudaRun", "cuda_emulation"]

# CUDA's autocast lists in torch 2.13, as registered for the Autocast(CUDA) key by
# aten/src/ATen/autocast_mode.cpp from the macros of autocast_mode.h. "op" is the default overload.
_LOWER = ("_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
          "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
          "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
          "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
          "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
          "cudnn_convolution", "cudnn_convolution_transpose")                      # AT_FORALL_LOWER_PRECISION_FP
_FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
         "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
         "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
         "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
         "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
         "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
         "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
         "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
         "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
         "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
         "_upsample_bicubic2d_aa")                                                  # AT_FORALL_FP32
_FP32_SET_OPT_DTYPE = ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                       "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
                       "sum.dim_IntList")                                           # AT_FORALL_FP32_SET_OPT_DTYPE
_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
            "tensordot", "scatter_add")                                             # AT_FORALL_PROMOTE
#: AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: these norms run as their dtype overload, in fp32.
_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}

#: op name -> CUDA autocast policy ("lower", "fp32", "set_opt_dtype", "append_dtype", "promote", "banned").
POLICIES: Dict[str, str] = {**dict.fromkeys(_LOWER, "lower"), **dict.fromkeys(_FP32, "fp32"),
                            **dict.fromkeys(_FP32_SET_OPT_DTYPE, "set_opt_dtype"),
                            **dict.fromkeys(_APPEND_DTYPE, "append_dtype"), **dict.fromkeys(_PROMOTE, "promote"),
                            "binary_cross_entropy": "banned"}

_BANNED = ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
           "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
           "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
           "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
           "safe to autocast.")  # torch's own message (autocast_mode.cpp): the step would fail so on a GPU

#: The aten ops (overload packets) whose CUDA kernels call cuBLAS or cuBLASLt, which take the handle's
#: workspace: GEMM (``at::cuda::blas::gemm``, ``gemm_and_bias``), GEMV and dot. A linear, a matmul or
#: an einsum reaches the tracker as one of these.
GEMMS = frozenset(("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation",
                   "_scaled_mm", "_int_mm"))

#: The torch.optim classes whose step takes the foreach path on CUDA when ``foreach`` and ``fused``
#: are left unset (their functional form calls ``_default_to_fused_or_foreach(..., use_fused=False)``
#: in torch 2.13: none defaults to fused). Adafactor keeps its for-loop; Muon, LBFGS and SparseAdam
#: have no foreach path.
FOREACH_BY_DEFAULT = ("Adadelta", "Adagrad", "Adam", "AdamW", "Adamax", "ASGD", "NAdam", "RAdam", "RMSprop",
                      "Rprop", "SGD")


def _resolve(torch, name: str):
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    return getattr(packet, overload or "default", None) if packet is not None else None


class CudaAutocast:
    """A context in which ``torch.autocast("cuda", dtype)`` casts as it does on CUDA, on CPU tensors.

    A CUDA region becomes a CPU autocast region with the same dtype (the CUDA default when none
    is given); the ops of CUDA's lists get Python kernels on the ``AutocastCPU`` key that cast as
    CUDA's do, through a weight cache that lives until the outermost region exits (torch's
    ``clear_autocast_cache``); the ops only CPU autocast casts fall through to the next key.
    Inside, ``torch.is_autocast_enabled("cuda")`` answers for the emulated region.
    """

    def __init__(self, api):
        self.api = api
        self.torch = api.torch
        #: id(fp32 leaf) -> (weakref to it, its low-precision copy): CUDA autocast's cached casts
        self.cache: Dict[int, tuple] = {}
        #: this torch takes Python kernels on the AutocastCPU key (else CUDA regions cast by the CPU's lists)
        self.supported = api.autocast_kernels_supported()
        self._lib = None
        self._undo = []

    # -- casting --------------------------------------------------------------------------------
    def _eligible(self, t) -> bool:
        # Every fake stands for a CUDA tensor; CUDA autocast leaves float64 and non-float alone.
        return isinstance(t, self.torch.Tensor) and t.is_floating_point() and t.dtype != self.torch.float64

    def cached_cast(self, t, to, low):
        """``t`` as ``to``, the way CUDA's ``cached_cast`` does it (a weight's copy is cached)."""
        torch = self.torch
        if not self._eligible(t) or t.dtype == to:
            return t
        if (to == low and t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not self.api.is_view(t)
                and torch.is_autocast_cache_enabled()):
            hit = self.cache.get(id(t))
            if hit is not None and hit[0]() is t:
                return hit[1]
            copy = t.to(to)
            self.cache[id(t)] = (weakref.ref(t), copy)
            return copy
        return t.to(to)

    def _cast(self, value, to, low):
        if isinstance(value, self.torch.Tensor):
            return self.cached_cast(value, to, low)
        if isinstance(value, (list, tuple)) and any(isinstance(v, self.torch.Tensor) for v in value):
            return type(value)(self.cached_cast(v, to, low) if isinstance(v, self.torch.Tensor) else v for v in value)
        return value

    def _promoted(self, low, values: Iterable) -> Any:
        """CUDA's ``promote``: fp32 if any eligible argument is fp32, else the low dtype."""
        for value in values:
            items = value if isinstance(value, (list, tuple)) else (value,)
            if any(self._eligible(v) and v.dtype == self.torch.float32 for v in items):
                return self.torch.float32
        return low

    def _with_dtype(self, op, args: tuple, kwargs: dict, dtype) -> tuple:
        """``(args, kwargs)`` with the op's optional ``dtype`` set to ``dtype`` unless the caller gave one."""
        names = self.api.op_argument_names(op)
        index = next((i for i, (name, _kw) in enumerate(names) if name == "dtype"), None)
        if index is not None and not names[index][1] and len(args) > index:
            if args[index] is None:
                args = args[:index] + (dtype,) + args[index + 1:]
            return args, kwargs
        if kwargs.get("dtype") is None:
            kwargs = dict(kwargs, dtype=dtype)
        return args, kwargs

    def _appended(self, op, target, args: tuple, kwargs: dict):
        """CUDA's ``fp32_append_dtype``: ``norm`` runs as its dtype overload, in fp32 for an eligible input."""
        names = [name for name, _kw in self.api.op_argument_names(op)]
        values = dict(zip(names, args), **kwargs)
        defaults = {"p": 2, "keepdim": False}  # norm.Scalar's and norm.ScalarOpt_dim's defaults
        first = args[0] if args else values.get("self")
        dtype = self.torch.float32 if self._eligible(first) else first.dtype
        return target(*[values.get(name, defaults.get(name)) for name in names], dtype=dtype)

    def _kernel(self, op, policy: str, target):
        torch, api = self.torch, self.api

        def kernel(keyset, *args, **kwargs):
            with api.below_autocast_cpu():
                if policy == "banned":
                    raise RuntimeError(_BANNED)
                low = torch.get_autocast_dtype("cpu")
                if policy == "set_opt_dtype":
                    if args and self._eligible(args[0]):
                        args, kwargs = self._with_dtype(op, args, kwargs, torch.float32)
                    return op(*args, **kwargs)
                if policy == "append_dtype":
                    return self._appended(op, target, args, kwargs)
                if policy == "lower":
                    to = low
                elif policy == "fp32":
                    to = torch.float32
                else:
                    to = self._promoted(low, (*args, *kwargs.values()))
                args = tuple(self._cast(a, to, low) for a in args)
                kwargs = {k: self._cast(v, to, low) for k, v in kwargs.items()}
                return op(*args, **kwargs)

        return kernel

    def _fallthrough(self, op):
        api = self.api

        def kernel(keyset, *args, **kwargs):
            # CUDA has no kernel here: the op goes on to the next key, and the ops it calls still
            # meet autocast (a cross_entropy's nll_loss copies its input to fp32, as on CUDA).
            return op.redispatch(api.without_autocast_cpu(keyset), *args, **kwargs)

        return kernel

    # -- entering and leaving -------------------------------------------------------------------
    def __enter__(self) -> "CudaAutocast":
        self._patch_regions()
        return self

    def _register(self) -> None:
        """Put the kernels on the dispatcher (at the first CUDA region: ~20 ms a step without one saves)."""
        torch, api = self.torch, self.api
        if self._lib is not None or not self.supported:
            return
        cpu_only = [n.split("::", 1)[1] for n in api.ops_with_kernel("AutocastCPU") if n.startswith("aten::")]
        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": intended
            for name, policy in POLICIES.items():
                op = _resolve(torch, name)
                target = _resolve(torch, _APPEND_DTYPE[name]) if policy == "append_dtype" else op
                if op is None or target is None:
                    continue
                lib.impl(name, self._kernel(op, policy, target), "AutocastCPU", with_keyset=True)
            for name in cpu_only:
                op = _resolve(torch, name)
                if name not in POLICIES and op is not None:
                    lib.impl(name, self._fallthrough(op), "AutocastCPU", with_keyset=True)
        self._lib = lib

    def _patch_regions(self) -> None:
        torch = self.torch
        cls = torch.amp.autocast_mode.autocast
        init, clear, enabled = cls.__init__, torch.clear_autocast_cache, torch.is_autocast_enabled
        cache = self.cache

        def __init__(inst, device_type, *args, **kwargs):
            if str(device_type).startswith("cuda"):
                self._register()
                dtype = args[0] if args else kwargs.pop("dtype", None)
                args = args[1:]
                kwargs["dtype"] = dtype if dtype is not None else torch.get_autocast_dtype("cuda")
                device_type = "cpu"
            init(inst, device_type, *args, **kwargs)

        def clear_autocast_cache():
            clear()
            cache.clear()  # the outermost region exits: the weights' copies are freed, as on CUDA

        def is_autocast_enabled(device_type=None):
            if device_type is None or str(device_type).startswith("cuda"):
                return enabled("cpu")
            return enabled(device_type)

        cls.__init__ = __init__
        torch.clear_autocast_cache = clear_autocast_cache
        torch.is_autocast_enabled = is_autocast_enabled
        self._undo = [(cls, "__init__", init), (torch, "clear_autocast_cache", clear),
                      (torch, "is_autocast_enabled", enabled)]

    def __exit__(self, *exc) -> bool:
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        self._undo = []
        if self._lib is not None:
            self.api.drop_library(self._lib)
            self._lib = None
        self.cache.clear()
        return False


class CublasWorkspaces:
    """Adds cuBLAS's workspace to a tracked run at the first matrix multiply of each thread.

    The forward and the optimizer run on the calling thread; backward (checkpoint recomputation
    included) on the autograd engine's device thread, with its own cuBLAS handle, so its first
    matrix multiply takes a second workspace. Both stay allocated for the rest of the process.
    """

    def __init__(self, tracker, size: int):
        self.tracker = tracker
        self.size = size
        #: "forward" / "backward" -> the event key of that thread's workspace
        self.keys: Dict[str, int] = {}

    def __call__(self, func, out=None) -> None:
        packet = getattr(func, "overloadpacket", None)
        if getattr(packet, "__name__", None) not in GEMMS:
            return
        thread = "backward" if self.tracker.in_backward() else "forward"
        if thread not in self.keys and self.size > 0:
            self.keys[thread] = self.tracker.allocate(self.size)

    @property
    def total(self) -> int:
        return self.size * len(self.keys)


def like_cuda(optimizers: Iterable[Any], api) -> int:
    """Make the optimizers that would take the foreach path on CUDA take it here; the number changed.

    torch picks it when neither ``foreach`` nor ``fused`` is set (Adadelta, Adamax, ASGD, NAdam,
    RAdam, RMSprop and Rprop have no ``fused``), the optimizer is not ``differentiable``, every
    parameter is a plain tensor on CUDA (here: a fake standing for one), and, for Adam and AdamW,
    the learning rate is not a tensor unless ``capturable``.
    """
    torch = api.torch
    classes = tuple(c for c in (getattr(torch.optim, n, None) for n in FOREACH_BY_DEFAULT) if isinstance(c, type))
    plain = (torch.Tensor, torch.nn.Parameter)
    changed = 0
    for optimizer in optimizers:
        if not isinstance(optimizer, classes):
            continue
        adam = isinstance(optimizer, getattr(torch.optim, "Adam", ()))
        for group in optimizer.param_groups:
            if "foreach" not in group or group["foreach"] is not None or group.get("fused") is not None:
                continue
            if group.get("differentiable"):
                continue
            if adam and isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable"):
                continue
            # A fake parameter is a FakeTensor standing for a plain Parameter; a real subclass
            # (a DTensor, a quantized weight) is not foreach material on CUDA either.
            if not all(type(p) in plain or _is_fake(p) for p in group["params"]):
                continue
            group["foreach"] = True
            changed += 1
    return changed


def _is_fake(t) -> bool:
    return type(t).__name__ == "FakeTensor"


class CudaDropout:
    """A context in which ``dropout`` and ``dropout_`` on CPU fakes run as on CUDA: the fused
    ``native_dropout`` (a one-byte mask kept for backward) wherever torch takes it there."""

    def __init__(self, api):
        self.api = api
        self.torch = api.torch
        self._lib = None

    def _rest(self, input, p, train, inplace):
        """``_dropout_impl`` for what the fused kernel does not take: p of 0 or 1, eval, empty input."""
        if not 0 <= p <= 1:
            raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
        if p == 0 or not train or input.numel() == 0:
            return input
        zero = self.torch.zeros((), dtype=input.dtype, device=input.device)
        return input.mul_(zero) if inplace else input.mul(zero)

    def dropout(self, input, p, train):
        if train and 0 < p < 1 and input.numel() > 0:
            return self.torch.ops.aten.native_dropout(input, p, True)[0]
        return self._rest(input, p, train, False)

    def dropout_(self, input, p, train):
        if train and 0 < p < 1 and input.numel() > 0:
            return input.copy_(self.torch.ops.aten.native_dropout(input, p, True)[0])
        return self._rest(input, p, train, True)

    def __enter__(self) -> "CudaDropout":
        lib = self.torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for key in ("AutogradCPU", "CPU"):  # as the attention kernel: before autograd, and inference mode
                lib.impl("dropout", self.dropout, key)
                lib.impl("dropout_", self.dropout_, key)
        self._lib = lib
        return self

    def __exit__(self, *exc) -> bool:
        if self._lib is not None:
            self.api.drop_library(self._lib)
            self._lib = None
        return False


class AttentionScratch:
    """Adds a fused attention backward's scratch (:func:`.attention.backward_scratch`) to the tracked run
    for the time of its call: taken after its gradients, given back at once."""

    def __init__(self, tracker):
        self.tracker = tracker

    def __call__(self, func, out=None) -> None:
        from .attention import backward_scratch

        name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
        if name.endswith("_attention_backward"):
            size = backward_scratch(name, out)
            if size > 0:
                self.tracker.release(self.tracker.allocate(size))


#: The aten ops through which a convolution reaches the tracker, forward and backward.
CONVOLUTIONS = frozenset(("convolution", "_convolution", "cudnn_convolution", "cudnn_convolution_transpose",
                          "convolution_backward"))


class Convolutions:
    """Counts the convolutions a CUDA run makes (cuDNN's workspaces are not counted: they are named)."""

    def __init__(self):
        self.forward = 0
        self.backward = 0

    def __call__(self, func, out=None) -> None:
        name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
        if name in CONVOLUTIONS:
            if name == "convolution_backward":
                self.backward += 1
            else:
                self.forward += 1


class AfterOps:
    """Several ``after_op`` hooks as one, called in order."""

    def __init__(self, *hooks):
        self.hooks = hooks

    def __call__(self, func, out=None) -> None:
        for hook in self.hooks:
            hook(func, out)


class CudaRun(NamedTuple):
    """What :func:`cuda_emulation` put in place for one run."""

    workspaces: CublasWorkspaces
    #: CUDA's autocast lists are emulated (False: this torch cannot take the kernels)
    autocast: bool
    #: the attention calls and the kernels picked for them
    attention: Any
    convolutions: Convolutions


@contextlib.contextmanager
def cuda_emulation(api, tracker, workspace: int, optimizers=(), sm=None) -> Iterator[CudaRun]:
    """CUDA's autocast, dropout, attention kernels (for a card of compute capability ``sm``), cuBLAS
    workspaces (``workspace`` bytes each) and foreach optimizers for one run."""
    from .attention import GpuAttention

    like_cuda(optimizers, api)
    workspaces = CublasWorkspaces(tracker, workspace)
    convolutions = Convolutions()
    tracker.after_op = AfterOps(workspaces, AttentionScratch(tracker), convolutions)
    marks = tracker.run.phase_marks
    try:
        with CudaAutocast(api) as autocast, CudaDropout(api), \
                GpuAttention(api, sm, step_of=lambda: marks[-1][2] if marks else 0) as attention:
            yield CudaRun(workspaces, autocast.supported, attention, convolutions)
    finally:
        tracker.after_op = None
