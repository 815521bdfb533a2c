"""How a walk treats each object, decided once per type: tensor, module, optimizer, container, a holder read its own way, the user's code, or nothing to look at; and the cheap proof that a container holds only scalars.

Most of a namespace is scalars, strings, numpy arrays and containers of them. Those are recognised
in C, a whole group of containers of one type at a time (``set(map(type, chain.from_iterable(...)))``),
so a million small variables cost a few hundred milliseconds and none of them a Python step. A dict's
keys count as much as its values (a tensor can be a key). A very large container (a list of a
million ints) is proven scalar-only once, in full, and then re-checked a small slice at a time on
later walks while its length stays the same (:class:`_Inert`), so a count that runs at every cell
costs a fraction of a millisecond for it; its verdict is dropped the moment a slice, or its length,
says otherwise.

Holders that are neither containers nor plain objects are read their own way (:data:`READ`, see
:mod:`.readers`): an ``lru_cache``'s entries, a suspended generator's frame, a numpy object array,
a pandas object column, a Future's result, a ``threading.local``, an asyncio queue, a
``LoggerAdapter``'s extra, a ``MappingProxyType``, an exception's arguments, a property's
functions, a ``weakref.finalize``'s arguments, and any other C object through ``gc.get_referents``
(the type's own C traversal: no user code). A numeric numpy array holds nothing.

The user's code is walked too, because it holds tensors: a function's closure cells and default
arguments, a class's attributes, a module's globals. Only code the user wrote counts (defined in a
notebook or in a file outside the Python installation and its site-packages); a library's
functions and modules are its own business and are not walked, and neither are the objects of the
session's own machinery (:data:`SKIP_PACKAGES`: IPython, the kernel, the event loop, plotting).

Type decisions are kept across walks (per torch), so a census at every line pays for them once.
"""
from __future__ import annotations

import functools
import sys
import types
from collections import defaultdict, deque
from itertools import chain, compress, islice, repeat
from operator import is_, not_
from typing import Any, Dict, Iterator, List, Optional, Tuple

from . import readers
from .userfiles import is_user_file

__all__ = ["SKIP", "TENSOR", "PARAM", "MODULE", "OPTIM", "DICT", "SEQ", "READ", "OBJECT", "FUNC", "CLASS", "MODOBJ",
           "TypeCache", "type_cache", "KindsMixin", "SKIP_PACKAGES", "LARGE", "RECHECK"]

# How an object is walked. SKIP is 0 so that "kind" reads as a truth value; kinds >= DICT are
# opened a level at a time (their contents wait for the next level); DICT..OBJECT hold data
# (proven scalar-only in C where they can be), kinds above OBJECT are the user's code.
SKIP, TENSOR, PARAM, MODULE, OPTIM, DICT, SEQ, READ, OBJECT, FUNC, CLASS, MODOBJ = range(12)
_UNSEEN = 255  # no kind yet (kinds fit in a byte)

