"""Plain data across the pipe: encode() and decode() of numbers, strings, bytes, lists, tuples, dicts and sets, and nothing that could run code.

Why not pickle: the step runs in the child and can write on the child's pipe (C code can reach any
descriptor of its process), so whatever the parent reads from it is untrusted. ``pickle.loads``
on it would run any callable the bytes name, in the user's kernel. This format names no type
but the ones listed, so decoding it builds values and nothing else, and it is bounded by the bytes
received: every length and count is checked against what is left before anything is allocated,
nesting stops at :data:`MAX_DEPTH`, and keys whose hash an attacker could make collide (ints,
floats, tuples: everything but str and bytes, whose hashes are salted) are limited to
:data:`MAX_UNSALTED_KEYS` per value, so a crafted dict cannot keep the parent busy for minutes.

A value is a tag byte and its body. Lengths and counts are unsigned 32-bit little-endian. A list or
tuple of ints that all fit in 64 bits travels as one packed array (an allocation event list of a
million entries encodes and decodes at C speed).
"""
from __future__ import annotations

import struct
from array import array
from typing import Any, List

__all__ = ["PlainError", "encode", "decode", "MAX_DEPTH", "MAX_UNSALTED_KEYS"]

#: Containers nested deeper than this are refused (both ways).
MAX_DEPTH = 64
#: Dict keys and set items that are not str or bytes, per decoded value.
MAX_UNSALTED_KEYS = 4096
#: An int of more bytes than this is refused (both ways).
MAX_INT_BYTES = 1024

_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_SMALL = (-(1 << 63), (1 << 63) - 1)
_LITTLE = array("q").itemsize == 8 and struct.pack("=q", 1) == struct.pack("<q", 1)


class PlainError(ValueError):
    """A value that is not plain data (encoding), or bytes that are not a plain value (decoding); one line."""


# --- encoding (the child) -------------------------------------------------------------------------------


def encode(value: Any) -> bytes:
    """``value`` as bytes; :class:`PlainError` naming the first part that is not plain data.

    Plain data: None, bool, int, float, str, bytes (bytearray and memoryview travel as bytes),
    and lists, tuples, dicts, sets and frozensets of plain data. A subclass of these (a named
    tuple, an IntEnum, an OrderedDict) travels as its base type.
    """
    out: List[bytes] = []
    _encode(value, out, 0)
    return b"".join(out)


def _ints(items) -> bool:
    if not items:
        return False
    if set(map(type, items)) != {int}:
        return False
    return _SMALL[0] <= min(items) and max(items) <= _SMALL[1]


