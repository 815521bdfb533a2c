"""Rules about the notebook session: IPython's own references, what earlier cells left behind, checkpoints still on the device."""
from __future__ import annotations

import re
from typing import List, Optional, Sequence

from ...core.text import cell_name, clip
from ...core.units import MiB
from .finding import Finding
from .facts import Facts, call_args, cell_deltas
from .words import b, cap, pct

__all__ = ["RULES", "checkpoint_on_gpu", "ipython_refs", "earlier_cells"]

_TORCH_LOAD = re.compile(r"\btorch\.load\s*\(")
# How people name what torch.load returned; matched against variable names, never display text.
_CKPT_NAME = re.compile(r"(?i)(?:^|[^a-z])(?:ckpt|checkpoint|state_dict|sd)(?:[^a-z]|$)"
                        r"|model_state_dict|optimizer_state_dict")
_ASSIGN = re.compile(r"([A-Za-z_]\w*)\s*=(?!=)\s*(.*)")
_NO_TENSOR = re.compile(r"[-+0-9.e_]+|['\"].*|True|False|None")


def checkpoint_on_gpu(x: Facts) -> Optional[Finding]:
    """torch.load without map_location, or a loaded checkpoint still referenced after load_state_dict."""
    loads = []
    for label, line in x.code_lines():
        for m in _TORCH_LOAD.finditer(line):
            args = call_args(line, m.end() - 1)
            if args is not None and "map_location" not in args:
                loads.append((label, line, args))
    holders = [h for h in x.holders if h.category in ("other_tensors", "ipython_caches")
               and any(_CKPT_NAME.search(name) for name in _names(h))]
    held = sum(h.bytes for h in holders)
    if x.is_host:
        # map_location="cpu" is where a host failure already is: only what the checkpoint still holds can help.
        loads = []
    if not x.matters(held or None):
        held = 0  # who() counted it: too little to be this failure's fix
    if not loads and not held:
        return None
    roots = sorted({name for h in holders for name in _names(h) if _CKPT_NAME.search(name)})
    parts = []
    if loads:
        label, line, _args = loads[0]
        parts.append(f"{cap(label)} calls `{clip(line, 70)}` without map_location: every tensor comes back on the "
                     "device it was saved from, before load_state_dict copies it again.")
    if held:
        room = x.room(held)
        parts.append(f"{', '.join(f'`{r}`' for r in roots)} still hold{'s' if len(roots) == 1 else ''} "
                     f"{b(held)} of checkpoint tensors after loading" + (f"; deleting is {room}." if room else "."))
    assigned = _ASSIGN.match(loads[0][1]) if loads else None
    var = roots[0] if roots else (assigned.group(1) if assigned else "checkpoint")
    if loads:
        _label, line, args = loads[0]
        load_line = line.replace(f"({args})", f'({args.strip()}, map_location="cpu")', 1)
    elif x.is_host:
        load_line = f"{var} = torch.load(path, mmap=True)   # read on demand, not whole (torch >= 2.1)"
    else:
        load_line = f'{var} = torch.load(path, map_location="cpu")'
    key = _state_dict_key(x, var)
    load_state = (f"model.load_state_dict({var}[{key!r}])   # copies to the model's device" if key else
                  f'model.load_state_dict({var})   # or {var}["model_state_dict"], as it was saved')
    title = (f"Checkpoint tensors still held: {b(held)}" if held
             else f"torch.load without map_location: `{clip(loads[0][1], 50)}`")
    return Finding(
        key="checkpoint_on_gpu",
        title=title,
        detail=" ".join(parts),
        fix=(f"`del {var}` once load_state_dict has copied it (load it memory-mapped next time)." if x.is_host else
             f'Load with map_location="cpu" and `del {var}` once load_state_dict has copied it.'),
        snippet=f"{load_line}\n{load_state}\ndel {var}",
        frees=held or None,
        confidence="likely" if held else "possible",
    )


def _names(h) -> Sequence[str]:
    """The variable names a holder answers to: its roots, or a traceback local's own name."""
    if h.roots:
        return h.roots
    return (h.expr,) if h.kind == "traceback_local" and h.expr else ()


def _state_dict_key(x: Facts, var: str) -> str:
    """The key the user's own code passes to load_state_dict (``ckpt["model_state_dict"]``), or ""."""
    rx = re.compile(r"load_state_dict\(\s*" + re.escape(var) + r"\[\s*(['\"])(\w+)\1\s*\]")
    hit = x.find(rx)
    return hit[2].group(2) if hit else ""


