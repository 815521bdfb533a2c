"""How the walk reads the holders that are neither containers nor plain objects, through C-level reads only: caches, generators' frames, object arrays, data frames, futures, thread-locals, queues, exceptions, properties, finalizers and other C objects.

Each reader takes the walk and one object and returns ``[(step, key, value)]``: what the object
keeps alive and how to name it (steps of :mod:`.paths`; ``VIA`` appends its key as text where
Python has no spelling, e.g. ``load.<lru_cache>[0]``). Nothing here runs user code or library code
that could: every read is a C getter found on a C base type (``BaseException.args``,
``property.fget``, ``ndarray.flat``), an instance dict read through its C descriptor, or
``gc.get_referents``, which asks the object's own C traversal what it references (how an
``lru_cache``'s entries, a ``threading.local``'s other threads' values, a ``MappingProxyType``'s
mapping and a suspended generator's locals are reached without calling anything).

A frame is read by name only where reading it keeps nothing alive: a finished frame (a
traceback's), or any frame from Python 3.13 on (``f_locals`` is a view there). Before 3.13,
``f_locals`` of a frame that can still run copies its locals into a dict the frame keeps, which
would hold a tensor the code has since deleted: a suspended generator's locals are then read
through ``gc.get_referents`` (unnamed: ``gen.gi_frame.<2>``), and a running thread's not at all
(the walk says so).

:func:`reader_for` says which reader a type gets (and, for a numpy array, the C test that proves a
whole group of arrays holds no objects); it looks for numpy, pandas, asyncio and concurrent.futures
in ``sys.modules`` only, never importing them.
"""
from __future__ import annotations

import functools
import gc
import sys
import types
import weakref
from typing import Any, Callable, List, Optional, Tuple

from .paths import ATTR, ITEM, VIA
from .userfiles import is_user_file

__all__ = ["reader_for", "read_referents", "read_frame_locals", "frame_reads_safely", "live_frames", "Triple",
           "class_attr", "getter_of", "info_parts"]

Triple = Tuple[int, Any, Any]  # (step, key, value)
Reader = Callable[[Any, Any], List[Triple]]

#: ``f_locals`` is a view that copies nothing into the frame (PEP 667).
_LOCALS_ARE_VIEWS = sys.version_info >= (3, 13)
#: Before 3.11 a generator's locals live in a frame object of their own.
_FRAME_OBJECTS = sys.version_info < (3, 11)
_EXC = BaseException.__dict__
_EXC_ARGS = _EXC["args"].__get__
_EXC_DICT = _EXC["__dict__"].__get__
_EXC_TRACEBACK = _EXC["__traceback__"].__get__
_EXC_CAUSE = _EXC["__cause__"].__get__
_EXC_CONTEXT = _EXC["__context__"].__get__
_MODULE_DICT = types.ModuleType.__dict__["__dict__"].__get__
_GEN_FRAMES = ((types.GeneratorType, "gi_frame"), (types.CoroutineType, "cr_frame"),
               (types.AsyncGeneratorType, "ag_frame"))
_PROPERTY_PARTS = tuple((name, property.__dict__[name].__get__) for name in ("fget", "fset", "fdel"))
_CELL_CONTENTS = types.CellType.__dict__["cell_contents"].__get__
#: Values of one holder read in full (a numpy object array or an object column); past it the walk
#: says what it left.
MAX_READ = 1 << 22


def class_attr(tp: type, name: str) -> Any:
    """``name`` as found along ``tp``'s MRO in the classes' own dicts (no metaclass, no descriptor runs)."""
    for klass in type.__dict__["__mro__"].__get__(tp):
        attrs = type.__dict__["__dict__"].__get__(klass)
        if name in attrs:
            return attrs[name]
    return None


_GETTERS: dict = {}