def _encode(value: Any, out: List[bytes], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise PlainError(f"the value is nested deeper than {MAX_DEPTH} levels (or holds itself)")
    if value is None:
        out.append(b"N")
    elif value is True:
        out.append(b"T")
    elif value is False:
        out.append(b"F")
    elif isinstance(value, int):
        value = int(value)
        if _SMALL[0] <= value <= _SMALL[1]:
            out.append(b"i" + _I64.pack(value))
        else:
            size = (value.bit_length() + 8) // 8
            if size > MAX_INT_BYTES:
                raise PlainError(f"an int of {value.bit_length()} bits is too large to send back")
            out.append(b"I" + _U32.pack(size) + value.to_bytes(size, "little", signed=True))
    elif isinstance(value, float):
        out.append(b"f" + _F64.pack(value))
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        out.append(b"s" + _U32.pack(len(data)))
        out.append(data)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        out.append(b"b" + _U32.pack(len(data)))
        out.append(data)
    elif isinstance(value, (list, tuple)):
        tag = b"l" if isinstance(value, list) else b"t"
        if len(value) > 8 and _ints(value):
            packed = array("q", value)
            if not _LITTLE:
                packed.byteswap()
            out.append((b"q" if tag == b"l" else b"r") + _U32.pack(len(value)))
            out.append(packed.tobytes())
            return
        out.append(tag + _U32.pack(len(value)))
        for item in value:
            _encode(item, out, depth + 1)
    elif isinstance(value, dict):
        out.append(b"d" + _U32.pack(len(value)))
        for key, item in value.items():
            _encode(key, out, depth + 1)
            _encode(item, out, depth + 1)
    elif isinstance(value, (set, frozenset)):
        out.append((b"Z" if isinstance(value, frozenset) else b"S") + _U32.pack(len(value)))
        for item in value:
            _encode(item, out, depth + 1)
    else:
        kind = type(value)
        raise PlainError(f"a {kind.__module__}.{kind.__qualname__} is not plain data (numbers, strings, bytes, "
                         "lists, tuples, dicts, sets)")


# --- decoding (the parent) ------------------------------------------------------------------------------


def decode(data) -> Any:
    """The value ``data`` (bytes, bytearray or memoryview) holds; :class:`PlainError` if it is not exactly one plain value."""
    reader = _Reader(memoryview(data).cast("B"))
    value = reader.value(0)
    if reader.pos != len(reader.data):
        raise PlainError(f"{len(reader.data) - reader.pos} bytes follow the value")
    return value


class _Reader:
    def __init__(self, data: memoryview):
        self.data = data
        self.pos = 0
        self.unsalted = 0

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise PlainError(f"the value is cut short (needs {n} bytes at offset {self.pos}, "
                             f"{len(self.data) - self.pos} left)")
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def count(self, each: int = 1) -> int:
        """A length or count, checked against the bytes left (each item takes at least ``each``)."""
        n = _U32.unpack(self.take(4))[0]
        if n * each > len(self.data) - self.pos:
            raise PlainError(f"a length of {n} at offset {self.pos - 4} is more than the {len(self.data) - self.pos} "
                             "bytes left")
        return n

    def key(self, depth: int) -> Any:
        key = self.value(depth)
        if type(key) not in (str, bytes):
            self.unsalted += 1
            if self.unsalted > MAX_UNSALTED_KEYS:
                raise PlainError(f"more than {MAX_UNSALTED_KEYS} dict keys or set items that are not strings")
        return key

    def value(self, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise PlainError(f"the value is nested deeper than {MAX_DEPTH} levels")
        tag = bytes(self.take(1))
        if tag == b"N":
            return None
        if tag == b"T":
            return True
        if tag == b"F":
            return False
        if tag == b"i":
            return _I64.unpack(self.take(8))[0]
        if tag == b"I":
            n = self.count()
            if n > MAX_INT_BYTES:
                raise PlainError(f"an int of {n} bytes is larger than {MAX_INT_BYTES}")
            return int.from_bytes(self.take(n), "little", signed=True)
        if tag == b"f":
            return _F64.unpack(self.take(8))[0]
        if tag == b"s":
            try:
                return str(self.take(self.count()), "utf-8", "surrogatepass")
            except UnicodeDecodeError as exc:
                raise PlainError(f"a string is not UTF-8 ({exc.reason})") from None
        if tag == b"b":
            return bytes(self.take(self.count()))
        if tag in (b"q", b"r"):
            packed = array("q")
            packed.frombytes(self.take(self.count(8) * 8))
            if not _LITTLE:
                packed.byteswap()
            items = packed.tolist()
            return items if tag == b"q" else tuple(items)
        if tag in (b"l", b"t"):
            items = [self.value(depth + 1) for _ in range(self.count())]
            return items if tag == b"l" else tuple(items)
        if tag == b"d":
            out = {}
            for _ in range(self.count(2)):
                key = self.key(depth + 1)
                item = self.value(depth + 1)
                try:
                    out[key] = item
                except TypeError:
                    raise PlainError(f"a dict key is unhashable ({type(key).__name__})") from None
            return out
        if tag in (b"S", b"Z"):
            items = set()
            for _ in range(self.count()):
                item = self.key(depth + 1)
                try:
                    items.add(item)
                except TypeError:
                    raise PlainError(f"a set item is unhashable ({type(item).__name__})") from None
            return items if tag == b"S" else frozenset(items)
        raise PlainError(f"unknown tag {tag!r} at offset {self.pos - 1}: not a plain value")

