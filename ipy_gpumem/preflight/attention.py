"""Inside the sealed child: scaled_dot_product_attention as torch runs it on a named GPU, with the kernel its CUDA rules pick for each call and that kernel's memory.

On the CPU, ``scaled_dot_product_attention`` takes the CPU's kernels (the math path, which keeps
batch x heads x seq^2 probabilities and a dropout mask, whenever dropout is on), and fakes computed
on the CPU inherit that choice. On a GPU, torch tries its kernels in a priority order (flash,
memory-efficient, math, cuDNN by default; ``torch.nn.attention.sdpa_kernel(..., set_priority=True)``
changes it) and takes the first one that is switched on (``torch.backends.cuda.enable_*_sdp``,
``sdpa_kernel``) and whose checks pass: ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``
and ``sdp_utils_cpp.h`` in torch 2.13, by compute capability, dtype, mask, dropout, head size,
shapes and strides. :func:`choose` ports those checks; :class:`GpuAttention` puts a kernel on the
dispatcher that calls what the chosen branch of ``attention.cpp`` calls, so autograd keeps what
that kernel keeps:

- flash: the output, one fp32 log-sum-exp per query row and the RNG state; head sizes not a
  multiple of 8 are padded first. Its backward takes ``dq_accum`` (fp32, queries rounded up to
  128, head size to 32) and ``softmax_d`` for the time of the call (``flash_api.cpp``, ``mha_bwd``);
- memory-efficient: the output, a log-sum-exp per row (rows rounded up to 32), the mask as given
  (expanded; copied only when its last dimension or strides are not multiples of 16, as
  ``preprocess_mask`` does). Its backward takes ``delta`` and a workspace that accumulates the
  query gradient in fp32 (``attention_backward.cu``; sized here as that gradient in fp32 on
  64 x 64 tiles, the kernel's ``workspace_elements_gq`` for its usual tiles);
- cuDNN: the output and a log-sum-exp per row (cuDNN's own workspace is not known here);
- math: the seq^2 probabilities, in fp32 (the math path computes half-precision inputs in fp32
  unless ``allow_fp16_bf16_reduction_math_sdp(True)``), and with dropout CUDA's one-byte mask.
"""
from __future__ import annotations

import math
import warnings
from typing import Dict, List, NamedTuple, Optional, Tuple

__all__ = ["FLASH", "EFFICIENT", "CUDNN", "MATH", "KERNEL_NAMES", "Settings", "settings", "choose", "Call",
           "GpuAttention", "backward_scratch", "summary", "words"]

FLASH, EFFICIENT, CUDNN, MATH = "flash", "efficient", "cudnn", "math"
#: How each kernel is named in words.
KERNEL_NAMES = {FLASH: "flash", EFFICIENT: "memory-efficient", CUDNN: "cuDNN", MATH: "math"}
#: torch's SDPBackend numbers (torch.nn.attention.SDPBackend), as its priority order lists them.
_NUMBERS = {0: MATH, 1: FLASH, 2: EFFICIENT, 3: CUDNN}
#: A card of unknown architecture (a size in bytes) counts as an A100's.
_DEFAULT_SM = 80


class Settings(NamedTuple):
    """The user's switches that steer the choice (read in the child: the user's process copied)."""

    flash: bool = True
    efficient: bool = True
    math: bool = True
    cudnn: bool = True
    fa3: bool = False
    order: Tuple[str, ...] = (FLASH, EFFICIENT, MATH, CUDNN)
    deterministic: bool = False


def settings(api) -> Settings:
    """The switches as they are now (``torch.backends.cuda``, ``sdpa_kernel``, deterministic algorithms)."""
    torch = api.torch
    cuda = torch.backends.cuda
    order = tuple(_NUMBERS[n] for n in api.sdp_priority_order() if n in _NUMBERS)
    deterministic = bool(torch.are_deterministic_algorithms_enabled()) and not bool(
        torch.is_deterministic_algorithms_warn_only_enabled())
    return Settings(flash=bool(cuda.flash_sdp_enabled()), efficient=bool(cuda.mem_efficient_sdp_enabled()),
                    math=bool(cuda.math_sdp_enabled()), cudnn=bool(cuda.cudnn_sdp_enabled()),
                    fa3=api.fa3_sdp_enabled(), order=order or Settings().order, deterministic=deterministic)


