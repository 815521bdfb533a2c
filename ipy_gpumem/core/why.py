"""Why memory moved, as typed data: what a change is made of (:class:`Why`) and what keeps a re-run's memory (:class:`Rerun`).

Records keep these values, never sentences: the sentence a view shows (why a cell moved memory,
the re-run warning) is made from them when it is shown, by ``ipy_gpumem.display.words``, so a view
never has to split a sentence back into its parts, and an API user reads the numbers themselves
(``to_dict()``). Everything here is numbers, names and plain strings: no tensor, module or frame
is held.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Mapping, NamedTuple, Optional, Tuple

__all__ = ["Why", "OwnerInfo", "Moved", "Imports", "Suspect", "Rerun", "owner_module", "SUSPECT_KINDS",
           "SUSPECT_FIXES"]

#: How a suspect holds an earlier run's tensors (``Suspect.kind``).
SUSPECT_KINDS = ("output_cache", "traceback", "hook", "optimizer", "appended_graph", "appended", "graph", "reassigned",
                 "class_attribute", "module_global", "default_argument", "closure", "variable")
#: What frees them (``Suspect.fix``).
SUSPECT_FIXES = ("free_or_semicolon", "free", "remove_handle", "rerun_cell", "recreate", "append_item",
                 "append_detached", "clear_or_del", "detach", "del_before_rerun", "clear", "default_none", "del")


def owner_module(owner: str) -> str:
    """The name whose info describes ``owner``: ``"opt's parameters"`` (parameters only an optimizer
    still reaches, its model's name rebound) is described by ``opt``."""
    return owner[: -len("'s parameters")] if owner.endswith("'s parameters") else owner


class OwnerInfo(NamedTuple):
    """What a census knew about one owner: a module (its class, its parameter bytes) or an optimizer
    (its class, its state's names, the bytes of the parameters it steps)."""

    kind: str
    cls: Optional[str] = None
    parameters: int = 0
    state: Tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"kind": self.kind, "class": self.cls, "parameters": self.parameters, "state": list(self.state)}


class Moved(NamedTuple):
    """Storages that stayed alive through a change and went from a name to an autograd graph, in
    one role: the old ``model``'s parameters, now kept by the graph ``output`` holds. Nothing was
    allocated or freed: only who keeps them changed.

    ``rebound``: the old owner's name still holds something else (``model`` was rebound, not deleted).
    """

    role: str
    source: str
    holder: str
    bytes: int
    rebound: bool = False

    def to_dict(self) -> dict:
        return self._asdict()


class Imports(NamedTuple):
    """The modules a cell imported (from ``sys.modules`` before and after it), and the host memory
    its line has beyond what tensors explain (None where it cannot be told: a GPU's line)."""

    modules: int
    packages: Tuple[Tuple[str, int], ...] = ()  # the top-level packages with the most new modules, most first
    untensored: Optional[int] = None

    def to_dict(self) -> dict:
        return {"modules": self.modules, "packages": [list(p) for p in self.packages], "untensored": self.untensored}


