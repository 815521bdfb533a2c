"""An nn.Module's own tables read from its instance dict: parameters, buffers, submodules and hooks (torch's private names for them, here once).

Every reader takes the module's instance dict (``holding.instance_attrs``, or ``vars(module)``) and
reads it with ``dict.get``, so a module's ``__getattr__``, a property or a dict subclass's method
never runs; a table that is not a dict is no table.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

__all__ = ["HOOK_ATTRS", "hook_tables", "tensor_tables", "submodules", "member_tables"]

# (attribute, what each entry is), in the order torch runs them.
_HOOKS = (("_forward_hooks", "forward hook"), ("_forward_pre_hooks", "forward pre-hook"),
          ("_backward_hooks", "backward hook"), ("_backward_pre_hooks", "backward pre-hook"))
#: The names of a module's hook dicts, as a walk's path through one reads them (``model._forward_hooks``).
HOOK_ATTRS = frozenset(attr for attr, _what in _HOOKS)


def hook_tables(attrs: dict) -> List[Tuple[str, dict]]:
    """``(what, hooks)`` for each of the module's hook dicts (id -> function) that is not empty:
    forward hook, forward pre-hook, backward hook, backward pre-hook."""
    out = []
    for attr, what in _HOOKS:
        hooks = dict.get(attrs, attr)
        if isinstance(hooks, dict) and hooks:
            out.append((what, hooks))
    return out


def tensor_tables(attrs: dict) -> List[dict]:
    """The module's parameters and buffers (name -> tensor or None), each dict that is not empty."""
    out = []
    for attr in ("_parameters", "_buffers"):
        table = dict.get(attrs, attr)
        if isinstance(table, dict) and table:
            out.append(table)
    return out


def submodules(attrs: dict) -> Optional[dict]:
    """The module's children (name -> module or None), or None."""
    children = dict.get(attrs, "_modules")
    return children if isinstance(children, dict) else None


def member_tables(attrs: dict) -> List[dict]:
    """Where ``module.name`` finds a name its instance dict lacks, in ``nn.Module.__getattr__``'s
    order: parameters, buffers, submodules."""
    out = []
    for attr in ("_parameters", "_buffers", "_modules"):
        table = dict.get(attrs, attr)
        if isinstance(table, dict):
            out.append(table)
    return out
