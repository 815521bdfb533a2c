"""Whether a cell changed anything the last census depended on, answered without walking: a quiet cell leaves the count as it was.

A census walks everything the user's names reach; most cells change none of it (``x = 1``, a plot,
a print). :class:`CensusWatch` keeps, as plain numbers and names (never a reference that keeps an
object alive), what the last census depended on, and at a cell's end says whether any of it moved:

- **the names**: the identity of what each name holds; for a builtin container, its length, and
  for a small one (:data:`SMALL` items), the identity of each item. The names that own a part of
  the count (usually a handful) are read at every cell, with a few *sentinels*: weak references
  to parameters (a gradient appears or goes with ``backward()`` and ``zero_grad()``), each
  optimizer's state count (it grows at its first ``step()``) and a small object's attributes.
  The other names are read with them while there are few; in a large namespace they are read
  :data:`WINDOW` a cell (identities and lengths; the names that hold scalars only for their
  type), so ten thousand names cost what a hundred do. IPython's input history (``_iN``) is
  left out (strings IPython binds), and its tables (``In``, ``Out``) are read for identity only.
- **new names**, read from the end of the namespace (a dict keeps insertion order) and counted
  against its length, so a name added, deleted or re-added is never missed;
- **IPython's own references**: the output cache's length and the last error;
- **the counters**: torch's allocated bytes per device, exact (any tensor made or freed on a GPU
  moves them), and the process's RSS, within :data:`HOST_SLACK` of what it was at the census.

A change that provably leaves the count as it was is absorbed (a name rebound from one scalar to
another, a new name holding a list of ints or a function of the notebook, a name that owned
nothing rebound to a string): :class:`_Proof` reads a value by the census's own rules. Any other
change says "count again". What this cannot see without memory moving: a change two levels down
in a container (``d["a"].append(t)`` of a CPU tensor smaller than :data:`HOST_SLACK`, or placed in
heap memory the process had freed but kept resident, as glibc does below 32 MiB), and,
in a namespace larger than one window, a name that held no tensor and now does, until its window
comes round, or an item replaced in such a name's container without its length changing; the next
count that runs for another reason sees them.

Every reading is a few C passes (``map`` over builtin methods and C descriptors): nothing here
calls user code, imports torch or keeps a user's object alive.
"""
from __future__ import annotations

import re
import sys
import time
import types
import weakref
from itertools import chain, compress, repeat
from operator import is_, is_not, itemgetter, not_
from typing import Any, Callable, Iterable, List, NamedTuple, Optional, Set, Tuple

from .kinds import CLASS, DICT, FUNC, MODOBJ, MODULE, OBJECT, OPTIM, SKIP, KindsMixin
from .walk import MAX_DEPTH

__all__ = ["CensusWatch", "Counters", "WINDOW", "HOST_SLACK"]

#: Names read per cell from a large namespace's other holders (twice as many scalars' names).
WINDOW = 16
#: Host RSS may drift this far from its value at the last census before the count is taken again
#: (IPython's own history grows the process a little; a tensor this small is not worth a walk).
HOST_SLACK = 1 << 20
#: Builtin containers up to this many items have each item's identity compared.
SMALL = 32
#: Modules and optimizers given sentinels.
MAX_SENTINEL_OWNERS = 8
#: What proving new values tensor-free may cost at one cell's end (past it: count again, on the
#: census's own budget).
PROOF_VISITS = 1 << 20
PROOF_S = 0.002

_MISSING = object()
_SYS = sys.__dict__  # sys's attributes, read without an exception for a missing one
_CALL = weakref.ref.__call__  # a weak reference's referent, as a function for map()
# IPython's input history: strings IPython binds on every cell, never a holder of anything.
_HISTORY = frozenset(("In", "_ih", "_dh", "_i", "_ii", "_iii"))
# IPython's own growing tables: their identity is watched, their length is IPython's business
# (the output cache is read on its own: :func:`_out_state`).
_IPYTHON_TABLES = _HISTORY | {"Out", "_oh"}
_SEQS = frozenset((list, tuple, set, frozenset))  # exact types: len() and iteration are C