def ipython_refs(x: Facts) -> Optional[Finding]:
    """IPython's output cache and last traceback keep tensors alive after the error."""
    cached = x.cat("ipython_caches")
    if cached <= 0 or not x.matters(cached):
        return None
    rows = [h for h in x.holders if h.category == "ipython_caches"]
    shown = ", ".join(f"`{h.name}` {b(h.bytes)}" for h in rows[:3])
    return Finding(
        key="ipython_refs",
        title=f"IPython keeps {b(cached)} alive (Out cache, last traceback)",
        detail=((f"{shown}. " if shown else "") + "IPython keeps displayed results in Out/_N and the failed call's "
                "frames in sys.last_traceback, so their tensors stay allocated after the error"
                + (f"; releasing them is {x.room(cached)}." if x.room(cached) else ".")),
        fix=("Run %gpumem free: it drops the last traceback and the Out entries that hold tensors, collects the "
             "garbage and gives PyTorch's cache back to the driver. Or clear them by hand."),
        snippet="%gpumem free\n# or by hand:\n%reset -f out\nimport sys; sys.last_traceback = sys.last_value = None",
        frees=cached,
        confidence="certain",
    )


def earlier_cells(x: Facts) -> Optional[Finding]:
    """Cells before the failing one left a large share of the memory allocated."""
    rows = cell_deltas(x.earlier, x.memory)  # the failing cell is not among x.earlier
    if not rows:
        return None
    top = rows[:3]
    left = sum(d for _rec, d in top)
    whole = x.memory.process_used if x.is_host else x.memory.allocated
    # Only worth a finding when those cells explain a fifth of what is held (or 256 MiB unknown).
    if whole:
        if left < whole // 5:
            return None
    elif left < 256 * MiB:
        return None
    what = "host RSS" if x.is_host else "allocated"
    names = _release_names([rec for rec, _d in top], x)
    # What `del` of those names frees is what who() counts under them, not the cells' growth (an
    # `import torch` grows RSS that no `del` gives back): that must be a size that matters here.
    deleted = set(names[:4])  # what the snippet deletes; a holder is freed when every name reaching it goes
    freeable = sum(h.bytes for h in x.holders if h.roots and set(h.roots) <= deleted) \
        if x.who is not None and names else left
    if not x.matters(freeable):
        return None
    named = "; ".join(f"{rec.label} `{cell_name(rec.source, 40)}` +{b(d)}" for rec, d in top)
    return Finding(
        key="earlier_cells",
        title=f"Earlier cells left {b(left)} {what} behind",
        detail=(named + (f": {pct(left, whole)} of the {b(whole)} {what} at the failure." if whole else ".")
                + " What a cell creates stays allocated as long as a variable refers to it."),
        fix=("Delete what those cells created and no longer need (`del name`), or restart the kernel and rerun "
             "only the cells you need."),
        snippet=_release_snippet(names, x),
        frees=freeable,
        confidence="possible",
    )


_TRAINING = ("parameters", "gradients", "optimizer_state")


def _release_names(records: Sequence, x: Facts) -> List[str]:
    """The tensor-holding names those cells assigned (who() knows which hold tensors); in a failing optimizer
    step not the model or the optimizer it updates (only their parameters, gradients and state are held)."""
    holding = {r for h in x.holders for r in h.roots}
    if x.phase == "step":
        needed = {r for h in x.holders if h.category in _TRAINING for r in h.roots}
        other = {r for h in x.holders if h.category not in _TRAINING for r in h.roots}
        holding -= needed - other
    names: List[str] = []
    for rec in records:
        for line in (rec.source or "").splitlines():
            m = _ASSIGN.match(line)  # top-level assignments only
            if not m or m.group(1) in names:
                continue
            if holding and m.group(1) not in holding:
                continue  # who() knows which names hold tensors
            if not holding and _NO_TENSOR.fullmatch(m.group(2).strip()):
                continue  # a number or a string holds no device memory
            names.append(m.group(1))
    return names


def _release_snippet(names: Sequence[str], x: Facts) -> str:
    """``del`` of those names, or a pointer to who() when none is known."""
    if not names:
        return "%gpumem who   # which variables hold the memory"
    tail = "" if x.is_host else "\ntorch.cuda.empty_cache()   # give the cached blocks back"
    return f"del {', '.join(names[:4])}   # only what you no longer need\nimport gc; gc.collect(){tail}"


RULES = (checkpoint_on_gpu, ipython_refs, earlier_cells)
