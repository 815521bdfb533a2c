"""Say in one sentence, in the user's names, why a line or a cell changed memory: which role moved, whose, and by what mechanism.

The input is a census change (``{(device, role, owner): bytes}``) with the snapshots around it;
the output names the user's objects (``model``, ``optimizer``, ``output``) and the mechanism torch
uses: gradients appear on the first backward and after ``zero_grad(set_to_none=True)`` freed them,
Adam-like optimizers create their state on the first step, autograd keeps activations until
backward runs or the outputs are deleted.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

from ..core.roles import ROLE_WORDS
from ..core.units import format_bytes, format_delta

__all__ = ["describe", "headline", "MIN_BYTES"]

_TEMPORARIES = " temporaries at the peak"

#: Changes smaller than this are not worth a clause (a loss scalar, a step counter).
MIN_BYTES = 64 * 1024

# What each optimizer keeps per parameter (torch.optim's state names), for the sentence.
_STATE_WORDS = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
                "sum", "grad_avg", "mu_product", "prev", "step_size", "ax", "eta", "exp_inf"}


def _names(owners, limit: int = 3) -> str:
    """`a`, `b`, `c`, 2 more: a dict of owners is named biggest first."""
    if isinstance(owners, dict):
        owners = sorted(owners, key=lambda o: -abs(owners[o]))
    owners = [o for o in owners if o]
    shown = [f"`{o}`" if not o.startswith("(") else o for o in owners[:limit]]
    if len(owners) > limit:
        shown.append(f"{len(owners) - limit} more")
    return ", ".join(shown)


def _by_role(parts: Mapping[Tuple[str, str, str], int]) -> Dict[str, Dict[str, int]]:
    out: Dict[str, Dict[str, int]] = {}
    for (_dev, role, owner), value in parts.items():
        row = out.setdefault(role, {})
        row[owner] = row.get(owner, 0) + value
    return out


def _owner_module(owner: str) -> str:
    # "opt's parameters" (parameters only an optimizer still reaches) -> "opt"
    return owner[: -len("'s parameters")] if owner.endswith("'s parameters") else owner


def describe(parts: Mapping[Tuple[str, str, str], int], before=None, after=None, *, temporaries: Optional[int] = None,
             seen: Optional[set] = None, extra: Optional[Mapping[str, int]] = None,
             minimum: int = MIN_BYTES) -> Optional[str]:
    """The sentence for one change, or None when nothing moved by ``minimum`` bytes.

    Args:
        parts: the change, ``{(device, role, owner): signed bytes}``.
        before, after: the census snapshots around it (``Snapshot``; their ``info`` names an
            optimizer's class and state, a module's parameter bytes); either may be None.
        temporaries: bytes that came and went within the span (its peak above its start and end).
        seen: ``(role, owner)`` pairs that held memory earlier (so gradients that appear again
            were re-made, not created by a first backward; optimizer state already existed).
        extra: GPU-only roles (``allocator_cache``, ``outside_pytorch``) and unnamed tensors
            (``other_tensors``), signed bytes.
    """
    seen = seen or set()
    info = {}
    for snap in (after, before):  # the later snapshot knows the optimizer's state names
        if snap is not None:
            for owner, data in snap.info.items():
                info.setdefault(owner, data)
    roles = _by_role(parts)
    clauses: List[Tuple[int, str]] = []

    def total(role):
        return sum(roles.get(role, {}).values())

    # Gradients.
    grads = roles.get("gradients", {})
    made = {o: v for o, v in grads.items() if v >= minimum}
    freed = {o: v for o, v in grads.items() if v <= -minimum}
    if made:
        size = sum(made.values())
        params = sum(info.get(_owner_module(o), {}).get("parameters", 0) for o in made)
        of = f" for {_names(made)}'s {format_bytes(params)} of parameters" if params else f" for {_names(made)}"
        if any(("gradients", o) in seen for o in made):
            why = "re-made after zero_grad(set_to_none=True) freed them"
        else:
            why = "first backward; zero_grad(set_to_none=True) frees them between steps"
        clauses.append((size, f"{format_delta(size)} gradients{of} ({why})"))
    if freed:
        size = sum(freed.values())
        clauses.append((size, f"{format_delta(size)} gradients of {_names(freed)} freed (zero_grad(set_to_none=True) "
                              "or deleting the model)"))
    # Optimizer state.
    for owner, value in roles.get("optimizer_state", {}).items():
        if abs(value) < minimum:
            continue
        data = info.get(owner, {})
        cls = data.get("class", "optimizer")
        keys = [k for k in data.get("state", []) if k != "step"]
        what = f"{cls} state ({', '.join(keys)})" if keys else f"{cls} state"
        if value > 0:
            params = data.get("parameters", 0)
            of = f" for {format_bytes(params)} of parameters" if params else ""
            when = ("" if ("optimizer_state", owner) in seen
                    else ", created on the first step")
            clauses.append((value, f"{format_delta(value)} {what} in `{owner}`{of}{when}"))
        else:
            clauses.append((value, f"{format_delta(value)} {what} in `{owner}` released"))
    # Activations.
    acts = roles.get("activations", {})
    kept = {o: v for o, v in acts.items() if v >= minimum}
    gone = sum(v for v in acts.values() if v < 0)
    if kept:
        size = sum(kept.values())
        clauses.append((size, f"{format_delta(size)} activations saved for backward, kept by {_names(kept)}"))
    if gone <= -minimum:
        clauses.append((gone, f"{format_delta(gone)} activations released"))
    # Parameters.
    for owner, value in roles.get("parameters", {}).items():
        if abs(value) < minimum:
            continue
        name = _owner_module(owner)
        cls = info.get(name, {}).get("class") if info.get(name, {}).get("kind") == "module" else None
        label = f"`{name}`" + (f" ({cls})" if cls else "")
        clauses.append((value, f"{format_delta(value)} parameters of {label}"))
    # Other tensors held by names.
    others = {o: v for o, v in roles.get("other_tensors", {}).items() if abs(v) >= minimum}
    if others:
        up = {o: v for o, v in others.items() if v > 0}
        down = {o: v for o, v in others.items() if v < 0}
        if up:
            clauses.append((sum(up.values()), f"{format_delta(sum(up.values()))} tensors held by {_names(up)}"))
        if down:
            clauses.append((sum(down.values()), f"{format_delta(sum(down.values()))} released from {_names(down)}"))
    for role, value in (extra or {}).items():
        if abs(value) < minimum:
            continue
        if role == "other_tensors":
            text = "tensors no name reaches (held inside functions, C++ or closures)"
        else:
            text = ROLE_WORDS.get(role, role)
        clauses.append((value, f"{format_delta(value)} {text}"))
    if temporaries is not None and temporaries >= minimum:
        clauses.append((temporaries, f"{format_delta(temporaries)}{_TEMPORARIES}"))
    if not clauses:
        return None
    clauses.sort(key=lambda c: -abs(c[0]))
    return "; ".join(text for _, text in clauses)


def headline(reason: Optional[str], count: int = 2) -> Optional[str]:
    """The first ``count`` clauses of a :func:`describe` sentence (its biggest changes)."""
    if not reason:
        return None
    # The roles, not what came and went: a cell's line names what it kept.
    clauses = [c for c in reason.split("; ") if not c.endswith(_TEMPORARIES)] or reason.split("; ")
    return "; ".join(clauses[:count]) + ("; …" if len(clauses) > count else "")

