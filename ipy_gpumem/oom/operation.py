"""Name the operation whose allocation failed and size it by its own arithmetic.

Read from the frames nearest to the failing allocation: the traceback's lines with the shapes of the
tensors they name (``oom.operands``), and a recorded stack's C++ frames (a snapshot, ``--trace``).
Recognised: attention scores in ``scaled_dot_product_attention``'s math fallback or written out
(batch x heads x seq_q x seq_k x bytes), cross-entropy over a vocabulary (its fp32 log-probabilities)
and an fp32 copy of logits, a convolution's output or workspace, an embedding's output or dense
gradient, an optimizer's foreach temporaries, ``torch.cat``/``stack`` of a list, and a literal size
written in the failing line. An allocation with no Python frame is named by what made it (autograd's
backward of a node, a gradient accumulated), else by the ATen operator, never by a C++ signature.

The request is checked against the operation's own arithmetic before the operation is said to be it
(:attr:`Operation.matches`); when it does not match, or no shape is known, the words say what is known
and no more.
"""
from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..core.units import format_bytes
from ..preflight.allocator import round_size, segment_size
from .literal import dotted, literal_allocation
from .operands import FrameOperands, TensorInfo
from .stack import Frame, is_python, recorded_stack

__all__ = ["Operation", "operation_of", "allocation_name", "request_matches", "dims_text"]

# C++ frames that are the allocator and tensor creation, not the operation.
_PLUMBING = re.compile(r"^(?:empty|empty_strided|empty_like|new_empty|new_empty_strided|resize_|_to_copy|"
                       r"zeros|zeros_like|ones_like|full|full_like|clone|contiguous|copy_|to|"
                       r"_reshape_alias|view|as_strided|set_)$")
_ATEN_OP = re.compile(r"\bat::_ops::(\w+?)(?:_out)?::(?:call|redispatch)\b")
# ATen's operator structs are ``name_overload`` (mul_Tensor, to_dtype, empty_memory_format): the overload goes.
_OVERLOAD = re.compile(r"_(?:Tensor|Scalar|Tensor_Tensor|Tensor_Scalar|Scalar_Tensor|Tensor_mode|dtype|dtype_layout|"
                       r"device|other|memory_format|dim|dim_IntList|int|intlist|self|names|default|using_ints|"
                       r"correction|input|out|vec|List|Dimname)$")
_BACKWARD_NODE = re.compile(r"torch::autograd::generated::(\w+Backward\w*)::apply")
_ACCUMULATE = re.compile(r"torch::autograd::AccumulateGrad::apply")
_SDPA_LINE = re.compile(r"scaled_dot_product_attention\s*\(")
_SDPA_NATIVE = {"math": re.compile(r"_scaled_dot_product_attention_math"),
                "flash": re.compile(r"_scaled_dot_product_flash_attention|_flash_attention_(?:forward|backward)"),
                "memory-efficient": re.compile(r"_scaled_dot_product_efficient_attention|_efficient_attention_"),
                "cuDNN": re.compile(r"_scaled_dot_product_cudnn_attention")}
_SCORES_LINE = re.compile(r"([\w.]+)\s*@\s*([\w.]+)\.(?:transpose\(\s*-2\s*,\s*-1\s*\)|mT\b)"
                          r"|matmul\(\s*([\w.]+)\s*,\s*([\w.]+)\.(?:transpose\(\s*-2\s*,\s*-1\s*\)|mT\b)")
_CE_LINE = re.compile(r"\bcross_entropy(?:_loss)?\s*\(")
_LOGITS_FLOAT = re.compile(r"\b(\w*logits\w*)\s*\.\s*(?:float\(\s*\)|to\(\s*torch\.float32\s*\))")
_CE_NATIVE = re.compile(r"at::_ops::(?:cross_entropy_loss|log_softmax|_log_softmax|nll_loss\w*)::")
_CE_BACKWARD = re.compile(r"(?:LogSoftmaxBackward|NllLossBackward|_log_softmax_backward)")
_CONV_LINE = re.compile(r"\bconv(?:_transpose)?[123]d\s*\(")
_CONV_NATIVE = re.compile(r"convolution|conv_depthwise|slow_conv|cudnn_conv|miopen_conv")
_CUDNN = re.compile(r"cudnn|cuDNN")
_EMBED_LINE = re.compile(r"\bembedding\s*\(")
_EMBED_BACKWARD = re.compile(r"embedding_dense_backward|EmbeddingBackward|embedding_backward")
_FOREACH_FUNC = re.compile(r"^_multi_tensor_(\w+)$")
_FOREACH_LINE = re.compile(r"torch\._foreach_\w+\s*\(")
_CAT_LINE = re.compile(r"\b(?:torch|np|numpy)\.(cat|concat|concatenate|stack|hstack|vstack)\s*\(")
_LIBRARY = re.compile(r"site-packages|dist-packages|[/\\]lib[/\\]python\d|^<frozen ")
_DTYPE_WORD = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}


