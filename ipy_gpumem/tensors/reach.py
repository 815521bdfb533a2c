"""Which of a namespace's names a step can reach: the names its code reads, followed through the user's functions, classes and objects they hold; None where names are read in a way code does not show.

An estimate fakes the tensors a step can reach (``preflight.world``), not every tensor of the
notebook, so that its cost follows what the step uses: a list of a hundred thousand tensors the
step never names costs nothing. :func:`reach` tells which names those are, without running
anything.

From the roots (the step and its arguments) and the code objects given (a cell's), breadth first,
each object once:

- a code object gives the names its instructions load, store or delete as globals (``LOAD_GLOBAL``,
  ``LOAD_NAME``, ``STORE_NAME``...: a name a cell rebinds frees what it held), and its nested code
  objects (the functions, lambdas, comprehensions and class bodies it defines); each name the
  namespace holds is reached, and its value followed;
- a function of the user's whose globals are the namespace gives its code's names; one of another
  module of the user's gives that module, whose globals are followed whole (as the world fakes
  them whole); any function gives its closure cells, default arguments and ``__dict__`` (the
  ``__wrapped__`` of a library's decorator around a function of the user's); a bound method its
  object and function; a partial its function and arguments;
- an object (an nn.Module, an optimizer, a plain object, a library's too) gives its attributes and
  slots, and its class; a class of the user's gives every attribute of each class of the user's
  along its MRO (every method: a Dataset's ``__getitem__``, a ``forward`` inherited from a base
  class) and its metaclass;
- a container gives its items (a dict's keys too), a holder read its own way (a generator's frame,
  an ``lru_cache``, a property, a staticmethod...) what :mod:`.readers` reads of it, and a
  generator of the user's its code's names;
- tensors, scalars and containers proven to hold only those stop it (decided per type, in C for a
  large container: a reached list of a million tensors is one pass).

It gives up (None: the caller fakes every name, as before) where names can be read by a name
computed at run time: the code spells (as a global, an attribute or a string constant) one of
:data:`DYNAMIC` (``globals()``, ``vars()``, ``locals()``, ``eval``, ``exec``, ``__import__``,
``importlib.import_module``, ``__main__``, IPython's ``get_ipython``/``user_ns``, a frame's
``f_globals``, ``sys._getframe``, ``inspect``, a function's ``__globals__``, ``gc``'s referrers), or
``modules`` beside ``sys`` or ``__name__`` (``sys.modules[__name__]``); the namespace itself, or the
module whose globals it is, is met as a value (``g = globals()`` kept in an earlier cell); an
object cannot be read; or more than :data:`MAX_OBJECTS` objects are met. ``getattr`` with a name
computed at run time needs no such rule: every attribute of an object that is reached is followed,
every global of a module of the user's too, and the notebook's own module can only be had through
the spellings above.

What it cannot see (a tensor hook's function, a global read by a library on the step's behalf) the
estimate finds when the step uses a real tensor there, and estimates again faking every name
(``preflight.run``). Nothing here calls user code (every read is a builtin type's C method or
descriptor), imports torch, or keeps a reference after :func:`reach` returns.
"""
from __future__ import annotations

import dis
import sys
import types
from itertools import chain
from typing import Any, Dict, Iterable, List, Optional

from .kinds import CLASS, DICT, FUNC, MODOBJ, MODULE, OBJECT, OPTIM, PARAM, READ, SEQ
from .userfiles import is_user_file
from .walk import Walk

__all__ = ["reach", "code_names", "Unfollowable", "DYNAMIC", "MAX_OBJECTS"]

#: Spellings that let code read the namespace's names by a name computed at run time (or reach the
#: namespace itself): met as a global, an attribute or a string constant, the reach is not followed.
DYNAMIC = frozenset((
    "globals", "vars", "locals", "eval", "exec", "execfile", "__import__", "import_module", "reload",
    "run_path", "run_module", "__main__", "__builtins__", "builtins", "get_ipython", "user_ns", "user_global_ns",
    "user_module", "f_globals", "f_locals", "f_back", "tb_frame", "gi_frame", "cr_frame", "ag_frame", "_getframe",
    "currentframe", "inspect", "__globals__", "func_globals", "get_referrers", "get_referents", "get_objects",
    "getmodule",
))
#: ``sys.modules[...]``: ``modules`` is also ``nn.Module.modules()``, so it counts beside one of these.
_MODULES_WITH = frozenset(("sys", "__name__"))
#: Objects followed at most: past it the reach is not followed (the caller fakes every name).
MAX_OBJECTS = 2_000_000
#: Seconds the proofs that large containers hold only scalars may take in all (past it they are
#: opened one by one: slower, never wrong).
PROOF_BUDGET_S = 10.0
#: The instructions that read, bind or delete a global by name (a class body's too).
_GLOBAL_OPS = frozenset(dis.opmap[name] for name in (
    "LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME", "STORE_NAME", "DELETE_NAME",
    "LOAD_FROM_DICT_OR_GLOBALS") if name in dis.opmap)