# -- the checks, one function per kernel: None when it accepts the call, else why not ------------------

def _sm_words(sm: int) -> str:
    return f"compute capability {sm // 10}.{sm % 10}"


_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}


def _dtype_name(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    return _SHORT.get(name, name)


def _dense(q, k, v, mask, enable_gqa: bool, singleton_ok: bool) -> Optional[str]:
    """``check_nonzero_sequence_lengths_dense``, ``check_last_dim_stride_equals_1_dense`` and
    ``check_batch_size_and_num_heads_dense`` (grouped-query attention supported)."""
    if q.size(-2) == 0 or k.size(-2) == 0:
        return "a sequence of length 0"
    strides_ok = q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    if singleton_ok:
        strides_ok = strides_ok or q.size(-1) == 1
    if not strides_ok or (mask is not None and mask.stride(-1) != 1):
        return "the last dimension of query, key, value or mask does not have stride 1"
    if not (q.size(0) == k.size(0) == v.size(0)):
        return "query, key and value have different batch sizes"
    hq, hk, hv = q.size(-3), k.size(-3), v.size(-3)
    if enable_gqa:
        if hk != hv or hq % hk:
            return f"grouped-query heads {hq}/{hk}/{hv} do not divide"
    elif not (hq == hk == hv):
        return f"query, key and value have {hq}, {hk} and {hv} heads"
    return None


def _gemm_alignment(sm: int, half: bool) -> int:
    """``minimum_gemm_alignment``: what the memory-efficient kernel needs head sizes to be a multiple of."""
    tensor_cores = sm >= 80 or (sm >= 70 and half)
    alignment = 4 if sm >= 80 else 1
    if tensor_cores:
        alignment = max(alignment, 128 // (16 if half else 32))
    return alignment


def refuse_flash(torch, sm, q, k, v, mask, dropout_p, is_causal, enable_gqa, grad, s: Settings) -> Optional[str]:
    """``can_use_flash_attention``: why flash refuses the call (None: it accepts it)."""
    if not s.flash:
        return "switched off (torch.backends.cuda.enable_flash_sdp or sdpa_kernel)"
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "query, key and value are not 4-D"
    if mask is not None:
        return "an explicit attn_mask"
    d = q.size(-1)
    if not (d == k.size(-1) == v.size(-1)) or d > 256:
        return f"head size {d} (flash needs equal query, key and value head sizes of at most 256)"
    if not 80 <= sm <= 121:
        return f"{_sm_words(sm)} (flash needs 8.0 to 12.1)"
    if grad and (86 <= sm <= 89 or 120 <= sm <= 121) and not (d <= 192 or (dropout_p == 0 and d > 224)):
        return f"training with head size {d} on {_sm_words(sm)}"
    if is_causal and q.size(-2) != k.size(-2):
        return "is_causal with different query and key lengths"
    allowed = (torch.float16, torch.bfloat16) if sm >= 80 else (torch.float16,)
    if sm >= 90 and s.fa3:
        allowed = allowed + tuple(t for t in (getattr(torch, "float8_e4m3fn", None),) if t is not None)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in allowed:
        return f"{_dtype_name(q.dtype)} (flash takes {' or '.join(_dtype_name(t) for t in allowed)} on {_sm_words(sm)})"
    return _dense(q, k, v, None, enable_gqa, singleton_ok=True)


def refuse_efficient(torch, sm, q, k, v, mask, dropout_p, is_causal, enable_gqa, grad, s: Settings) -> Optional[str]:
    """``can_use_mem_efficient_attention``: why the memory-efficient kernel refuses the call."""
    if not s.efficient:
        return "switched off (torch.backends.cuda.enable_mem_efficient_sdp or sdpa_kernel)"
    if not 50 <= sm <= 121:
        return f"{_sm_words(sm)} (memory-efficient needs 5.0 to 12.1)"
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "query, key and value are not 4-D"
    half = q.dtype in (torch.float16, torch.bfloat16)
    alignment = _gemm_alignment(sm, half)
    dq, dv = q.size(-1), v.size(-1)
    if dq != k.size(-1) or dq % alignment or dv % alignment or dq <= 0 or dv <= 0:
        return f"head size {dq} (memory-efficient needs a multiple of {alignment} for {_dtype_name(q.dtype)} on {_sm_words(sm)})"
    if sm >= 80 and any(t.numel() and t.storage_offset() % alignment for t in (q, k, v)):
        return f"query, key or value starts at an offset that is not a multiple of {alignment} elements"
    dense = _dense(q, k, v, mask, enable_gqa, singleton_ok=False)
    if dense:
        return dense
    allowed = (torch.float16, torch.float32, torch.bfloat16) if sm >= 80 else (torch.float16, torch.float32)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in allowed:
        return f"{_dtype_name(q.dtype)} (memory-efficient takes {', '.join(_dtype_name(t) for t in allowed)} on {_sm_words(sm)})"
    return None


def refuse_cudnn(torch, sm, q, k, v, mask, dropout_p, is_causal, enable_gqa, grad, s: Settings) -> Optional[str]:
    """``can_use_cudnn_attention`` (the checks that do not depend on the cuDNN version, and a head size of at most 128)."""
    if not s.cudnn:
        return "switched off (torch.backends.cuda.enable_cudnn_sdp or sdpa_kernel)"
    if not (q.dim() == k.dim() == v.dim() == 4):
        return "query, key and value are not 4-D"
    if s.deterministic:
        return "deterministic algorithms are on"
    allowed = (torch.float16, torch.bfloat16) if sm >= 80 else (torch.float16,)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in allowed:
        return f"{_dtype_name(q.dtype)} (cuDNN attention takes fp16 or bf16)"
    if mask is not None and (mask.requires_grad or mask.dim() not in (2, 4)):
        return "an attn_mask that requires grad or is neither 2-D nor 4-D"
    if not 80 <= sm <= 121:
        return f"{_sm_words(sm)} (cuDNN attention needs 8.0 to 12.1)"
    if dropout_p * 16 != math.floor(dropout_p * 16):
        return f"dropout {dropout_p:g} (cuDNN takes multiples of 1/16)"
    dense = _dense(q, k, v, mask, enable_gqa or q.size(-3) != k.size(-3), singleton_ok=True)
    if dense:
        return dense
    limit = 256 if sm in (90, 100, 103) else 128
    if q.size(-1) > limit or v.size(-1) > limit or q.size(-1) % 8 or v.size(-1) % 8:
        return f"head size {q.size(-1)} (cuDNN attention needs a multiple of 8 up to {limit})"
    if k.size(-2) == 1:
        return "a key length of 1"
    return None


_REFUSALS = {FLASH: refuse_flash, EFFICIENT: refuse_efficient, CUDNN: refuse_cudnn}


def choose(torch, sm: Optional[int], q, k, v, mask=None, dropout_p: float = 0.0, is_causal: bool = False,
           enable_gqa: bool = False, grad: bool = True, s: Settings = Settings()) -> Tuple[str, Dict[str, str]]:
    """The kernel torch runs this call with on a card of compute capability ``sm`` (e.g. 75 for a T4),
    and why each kernel tried before it refused: ``(kernel, {kernel: reason})``.

    ``grad``: grad mode is on and an input requires grad (torch's ``input_requires_grad``).
    Raises RuntimeError as torch does when no kernel can run the call.
    """
    sm = _DEFAULT_SM if sm is None else sm
    refused: Dict[str, str] = {}
    if not (s.math or s.flash or s.efficient or s.cudnn):
        raise RuntimeError("No available kernel. Aborting execution. (every scaled_dot_product_attention kernel "
                           "is switched off)")
    for kernel in s.order:
        if kernel == MATH:
            if s.math:
                return MATH, refused
            refused[MATH] = "switched off (torch.backends.cuda.enable_math_sdp or sdpa_kernel)"
            continue
        why = _REFUSALS[kernel](torch, sm, q, k, v, mask, dropout_p, is_causal, enable_gqa, grad, s)
        if why is None:
            return kernel, refused
        refused[kernel] = why
    raise RuntimeError("No available kernel. Aborting execution. (" + "; ".join(
        f"{KERNEL_NAMES[n]}: {why}" for n, why in refused.items()) + ")")


class Call(NamedTuple):
    """One attention call as the emulation ran it."""

    kernel: str
    step: int
    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str
    mask: str          # "none", "bool" or "float"
    dropout: float
    causal: bool
    refused: Tuple[Tuple[str, str], ...]


# -- the kernels' memory: what autograd keeps comes from calling their ops; scratch is added here ------

def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def backward_scratch(name: str, out) -> int:
    """Bytes a fused attention backward takes from the allocator for the time of its call, beyond its
    outputs (``out``: the gradients, query's first, shaped batch x heads x queries x head size)."""
    grad_q = out[0] if isinstance(out, (tuple, list)) and out else None
    if grad_q is None or not hasattr(grad_q, "shape") or grad_q.dim() != 4:
        return 0
    b, h, m, d = (int(n) for n in grad_q.shape)
    if name == "_scaled_dot_product_flash_attention_backward":
        d_rounded = _round_up(d, 32) if d <= 192 else 256
        m_rounded = _round_up(m, 128)
        return b * m_rounded * h * d_rounded * 4 + b * h * m_rounded * 4  # dq_accum, softmax_d
    if name == "_scaled_dot_product_efficient_attention_backward":
        return b * h * m * 4 + b * h * _round_up(m, 64) * _round_up(d, 64) * 4  # delta, the gq workspace
    return 0


class GpuAttention:
    """A context in which ``scaled_dot_product_attention`` on CPU fakes runs the kernel a GPU of compute
    capability ``sm`` picks; :attr:`calls` lists every call and its kernel."""

    def __init__(self, api, sm: Optional[int], step_of=lambda: 0):
        self.api = api
        self.torch = api.torch
        self.sm = sm
        self.step_of = step_of
        self.calls: List[Call] = []
        self._lib = None

    def _mask_as_float(self, mask, dtype):
        """``convert_boolean_attn_mask``: a bool mask becomes an additive one of the query's dtype."""
        torch = self.torch
        if mask is None or mask.dtype != torch.bool:
            return mask
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), float("-inf"))

    def _preprocess_mask(self, mask, q, k):
        """``preprocess_mask``: expanded to 4-D; padded to a multiple of 16 or made contiguous when needed."""
        m = mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))
        last = m.size(-1)
        if last % 16:
            padded = self.torch.nn.functional.pad(m, (0, 16 - last % 16))
            return padded[..., :last]
        if m.stride(0) % 16 or m.stride(1) % 16 or m.stride(2) % 16:
            return m.contiguous()
        return m

    def _pad8(self, t):
        extra = (-t.size(-1)) % 8
        return self.torch.nn.functional.pad(t, (0, extra)) if extra else t

    def _run(self, kernel, q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, lse):
        op = self.api.attention_kernel(kernel)
        if kernel == FLASH:
            size = q.size(-1)
            scale = scale if scale is not None else 1.0 / math.sqrt(size)
            out = op(self._pad8(q), self._pad8(k), self._pad8(v), dropout_p, is_causal, False, scale=scale)[0]
            return out[..., :size] if out.size(-1) != size else out
        if kernel == EFFICIENT:
            mask = self._mask_as_float(mask, q.dtype)
            if mask is not None:
                mask = self._preprocess_mask(mask, q, k)
            return op(q, k, v, mask, lse, dropout_p, is_causal, scale=scale)[0]
        if kernel == CUDNN:
            return op(q, k, v, self._mask_as_float(mask, q.dtype), lse, dropout_p, is_causal, False, scale=scale)[0]
        return op(q, k, v, self._mask_as_float(mask, q.dtype), dropout_p, is_causal, None, scale=scale,
                  enable_gqa=enable_gqa)[0]

    def kernel(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
               enable_gqa=False):
        torch = self.torch
        if not (query.dtype == key.dtype == value.dtype):
            raise RuntimeError("Expected query, key, and value to have the same dtype, but got query.dtype: "
                               f"{query.dtype} key.dtype: {key.dtype} and value.dtype: {value.dtype} instead.")
        if attn_mask is not None and attn_mask.dtype not in (torch.bool, query.dtype):
            raise RuntimeError("Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                               f"attn_mask.dtype: {attn_mask.dtype} and  query.dtype: {query.dtype} instead.")
        grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        kernel, refused = choose(torch, self.sm, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa,
                                 grad, settings(self.api))
        try:
            out = self._run(kernel, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, grad)
        except RuntimeError as exc:
            if kernel == MATH:
                raise
            # The fake of a fused kernel refused a shape its CUDA kernel takes: counted as the math path
            # (which keeps more), and said.
            refused[kernel] = f"its fake could not run this call ({str(exc).splitlines()[0][:80]}); counted as math"
            kernel = MATH
            out = self._run(MATH, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, grad)
        mask = "none" if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "float")
        shape = query.shape
        self.calls.append(Call(kernel, self.step_of(), int(shape[0]) if query.dim() > 3 else 1,
                               int(shape[-3]) if query.dim() > 2 else 1, int(shape[-2]), int(key.shape[-2]),
                               int(shape[-1]), _dtype_name(query.dtype), mask, float(dropout_p), bool(is_causal),
                               tuple(refused.items())))
        return out

    def __enter__(self) -> "GpuAttention":
        lib = self.torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # AutogradCPU: the call as autocast (emulated CUDA autocast) left it, before autograd records
            # anything, so autograd records what the chosen kernel's ops save. CPU: inference mode,
            # which skips the autograd keys.
            for key in ("AutogradCPU", "CPU"):
                lib.impl("scaled_dot_product_attention", self.kernel, key)
        self._lib = lib
        return self

    def __exit__(self, *exc) -> bool:
        if self._lib is not None:
            self.api.drop_library(self._lib)
            self._lib = None
        return False