class Counters(NamedTuple):
    """The memory counters a census is compared with: host RSS and torch's allocated bytes per device."""

    rss: Optional[int]
    allocated: Tuple[Tuple[int, Optional[int]], ...] = ()

    @classmethod
    def of(cls, sample) -> "Counters":
        """From a ``core.probes.Sample`` (None: nothing known)."""
        if sample is None:
            return _NO_COUNTERS
        devices = sample.devices
        return cls(sample.host.rss, tuple((d.index, d.allocated) for d in devices) if devices else ())


_NO_COUNTERS = Counters(None)


def _history_name(key: Any) -> bool:
    return type(key) is str and (key in _HISTORY or (key[:2] == "_i" and key[2:].isdigit()))


# The same test for many names at once, in C (a session of 20,000 cells has 20,000 ``_iN``); a name
# whose digits are not decimal (``_i²``) is not history here: read with the scalars, never left out.
_HISTORY_RE = re.compile(r"_i\d+|" + "|".join(sorted(_HISTORY, key=len, reverse=True)))


def _not_history(keys: List[Any]) -> List[Any]:
    """The keys that are not IPython's input history (:func:`_history_name`)."""
    try:
        return list(compress(keys, map(not_, map(_HISTORY_RE.fullmatch, keys))))
    except TypeError:  # a key that is not a string
        return [k for k in keys if not _history_name(k)]


class _Sig:
    """What a list of names holds, as identities: each value; with the same values, the length of
    each builtin container; with the same lengths, the items of the small ones. Read in C passes."""

    __slots__ = ("names", "ids", "containers", "lengths", "small_dicts", "small_seqs", "items")

    def __init__(self, ns: dict, names: List[Any], items: bool = True):
        self.names = names
        values = list(map(ns.get, names, repeat(_MISSING)))
        tps = list(map(type, values))
        self.ids = list(map(id, values))
        is_dict = list(map(is_, tps, repeat(dict)))
        self.containers = list(map(_SEQS.__contains__, tps))
        self.containers = list(map(bool.__or__, is_dict, self.containers))
        conts = list(compress(values, self.containers))
        self.lengths = list(map(len, conts))
        small = list(map(SMALL.__ge__, self.lengths)) if items else [False] * len(self.lengths)
        cont_dicts = list(compress(is_dict, self.containers))
        self.small_dicts = list(map(bool.__and__, small, cont_dicts))
        self.small_seqs = list(map(bool.__and__, small, map(not_, cont_dicts)))
        self.items = _items(conts, self.small_dicts, self.small_seqs)

    def same(self, ns: dict) -> bool:
        values = list(map(ns.get, self.names, repeat(_MISSING)))
        return list(map(id, values)) == self.ids and self.same_contents(values)

    def same_contents(self, values) -> bool:
        """With the same objects (``values`` starts with this signature's names' values, in order):
        the same lengths and small items."""
        if not self.lengths:
            return True
        # The same objects: the same containers (compress stops at the end of the containers mask).
        conts = list(compress(values, self.containers))
        return list(map(len, conts)) == self.lengths and _items(conts, self.small_dicts, self.small_seqs) == self.items

    def changed_names(self, ns: dict) -> List[Any]:
        """The names whose own part differs now (Python, only once :meth:`same` said no)."""
        now = _Sig(ns, self.names, any(self.small_dicts) or any(self.small_seqs))
        return [name for name, before, after in zip(self.names, self._parts(), now._parts()) if before != after]

    def _parts(self) -> List[tuple]:
        parts = [(i,) for i in self.ids]
        positions = list(compress(range(len(self.names)), self.containers))
        pos = 0
        for index, length, sd, ss in zip(positions, self.lengths, self.small_dicts, self.small_seqs):
            items = None
            if sd or ss:
                items = tuple(self.items[pos:pos + length])
                pos += length
            parts[index] = (self.ids[index], length, items)
        return parts


def _items(conts: List[Any], small_dicts: List[bool], small_seqs: List[bool]) -> List[int]:
    if not (any(small_dicts) or any(small_seqs)):
        return []
    return list(map(id, chain(chain.from_iterable(map(dict.values, compress(conts, small_dicts))),
                              chain.from_iterable(compress(conts, small_seqs)))))