_CODE_FREE = PARAM  # kinds up to this one (nothing, a tensor, a parameter) hold no code
_GROUP = 64  # a container with more items than this has its containers proven scalar-only a type at a time
_MISSING = object()
_MODULE_DICT = types.ModuleType.__dict__["__dict__"]
_TYPE_DICT = type.__dict__["__dict__"]
_MRO = type.__dict__["__mro__"]
#: A generator's (coroutine's) code, through its type's C getter.
_CODE_OF = {tp: tp.__dict__[name] for tp, name in ((types.GeneratorType, "gi_code"), (types.CoroutineType, "cr_code"),
                                                  (types.AsyncGeneratorType, "ag_code"))}


class Unfollowable(Exception):
    """The code can read names in a way no reading of it can follow; the message says which."""


def reach(api: Any, namespace: dict, roots: Iterable[Any] = (),
          codes: Iterable[types.CodeType] = ()) -> Optional[frozenset]:
    """The names of ``namespace`` that code run from ``roots`` (objects: a step, its arguments) and
    ``codes`` (code objects: a cell's) can read, or None when that cannot be told (see the module)."""
    finder = _Reach(api, namespace)
    try:
        with api.no_torch_function():
            finder.run(list(roots), list(codes))
    except Exception:  # noqa: BLE001 - Unfollowable, or code this reading did not foresee: every name, as before
        return None
    finally:
        finder.close()
    return frozenset(finder.names)


def code_names(code: types.CodeType) -> List[str]:
    """The names ``code`` (and the code it defines) loads, binds or deletes as globals, in order;
    :class:`Unfollowable` when it spells one of :data:`DYNAMIC`."""
    out: List[str] = []
    stack, seen = [code], set()
    while stack:
        one = stack.pop()
        if id(one) in seen:
            continue
        seen.add(id(one))
        _check(one)
        out.extend(ins.argval for ins in dis.get_instructions(one) if ins.opcode in _GLOBAL_OPS)
        stack.extend(c for c in one.co_consts if type(c) is types.CodeType)
    return out


def _check(code: types.CodeType) -> None:
    names = code.co_names
    if not DYNAMIC.isdisjoint(names):
        raise Unfollowable(f"{code.co_name} uses {sorted(DYNAMIC.intersection(names))[0]}")
    if "modules" in names and not _MODULES_WITH.isdisjoint(names):
        raise Unfollowable(f"{code.co_name} reads sys.modules")
    for const in code.co_consts:
        parts = const if type(const) in (tuple, frozenset) else (const,)
        for part in parts:
            if type(part) is str and part in DYNAMIC:
                raise Unfollowable(f"{code.co_name} spells {part!r}")