def getter_of(tp: type, name: str) -> Optional[Callable[[Any], Any]]:
    """The C getter (getset or member descriptor) called ``name`` along ``tp``'s MRO, or None (remembered)."""
    key = (tp, name)
    if key in _GETTERS:
        return _GETTERS[key]
    desc = class_attr(tp, name)
    found = desc.__get__ if type(desc) in (types.GetSetDescriptorType, types.MemberDescriptorType) else None
    if _library_type(tp):  # a user's class is never kept alive by a cache of ours
        if len(_GETTERS) > 4096:
            _GETTERS.clear()
        _GETTERS[key] = found
    return found


def _library_type(tp: type) -> bool:
    module = sys.modules.get(type.__dict__["__module__"].__get__(tp))
    if module is None or module.__name__ == "__main__":
        return False
    filename = _MODULE_DICT(module).get("__file__")
    return filename is None or not is_user_file(filename)




def _instance_dict(walk: Any, obj: Any) -> dict:
    attrs = walk.instance_dict(obj)
    return attrs if attrs is not None else {}


# -- frames -----------------------------------------------------------------------------------------
def live_frames() -> set:
    """Ids of the frames some thread is running now (each thread's stack): their locals can still change."""
    ids = set()
    try:
        frames = list(sys._current_frames().values())
    except Exception:  # noqa: BLE001 - an interpreter without it
        return ids
    try:
        for frame in frames:
            steps = 0
            while frame is not None and steps < 10_000:
                ids.add(id(frame))
                frame = frame.f_back
                steps += 1
    finally:
        frames = frame = None  # this very frame is among them: no cycle may outlive the call
    return ids


def frame_reads_safely(frame: Any, live: set) -> bool:
    """Whether reading ``frame.f_locals`` keeps nothing alive: a view (3.13+) or a frame that can no
    longer run (neither on a thread's stack nor a suspended generator's: a traceback's)."""
    return _LOCALS_ARE_VIEWS or id(frame) not in live


def read_frame_locals(frame: Any) -> List[Tuple[Any, Any]]:
    """``[(name, value)]`` of a frame's locals (the caller checked :func:`frame_reads_safely`)."""
    f_locals = frame.f_locals
    if isinstance(f_locals, dict):
        return list(dict.items(f_locals))
    return list(f_locals.items())  # 3.13's FrameLocalsProxy: a C view


def _frame_values(frame: Any) -> List[Any]:
    """What a frame object references (its locals and stack), without its globals, builtins, code or caller."""
    skip = {id(frame.f_globals), id(frame.f_builtins), id(frame.f_code), id(frame.f_back)}
    return [value for value in gc.get_referents(frame) if id(value) not in skip]


def read_generator(walk: Any, gen: Any) -> List[Triple]:
    """A suspended generator's or coroutine's frame: its locals (by name from 3.13 on) and what its
    stack holds (the list a ``for`` loop runs over)."""
    attr = next(name for base, name in _GEN_FRAMES if isinstance(gen, base))
    frame = getter_of(type(gen), attr)(gen)
    if frame is None:
        return []  # finished, or running now (then it is on a thread's stack)
    out: List[Triple] = []
    named = set()
    if _LOCALS_ARE_VIEWS:
        for name, value in read_frame_locals(frame):
            named.add(id(value))
            out.append((VIA, f".{attr}.f_locals[{name!r}]", value))
    values = gc.get_referents(gen)
    if _FRAME_OBJECTS:
        values = [v for f in values if type(f) is types.FrameType for v in _frame_values(f)]
    code = gen.gi_code if attr == "gi_frame" else gen.cr_code if attr == "cr_frame" else gen.ag_code
    for index, value in enumerate(values):
        if id(value) in named or type(value) in (types.CodeType, types.FrameType, str):
            continue
        if type(value) is types.FunctionType and value.__code__ is code:
            continue  # the generator's own function
        out.append((VIA, f".{attr}.<{index}>", value))
    return out