class CensusWatch:
    """The fingerprint of the last census and the check that a cell left it unchanged.

    Args:
        types: the walk's type cache (``kinds.type_cache``): what a name holds is judged by the
            census's own rules (a type it never opens is a scalar to it).
    """

    def __init__(self, types: Any):
        self.types = types
        self.settled = False
        self.reason: Optional[str] = None  # why the last check said "count again" (tests, benchmarks)
        self._proof = _Proof(types)
        self._get_grad = _tensor_base_grad(types)
        self._namespace_id = 0
        self._owned: frozenset = frozenset()
        self._every: Optional[_Sig] = None  # read at every cell
        self._tables: List[Any] = []  # IPython's growing tables (In, Out...) and the namespace itself: identity only
        self._table_ids: List[int] = []
        # The identities of every name read at every cell and of the tables, in one C call: what a
        # quiet cell checks first (None: there is no such name, or the namespace is not a plain dict).
        self._quick: Optional[Callable[[dict], tuple]] = None
        self._quick_ids: List[int] = []
        self._windows: List[_Sig] = []  # a large namespace's other holders, one window a cell
        self._window = 0
        self._scalars: List[Any] = []  # a large namespace's names of scalars, their types a window a cell
        self._scalar_cursor = 0
        self._tracked: Set[Any] = set()
        self._present = 0
        self._anchor: Any = _MISSING
        self._objects: List[Tuple[Any, Tuple[int, ...]]] = []  # (owner's name, ids of its attributes)
        self._sentinels: List[Tuple[Any, int]] = []  # (weak reference to a parameter, id of its grad)
        self._refs: List[Any] = []  # the sentinels' weak references, as one list...
        self._grads: List[int] = []  # ...and their grads' ids
        self._optimizers: List[Tuple[Any, int]] = []  # (weak reference to an optimizer, its state count)
        self._out: Tuple[int, int] = (0, 0)
        self._errors: Tuple[int, ...] = ()
        self._counters = _NO_COUNTERS

    # -- after a census ------------------------------------------------------------------------------

    def settle(self, namespace: dict, owners: Iterable[str], sample: Any = None) -> None:
        """Remember what a census just counted depended on (C passes over the names, once per census).

        Args:
            namespace: the names the census walked (IPython's output cache is its ``Out``).
            owners: the top-level names that own a part of it (a change to them changes the count).
            sample: the reading (``core.probes.Sample``) at the moment of the census: its counters.
        """
        self.settled = False
        if not isinstance(namespace, dict):
            return
        keys = list(dict.keys(namespace))
        values = list(dict.values(namespace))
        if len(keys) != len(values):
            return  # changed while read (another thread): no fingerprint, the next cell counts
        self._namespace_id = id(namespace)
        self._owned = frozenset(owners)
        self._tracked = set(keys)
        self._present = len(keys)
        self._anchor = keys[-1] if keys else _MISSING
        self._sign(namespace, keys, values)
        self._watch_owners(namespace, values)
        self._out = _out_state(dict.get(namespace, "Out"))
        self._errors = _error_ids()
        self._counters = Counters.of(sample)
        self.settled = True

    def _sign(self, ns: dict, keys: List[Any], values: List[Any]) -> None:
        """Split the names into what is read every cell and what is read a window at a time, and sign them."""
        scalar = list(map(self.types.skip_types.__contains__, map(type, values)))
        owned, ns_id = self._owned, id(ns)
        every, others, tables = [], [], []
        for key, value in zip(compress(keys, map(not_, scalar)), compress(values, map(not_, scalar))):
            if key in owned:
                every.append(key)
            elif key in _IPYTHON_TABLES or id(value) == ns_id:  # ``g = globals()``: the names themselves
                tables.append(key)
            else:
                others.append(key)
        self._tables = tables
        self._table_ids = list(map(id, map(ns.get, tables)))
        scalars = _not_history(list(compress(keys, scalar)))
        if len(others) + len(scalars) <= 2 * WINDOW:
            every.extend(others)
            every.extend(scalars)
            others, scalars = [], []
        self._set_every(ns, every)
        # A large namespace's other holders: identities and lengths only (what a window can afford).
        self._windows = [_Sig(ns, others[i:i + WINDOW], items=False) for i in range(0, len(others), WINDOW)]
        self._window = 0
        self._scalars = scalars
        self._scalar_cursor = 0

    def _set_every(self, ns: dict, names: List[Any]) -> None:
        """The names read at every cell, signed; and the one call that reads them with the tables."""
        every = self._every = _Sig(ns, names)
        watched = every.names + self._tables
        self._quick = None
        if type(ns) is dict and watched:
            getter = itemgetter(*watched)
            self._quick = getter if len(watched) > 1 else (lambda ns, get=getter: (get(ns),))
            self._quick_ids = every.ids + self._table_ids

    def forget(self) -> None:
        """No fingerprint: the next check says "count again"."""
        self.settled = False
        self._sentinels, self._optimizers, self._objects = [], [], []
        self._every, self._windows = None, []
        self._quick = None

    # -- at a cell's end ------------------------------------------------------------------------------

    def changed(self, namespace: dict, sample: Any = None) -> bool:
        """True when the count may differ from the last census's (the reason is in :attr:`reason`);
        ``sample`` is the reading at the cell's end (``core.probes.Sample``: its counters).

        A change that provably leaves the count as it was is absorbed into the fingerprint.
        """
        try:
            self.reason = self._check(namespace, sample)
        except Exception as exc:  # noqa: BLE001 - a name changed while read: count again
            self.reason = f"the check failed ({type(exc).__name__})"
        if self.reason is not None:
            self.settled = False
        return self.reason is not None

    def _check(self, ns: dict, sample: Any) -> Optional[str]:
        # Cheapest first, and nothing built that a quiet cell does not need: this runs after every cell.
        if not self.settled or id(ns) != self._namespace_id:
            return "no fingerprint"
        # The counters first: they are read anyway, and a cell that moved memory is counted again.
        before = self._counters
        if sample is None:
            rss, devices = None, ()
        else:
            rss, devices = sample.host.rss, sample.devices
        if (devices or before.allocated) and tuple((d.index, d.allocated) for d in devices) != before.allocated:
            return "allocated bytes moved"
        if rss is not None and before.rss is not None and abs(rss - before.rss) >= HOST_SLACK:
            return "host RSS moved"
        attrs = _SYS  # _error_ids(), inlined
        if (id(attrs.get("last_value")), id(attrs.get("last_traceback")), id(attrs.get("last_exc"))) != self._errors:
            return "the last error changed"
        if _out_state(dict.get(ns, "Out")) != self._out:
            return "the output cache changed"
        quick = self._quick
        if quick is not None:
            try:
                values = quick(ns)  # a name deleted raises KeyError: read one by one below
            except KeyError:
                values = None
            if (values is not None and list(map(id, values)) == self._quick_ids
                    and (not self._every.lengths or self._every.same_contents(values))):
                return self._after_names(ns)  # the names and the tables hold what they held
        if list(map(id, map(ns.get, self._tables))) != self._table_ids:
            return "IPython's tables were replaced"
        if not self._every.same(ns):
            reason = self._judge(ns, self._every.changed_names(ns))
            if reason is not None:
                return reason
            self._set_every(ns, [n for n in self._every.names if n in ns])
        return self._after_names(ns)

    def _after_names(self, ns: dict) -> Optional[str]:
        reason = None
        if self._objects or self._sentinels or self._optimizers:
            reason = self._owner_contents(ns)
        if reason is None:
            reason = self._new_names(ns)
        if reason is not None or not (self._windows or self._scalars):
            return reason
        return self._other_window(ns) or self._scalar_window(ns)

    def _judge(self, ns: dict, changed: List[Any]) -> Optional[str]:
        """Names whose value or contents moved: an owner, or a name that now holds more than
        scalars, means count again; anything else (it owned nothing, and holds nothing now) is absorbed."""
        self._proof.start()
        for name in changed:
            if name in self._owned:
                return f"`{name}` changed"
            value = dict.get(ns, name, _MISSING)
            if value is _MISSING:
                self._tracked.discard(name)
                self._present -= 1
                continue  # deleted: it owned nothing
            if not self._tensor_free(value, fresh=False):
                return f"`{name}` holds something new"
        return None

    def _other_window(self, ns: dict) -> Optional[str]:
        windows = self._windows
        index = self._window if self._window < len(windows) else 0
        self._window = index + 1
        sig = windows[index]
        if sig.same(ns):
            return None
        reason = self._judge(ns, sig.changed_names(ns))
        if reason is None:
            windows[index] = _Sig(ns, [n for n in sig.names if n in ns], items=False)
        return reason

    def _scalar_window(self, ns: dict) -> Optional[str]:
        """A window of a large namespace's names that held scalars: still scalars (or gone)?"""
        scalars = self._scalars
        if not scalars:
            return None
        start = self._scalar_cursor if self._scalar_cursor < len(scalars) else 0
        names = scalars[start:start + 2 * WINDOW]
        self._scalar_cursor = start + 2 * WINDOW
        values = list(map(ns.get, names, repeat(None)))  # a deleted scalar changes nothing
        skip = self.types.skip_types
        if skip.issuperset(map(type, values)):
            return None
        self._proof.start()
        for name, value in zip(names, values):
            if type(value) not in skip:
                if not self._tensor_free(value, fresh=False):
                    return f"`{name}` holds something new"
                # Now a container of scalars: read with the other holders from here on.
                scalars.remove(name)
                self._add_other(ns, name)
        return None

    def _add_other(self, ns: dict, name: Any) -> None:
        if self._windows and len(self._windows[-1].names) < WINDOW:
            self._windows[-1] = _Sig(ns, self._windows[-1].names + [name], items=False)
        elif self._windows or self._scalars:
            self._windows.append(_Sig(ns, [name], items=False))
        else:
            self._set_every(ns, self._every.names + [name])

    # -- sentinels -------------------------------------------------------------------------------------

    def _watch_owners(self, ns: dict, values: List[Any]) -> None:
        """Sentinels: the owners' small objects' attributes and their parameters' gradients, and every
        optimizer's state count (one owns nothing until its first ``step()``)."""
        types = self.types
        self._objects, self._sentinels, self._optimizers = [], [], []
        for name in self._owned:
            value = dict.get(ns, name, _MISSING)
            kind = _kind(types, value)
            if kind == OBJECT:
                attrs = _attributes(types, value)
                if attrs is not None and len(attrs) <= SMALL:
                    self._objects.append((name, _attribute_ids(attrs)))
            elif kind == MODULE and len(self._sentinels) < 2 * MAX_SENTINEL_OWNERS:
                for param in _end_parameters(value):
                    try:
                        self._sentinels.append((weakref.ref(param), id(self._grad(param))))
                    except TypeError:
                        pass
        self._refs = [ref for ref, _grad in self._sentinels]
        self._grads = [grad for _ref, grad in self._sentinels]
        kinds = list(map(types.kinds.get, map(type, values)))
        for opt in list(compress(values, map(OPTIM.__eq__, kinds)))[:MAX_SENTINEL_OWNERS]:
            try:
                self._optimizers.append((weakref.ref(opt), _state_count(opt)))
            except TypeError:
                pass

    def _owner_contents(self, ns: dict) -> Optional[str]:
        for name, attrs_ids in self._objects:
            attrs = _attributes(self.types, dict.get(ns, name))
            if attrs is None or _attribute_ids(attrs) != attrs_ids:
                return f"what `{name}` holds changed"
        sentinels = self._sentinels
        if sentinels:
            params = list(map(_CALL, self._refs))  # C passes: the parameters, then their gradients' ids
            try:
                same = (all(map(is_not, params, repeat(None)))
                        and list(map(id, map(self._get_grad, params))) == self._grads)
            except Exception:  # noqa: BLE001 - a gradient unreadable: read one at a time, as the fingerprint did
                same = all(ref() is not None and id(self._grad(ref())) == grad for ref, grad in sentinels)
            if not same:  # a parameter gone (its weak reference gives None), or a gradient made, freed or replaced
                return "gradients appeared, went or were replaced"
        for ref, count in self._optimizers:
            opt = ref()
            if opt is None or _state_count(opt) != count:
                return "an optimizer's state changed"
        return None

    def _grad(self, param: Any) -> Any:
        try:
            return self._get_grad(param)
        except Exception:  # noqa: BLE001
            return _MISSING

    # -- new and deleted names -------------------------------------------------------------------------

    def _new_names(self, ns: dict) -> Optional[str]:
        """Names added since the fingerprint, read from the end of the namespace and counted against its length."""
        length = dict.__len__(ns)
        last = next(reversed(ns), _MISSING)
        anchor = self._anchor
        if length == self._present and (last is anchor
                                        or (type(last) is str and type(anchor) is str and last == anchor)):
            return None
        if length == self._present + 1 and type(last) is str and last[:2] == "_i" and last[2:].isdigit():
            # The usual case: IPython stored this cell's input as `_iN` (a string) after the anchor.
            it = reversed(ns)
            next(it)
            before = next(it, _MISSING)
            if ((before is anchor or (type(before) is str and type(anchor) is str and before == anchor))
                    and type(dict.get(ns, last)) is str):
                self._tracked.add(last)
                self._present = length
                self._anchor = last
                return None
        new = []
        for key in reversed(ns):
            if _same_key(key, self._anchor):
                break
            new.append(key)
            if len(new) > 4096:
                return "many new names"
        else:
            return "the namespace was rebuilt"
        gone = self._present + sum(1 for k in new if k not in self._tracked) - length
        if gone and not self._scalars_deleted(ns, gone):
            return "names were deleted"  # a re-added anchor, or a holder deleted outside its window
        skip = self.types.skip_types
        self._proof.start()
        for key in reversed(new):
            value = dict.get(ns, key, _MISSING)
            if value is _MISSING:
                return "the namespace changed while read"
            if key in self._tracked:
                continue  # deleted and bound again: the reading of its name sees it
            if type(value) not in skip and not self._tensor_free(value, fresh=False):
                return f"`{key}` is new"
            self._tracked.add(key)
            self._present += 1
            if type(value) not in skip:
                self._add_other(ns, key)
            elif not _history_name(key):
                if self._scalars or self._windows:
                    self._scalars.append(key)
                else:
                    self._set_every(ns, self._every.names + [key])
        self._anchor = new[0]
        if self._present != length:
            return "the names do not add up"
        return None

    def _scalars_deleted(self, ns: dict, gone: int) -> bool:
        """Exactly ``gone`` names that held scalars were deleted (they held nothing): forget them (C passes)."""
        every = self._every.names
        present_every = list(map(ns.__contains__, every))
        present = list(map(ns.__contains__, self._scalars))
        missing_every = [n for n in compress(every, map(not_, present_every))]
        if present.count(False) + len(missing_every) != gone:
            return False
        if any(n in self._owned or type(n) is not str for n in missing_every):
            return False
        for name in chain(missing_every, compress(self._scalars, map(not_, present))):
            self._tracked.discard(name)
        self._scalars = list(compress(self._scalars, present))
        if missing_every:
            self._set_every(ns, list(compress(every, present_every)))
        self._present -= gone
        self._scalar_cursor = 0
        return True

    def _tensor_free(self, value: Any, fresh: bool = True) -> bool:
        """``value`` provably reaches no tensor; ``fresh``: with a budget of its own (else the one
        :meth:`_Proof.start` opened for several values)."""
        try:
            if fresh:
                self._proof.start()
            return self._proof.tensor_free(value, self._namespace_id)
        except Exception:  # noqa: BLE001 - unprovable: count again
            return False