class _Reach:
    """One reach: the names found, the objects to follow, and what was followed (by id, kept alive
    until :meth:`close`, so that no id is reused meanwhile)."""

    def __init__(self, api: Any, namespace: dict):
        self.namespace = namespace
        # The tensors room's helpers: kinds by type, instance dicts and slots through C descriptors,
        # proofs in C that containers hold only scalars, the readers of holders read their own way.
        self.walk = Walk(api, None, budget_s=PROOF_BUDGET_S, caches=False)
        self.kinds = self.walk.types
        self.names: set = set()
        self.pending: List[Any] = []  # names to look up
        self.stack: List[Any] = []  # objects to follow
        self.seen: Dict[int, Any] = {}
        self.classes: Dict[int, Any] = {}

    def close(self) -> None:
        self.stack, self.seen, self.classes, self.pending = [], {}, {}, []
        self.namespace = None

    def run(self, roots: List[Any], codes: List[types.CodeType]) -> None:
        for code in codes:
            self.code(code)
        self.stack.extend(roots)
        ns = self.namespace
        while self.stack or self.pending:
            while self.pending:
                name = self.pending.pop()
                if type(name) is not str or name in self.names:
                    continue
                value = dict.get(ns, name, _MISSING)
                if value is not _MISSING:
                    self.names.add(name)
                    self.stack.append(value)
            while self.stack:
                self.follow(self.stack.pop())

    def code(self, code: types.CodeType) -> None:
        if id(code) not in self.seen:
            self.seen[id(code)] = code
            self.pending.extend(code_names(code))

    def follow(self, obj: Any) -> None:
        if obj is self.namespace:
            raise Unfollowable("the namespace is held as a value")
        tp = type(obj)
        kind = self.kinds.kinds.get(tp)
        if kind is None:
            kind = self.kinds.classify(tp)
        if kind <= _CODE_FREE:
            if tp is types.CodeType:
                self.code(obj)
            return
        if id(obj) in self.seen:
            return
        self.seen[id(obj)] = obj
        if len(self.seen) > MAX_OBJECTS:
            raise Unfollowable(f"more than {MAX_OBJECTS:,} objects")
        try:
            self.open(obj, tp, kind)
        except Unfollowable:
            raise
        except Exception as exc:  # noqa: BLE001 - what cannot be read cannot be followed
            raise Unfollowable(f"a {tp.__name__} could not be read: {type(exc).__name__}") from None

    def open(self, obj: Any, tp: type, kind: int) -> None:
        if kind == DICT:
            self.many(chain(dict.keys(obj), dict.values(obj)))
        elif kind == SEQ:
            self.many(self.kinds.seq_iter[tp](obj))
        elif kind in (MODULE, OPTIM, OBJECT):
            attrs = self.walk.attributes(obj)
            if attrs is not None:
                self.many(dict.values(attrs))
            self.klass(tp)
        elif kind == FUNC:
            self.function(obj, tp)
        elif kind == CLASS:
            self.klass(obj)
        elif kind == MODOBJ:
            self.module(obj)
        elif kind == READ:
            code_of = _CODE_OF.get(tp)
            if code_of is not None:  # a generator's code reads its globals when it goes on
                code = code_of.__get__(obj, tp)
                if is_user_file(code.co_filename):
                    self.code(code)
            self.many(value for _step, _key, value in self.kinds.readers[tp](self.walk, obj))

    def many(self, values: Iterable[Any]) -> None:
        """Follow what a container holds, but for tensors, scalars and (in a large container) the
        containers proven to hold only scalars, a type at a time, in C."""
        items = list(values)
        if not items:
            return
        tps = list(set(map(type, items)))
        found = self.walk.kinds_of(tps)
        stop = {tp for tp, kind in zip(tps, found) if kind <= _CODE_FREE and tp is not types.CodeType}
        if len(items) > _GROUP:
            for tp, kind in zip(tps, found):
                if DICT <= kind <= OBJECT and kind != READ:
                    group = [v for v in items if type(v) is tp]
                    if len(group) > 1 and self.walk.inert(tp, group, 1):
                        stop.add(tp)
                        if kind == OBJECT:
                            self.klass(tp)  # proven to hold no tensor, but their methods' code reads names
        if len(stop) == len(tps):
            return
        self.stack.extend(v for v in items if type(v) not in stop)

    def function(self, fn: Any, tp: type) -> None:
        if tp is types.MethodType:
            self.stack.extend((fn.__self__, fn.__func__))
            return
        if tp is not types.FunctionType:  # functools.partial
            self.stack.extend((fn.func, fn.args, fn.keywords))
            return
        code = fn.__code__
        if is_user_file(code.co_filename):
            globals_ = fn.__globals__
            if globals_ is self.namespace:
                self.code(code)
            else:
                module = sys.modules.get(fn.__module__) if isinstance(fn.__module__, str) else None
                if module is not None and _MODULE_DICT.__get__(module) is globals_:
                    self.stack.append(module)  # a module of the user's: its globals, whole
        # Any function's (a library's decorator closes over the user's function, or keeps it in
        # ``__wrapped__``): its closure cells, default arguments and attributes.
        for cell in fn.__closure__ or ():
            try:
                self.stack.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        if fn.__defaults__:
            self.stack.append(fn.__defaults__)
        if fn.__kwdefaults__:
            self.stack.append(fn.__kwdefaults__)
        attrs = self.walk.instance_dict(fn)
        if attrs:
            self.many(dict.values(attrs))

    def klass(self, cls: type) -> None:
        """A class: every attribute of each class of the user's along its MRO, and its metaclass."""
        if id(cls) in self.classes:
            return
        self.classes[id(cls)] = cls
        for base in _MRO.__get__(cls):
            if id(base) in self.classes and base is not cls:
                continue
            self.classes[id(base)] = base
            if base is not object and self.users(base):
                self.many(_TYPE_DICT.__get__(base).values())
        meta = type(cls)
        if meta is not type and self.users(meta):
            self.klass(meta)

    def users(self, cls: type) -> bool:
        """A class the user wrote: defined in a module of theirs, or holding a function of theirs (a
        class defined in code run with ``exec`` has no module of its own)."""
        if self.walk.user_class(cls):
            return True
        for value in _TYPE_DICT.__get__(cls).values():
            if type(value) in (staticmethod, classmethod):
                value = value.__func__
            elif type(value) is property:
                value = value.fget
            if type(value) is types.FunctionType and is_user_file(value.__code__.co_filename):
                return True
        return False

    def module(self, module: Any) -> None:
        attrs = _MODULE_DICT.__get__(module)
        if attrs is self.namespace:
            raise Unfollowable("the notebook's module is held as a value")
        if self.kinds.is_user_module(module):
            self.many(v for k, v in list(dict.items(attrs))
                      if not (type(k) is str and k.startswith("__") and k.endswith("__")))
