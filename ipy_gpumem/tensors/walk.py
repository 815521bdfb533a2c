"""The one walk from a namespace to every tensor storage it keeps alive: (storage, role, holder path), counted once, within a budget.

The census, ``who()``, the re-run tracker, the phases and the estimate all count through it.
It visits, breadth first, the user's names (and roots a caller adds), then IPython's own
references (the output cache, ``_``/``_N``, the last error's frames), then what other running
threads' code of the user's and ``weakref.finalize``'s registry keep, then the modules the user
wrote, one level deeper at a time down to :data:`MAX_DEPTH`: containers (a dict's keys too),
plain objects' attributes and slots (dataclasses included), nn.Modules (parameters, buffers, other
attributes, hooks), optimizers (state, param groups), the holders read their own way
(:mod:`.readers`: caches, generators' frames, object arrays, data frames, futures, thread-locals,
exceptions, properties), the user's functions (closure cells, default arguments, the globals of
their module), classes (class attributes) and modules (globals), and the autograd graphs of the
tensors found (:mod:`.graphs`). Scalars and containers of scalars are recognised in C without a
Python step each (:mod:`.kinds`).

Each storage is *claimed* by every holder that reaches it; the best claim wins (see
:mod:`.claims`: the user's names before IPython's, then the one role order), so the order of the
walk never changes the result, only what a budget leaves out. The work is done in order of
importance, so a budget that runs out costs the least useful part: the names themselves and
IPython's references, then the graphs of the tensors found so far, then the contents of
containers, then the graphs found in them. When a budget stops it, :attr:`Walk.stopped` says why
and :attr:`Walk.unexamined` what was left; what it reached but could not read (a container deeper
than :data:`MAX_DEPTH`, a running thread's locals before Python 3.13, an object that failed) makes
it incomplete too (:attr:`Walk.complete`), and :attr:`Walk.unexamined` names those kinds.

Nothing here calls user code (every read goes through a builtin type's own C method or
descriptor, and tensor subclasses' ``__torch_function__`` is off), allocates tensors, imports
torch, or keeps a reference after :meth:`Walk.run` returns.
"""
from __future__ import annotations

import _thread
import functools
import sys
import threading
import time
import types
import weakref
from collections import deque
from itertools import chain, compress, islice
from operator import itemgetter, not_
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..core.devices import Device
from .claims import IPYTHON, USER
from .graphs import GraphNode, GraphRoot, GraphWalk
from .holding import MAX_ITEMS, HoldingMixin
from .kinds import (CLASS, DICT, FUNC, MODOBJ, MODULE as K_MODULE, OBJECT, OPTIM as K_OPTIM, PARAM, READ, SKIP,
                    KindsMixin, type_cache)
from .paths import (ATTR, CELL, CLASSOF, EXTRA, ITEM, KEY, LOCAL, MODROOT, NAME, OUT, THREAD, UNDER, VIA, Local,
                    PathsMixin, clip, key_text)
from .readers import class_attr, frame_reads_safely, getter_of, info_parts, live_frames, read_frame_locals
from .saved import SavedReader
from .storage import Storages
from .userfiles import is_user_file

__all__ = ["Walk", "GraphHandle", "MAX_DEPTH", "MAX_VISITS", "MAX_ITEMS"]

MAX_DEPTH = 6  # containers/attributes below a name, e.g. ckpt['a']['b']['c']['d']['e']['f']
MAX_VISITS = 50_000_000  # items examined in all containers together (the deterministic budget)
_BULK = 64  # containers larger than this have their children sorted by type in C first
_TENSORS = 1 << 14  # tensors read in bulk between two looks at the clock
_OPEN_SLICE = 1 << 16  # a large container's items read, sorted and counted in one go
_SIZED_BASES = (list, tuple, set, frozenset, deque)  # their C __len__, whatever a subclass says
# The budget covers the report too: turning claims into rows takes about this long per claim
# (0.8 us measured on a loaded 2-core machine), so the walk stops early enough to leave it time.
_REPORT_S_PER_CLAIM = 1e-6

_EXC_TRACEBACK = BaseException.__dict__["__traceback__"]
_EXC_CAUSE = BaseException.__dict__["__cause__"]
_EXC_CONTEXT = BaseException.__dict__["__context__"]
_UNDERSCORES = ("_", "__", "___")
_OUT_NAMES = ("Out", "_oh")
_FIRST = itemgetter(0)
_GONE = object()  # a name deleted while the walk ran
_MODULE_DICT = types.ModuleType.__dict__["__dict__"]
_TYPE_DICT = type.__dict__["__dict__"]


_READ_SLICE = 4096  # values read, and their types, in one go
# Reading a slice of names and sorting it by kind without proofs takes about this many times the
# reading alone (about 2 measured on a loaded 2-core machine, where the reading's pace varies 3x).
_SORTING = 2.0
_PACED = 16 * _READ_SLICE  # names read before their pace is trusted (one slow slice is not a pace)
_FIRST_NAMES = 1024  # names that hold containers, rooted whatever the budget (after those that hold tensors)
# ``bytes.translate`` tables from a kind (:meth:`kinds_of`) to 1 where the value holds a tensor, a module
# or an optimizer itself, or where it may hold one further down.
_DIRECT = bytes(SKIP < kind < DICT for kind in range(256))
_OTHER = bytes(DICT <= kind <= MODOBJ for kind in range(256))
_INDEX = list(range(_READ_SLICE))  # positions in a slice, made once