class _Proof(KindsMixin):
    """Proves, by the census's own rules, that a value reaches no tensor (within a small budget).

    Containers down to the census's depth are proven in C (``KindsMixin.inert``); the user's own
    code is read as the walk reads it: a function's closure cells and default arguments, a class's
    attributes, an instance of the user's class with its class. A library's module, function or
    class is never walked by the census, so it holds nothing for it either.
    """

    def __init__(self, types: Any):
        self.types = types
        self.visits = 0
        self.deadline = 0.0

    def start(self) -> None:
        self.visits, self.deadline = 0, time.perf_counter() + PROOF_S

    def out_of_budget(self) -> bool:
        return self.visits > PROOF_VISITS or time.perf_counter() > self.deadline

    def tensor_free(self, value: Any, namespace_id: int, depth: int = 0) -> bool:
        kind = self.kind_of(value)
        if kind == SKIP or id(value) == namespace_id:  # ``g = globals()``: the names themselves
            return True
        if depth > 2 or self.out_of_budget():
            return False
        if DICT <= kind <= OBJECT:
            if kind == OBJECT and self.types.user_classes.get(type(value)):
                attrs = self.attributes(value)
                return (attrs is not None and self.all_free(dict.values(attrs), namespace_id, depth)
                        and self.tensor_free(type(value), namespace_id, depth + 1))
            return self.inert(type(value), [value], MAX_DEPTH + 1)
        if kind == FUNC:
            if type(value) is not types.FunctionType:
                return False  # a bound method or a partial: what it is bound to could hold anything
            globals_ = value.__globals__
            if id(globals_) != namespace_id and self.types.is_user_module(_module_of(globals_)):
                return False  # a function of the user's module: the census walks that module's globals
            cells = []
            for cell in value.__closure__ or ():
                try:
                    cells.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    continue
            return self.all_free(chain(cells, value.__defaults__ or (), (value.__kwdefaults__ or {}).values()),
                                 namespace_id, depth)
        if kind == CLASS:
            if not _user_class(self.types, value):
                return True  # a library's class: never walked
            attrs = type.__dict__["__dict__"].__get__(value)
            picked = [v.__func__ if type(v) in (staticmethod, classmethod) else v
                      for k, v in list(attrs.items()) if not (type(k) is str and k.startswith("__") and k.endswith("__"))]
            return self.all_free(picked, namespace_id, depth)
        if kind == MODOBJ:
            return not self.types.is_user_module(value)  # a library's module is never walked
        return False

    def all_free(self, values: Iterable[Any], namespace_id: int, depth: int) -> bool:
        return all(self.tensor_free(v, namespace_id, depth + 1) for v in values)


