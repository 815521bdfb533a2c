"""The roles a byte of device memory plays (parameters, gradients, ...), and arithmetic on role tables.

A *role table* is ``{device label: {role: signed bytes}}`` ("cpu", "cuda:0"): what a line, a cell,
a phase or an estimate did to memory, broken down by what the memory is for. The anatomy
(``ipy_gpumem.anatomy``), the pre-flight estimate and the views all use these names, in this order,
so a table reads the same wherever it appears. The words are torch's where torch has them
(MemTracker's categories, "reserved but unallocated").
"""
from __future__ import annotations

from typing import Dict, Iterable, Mapping, Optional

__all__ = ["ROLES", "TENSOR_ROLES", "ROLE_WORDS", "ROLE_SHORT", "RoleTable", "add_tables", "sub_tables",
           "clean_table", "table_total", "dominant"]

#: Every role, in the one order the package uses: tables and legends list them so, and a storage
#: reached in two roles counts in the first (a parameter a name also holds is a parameter; an
#: activation the user holds is the user's tensor, which backward would not free).
ROLES = ("parameters", "gradients", "optimizer_state", "other_tensors", "activations",
         "allocator_cache", "outside_pytorch")
#: The roles of live tensors (the rest exist only on a GPU: the caching allocator and the driver).
TENSOR_ROLES = ROLES[:5]

#: How a sentence names each role.
ROLE_WORDS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "other_tensors": "other tensors",
    "allocator_cache": "reserved but unallocated",
    "outside_pytorch": "outside PyTorch",
}
#: How a narrow table column names each role.
ROLE_SHORT = {
    "parameters": "param",
    "gradients": "grad",
    "optimizer_state": "optim",
    "activations": "act",
    "other_tensors": "other",
    "allocator_cache": "cache",
    "outside_pytorch": "outside",
}

RoleTable = Dict[str, Dict[str, int]]


def add_tables(*tables: Optional[Mapping[str, Mapping[str, int]]]) -> RoleTable:
    """The sum of role tables (None entries are skipped); roles in :data:`ROLES` order."""
    out: Dict[str, Dict[str, int]] = {}
    for table in tables:
        for device, roles in (table or {}).items():
            row = out.setdefault(device, {})
            for role, value in roles.items():
                row[role] = row.get(role, 0) + int(value)
    return clean_table(out, keep_zero=True)


def sub_tables(after: Optional[Mapping], before: Optional[Mapping]) -> RoleTable:
    """``after - before``, role by role (a role missing on one side counts 0)."""
    neg = {dev: {role: -int(v) for role, v in roles.items()} for dev, roles in (before or {}).items()}
    return add_tables(after, neg)


def clean_table(table: Mapping[str, Mapping[str, int]], keep_zero: bool = False) -> RoleTable:
    """The table in canonical order (devices as given, roles in :data:`ROLES` order), zeros dropped
    unless ``keep_zero``; devices left empty are dropped."""
    out = {}
    for device, roles in table.items():
        row = {role: int(roles[role]) for role in ROLES if role in roles and (keep_zero or roles[role])}
        row.update({role: int(v) for role, v in roles.items() if role not in ROLES and (keep_zero or v)})
        if row:
            out[device] = row
    return out


def table_total(table: Optional[Mapping[str, Mapping[str, int]]], device: Optional[str] = None,
                roles: Iterable[str] = TENSOR_ROLES) -> int:
    """The sum of ``roles`` over one device (or all)."""
    wanted = set(roles)
    return sum(int(v) for dev, row in (table or {}).items() if device in (None, dev)
               for role, v in row.items() if role in wanted)


def dominant(table: Optional[Mapping[str, Mapping[str, int]]], count: int = 2, share: float = 0.1):
    """The largest changes of a table as ``(device, role, bytes)``, biggest |bytes| first: at most
    ``count``, and only those at least ``share`` of the largest."""
    items = [(dev, role, int(v)) for dev, row in (table or {}).items() for role, v in row.items() if v]
    items.sort(key=lambda item: -abs(item[2]))
    if not items:
        return []
    top = abs(items[0][2])
    return [item for item in items[:count] if abs(item[2]) >= share * top]