# -- caches, cells, proxies, properties, finalizers ---------------------------------------------------
def read_lru_cache(walk: Any, wrapper: Any) -> List[Triple]:
    """An ``functools.lru_cache``/``cache`` wrapper: its cached results and keys, the function it wraps.

    The entries live in C; the wrapper's own traversal (``gc.get_referents``) lists them: the cache
    dict (``maxsize=None``: key -> result) and, for a bounded cache, each entry's key and result.
    """
    out: List[Triple] = []
    attrs = _instance_dict(walk, wrapper)
    wrapped = dict.get(attrs, "__wrapped__")
    if wrapped is not None:
        out.append((ATTR, "__wrapped__", wrapped))
    index = 0
    for value in gc.get_referents(wrapper):
        if value is attrs or value is wrapped or isinstance(value, type) or type(value) is object:
            continue  # its __dict__, its function, its helper types and keyword marker
        out.append((VIA, ".<lru_cache>" if type(value) is dict else f".<lru_cache>[{index}]", value))
        index += 1
    return out


def read_cell(walk: Any, cell: Any) -> List[Triple]:
    try:
        return [(VIA, ".cell_contents", _CELL_CONTENTS(cell))]
    except ValueError:  # empty
        return []


def read_mapping_proxy(walk: Any, proxy: Any) -> List[Triple]:
    """A ``types.MappingProxyType``: the mapping it shows (its own traversal names it)."""
    return [(VIA, "", value) for value in gc.get_referents(proxy) if not isinstance(value, type)]


def read_property(walk: Any, prop: Any) -> List[Triple]:
    """A property's getter, setter and deleter (their closures and defaults are walked as code)."""
    out = [(ATTR, name, get(prop)) for name, get in _PROPERTY_PARTS]
    out.extend((ATTR, name, value) for name, value in dict.items(_instance_dict(walk, prop)))
    return [(step, key, value) for step, key, value in out if value is not None]


def read_method_wrapper(walk: Any, method: Any) -> List[Triple]:
    """A staticmethod or classmethod: the function it wraps."""
    get = getter_of(type(method), "__func__")
    return [(ATTR, "__func__", get(method))] if get is not None else []


def read_bound_builtin(walk: Any, method: Any) -> List[Triple]:
    """A C function or method bound to an object (``keep = batches.append``): that object."""
    get = getter_of(type(method), "__self__")
    owner = get(method) if get is not None else None
    if owner is None or isinstance(owner, types.ModuleType):
        return []  # a module's function: the module is a library's business
    return [(ATTR, "__self__", owner)]


def read_finalize(walk: Any, fin: Any) -> List[Triple]:
    """A ``weakref.finalize``: the function and arguments its registry keeps until it runs (``fin.peek()``)."""
    registry = class_attr(weakref.finalize, "_registry")
    if type(registry) is not dict:
        return []
    if class_attr(type(fin), "__hash__") is object.__hash__:
        info = dict.get(registry, fin)
    else:  # a subclass's own __hash__ would be user code: find it by identity
        info = next((v for k, v in list(dict.items(registry)) if k is fin), None)
    return info_parts(info, ".peek()")


def info_parts(info: Any, prefix: str) -> List[Triple]:
    """A finalizer's registry record (``weakref.finalize._Info``): its function, args and kwargs."""
    if info is None:
        return []
    out = []
    for position, name in ((1, "func"), (2, "args"), (3, "kwargs")):
        get = getter_of(type(info), name)
        try:
            value = get(info) if get is not None else None
        except AttributeError:
            value = None
        if value is not None:
            out.append((VIA, f"{prefix}[{position}]", value))
    return out


def read_thread_local(walk: Any, local: Any) -> List[Triple]:
    """A ``threading.local``: every thread's attributes (the object's traversal lists each thread's dict)."""
    out: List[Triple] = []
    found = False
    for value in gc.get_referents(local):
        if type(value) is not dict:
            continue
        for per_thread in list(dict.values(value)):
            if type(per_thread) is dict:
                found = True
                out.extend((ATTR, name, item) for name, item in list(dict.items(per_thread)) if type(name) is str)
    if not found:
        attrs = walk.instance_dict(local)  # this thread's only
        if attrs:
            out.extend((ATTR, name, item) for name, item in list(dict.items(attrs)) if type(name) is str)
            walk.not_read("other threads' values of a threading.local (a layout this Python does not expose)")
    return out