SCALAR_TYPES = (
    int, float, complex, bool, str, bytes, bytearray, type(None), range, slice,
    type(Ellipsis), type(NotImplemented), memoryview,
)
# Never opened: code objects, frames, descriptors of C types (functions, classes and modules have
# kinds of their own; generators, exceptions and properties are read by :mod:`.readers`).
_OPAQUE_TYPES = (
    types.CodeType, types.FrameType, types.TracebackType,
    types.WrapperDescriptorType, types.MethodDescriptorType,
    types.ClassMethodDescriptorType, types.GetSetDescriptorType, types.MemberDescriptorType,
)
_SEQ_BASES = (list, tuple, set, frozenset, deque)
#: Packages whose objects are the session's machinery, not the user's data: never opened. Walking
#: them would find the user namespace again (e.g. ``exit._ip.user_ns``) under misleading names.
#: The holders users keep data in that live in some of them (a numpy array, a pandas frame, a
#: Future, a ``threading.local``, an asyncio queue, a ``LoggerAdapter``) are read by
#: :mod:`.readers` before this list is looked at.
SKIP_PACKAGES = frozenset((
    "IPython", "ipykernel", "traitlets", "jupyter_client", "jupyter_core", "zmq", "tornado",
    "ipywidgets", "plotly", "matplotlib", "asyncio", "logging", "threading", "concurrent",
    "multiprocessing", "socket", "ssl", "subprocess", "ipy_gpumem", "comm", "debugpy", "numpy", "pandas",
))
_C_DESCRIPTORS = (types.GetSetDescriptorType, types.MemberDescriptorType)
_HAVE_GC = 1 << 14  # Py_TPFLAGS_HAVE_GC: only such types can hold other objects
_GROUP = 1024  # containers of one type tested together for "holds only scalars"
_SLICE = 1 << 16  # items scanned in C between two looks at the clock
_HEAD = 256  # items looked at first, to choose between reading types only and listing the items
#: A container whose proof touched more items than this is remembered and re-checked a slice per walk.
LARGE = 1 << 16
#: About this many items (below the container) are re-checked per walk: a fraction of a
#: millisecond, so the two walks of a cell that moves memory stay cheap beside a list of a
#: million ints (a replaced item is seen within ``length / RECHECK`` walks, as the docstring says).
RECHECK = 1 << 11
#: Builtin containers longer than this are proven one by one (so that the proof can be remembered).
_ALONE = 1024
#: Larger builtin containers are proven a part at a time, resumably (see ``_inert_in_parts``): parts
#: of about _PART items below them, at most _CHUNK of their own items, the first one _FIRST_PART.
_PART = 1 << 16
_CHUNK = 1 << 16
_FIRST_PART = 256
_SIZED = frozenset((list, tuple, dict, set, frozenset))
_MEMO_SIZE = 256
#: Values proven a slice at a time: every object of a slice is read from memory once, then looked at
#: again (its type, its length, its items) while it is still in the cache.
_SUB = 4096
_INDEX = list(range(_SUB))  # positions in a slice, made once
_ALL_LEVELS = 1 << 30  # a proof that found only scalars one level down holds at any depth
_GONE = object()


class _Inert:
    """A large container proven to hold only scalars ``levels`` deep: its type and length then, how
    many of its items a re-check takes (about :data:`LARGE` items below them), and where the next starts."""

    __slots__ = ("tp", "length", "levels", "stride", "cursor")

    def __init__(self, tp: type, length: int, levels: int, stride: int):
        self.tp, self.length, self.levels, self.stride, self.cursor = tp, length, levels, stride, 0


