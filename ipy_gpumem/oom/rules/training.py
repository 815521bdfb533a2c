"""Rules about a training step: activations kept for backward, graphs kept alive, optimizer state, gradients, and the batch size that fits."""
from __future__ import annotations

import math
import re
from typing import Optional, Tuple

from ...core.text import clip
from ...core.units import MiB
from . import Finding
from .facts import BACKWARD_CALL, BATCH, OPTIM_FILE, Facts, call_args, device_record
from .words import b, cap, pct, where

__all__ = ["RULES", "activations", "graphs_kept", "optimizer_state", "gradients", "batch_size"]

_OPTIM_CTOR = re.compile(r"\b((?:torch\.)?optim\.|bnb\.optim\.|bitsandbytes\.optim\.)(\w+)\s*\(")
_OPTIM_BY_FILE = {
    "adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "rmsprop": "RMSprop", "adagrad": "Adagrad",
    "adadelta": "Adadelta", "adamax": "Adamax", "nadam": "NAdam", "radam": "RAdam", "lion": "Lion",
}
_TWO_BUFFERS = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adafactor", "LAMB", "Lamb")
_LOSSISH = r"\w*loss\w*"  # not "out": ``out += residual`` inside a forward is no accumulation
_ACCUM = re.compile(r"^([A-Za-z_][\w.\[\]'\"]*)\s*\+=\s*(.+)$")
_APPEND = re.compile(r"^([A-Za-z_][\w.]*)\.(?:append|extend)\(\s*(.+)\)\s*$")
_DETACHED = re.compile(r"\.item\(\)|\.detach\(\)|\.tolist\(\)|\bfloat\(|\bint\(|\.numpy\(\)")
_SET_TO_NONE_FALSE = re.compile(r"zero_grad\(\s*(?:set_to_none\s*=\s*)?False\s*\)")


