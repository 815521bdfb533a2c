"""Fake copies of the user's objects: every tensor, module and optimizer reachable from a step's arguments, globals and closure, copied around fake tensors.

The user's objects are never touched: a deepcopy memo maps each real tensor to a ``FakeTensor``
(``FakeTensorMode.from_tensor``, no memory), so ``copy.deepcopy`` rebuilds modules, optimizers and
containers around the fakes without copying a byte of real storage. The step is re-bound to the
copies: a plain function gets a copy of its globals (only the names it uses that hold tensors) and
of its closure cells, a bound method a copy of its object.
"""
from __future__ import annotations

import copy
import functools
import types
from typing import Any, Dict, List, Tuple

__all__ = ["ROLE_ORDER", "collect_tensors", "FakeWorld", "holds_tensors"]

#: When one tensor is reachable in two roles, the first of these wins.
ROLE_ORDER = ("parameters", "optimizer_state", "gradients", "other_tensors")
_SKIP = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType, str, bytes,
         int, float, complex, bool, type(None))


def _better(role, old):
    return old is None or ROLE_ORDER.index(role) < ROLE_ORDER.index(old)


def collect_tensors(roots, depth: int = 6) -> Dict[int, Tuple[Any, str]]:
    """Every tensor reachable from ``roots``: ``{id: (tensor, role)}``.

    Modules give their parameters and buffers ("parameters") and gradients; optimizers their state
    ("optimizer_state"); anything else a tensor is found in (lists, dicts, attributes of plain
    objects, up to ``depth`` levels) gives "other_tensors".
    """
    import torch

    found: Dict[int, Tuple[Any, str]] = {}
    seen = set()

    def add(t, role):
        old = found.get(id(t))
        if old is None or _better(role, old[1]):
            found[id(t)] = (t, role)
        if t.grad is not None if t.is_leaf else False:
            add(t.grad, "gradients")

    def walk(obj, level, role="other_tensors"):
        if isinstance(obj, torch.Tensor):
            add(obj, role)
            return
        if isinstance(obj, _SKIP) or id(obj) in seen or level > depth:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            for t in obj.parameters():
                add(t, "parameters")
            for t in obj.buffers():
                add(t, "parameters")
        if isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                walk(state, level + 1, "optimizer_state")
            for group in obj.param_groups:
                for t in group["params"]:
                    add(t, "parameters")
            return
        if isinstance(obj, dict):
            for value in list(obj.values()):
                walk(value, level + 1, role)
            for k in list(obj.keys()):
                if isinstance(k, torch.Tensor):
                    walk(k, level + 1, role)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for value in list(obj):
                walk(value, level + 1, role)
        elif isinstance(obj, functools.partial):
            walk(obj.args, level + 1)
            walk(obj.keywords, level + 1)
        elif isinstance(obj, types.MethodType):
            walk(obj.__self__, level + 1)
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                for value in list(attrs.values()):
                    walk(value, level + 1)

    for root in roots:
        walk(root, 0)
    return found