def read_exception(walk: Any, exc: Any) -> List[Triple]:
    """An exception a name keeps: its args, attributes, cause and context, and its traceback's
    finished frames' locals."""
    out: List[Triple] = [(ATTR, "args", _EXC_ARGS(exc))]
    try:
        attrs = _EXC_DICT(exc)
    except Exception:  # noqa: BLE001
        attrs = None
    if type(attrs) is dict:
        out.extend((ATTR, name, value) for name, value in list(dict.items(attrs)) if type(name) is str)
    for name, get in (("__cause__", _EXC_CAUSE), ("__context__", _EXC_CONTEXT)):
        value = get(exc)
        if value is not None:
            out.append((ATTR, name, value))
    tb = _EXC_TRACEBACK(exc)
    live = walk.live_frames()
    steps = 0
    while isinstance(tb, types.TracebackType) and steps < 1000:
        frame, tb = tb.tb_frame, tb.tb_next
        steps += 1
        if frame.f_code.co_flags & 0x1 == 0:  # not CO_OPTIMIZED: a module or class body, whose locals are its names
            continue
        if not frame_reads_safely(frame, live):
            walk.not_read("the locals of running frames in a kept exception's traceback")
            continue
        function = frame.f_code.co_name
        out.extend((VIA, f".__traceback__[{function}() local {name!r}]", value)
                   for name, value in read_frame_locals(frame) if type(name) is str)
    return out


# -- numpy and pandas -------------------------------------------------------------------------------
def _numpy_parts() -> Optional[Tuple[type, Callable, Callable]]:
    numpy = sys.modules.get("numpy")
    ndarray = getattr(numpy, "ndarray", None)
    if not isinstance(ndarray, type):
        return None
    dtype_of = getter_of(ndarray, "dtype")
    has_object = getter_of(getattr(numpy, "dtype", type), "hasobject")
    if dtype_of is None or has_object is None:
        return None
    return ndarray, dtype_of, has_object


def _array_group_test(dtype_of: Callable, has_object: Callable) -> Callable[[List[Any]], bool]:
    def arrays_hold_nothing(group: List[Any]) -> bool:
        return not any(map(has_object, map(dtype_of, group)))  # in C: numbers hold no object
    return arrays_hold_nothing


def _read_array(walk: Any, array: Any) -> List[Triple]:
    """A numpy array: nothing when it holds numbers; its objects when its dtype holds some
    (``arr[i]`` one-dimensional, ``arr.flat[i]`` else, ``arr.tolist()`` for records)."""
    parts = _numpy_parts()
    out: List[Triple] = [(ATTR, name, value) for name, value in dict.items(_instance_dict(walk, array))
                         if type(name) is str]  # a subclass's attributes
    if parts is None:
        return out
    ndarray, dtype_of, has_object = parts
    dtype = dtype_of(array)
    if not has_object(dtype):
        return out
    # The base class's C getters and methods: a subclass's Python overrides never run.
    size, ndim = getter_of(ndarray, "size")(array), getter_of(ndarray, "ndim")(array)
    if size > MAX_READ:
        walk.not_read(f"the items of object arrays past the first {MAX_READ:,}")
    if getter_of(type(dtype), "kind")(dtype) != "O":  # records with object fields: their fields as Python values
        return out + [(VIA, ".tolist()", ndarray.tolist(array))]
    flat = getter_of(ndarray, "flat")(array)  # a C iterator over the items, in C order, whatever the strides
    values = [value for _i, value in zip(range(MAX_READ), flat)]
    if ndim == 1:
        out.extend(zip([ITEM] * len(values), range(len(values)), values))
    else:
        out.extend((VIA, f".flat[{i}]", value) for i, value in enumerate(values))
    return out