class TypeCache:
    """What is decided once per type (and per user file), kept across walks for one torch."""

    def __init__(self, api: Any):
        torch = api.torch
        self.tensor_type = torch.Tensor
        nn_module = sys.modules.get("torch.nn.modules.module")
        parameter = sys.modules.get("torch.nn.parameter")
        optimizer = sys.modules.get("torch.optim.optimizer")
        self.module_type = getattr(nn_module, "Module", None)
        self.parameter_type = getattr(parameter, "Parameter", None)
        self.optimizer_type = getattr(optimizer, "Optimizer", None)
        self.plain_tensor_types = {torch.Tensor} | ({self.parameter_type} if self.parameter_type else set())
        # An nn.Module's own bookkeeping (what Module.__init__ sets): walked by the module's own rules.
        try:
            self.module_internals = frozenset(self.module_type().__dict__) if self.module_type else frozenset()
        except Exception:  # noqa: BLE001
            self.module_internals = frozenset()
        self.kinds: Dict[type, int] = dict.fromkeys(SCALAR_TYPES, SKIP)
        self.skip_types = set(SCALAR_TYPES)  # the types whose kind is SKIP, for tests in C
        self.seq_iter: Dict[type, Any] = {}
        self.dict_desc: Dict[type, Any] = {}
        self.slot_desc: Dict[type, tuple] = {}
        self.user_modules: Dict[str, bool] = {}
        self.user_classes: Dict[type, bool] = {}  # classes the user wrote (filled by classify)
        self.inert: Dict[int, _Inert] = {}  # id of a large container -> its verdict
        # id of a large container -> (type, length, levels, items proven, deepest level, visits, part
        # size) of a proof a budget stopped, taken up by the next walk.
        self.partial: Dict[int, tuple] = {}
        #: READ types: ``reader(walk, obj) -> [(step, key, value)]`` (see :mod:`.readers`).
        self.readers: Dict[type, Any] = {}
        #: READ types whose instances can be proven empty in C, a group at a time: ``test(group) -> bool``.
        self.group_empty: Dict[type, Any] = {}
        for tp in (list, tuple, dict, set, frozenset):  # the proofs' own slices are lists
            self.classify(tp)

    def classify(self, tp: type) -> int:
        """Decide once per type how its instances are walked."""
        try:
            kind = self._classify(tp)
        except Exception:  # noqa: BLE001
            kind = SKIP
        self.kinds[tp] = kind
        if kind == SKIP:
            self.skip_types.add(tp)
        return kind

    def _classify(self, tp: type) -> int:
        if issubclass(tp, self.tensor_type):
            if self.parameter_type is not None and issubclass(tp, self.parameter_type):
                return PARAM
            return TENSOR
        if self.module_type is not None and issubclass(tp, self.module_type):
            return MODULE
        if self.optimizer_type is not None and issubclass(tp, self.optimizer_type):
            return OPTIM
        if issubclass(tp, dict):
            return DICT
        for base in _SEQ_BASES:
            if issubclass(tp, base):
                # The base's C methods: a subclass's Python __iter__/__len__ never run.
                self.seq_iter[tp] = base.__iter__
                return SEQ
        if tp is types.FunctionType or tp is types.MethodType or tp is functools.partial:
            return FUNC
        if issubclass(tp, type):
            return CLASS
        if issubclass(tp, types.ModuleType):
            return MODOBJ
        if issubclass(tp, SCALAR_TYPES):
            return SKIP
        found = readers.reader_for(tp)  # holders read their own way (before the machinery's packages)
        if found is not None:
            reader, group_test = found
            self.readers[tp] = reader
            if group_test is not None:
                self.group_empty[tp] = group_test
            return READ
        if issubclass(tp, _OPAQUE_TYPES):
            return SKIP
        module = type.__dict__["__module__"].__get__(tp)
        if not isinstance(module, str) or module.partition(".")[0] in SKIP_PACKAGES:
            return SKIP
        desc = self._dict_descriptor(tp)
        slots = self._slot_descriptors(tp)
        if desc is None and not slots:
            # A C object: it holds other objects only if its type takes part in garbage collection,
            # and then its own C traversal (gc.get_referents) says which, without running anything.
            if type.__dict__["__flags__"].__get__(tp) & _HAVE_GC:
                self.readers[tp] = readers.read_referents
                return READ
            return SKIP
        if desc is not None:
            self.dict_desc[tp] = desc
        self.slot_desc[tp] = slots
        owner = sys.modules.get(module)
        self.user_classes[tp] = owner is not None and self.is_user_module(owner)
        return OBJECT

    @staticmethod
    def _dict_descriptor(tp: type) -> Any:
        """The C ``__dict__`` getter of ``tp``, or None if instances have no plain ``__dict__``.

        A class may define ``__dict__`` as a property (proxies do); then we stay out.
        """
        for klass in type.__dict__["__mro__"].__get__(tp):
            desc = type.__dict__["__dict__"].__get__(klass).get("__dict__")
            if desc is not None:
                # C getters only (classes' getset, SimpleNamespace's member); a Python
                # property named __dict__ would be user code.
                return desc if type(desc) in _C_DESCRIPTORS else None
        return None

    @staticmethod
    def _slot_descriptors(tp: type) -> tuple:
        """``(name, C member descriptor)`` of every ``__slots__`` entry along the MRO (dataclasses with slots)."""
        out = []
        for klass in type.__dict__["__mro__"].__get__(tp):
            if klass is object:
                continue
            attrs = type.__dict__["__dict__"].__get__(klass)
            slots = attrs.get("__slots__")
            if not slots:
                continue
            for name in (slots,) if isinstance(slots, str) else slots:
                desc = attrs.get(name) if isinstance(name, str) else None
                if type(desc) is types.MemberDescriptorType:
                    out.append((name, desc))
        return tuple(out)

    def is_user_module(self, module: Any) -> bool:
        """A module the user wrote: ``__main__``, or a file outside the installation's libraries."""
        try:
            name = types.ModuleType.__dict__["__dict__"].__get__(module).get("__name__")
        except Exception:  # noqa: BLE001
            return False
        if not isinstance(name, str):
            return False
        if name == "__main__":
            return True  # the notebook's (or the script's) own module
        known = self.user_modules.get(name)
        if known is None:
            attrs = types.ModuleType.__dict__["__dict__"].__get__(module)
            top = name.partition(".")[0]
            known = top not in SKIP_PACKAGES and top != "torch" and is_user_file(attrs.get("__file__"))
            self.user_modules[name] = known
        return known


