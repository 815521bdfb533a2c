"""What ``%gpumem free`` plans to release and what it released, as text."""
from __future__ import annotations

from ..core.units import format_bytes, format_delta

__all__ = ["freed_report"]


def freed_report(before, after) -> str:
    """What ``%gpumem free`` released, from samples before and after: per device and host RSS."""
    lines = ["ipy_gpumem free: done."]
    prior = {d.index: d for d in before.devices}
    for dev in after.devices:
        b = prior.get(dev.index)
        if b is None:
            continue
        lines.append(f"  cuda:{dev.index}: allocated {format_bytes(b.allocated)} -> {format_bytes(dev.allocated)} "
                     f"({format_delta((dev.allocated or 0) - (b.allocated or 0))}), reserved "
                     f"{format_bytes(b.reserved)} -> {format_bytes(dev.reserved)} "
                     f"({format_delta((dev.reserved or 0) - (b.reserved or 0))})")
    if before.host.rss is not None and after.host.rss is not None:
        lines.append(f"  host RSS: {format_bytes(before.host.rss)} -> {format_bytes(after.host.rss)} "
                     f"({format_delta(after.host.rss - before.host.rss)})")
    return "\n".join(lines)