@dataclass(frozen=True)
class Operation:
    """The operation whose allocation failed, and what its own arithmetic says it needs.

    Attributes:
        key: ``attention_scores``, ``sdpa``, ``cross_entropy``, ``logits_fp32``, ``conv_output``,
            ``conv_workspace``, ``embedding``, ``embedding_grad``, ``foreach``, ``cat``, ``literal``,
            ``backward_node``, ``gradient`` or ``aten``.
        what: what needed the memory, a noun phrase that starts a sentence ("Attention scores of 16 x 12 x
            2048² in fp32").
        needs: bytes by the operation's arithmetic, None when no shape is known.
        matches: True when the request is what the arithmetic gives, False when it is not, None when
            there is no arithmetic to check.
        frame: the frame whose line runs it, or None (a C++-only stack).
        detail: the arithmetic, or what is known without it, in a sentence or two.
        fix: the changes that shrink this operation, one sentence ("" when none is specific to it).
        snippet: code for the fix ("" when none).
        total: bytes of the whole of what it makes at once, when more than the one allocation (the
            foreach step's temporaries for every parameter, a concatenation's parts and result).
    """

    key: str
    what: str
    needs: Optional[int] = None
    matches: Optional[bool] = None
    frame: Optional[Frame] = None
    detail: str = ""
    fix: str = ""
    snippet: str = ""
    total: Optional[int] = None

    @property
    def sized(self) -> bool:
        """Whether the request is known to be this operation's arithmetic."""
        return self.matches is True and self.needs is not None


def request_matches(requested: Optional[int], nbytes: int, cuda: bool) -> bool:
    """Whether a failing request (the caching allocator's block, printed to two decimals; the host's exact
    bytes) can be an allocation of ``nbytes``."""
    if requested is None or nbytes <= 0:
        return False
    candidates = {nbytes}
    if cuda:
        candidates |= {round_size(nbytes), segment_size(round_size(nbytes))}
    return any(abs(requested - c) <= 0.006 * max(requested, c) + 1024 for c in candidates)


def dims_text(dims: Sequence[int]) -> str:
    """``16 x 12 x 2048²`` for scores whose last two sizes are equal, else ``16 x 12 x 2048 x 1024``."""
    dims = list(dims)
    if len(dims) >= 2 and dims[-1] == dims[-2]:
        return " x ".join(f"{d:,}" for d in dims[:-2]) + (" x " if len(dims) > 2 else "") + f"{dims[-1]:,}²"
    return " x ".join(f"{d:,}" for d in dims)


def _dtype(info: TensorInfo, itemsize: Optional[int] = None) -> str:
    if itemsize is not None and itemsize != info.itemsize:
        return {4: "fp32", 2: "fp16", 8: "fp64", 1: "bytes"}.get(itemsize, f"{itemsize}-byte elements")
    return _DTYPE_WORD.get(info.dtype, info.dtype)


