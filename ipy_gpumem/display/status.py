"""``%gpumem status``: the memory of each device now, in torch's words, and the process's host RSS."""
from __future__ import annotations

from typing import Optional

from ..core.units import format_bytes
from .view import View, esc, html_table, text_table, wrap_html as _wrap

__all__ = ["status_view"]


def status_view(sample, names: Optional[dict] = None, host_backend: Optional[str] = None) -> View:
    """``%gpumem status``: per device, who has the memory now; and the process's host RSS.

    "used outside PyTorch" is the device's used memory minus what torch reserved: the CUDA
    context, other libraries (cuBLAS workspaces, NCCL) and other processes.
    """
    names = names or {}
    headers = ["device", "allocated by PyTorch", "reserved but unallocated", "used outside PyTorch", "free", "total"]
    rows = []
    for dev in sample.devices:
        unalloc = None if dev.reserved is None or dev.allocated is None else dev.reserved - dev.allocated
        outside = None if dev.used is None or dev.reserved is None else max(dev.used - dev.reserved, 0)
        free = None if dev.used is None or dev.total is None else dev.total - dev.used
        label = f"cuda:{dev.index}" + (f" ({names[dev.index]})" if names.get(dev.index) else "")
        rows.append([label, format_bytes(dev.allocated), format_bytes(unalloc), format_bytes(outside), format_bytes(free), format_bytes(dev.total)])
    text_parts, html_parts = [], []
    if rows:
        text_parts.append(text_table(headers, rows))
        html_parts.append(html_table(headers, rows))
    else:
        msg = f"No CUDA device in use: {sample.reason or 'none found'}."
        text_parts.append(msg)
        html_parts.append(f"<div>{esc(msg)}</div>")
    rss = sample.host.rss
    host = f"host: {format_bytes(rss)} resident (process RSS)" if rss is not None else "host: RSS unavailable"
    text_parts.append(host)
    html_parts.append(f"<div>{esc(host)}</div>")
    return View("\n".join(text_parts), _wrap("".join(html_parts)))
