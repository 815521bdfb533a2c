"""Rules about a training step: activations kept for backward, graphs kept alive, optimizer state, gradients, and the batch size that fits."""
from __future__ import annotations

import re
from typing import Optional, Tuple

from ...core.text import clip
from ...core.units import MiB
from .finding import Finding
from .facts import BACKWARD_CALL, BATCH, OPTIM_FILE, Facts, call_args, device_record
from .words import b, cap, pct, where

__all__ = ["RULES", "activations", "graphs_kept", "optimizer_state", "gradients", "batch_size"]

_OPTIM_CTOR = re.compile(r"\b((?:torch\.)?optim\.|bnb\.optim\.|bitsandbytes\.optim\.)(\w+)\s*\(")
_OPTIM_BY_FILE = {
    "adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "rmsprop": "RMSprop", "adagrad": "Adagrad",
    "adadelta": "Adadelta", "adamax": "Adamax", "nadam": "NAdam", "radam": "RAdam", "lion": "Lion",
}
_TWO_BUFFERS = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adafactor", "LAMB", "Lamb")
_ONE_BUFFER = ("RMSprop", "Adagrad")
_LOSSISH = r"\w*loss\w*"  # not "out": ``out += residual`` inside a forward is no accumulation
_ACCUM = re.compile(r"^([A-Za-z_][\w.\[\]'\"]*)\s*\+=\s*(.+)$")
_APPEND = re.compile(r"^([A-Za-z_][\w.]*)\.(?:append|extend)\(\s*(.+)\)\s*$")
_DETACHED = re.compile(r"\.item\(\)|\.detach\(\)|\.tolist\(\)|\bfloat\(|\bint\(|\.numpy\(\)")
_PER_SAMPLE = re.compile(r"reduction\s*=\s*['\"]none['\"]")  # a loss with one value per sample
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
    if x.batch is not None and x.batch.best is not None and x.batch.best < (x.batch.size or 0):
        detail += " An earlier estimate of this cell names the batch that should fit (see the batch-size finding)."
    elif acts:
        # Halving the batch halves what scales with it: said with what that is worth here, never
        # as "batch N fits" (what the failing step would still allocate was never measured).
        room = x.room(acts // 2)
        detail += ((f" Halving batch_size={batch[2].group(1)}" if batch else " Halving the batch size")
                   + f" frees about {b(acts // 2)}" + (f", {room}." if room else "."))
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
    # A graph keeps what its nodes saved (retained graphs) and the leaves it accumulates into, which
    # keep their roles: an earlier model's parameters and gradients once its name was rebound, a
    # user's tensor that requires grad. All of it goes with the graph.
    model_bytes = sum(h.bytes for h in graphs if h.category in ("parameters", "gradients"))
    leaf_bytes = sum(h.bytes for h in graphs if h.category == "other_tensors")
    graph_bytes = x.cat("retained_graphs") + model_bytes + leaf_bytes
    name_rx = "|".join([re.escape(n) for n in names if re.fullmatch(r"\w+", n)] + [_LOSSISH])
    accum = _accumulation(x, name_rx)
    if not (graph_bytes > 0 and graphs) and accum is None:
        return None
    own = sum(h.bytes for h in x.holders_of("variable") if h.category == "other_tensors" and h.expr in names)
    frees = (graph_bytes + own) if graphs else None
    if graphs and accum is None and not x.matters(frees):
        return None  # real, but too small to be this failure's fix
    parts = []
    if graphs:
        by_name: dict = {}
        for h in graphs:  # one row per graph: its saved activations, and a model's parameters and gradients
            by_name[h.name] = by_name.get(h.name, 0) + h.bytes
        shown = ", ".join(f"`{name}` {b(size)}" for name, size in list(by_name.items())[:3])
        room = x.room(frees)
        freed = (["the saved activations"] if x.cat("retained_graphs") else []) + (
            [f"the parameters and gradients ({b(model_bytes)}) of an earlier model that no name holds any more"]
            if model_bytes else []) + ([f"tensors that require grad ({b(leaf_bytes)}) no name holds"]
                                       if leaf_bytes else [])
        parts.append(f"Tensors from an earlier forward pass still hold their autograd graphs: {shown}. "
                     f"Deleting them frees {' and '.join(freed) or 'what the graphs keep'}"
                     + (f" (plus {b(own)} of their own data)" if own else "") + (f", {room}." if room else "."))
    if accum is not None:
        label, line = accum
        parts.append(f"{cap(label)} accumulates a tensor with its graph: `{clip(line, 60)}` keeps every "
                     "iteration's graph alive.")
    target = accum[1] if accum else None
    fixed = _detached(target, per_sample=x.find(_PER_SAMPLE) is not None) if target else None
    snippet = f"{fixed}    # a Python number: no graph\n" if fixed else ""
    if graphs and not names:
        # Only IPython keeps them (Out[N], the last traceback's locals): no variable of the user's to delete.
        keepers = "the last traceback" if any(h.frame for h in graphs) else "IPython's output cache"
        snippet += "%gpumem free    # drops the last traceback and the Out entries that hold tensors"
        fix = f"Keep numbers (.item() of a scalar) or detached tensors, and run %gpumem free to release {keepers}."
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
        frees=frees,
        confidence="certain" if graphs and x.covers(frees) is not False else "likely",
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


def _detached(line: str, per_sample: bool = False) -> Optional[str]:
    """The accumulating line rewritten to keep a number (``.item()``) or a detached tensor instead.

    ``.item()`` only for a loss (a scalar, unless the code asks for ``reduction="none"``: ``per_sample``);
    anything else may have more than one element, where ``.item()`` raises, so it is detached.
    """
    m = _ACCUM.match(line)
    if m:
        value = m.group(2).strip()
        how = ".item()" if re.fullmatch(_LOSSISH, value) and not per_sample else ".detach()"
        bare = re.fullmatch(r"[\w.]+|\(.*\)", value)  # a name, or already in parentheses
        return f"{m.group(1)} += {value}{how}" if bare else f"{m.group(1)} += ({value}){how}"
    m = _APPEND.match(line)
    if m:
        item = m.group(2).strip()
        how = ".item()" if re.fullmatch(_LOSSISH, item) and not per_sample else ".detach()"
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
    # What the step needs is the whole state, not what existed when it failed: Adam's first step makes its two
    # buffers one parameter at a time, so a failure there finds part of them. Each trainable parameter (one
    # with a gradient) gets its buffers.
    buffers = 2 if two else (1 if opt in _ONE_BUFFER else None)
    trainable = x.cat("gradients") or params
    needed = max(state_bytes, buffers * trainable) if in_step and buffers and trainable else state_bytes
    partial = in_step and needed > state_bytes
    if needed:
        title = (f"{name} keeps two buffers the size of the weights: {b(needed)}" if two
                 else f"{name}'s state holds {b(needed)}")
        if partial:
            title = (f"{name}'s state needs two buffers the size of the weights: {b(needed)}" if two
                     else f"{name}'s state needs {b(needed)}")
    else:
        title = f"Out of memory inside the optimizer step ({where(x.phase_frame)})"
    detail = ""
    if needed and trainable:
        detail = (f"Optimizer state is {b(needed)}, {needed / trainable:.1f}x the {b(trainable)} of "
                  + ("parameters with gradients" if x.cat("gradients") else "parameters")
                  + (" (exp_avg and exp_avg_sq per weight)." if two else "."))
        if partial:
            detail += (f" {b(state_bytes)} of it existed when the step failed: the first step makes it one parameter "
                       "at a time.")
        footprint = params + x.cat("gradients") + needed
        total = x.memory.total
        if total and footprint * 100 >= total:
            detail += (f" Weights + gradients + optimizer state take {b(footprint)}, "
                       f"{pct(footprint, total)} of the {b(total)} {x.device_label if x.is_host else 'device'}, "
                       "before any activation.")
    state_bytes = needed
    if in_step:
        detail += (f" The allocation failed in {where(x.phase_frame)}"
                   + (f" while allocating {b(x.requested)}" if x.requested else "") + _step_temporaries(x))
    # Each change offered must bear on this failure: less state only when the state is a size that
    # matters here; foreach=False only when the step may be the foreach one (a single-tensor step
    # already makes its temporaries one parameter at a time).
    # 8-bit Adam keeps 2 of Adam's 8 bytes per weight; other optimizers: about half, a guess.
    frees = state_bytes * 3 // 4 if two and state_bytes else (state_bytes // 2 if state_bytes else None)
    smaller_state = x.matters(frees) if state_bytes else x.who is None
    temporaries = in_step and _step_impl(x) not in ("single", "fused")
    if not smaller_state and not temporaries:
        return None
    args = _optimizer_args(x)
    ctor = f"torch.optim.{opt if opt in _OPTIM_BY_FILE.values() else 'Adam'}({args}, foreach=False)"
    no_temps = "pass foreach=False (fused=True on CUDA) to avoid the step's temporary copies for all parameters at once"
    if smaller_state and (two or opt is None):
        fix = ("Use an optimizer with less state (8-bit Adam keeps 2 bytes per weight instead of 8; SGD with "
               "momentum one buffer, without momentum none)" + (f", or {no_temps}." if temporaries else "."))
        snippet = ("import bitsandbytes as bnb          # pip install bitsandbytes\n"
                   f"optimizer = bnb.optim.Adam8bit({args})\n"
                   "# or one buffer per weight:  torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)"
                   + (f"\n# or no step temporaries:   {ctor}" if temporaries else ""))
    elif smaller_state:
        fix = ("Use less optimizer state (without momentum SGD keeps none)"
               + (f", or {no_temps}." if temporaries else "."))
        snippet = f"optimizer = {ctor}" if temporaries else \
            "optimizer = torch.optim.SGD(model.parameters(), lr=0.01)   # no momentum: no state"
    else:
        fix = no_temps[0].upper() + no_temps[1:] + ": the state itself is too small to be the fix."
        snippet = f"optimizer = {ctor}"
        frees = None
    confident = in_step and (state_bytes > 0 or opt is not None)
    return Finding("optimizer_state", title, detail.strip() or f"{name} allocates in its step.", fix, snippet,
                   frees, "certain" if confident else "likely")


def _step_impl(x: Facts) -> Optional[str]:
    """``"foreach"``, ``"fused"`` or ``"single"``: the optimizer step's implementation, as the frames show it;
    None when unknown."""
    funcs = " ".join(f[1] + " " + f[2] for f in x.frames)
    if "_fused_" in funcs:
        return "fused"
    if "_multi_tensor_" in funcs or "_foreach_" in funcs:
        return "foreach"
    if "_single_tensor_" in funcs or any(f[0].endswith("_functional.py") for f in x.frames):
        return "single"
    return None


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
    impl = _step_impl(x)
    if impl == "foreach":
        return ("; the foreach implementation allocates per-parameter temporaries for all parameters at "
                "once (foreach=False does one parameter at a time).")
    if impl == "single":
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
    if not x.matters(grads if x.who is not None else None):
        return None  # who() counted the gradients: too few to be this failure's fix
    names = [h.name for h in x.holders if h.category == "gradients"][:3]
    parts = []
    if held:
        room = x.room(grads)
        parts.append(f"{b(grads)} of gradients ({', '.join(f'`{n}`' for n in names) or 'parameters'}) are "
                     "still allocated at the failure, outside backward and the optimizer step"
                     + (f"; freeing them is {room}." if room else "."))
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
    """What is known about the batch that fits, from an earlier estimate or run of this cell; else the command that would know.

    Nothing runs: the numbers come from ``oom.batch`` (an earlier ``%%gpumem --estimate`` of this
    cell, earlier runs, this run's own measurement). A batch size is named only from an estimate of
    this very text, which covers the whole step, by scaling its activations linearly ("about").
    """
    known = x.batch
    if known is None:
        return None
    history = _batch_history(x, known)
    p = known.predicted
    if p is not None and p.capacity is not None:
        return _from_estimate(x, known, history)
    if known.earlier is not None and known.earlier.same_code and known.start is not None \
            and known.earlier.start is not None and known.start - known.earlier.start > 0 \
            and x.matters(known.start - known.earlier.start):
        grew = known.start - known.earlier.start
        return Finding(
            "batch_size", f"The same cell ran at {known.earlier.record.label}; this run started {b(grew)} higher",
            " ".join(history) + " " + _ask(x, known),
            f"Free what is held now that was not then ({b(grew)}; the tables above name it), or restart and run "
            "only the cells you need, then run this cell again.",
            "%gpumem who    # what holds the memory now", grew, "likely")
    if x.phase == "step":
        return None  # the update's need does not shrink with the batch: its activations are already freed
    training = x.phase in ("forward", "backward") or BACKWARD_CALL.search(x.failing_source or "")
    # A request larger than the whole device has its own finding, which says how far the batch must
    # shrink; the command is added only to what is known about this cell.
    impossible = bool(x.requested and x.memory.total and x.requested > x.memory.total)
    if not (training or known.size or history) or (impossible and not history):
        return None
    until = "its peak allocated is below what the host has available" if x.is_host else \
        "the verdict says it fits"
    return Finding(
        "batch_size", f"Find the batch that fits before running it again: {known.line}",
        " ".join(history + ["Nothing recorded says how much this cell needs at a smaller batch." if not history
                            else "How much a smaller batch needs is not known from these."]) + " " + _ask(x, known),
        f"Put `{known.line}` as the cell's first line, lower the batch until {until}, then remove the line and run "
        "the cell.",
        f"{known.line}\n# ... the failing cell's code, with a smaller batch"
        + (f"\n# or: {known.call}" if known.call else ""), None, "possible")


def _ask(x: Facts, known) -> str:
    """The command that would know, and that it runs only when the user runs it."""
    verdict = ("what its tensors need, to set against the host's RAM" if x.is_host else
               "and whether it fits")
    text = (f"`{known.line}` as the cell's first line works out its peak line by line on fake tensors, {verdict}, "
            "when you run it")
    if known.call:
        text += f"; `{known.call}` searches the largest batch that fits"
    return text + "."


def _batch_history(x: Facts, known) -> list:
    """Sentences on what earlier runs of this cell and this run's own measurement say."""
    out = []
    p, e, m = known.predicted, known.earlier, known.measured
    if p is not None and p.capacity is None:
        out.append(f"An earlier `{known.line}` of this cell predicted {b(p.needed)} for {p.device}, which does not "
                   f"answer for {x.device_label}.")
    if e is not None:
        rose = f"rose {'at least ' if e.sampled else ''}{b(e.peak)}" + (f" above its start of {b(e.start)}"
                                                                         if e.start is not None else "")
        if e.same_code:
            text = f"The same code ran without error at {e.record.label}: it {rose}."
            if known.start is not None and e.start is not None:
                grew = known.start - e.start
                text += (f" This run started from {b(known.start)}, {b(grew)} more: what changed is what was held "
                         "before it" + ("" if known.pinned else ", if its inputs are the same size") + "."
                         if grew > 0 else
                         f" This run started from {b(known.start)}, no higher: the cell itself needed more this time"
                         + ("." if known.pinned else " (larger inputs, or a batch read from a variable)."))
        else:
            text = (f"The same code with batch_size = {e.size} ran without error at {e.record.label}: it {rose}"
                    + (f"; this run asks for batch {known.size}." if known.size else "."))
        out.append(text)
    if m is not None:
        out.append(f"This run had kept {b(m.activations)} of activations {m.where} (measured), the part that grows "
                   "with the batch; it failed before the rest of the step ran, so what the whole step needs is not "
                   "measured.")
    return out


def _accumulate(size: int, best: int) -> str:
    """How to keep the effective batch ``size`` with batches of at most ``best``: ``k`` equal batches
    whose sizes multiply back to exactly ``size`` (24 twice is 48, not 32)."""
    part = next(d for d in range(best, 0, -1) if size % d == 0)
    if part == best:
        return f" (accumulate gradients over {size // best} batches to keep the effective size {size})."
    return (f"; to keep the effective size {size}, use {part} and accumulate gradients over {size // part} batches "
            f"({size // part} x {part} = {size}).")


def _from_estimate(x: Facts, known, history) -> Finding:
    """The finding from an earlier ``%%gpumem --estimate`` of this cell set against the failing device."""
    p, size, line = known.predicted, known.size, known.line
    at = f" at batch {size}" if size and known.pinned else ""
    basis = (f"An earlier `{line}` of this cell predicted {b(p.needed)}{at}"
             + (f", of which {b(p.activations)} activations at its peak" if p.activations else "")
             + f"; there is {b(p.capacity)} for it ({p.capacity_from})")
    tail = (" " + " ".join(history)) if history else ""
    check = f"{line}   # as the cell's first line: estimates it again without running it"
    if p.fits:
        return Finding(
            "batch_size", f"The estimate of this cell said it fits: {b(p.needed)} of {b(p.capacity)}",
            basis + ". As far as the estimate sees, the batch is not what ran out: memory it does not count was held "
                    "(the tables above), or the inputs changed since it was made." + tail,
            "Free what the other findings name; if the inputs changed since the estimate, estimate the cell again.",
            check, None, "possible")
    share = p.share
    if share is None:
        return Finding(
            "batch_size", f"The estimate of this cell predicted {b(p.needed)}, more than the {b(p.capacity)} there is",
            basis + ". It does not say how much of that grows with the batch." + tail + " " + _ask(x, known),
            "Lower the batch and estimate the cell again before running it.", check, p.needed - p.capacity, "likely")
    if share <= 0 or (size and known.pinned and known.best == 0):
        return Finding(
            "batch_size", f"Not even a batch of 1 fits: {b(p.fixed)} does not grow with the batch",
            basis + f". Without its activations the step still needs {b(p.fixed)} (parameters, gradients, optimizer "
                    f"state, fixed costs), more than the {b(p.capacity)}: no batch size makes it fit." + tail,
            "Shrink what does not grow with the batch first: mixed precision, an optimizer with less state (8-bit "
            "Adam), or a smaller model; estimate each change before running it.", check, None, "likely")
    training = bool(BACKWARD_CALL.search(x.failing_source or ""))
    if known.best is not None and size:
        best = known.best
        need = p.needed_at(best, size)
        detail = (basis + f". Activations grow about linearly with the batch and the rest does not, so at batch "
                  f"{best} the step needs about {b(need)}." + tail)
        fix = f"Use a batch of {best}" + (_accumulate(size, best) if training else ".")
        snippet = f"batch_size = {best}   # was {size}: about {b(need)} of {b(p.capacity)}\n# check first: {check}"
        return Finding("batch_size", f"Batch {best} should fit, with about {b(p.capacity - need)} to spare "
                       f"(batch {size} needs {b(p.needed)})", detail, fix, snippet, p.needed - need, "likely")
    then = ""
    if size:
        then = (f" ({known.size_from} now: if it was the same when estimated, about batch {p.fits_at(size)})")
    return Finding(
        "batch_size", f"The batch must shrink to about {share:.0%} of the one estimated",
        basis + f". Activations grow about linearly with the batch and the rest does not, so the step should fit at "
                f"about {share:.0%} of the batch it was estimated at{then}. The cell's text does not state its batch "
                "size, so which batch the estimate saw is not known here." + tail,
        f"Lower the batch to about {share:.0%} of what the estimate saw, and estimate the cell again before "
        "running it.",
        check, None, "possible")


RULES = (activations, graphs_kept, optimizer_state, gradients, batch_size)