def holds_tensors(obj, depth: int = 3) -> bool:
    """Whether ``obj`` is, or holds within a few levels, a tensor, module or optimizer."""
    import torch

    if isinstance(obj, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
        return True
    if depth <= 0 or isinstance(obj, _SKIP):
        return False
    if isinstance(obj, dict):
        return any(holds_tensors(v, depth - 1) for v in list(obj.values())[:64])
    if isinstance(obj, (list, tuple, set, frozenset)):
        return any(holds_tensors(v, depth - 1) for v in list(obj)[:64])
    if isinstance(obj, types.MethodType):
        return holds_tensors(obj.__self__, depth - 1)
    attrs = getattr(obj, "__dict__", None)
    return isinstance(attrs, dict) and any(holds_tensors(v, depth - 1) for v in list(attrs.values())[:64])


def _names(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


class FakeWorld:
    """The fake copies of one step's world, made under ``fake_mode``.

    Args:
        step: the user's callable.
        args, kwargs: its arguments.
        fake_mode: the ``FakeTensorMode`` the copies belong to.
        batch: optional ``{id(real tensor): new shape}``; those tensors are faked at the new shape
            (how :func:`max_batch_size` tries other batch sizes).
    """

    def __init__(self, step, args, kwargs, fake_mode, batch=None):
        import torch

        self.fake_mode = fake_mode
        globals_used, cells = self._free_objects(step)
        roots = [step if not isinstance(step, types.FunctionType) else None, args, kwargs,
                 list(globals_used.values()), [c for c in cells if c is not None]]
        self.real = collect_tensors(roots)
        memo: Dict[int, Any] = {}
        self.fakes: List[Tuple[Any, str, Any]] = []  # (fake tensor, role, real tensor)
        # Tensors first, grads after their parameter (from_tensor fakes a parameter's .grad too).
        order = sorted(self.real.values(), key=lambda item: ROLE_ORDER.index(item[1]))
        for real, role in order:
            if id(real) in memo:
                continue
            fake = self._fake(real, (batch or {}).get(id(real)))
            memo[id(real)] = fake
            if real.is_leaf and real.grad is not None and fake.grad is not None:
                memo.setdefault(id(real.grad), fake.grad)
            self.fakes.append((fake, role, real))
        for real, role in order:  # a .grad faked with its parameter keeps its own role
            if role == "gradients" and all(f is not memo[id(real)] for f, _r, _x in self.fakes):
                self.fakes.append((memo[id(real)], role, real))
        memo[id(memo)] = [real for real, _role in order]  # keep-alive list, as deepcopy does
        self.memo = memo
        self.args = copy.deepcopy(args, memo)
        self.kwargs = copy.deepcopy(kwargs, memo)
        self.step = self._rebind(step, globals_used, memo)
        self.modules = [m for m in self._roots_of(torch.nn.Module)]
        self.optimizers = [o for o in self._roots_of(torch.optim.Optimizer)]

    def _fake(self, real, shape=None):
        import torch

        mode = self.fake_mode
        if shape is None and real.device.type == "cpu" and real.layout == torch.strided:
            if real.numel() <= 1 and not real.requires_grad and not isinstance(real, torch.nn.Parameter):
                # A scalar (an optimizer's step count) keeps its value, so .item() on it is exact.
                # The constant is a clone: fake in-place ops (step += 1) update the constant itself.
                return mode.fake_tensor_converter.from_real_tensor(mode, real.detach().clone(), make_constant=True)
            return mode.from_tensor(real)
        # Another device (a fake run computes on the CPU) or another batch size: a new fake tensor
        # of the same kind. Storage shared between such tensors is not kept (each is counted).
        shape = tuple(real.shape if shape is None else shape)
        with mode:
            fake = torch.empty(shape, dtype=real.dtype, device="cpu")
            if isinstance(real, torch.nn.Parameter):
                fake = torch.nn.Parameter(fake, requires_grad=real.requires_grad)
            elif real.requires_grad:
                fake.requires_grad_(True)
            if real.is_leaf and real.grad is not None and tuple(real.grad.shape) == shape:
                fake.grad = torch.empty(shape, dtype=real.grad.dtype, device="cpu")
        return fake

    @staticmethod
    def _free_objects(step):
        """The globals a plain function names that hold tensors, and its closure cells' contents."""
        func = step.__func__ if isinstance(step, types.MethodType) else step
        if not isinstance(func, types.FunctionType):
            return {}, []
        g = func.__globals__
        used = {name: g[name] for name in _names(func.__code__) if name in g and holds_tensors(g[name])}
        cells = []
        for cell in func.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:
                cells.append(None)
        return used, cells

    def _rebind(self, step, globals_used, memo):
        if isinstance(step, types.FunctionType):
            if not globals_used and not step.__closure__ and not step.__defaults__ and not step.__kwdefaults__:
                return step
            new_globals = dict(step.__globals__)
            for name, value in globals_used.items():
                new_globals[name] = copy.deepcopy(value, memo)
            closure = None
            if step.__closure__:
                closure = tuple(types.CellType(copy.deepcopy(c.cell_contents, memo)) if _filled(c)
                                and holds_tensors(c.cell_contents) else c for c in step.__closure__)
            func = types.FunctionType(step.__code__, new_globals, step.__name__,
                                      copy.deepcopy(step.__defaults__, memo), closure)
            func.__kwdefaults__ = copy.deepcopy(step.__kwdefaults__, memo)
            func.__dict__.update(step.__dict__)
            return func
        if isinstance(step, types.MethodType):
            return types.MethodType(self._rebind(step.__func__, globals_used, memo),
                                    copy.deepcopy(step.__self__, memo))
        if isinstance(step, functools.partial):
            return functools.partial(self._rebind(step.func, {}, memo), *copy.deepcopy(step.args, memo),
                                     **copy.deepcopy(step.keywords, memo))
        if holds_tensors(step):
            return copy.deepcopy(step, memo)
        return step

    def _roots_of(self, cls):
        """The objects of ``cls`` among the copies (arguments, re-bound globals and closure, the step's self)."""
        out, seen = [], set()

        def walk(obj, level):
            if id(obj) in seen or level > 4 or isinstance(obj, _SKIP + (self._tensor_type(),)):
                return
            seen.add(id(obj))
            if isinstance(obj, cls):
                out.append(obj)
                return
            if isinstance(obj, dict):
                for v in list(obj.values()):
                    walk(v, level + 1)
            elif isinstance(obj, (list, tuple, set, frozenset)):
                for v in obj:
                    walk(v, level + 1)
            elif hasattr(obj, "__dict__") and not callable(obj) or isinstance(obj, types.MethodType):
                target = obj.__self__ if isinstance(obj, types.MethodType) else obj
                for v in list(vars(target).values()):
                    walk(v, level + 1)

        walk(self.args, 0)
        walk(self.kwargs, 0)
        step = self.step
        if isinstance(step, types.FunctionType):
            func_names = _names(step.__code__)
            walk([step.__globals__[n] for n in func_names if n in step.__globals__], 0)
            walk([c.cell_contents for c in step.__closure__ or () if _filled(c)], 0)
        elif isinstance(step, types.MethodType):
            walk(step.__self__, 0)
        else:
            walk(step, 0)
        return out

    @staticmethod
    def _tensor_type():
        import torch

        return torch.Tensor


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True
