"""Inside the sealed child only: every real tensor the step can reach replaced, in place, by a fake of it, and the state that was there registered as such.

The estimate runs in a forked copy of the user's process (``ipy_gpumem.sealed``), so nothing needs
copying: the child's own copy of each object is changed where it stands. Every tensor reachable
from the roots (the step, its arguments, the names of the user's namespace the step can reach, the
modules and classes their code lives in) is swapped for a ``FakeTensor`` of the same shape, dtype,
strides and storage sharing, through the same rules as the tensors room's walk: containers, plain
objects' attributes and slots,
nn.Modules (their ``_parameters``, ``_buffers`` and other attributes), optimizers (``state`` is
keyed by parameters: re-keyed by their fakes), closure cells, default arguments, class and module
globals. Immutable containers (tuples, named tuples, frozensets, partials) are rebuilt and put back
in their parent. Scalars, strings, numpy arrays and containers proven to hold only scalars are
never looked into (``tensors.kinds``), so a 3 GiB array or a list of five million ints costs
nothing.

The step then runs on the child's own objects from the state that is there: gradients, optimizer
state, a previous output and its graph exist before the first call and are counted as such, and
what the step frees or replaces (``zero_grad()`` clearing the previous gradients, a buffer
re-assigned) is freed or replaced in the estimate too. The roles of what exists come from the
tensors room's walk of the real objects, before they are swapped.

The names are those the step's code reads, followed through what they hold (``tensors.reach``):
a tensor no reached name holds is not faked, nor walked, so an unrelated list of a hundred
thousand tensors costs nothing, and an object that cannot be faked stops only a step that uses it.
A tensor the step never touches would count nothing anyway (``steps.analyse`` leaves out what was
there and never used). Where the reach cannot be told, every name is faked, as before.
"""
from __future__ import annotations

import functools
import types
from typing import Any, Collection, Dict, List, Optional, Tuple

from ..tensors.kinds import CLASS, DICT, FUNC, MODOBJ, MODULE, OBJECT, OPTIM, PARAM, SEQ, TENSOR
from ..tensors.module_tables import hook_tables, submodules, tensor_tables
from ..tensors.userfiles import is_user_file
from ..tensors.walk import Walk

__all__ = ["FakeWorld", "SubstitutionError"]

#: Levels below a root that are looked into (one more than the walk: a module's parameters sit in
#: its ``_parameters`` dict, one level below the module).
MAX_DEPTH = 7
_SAME = object()
_MODULE_DICT = types.ModuleType.__dict__["__dict__"]
_TYPE_DICT = type.__dict__["__dict__"]


class SubstitutionError(Exception):
    """A tensor the step can reach could not be faked; the message names where it is held."""