_CACHES: Dict[int, TypeCache] = {}


def type_cache(api: Any) -> TypeCache:
    """The :class:`TypeCache` of one torch (made on first use)."""
    cache = _CACHES.get(id(api))
    if cache is None:
        cache = _CACHES[id(api)] = TypeCache(api)
    return cache


class KindsMixin:
    """The part of a walk that classifies objects and proves containers scalar-only.

    Uses the walk's ``types`` (:class:`TypeCache`), ``visits`` and :meth:`out_of_budget`.
    """

    types: TypeCache

    def kind_of(self, value: Any) -> int:
        """How ``value`` is walked, decided by its type (never by ``__class__``)."""
        kind = self.types.kinds.get(type(value))
        return self.types.classify(type(value)) if kind is None else kind

    def kinds_of(self, tps: List[type]) -> bytes:
        """The kinds of the types ``tps``, one byte each, in C (a type not seen yet is classified first;
        bytes, so that ``translate`` sorts them by kind at memory speed)."""
        kinds = self.types.kinds
        found = bytes(map(kinds.get, tps, repeat(_UNSEEN)))
        if _UNSEEN in found:
            for tp in set(compress(tps, map(_UNSEEN.__eq__, found))):
                self.types.classify(tp)
            found = bytes(map(kinds.__getitem__, tps))
        return found

    def is_tensor(self, value: Any) -> bool:
        """True for real tensors (by type, never by ``__class__``)."""
        kind = self.kind_of(value)
        return kind == TENSOR or kind == PARAM

    def instance_dict(self, obj: Any) -> Optional[dict]:
        """``obj.__dict__`` read through the C descriptor (no ``__getattr__``), or None."""
        tp = type(obj)
        cache = self.types
        desc = cache.dict_desc.get(tp)
        if desc is None:
            desc = cache._dict_descriptor(tp)
            if desc is None:
                return None
            cache.dict_desc[tp] = desc
        try:
            value = desc.__get__(obj, tp)
        except Exception:  # noqa: BLE001
            return None
        return value if isinstance(value, dict) else None

    def attributes(self, obj: Any) -> Optional[dict]:
        """An object's attributes: its ``__dict__`` and its slots (read through C descriptors), or None."""
        slots = self.types.slot_desc.get(type(obj), ())
        attrs = self.instance_dict(obj)
        if not slots:
            return attrs
        out = dict(attrs) if attrs is not None else {}
        for name, desc in slots:
            try:
                out[name] = desc.__get__(obj, type(obj))
            except AttributeError:  # an unset slot
                continue
        return out

    def values_of(self, obj: Any, kind: int) -> Any:
        """An iterator over what container ``obj`` holds (a dict's keys too), through builtin C methods
        only; None if unreadable."""
        if kind == DICT:
            return chain(dict.keys(obj), dict.values(obj))
        if kind == SEQ:
            return self.types.seq_iter[type(obj)](obj)
        if kind == OBJECT:
            attrs = self.attributes(obj)
            return None if attrs is None else dict.values(attrs)
        return None  # code and other holders: opened one by one

    def scalars_only(self, obj: Any, kind: int) -> bool:
        """True when container ``obj`` holds only values of skipped types (one C pass, or a slice of a
        large container already proven); a holder read its own way only when its type has a C test."""
        if kind > OBJECT:
            return False  # the user's code: looked at one by one
        cache = self.types
        if kind == READ:
            test = cache.group_empty.get(type(obj))
            try:
                return test is not None and test([obj])
            except Exception:  # noqa: BLE001
                return False
        if kind == OBJECT and cache.user_classes.get(type(obj)) and not self.class_holds_nothing(type(obj)):
            return False  # an instance of the user's class: its class attributes are looked at too
        try:
            if type(obj) in (list, tuple, dict) and len(obj) > _ALONE:
                return self.inert(type(obj), [obj], 1)
            values = self.values_of(obj, kind)
            return values is None or cache.skip_types.issuperset(map(type, values))
        except Exception:  # noqa: BLE001 - changed size during iteration (another thread)
            return False

    def inert(self, tp: type, group: List[Any], levels: int) -> bool:
        """True when no container in ``group`` (all of type ``tp``) holds anything but scalars
        within ``levels`` levels: ``levels=1`` looks at their items, ``2`` also inside those.

        All in C (``chain.from_iterable`` of the builtin C iterators, ``map(type, ...)``), so a
        million small records cost a few passes over memory instead of a Python step each. One
        list, tuple or dict whose proof touched more than :data:`LARGE` items is remembered and,
        while its length stays the same, re-checked about :data:`RECHECK` items per walk. One
        found to hold more than scalars is not looked at again in the same walk.
        """
        cache = self.types
        kind = cache.kinds[tp]
        if kind == READ:
            test = cache.group_empty.get(tp)
            try:
                return test is not None and test(group)
            except Exception:  # noqa: BLE001
                return False
        if kind > OBJECT or (kind == OBJECT and cache.user_classes.get(tp) and not self.class_holds_nothing(tp)):
            return False  # the user's code, and instances of the user's classes whose class holds something: one by one
        single = group[0] if len(group) == 1 and tp in (list, tuple, dict) else None
        refuted = getattr(self, "refuted", None)
        if single is not None:
            if refuted is not None and id(single) in refuted:
                return False
            known = cache.inert.get(id(single))
            if known is not None:
                if known.tp is tp and known.length == len(single) and known.levels >= levels:
                    return self._recheck(single, known)
                cache.inert.pop(id(single), None)
        before = self.visits
        if single is not None and len(single) > _ALONE:
            verdict, depth = self._inert_in_parts(single, levels)
            touched = self.proof_visits if verdict else 0
        else:
            verdict, depth = self._inert(tp, group, levels)
            touched = self.visits - before
        if single is not None:
            if verdict and touched > LARGE:
                memo = cache.inert
                if len(memo) >= _MEMO_SIZE:
                    memo.pop(next(iter(memo)))
                memo[id(single)] = _Inert(tp, len(single), _ALL_LEVELS if depth <= 1 else levels,
                                          max(1, len(single) * RECHECK // touched))
            elif not verdict and refuted is not None and len(single) > _ALONE and not self.stopped_early():
                refuted.add(id(single))  # it holds more than scalars: the walk opens it, once
        return verdict

    def class_holds_nothing(self, cls: type, depth: int = 0) -> bool:
        """Whether a class of the user's holds nothing the walk would find through it (its attributes
        scalars, or functions with no closure, defaults or module of the user's other than the
        notebook's): then a million of its instances are proven together, in C, by their own
        attributes. Decided once per walk (``class_memo``), since class attributes can change."""
        memo = getattr(self, "class_memo", None)
        if memo is not None and id(cls) in memo:
            return memo[id(cls)]
        verdict = self._class_holds_nothing(cls, depth)
        if memo is not None:
            memo[id(cls)] = verdict
        return verdict

    def _class_holds_nothing(self, cls: type, depth: int) -> bool:
        try:
            attrs = type.__dict__["__dict__"].__get__(cls)
            values = [v for k, v in list(attrs.items()) if not (type(k) is str and k[:2] == "__" and k[-2:] == "__")]
        except Exception:  # noqa: BLE001
            return False
        skip = self.types.skip_types
        for value in values:
            if type(value) in skip:
                continue
            if type(value) in (staticmethod, classmethod):
                value = value.__func__
            if type(value) is not types.FunctionType:
                return False  # a property, a nested class, a cache, data: the walk looks at it
            if value.__closure__ or value.__defaults__ or value.__kwdefaults__:
                return False
            module = sys.modules.get(value.__module__) if type(value.__module__) is str else None
            if module is not None and module.__name__ != "__main__" and self.types.is_user_module(module):
                return False  # its module's globals are walked through it
        return True

    def _inert_in_parts(self, container: Any, levels: int) -> Tuple[bool, int]:
        """A large list, tuple or dict proven a part at a time (parts of about :data:`_PART` items
        below them: 16 rows of a 4096 x 4096 grid, 4096 ints), with a look at the clock between
        parts; a proof a budget stopped is taken up where it stopped by the next walk
        (:attr:`TypeCache.partial`), so a structure larger than one budget is proven over a few counts."""
        cache = self.types
        tp, length = type(container), len(container)
        partial = cache.partial.get(id(container))
        start, deepest, visits, size = 0, 1, 0, _FIRST_PART
        if partial is not None and partial[0] is tp and partial[1] == length and partial[2] >= levels:
            # Taken up where it stopped, at its own depth (a deeper proof answers a shallower question:
            # nothing to find either way).
            levels, start, deepest, visits, size = partial[2:7]
        cache.partial.pop(id(container), None)
        if tp is dict:
            # Values, then keys, read in order from where the proof stopped (a dict has no random
            # access: skipping there reads what is before once, in C).
            source = chain(dict.values(container), dict.keys(container))
            deque(islice(source, start), maxlen=0)
            total = 2 * length
        else:
            total = length
        begin = start
        while begin < total:
            if self.out_of_budget():
                self._keep_partial(container, (tp, length, levels, begin, deepest, visits, size))
                return False, levels  # not proven yet: the walk says what it left; the next goes on
            before = self.visits
            if tp is dict:
                part = list(islice(source, size))
                if not part:
                    return False, levels  # changed while read
            else:
                part = container[begin:begin + size]
                part = part if type(part) is list else list(part)
            weight = len(part)
            if _SIZED.issuperset(map(type, part)):  # builtin containers: their lengths, in C
                weight += sum(map(len, part))
            verdict, depth = self._inert(list, [part], levels)
            self.visits += weight - min(weight, self.visits - before)  # every item below counts once
            if not verdict:
                if self.stopped_early():  # the budget ran out inside this part: smaller parts next time
                    self._keep_partial(container, (tp, length, levels, begin, deepest, visits, max(1, size // 4)))
                return False, levels
            visits += self.visits - before
            deepest = max(deepest, depth)
            begin += len(part)
            size = max(1, min(_CHUNK, size * _PART // max(1, weight)))
        self.proof_visits = visits  # the whole proof's, over every walk that took part in it
        return True, deepest

    def _keep_partial(self, container: Any, state: tuple) -> None:
        partial = self.types.partial
        if len(partial) >= _MEMO_SIZE:
            partial.pop(next(iter(partial)))
        partial[id(container)] = state

    def stopped_early(self) -> bool:
        """Whether a budget stopped the proofs (then "not proven" is no verdict)."""
        return bool(getattr(self, "stopped", None))

    def _recheck(self, container: Any, known: "_Inert") -> bool:
        """One slice of a container proven scalar-only before: still so? (Drops the verdict if not.)"""
        start, stop = known.cursor, known.cursor + known.stride
        if known.tp is dict:
            # A dict has no random access (skipping to a slice touches every value before it): its
            # oldest and its newest items, in turn.
            ends = (dict.values(container), dict.keys(container))
            if start:
                ends = tuple(map(reversed, ends))
            part = list(chain(islice(ends[0], known.stride), islice(ends[1], known.stride)))
            stop = known.length if start else known.stride
        else:
            part = list(container[start:stop]) if known.tp is tuple else container[start:stop]
        verdict, _ = self._inert(list, [part], known.levels)
        if verdict:
            known.cursor = 0 if stop >= known.length else stop
            return True
        self.types.inert.pop(id(container), None)
        return False

    def _inert(self, tp: type, group: List[Any], levels: int) -> Tuple[bool, int]:
        """``(verdict, levels looked into)``: 1 when the containers' own items were all scalars."""
        cache = self.types
        skip = cache.skip_types
        try:
            self.visits += len(group)
            parts = []
            found: set = set()
            for part_of, size in self.parts(tp, group):
                scanned = self._scan(part_of(), levels > 1, size)
                if scanned is None:
                    return False, levels  # not proven empty: the caller's walk reports it as not examined
                parts.append((part_of,) + scanned)
                found |= scanned[0]
            kinds = cache.kinds
            for other in found.difference(kinds):
                cache.classify(other)
            others = found.difference(skip)
            if not others:
                return True, 1
            if levels <= 1:
                return False, levels
            for other in others:
                kind = kinds[other]
                if kind < DICT or kind > OBJECT or (kind == READ and other not in cache.group_empty):
                    return False, levels  # a tensor, a module, the user's code: no need to look closer
            values: List[Any] = []
            tps: List[type] = []
            for part_of, part_found, part_values, part_tps in parts:
                if part_found.issubset(skip):
                    continue  # a dict's keys, nearly always: nothing in them to look into
                if part_values is None:  # containers are there after all: look closer
                    part_values = list(part_of())
                    part_tps = list(map(type, part_values))
                values += part_values
                tps += part_tps
        except Exception:  # noqa: BLE001 - an odd instance: let the item-by-item path look at each one
            return False, levels
        for other in others:
            if not self.inert(other, list(compress(values, map(is_, tps, repeat(other)))), levels - 1):
                return False, levels
        return True, levels

    def _scan(self, items: Iterator[Any], listed: bool,
              size: Optional[int]) -> Optional[Tuple[set, Optional[List[Any]], Optional[List[type]]]]:
        """``(types found, the items, their types)`` of one iterator of children (``size`` of them, when
        known), or None when the budget ran out. The first items tell which pass fits: scalars there,
        types only for the rest (listing them, and dropping the list, would touch every object twice
        more; the items are None then); records there and ``listed``, the items are listed with their
        types (they are looked into next). A few items (``size`` at most a slice) go in one pass."""
        skip = self.types.skip_types
        if size is not None and size <= _SLICE:
            values = list(islice(items, _HEAD))
            found = set(map(type, values))
            if not listed or found.issubset(skip):
                found.update(map(type, items))
                return found, None, None
            values += items
            tps = list(map(type, values))
            return set(tps), values, tps
        values = list(islice(items, _HEAD))
        tps: Optional[List[type]] = list(map(type, values))
        found = set(tps)
        if not listed or found.issubset(skip):
            values = tps = None
        # A slice at a time, with a look at the clock between slices: a list of fifty million ints
        # must not stall the kernel either.
        while True:
            if values is None:
                found.update(map(type, islice(items, _SLICE)))
            else:
                part = list(islice(items, _SLICE))
                part_types = list(map(type, part))
                found.update(part_types)
                values += part
                tps += part_types
            following = next(items, _GONE)
            if following is _GONE:
                return found, values, tps
            found.add(type(following))
            if values is not None:
                values.append(following)
                tps.append(type(following))
            self.visits += _SLICE
            if self.out_of_budget():
                return None

    def parts(self, tp: type, group: List[Any]) -> Tuple[Tuple[Any, Optional[int]], ...]:
        """What the containers in ``group`` (all of type ``tp``) hold, as functions that chain it anew
        through C iterators only, each with how many items that is when the builtin types' own lengths
        say: a dict's values, then its keys (apart: the keys are nearly always strings, read for their
        types only whatever the values hold)."""
        cache = self.types
        kind = cache.kinds[tp]
        size = sum(map(len, group)) if tp in _SIZED else None
        if kind == DICT:
            return ((lambda: chain.from_iterable(map(dict.values, group)), size),
                    (lambda: chain.from_iterable(map(dict.keys, group)), size))
        if kind == SEQ:
            return ((lambda: chain.from_iterable(map(cache.seq_iter[tp], group)), size),)
        if cache.slot_desc.get(tp):
            return ((lambda: chain.from_iterable(dict.values(self.attributes(obj) or {}) for obj in group), None),)
        return ((lambda: chain.from_iterable(map(dict.values, map(cache.dict_desc[tp].__get__, group))), None),)

    def suspects(self, values: List[Any], levels: int, tps: Optional[List[type]] = None) -> List[int]:
        """Positions of ``values`` that may hold a tensor within ``levels`` levels, in order.

        Scalars are dropped by type (``tps``: their types, when the caller has them); containers are
        tested in groups of one type (``_GROUP`` at a time) with :meth:`inert`, so only groups that
        hold something are walked item by item. When the budget runs out, what was not proven is
        kept (the caller's walk then says it was not examined).
        """
        if tps is None:
            tps = list(map(type, values))
        if len(values) <= _SUB:
            return self._suspects(values, levels, tps)
        kept: List[int] = []
        for start in range(0, len(values), _SUB):
            kept += map(start.__add__, self._suspects(values[start:start + _SUB], levels, tps[start:start + _SUB]))
        return kept

    def _suspects(self, values: List[Any], levels: int, tps: List[type]) -> List[int]:
        """:meth:`suspects` of one slice: its containers are touched while still in the cache."""
        cache = self.types
        kinds = cache.kinds
        # The positions of what is not a scalar, then those handed to their type's list: two passes
        # over the types, whatever the number of types.
        positions = list(compress(_INDEX, self.kinds_of(tps)))
        if not positions or self.out_of_budget():
            return positions  # nothing to prove, or no time to: the caller says what was not examined
        by_type: Dict[type, List[int]] = defaultdict(list)
        any(map(list.append, map(by_type.__getitem__, map(tps.__getitem__, positions)), positions))
        kept = []
        for tp, mine in by_type.items():
            kind = kinds[tp]
            if kind < DICT or kind > OBJECT or (kind == READ and tp not in cache.group_empty):
                kept += mine
                continue
            if self.out_of_budget():
                kept += mine
                continue
            group = list(map(values.__getitem__, mine))
            if tp in (list, tuple, dict) and max(map(len, group)) > _ALONE:
                # A large builtin container goes alone, through the memo of proven ones.
                small = list(map(_ALONE.__ge__, map(len, group)))
                for position, value in zip(compress(mine, map(not_, small)), compress(group, map(not_, small))):
                    if not self.inert(tp, [value], levels):
                        kept.append(position)
                mine, group = list(compress(mine, small)), list(compress(group, small))
            if len(mine) > _GROUP and self.inert(tp, group, levels):
                continue  # the usual case, in one go: a million records of scalars
            for start in range(0, len(mine), _GROUP):
                if self.out_of_budget():
                    kept += mine[start:]
                    break
                if not self.inert(tp, group[start:start + _GROUP], levels):
                    kept += mine[start:start + _GROUP]
        kept.sort()
        return kept
