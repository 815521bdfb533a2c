"""The part of a walk that meets torch's own objects: tensors (their storages, gradients and graphs), nn.Modules and optimizers, and the claims they make.

A tensor a holder reaches is claimed in the role its holder gives it (a bare tensor is the
user's ``other_tensors``; a module's are ``parameters``; an optimizer's ``state`` is
``optimizer_state``; a leaf's ``.grad`` is ``gradients``), and its graph is queued for the
autograd half of the walk. Many tensors of one holder (a model's parameters, an optimizer's
state, a list of a million tensors) are read with ``map`` over C descriptors instead of a Python
step each. Modules are read through their instance dicts (``_parameters``, ``_buffers``,
``_modules``), so an overridden ``parameters()`` or ``__getattr__`` never runs.
"""
from __future__ import annotations

import types
from itertools import compress, repeat
from operator import is_, is_not, itemgetter
from typing import Any, List, Optional, Tuple

from ..core.devices import Device
from .claims import GRAD, GRADIENTS, MODULE, MODULE_GRADS, OPT_GRADS, OPT_PARAMS, OPTIM, OPTIMIZER, OTHER, PARAMETERS, VAR
from .graphs import GraphRoot
from .kinds import CLASS, DICT, FUNC, MODOBJ, MODULE as K_MODULE, OBJECT, PARAM, TENSOR as K_TENSOR
from .paths import ATTR
from .storage import HOST, block_bytes

__all__ = ["HoldingMixin", "MAX_ITEMS", "module_parts", "instance_attrs"]

MAX_ITEMS = 10_000  # submodules of one module, parameters of one optimizer, locals of one frame
_FIRST = itemgetter(0)
# An nn.Module's own bookkeeping: walked through its own rules (parameters, buffers, submodules,
# hooks), never as plain attributes.
_MODULE_SLOTS = frozenset(("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
                           "_is_full_backward_hook", "_state_dict_pre_hooks", "_load_state_dict_post_hooks",
                           "_load_state_dict_pre_hooks", "_state_dict_hooks"))
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def instance_attrs(obj: Any) -> Optional[dict]:
    """``obj.__dict__`` through the C getter its class inherits (a property or ``__getattr__`` never runs), or None."""
    for klass in type.__dict__["__mro__"].__get__(type(obj)):
        desc = type.__dict__["__dict__"].__get__(klass).get("__dict__")
        if desc is not None:
            if type(desc) not in (types.GetSetDescriptorType, types.MemberDescriptorType):
                return None
            try:
                attrs = desc.__get__(obj, type(obj))
            except Exception:  # noqa: BLE001
                return None
            return attrs if type(attrs) is dict else None
    return None


def module_parts(module: Any, limit: int = MAX_ITEMS) -> Tuple[List[Tuple[str, Any]], List[Any], List[Any]]:
    """``(named submodules, parameters, buffers)`` of an nn.Module and everything below it, as
    ``named_modules()``, ``parameters()`` and ``buffers()`` give them, read from the instance dicts
    (``_modules``, ``_parameters``, ``_buffers``): an overridden method or ``__getattr__`` never runs.
    Each module and tensor once; at most ``limit`` modules."""
    named: List[Tuple[str, Any]] = []
    params: List[Any] = []
    buffers: List[Any] = []
    seen_modules, seen_tensors = set(), set()
    stack = [("", module)]
    while stack and len(named) < limit:
        prefix, mod = stack.pop()
        if id(mod) in seen_modules:
            continue
        seen_modules.add(id(mod))
        named.append((prefix, mod))
        attrs = instance_attrs(mod)
        if attrs is None:
            continue
        for slot, out in (("_parameters", params), ("_buffers", buffers)):
            found = dict.get(attrs, slot)
            if type(found) is dict:
                for t in list(dict.values(found)):
                    if t is not None and id(t) not in seen_tensors:
                        seen_tensors.add(id(t))
                        out.append(t)
        children = dict.get(attrs, "_modules")
        if type(children) is dict:
            items = [(name, child) for name, child in list(dict.items(children)) if child is not None]
            stack.extend((f"{prefix}.{name}" if prefix else str(name), child) for name, child in reversed(items))
    return named, params, buffers