def _module_of(globals_: Any) -> Any:
    name = globals_.get("__name__") if isinstance(globals_, dict) else None
    return sys.modules.get(name) if isinstance(name, str) else None


def _user_class(types: Any, cls: type) -> bool:
    known = types.user_classes.get(cls)
    if known is not None:
        return known
    try:
        module = sys.modules.get(type.__dict__["__module__"].__get__(cls))
    except Exception:  # noqa: BLE001
        return True  # unsure: treat it as the user's (walked)
    return module is not None and (module.__name__ == "__main__" or types.is_user_module(module))


def _kind(types: Any, value: Any) -> int:
    kind = types.kinds.get(type(value))
    return types.classify(type(value)) if kind is None else kind


def _same_key(key: Any, anchor: Any) -> bool:
    return key is anchor or (type(key) is str and type(anchor) is str and key == anchor)


def _error_ids(attrs: dict = sys.__dict__) -> Tuple[int, int, int]:
    """What holds the last error (the census walks its frames), as identities; read from ``sys``'s
    dict (a missing attribute read through getattr costs an exception each time)."""
    return id(attrs.get("last_value")), id(attrs.get("last_traceback")), id(attrs.get("last_exc"))


def _out_state(out: Any) -> Tuple[int, int]:
    if type(out) is not dict:
        return (0, 0)
    length = dict.__len__(out)
    last = next(reversed(out), None) if length else None
    return (length, id(dict.get(out, last)) if last is not None else 0)