def _read_frame(walk: Any, frame: Any) -> List[Triple]:
    """A pandas DataFrame or Series: its object columns' values (``df['w'].iloc[3]``) and its ``attrs``.

    Read from its block manager (the instance dict's ``_mgr``, its ``blocks``, each block's
    ``values`` and column positions) through C getters and instance dicts; numeric, string and
    other typed columns hold no Python objects and are passed over.
    """
    attrs = _instance_dict(walk, frame)
    out: List[Triple] = []
    extra = dict.get(attrs, "_attrs")
    if type(extra) is dict and extra:
        out.append((ATTR, "attrs", extra))
    manager = dict.get(attrs, "_mgr")
    parts = _numpy_parts()
    if manager is None or parts is None:
        if manager is not None:
            walk.not_read("pandas objects without numpy")
        return out
    _ndarray, dtype_of, has_object = parts
    blocks = _field(walk, manager, "blocks")
    axes = _field(walk, manager, "axes")
    if type(blocks) not in (tuple, list):
        walk.not_read("pandas objects of a layout not recognised")
        return out
    labels = _labels(walk, axes[0]) if type(axes) in (list, tuple) and len(axes) > 1 else None
    for block in blocks:
        values = _field(walk, block, "values")
        inner = values if isinstance(values, _ndarray) else _field(walk, values, "_ndarray")
        if not isinstance(inner, _ndarray):
            continue  # an extension array (strings, categories, Arrow): typed data, no Python objects
        if not has_object(dtype_of(inner)):
            continue
        rows = _ndarray.tolist(inner)
        if inner.ndim == 1:  # a Series, or a one-column block
            out.extend((VIA, f".iloc[{row}]", value) for row, value in enumerate(rows[:MAX_READ]))
            continue
        columns = _positions(walk, block, len(rows))
        for position, column in enumerate(rows):
            where = columns[position] if columns is not None and position < len(columns) else position
            label = labels[where] if labels is not None and where < len(labels) else None
            text = f"[{label!r}]" if type(label) in (str, int, float, bool) else f".iloc[:, {where}]"
            out.extend((VIA, f"{text}.iloc[{row}]", value) for row, value in enumerate(column[:MAX_READ]))
    return out


def _field(walk: Any, obj: Any, name: str) -> Any:
    """``obj.name`` through a C getter of its class or its instance dict (a pandas internal), else None."""
    get = getter_of(type(obj), name)
    if get is not None:
        try:
            return get(obj)
        except Exception:  # noqa: BLE001
            return None
    return dict.get(_instance_dict(walk, obj), name)


def _positions(walk: Any, block: Any, count: int) -> Optional[List[int]]:
    """The column positions a 2-D block stores (its ``BlockPlacement``), or None."""
    placement = _field(walk, block, "_mgr_locs")
    if placement is None:
        placement = _field(walk, block, "mgr_locs")
    array = _field(walk, placement, "as_array") if placement is not None else None
    try:
        positions = array.tolist() if array is not None else None
    except Exception:  # noqa: BLE001
        return None
    return positions if type(positions) is list and len(positions) == count else None


def _labels(walk: Any, index: Any) -> Optional[list]:
    """A pandas Index's labels as a list (its ``_data`` array), or None."""
    data = _field(walk, index, "_data")
    parts = _numpy_parts()
    if parts is not None and data is not None and not isinstance(data, parts[0]):
        data = _field(walk, data, "_ndarray")  # an extension array of labels (pandas 3's strings)
    try:
        labels = parts[0].tolist(data) if parts is not None and isinstance(data, parts[0]) else None
    except Exception:  # noqa: BLE001
        return None
    return labels if type(labels) is list else None