class HoldingMixin:
    """Claims for tensors, modules and optimizers; uses the walk's claims, store, paths, tiers and budget."""

    # ------------------------------------------------------- tensors, modules
    def held_tensor(self, tier: Any, t: Any, is_param: bool, pid: int, depth: int, order: int) -> None:
        """A tensor a holder reaches: its data, its ``.grad``, and its graph as a root."""
        if is_param:
            self.claim(tier, t, PARAMETERS, 2, depth, order, VAR, pid)
        else:
            self.claim(tier, t, OTHER, 0, depth, order, VAR, pid)
        self.tensor_extras(tier, t, 2, depth, order, pid, GRAD)

    def held_tensors(self, tier: Any, pid: int, step: int, keys: List[Any], tensors: List[Any], depth: int) -> bool:
        """Many plain tensors held by one container (``keys`` under path ``pid``): what
        :meth:`held_tensor` does for each, with the storages read by ``map`` over C descriptors.

        Returns False when the budget ran out (the rest is then named in ``unexamined``).
        """
        store = self.store
        count, order = len(tensors), self.p_order[pid]
        first = len(self.p_parent)  # one path per tensor, made in bulk: first + i
        self.p_parent.extend(repeat(pid, count))
        self.p_step.extend(repeat(step, count))
        self.p_key.extend(keys)
        self.p_order.extend(repeat(order, count))
        host = HOST
        try:
            storages = list(map(store.untyped_storage, tensors))
            nbytes = list(map(store.storage_nbytes, storages))
            ptrs = list(map(store.storage_ptr, storages))
            fns = list(map(store.get_grad_fn, tensors))
            if all(map(store.get_is_cpu, tensors)):  # the usual case: no torch.device object per tensor
                devices: List[Optional[Device]] = [host] * count
                unique = {host}
            else:
                devices = [store.device(d) for d in map(store.storage_device, storages)]
                unique = set(devices)
        except Exception:  # noqa: BLE001 - a sparse or odd tensor among them: one at a time, each guarded
            devices = nbytes = ptrs = [None] * count
            fns = None
        params = list(map(is_, map(type, tensors), repeat(self.types.parameter_type)))
        claims, wanted, level = self.claims, self.wanted, tier.level
        careful: List[int] = []
        if fns is not None and self.claim_plainly(level, devices, unique, nbytes, ptrs, params, depth, order, first):
            devices = []  # all claimed: nothing for the loop below
        for index, (dev, size, ptr, is_param) in enumerate(zip(devices, nbytes, ptrs, params)):
            if index & 4095 == 4095 and self.out_of_budget():
                self.unexamined.append(f"the rest of {self.label(pid)} ({count - index:,} tensors)")
                return False
            if dev is None or not size or size < 0 or not ptr:
                careful.append(index)  # meta, empty, sparse, a wrapper, or a device not met yet
                continue
            if wanted is not None and not wanted.covers(dev):
                continue
            size = block_bytes(size, dev)
            claim = (level, PARAMETERS, 2, depth, 0, order, VAR, first + index, size, dev) if is_param else (
                level, OTHER, 0, depth, 0, order, VAR, first + index, size, dev)
            key = (id(dev), ptr)
            old = claims.get(key)
            if old is None or claim < old:
                claims[key] = claim
        careful_set = set(careful)
        for index in compress(range(count), map(is_not, fns or (), repeat(None))):  # tensors with a graph
            if index not in careful_set:
                t = tensors[index]
                tier.roots.append(GraphRoot(first + index, order, fns[index]))
                if store.get_retains_grad(t):
                    grad = store.get_grad(t)
                    if grad is not None:
                        self.claim(tier, grad, GRADIENTS, 2, depth, order, GRAD, first + index)
        # ``.grad`` of leaves only: reading it on a non-leaf warns.
        leaves = list(compress(range(count), map(is_, fns or (), repeat(None))))
        for index, grad in zip(leaves, map(store.get_grad, map(tensors.__getitem__, leaves))):
            if grad is not None and index not in careful_set:
                self.claim(tier, grad, GRADIENTS, 2, depth, order, GRAD, first + index)
        for index in careful:
            try:
                self.visit(tier, tensors[index], self.kind_of(tensors[index]), first + index, depth, order)
            except Exception as exc:  # noqa: BLE001
                self.error(first + index, exc)
        return True

    def claim_plainly(self, level: int, devices: List[Optional[Device]], unique: set, nbytes: List[int],
                      ptrs: List[int], params: List[bool], depth: int, order: int, first: int) -> bool:
        """The common case of :meth:`held_tensors` with no Python step per tensor: no Parameter,
        every storage real (on a known device, not empty), every device wanted. False (nothing
        claimed) when any of that is not so; the caller then goes tensor by tensor."""
        if any(params) or not all(ptrs) or min(nbytes, default=1) <= 0:
            return False
        for dev in unique:
            if dev is None or (self.wanted is not None and not self.wanted.covers(dev)):
                return False
        if any(dev.type == "cuda" for dev in unique):
            nbytes = [block_bytes(n, d) for n, d in zip(nbytes, devices)]
        keys = list(zip(map(id, devices), ptrs))
        new = list(zip(repeat(level), repeat(OTHER), repeat(0), repeat(depth), repeat(0), repeat(order), repeat(VAR),
                       range(first, first + len(keys)), nbytes, devices))
        claims = self.claims
        old = list(map(claims.setdefault, keys, new))
        for index in compress(range(len(keys)), map(is_not, old, new)):  # already claimed: the best wins
            if new[index] < old[index]:
                claims[keys[index]] = new[index]
        return True

    def tensor_extras(self, tier: Any, t: Any, priority: int, depth: int, order: int, pid: int,
                      grad_relation: int, weight: int = 0) -> None:
        """Claim ``t.grad`` (leaves and retain_grad only) and queue ``t``'s graph."""
        store = self.store
        fn = store.get_grad_fn(t)
        if fn is not None:
            tier.roots.append(GraphRoot(pid, order, fn))
            if not store.get_retains_grad(t):
                return
        grad = store.get_grad(t)
        if grad is not None:
            self.claim(tier, grad, GRADIENTS, priority, depth, order, grad_relation, pid, weight)

    def module(self, tier: Any, module: Any, pid: int, depth: int, order: int) -> None:
        """An ``nn.Module``: parameters and buffers, their grads, its other attributes and its hooks.

        Reads ``_parameters``/``_buffers``/``_modules`` straight from each instance dict, so an
        overridden ``parameters()`` or ``__getattr__`` never runs. When two variables hold modules
        sharing parameters (``model`` and ``head = model.fc``), the larger module gets them:
        deleting ``head`` frees nothing. Other attributes (``self.cache = [...]``) and the
        functions in its hook dicts (their closures) are walked one level down.
        """
        key = id(module)
        if tier.seen.get(key, depth + 1) <= depth:
            return
        tier.seen[key] = depth
        tensors: List[Any] = []
        stack = [("", module)]
        walked = {key}
        attributes: List[Tuple[str, Any]] = []
        internals = self.types.module_internals | _MODULE_SLOTS
        while stack:
            prefix, mod = stack.pop()
            attrs = self.instance_dict(mod)
            if attrs is None:
                continue
            for slot in ("_parameters", "_buffers"):
                slot_dict = dict.get(attrs, slot)
                if isinstance(slot_dict, dict):
                    tensors.extend(t for t in list(dict.values(slot_dict)) if t is not None and self.is_tensor(t))
            for name in _HOOK_DICTS:
                hooks = dict.get(attrs, name)
                if isinstance(hooks, dict) and hooks:
                    attributes.append((prefix + name, hooks))
            for name in dict.keys(attrs) - internals:
                value = dict.get(attrs, name)
                if type(name) is not str:
                    continue
                kind = self.kind_of(value)
                if kind == K_TENSOR or kind == PARAM:  # plain tensor attributes (``self.mask = ...``)
                    self.held_tensor(tier, value, False, self.path(pid, ATTR, prefix + name, order), depth, order)
                elif kind >= DICT and kind != MODOBJ and kind != CLASS and not (kind == FUNC and type(value) is types.MethodType):
                    attributes.append((prefix + name, value))
            children = dict.get(attrs, "_modules")
            if not isinstance(children, dict):
                continue
            for child_name, child in list(dict.items(children)):
                if child is None or id(child) in walked or self.kind_of(child) != K_MODULE:
                    continue
                if len(walked) >= MAX_ITEMS:
                    self.notes.append(f"only the first {MAX_ITEMS:,} submodules of {self.label(pid)} were examined")
                    stack.clear()
                    break
                walked.add(id(child))
                stack.append((f"{prefix}{child_name}.", child))
        weight = -len(tensors)
        info = self.info.setdefault(self.owner(pid), {"kind": "module", "class": type(module).__name__,
                                                      "parameters": 0})
        self.claim_many(tier, tensors, PARAMETERS, 0, depth, order, MODULE, pid, weight)
        self.extras_many(tier, tensors, 0, depth, order, pid, MODULE_GRADS, weight)
        if info.get("kind") == "module":
            params = [t for t in tensors if type(t) is self.types.parameter_type]
            entries = self.store.bulk(params)
            if entries is None:
                entries = [e for t in params for e in self.store.entries(t)]
            info["parameters"] = sum(dict((key, nbytes) for key, nbytes, _dev in entries).values())
        for name, value in attributes:
            kind = self.kind_of(value)
            if DICT <= kind <= OBJECT and self.scalars_only(value, kind):
                continue
            self.visit(tier, value, kind, self.path(pid, ATTR, name, order), depth + 1, order)

    def optimizer(self, tier: Any, opt: Any, pid: int, depth: int, order: int) -> None:
        """An optimizer: its ``state`` tensors, and the parameters of its ``param_groups``."""
        attrs = self.instance_dict(opt)
        if attrs is None:
            return
        info = self.info.setdefault(self.owner(pid), {"kind": "optimizer", "class": type(opt).__name__,
                                                      "state": [], "parameters": 0})
        names = set()
        found: List[Any] = []
        state = dict.get(attrs, "state")
        if isinstance(state, dict):
            for count, per_param in enumerate(list(dict.values(state))):
                if count >= MAX_ITEMS * 10:
                    self.notes.append(f"only the state of the first {MAX_ITEMS * 10:,} parameters of "
                                      f"{self.label(pid)} was examined")
                    break
                items = list(dict.items(per_param)) if isinstance(per_param, dict) else [(None, per_param)]
                for name, value in items:
                    if self.is_tensor(value):
                        found.append(value)
                        if type(name) is str:
                            names.add(name)
            self.claim_many(tier, found, OPTIMIZER, 0, depth, order, OPTIM, pid)
        groups = dict.get(attrs, "param_groups")
        params: List[Any] = []
        if isinstance(groups, list):
            for group in list(groups):
                group_params = dict.get(group, "params") if isinstance(group, dict) else None
                if isinstance(group_params, list):
                    params.extend(p for p in list(group_params) if self.is_tensor(p))
        self.claim_many(tier, params, PARAMETERS, 1, depth, order, OPT_PARAMS, pid)
        self.extras_many(tier, params, 1, depth, order, pid, OPT_GRADS)
        entries = self.store.bulk(params)
        if entries is None:
            entries = [e for p in params for e in self.store.entries(p)]
        params_bytes = sum(dict((key, nbytes) for key, nbytes, _dev in entries).values())
        if info.get("kind") == "optimizer":
            info["state"] = sorted(set(info["state"]) | names)
            info["parameters"] = max(info["parameters"], params_bytes)

    def claim_many(self, tier: Any, tensors: List[Any], role: int, priority: int, depth: int, order: int,
                   relation: int, ref: Any, weight: int = 0) -> None:
        """:meth:`claim` for many tensors of one holder, in C when they are plain CPU tensors."""
        entries = self.store.bulk(tensors)
        if entries is None:
            for t in tensors:
                self.claim(tier, t, role, priority, depth, order, relation, ref, weight)
            return
        claims = self.claims
        keys = list(map(_FIRST, entries))
        new = [(tier.level, role, priority, depth, weight, order, relation, ref, nbytes, dev)
               for _key, nbytes, dev in entries]
        old = list(map(claims.setdefault, keys, new))
        for index in compress(range(len(keys)), map(is_not, old, new)):  # already claimed: the best wins
            if new[index] < old[index]:
                claims[keys[index]] = new[index]

    def extras_many(self, tier: Any, tensors: List[Any], priority: int, depth: int, order: int, pid: int,
                    grad_relation: int, weight: int = 0) -> None:
        """:meth:`tensor_extras` for many tensors: their graphs queued, their gradients claimed together."""
        store = self.store
        fns = list(map(store.get_grad_fn, tensors))
        grads = []
        for t, fn in zip(tensors, fns):
            if fn is not None:
                tier.roots.append(GraphRoot(pid, order, fn))
                if not store.get_retains_grad(t):
                    continue
            grad = store.get_grad(t)
            if grad is not None:
                grads.append(grad)
        if grads:
            self.claim_many(tier, grads, GRADIENTS, priority, depth, order, grad_relation, pid, weight)

    def claim(self, tier: Any, t: Any, role: int, priority: int, depth: int, order: int, relation: int,
              ref: Any, weight: int = 0) -> None:
        """Offer ``t``'s storages to a holder; the best claim per storage wins (see :mod:`.claims`)."""
        claims, level = self.claims, tier.level
        for key, nbytes, dev in self.store.entries(t):
            claim = (level, role, priority, depth, weight, order, relation, ref, nbytes, dev)
            old = claims.get(key)
            if old is None or claim < old:
                claims[key] = claim