class FakeWorld:
    """The child's world with its tensors faked in place.

    Args:
        api: the torch adapter.
        fake_mode: the ``FakeTensorMode`` the fakes belong to; None leaves every tensor real (and
            only registers what exists: how the tests count a real run the same way).
        roots: ``(name, object)`` pairs to substitute through (``args``, the step, the namespace...).
        namespace: the user's namespace (substituted in place, and the walk's roles come from it).
        names: the names of ``namespace`` the step can reach (``tensors.reach``): only those are
            substituted and walked for roles; None: every name (the step reads names in a way that
            cannot be followed, or the world is registered whole, as the tests count it).
        batch: ``{id(real tensor): new shape}``: those are faked at another shape (the batch search).
        cpu: make every fake a CPU fake (a CUDA run is computed on the CPU; its fakes stand for CUDA ones).

    After :meth:`substitute`, :attr:`existing` is ``[(fake, role)]`` (the state there before the
    step: parameters, gradients, optimizer state, tensors the names hold, activations of graphs
    they keep), :attr:`modules` and :attr:`optimizers` the nn.Modules and optimizers found.
    """

    def __init__(self, api: Any, fake_mode: Any, roots: List[Tuple[str, Any]], namespace: Optional[dict] = None,
                 batch: Optional[Dict[int, tuple]] = None, cpu: bool = True, names: Optional[Collection[str]] = None):
        self.api = api
        self.torch = api.torch
        self.mode = fake_mode
        self.roots = roots
        self.namespace = namespace
        self.only = None if names is None or namespace is None else frozenset(names)
        self.batch = batch or {}
        self.cpu = cpu
        self.existing: List[Tuple[Any, str]] = []
        self.modules: List[Any] = []
        self.optimizers: List[Any] = []
        self.faked = 0
        self.reached = 0  # tensors met (one met twice counts twice: it tells which names hold tensors)
        self.names: List[str] = []  # the namespace's names that hold tensors
        self._fakes: Dict[int, Any] = {}  # id(real tensor) -> fake (real tensors are kept alive by their holders)
        self._bases: Dict[Tuple[int, int], Any] = {}  # (device id, data_ptr) -> fake base of another device
        self._memo: Dict[int, Any] = {}  # id(container) -> replacement or _SAME
        self._roles: Dict[Tuple[int, int], str] = {}
        self._path: List[str] = []

    # -- roles, from the walk of the real world ------------------------------------------------------
    @property
    def partial(self) -> bool:
        """Only the names the step reaches are faked (not the whole namespace)."""
        return self.only is not None

    def _walk_roles(self) -> None:
        namespace, whole = self.namespace, None
        if self.only is not None:
            # The reached names only (their roles cannot come from a name the step does not use,
            # nor their cost from the rest): the namespace itself is never walked as a value.
            namespace, whole = dict(self._items(self.namespace)), self.namespace
        walk = Walk(self.api, namespace, extra=[(name, obj) for name, obj in self.roots], budget_s=5.0,
                    caches=False, whole=whole)
        walk.run()
        from ..tensors.claims import ROLE_ORDER

        self._roles = {key: ROLE_ORDER[claim[1]] for key, claim in walk.claims.items()}
        self.walk = walk

    def role_of(self, real: Any) -> str:
        entries = self.walk.store.entries(real)
        for key, _n, _d in entries:
            role = self._roles.get(key)
            if role is not None:
                return role
        return "other_tensors"

    # -- substitution -------------------------------------------------------------------------------
    def substitute(self) -> None:
        """Swap every reachable real tensor for its fake, in place; register what exists."""
        self._walk_roles()
        kinds = self.walk.types
        self.kinds = kinds
        if self.namespace is not None:
            self._namespace(self.namespace)
        new_roots = []
        for name, obj in self.roots:
            self._path = [name]
            replaced = self._replace(obj, 0)
            new_roots.append((name, obj if replaced is _SAME else replaced))
        self.roots = new_roots
        self.walk.store.memo = {}
        self._memo = {}
        self._bases = {}
        self._fakes = {}  # the fakes must not be kept alive by us: a step that frees one frees it

    def _items(self, ns: dict) -> List[Tuple[Any, Any]]:
        """The namespace's (name, value) pairs to substitute, in its order: the reached ones, or all."""
        only = self.only
        if only is None:
            return list(dict.items(ns))
        keys = list(dict.keys(ns))
        if set(map(type, keys)) <= {str}:  # str hashes in C: the filter runs no code of the user's
            keys = list(filter(only.__contains__, keys))
        else:
            keys = [k for k in keys if type(k) is str and k in only]
        return [(k, v) for k in keys for v in (dict.get(ns, k, _SAME),) if v is not _SAME]

    def _namespace(self, ns: dict) -> None:
        """The user's names in place, remembering which held tensors (for the report)."""
        for name, value in self._items(ns):
            before = self.reached
            self._path = [str(name)]
            new = self._replace(value, 0)
            if new is not _SAME:
                dict.__setitem__(ns, name, new)
            if self.reached > before and type(name) is str and not name.startswith("_"):
                self.names.append(name)

    def root(self, name: str) -> Any:
        """A root after substitution (a rebuilt tuple of arguments, the step)."""
        for root_name, obj in self.roots:
            if root_name == name:
                return obj
        raise KeyError(name)

    def _replace(self, obj: Any, depth: int) -> Any:
        """The replacement of ``obj`` (a new object for a tensor or a rebuilt immutable container), or _SAME."""
        tp = type(obj)
        kind = self.kinds.kinds.get(tp)
        if kind is None:
            kind = self.kinds.classify(tp)
        if not kind:
            return _SAME
        if kind == TENSOR or kind == PARAM:
            self.reached += 1
            fake = self._fake(obj)
            return _SAME if fake is obj else fake
        if depth >= MAX_DEPTH:
            return _SAME
        key = id(obj)
        done = self._memo.get(key)
        if done is not None:
            return done
        self._memo[key] = _SAME  # cycles: an object reached again while it is being done stays itself
        try:
            result = self._container(obj, kind, depth)
        except SubstitutionError:
            raise
        except Exception:  # noqa: BLE001 - an object that cannot be changed: left as it is
            result = _SAME
        self._memo[key] = result
        return result

    def _container(self, obj: Any, kind: int, depth: int) -> Any:
        if kind == DICT:
            if DICT <= kind <= OBJECT and self.walk.scalars_only(obj, kind):
                return _SAME
            self._dict(obj, depth, None)
            return _SAME
        if kind == SEQ:
            return self._seq(obj, depth)
        if kind == MODULE:
            self.modules.append(obj)
            self._module(obj, depth)
            return _SAME
        if kind == OPTIM:
            self.optimizers.append(obj)
            self._attrs(obj, depth)
            return _SAME
        if kind == OBJECT:
            self._attrs(obj, depth)
            cls = type(obj)
            if self.walk.user_class(cls):
                self._replace(cls, depth + 1)
            return _SAME
        if kind == FUNC:
            return self._code(obj, depth)
        if kind == CLASS:
            if self.walk.user_class(obj):
                attrs = _TYPE_DICT.__get__(obj)
                for name, value in list(attrs.items()):
                    if type(name) is str and not (name.startswith("__") and name.endswith("__")):
                        new = self._replace(value, depth + 1)
                        if new is not _SAME:
                            type.__setattr__(obj, name, new)
            return _SAME
        if kind == MODOBJ:
            if self.kinds.is_user_module(obj):
                self._dict(_MODULE_DICT.__get__(obj), depth, None)
            return _SAME
        return _SAME

    def _module(self, module: Any, depth: int) -> None:
        """An nn.Module and its submodules (one level each, however deep the tree): parameters,
        buffers and other attributes in place."""
        internals = self.kinds.module_internals
        stack, seen = [module], {id(module)}
        while stack:
            mod = stack.pop()
            self._memo[id(mod)] = _SAME
            attrs = self.walk.instance_dict(mod)
            if attrs is None:
                continue
            # A module's hooks are functions whose closures may hold tensors the forward uses.
            for held in tensor_tables(attrs) + [hooks for _what, hooks in hook_tables(attrs)]:
                self._dict(held, depth, None)
            for name in list(dict.keys(attrs) - internals):
                new = self._replace(dict.get(attrs, name), depth + 1)
                if new is not _SAME:
                    dict.__setitem__(attrs, name, new)
            children = submodules(attrs)
            if children is not None:
                for child in list(dict.values(children)):
                    if child is not None and id(child) not in seen and self.kinds.kinds.get(type(child)) == MODULE:
                        seen.add(id(child))
                        stack.append(child)

    def _dict(self, d: dict, depth: int, _label: Optional[str]) -> None:
        """A dict in place: its values, and its keys when they are tensors (an optimizer's ``state``)."""
        plain = type(d) is dict or type(d).__name__ == "defaultdict"  # C methods that keep it consistent
        rekey = []
        for k, v in list(dict.items(d)):
            new = self._replace(v, depth + 1)
            if new is not _SAME:
                if plain:
                    dict.__setitem__(d, k, new)
                else:
                    d[k] = new  # an OrderedDict or a user's mapping: its own methods keep it whole
            if self.kinds.kinds.get(type(k)) in (TENSOR, PARAM):
                rekey.append(k)
        for k in rekey:
            value = dict.pop(d, k) if plain else d.pop(k)
            if plain:
                dict.__setitem__(d, self._fake(k), value)
            else:
                d[self._fake(k)] = value

    def _seq(self, obj: Any, depth: int) -> Any:
        tp = type(obj)
        items = list(self.kinds.seq_iter[tp](obj))
        if self.walk.scalars_only(obj, SEQ):
            return _SAME
        new = [self._replace(v, depth + 1) for v in items]
        if all(v is _SAME for v in new):
            return _SAME
        values = [old if v is _SAME else v for old, v in zip(items, new)]
        if isinstance(obj, list):
            list.__setitem__(obj, slice(None), values)
            return _SAME
        if isinstance(obj, (set, frozenset)) and not isinstance(obj, frozenset):
            set.clear(obj)
            set.update(obj, values)
            return _SAME
        if isinstance(obj, tuple) and hasattr(tp, "_make"):
            return tp._make(values)  # a named tuple
        if isinstance(obj, (tuple, frozenset)):
            return tp(values) if tp in (tuple, frozenset) else tp.__new__(tp, values)
        # a deque or another mutable sequence: cleared and refilled
        obj.clear()
        obj.extend(values)
        return _SAME

    def _attrs(self, obj: Any, depth: int) -> None:
        """An object's ``__dict__`` in place, and its slots."""
        attrs = self.walk.instance_dict(obj)
        if attrs is not None:
            self._dict(attrs, depth, None)
        for name, desc in self.kinds.slot_desc.get(type(obj), ()):
            try:
                value = desc.__get__(obj, type(obj))
            except AttributeError:
                continue
            new = self._replace(value, depth + 1)
            if new is not _SAME:
                desc.__set__(obj, new)

    def _code(self, obj: Any, depth: int) -> Any:
        tp = type(obj)
        if tp is types.MethodType:
            self._replace(obj.__self__, depth + 1)
            self._replace(obj.__func__, depth + 1)
            return _SAME
        if tp is functools.partial:
            func = self._replace(obj.func, depth + 1)
            args = self._replace(obj.args, depth + 1)
            keywords = obj.keywords
            self._dict(keywords, depth, None)
            if func is _SAME and args is _SAME:
                return _SAME
            return functools.partial(obj.func if func is _SAME else func, *(obj.args if args is _SAME else args),
                                     **keywords)
        if not is_user_file(obj.__code__.co_filename):
            return _SAME
        if obj.__defaults__:
            new = self._replace(obj.__defaults__, depth + 1)
            if new is not _SAME:
                obj.__defaults__ = new
        if obj.__kwdefaults__:
            self._dict(obj.__kwdefaults__, depth, None)
        for cell in obj.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            new = self._replace(value, depth + 1)
            if new is not _SAME:
                cell.cell_contents = new
        globals_ = obj.__globals__
        if globals_ is not self.namespace and id(globals_) not in self._memo:
            module = __import__("sys").modules.get(obj.__module__) if isinstance(obj.__module__, str) else None
            if module is not None and _MODULE_DICT.__get__(module) is globals_ and self.kinds.is_user_module(module):
                self._memo[id(globals_)] = _SAME
                self._dict(globals_, depth, None)
        return _SAME

    # -- one tensor ---------------------------------------------------------------------------------
    def _fake(self, real: Any) -> Any:
        """The fake of ``real`` (one per real tensor), registered once as existing with its role."""
        known = self._fakes.get(id(real))
        if known is not None:
            return known
        try:
            fake = self._make(real)
        except Exception as exc:  # noqa: BLE001
            where = ".".join(self._path) or "an object the step reaches"
            raise SubstitutionError(f"a tensor held by {where} ({type(real).__name__}, {_shape_words(real)}) "
                                    "could not be faked: "
                                    f"{type(exc).__name__}: {exc}") from None
        self._fakes[id(real)] = fake
        self.faked += 1
        self.existing.append((fake, self.role_of(real)))
        grad = getattr(fake, "grad", None) if fake.is_leaf else None
        real_grad = real.grad if real.is_leaf else None
        if grad is not None and real_grad is not None and id(real_grad) not in self._fakes:
            self._fakes[id(real_grad)] = grad
            self.existing.append((grad, self.role_of(real_grad)))
        return fake

    def _make(self, real: Any) -> Any:
        torch = self.torch
        mode = self.mode
        if mode is None:
            return real  # counting the real world as it is (the ground truth of the tests)
        shape = self.batch.get(id(real))
        plain = real.layout == torch.strided and not self.api.is_wrapper_subclass(real)
        if shape is None and plain and (real.device.type == "cpu" or not self.cpu):
            if real.numel() <= 1 and not real.requires_grad and not isinstance(real, torch.nn.Parameter):
                # A scalar (an optimizer's step count) keeps its value, so .item() on it is exact. A
                # clone: fake in-place ops (step += 1) update the constant itself.
                return self.api.fake_constant(mode, real.detach().clone())
            return mode.from_tensor(real)
        # Another device (a CUDA run is computed on the CPU), another batch size, or a tensor
        # without plain strided storage: a new CPU fake of the same kind; views of one storage
        # share one fake base when the shape is unchanged.
        with mode:
            if shape is None and plain:
                try:
                    storage = real.untyped_storage()
                    key = (id(real.device), storage.data_ptr())
                except Exception:  # noqa: BLE001
                    key = None
                base = self._bases.get(key) if key is not None else None
                if base is None:
                    base = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu")
                    if key is not None:
                        self._bases[key] = base
                fake = torch.empty(0, dtype=real.dtype, device="cpu").set_(
                    base.untyped_storage(), real.storage_offset(), tuple(real.shape), tuple(real.stride()))
            else:
                fake = torch.empty(tuple(real.shape if shape is None else shape), dtype=real.dtype, device="cpu")
            if isinstance(real, torch.nn.Parameter):
                fake = torch.nn.Parameter(fake, requires_grad=real.requires_grad)
            elif real.requires_grad and fake.is_leaf:
                fake.requires_grad_(True)
            real_grad = real.grad if real.is_leaf else None
            if real_grad is not None:
                fake.grad = torch.empty(tuple(fake.shape), dtype=real_grad.dtype, device="cpu")
        return fake


def _shape_words(real: Any) -> str:
    """``shape (2, 3)``, or what the tensor says instead (a nested tensor has no one shape)."""
    try:
        return f"shape {tuple(real.shape)}"
    except Exception:  # noqa: BLE001
        return "of no single shape"