# -- what the estimate says about them --------------------------------------------------------------

def summary(calls: List[Call]) -> List[dict]:
    """The calls of the last step, grouped (plain data for ``Estimate.attention``)."""
    if not calls:
        return []
    last = max(c.step for c in calls)
    groups: Dict[tuple, dict] = {}
    for c in calls:
        if c.step != last:
            continue
        key = c[:1] + c[2:]
        row = groups.get(key)
        if row is None:
            row = groups[key] = {"kernel": c.kernel, "calls": 0, "batch": c.batch, "heads": c.heads,
                                 "q_len": c.q_len, "kv_len": c.kv_len, "head_dim": c.head_dim, "dtype": c.dtype,
                                 "mask": c.mask, "dropout": c.dropout, "causal": c.causal,
                                 "refused": {KERNEL_NAMES[n]: why for n, why in c.refused}}
        row["calls"] += 1
    return list(groups.values())


def words(row: dict, gpu: Optional[str], sm: Optional[int]) -> str:
    """One sentence for a group of attention calls: the kernel, why the faster ones were refused, and what it keeps."""
    from ..core.units import format_bytes

    kernel = row["kernel"]
    card = f"a {gpu}" if gpu else "this GPU"
    if sm is not None:
        card += f" ({_sm_words(sm)})"
    what = (f"{row['calls']} attention call{'s' if row['calls'] != 1 else ''} a step "
            f"({row['batch']} x {row['heads']} heads x {row['q_len']} queries of {row['head_dim']}, {row['dtype']}"
            + (f", {row['mask']} mask" if row["mask"] != "none" else "")
            + (f", dropout {row['dropout']:g}" if row["dropout"] else "") + (", causal" if row["causal"] else "") + ")")
    refused = "; ".join(f"{name} refused: {why}" for name, why in row["refused"].items())
    scores = row["batch"] * row["heads"] * row["q_len"] * row["kv_len"]
    if kernel == MATH:
        keeps = (f"keeps {row['batch']} x {row['heads']} x {row['q_len']} x {row['kv_len']} probabilities "
                 f"({format_bytes(scores * 4)} in fp32" + (" and a one-byte dropout mask" if row["dropout"] else "")
                 + " a call)")
    else:
        keeps = f"keeps no {row['q_len']} x {row['kv_len']} scores, a log-sum-exp per query row instead"
    return (f"{what}: the {KERNEL_NAMES[kernel]} kernel, as torch picks it on {card}"
            + (f" ({refused})" if refused else "") + f"; it {keeps}")