def _names_at(ns: dict, positions: List[int], length: int) -> Optional["_Names"]:
    """The keys of ``ns`` at ``positions`` (``length`` keys when its values were read), read from
    its start up to the last of them in the first half and from its end down to the first of them
    in the second half: a few names bound first or last cost a few reads, not a million. None when
    the namespace's length changed."""
    if dict.__len__(ns) != length:
        return None
    half = length // 2
    head_end = max((p for p in positions if p < half), default=-1) + 1
    tail_start = min((p for p in positions if p >= half), default=length)
    head = list(islice(dict.keys(ns), head_end))
    tail = list(islice(reversed(dict.keys(ns)), length - tail_start))
    tail.reverse()
    return _Names(head, tail, tail_start, length)


class _Names:
    """Some of a namespace's keys, by their position in it (see :func:`_names_at`)."""

    __slots__ = ("head", "tail", "tail_start", "length")

    def __init__(self, head: List[Any], tail: List[Any], tail_start: int, length: int):
        self.head, self.tail, self.tail_start, self.length = head, tail, tail_start, length

    def __getitem__(self, position: int) -> Any:
        if position < len(self.head):
            return self.head[position]
        return self.tail[position - self.tail_start]

    def __len__(self) -> int:
        return self.length


def _thread_names() -> Dict[int, str]:
    """Running threads' names by ident (``threading``'s own table, read without its lock)."""
    try:
        return {ident: getattr(t, "_name", "?") for ident, t in list(dict.items(threading._active))}
    except Exception:  # noqa: BLE001
        return {}


def _library_function(fn: Any) -> bool:
    """A Python function (or a method of one) defined in a library's file, not the user's."""
    if type(fn) is types.MethodType:
        fn = fn.__func__
    return type(fn) is types.FunctionType and not is_user_file(fn.__code__.co_filename)


class GraphHandle:
    """A root that holds no storage of its own, only an autograd graph: the node the engine is
    running during a backward (the only handle on a graph whose output nobody holds)."""

    __slots__ = ("grad_fn",)

    def __init__(self, grad_fn: Any):
        self.grad_fn = grad_fn


class _Tier:
    """One pass of attribution: the user's names, or IPython's references. Each has its own
    seen-set, levels to open, graph roots and graph nodes."""

    def __init__(self, level: int, namespace_ids: Iterable[int]):
        self.level = level  # USER or IPYTHON
        self.seen: Dict[int, int] = dict.fromkeys(namespace_ids, -1)  # id -> depth it was opened at
        self.levels: List[List[Tuple[int, Any, int]]] = [[] for _ in range(MAX_DEPTH + 1)]
        self.roots: List[GraphRoot] = []  # tensors with a graph
        self.spread = 0  # roots[:spread] are in ``nodes``
        self.nodes: Dict[int, GraphNode] = {}  # by id(node)
        self.owners_of: Dict[Any, tuple] = {}
        self.joined: Dict[int, set] = {}  # root -> earlier roots whose graph it met (census mode)


