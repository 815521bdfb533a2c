"""Where in the program an allocation failed: the phase (forward, backward, the optimizer's update), read from the frames nearest to it.

The phase is the innermost one. Lightning's automatic and manual optimization, ``torch.optim.LBFGS``
and accelerate's wrappers call the forward and backward passes from a closure *inside*
``optimizer.step``, so an optimizer frame far out in the stack says nothing: the frames are read
from the failing allocation outwards, and the first one that says where it is decides. A module's
forward is the forward pass, autograd (or a C++ frame of its engine, in a snapshot) is the backward
pass, and only an optimizer frame that is not calling its closure is the optimizer's own update.

Frames are ``(filename, function, line)``; a recorded allocation's stack (a snapshot, ``--trace``)
mixes Python frames with C++ ones (``at::native::...``, ``torch::autograd::Engine::...``), which
:func:`is_python` tells apart.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Optional, Sequence, Tuple

__all__ = ["Frame", "OPTIM_FILE", "BACKWARD_CALL", "phase_of", "is_python", "recorded_stack", "python_part",
           "native_part", "CHECKPOINT_RECOMPUTE"]

#: ``(filename, function, source line)`` of one frame, innermost last in every sequence here.
Frame = Tuple[str, str, str]

# torch's own layout (torch/optim, torch/autograd, torch/nn) and the libraries that wrap it.
OPTIM_FILE = re.compile(r"torch[/\\]optim[/\\]|[/\\]optim[/\\]\w+\.py$|bitsandbytes[/\\]optim")
_OPTIM_FUNC = re.compile(r"^_(?:single|multi)_tensor_\w+$|^_fused_\w+$")
_AUTOGRAD_FILE = re.compile(r"torch[/\\]autograd[/\\]|torch[/\\]_tensor\.py$")
_NN_FILE = re.compile(r"torch[/\\]nn[/\\]|transformers[/\\]models[/\\]|timm[/\\]")
_FORWARD_LINE = re.compile(r"\bF\.(?:linear|conv\w*|scaled_dot_product_attention|softmax|gelu|relu|"
                           r"layer_norm|batch_norm|embedding|interpolate)\s*\(|scaled_dot_product_attention")
#: A line that runs the backward pass.
BACKWARD_CALL = re.compile(r"\.backward\b|autograd\.grad\s*\(|manual_backward\s*\(")
_STEP_CALL = re.compile(r"\b\w*(?:optim\w*|opt)\.step\s*\(")
# Functions whose body is the forward pass of a training framework (Lightning's steps).
_STEP_FUNCS = frozenset({"forward", "_call_impl", "_wrapped_call_impl", "training_step", "validation_step",
                         "test_step", "predict_step"})
# Functions that run the backward pass: autograd's, Lightning's (module.backward, manual_backward),
# accelerate's (Accelerator.backward), a custom autograd.Function's backward.
_BACKWARD_FUNCS = frozenset({"backward", "manual_backward", "_engine_run_backward"})
#: A frame of ``torch.utils.checkpoint`` that recomputes the forward pass during backward.
CHECKPOINT_RECOMPUTE = re.compile(r"torch[/\\]utils[/\\]checkpoint\.py$")
_RECOMPUTE_FUNCS = re.compile(r"unpack|recompute")
_LIBRARY = re.compile(r"site-packages|dist-packages|[/\\]lib[/\\]python\d|^<frozen ")
_TORCH_FILE = re.compile(r"[/\\]torch[/\\]")
# The optimizer's line that calls the closure: what runs below it is the closure's, not the update's.
_CALLS_CLOSURE = re.compile(r"\bclosure\s*\(")
# C++ frames of autograd's engine running the backward pass (a snapshot's stack; on CUDA the
# backward runs on a device thread, so these are often the only frames there are).
_NATIVE_BACKWARD = re.compile(r"torch::autograd::(?:Engine::|generated::\w+Backward\w*::apply|AccumulateGrad::apply|"
                              r"PyNode::apply|CppNode)")


def is_python(frame: Frame) -> bool:
    """Whether a recorded frame is Python's (a ``.py`` file, a notebook cell, ``<string>``), not C++."""
    filename = frame[0]
    return filename.endswith((".py", ".pyw")) or (filename.startswith("<") and filename.endswith(">"))