@dataclass(frozen=True)
class Why:
    """What one change (a cell, a line, lines counted together) is made of.

    Attributes:
        parts: ``((device, role, owner, signed bytes), ...)``: the census's change, part by part.
        owners: ``{name: OwnerInfo}`` for the modules and optimizers among the owners.
        seen: ``(role, owner)`` pairs that held memory before the change (gradients that appear again
            were re-made, not created by a first backward; optimizer state already existed).
        temporaries: bytes that came and went within the span (its peak above its start and end).
        extra: the GPU-only roles (``allocator_cache``, ``outside_pytorch``) and tensors no name
            reaches (``other_tensors``), signed bytes summed over the devices.
        complete: both censuses examined everything; False: the parts are what they counted, and
            ``left_out`` says what they did not examine.
        moved: :class:`Moved` entries: storages alive at both ends that went from a name to a graph
            (their parts appear as a loss for one owner and a gain for the other, which is no
            allocation).
        graph_held: ``(role, owner)`` pairs, other than activations, that only an autograd graph
            kept at either end (an old model's parameters and gradients held by ``loss``).
        graphs: for the owners of those pairs, every variable that keeps the graph (owner first).
        owners_before: what an owner was before the change where that differs from ``owners``
            (``optimizer`` was an Adam and is now an SGD): a release is named by what it was.
        whole_cell: this is a cell's change (not a line's): what it kept at its end is what it
            leaves behind (activations no backward consumed, in an evaluation without no_grad).
        imports: the modules the cell imported, when it imported some (:class:`Imports`).
    """

    parts: Tuple[Tuple[str, str, str, int], ...] = ()
    owners: Mapping[str, OwnerInfo] = field(default_factory=dict)
    seen: FrozenSet[Tuple[str, str]] = frozenset()
    temporaries: Optional[int] = None
    extra: Mapping[str, int] = field(default_factory=dict)
    complete: bool = True
    left_out: Tuple[str, ...] = ()
    moved: Tuple[Moved, ...] = ()
    graph_held: FrozenSet[Tuple[str, str]] = frozenset()
    graphs: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)
    owners_before: Mapping[str, OwnerInfo] = field(default_factory=dict)
    whole_cell: bool = False
    imports: Optional[Imports] = None

    def by_role(self) -> Dict[str, Dict[str, int]]:
        """``{role: {owner: signed bytes}}`` summed over devices."""
        out: Dict[str, Dict[str, int]] = {}
        for _dev, role, owner, value in self.parts:
            row = out.setdefault(role, {})
            row[owner] = row.get(owner, 0) + value
        return out

    def to_dict(self) -> dict:
        return {
            "parts": [{"device": d, "role": r, "owner": o, "bytes": v} for d, r, o, v in self.parts],
            "owners": {name: info.to_dict() for name, info in self.owners.items()},
            "seen": [list(pair) for pair in sorted(self.seen)],
            "temporaries": self.temporaries,
            "extra": dict(self.extra),
            "complete": self.complete,
            "left_out": list(self.left_out),
            "moved": [m.to_dict() for m in self.moved],
            "graph_held": [list(pair) for pair in sorted(self.graph_held)],
            "graphs": {owner: list(names) for owner, names in self.graphs.items()},
            "owners_before": {name: info.to_dict() for name, info in self.owners_before.items()},
            "whole_cell": self.whole_cell,
            "imports": None if self.imports is None else self.imports.to_dict(),
        }


class Suspect(NamedTuple):
    """One holder of an earlier run's tensors, and what frees them.

    ``kind`` says how it holds them and ``fix`` what to do (:data:`SUSPECT_KINDS` and
    :data:`SUSPECT_FIXES` name them all); the other fields are what the fix names, when known.
    """

    name: str                   # who holds it, as the user knows it: `opt`, `Out[3]`, `traceback`, `lin hook`
    kind: str                   # output_cache, traceback, hook, optimizer, appended_graph, appended, graph, reassigned, class_attribute, module_global, default_argument, closure, variable
    fix: str                    # what frees them: one of SUSPECT_FIXES (append_item, append_detached, del...)
    bytes: int                  # what it gained since the previous run
    new: bool = True            # this run is the first to name it (a cell says so once per suspect)
    exprs: Tuple[str, ...] = ()  # the expressions that hold it (``Out[3]``, ``_``), or a traceback's locals
    frames: Tuple[str, ...] = ()  # a traceback's functions
    cell: Optional[int] = None  # the cell that built an optimizer (its execution count)
    model: Optional[str] = None  # the module the suspect holds or replaced
    item: Optional[str] = None  # what the cell appends (``loss`` in ``losses.append(loss)``), or the container code keeps (``Store.kept``)
    hook: Optional[Tuple[str, str, int]] = None  # (module, hook kind, copies) of a hook registered on every run

    def to_dict(self) -> dict:
        out = self._asdict()
        out["exprs"], out["frames"] = list(self.exprs), list(self.frames)
        out["hook"] = None if self.hook is None else {"module": self.hook[0], "kind": self.hook[1], "copies": self.hook[2]}
        return out


@dataclass(frozen=True)
class Rerun:
    """A run of a cell that ran before (the same cell id, or the same source).

    Attributes:
        of: the first run's execution count.
        runs: how many times the cell has run, this run included.
        previous: the previous run's execution count.
        growth: bytes kept beyond the previous run (allocated bytes on a GPU, exact tensor bytes on
            the CPU), None when not measured (the run kept nothing).
        suspects: who holds the earlier runs' tensors, biggest first.
    """

    of: Optional[int]
    runs: int
    previous: Optional[int] = None
    growth: Optional[int] = None
    suspects: Tuple[Suspect, ...] = ()

    @property
    def names(self) -> list:
        """The suspects' names (``rerun.to_dict()["suspects"]``)."""
        return [s.name for s in self.suspects]

    @property
    def warns(self) -> bool:
        """This run names a suspect for the first time: its line says so."""
        return any(s.new for s in self.suspects)
