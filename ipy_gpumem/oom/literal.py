"""The size a failing line writes out in literals (``frames = bytearray(48 * 2**40)``): its arithmetic evaluated, never the user's code.

Only numbers and ``+ - * / // % **`` between them are evaluated (with the sizes of the operands
bounded, so ``10**10**10`` is refused rather than computed), and names whose value in the failing
frame is a plain ``int`` (``batch_size``, handed in by the caller, read without running anything);
a call, an attribute or anything else makes the size unknown. The allocating calls read are the ones whose size follows from their
arguments alone: ``bytearray(n)``, ``bytes(n)``, numpy's and torch's ``empty/zeros/ones/full/rand``
with literal shapes and an optional literal dtype, and ``[x] * n``.
"""
from __future__ import annotations

import ast
import math
import operator
import re
from typing import Mapping, Optional, Tuple

__all__ = ["literal_value", "literal_allocation", "dotted", "ITEMSIZE"]

#: Bytes per element of the dtypes a line may name (numpy's default is float64, torch's float32).
ITEMSIZE = {"float64": 8, "double": 8, "float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2,
            "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "short": 2, "int8": 1, "uint8": 1,
            "bool": 1, "complex64": 8, "complex128": 16, "cfloat": 8, "cdouble": 16}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_MAX_BITS = 256  # no real size needs more; bigger operands are refused before they are computed
_ARRAY = re.compile(r"^(?:np|numpy|torch)\.(empty|zeros|ones|full|rand|randn|randint)$")
_BYTES = ("bytearray", "bytes")


def literal_value(node: ast.AST, names: Optional[Mapping[str, int]] = None):
    """The number a literal arithmetic expression stands for, or None (a call, an unknown name, too large).

    ``names`` gives the plain ints a name may stand for (the failing frame's ``batch_size``).
    """
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and names is not None:
        value = names.get(node.id)
        return value if type(value) is int else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = literal_value(node.operand, names)
        return None if v is None else (-v if isinstance(node.op, ast.USub) else v)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = literal_value(node.left, names), literal_value(node.right, names)
        if left is None or right is None:
            return None
        if isinstance(node.op, ast.Pow):
            if abs(right) > _MAX_BITS or (abs(left) > 1 and abs(right) * math.log2(abs(left)) > _MAX_BITS):
                return None
        elif isinstance(node.op, ast.Mult) and _bits(left) + _bits(right) > _MAX_BITS:
            return None
        try:
            return _OPS[type(node.op)](left, right)
        except (ArithmeticError, ValueError):
            return None
    return None


def _bits(v) -> float:
    return math.log2(abs(v)) if v else 0.0


def _shape(node: ast.AST, names=None) -> Optional[Tuple[int, ...]]:
    """A literal shape: one number, or a tuple/list of them."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List)) else [node]
    dims = []
    for item in items:
        v = literal_value(item, names)
        if v is None or v != int(v) or v < 0:
            return None
        dims.append(int(v))
    return tuple(dims)


def dotted(node: ast.AST) -> str:
    """``torch.nn.functional.linear`` for the expression node that names it; "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def literal_allocation(line: str, names: Optional[Mapping[str, int]] = None) -> Optional[Tuple[int, str]]:
    """``(bytes, the call that asks for them)`` when the line's allocating call has literal sizes (or names
    ``names`` gives a plain int for); else None.

    >>> literal_allocation("frames = bytearray(48 * 2**40)")
    (52776558133248, 'bytearray(48 * 2**40)')
    """
    try:
        tree = ast.parse(line.strip())
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and isinstance(node.left, ast.List) \
                and len(node.left.elts) == 1:
            n = literal_value(node.right, names)
            if isinstance(n, int) and n > 0:  # [x] * n: n references of 8 bytes
                return 8 * n, ast.get_source_segment(line.strip(), node) or ""
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        text = ast.get_source_segment(line.strip(), node) or name
        if name in _BYTES and len(node.args) == 1 and not node.keywords:
            n = literal_value(node.args[0], names)
            if isinstance(n, int) and n >= 0:
                return n, text
            continue
        m = _ARRAY.match(name)
        if not m or not node.args:
            continue
        shape_args = node.args[:1] if m.group(1) != "randint" else node.args[-1:]
        if m.group(1) not in ("randint", "full") and name.startswith("torch") and len(node.args) > 1:
            shape_args = node.args  # torch.zeros(3, 4): sizes as separate arguments
        dims = []
        for arg in shape_args:
            shape = _shape(arg, names)
            if shape is None:
                dims = None
                break
            dims.extend(shape)
        if dims is None:
            continue
        size = 8 if name.startswith(("np", "numpy")) else 4
        if m.group(1) == "randint":
            size = 8
        for kw in node.keywords:
            if kw.arg == "dtype":
                dtype = dotted(kw.value).split(".")[-1] or (kw.value.value if isinstance(kw.value, ast.Constant)
                                                            and isinstance(kw.value.value, str) else "")
                if dtype not in ITEMSIZE:
                    break
                size = ITEMSIZE[dtype]
        else:
            return math.prod(dims) * size, text
    return None