def recorded_stack(frames: Any) -> Tuple[Frame, ...]:
    """A recorded allocation's frames (torch's dicts, innermost first) as :data:`Frame` tuples, innermost last.

    Their source lines are not recorded (the text slot is ""). Anything that is not a dict with text is
    skipped: a snapshot is data from elsewhere.
    """
    out = []
    for f in reversed(tuple(frames or ())):
        if not isinstance(f, dict):
            continue
        filename, name = f.get("filename", ""), f.get("name", "")
        out.append((filename if isinstance(filename, str) else "", name if isinstance(name, str) else "", ""))
    return tuple(out)


def python_part(stack: Sequence[Frame]) -> Tuple[Frame, ...]:
    """The Python frames of a recorded stack (their source lines are not recorded: line is "")."""
    return tuple((f[0], f[1], "") for f in stack if is_python(f))


def native_part(stack: Sequence[Frame]) -> Tuple[str, ...]:
    """The C++ function names of a recorded stack, innermost last."""
    return tuple(f[1] for f in stack if not is_python(f) and f[1])


def _classify(frame: Frame) -> Optional[str]:
    """``"forward"``, ``"backward"``, ``"step"``, ``"closure"`` (an optimizer calling its closure) or None."""
    filename, func, line = frame
    if not is_python(frame):
        return "backward" if _NATIVE_BACKWARD.search(func) else None
    if func in _BACKWARD_FUNCS or (_AUTOGRAD_FILE.search(filename) and ("backward" in func or func == "grad")):
        return "backward"
    if OPTIM_FILE.search(filename) or _OPTIM_FUNC.match(func):
        return "closure" if _CALLS_CLOSURE.search(line) else "step"
    if func in _STEP_FUNCS or _NN_FILE.search(filename) or _FORWARD_LINE.search(line):
        return "forward"
    return None


def phase_of(frames: Sequence[Frame], model_names: Iterable[str] = ()) -> Tuple[Optional[str], Optional[Frame]]:
    """Where the failing allocation was made: ``("forward" | "backward" | "step", the frame that says so)``,
    or ``(None, None)`` when no frame says.

    ``frames`` run innermost last (a traceback, or a recorded stack with its C++ frames). The innermost
    frame that says where it is decides; an optimizer frame calling its closure means the allocation was
    the closure's own code, which computes the loss: the forward pass (a backward inside it was found
    first). A forward recomputed by ``torch.utils.checkpoint`` during backward is the backward pass.
    Without a library frame that says, the user's own lines are read, outermost first.
    """
    frames = tuple(frames)
    for i in range(len(frames) - 1, -1, -1):
        kind = _classify(frames[i])
        if kind is None:
            continue
        inner = [f for f in frames[i + 1:] if is_python(f)]
        if kind == "step" and inner and inner[0][1] == "step":
            return "step", inner[0]  # an Optimizer subclass's own step(), called by torch's wrapper
        if kind == "step" and not frames[i][2] and any(not _TORCH_FILE.search(f[0]) for f in inner):
            kind = "closure"  # a recorded frame has no source line: code outside torch below step() is its closure
        if kind == "closure":
            return "forward", (inner[-1] if inner else frames[i])
        if kind == "forward" and any(CHECKPOINT_RECOMPUTE.search(f[0]) and _RECOMPUTE_FUNCS.search(f[1])
                                     for f in frames[:i]):
            return "backward", frames[i]
        if kind == "forward" and _LIBRARY.search(frames[i][0]):
            # torch's own layer: the user's line that called it says more (models.py forward(), not linear.py).
            user = next((f for f in reversed(frames[:i]) if is_python(f) and not _LIBRARY.search(f[0])), None)
            if user is not None:
                return kind, user
        return kind, frames[i]
    # No library frame says it: read the user's own lines, outermost first.
    calls = [re.compile(r"(?<![\w.])" + re.escape(n) + r"\s*\(") for n in model_names]
    calls.append(re.compile(r"(?<![\w.])(?:model|net|network|module)\s*\("))
    for frame in frames:
        line = frame[2]
        if BACKWARD_CALL.search(line):
            return "backward", frame
        if _STEP_CALL.search(line):
            return "step", frame
        if any(c.search(line) for c in calls):
            return "forward", frame
    return None, None