# -- futures, queues, adapters ----------------------------------------------------------------------
def _read_fields(fields: Tuple[Tuple[str, str], ...]) -> Reader:
    """A reader of some of an object's fields (C getters or instance dict): ``((field, path text), ...)``."""
    def read(walk: Any, obj: Any) -> List[Triple]:
        out = []
        for name, text in fields:
            value = _field(walk, obj, name)
            if value is not None:
                out.append((VIA, text, value))
        return out
    return read


_FUTURE = _read_fields((("_result", ".result()"), ("_exception", ".exception()"),
                        ("_done_callbacks", "._done_callbacks")))
_ASYNC_FUTURE = _read_fields((("_result", ".result()"), ("_exception", ".exception()"),
                              ("_callbacks", "._callbacks"), ("_coro", ".get_coro()")))
_ASYNC_QUEUE = _read_fields((("_queue", "._queue"),))


def _read_adapter(walk: Any, adapter: Any) -> List[Triple]:
    """A ``logging.LoggerAdapter``: its ``extra`` and a subclass's own attributes (not the logger: machinery)."""
    return [(ATTR, name, value) for name, value in list(dict.items(_instance_dict(walk, adapter)))
            if type(name) is str and name not in ("logger", "manager")]


def read_referents(walk: Any, obj: Any) -> List[Triple]:
    """Any other C object that takes part in garbage collection (an iterator, ``itertools.cycle``,
    ``operator.itemgetter``): what its own C traversal says it references (``it.<0>``)."""
    out = []
    for index, value in enumerate(gc.get_referents(obj)):
        if isinstance(value, (type, types.ModuleType)):
            continue
        if type(value) is dict and _is_module_dict(value):
            continue  # a module's globals: the module's business
        out.append((VIA, f".<{index}>", value))
    return out


def _is_module_dict(value: dict) -> bool:
    name = dict.get(value, "__name__")
    module = sys.modules.get(name) if type(name) is str else None
    return module is not None and _MODULE_DICT(module) is value


# -- which reader -----------------------------------------------------------------------------------
def _module_type(module: str, name: str) -> Optional[type]:
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def reader_for(tp: type) -> Optional[Tuple[Reader, Optional[Callable[[List[Any]], bool]]]]:
    """``(reader, group test or None)`` for a type read its own way, None for any other type."""
    if issubclass(tp, (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)):
        return read_generator, None
    if issubclass(tp, BaseException):
        return read_exception, None
    if issubclass(tp, property):
        return read_property, None
    if issubclass(tp, (staticmethod, classmethod)):
        return read_method_wrapper, None
    if tp is types.CellType:
        return read_cell, None
    if tp is types.MappingProxyType:
        return read_mapping_proxy, None
    if tp in (types.BuiltinFunctionType, types.MethodWrapperType):
        return read_bound_builtin, None
    lru = getattr(functools, "_lru_cache_wrapper", None)
    if isinstance(lru, type) and issubclass(tp, lru):
        return read_lru_cache, None
    if issubclass(tp, weakref.finalize):
        return read_finalize, None
    local = _module_type("_thread", "_local")
    if local is not None and issubclass(tp, local):
        return read_thread_local, None
    parts = _numpy_parts()
    if parts is not None and issubclass(tp, parts[0]):
        return _read_array, (_array_group_test(parts[1], parts[2]) if tp is parts[0] else None)
    frame = _module_type("pandas.core.generic", "NDFrame")
    if frame is not None and issubclass(tp, frame):
        return _read_frame, None
    for module, name, reader in (("concurrent.futures._base", "Future", _FUTURE),
                                 ("_asyncio", "Future", _ASYNC_FUTURE),
                                 ("asyncio.futures", "Future", _ASYNC_FUTURE),
                                 ("asyncio.queues", "Queue", _ASYNC_QUEUE),
                                 ("logging", "LoggerAdapter", _read_adapter)):
        base = _module_type(module, name)
        if base is not None and issubclass(tp, base):
            return reader, None
    return None
