"""The sentences made from the records' data: why a cell or line moved memory, why a re-run kept it, what a rank hid.

Records keep :class:`~ipy_gpumem.core.why.Why` and :class:`~ipy_gpumem.core.why.Rerun` values
and plain fields (numbers and names); these functions turn them into the words the views show,
each time they are shown, and ``to_dict()`` never calls them. A view asks for the clauses it wants
(:func:`headline` picks the biggest), so nothing ever splits a sentence back into its parts. The
words name the user's objects (``model``, ``optimizer``, ``output``) and the mechanism torch uses:
gradients appear on the first backward and after ``zero_grad(set_to_none=True)`` freed them,
Adam-like optimizers create their state on the first step, autograd keeps activations until
backward runs or the outputs are deleted.
"""
from __future__ import annotations

from typing import Iterable, List, NamedTuple, Optional

from ..core.roles import ROLE_WORDS, ROLES
from ..core.text import clip
from ..core.units import format_bytes, format_delta
from ..core.why import Rerun, Suspect, Why, owner_module

__all__ = ["Clause", "clauses", "sentence", "headline", "line_sentence", "cell_reason", "line_reason",
           "rerun_warning", "cause", "causes", "MIN_BYTES", "rank_note"]

#: Changes smaller than this are not worth a clause (a loss scalar, a step counter).
MIN_BYTES = 64 * 1024


class Clause(NamedTuple):
    """One part of a sentence: its size (for ordering), what it is, and its words."""

    bytes: int
    kind: str  # a role, "temporaries", or an extra role ("allocator_cache", ...)
    text: str


def _names(owners, limit: int = 3) -> str:
    """`a`, `b`, `c`, 2 more: a dict of owners is named biggest first."""
    if isinstance(owners, dict):
        owners = sorted(owners, key=lambda o: -abs(owners[o]))
    owners = [o for o in owners if o]
    shown = [f"`{o}`" if not o.startswith("(") else o for o in owners[:limit]]
    if len(owners) > limit:
        shown.append(f"{len(owners) - limit} more")
    return ", ".join(shown)