def operation_of(frames: Sequence[Frame], operands: Sequence[FrameOperands] = (), stack: Sequence[Frame] = (),
                 requested: Optional[int] = None, cuda: bool = False, host: bool = False) -> Optional[Operation]:
    """The operation whose allocation failed, or None when no frame names one.

    Args:
        frames: the traceback's frames, innermost last.
        operands: :func:`~.operands.operands_of` of the same traceback (parallel to ``frames``), or ().
        stack: a recorded allocation's stack with its C++ frames, innermost last, or ().
        requested: the failing request in bytes (the message's, or a recording's).
        cuda: the failure is CUDA's caching allocator's (its request is a rounded block).
        host: the failure is the host's (a ``MemoryError`` may have its size only in the failing line).
    """
    native = tuple(f[1] for f in stack if not is_python(f) and f[1])
    ops = list(operands)[-len(frames):] if operands and frames else []
    ops = [FrameOperands("", {})] * (len(frames) - len(ops)) + ops
    py = [(f, o) for f, o in zip(frames, ops)]
    if not py and stack:
        py = [((f[0], f[1], ""), FrameOperands("", {})) for f in stack if is_python(f)]
    for recognise in (_foreach, _attention, _cross_entropy, _convolution, _embedding, _cat):
        found = recognise(py, native, requested, cuda)
        if found is not None:
            return found
    if host:
        found = _literal(py, requested)
        if found is not None:
            return found
    return _named(py, tuple(stack))


def allocation_name(frames) -> Optional[str]:
    """What made a recorded allocation, from its stack as torch keeps it (dicts, innermost first): the
    operation (``Autograd's backward of Softmax (SoftmaxBackward0)``, ```relu` (models.py forward())``),
    None when its frames name none. Never a C++ signature."""
    op = operation_of((), (), recorded_stack(frames), None)
    return op.what if op is not None else None


# ==================================================================================================
# Recognisers: each reads (frame, operands) pairs innermost last and the C++ names
# ==================================================================================================


def _text(pair) -> str:
    frame, ops = pair
    return ops.statement or frame[2]


def _innermost(py, rx: "re.Pattern[str]"):
    for pair in reversed(py):
        if rx.search(_text(pair)):
            return pair
    return None


