"""Byte quantities in torch's own spelling: ``format_bytes(1610612736) == "1.50 GiB"`` and back.

PyTorch's out-of-memory messages print sizes with c10's ``format_size``: whole ``bytes`` up to
1024, then KiB, MiB and GiB with two decimals. Using the same spelling means the numbers we show
line up character for character with the ones in the user's traceback, for every size a device
can hold. c10 stops at GiB ("131072.00 GiB"); past 1 TiB we go on to TiB and PiB as
``torch.cuda.memory_summary`` (``_format_size``) does, so an absurd request reads "128.00 TiB".
``parse_bytes`` reads both spellings.
"""
from __future__ import annotations

import re
from typing import Optional

__all__ = ["KiB", "MiB", "GiB", "TiB", "PiB", "format_bytes", "format_delta", "format_seconds", "parse_bytes"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4
PiB = 1024**5

# Every unit is binary. "KB/MB/GB" are binary too: torch's old MPS allocator and TensorFlow
# divide by 1024 and print those labels, so reading them as decimal would be wrong by ~7%.
_UNITS = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "k": KiB, "kb": KiB, "kib": KiB,
    "m": MiB, "mb": MiB, "mib": MiB,
    "g": GiB, "gb": GiB, "gib": GiB,
    "t": TiB, "tb": TiB, "tib": TiB,
    "p": PiB, "pb": PiB, "pib": PiB,
    "e": 1024**6, "eb": 1024**6, "eib": 1024**6,
}
# ASCII digits only: \d would also accept other scripts' digits ("٣ GiB").
_QUANTITY = re.compile(r"^\s*([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))\s*([a-zA-Z]*)\s*$")


def format_bytes(size: int | None) -> str:
    """Format a byte count as PyTorch's ``format_size`` does, going on to TiB and PiB past 1 TiB.

    Examples:
        >>> format_bytes(0), format_bytes(1024), format_bytes(1536), format_bytes(1610612736)
        ('0 bytes', '1024 bytes', '1.50 KiB', '1.50 GiB')
        >>> format_bytes(128 * TiB), format_bytes(2**64)
        ('128.00 TiB', '16384.00 PiB')
        >>> format_bytes(None)
        'n/a'
    """
    if size is None:
        return "n/a"
    size = int(size)
    if size < 0:
        return "-" + format_bytes(-size)
    if size <= KiB:
        return f"{size} bytes"
    if size <= MiB:
        return f"{size / KiB:.2f} KiB"
    if size <= GiB:
        return f"{size / MiB:.2f} MiB"
    if size <= TiB:  # c10 stops here: "131072.00 GiB"
        return f"{size / GiB:.2f} GiB"
    if size <= PiB:
        return f"{size / TiB:.2f} TiB"
    return f"{size / PiB:.2f} PiB"


def format_delta(delta: int | None) -> str:
    """Format a signed change in bytes: ``+2.81 GiB``, ``-512.00 MiB``, ``+0 bytes``.

    Examples:
        >>> format_delta(3 * 1024**3), format_delta(-512 * 1024**2), format_delta(0)
        ('+3.00 GiB', '-512.00 MiB', '+0 bytes')
    """
    if delta is None:
        return "n/a"
    return ("-" if delta < 0 else "+") + format_bytes(abs(int(delta)))


def parse_bytes(text: str | int) -> int:
    """Read a size such as ``"20.00 MiB"``, ``"0 bytes"``, ``"3.34GiB"``, ``"72GB"`` or ``"16M"``.

    Decimals are rounded half up after exact (integer) multiplication, so
    ``parse_bytes("2.32 GiB") == round(2.32 * 1024**3)`` without float error, and huge values
    such as torch's ``"17179869184.00 GiB"`` (2**64) stay exact.

    Raises:
        ValueError: ``text`` is not a size.

    Examples:
        >>> parse_bytes("1.50 GiB"), parse_bytes("256 bytes"), parse_bytes("16 MiB")
        (1610612736, 256, 16777216)
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        return text
    match = _QUANTITY.match(str(text))
    if not match:
        raise ValueError(f"not a size: {text!r} (try e.g. '16 MiB', '1.5 GiB' or '0 bytes')")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown unit {unit!r} in {text!r} (use bytes, KiB, MiB, GiB, TiB or PiB)")
    if len(number) > 60:
        raise ValueError(f"not a size: {text!r} (too many digits)")
    whole, _, fraction = number.lstrip("+-").partition(".")
    scale = 10 ** len(fraction)
    quotient, rest = divmod(int(whole + fraction) * factor, scale)
    return (-1 if number[0] == "-" else 1) * (quotient + (2 * rest >= scale))  # half up, away from zero


def format_seconds(seconds: Optional[float]) -> str:
    """``0.4 ms``, ``12 ms``, ``1.2 s``, ``3 min 5 s``."""
    if seconds is None:
        return "n/a"
    if seconds < 0.001:
        return f"{seconds * 1e3:.2f} ms"
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest} s"