def _and(items: List[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _role_sizes(pairs) -> str:
    """``parameters (32.06 MiB) and gradients (32.06 MiB)``, in the one role order."""
    pairs = sorted(pairs, key=lambda p: ROLES.index(p[0]) if p[0] in ROLES else len(ROLES))
    return _and([f"{ROLE_WORDS.get(role, role)} ({format_bytes(abs(size))})" for role, size in pairs])


def _keepers(why: Why, owner: str) -> List[str]:
    """The names that keep the graph ``owner`` holds (``owner`` first)."""
    return [n for n in why.graphs.get(owner, (owner,)) if n] or [owner]


def _ticked_and(names: List[str]) -> str:
    return _and([f"`{n}`" for n in names])


def _moved_clauses(why: Why, minimum: int) -> List[Clause]:
    """A model (or optimizer) whose name was rebound or deleted and that stays alive because an
    autograd graph keeps it: the common notebook leak, said with the names that keep it and the
    ``del`` that frees it. Nothing was allocated or freed."""
    groups: dict = {}
    for m in why.moved:
        groups.setdefault((m.source, m.holder, m.rebound), []).append((m.role, m.bytes))
    out = []
    for (source, holder, rebound), pairs in groups.items():
        size = sum(b for _r, b in pairs)
        if size < minimum:
            continue
        keepers = _keepers(why, holder)
        which = f"the old `{source}`" if rebound else f"`{source}` (deleted)"
        hold = "holds" if len(keepers) == 1 else "hold"
        text = (f"{which} stays alive, its {_role_sizes(pairs)}: {_ticked_and(keepers)} still {hold} the "
                f"autograd graph of its last forward, which keeps them (a common notebook leak; "
                f"`del {', '.join(keepers)}` frees them)")
        out.append(Clause(size, "kept_alive", text))
    return out


def _graph_held_clauses(why: Why, roles: dict, minimum: int) -> List[Clause]:
    """Parameters and gradients that only a graph keeps (their model's name is gone), appearing or
    released with that graph; taken out of ``roles`` so no other clause names them again."""
    by_owner: dict = {}
    for role, owners in roles.items():
        for owner, value in list(owners.items()):
            if (role, owner) in why.graph_held and value:
                by_owner.setdefault(owner, []).append((role, value))
                del owners[owner]
    out = []
    for owner, pairs in by_owner.items():
        for sign in (1, -1):
            mine = [(r, v) for r, v in pairs if v * sign > 0]
            size = sum(v for _r, v in mine)
            if abs(size) < minimum:
                continue
            keepers = _ticked_and(_keepers(why, owner))
            if sign < 0:
                text = (f"{format_delta(size)} released: the {_role_sizes(mine)} of a model no name held, which "
                        f"the autograd graph of {keepers} kept until now")
            else:
                text = (f"{format_delta(size)} {_role_sizes(mine)} of a model no name holds, kept alive by the "
                        f"autograd graph of {keepers} (`del {', '.join(_keepers(why, owner))}` frees them)")
            out.append(Clause(size, mine[0][0], text))
    return out


#: A cell must import at least this many modules for its untensored host memory to be put down to them
#: (one import of a small module is not where tens of MiB went).
MIN_IMPORTED = 20
#: ...and gain at least this much: a traceback's display importing a few dozen small modules is no news.
MIN_IMPORTED_BYTES = 8 * 2**20


def _imports_clause(why: Why, minimum: int) -> Optional[Clause]:
    """Host memory no tensor explains, in a cell that imported many modules (the first optimizer
    imports some 800: torch._dynamo, sympy...)."""
    imports = why.imports
    if imports is None or imports.untensored is None or imports.untensored < max(minimum, MIN_IMPORTED_BYTES) \
            or imports.modules < MIN_IMPORTED:
        return None
    packages = ", ".join(f"{name} {count:,}" for name, count in imports.packages)
    if packages and sum(c for _n, c in imports.packages) < imports.modules:
        packages += ", …"
    which = f" ({packages})" if packages else ""
    return Clause(imports.untensored, "imports",
                  f"{format_delta(imports.untensored)} host RSS that no tensor explains: this cell imported "
                  f"{imports.modules:,} modules{which}, whose code and data stay loaded")


def clauses(why: Optional[Why], minimum: int = MIN_BYTES) -> List[Clause]:
    """The clauses of ``why``, biggest |bytes| first (those under ``minimum`` left out)."""
    if why is None:
        return []
    info = why.owners
    before = why.owners_before  # what a rebound name was: a release is named by it
    seen = why.seen
    roles = why.by_role()
    out: List[Clause] = []

    # Storages that only changed hands were neither allocated nor freed: said once, and taken out
    # of their old owner's loss and their new owner's gain.
    for m in why.moved:
        row = roles.setdefault(m.role, {})
        row[m.source] = row.get(m.source, 0) + m.bytes
        row[m.holder] = row.get(m.holder, 0) - m.bytes
    out.extend(_moved_clauses(why, minimum))
    out.extend(_graph_held_clauses(why, roles, minimum))

    grads = roles.get("gradients", {})
    made = {o: v for o, v in grads.items() if v >= minimum}
    freed = {o: v for o, v in grads.items() if v <= -minimum}
    if made:
        size = sum(made.values())
        params = sum(getattr(info.get(owner_module(o)), "parameters", 0) for o in made)
        of = f" for {_names(made)}'s {format_bytes(params)} of parameters" if params else f" for {_names(made)}"
        if any(("gradients", o) in seen for o in made):
            mechanism = "re-made after zero_grad(set_to_none=True) freed them"
        else:
            mechanism = "first backward; zero_grad(set_to_none=True) frees them between steps"
        out.append(Clause(size, "gradients", f"{format_delta(size)} gradients{of} ({mechanism})"))
    if freed:
        size = sum(freed.values())
        out.append(Clause(size, "gradients", f"{format_delta(size)} gradients of {_names(freed)} freed "
                                             "(zero_grad(set_to_none=True) or deleting the model)"))
    for owner, value in roles.get("optimizer_state", {}).items():
        if abs(value) < minimum:
            continue
        data = before.get(owner) if value < 0 and owner in before else info.get(owner)
        cls = (data.cls if data is not None else None) or "optimizer"
        keys = [k for k in (data.state if data is not None else ()) if k != "step"]
        what = f"{cls} state ({', '.join(keys)})" if keys else f"{cls} state"
        if value > 0:
            params = data.parameters if data is not None else 0
            of = f" for {format_bytes(params)} of parameters" if params else ""
            when = "" if ("optimizer_state", owner) in seen else ", created on the first step"
            out.append(Clause(value, "optimizer_state", f"{format_delta(value)} {what} in `{owner}`{of}{when}"))
        else:
            # A rebound name: the state released was the old optimizer's, not the one the name holds now.
            now = info.get(owner) if owner in before else None
            rebound = f" (`{owner}` is now {now.cls})" if now is not None and now.cls else ""
            out.append(Clause(value, "optimizer_state", f"{format_delta(value)} {what} in `{owner}` released{rebound}"))
    acts = roles.get("activations", {})
    kept = {o: v for o, v in acts.items() if v >= minimum}
    gone = sum(v for v in acts.values() if v < 0)
    if kept:
        size = sum(kept.values())
        text = f"{format_delta(size)} activations saved for backward, kept by {_names(kept)}"
        if why.whole_cell and not any(roles.get("gradients", {}).values()):
            # What a cell keeps saved is what no backward consumed (backward frees it), and no gradient
            # moved: the forwards of an evaluation, which need no graph at all.
            text += ("; no backward used them: an evaluation under `with torch.no_grad():` (or "
                     "`torch.inference_mode()`) keeps none")
        out.append(Clause(size, "activations", text))
    if gone <= -minimum:
        # Whose: the variables whose graphs saved them (backward freed them, or the names were rebound).
        owners = {o: v for o, v in acts.items() if v < 0}
        out.append(Clause(gone, "activations", f"{format_delta(gone)} activations released (saved in the graph of "
                                               f"{_names(owners)})"))
    for owner, value in roles.get("parameters", {}).items():
        if abs(value) < minimum:
            continue
        name = owner_module(owner)
        data = before.get(name) if value < 0 and name in before else info.get(name)
        cls = data.cls if data is not None and data.kind == "module" else None
        label = f"`{name}`" + (f" ({cls})" if cls else "")
        out.append(Clause(value, "parameters", f"{format_delta(value)} parameters of {label}"))
    others = {o: v for o, v in roles.get("other_tensors", {}).items() if abs(v) >= minimum}
    up = {o: v for o, v in others.items() if v > 0}
    down = {o: v for o, v in others.items() if v < 0}
    if up:
        out.append(Clause(sum(up.values()), "other_tensors",
                          f"{format_delta(sum(up.values()))} tensors held by {_names(up)}"))
    if down:
        out.append(Clause(sum(down.values()), "other_tensors",
                          f"{format_delta(sum(down.values()))} released from {_names(down)}"))
    for role, value in why.extra.items():
        if abs(value) < minimum:
            continue
        if role == "other_tensors":
            text = "tensors no name reaches (held inside functions, C++ or closures)"
        else:
            text = ROLE_WORDS.get(role, role)
        out.append(Clause(value, role, f"{format_delta(value)} {text}"))
    imports = _imports_clause(why, minimum)
    if imports is not None:
        out.append(imports)
    if why.temporaries is not None and why.temporaries >= minimum:
        out.append(Clause(why.temporaries, "temporaries", f"{format_delta(why.temporaries)} temporaries at the peak"))
    out.sort(key=lambda c: -abs(c.bytes))
    return out


def _partial(why: Why) -> str:
    """What an incomplete count says after its clauses: the amounts are what it counted."""
    left = "; ".join(why.left_out[:2]) if why.left_out else "a time budget"
    if why.left_out and not why.left_out[0].startswith("stopped"):
        return f" (at least: the count of tensors left out {clip(left, 160)})"
    return f" (at least: the count of tensors stopped early, {clip(left, 160)})"


def sentence(why: Optional[Why], minimum: int = MIN_BYTES) -> Optional[str]:
    """Every clause of ``why``, biggest first, or None when nothing moved by ``minimum`` bytes."""
    found = clauses(why, minimum)
    if not found:
        return None
    text = "; ".join(c.text for c in found)
    return text + ("" if why.complete else _partial(why))


def headline(why: Optional[Why], count: int = 2) -> Optional[str]:
    """The ``count`` biggest clauses of what the change kept (temporaries only when nothing else
    moved): the per-cell line's second line."""
    found = clauses(why)
    if not found:
        return None
    kept = [c for c in found if c.kind != "temporaries"] or found
    text = "; ".join(c.text for c in kept[:count]) + ("; …" if len(kept) > count else "")
    return text + ("" if why.complete else " (at least)")


def line_sentence(first: Optional[Why], last: Optional[Why] = None, hits: int = 1) -> Optional[str]:
    """A line's sentence from its first hit and, for a line run more than once, its latest hit."""
    text = sentence(first)
    if hits <= 1 or last is None:
        return text
    later = sentence(last)
    if later != text:
        return f"first hit: {text or 'nothing'}; last hit: {later or 'nothing'}"
    return None if text is None else f"each hit: {text}"


def cell_reason(record) -> Optional[str]:
    """What a cell's change is made of (a ``CellRecord``'s ``why``), in the user's names; None when
    nothing moved or the cell was not analysed."""
    return sentence(record.why)


def line_reason(line) -> Optional[str]:
    """Why a line of a ``--lines`` cell moved memory (a ``LineRecord``, or a ``JoinedLines``: lines
    counted together), from its first and latest hit; None when nothing moved."""
    return line_sentence(line.why, line.why_last, line.hits)


# -- re-runs ---------------------------------------------------------------------------------------------


def _ticks(items: Iterable[str]) -> List[str]:
    return [f"`{item}`" for item in items]


def _label(count: Optional[int]) -> str:
    return f"[{count}]" if count is not None else "[ ]"


def rerun_warning(rerun: Optional[Rerun]) -> Optional[str]:
    """``Re-run of [3] (run 2) kept 64.00 MiB more than the previous run:``, when this run names a
    suspect for the first time; else None."""
    if rerun is None or not rerun.warns or rerun.growth is None:
        return None
    return f"Re-run of {_label(rerun.of)} (run {rerun.runs}) kept {format_bytes(rerun.growth)} more than the previous run:"


def causes(rerun: Optional[Rerun], new_only: bool = False) -> List[str]:
    """The sentence of each suspect (only those named for the first time with ``new_only``)."""
    if rerun is None:
        return []
    return [cause(s) for s in rerun.suspects if s.new or not new_only]


def _hook(suspect: Suspect, size: str, lead: str) -> str:
    if suspect.hook is not None:
        module, label, count = suspect.hook
        return (f"a {label} is registered on every run (`{module}` has {count} copies of it; {lead} {size}): keep "
                "its handle and call `handle.remove()` before registering it again")
    module = suspect.name[: -len(" hook")] if suspect.name.endswith(" hook") else suspect.name
    return f"a hook on `{module}`: {lead} {size}: keep its handle and call `handle.remove()`"


def cause(s: Suspect) -> str:
    """One suspect's sentence: who holds what, and the fix, in the user's names."""
    size = format_bytes(s.bytes)
    name = s.name
    if s.kind == "output_cache":
        held = " and ".join(_ticks(s.exprs)) or "IPython's output cache"
        return f"{held} keep the displayed tensor ({size}): `%gpumem free` or end the line with `;`"
    if s.kind == "traceback":
        where = ", ".join(f"{f}()" for f in s.frames[:2])
        local = f" ({where} local {', '.join(_ticks(s.exprs[:2]))})" if where else ""
        return f"the last error's traceback holds its frames{local}, {size} from an earlier run: `%gpumem free`"
    if s.kind == "hook":
        lead = "its closure keeps" if name.endswith(" hook") else f"`{name}` gains"
        return _hook(s, size, lead)
    if s.kind == "optimizer":
        what = f"the old `{s.model}`'s parameters" if s.model else "the parameters of an earlier model"
        where = f" (built in [{s.cell}])" if s.cell is not None else ""
        fix = f"re-run [{s.cell}] after this cell" if s.fix == "rerun_cell" else f"re-create `{name}` after this cell"
        return f"`{name}`{where} still holds {what} ({size}): {fix}"
    if s.kind == "appended_graph":
        if s.fix == "append_item":  # a one-element tensor: a number is all it needs
            return (f"`{name}.append({s.item})` keeps each run's graph ({size}): append `{s.item}.item()` "
                    f"(or `{s.item}.detach()`)")
        return (f"`{name}.append({s.item})` keeps each run's graph ({size}): append `{s.item}.detach()` (a "
                f"tensor of more than one element has no `.item()`), or `{s.item}.detach().cpu()` to keep it "
                "off the device")
    if s.kind == "appended":
        return (f"`{name}` gains {size} on every run (`{name}.append({s.item})`): clear it at the top of the cell "
                f"(`{name}.clear()`) or `del` what you no longer need")
    if s.kind == "graph":
        return (f"`{name}` keeps an earlier run's graph ({size}): keep `.detach()` (or the `.item()` of a one-element "
                "tensor) instead of the tensor")
    if s.kind == "class_attribute":
        return (f"`{s.item}`, a class attribute, gains {size} on every run (it outlives the run and every "
                f"instance): clear it at the top of the cell (`{s.item}.clear()`) or keep the tensors on an instance")
    if s.kind == "module_global":
        return (f"`{s.item}`, a global of your module, gains {size} on every run: clear it at the top of the cell "
                f"(`{s.item}.clear()`)")
    if s.kind == "default_argument":
        param = s.exprs[0] if s.exprs else "the default"
        return (f"`{name}`'s default argument `{param}` is one object shared by every call, and it gains {size} on "
                f"every run: default to `{param}=None` and make a new one inside `{name}`")
    if s.kind == "closure":
        var = f" `{s.exprs[0]}`" if s.exprs else ""
        return (f"`{name}` keeps{var} in its closure, which gains {size} on every run: clear it, or re-create "
                f"`{name}` before re-running")
    if s.kind == "reassigned":
        return (f"`{name}` still holds tensors from the earlier run ({size}): `del` them before re-running, or clear "
                "it at the top of the cell")
    what = f"the earlier run's `{s.model}`" if s.model else "tensors from the earlier run"
    return f"`{name}` still holds {what} ({size}): `del {name}` (or rebind it)"


def rank_note(rank) -> Optional[str]:
    """What could not be seen of a launched process (a ``RankRecord``), and how it ended; None when
    it was recorded whole from inside."""
    parts = []
    how = f"killed by {rank.signal}" if rank.signal else (
        f"exit code {rank.exit_code}" if rank.exit_code is not None else None)
    unread = rank.end == "gone" and not rank.readings
    never_read = unread and rank.seen == "outside" and rank.host.rss_before is None  # known from the launcher only
    if rank.end == "gone" and rank.seen == "inside":
        if unread:
            parts.append(f"ended without recording its end ({how or 'killed or terminated'}) before its first "
                         "reading from outside: only its start is known")
        else:
            parts.append(f"ended without recording its end ({how or 'killed or terminated'}): its numbers after its "
                         "start are the last readings taken from outside")
    elif never_read:
        parts.append(f"ended ({how or 'killed or terminated'}) before its first reading: nothing of its memory is "
                     "known")
    elif rank.end == "gone" and how:
        parts.append(f"ended: {how}")
    elif rank.end == "running":
        parts.append("still running when the cell ended: its numbers are those of the cell's end")
    if rank.signal == "SIGKILL":
        # Nothing in the process could say why; the kernel's OOM killer sends SIGKILL when RAM runs out.
        parts.append(f"nothing in Python can catch SIGKILL: the kernel's OOM killer is the likely cause (`dmesg` or "
                     f"`journalctl -k` shows \"Out of memory: Killed process {rank.pid}\")")
    if rank.seen == "outside" and not never_read:
        if rank.devices is None:
            parts.append("not a fork of this kernel, so read from outside: host RSS and its high-water mark from "
                         "/proc; device memory not visible (no NVML reading for its pid)")
        else:
            parts.append("read from outside: device memory is NVML's per-process use (context and cache "
                         "included); torch's allocated and reserved are not visible")
    elif rank.devices_note and not rank.devices:
        parts.append(f"no CUDA device measured: {rank.devices_note}")
    return "; ".join(parts) if parts else None