def _call(text: str, rx: "re.Pattern[str]") -> Tuple[List[ast.AST], Dict[str, ast.AST]]:
    """The arguments of the call ``rx`` finds in a statement: positional and keyword, as AST nodes."""
    m = rx.search(text)
    if m is None:
        return [], {}
    opened = text.find("(", m.start())
    depth, end = 0, None
    for i in range(opened, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                end = i
                break
    if end is None:
        return [], {}
    try:
        node = ast.parse("f" + text[opened:end + 1], mode="eval").body
    except SyntaxError:
        return [], {}
    if not isinstance(node, ast.Call):
        return [], {}
    return list(node.args), {k.arg: k.value for k in node.keywords if k.arg}


def _base(node: Optional[ast.AST]) -> Tuple[str, bool]:
    """The dotted name an argument expression is built on (``logits`` in ``logits.view(-1, V).float()``),
    and whether it is cast to fp32 on the way; ``("", False)`` when it is anything else."""
    to_fp32 = False
    while node is not None:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method = node.func.attr
            if method in ("float",):
                to_fp32 = True
            elif method not in ("view", "reshape", "flatten", "contiguous", "transpose", "permute", "to", "half",
                                "bfloat16", "squeeze", "unsqueeze", "view_as", "reshape_as", "clone"):
                return "", False
            node = node.func.value
            continue
        return dotted(node), to_fp32
    return "", False


def _arg(args, kwargs, index: int, *names: str):
    if len(args) > index:
        return args[index]
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return None


def _tensor(ops: FrameOperands, node) -> Tuple[Optional[TensorInfo], bool]:
    name, to_fp32 = _base(node)
    value = ops.values.get(name) if name else None
    return (value if isinstance(value, TensorInfo) else None), to_fp32


def _where(frame: Optional[Frame]) -> str:
    if frame is None:
        return ""
    base = re.split(r"[/\\]", frame[0])[-1] or frame[0]
    return f"{base} {frame[1]}()" if frame[1] and not frame[1].startswith("<") else base


def _check(requested, candidates: Sequence[int], cuda: bool) -> Tuple[Optional[int], Optional[bool]]:
    """The candidate size the request is, ``(size, True)``; else ``(first candidate, False)``; no candidate:
    ``(None, None)``."""
    candidates = [c for c in candidates if c]
    if not candidates:
        return None, None
    for c in candidates:
        if request_matches(requested, c, cuda):
            return c, True
    return candidates[0], (False if requested is not None else None)


def _mismatch(requested, needs: int, what: str) -> str:
    return (f" The failing request, {format_bytes(requested)}, is not that size, so it was another allocation of "
            f"{what}." if requested is not None else "")


_ATTENTION_FIX = ("Run attention in half precision (bf16 or fp16) so the flash or memory-efficient kernel applies, "
                  "with no explicit float mask (is_causal=True, or a boolean mask); or shorten the sequences, lower "
                  "the batch, or recompute the attention blocks in backward with torch.utils.checkpoint.")
_ATTENTION_SNIPPET = ('with torch.autocast(device_type="cuda", dtype=torch.bfloat16):   # flash / memory-efficient '
                      'attention: no seq² scores\n    out = model(batch)\n'
                      "# a causal mask as a flag, not a float tensor:\n"
                      "# F.scaled_dot_product_attention(q, k, v, is_causal=True)")


def _attention(py, native, requested, cuda) -> Optional[Operation]:
    kernel = next((name for name, rx in _SDPA_NATIVE.items() if any(rx.search(n) for n in native)), None)
    pair = _innermost(py, _SDPA_LINE)
    scores_line = None
    if pair is None:
        scores_line = next((p for p in reversed(py) if _SCORES_LINE.search(_text(p))), None)
        if scores_line is None and kernel is None:
            return None
    q = k = mask = None
    frame = None
    if pair is not None:
        frame, ops = pair
        args, kwargs = _call(_text(pair), _SDPA_LINE)
        q, _ = _tensor(ops, _arg(args, kwargs, 0, "query"))
        k, _ = _tensor(ops, _arg(args, kwargs, 1, "key"))
        mask, _ = _tensor(ops, _arg(args, kwargs, 3, "attn_mask"))
    elif scores_line is not None:
        frame, ops = scores_line
        m = _SCORES_LINE.search(_text(scores_line))
        qn, kn = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        q, k = ops.values.get(qn), ops.values.get(kn)
        q = q if isinstance(q, TensorInfo) else None
        k = k if isinstance(k, TensorInfo) else None
    call = "scaled_dot_product_attention" + (f" ({_where(frame)})" if frame is not None else "")
    if kernel in ("flash", "memory-efficient", "cuDNN"):
        return Operation("sdpa", f"The {kernel} attention kernel of {call}", None, None, frame,
                         f"The {kernel} kernel keeps no seq² scores: what it allocates is its output and a "
                         "logsumexp per row, which grow with batch x heads x seq.",
                         "Lower the batch or shorten the sequences, or recompute the attention blocks in backward "
                         "with torch.utils.checkpoint.")
    if q is not None and k is not None and len(q.shape) >= 2 and len(k.shape) >= 2:
        dims = tuple(q.shape[:-1]) + (k.shape[-2],)
        numel = math.prod(dims)
        sizes = [q.itemsize] + ([4] if q.itemsize != 4 else []) + [1]  # fp32 upcast; dropout's bool mask
        needs, ok = _check(requested, [numel * s for s in sizes], cuda)
        item = needs // numel if needs else q.itemsize
        what = f"Attention scores of {dims_text(dims)} in {_dtype(q, item)}" if item != 1 else \
            f"The dropout mask over attention scores of {dims_text(dims)}"
        path = ("in scaled_dot_product_attention's math fallback" if pair is not None else
                f"written out in {_where(frame)}")
        detail = (f"{what[0].lower() + what[1:]} {path}: {' x '.join(f'{d:,}' for d in dims)} x {item} bytes = "
                  f"{format_bytes(numel * item)}, one such tensor for the scores, another for softmax's output.")
        if mask is not None and mask.dtype != "bool":
            detail += f" The explicit {mask.dtype} mask ({dims_text(mask.shape)}) is one more reason for the fallback."
        if ok is False:
            detail = (f"Attention scores of {dims_text(dims)} in {_dtype(q)} would be {format_bytes(numel * q.itemsize)}"
                      + _mismatch(requested, numel * q.itemsize, call))
            return Operation("sdpa", f"An allocation inside {call}", None, False, frame, detail, _ATTENTION_FIX,
                             _ATTENTION_SNIPPET)
        return Operation("attention_scores", what, needs, ok, frame, detail, _ATTENTION_FIX, _ATTENTION_SNIPPET)
    if kernel == "math":
        return Operation("attention_scores", "Attention scores in scaled_dot_product_attention's math fallback", None,
                         None, frame,
                         "The math fallback materialises batch x heads x seq_q x seq_k scores (and softmax's output, "
                         "the same size); flash and memory-efficient attention never do. The recorded frames do not say "
                         "the shapes.", _ATTENTION_FIX, _ATTENTION_SNIPPET)
    if pair is not None:
        return Operation("sdpa", f"An allocation inside {call}", None, None, frame,
                         "Which attention kernel ran is not recorded; in the math fallback it materialises batch x heads "
                         "x seq_q x seq_k scores.", _ATTENTION_FIX, _ATTENTION_SNIPPET)
    return None


_CE_FIX = ("Compute the loss in chunks of tokens (or with a fused linear + cross-entropy kernel), only at the "
           "positions that have labels, without casting the whole logits to fp32 yourself; or lower the batch or the "
           "sequence length.")
_CE_SNIPPET = ("# the loss over chunks of tokens: one chunk's fp32 log-probabilities at a time\n"
               "logits, labels = logits.view(-1, logits.size(-1)), labels.view(-1)\n"
               "loss = sum(F.cross_entropy(l, t, reduction=\"sum\") for l, t in zip(logits.split(4096), labels.split(4096)))\n"
               "loss = loss / (labels != -100).sum()")


def _cross_entropy(py, native, requested, cuda) -> Optional[Operation]:
    upcast = _innermost(py, _LOGITS_FLOAT)
    if upcast is not None:
        frame, ops = upcast
        name = _LOGITS_FLOAT.search(_text(upcast)).group(1)
        info = ops.values.get(name)
        if isinstance(info, TensorInfo):
            needs, ok = _check(requested, [info.numel * 4], cuda)
            if ok is not False:
                return Operation("logits_fp32", f"An fp32 copy of the logits ({dims_text(info.shape)})", needs, ok,
                                 frame, f"`{name}.float()` in {_where(frame)} copies {' x '.join(f'{d:,}' for d in info.shape)} "
                                 f"logits to fp32: {format_bytes(info.numel * 4)}; the vocabulary is {info.shape[-1]:,} wide.",
                                 _CE_FIX, _CE_SNIPPET)
    pair = _innermost(py, _CE_LINE)
    backward = any(_CE_BACKWARD.search(n) for n in native)
    if pair is None and not (backward or any(_CE_NATIVE.search(n) for n in native)):
        return None
    frame = pair[0] if pair is not None else None
    info = None
    if pair is not None:
        args, kwargs = _call(_text(pair), _CE_LINE)
        info, _ = _tensor(pair[1], _arg(args, kwargs, 0, "input"))
    what_grad = "The gradient of cross-entropy over the logits" if backward else "Cross-entropy's log-probabilities"
    if info is not None and len(info.shape) >= 1:
        vocab = info.shape[1] if len(info.shape) >= 2 else info.shape[0]
        rows = info.numel // vocab if vocab else 0
        needs, ok = _check(requested, [info.numel * 4, info.numel * info.itemsize], cuda)
        if ok is False:
            return Operation("cross_entropy", f"An allocation inside cross_entropy ({_where(frame)})", None, False, frame,
                             f"Its log-probabilities over {vocab:,} classes for {rows:,} rows would be "
                             f"{format_bytes(info.numel * 4)} in fp32" + _mismatch(requested, info.numel * 4, "the loss"),
                             _CE_FIX, _CE_SNIPPET)
        item = needs // info.numel if needs else 4
        what = f"{what_grad} over a vocabulary of {vocab:,} for {rows:,} tokens in {_dtype(info, item)}"
        return Operation("cross_entropy", what, needs, ok, frame,
                         f"{rows:,} tokens x {vocab:,} classes x {item} bytes = {format_bytes(info.numel * item)}; "
                         "cross-entropy computes its log-softmax in fp32 even under autocast.", _CE_FIX, _CE_SNIPPET)
    return Operation("cross_entropy", what_grad + (f" ({_where(frame)})" if frame else ""), None, None, frame,
                     "Cross-entropy makes a log-softmax the size of the logits (batch x sequence x vocabulary), in fp32 "
                     "even under autocast; the frames do not say the shapes.", _CE_FIX, _CE_SNIPPET)


def _conv_out(x: TensorInfo, w: TensorInfo, ops: FrameOperands, args, kwargs) -> Optional[Tuple[int, ...]]:
    spatial = len(w.shape) - 2
    if spatial < 1 or len(x.shape) < spatial + 1:
        return None

    def param(index, name, default):
        node = _arg(args, kwargs, index, name)
        if node is None:
            return default
        value = ops.values.get(dotted(node)) if dotted(node) else None
        if value is None and isinstance(node, ast.Constant):
            value = node.value
        if value is None and isinstance(node, ast.Tuple):
            value = tuple(e.value for e in node.elts if isinstance(e, ast.Constant))
        return value

    stride, padding, dilation = param(3, "stride", 1), param(4, "padding", 0), param(5, "dilation", 1)

    def each(v):
        if isinstance(v, int):
            return (v,) * spatial
        if isinstance(v, tuple) and len(v) == spatial and all(isinstance(i, int) for i in v):
            return v
        return None

    s, d = each(stride), each(dilation)
    ins, ks = x.shape[-spatial:], w.shape[2:]
    if s is None or d is None:
        return None
    if padding == "same":
        out = tuple(ins)
    else:
        p = (0,) * spatial if padding == "valid" else each(padding)
        if p is None:
            return None
        out = tuple((i + 2 * pi - di * (k - 1) - 1) // si + 1 for i, pi, di, k, si in zip(ins, p, d, ks, s))
    batch = x.shape[0] if len(x.shape) == spatial + 2 else 1
    return (batch, w.shape[0]) + out


def _convolution(py, native, requested, cuda) -> Optional[Operation]:
    pair = _innermost(py, _CONV_LINE)
    in_native = any(_CONV_NATIVE.search(n) for n in native)
    if pair is None and not in_native:
        return None
    frame = pair[0] if pair is not None else None
    call = "the convolution" + (f" in {_where(frame)}" if frame else "")
    cudnn = any(_CUDNN.search(n) for n in native)
    fix = ("Lower the batch or the input's size, use channels_last with autocast, or turn off cuDNN's autotuning "
           "(torch.backends.cudnn.benchmark = False), which tries workspace-hungry algorithms.")
    snippet = "torch.backends.cudnn.benchmark = False   # no autotuning over workspace-hungry algorithms"
    if pair is not None:
        args, kwargs = _call(_text(pair), _CONV_LINE)
        x, _ = _tensor(pair[1], _arg(args, kwargs, 0, "input"))
        w, _ = _tensor(pair[1], _arg(args, kwargs, 1, "weight"))
        out = _conv_out(x, w, pair[1], args, kwargs) if x is not None and w is not None else None
        if out is not None:
            nbytes = math.prod(out) * x.itemsize
            needs, ok = _check(requested, [nbytes], cuda)
            if ok:
                return Operation("conv_output", f"The output of {call}, {' x '.join(f'{d:,}' for d in out)} in "
                                 f"{_dtype(x)}", needs, True, frame,
                                 f"{' x '.join(f'{d:,}' for d in out)} x {x.itemsize} bytes = {format_bytes(nbytes)}.",
                                 fix, snippet)
            what = ("cuDNN's workspace for " + call) if cudnn else f"A workspace or temporary of {call}"
            return Operation("conv_workspace", what[0].upper() + what[1:], None, False if requested else None, frame,
                             f"Its output, {' x '.join(f'{d:,}' for d in out)}, is {format_bytes(nbytes)}"
                             + (f"; the request, {format_bytes(requested)}, is not that: a workspace (cuDNN's on a GPU) "
                                "or an unfolded copy of the input (im2col on the CPU)." if requested else "."), fix, snippet)
    what = f"cuDNN's workspace or output for {call}" if cudnn else f"An allocation inside {call}"
    return Operation("conv_workspace" if cudnn else "conv_output", what, None, None, frame,
                     "A convolution allocates its output and, on a GPU, a workspace for the algorithm cuDNN picked; the "
                     "frames do not say the shapes.", fix, snippet)


def _embedding(py, native, requested, cuda) -> Optional[Operation]:
    backward = any(_EMBED_BACKWARD.search(n) for n in native)
    pair = _innermost(py, _EMBED_LINE)
    if pair is None and not backward:
        return None
    frame = pair[0] if pair is not None else None
    fix_grad = ("A vocabulary this large makes a dense gradient the size of the whole table each step: use "
                "sparse=True (with an optimizer that takes sparse gradients, e.g. SparseAdam), freeze the embedding, or "
                "keep it in lower precision.")
    if pair is not None:
        args, kwargs = _call(_text(pair), _EMBED_LINE)
        idx, _ = _tensor(pair[1], _arg(args, kwargs, 0, "input"))
        weight, _ = _tensor(pair[1], _arg(args, kwargs, 1, "weight"))
        if idx is not None and weight is not None and idx.dtype.startswith("float"):
            idx, weight = weight, idx  # torch.embedding(weight, indices): the indices are the integer tensor
        if weight is not None and len(weight.shape) == 2:
            rows, dim = weight.shape
            if backward:
                needs, ok = _check(requested, [weight.nbytes], cuda)
                return Operation("embedding_grad", f"The dense gradient of the {rows:,} x {dim:,} embedding", needs, ok,
                                 frame, f"{rows:,} x {dim:,} x {weight.itemsize} bytes = {format_bytes(weight.nbytes)}.",
                                 fix_grad)
            if idx is not None:
                out = idx.numel * dim * weight.itemsize
                needs, ok = _check(requested, [out], cuda)
                if ok is not False:
                    return Operation("embedding", f"The embedding's output, {dims_text(idx.shape + (dim,))} in "
                                     f"{_dtype(weight)}", needs, ok, frame,
                                     f"{idx.numel:,} indices x {dim:,} x {weight.itemsize} bytes = {format_bytes(out)}.",
                                     "Lower the batch or the sequence length.")
                needs, ok = _check(requested, [weight.nbytes], cuda)
                if ok:
                    return Operation("embedding_grad", f"A copy of the {rows:,} x {dim:,} embedding table", needs, ok,
                                     frame, f"{format_bytes(weight.nbytes)}, the size of the whole table.", fix_grad)
    if backward:
        return Operation("embedding_grad", "The embedding's dense gradient (EmbeddingBackward)", None, None, frame,
                         "An embedding's backward makes a gradient the size of its whole table.", fix_grad)
    return None


def _foreach(py, native, requested, cuda) -> Optional[Operation]:
    pair = next((p for p in reversed(py) if _FOREACH_FUNC.match(p[0][1])), None)
    if pair is None:
        return None
    name = _FOREACH_FUNC.match(pair[0][1]).group(1)
    opt = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "rmsprop": "RMSprop", "adagrad": "Adagrad",
           "nadam": "NAdam", "radam": "RAdam", "adamax": "Adamax", "adadelta": "Adadelta"}.get(name, name)
    frame, ops = pair
    lists = [v for v in ops.values.values() if isinstance(v, tuple) and v and isinstance(v[0], TensorInfo)]
    args, _kwargs = _call(_text(pair), _FOREACH_LINE) if _FOREACH_LINE.search(_text(pair)) else ([], {})
    arg = ops.values.get(dotted(args[0])) if args else None
    if isinstance(arg, tuple) and arg and isinstance(arg[0], TensorInfo):
        lists = [arg]
    fix = "Pass foreach=False (one parameter at a time) or fused=True (on CUDA: no temporaries) to the optimizer."
    snippet = f"optimizer = torch.optim.{opt}(model.parameters(), lr=1e-3, foreach=False)"
    if lists:
        items = lists[0]
        total = sum(i.nbytes for i in items)
        one = next((i for i in items if request_matches(requested, i.nbytes, cuda)), None)
        what = f"{opt}'s foreach step: a temporary for each of {len(items):,} tensors, {format_bytes(total)} in all"
        detail = (f"The foreach implementation ({_where(frame)}) makes every parameter's temporary at once"
                  + (f"; the failing one is {format_bytes(one.nbytes)} ({dims_text(one.shape)})." if one else "."))
        return Operation("foreach", what, total if one is not None else None, True if one is not None else
                         (False if requested is not None else None), frame, detail, fix, snippet, total)
    return Operation("foreach", f"{opt}'s foreach step ({_where(frame)})", None, None, frame,
                     "The foreach implementation makes a temporary for every parameter at once.", fix, snippet)


def _cat(py, native, requested, cuda) -> Optional[Operation]:
    pair = _innermost(py, _CAT_LINE)
    if pair is None:
        return None
    frame, ops = pair
    verb = _CAT_LINE.search(_text(pair)).group(1)
    args, kwargs = _call(_text(pair), _CAT_LINE)
    node = _arg(args, kwargs, 0, "tensors")
    parts = ops.values.get(dotted(node)) if node is not None and dotted(node) else None
    fix = ("Preallocate the result and write each piece into its slice as it is made (out[i:i + n] = piece), or reduce "
           "each piece to what you keep; the list and the result cannot both be alive at this size.")
    snippet = ("out = torch.empty(total_rows, *shape, dtype=dtype, device=device)   # once\n"
               "row = 0\nfor piece in pieces_as_they_come():\n    out[row:row + len(piece)] = piece\n"
               "    row += len(piece)")
    if isinstance(parts, tuple) and parts and isinstance(parts[0], TensorInfo):
        total = sum(p.nbytes for p in parts)
        needs, ok = _check(requested, [total], cuda)
        name = dotted(node)
        if ok is not False:
            return Operation("cat", f"torch.{verb} of {len(parts):,} tensors in `{name}`",
                             needs, ok, frame,
                             f"The result is a new {format_bytes(total)} while `{name}` still holds its "
                             f"{format_bytes(total)} of parts: twice the data at once.", fix, snippet, 2 * total)
    return Operation("cat", f"torch.{verb} in {_where(frame)}", None, None, frame,
                     "A concatenation makes a new tensor the size of all its parts, while the parts are still alive.",
                     fix, snippet)


def _literal(py, requested) -> Optional[Operation]:
    for frame, ops in reversed(py):
        text = ops.statement or frame[2]
        ints = {k: v for k, v in ops.values.items() if type(v) is int}  # batch_size = 4096 in the frame
        found = literal_allocation(text, ints) if text else None
        if found is None:
            continue
        nbytes, call = found
        ok = True if requested is None else request_matches(requested, nbytes, False)  # the line is the request
        if ok is False:
            return None
        return Operation("literal", f"`{call}`", nbytes, True, frame,
                         f"`{call}` in {_where(frame)} asks for {format_bytes(nbytes)}, written out in the line itself.")
    return None


def _named(py, stack: Sequence[Frame]) -> Optional[Operation]:
    """An operation named only by its frames: autograd's node, a gradient, the ATen operator the Python code called."""
    last_py = max((i for i, f in enumerate(stack) if is_python(f)), default=-1)
    node_at, node = -1, None
    accumulate_at = -1
    op = None
    for i, f in enumerate(stack):
        if is_python(f):
            continue
        m = _BACKWARD_NODE.search(f[1])
        if m:
            node_at, node = i, m.group(1)
        if _ACCUMULATE.search(f[1]):
            accumulate_at = i
        m = _ATEN_OP.search(f[1])
        name = _OVERLOAD.sub("", m.group(1)) if m else ""
        if m and op is None and i > last_py and not _PLUMBING.match(name):
            op = name  # the outermost operator below the Python code: the one it called
    python = [p[0] for p in py if p[0][0]]
    users = [f for f in python if not _LIBRARY.search(f[0])]
    frame = users[-1] if users else (python[-1] if python else None)  # the user's line that called it
    if accumulate_at > node_at:
        return Operation("gradient", "A parameter's gradient, accumulated by autograd's backward (AccumulateGrad)",
                         None, None, frame, "Autograd makes each parameter's .grad the size of the parameter.")
    if node is not None:
        forward = re.sub(r"Backward\d*$", "", node)
        return Operation("backward_node", f"Autograd's backward of {forward} ({node})", None, None, frame,
                         f"The allocation was made by autograd's backward pass, in the gradient of {forward}; no Python "
                         "frame runs there.")
    if op is not None:
        where = f" ({_where(frame)})" if frame is not None else ""
        return Operation("aten", f"`{op}`{where}", None, None, frame,
                         f"The allocation was made by the operator `{op}`" + (f", called from {_where(frame)}" if frame
                                                                             else "") + ".")
    return None