def _attributes(types: Any, obj: Any) -> Optional[dict]:
    desc = types.dict_desc.get(type(obj))
    if desc is None:
        return None
    try:
        attrs = desc.__get__(obj, type(obj))
    except Exception:  # noqa: BLE001
        return None
    return attrs if isinstance(attrs, dict) else None


def _attribute_ids(attrs: dict) -> Tuple[int, ...]:
    return tuple(map(id, dict.keys(attrs))) + tuple(map(id, dict.values(attrs)))


def _end_parameters(module: Any) -> List[Any]:
    """The first and the last parameter of a module (through its instance dicts: no user code)."""
    first = last = None
    stack = [module]
    seen = 0
    while stack and seen < 10_000:
        mod = stack.pop()
        seen += 1
        try:
            attrs = object.__getattribute__(mod, "__dict__")
        except Exception:  # noqa: BLE001
            continue
        params = attrs.get("_parameters")
        if isinstance(params, dict):
            for p in dict.values(params):
                if p is not None:
                    if first is None:
                        first = p
                    last = p
        children = attrs.get("_modules")
        if isinstance(children, dict):
            stack.extend(reversed([c for c in dict.values(children) if c is not None]))
    return [p for p in {id(first): first, id(last): last}.values() if p is not None]


def _tensor_base_grad(types: Any):
    """``TensorBase.grad``'s C getter: a subclass's property never runs."""
    for klass in type.__dict__["__mro__"].__get__(types.tensor_type):
        desc = type.__dict__["__dict__"].__get__(klass).get("grad")
        if desc is not None and not isinstance(desc, property):
            return desc.__get__
    return lambda t: None


def _state_count(opt: Any) -> int:
    try:
        state = object.__getattribute__(opt, "__dict__").get("state")
    except Exception:  # noqa: BLE001
        return -1
    return dict.__len__(state) if isinstance(state, dict) else -1