def activations(x: Facts) -> Optional[Finding]:
    """The forward or backward pass ran out: activations grow with the batch."""
    if x.phase not in ("forward", "backward"):
        return None
    traceback_held = sum(h.bytes for h in x.holders_of("traceback_local"))
    acts: Optional[int] = None
    basis = ""
    if x.who is not None:
        acts = x.cat("retained_graphs") + x.unattributed + traceback_held
        basis = (f"retained graphs {b(x.cat('retained_graphs'))}"
                 + (f" + unattributed {b(x.unattributed)}" if x.unattributed else "")
                 + (f" + held by the last traceback {b(traceback_held)}" if traceback_held else ""))
    else:
        peak = _failing_peak(x)
        if peak:
            acts, basis = peak, "how far allocated memory rose in the failing cell"
    if acts is not None and acts <= 0:
        return None
    big = acts is None or x.requested is None or acts >= x.requested or (
        x.memory.allocated and acts >= x.memory.allocated // 10)
    evaluating = _looks_like_eval(x)
    if not big and not evaluating:  # when evaluating, any kept graph is pure waste
        return None
    at = where(x.phase_frame)
    line = x.phase_frame[2].strip() if x.phase_frame else ""
    model_line = _model_call_line(x) or "output = model(inputs)"
    title = (f"Activations of the {x.phase} pass: {b(acts)}" if acts is not None
             else f"Out of memory in the {x.phase} pass ({at})")
    detail = (f"The {x.phase} pass failed in {at}" + (f" at `{clip(line, 60)}`" if line else "")
              + ". Autograd keeps every layer's inputs for backward, so activations grow with the batch"
              + (f" ({basis})." if acts is not None else "."))
    batch = x.find(BATCH)
    frees = acts // 2 if acts else None
    if x.batch is not None and x.batch.known and x.batch.best < x.batch.size:
        detail += f" Estimated on fake tensors: {x.batch.sentence()} (see the batch-size finding)."
    elif batch and acts:
        size = int(batch[2].group(1))
        new = _fitting_batch(size, acts, x.requested, x.free)
        detail += f" Halving batch_size={size} frees about {b(acts // 2)}"
        detail += f"; batch_size={new} would fit." if new and new < size else "."
    elif acts:
        detail += f" Halving the batch size frees about {b(acts // 2)}."
    if evaluating:
        fix = ("This looks like evaluation (no .backward() in the cell): run it under torch.inference_mode() "
               "so no graph is kept, and lower the batch size if it still does not fit.")
        snippet = ("model.eval()\nwith torch.inference_mode():    # no graph: each activation is freed after use\n"
                   f"    {model_line}")
        frees = acts
    else:
        device = x.memory.device
        dev = device.type if device is not None and device.type in ("cuda", "cpu", "mps", "xpu") else "cuda"
        fix = ("Lower the batch size (accumulate gradients over several smaller batches to keep the effective "
               "size), run the forward pass under torch.autocast, or recompute activations in backward with "
               "torch.utils.checkpoint.")
        snippet = (f'with torch.autocast(device_type="{dev}", dtype=torch.bfloat16):  # float16 before Ampere\n'
                   f"    {model_line}\n"
                   "# or keep only block boundaries and recompute the rest during backward:\n"
                   "from torch.utils.checkpoint import checkpoint\n"
                   "h = checkpoint(block, h, use_reentrant=False)")
    return Finding("activations", title, detail, fix, snippet, frees, "likely" if acts is not None else "possible")


def _fitting_batch(size: int, acts: int, requested: Optional[int], free: Optional[int]) -> Optional[int]:
    """The largest power-of-two batch size whose activations and request fit, or None.

    Activations and the failing request both scale with the batch, so a batch ``k`` times the
    size needs ``k * (acts + requested)``, and ``acts + free`` is what there is.
    """
    if requested is None or free is None or requested <= free:
        return None
    target = int(size * (acts + free) / (acts + requested))
    if target < 1:
        return None
    return 2 ** int(math.log2(target))


def _failing_peak(x: Facts) -> Optional[int]:
    dev = device_record(x.failing, x.memory)
    return dev.peak_increase if dev is not None and dev.peak_increase and dev.peak_increase > 0 else None


def _looks_like_eval(x: Facts) -> bool:
    src = x.failing_source
    if not src.strip() or re.search(r"no_grad|inference_mode", src):
        return False
    return bool(re.search(r"\.eval\s*\(\s*\)", src)) or not BACKWARD_CALL.search(src)


def _model_call_line(x: Facts) -> Optional[str]:
    names = list(x.model_names) + ["model", "net"]
    for _label, line in x.code_lines():
        for n in names:
            if re.search(r"(?<![\w.])" + re.escape(n) + r"\s*\(", line) and "=" in line:
                return clip(line, 70)
    return None


def graphs_kept(x: Facts) -> Optional[Finding]:
    """Tensors from an earlier forward pass keep their autograd graphs (and the saved activations) alive."""
    graphs = x.holders_of("graph", "shared_graph")
    # IPython's caches are cleared with %gpumem free, never with ``del Out``.
    cached = {r for h in x.holders_of("out_cache", "underscore") for r in h.roots}
    names = list(dict.fromkeys(r for h in graphs for r in h.roots if r not in cached))  # first-seen order
    graph_bytes = x.cat("retained_graphs")
    name_rx = "|".join([re.escape(n) for n in names if re.fullmatch(r"\w+", n)] + [_LOSSISH])
    accum = _accumulation(x, name_rx)
    if not (graph_bytes > 0 and graphs) and accum is None:
        return None
    own = sum(h.bytes for h in x.holders_of("variable") if h.category == "other_tensors" and h.expr in names)
    parts = []
    if graphs:
        shown = ", ".join(f"`{h.name}` {b(h.bytes)}" for h in graphs[:3])
        parts.append(f"Tensors from an earlier forward pass still hold their autograd graphs: {shown}. "
                     "Deleting them frees the saved activations"
                     + (f" (plus {b(own)} of their own data)." if own else "."))
    if accum is not None:
        label, line = accum
        parts.append(f"{cap(label)} accumulates a tensor with its graph: `{clip(line, 60)}` keeps every "
                     "iteration's graph alive.")
    target = accum[1] if accum else None
    fixed = _detached(target) if target else None
    snippet = f"{fixed}    # a Python number: no graph\n" if fixed else ""
    if graphs and not names:
        # Only IPython keeps them (Out[N], the last traceback's locals): no variable of the user's to delete.
        keepers = "the last traceback" if any(h.frame for h in graphs) else "IPython's output cache"
        snippet += "%gpumem free    # drops the last traceback and the Out entries that hold tensors"
        fix = f"Take numbers with .item() (or .detach()) when you keep them, and run %gpumem free to release {keepers}."
    else:
        del_names = ", ".join(names) if names else "output, loss"  # accumulation only: the usual names
        keepers = ", ".join(names)
        snippet += f"del {del_names}    # before the next forward pass"
        fix = (f"Take numbers with .item() (or .detach()) when you keep them, and `del {del_names}` before "
               "the next forward pass.")
    title = (f"Graphs kept alive by {keepers}: {b(graph_bytes)}" if graphs
             else f"A graph accumulates across iterations: `{clip(target or '', 50)}`")
    return Finding(
        key="graphs_kept",
        title=title,
        detail=" ".join(parts),
        fix=fix,
        snippet=snippet,
        frees=(graph_bytes + own) if graphs else None,
        confidence="certain" if graphs else "likely",
    )


def _accumulation(x: Facts, name_rx: str) -> Optional[Tuple[str, str]]:
    """``(label, line)`` of ``total += loss`` / ``losses.append(loss)`` without .item()/.detach()."""
    graphish = re.compile(r"(?<![\w.])(?:" + name_rx + r")(?![\w(])")
    for label, line in x.code_lines():
        for rx in (_ACCUM, _APPEND):
            m = rx.match(line)
            if m and graphish.search(m.group(2)) and not _DETACHED.search(m.group(2)):
                return label, line
    return None


def _detached(line: str) -> Optional[str]:
    """The accumulating line rewritten to keep a number (``.item()``) or a detached tensor instead."""
    m = _ACCUM.match(line)
    if m:
        value = m.group(2).strip()
        return f"{m.group(1)} += {value}.item()" if re.fullmatch(r"[\w.]+", value) \
            else f"{m.group(1)} += ({value}).item()"
    m = _APPEND.match(line)
    if m:
        item = m.group(2).strip()
        how = ".item()" if re.search(_LOSSISH, item) else ".detach()"
        return f"{m.group(1)}.append({item}{how})"
    return None


def optimizer_state(x: Facts) -> Optional[Finding]:
    """The optimizer's state (Adam: two buffers per weight) or its step's temporaries."""
    opt = _optimizer_name(x)
    state_bytes, params = x.cat("optimizer_state"), x.cat("parameters")
    in_step = x.phase == "step"
    share = state_bytes / x.who.total if x.who is not None and x.who.total else 0.0
    if not in_step and not (state_bytes >= MiB and share >= 0.25):
        return None  # neither the failing frame nor the numbers point at the optimizer
    two = opt in _TWO_BUFFERS
    name = opt or "The optimizer"
    if state_bytes:
        title = (f"{name} keeps two buffers the size of the weights: {b(state_bytes)}" if two
                 else f"{name}'s state holds {b(state_bytes)}")
    else:
        title = f"Out of memory inside the optimizer step ({where(x.phase_frame)})"
    detail = ""
    if state_bytes and params:
        detail = (f"Optimizer state is {b(state_bytes)}, {state_bytes / params:.1f}x the {b(params)} of "
                  "parameters" + (" (exp_avg and exp_avg_sq per weight)." if two else "."))
        footprint = params + x.cat("gradients") + state_bytes
        total = x.memory.total
        if total and footprint * 100 >= total:
            detail += (f" Weights + gradients + optimizer state take {b(footprint)}, "
                       f"{pct(footprint, total)} of the {b(total)} device, before any activation.")
    if in_step:
        detail += (f" The allocation failed in {where(x.phase_frame)}"
                   + (f" while allocating {b(x.requested)}" if x.requested else "") + _step_temporaries(x))
    args = _optimizer_args(x)
    ctor = f"torch.optim.{opt if opt in _OPTIM_BY_FILE.values() else 'Adam'}({args}, foreach=False)"
    if two or opt is None:
        fix = ("Use an optimizer with less state (8-bit Adam keeps 2 bytes per weight instead of 8; SGD with "
               "momentum one buffer, without momentum none), or pass foreach=False (fused=True on CUDA) to avoid "
               "the step's temporary copies.")
        snippet = ("import bitsandbytes as bnb          # pip install bitsandbytes\n"
                   f"optimizer = bnb.optim.Adam8bit({args})\n"
                   "# or one buffer per weight:  torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)\n"
                   f"# or no step temporaries:   {ctor}")
    else:
        fix = ("Pass foreach=False to avoid the step's temporaries for all parameters at once; without momentum "
               "SGD keeps no state at all.")
        snippet = f"optimizer = {ctor}"
    # 8-bit Adam keeps 2 of Adam's 8 bytes per weight; other optimizers: about half, a guess.
    frees = state_bytes * 3 // 4 if two and state_bytes else (state_bytes // 2 if state_bytes else None)
    confident = in_step and (state_bytes > 0 or opt is not None)
    return Finding("optimizer_state", title, detail.strip() or f"{name} allocates in its step.", fix, snippet,
                   frees, "certain" if confident else "likely")


def _optimizer_name(x: Facts) -> Optional[str]:
    """The optimizer's class: from the failing frames (torch/optim/adam.py), else from the code that built it."""
    for filename, func, _line in reversed(x.frames):
        base = re.sub(r"\.py$", "", re.split(r"[/\\]", filename)[-1]).lower()
        if OPTIM_FILE.search(filename) and base in _OPTIM_BY_FILE:
            return _OPTIM_BY_FILE[base]
        m = re.match(r"^_(?:single_tensor|multi_tensor|fused)_(\w+)$", func)
        if m and m.group(1).lower() in _OPTIM_BY_FILE:
            return _OPTIM_BY_FILE[m.group(1).lower()]
    hit = x.find(_OPTIM_CTOR)
    return hit[2].group(2) if hit else None


def _step_temporaries(x: Facts) -> str:
    """What the frames say about the step's implementation and its temporary tensors."""
    funcs = " ".join(f[1] + " " + f[2] for f in x.frames)
    if "_multi_tensor_" in funcs or "_foreach_" in funcs:
        return ("; the foreach implementation allocates per-parameter temporaries for all parameters at "
                "once (foreach=False does one parameter at a time).")
    if "_single_tensor_" in funcs or any(f[0].endswith("_functional.py") for f in x.frames):
        return ("; this single-tensor step allocates temporaries one parameter at a time, so the request is "
                "about one parameter's size.")
    return ("; on CUDA the default foreach implementation allocates per-parameter temporaries for all "
            "parameters at once.")


def _optimizer_args(x: Facts) -> str:
    """The arguments the user built the optimizer with (``model.parameters(), lr=1e-3``)."""
    hit = x.find(_OPTIM_CTOR)
    if hit:
        _label, line, m = hit
        inner = call_args(line, m.end() - 1)
        if inner is not None and inner.strip():
            return clip(inner.strip(), 60)
    return "model.parameters(), lr=1e-3"


def gradients(x: Facts) -> Optional[Finding]:
    """Gradients still allocated outside backward and the step, or kept as zeros by zero_grad(set_to_none=False)."""
    grads = x.cat("gradients")
    keep_zeros = x.find(_SET_TO_NONE_FALSE)
    held = grads > 0 and x.phase not in ("step", "backward")  # there, the step needs them
    if not held and keep_zeros is None:
        return None
    names = [h.name for h in x.holders if h.category == "gradients"][:3]
    parts = []
    if held:
        parts.append(f"{b(grads)} of gradients ({', '.join(f'`{n}`' for n in names) or 'parameters'}) are "
                     "still allocated at the failure, outside backward and the optimizer step.")
    if keep_zeros is not None:
        parts.append(f"{cap(keep_zeros[0])} calls `{clip(keep_zeros[1], 60)}`: gradients stay allocated as zeros "
                     "between steps instead of being freed.")
    parts.append("With gradient accumulation they live across micro-batches by design.")
    title = (f"Gradients held between steps: {b(grads)}" if grads
             else f"zero_grad(set_to_none=False) keeps gradients allocated: `{clip(keep_zeros[1], 50)}`")
    return Finding(
        key="gradients",
        title=title,
        detail=" ".join(parts),
        fix=("Call optimizer.zero_grad(set_to_none=True) (the default since torch 2.0) right after "
             "optimizer.step(), so the next forward pass runs without last step's gradients."),
        snippet=("optimizer.step()\n"
                 "optimizer.zero_grad(set_to_none=True)   # frees .grad now, not after the next forward"),
        frees=grads or None,
        confidence="likely",
    )


def batch_size(x: Facts) -> Optional[Finding]:
    """The batch that fits, worked out by re-estimating the failing cell on fake tensors; otherwise the line that estimates it."""
    fit = x.batch
    if fit is None:
        return None
    names = ", ".join(f"`{n}`" for n in fit.faked[:4]) or "your objects"
    if fit.known and fit.best < fit.size:
        where = "the host's available RAM" if x.is_host else "the device less other processes"
        detail = (f"The failing cell's code, run twice as re-running the cell does (what the first run assigned is "
                  f"alive during the second) on fake copies of {names} (nothing ran for real), with `{fit.name}` "
                  f"resized along its first dimension, needs {b(fit.needed)} at batch {fit.size} against "
                  f"{b(fit.capacity)} ({where})"
                  + (f"; at batch {fit.best} it needs {b(fit.best_needed)}." if fit.best else
                     "; not even a batch of 1 fits, so the model or what the step keeps must shrink first."))
        fix = (f"Use a batch of {fit.best} (accumulate gradients over {-(-fit.size // fit.best)} batches to keep the "
               f"effective size {fit.size})." if fit.best else
               "Shrink the model or the step (mixed precision, activation checkpointing) before the batch.")
        snippet = (f"{fit.name} = {fit.name}[:{fit.best}]   # or batch_size={fit.best} in your DataLoader\n"
                   f"# check before running: put {fit.line} on the cell" if fit.best else
                   f"# estimate each change before running it: put {fit.line} on the cell")
        return Finding("batch_size", cap(fit.sentence()), detail, fix, snippet,
                       (fit.needed - fit.best_needed) if fit.best and fit.needed and fit.best_needed else None, "likely")
    training = x.phase in ("forward", "backward", "step") or BACKWARD_CALL.search(x.failing_source or "")
    if not training or (fit.known and fit.best >= fit.size):
        return None
    return Finding(
        "batch_size", f"Find the batch that fits before running it: {fit.line}",
        f"The batch size that fits was not worked out here: {(fit.reason or '').rstrip('.')}. {fit.line} on the cell runs its code on fake "
        "copies of your objects (no memory, nothing runs for real) and says whether it fits, line by line; change "
        "the batch until it does" + (f" (the failing request was {b(x.requested)})." if x.requested else "."),
        "Put the line on the failing cell, lower the batch until the verdict says it fits, then run it.",
        f"{fit.line}\n# ... the failing cell's code, with a smaller batch", None, "possible")


RULES = (activations, graphs_kept, optimizer_state, gradients, batch_size)