class Walk(HoldingMixin, KindsMixin, PathsMixin, GraphWalk):
    """One walk; holds references to the user's objects only until :meth:`run` returns.

    Args:
        api: the torch adapter (``torch_api.api()``).
        namespace: the user's names (``shell.user_ns``), or None.
        wanted: count only storages on this device (None: every device).
        ipython_names: the names of ``namespace`` that IPython bound (their values count in the
            IPython tier, by identity: ``attribution.holders.ipython_refs``).
        extra: more roots, ``(name, object)``: modules, optimizers, tensors, :class:`GraphHandle`.
        budget_s, max_visits: when to stop, in seconds and in items examined.
        errors: exceptions or tracebacks IPython keeps besides ``sys.last_*``.
        caches: walk IPython's references and the last error (the IPython tier).
        user_modules: walk the globals of the modules the user wrote that the names reach (through
            their functions and classes, or bound by name).
        shared_owners: name every root that shares a graph (``who()``); False: the first only.
        whole: the namespace ``namespace`` is a part of (the estimate walks only the names a step
            reaches): it is never walked itself, as a value or as the globals of its module, which
            would walk every name the caller left out.

    After :meth:`run` the results are plain values: :attr:`claims` (storage key -> winning claim,
    whose last two fields are its bytes and Device), :attr:`info` (per owner: a module's class and
    parameter bytes, an optimizer's class and state names), the paths, the notes.
    """

    def __init__(self, api: Any, namespace: Optional[dict], *, wanted: Optional[Device] = None,
                 ipython_names: Iterable[str] = (), extra: Iterable[Tuple[str, Any]] = (), budget_s: float = 0.75,
                 max_visits: int = MAX_VISITS, start: Optional[float] = None, errors: Tuple[Any, ...] = (),
                 caches: bool = True, user_modules: bool = True, shared_owners: bool = True,
                 whole: Optional[dict] = None):
        self.api = api
        self.shared_owners = shared_owners
        self.namespace = namespace if isinstance(namespace, dict) else {}
        # the namespaces never walked as values: this one, and the one it is a part of
        self.namespace_ids = frozenset((id(self.namespace),) + ((id(whole),) if isinstance(whole, dict) else ()))
        self.ipython_names = frozenset(ipython_names)
        self.extra = list(extra)
        self.errors_kept = errors
        self.walk_caches = caches
        self.walk_user_modules = user_modules
        self.budget_s = budget_s
        self.deadline = (time.perf_counter() if start is None else start) + budget_s
        self.max_visits = max_visits
        #: What turning one claim into the caller's rows costs (``who()`` measures its own and says).
        self.report_s_per_claim = _REPORT_S_PER_CLAIM
        self.types = type_cache(api)
        self.store = Storages(api, wanted)
        self.wanted = wanted
        self.saved = SavedReader(api, self.is_tensor, self.instance_dict)
        # storage key -> its best claim (see .claims); ``sizes`` keeps (bytes, Device) of the
        # storages that autograd graphs keep, until their claims are made.
        self.claims: Dict[Tuple[int, int], tuple] = {}
        self.sizes: Dict[Tuple[int, int], Tuple[int, Device]] = {}
        self.graph_roles: Dict[Tuple[int, int], int] = {}  # what a storage only a graph keeps is (see .graphs)
        self.info: Dict[str, dict] = {}
        self.p_parent: List[int] = []
        self.p_step: List[int] = []
        self.p_key: List[Any] = []
        self.p_order: List[int] = []
        self._exprs: Dict[int, Tuple[int, str]] = {}
        self.order = 0
        self.visits = 0
        self.tiers = (_Tier(USER, self.namespace_ids), _Tier(IPYTHON, self.namespace_ids))
        self.local_orders: set = set()  # orders of traceback locals, walked one level deep by design
        self.modules_to_walk: Dict[int, Tuple[str, Any]] = {}  # user modules met through functions' globals
        self.stopped: Optional[str] = None  # why a budget stopped the walk, in words
        self.unexamined: List[str] = []  # what the walk did not look at because of it
        self.notes: List[str] = []
        self.too_deep = 0
        self.too_deep_path = -1
        self.errors: List[str] = []
        self.error_count = 0
        self.unread: Dict[str, int] = {}  # kinds of holders reached but not read -> how many
        self.refuted: set = set()  # ids of large containers found to hold more than scalars (this walk)
        self.class_memo: Dict[int, bool] = {}  # id of a class of the user's -> it holds nothing (this walk)
        self._live: Optional[set] = None

    # ----------------------------------------------------------------- driver
    def run(self) -> None:
        """Walk in order of importance (see the module docstring), then drop every reference."""
        users, caches = self.tiers
        try:
            with self.api.no_torch_function():
                self.top_variables(users)
                self.top_extra(users)
                if self.walk_caches:
                    self.top_caches(caches)
                self.top_threads(users)
                self.graphs()
                for depth in range(MAX_DEPTH + 1):
                    if depth == 1 and self.walk_user_modules:
                        self.top_modules(users)  # their globals: level 1, after the names' own contents
                    for tier in self.tiers:
                        self.open_level(tier, depth)
                # What only weakref.finalize's registry keeps: after all the names reach, so that an
                # argument a name's finalizer also reaches is that name's (``fin.peek()[2]``).
                self.top_finalizers(users)
                for depth in range(1, MAX_DEPTH + 1):
                    self.open_level(users, depth)
                self.graphs()
                self.claim_graphs()
        finally:
            for tier in self.tiers:
                tier.levels = []
                tier.roots = [root._replace(fn=None) for root in tier.roots]  # no graph node kept
                tier.nodes = {}
            self.namespace = None
            self.store.memo = {}  # it holds the tensors it read
            self.extra = []
            self.errors_kept = ()
            self.modules_to_walk = {}
            self.saved.closures_seen = set()
            self.refuted = set()
            self.class_memo = {}
            self._live = None
            for what, count in self.unread.items():
                self.unexamined.append(what if count == 1 else f"{what} ({count:,})")

    @property
    def complete(self) -> bool:
        """Nothing left out: no budget ran out, no container was deeper than :data:`MAX_DEPTH`, every
        holder reached was read and none failed."""
        return self.stopped is None and not self.too_deep and not self.unread and not self.error_count

    def not_read(self, what: str) -> None:
        """A kind of holder reached but not read (said in :attr:`unexamined`; the walk is incomplete)."""
        self.unread[what] = self.unread.get(what, 0) + 1

    def live_frames(self) -> set:
        """Ids of the frames threads are running now (read once per walk)."""
        if self._live is None:
            self._live = live_frames()
        return self._live

    def out_of_budget(self) -> bool:
        """True once the time or visit budget is spent (and from then on)."""
        if self.stopped is not None:
            return True
        if self.visits >= self.max_visits:
            self.stopped = f"stopped after examining {self.max_visits:,} items (the visit budget)"
        elif time.perf_counter() + len(self.claims) * self.report_s_per_claim >= self.deadline:
            self.stopped = f"stopped after {self.budget_s:g} s (the time budget)"
        return self.stopped is not None

    def root(self, tier: _Tier, step: int, key: Any, value: Any, kind: int, depth: int, parent: int = -1) -> None:
        """A named value under its own order number; nothing it holds can make the walk raise."""
        if DICT <= kind <= OBJECT and self.scalars_only(value, kind):
            return  # most containers in a namespace: no path, no order number, nothing to open
        self.order += 1
        pid = self.path(parent, step, key, self.order)
        if step == LOCAL:
            self.local_orders.add(self.order)
        try:
            self.visit(tier, value, kind, pid, depth, self.order)
        except Exception as exc:  # noqa: BLE001
            self.error(pid, exc)

    def error(self, pid: int, exc: BaseException) -> None:
        """Remember that the object at path ``pid`` could not be examined (as text only)."""
        self.error_count += 1
        if len(self.errors) < 3:
            try:
                text = clip(str(exc), 80)
            except Exception:  # noqa: BLE001 - an exception whose __str__ raises
                text = "?"
            self.errors.append(f"{self.label(pid)}: {type(exc).__name__}: {text}")

    # ------------------------------------------------------------ the roots
    def top_variables(self, tier: _Tier) -> None:
        """The namespace's names: every one is the user's variable except those IPython bound."""
        ns = self.namespace
        # The values a slice at a time, their types read and their containers proven while they are
        # still in the cache (one trip to memory per name, not one per pass); the names only where a
        # value may hold something. Each suspect is checked against the namespace below, so a name
        # another thread rebinds in between is never mislabelled.
        kinds_of = self.kinds_of
        direct: List[int] = []  # names that hold a tensor, a module or an optimizer themselves
        others: List[int] = []  # names whose value may hold one further down
        passed = 0  # names of the latter the budget left unread, past the first _FIRST_NAMES
        total = dict.__len__(ns)
        length = 0
        read_s = 0.0
        iterator = iter(dict.values(ns))
        while True:
            begun = time.perf_counter()
            try:
                part = list(islice(iterator, _READ_SLICE))
            except RuntimeError:  # another thread resized it while it was read: every name, as it is now
                length = -1
                break
            if not part:
                break
            part_types = list(map(type, part))
            now = time.perf_counter()
            read_s += now - begun
            if self.stopped is None and length >= _PACED and \
                    now + (total - length) * read_s / length * _SORTING >= self.deadline:
                # Every name is read and sorted by kind whatever the budget (a tensor bound last counts):
                # the proofs stop when what is left to read would no longer fit in it, at this machine's
                # pace (learnt while reading).
                self.stopped = f"stopped after {self.budget_s:g} s (the time budget)"
            if self.stopped is None:
                # Values at depth 0 hold tensors at most MAX_DEPTH levels below them.
                found = self.suspects(part, MAX_DEPTH + 1, part_types)
                held = kinds_of(list(map(part_types.__getitem__, found)))
                direct += map(length.__add__, compress(found, held.translate(_DIRECT)))
                others += map(length.__add__, compress(found, held.translate(_OTHER)))
            else:  # no proofs any more: the names sorted by kind, in C
                found = kinds_of(part_types)
                direct += map(length.__add__, compress(_INDEX, found.translate(_DIRECT)))
                other = found.translate(_OTHER)
                count = other.count(1)
                room = min(count, max(0, _FIRST_NAMES - len(others)))
                if room:
                    others += map(length.__add__, islice(compress(_INDEX, other), room))
                passed += count - room
            length += len(part)
        part = []
        self.visits += max(length, 0)
        owned = self.ipython_names
        kinds, classify, root = self.types.kinds, self.types.classify, self.root
        if len(direct) + len(others) > _FIRST_NAMES:
            # Many suspects (a budget stopped their proofs): the names that hold a tensor, a module or
            # an optimizer themselves first, whatever the budget (one claim each), then the others.
            positions = direct + others
            first_ones = len(direct) + _FIRST_NAMES
        else:
            positions = sorted(direct + others)
            first_ones = _FIRST_NAMES
        reached = positions if not self.stopped else positions[:first_ones]  # what this budget can still do
        names: Any = _names_at(ns, reached, length)
        if names is None:  # the namespace changed while read (another thread): every name, as it is now
            names = list(dict.keys(ns))
            positions = range(len(names))
        elif len(reached) < len(positions) or passed:
            self.unexamined.append(f"{len(positions) - len(reached) + passed:,} of the namespace's names (those "
                                   "that hold containers, past the first 1,024)")
            positions = reached
        for count, position in enumerate(positions):
            if count >= first_ones and not count & 1023 and self.out_of_budget():  # the first names always count
                first = names[position] if position < len(names) else "?"
                self.unexamined.append(f"{len(positions) - count:,} of the namespace's names (from "
                                       f"{first if type(first) is str else key_text(first)} on)")
                return
            name = names[position] if position < len(names) else None
            if type(name) is not str or name in owned:
                continue
            value = dict.get(ns, name, _GONE)
            if value is _GONE:
                continue
            kind = kinds.get(type(value))
            if kind is None:
                kind = classify(type(value))
            if kind:
                root(tier, NAME, name, value, kind, 0)

    def top_extra(self, tier: _Tier) -> None:
        """Roots the caller added (the phases' modules, optimizers, inputs and a running graph)."""
        for name, value in self.extra:
            if type(value) is GraphHandle:
                if value.grad_fn is not None:
                    self.order += 1
                    tier.roots.append(GraphRoot(self.path(-1, EXTRA, name, self.order), self.order, value.grad_fn))
                continue
            kind = self.kind_of(value)
            if kind:
                self.root(tier, EXTRA, name, value, kind, 0)

    def top_modules(self, tier: _Tier) -> None:
        """The globals of the modules the user wrote that the names reach without holding them: the
        module of a function or class of theirs (``from helpers import train`` reaches ``helpers``)."""
        own = self.namespace_ids
        for name, module in list(self.modules_to_walk.values()):
            try:
                attrs = _MODULE_DICT.__get__(module)
            except Exception:  # noqa: BLE001
                continue
            if id(attrs) in own or tier.seen.get(id(module), MAX_DEPTH + 1) <= 0:
                continue  # the notebook's own module is the namespace; a module a name holds is walked there
            tier.seen[id(module)] = 0
            self.order += 1
            pid = self.path(-1, MODROOT, name, self.order)
            try:
                self.open_code(tier, pid, module, MODOBJ, 0)
            except Exception as exc:  # noqa: BLE001
                self.error(pid, exc)

    def top_caches(self, tier: _Tier) -> None:
        """IPython's own references: its output cache, ``_``/``__``/``___``/``_N``, the last error's frames.

        Only names IPython bound count (``ipython_names``); the last error is read from ``sys``.
        """
        ns, owned = self.namespace, self.ipython_names
        if owned:
            walked = set()
            for name in _OUT_NAMES:
                cache = dict.get(ns, name) if name in owned else None
                if not isinstance(cache, dict) or id(cache) in walked:
                    continue
                walked.add(id(cache))
                self.order += 1
                out = self.path(-1, OUT, name, self.order)
                for key, value in list(dict.items(cache)):
                    kind = self.kind_of(value)
                    if kind:
                        self.root(tier, ITEM, key, value, kind, 0, parent=out)
            numbered = sorted((int(n[1:]), n) for n in owned
                              if n[:1] == "_" and n[1:].isdecimal() and n[1:].isascii())
            for name in [n for n in _UNDERSCORES if n in owned] + [n for _, n in numbered]:
                value = dict.get(ns, name)
                kind = self.kind_of(value)
                if kind:
                    self.root(tier, UNDER, name, value, kind, 0)
        self.walk_tracebacks(tier)

    def walk_tracebacks(self, tier: _Tier) -> None:
        """Locals of the frames of the last exception's traceback (and chained exceptions), and of
        the other errors IPython keeps that the caller passed."""
        tracebacks = []
        exceptions = [getattr(sys, "last_exc", None), getattr(sys, "last_value", None)]
        for kept in (getattr(sys, "last_traceback", None),) + tuple(self.errors_kept):
            if isinstance(kept, types.TracebackType):
                tracebacks.append(kept)
            elif isinstance(kept, BaseException):
                exceptions.append(kept)
        seen_exc = set()
        while exceptions and len(seen_exc) < 8:
            exc = exceptions.pop(0)
            if not isinstance(exc, BaseException) or id(exc) in seen_exc:
                continue
            seen_exc.add(id(exc))
            # BaseException's own C getters: an exception class's properties never run.
            tb = _EXC_TRACEBACK.__get__(exc)
            if isinstance(tb, types.TracebackType):
                tracebacks.append(tb)
            exceptions.extend((_EXC_CAUSE.__get__(exc), _EXC_CONTEXT.__get__(exc)))
        seen_frames = set()
        for tb in tracebacks:
            steps = 0
            while isinstance(tb, types.TracebackType) and steps < 1000:
                steps += 1
                frame = tb.tb_frame
                tb = tb.tb_next
                if id(frame) in seen_frames:
                    continue
                seen_frames.add(id(frame))
                try:
                    self.frame_locals(tier, frame)
                except Exception as exc:  # noqa: BLE001
                    self.errors.append(f"traceback frame {frame.f_code.co_name}: {type(exc).__name__}")
                    self.error_count += 1

    def frame_locals(self, tier: _Tier, frame: types.FrameType) -> None:
        """One frame's locals: tensors, modules, optimizers, and one level into containers."""
        if not frame.f_code.co_flags & 0x1:  # not CO_OPTIMIZED: a cell's module-level frame, whose
            return  # "locals" are the user namespace itself (or a class body's, gone with it)
        if not frame_reads_safely(frame, self.live_frames()):
            # Still running (IPython's own frames while an error is handled): its locals can change,
            # and before Python 3.13 reading them would keep them alive.
            if is_user_file(frame.f_code.co_filename):
                self.not_read("the locals of running frames of the last error's traceback")
            return
        function = frame.f_code.co_name
        for name, value in read_frame_locals(frame)[:MAX_ITEMS]:
            kind = self.kind_of(value)
            if kind and type(name) is str and kind not in (FUNC, CLASS, MODOBJ):
                self.root(tier, LOCAL, Local(function, name), value, kind, MAX_DEPTH - 1)

    def top_threads(self, tier: _Tier) -> None:
        """The locals of the user's code that other threads are running now (a loader or a training thread).

        From Python 3.13 on a running frame's ``f_locals`` is a view; before it, reading them would
        copy them into a dict the frame keeps (holding what the code deletes next), so they are not
        read and the walk says so.
        """
        try:
            frames = list(sys._current_frames().items())
        except Exception:  # noqa: BLE001 - an interpreter without it
            return
        me = _thread.get_ident()
        frames = [(ident, frame) for ident, frame in frames if ident != me]  # ours would make a cycle with this frame
        names = None
        try:
            for ident, frame in frames:
                steps = 0
                while frame is not None and steps < 1000:
                    steps += 1
                    code = frame.f_code
                    if code.co_flags & 0x1 and is_user_file(code.co_filename):
                        self.thread_frame(tier, ident, frame, names)
                        if names is None:
                            names = _thread_names()
                    frame = frame.f_back
        finally:
            frames = frame = None

    def thread_frame(self, tier: _Tier, ident: int, frame: Any, names: Optional[Dict[int, str]]) -> None:
        """One running frame of the user's code in another thread: its locals, or a note that they were not read."""
        if not frame_reads_safely(frame, self.live_frames()):
            self.not_read("the locals of code of yours running in other threads (before Python 3.13 "
                          "reading a running frame's locals would keep them alive)")
            return
        thread = (names if names is not None else _thread_names()).get(ident, str(ident))
        code = frame.f_code
        for name, value in read_frame_locals(frame)[:MAX_ITEMS]:
            kind = self.kind_of(value)
            if kind and type(name) is str and kind not in (FUNC, CLASS, MODOBJ):
                self.root(tier, THREAD, Local(code.co_name, name, thread), value, kind, 0)

    def top_finalizers(self, tier: _Tier) -> None:
        """What ``weakref.finalize`` keeps until its object dies: each registered function and its
        arguments, whether or not a name holds the finalizer (``weakref.finalize._registry``)."""
        registry = class_attr(weakref.finalize, "_registry")
        if type(registry) is not dict or not registry:
            return
        infos = list(dict.values(registry))[:MAX_ITEMS]
        get_func = getter_of(type(infos[0]), "func") if infos else None
        if get_func is None:
            return
        try:
            funcs = list(map(get_func, infos))  # C passes: torch alone registers a hundred finalizers
        except Exception:  # noqa: BLE001 - another layout of weakref.finalize._Info
            return
        ids = list(map(id, funcs))
        library = {key: _library_function(fn) for key, fn in dict(zip(ids, funcs)).items()}  # a few functions
        # A library's own finalizers (torch registers one per operator library) are passed over in C.
        own = self.namespace_ids
        for index in compress(range(len(infos)), map(not_, map(library.__getitem__, ids))):
            info = infos[index]
            for _step, key, value in info_parts(info, f"._registry[{index}]"):
                kind = self.kind_of(value)
                if not kind or id(value) in own or (DICT <= kind <= OBJECT and self.scalars_only(value, kind)):
                    continue
                self.order += 1
                root = self.path(-1, MODROOT, "weakref.finalize", self.order)
                pid = self.path(root, VIA, key, self.order)
                try:  # one step below the finalizer, as from a name that holds it (``fin.peek()[2]``)
                    self.visit(tier, value, kind, pid, 1, self.order)
                except Exception as exc:  # noqa: BLE001
                    self.error(pid, exc)

    # ------------------------------------------------------------- visiting
    def visit(self, tier: _Tier, obj: Any, kind: int, pid: int, depth: int, order: int) -> None:
        """Attribute what ``obj`` (at path ``pid``) holds; containers and code wait for their level."""
        if kind <= PARAM:
            self.held_tensor(tier, obj, kind == PARAM, pid, depth, order)
        elif kind == K_MODULE:
            self.module(tier, obj, pid, depth, order)
        elif kind == K_OPTIM:
            self.optimizer(tier, obj, pid, depth, order)
        elif tier.seen.get(id(obj), MAX_DEPTH + 1) > depth:
            tier.levels[depth].append((pid, obj, kind))

    def open_level(self, tier: _Tier, depth: int) -> None:
        """Open the containers reached at ``depth`` (or, at ``MAX_DEPTH``, count those left closed)."""
        level = tier.levels[depth]
        tier.levels[depth] = []
        if not level:
            return
        if depth >= MAX_DEPTH:
            self.count_too_deep(tier, level)
            return
        if len(level) > _BULK:  # drop, in C, the groups whose contents are all scalars
            level = list(map(level.__getitem__, self.suspects(list(map(itemgetter(1), level)),
                                                                MAX_DEPTH - depth + 1)))
        seen = tier.seen
        for index, (pid, obj, kind) in enumerate(level):
            if not index & 255 and self.out_of_budget():
                self.not_opened(level[index:], depth)
                for deeper in range(depth + 1, MAX_DEPTH):
                    self.not_opened(tier.levels[deeper], deeper)
                    tier.levels[deeper] = []
                return
            if seen.get(id(obj), MAX_DEPTH + 1) <= depth:
                continue  # reached twice; opened already (also breaks cycles)
            seen[id(obj)] = depth
            try:
                if kind > OBJECT:
                    self.open_code(tier, pid, obj, kind, depth)
                else:
                    self.open(tier, pid, obj, kind, depth)
            except Exception as exc:  # noqa: BLE001
                self.error(pid, exc)

    def not_opened(self, level: List[Tuple[int, Any, int]], depth: int) -> None:
        if level:
            many = len(level) > 1
            self.unexamined.append(f"the contents of {len(level):,} container{'s' if many else ''} at depth "
                                   f"{depth} ({'e.g. ' if many else ''}{self.label(level[0][0])})")

    def open(self, tier: _Tier, pid: int, obj: Any, kind: int, depth: int) -> None:
        """Visit what one container holds, one level down; skipped types never take a Python step."""
        if kind == READ:
            self.open_read(tier, pid, obj, depth)
            return
        if kind == OBJECT:
            attrs = self.attributes(obj)
            if attrs is None:
                return
            cls = type(obj)
            if self.user_class(cls) and tier.seen.get(id(cls), MAX_DEPTH + 1) > depth + 1:
                # Class attributes are shared by every instance: ``type(trainer).history``.
                self.visit(tier, cls, CLASS, self.path(pid, CLASSOF, None, self.p_order[pid]), depth + 1,
                           self.p_order[pid])
            obj, kind, step = attrs, DICT, ATTR
        else:
            step = ITEM
        cache = self.types
        skip_types = cache.skip_types
        keys: Any = None
        if kind == DICT:
            size = dict.__len__(obj)
            self.visits += size
            if step == ITEM and not skip_types.issuperset(map(type, dict.keys(obj))):
                # Keys that are not scalars (a tensor, a tuple of them, an object): ``list(d)[i]``.
                keys = list(dict.keys(obj))
                self.visit_pairs(tier, pid, KEY, [(i, k) for i, k in enumerate(keys) if type(k) not in skip_types],
                                 depth, size)
            if size <= _BULK:
                if skip_types.issuperset(map(type, dict.values(obj))):
                    return
                self.visit_pairs(tier, pid, step, list(dict.items(obj)), depth, size)
                return
            if keys is None:
                keys = iter(dict.keys(obj))
            else:
                keys = iter(keys)
            source: Any = iter(dict.values(obj))
        else:
            source = cache.seq_iter[type(obj)](obj)
            first = list(islice(source, _BULK + 1))
            if len(first) <= _BULK:
                self.visits += len(first)
                if not skip_types.issuperset(map(type, first)):
                    self.visit_pairs(tier, pid, step, enumerate(first), depth, len(first))
                return
            size = next((base.__len__(obj) for base in _SIZED_BASES if issubclass(type(obj), base)), len(first))
            source = chain(first, source)
        # A large container a slice at a time (a list of a million tensors is counted as far as the
        # budget goes, never spent on reading it first): children sorted by type in C, whole groups
        # of scalar-only records dropped at once, plain tensors read in bulk through C descriptors.
        begin = 0
        while True:
            values = list(islice(source, _OPEN_SLICE))
            if not values:
                return
            names: Any = range(begin, begin + len(values)) if keys is None else list(islice(keys, len(values)))
            if len(names) != len(values):
                return  # changed while read (another thread)
            if kind != DICT:
                self.visits += len(values)
            if begin and self.out_of_budget():
                self.unexamined.append(f"the rest of {self.label(pid)} (from item {begin:,} on)")
                return
            if not self.open_slice(tier, pid, step, names, values, depth, size):
                return  # it said what it left
            begin += len(values)

    def open_slice(self, tier: _Tier, pid: int, step: int, names: Any, values: List[Any], depth: int,
                   size: int) -> bool:
        """One slice of a large container (``names``: its keys or indices); False once the budget ran out."""
        cache = self.types
        tps = list(map(type, values))
        if cache.skip_types.issuperset(tps):
            return True  # a slice of scalars: one C pass over the types
        positions = self.suspects(values, MAX_DEPTH - depth, tps)
        if len(positions) > _BULK and self.store.storage_device is not None:
            plain = list(map(cache.plain_tensor_types.__contains__, map(tps.__getitem__, positions)))
            bulk = list(compress(positions, plain))
            if len(bulk) > _BULK:
                for start in range(0, len(bulk), _TENSORS):
                    part = bulk[start:start + _TENSORS]
                    if start and self.out_of_budget():
                        self.unexamined.append(f"{len(bulk) - start:,} tensors in {self.label(pid)} from "
                                               f"{key_text(names[part[0]])} on, and what follows them there")
                        return False
                    if not self.held_tensors(tier, pid, step, list(map(names.__getitem__, part)),
                                             list(map(values.__getitem__, part)), depth + 1):
                        return False  # it said what it left
                positions = list(compress(positions, map(not_, plain)))
        if positions:
            self.visit_pairs(tier, pid, step, zip(map(names.__getitem__, positions), map(values.__getitem__, positions)),
                             depth, size)
        return not self.stopped

    def open_read(self, tier: _Tier, pid: int, obj: Any, depth: int) -> None:
        """A holder read its own way (:mod:`.readers`): visit what its reader says it keeps."""
        reader = self.types.readers.get(type(obj))
        if reader is None:
            return
        triples = reader(self, obj)
        order = self.p_order[pid]
        kinds, classify = self.types.kinds, self.types.classify
        for count, (step, key, value) in enumerate(triples):
            if count & 4095 == 4095 and self.out_of_budget():
                self.unexamined.append(f"the rest of {self.label(pid)} ({len(triples) - count:,} items)")
                return
            kind = kinds.get(type(value))
            if kind is None:
                kind = classify(type(value))
            if not kind or (DICT <= kind <= OBJECT and self.scalars_only(value, kind)):
                continue
            cpid = self.path(pid, step, key, order)
            try:
                self.visit(tier, value, kind, cpid, depth + 1, order)
            except Exception as exc:  # noqa: BLE001
                self.error(cpid, exc)

    def visit_pairs(self, tier: _Tier, pid: int, step: int, pairs: Any, depth: int, size: int) -> None:
        """Visit ``(key, value)`` children of path ``pid`` one level down."""
        order = self.p_order[pid]
        cache = self.types
        kinds, classify, skip_types = cache.kinds, cache.classify, cache.skip_types
        seen, child_depth, scalars_only = tier.seen, depth + 1, self.scalars_only
        for count, (key, value) in enumerate(pairs):
            if count & 4095 == 4095 and self.out_of_budget():
                self.unexamined.append(f"the rest of {self.label(pid)} ({size:,} items)")
                return
            tp = type(value)
            kind = kinds.get(tp)
            if kind is None:
                kind = classify(tp)
            if not kind:
                continue
            if kind >= DICT:
                if seen.get(id(value), MAX_DEPTH + 1) <= child_depth:
                    continue
                # Exact small builtins iterate in C without user code: test them inline, the rest by type.
                if (tp is list or tp is tuple) and len(value) <= _BULK:
                    if skip_types.issuperset(map(type, value)):
                        continue
                elif tp is dict and len(value) <= _BULK:
                    if skip_types.issuperset(map(type, dict.values(value))) and \
                            skip_types.issuperset(map(type, dict.keys(value))):
                        continue
                elif kind <= OBJECT and scalars_only(value, kind):
                    continue
            cpid = self.path(pid, step, key, order)
            try:
                self.visit(tier, value, kind, cpid, child_depth, order)
            except Exception as exc:  # noqa: BLE001
                self.error(cpid, exc)

    def count_too_deep(self, tier: _Tier, level: List[Tuple[int, Any, int]]) -> None:
        """Containers at ``MAX_DEPTH`` that hold more than scalars: said in a note, not opened.

        Traceback locals go one level deep by design; theirs are not counted.
        """
        local_orders, seen = self.local_orders, tier.seen
        for pid, obj, kind in level:
            if id(obj) in seen or self.p_order[pid] in local_orders or kind > OBJECT or self.scalars_only(obj, kind):
                continue
            seen[id(obj)] = MAX_DEPTH
            self.too_deep += 1
            if self.too_deep_path < 0:
                self.too_deep_path = pid

    # ------------------------------------------------------------- the user's code
    def user_class(self, cls: type) -> bool:
        try:
            module = sys.modules.get(type.__dict__["__module__"].__get__(cls))
        except Exception:  # noqa: BLE001
            return False
        return module is not None and (module.__name__ == "__main__" or self.types.is_user_module(module))

    def open_code(self, tier: _Tier, pid: int, obj: Any, kind: int, depth: int) -> None:
        """What the user's code holds: a function's closure cells, defaults and module globals; a bound
        method's object; a partial's arguments; a class's attributes; a module's globals."""
        pairs: List[Tuple[int, Any, Any]] = []  # (step, key, value)
        if kind == FUNC:
            tp = type(obj)
            if tp is types.MethodType:
                pairs.append((ATTR, "__self__", obj.__self__))
                pairs.append((ATTR, "__func__", obj.__func__))
            elif tp is functools.partial:
                pairs.extend(((ATTR, "func", obj.func), (ATTR, "args", obj.args), (ATTR, "keywords", obj.keywords)))
            elif is_user_file(obj.__code__.co_filename):
                if obj.__defaults__:
                    pairs.append((ATTR, "__defaults__", obj.__defaults__))
                if obj.__kwdefaults__:
                    pairs.append((ATTR, "__kwdefaults__", obj.__kwdefaults__))
                for index, cell in enumerate(obj.__closure__ or ()):
                    try:
                        pairs.append((CELL, index, cell.cell_contents))
                    except ValueError:  # an empty cell
                        continue
                module = sys.modules.get(obj.__module__) if isinstance(obj.__module__, str) else None
                if module is not None and self.walk_user_modules and _MODULE_DICT.__get__(module) is obj.__globals__:
                    self.modules_to_walk.setdefault(id(module), (module.__name__, module))
        elif kind == CLASS:
            if not self.user_class(obj):
                return
            module = sys.modules.get(type.__dict__["__module__"].__get__(obj))
            if module is not None and self.walk_user_modules and module is not sys.modules.get("__main__"):
                self.modules_to_walk.setdefault(id(module), (module.__name__, module))
            for name, value in list(_TYPE_DICT.__get__(obj).items()):
                if type(name) is str and not (name.startswith("__") and name.endswith("__")):
                    if type(value) in (staticmethod, classmethod):
                        value = value.__func__
                    pairs.append((ATTR, name, value))
        elif kind == MODOBJ:
            if not self.types.is_user_module(obj):
                return
            for name, value in list(_MODULE_DICT.__get__(obj).items()):
                if type(name) is str and not (name.startswith("__") and name.endswith("__")):
                    pairs.append((ATTR, name, value))
        order = self.p_order[pid]
        for step, key, value in pairs:
            value_kind = self.kind_of(value)
            if not value_kind or (value_kind == MODOBJ and step == ATTR and kind == MODOBJ):
                continue  # a module's imports are walked as modules of their own, if the user wrote them
            if DICT <= value_kind <= OBJECT and self.scalars_only(value, value_kind):
                continue
            cpid = self.path(pid, step, key, order)
            try:
                self.visit(tier, value, value_kind, cpid, depth + 1, order)
            except Exception as exc:  # noqa: BLE001
                self.error(cpid, exc)
