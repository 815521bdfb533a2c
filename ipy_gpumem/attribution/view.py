"""``%gpumem who`` and the OOM panel's "who holds it" section: one list of parts, rendered to text and HTML.

Both read a :class:`~ipy_gpumem.attribution.who.WhoReport` and nothing else; the view keeps the
report as ``View.data``, so code and tests read numbers from it instead of from the text.
"""
from __future__ import annotations

from typing import Any, List, Optional

from ..core.units import format_bytes
from ..display.parts import Details, Para, Table, render
from ..display.view import View
from .who import CATEGORIES, CATEGORY_LABELS, WhoReport

__all__ = ["who_view", "who_section"]


def who_view(report: WhoReport, max_holders: int = 20) -> View:
    """``%gpumem who``: the categories and the ``max_holders`` largest holders, expanded; ``data`` is the report."""
    return render([who_section(report, max_holders, expanded=True)], data=report)


def who_section(report: Optional[WhoReport], max_holders: int = 8, expanded: bool = False) -> Optional[Details]:
    """The "who holds it" section as one part: a summary line (the title and the three largest
    holders) over the categories, the holders' table and the notes. None without a report.

    Args:
        report: what ``who()`` returned, or None.
        max_holders: rows of the holders' table.
        expanded: open in notebooks (``%gpumem who``); the OOM panel shows it collapsed.
    """
    if report is None:
        return None
    where = "all devices" if report.device is None else report.device.label
    title = f"Who holds it ({where}): {format_bytes(report.total)} in {report.tensor_count:,} tensor storages"
    if report.reason:
        title += f" ({report.reason})"
    if not report.complete and not report.reason:
        title += " (incomplete)"
    holders = [h for h in report.holders if h.bytes][: max(0, max_holders)]
    top = ", ".join(f"{h.name} {format_bytes(h.bytes)}" for h in holders[:3])
    body: List[Any] = []
    shares = _shares(report)
    if shares:
        body.append(Para(" · ".join(shares), indent="  "))
    if holders:
        devices = report.device is None and len({h.device for h in holders}) > 1
        headers = ["holder", "category"] + (["device"] if devices else []) + ["bytes"]
        rows = [[h.name, CATEGORY_LABELS.get(h.category, h.category)]
                + ([h.device.label] if devices else []) + [format_bytes(h.bytes)] for h in holders]
        body.append(Table(headers, rows, left=(0, 1, 2) if devices else (0, 1), indent="  "))
        hidden = len([h for h in report.holders if h.bytes]) - len(holders)
        if hidden > 0:
            body.append(Para(f"... and {hidden} more holders", style="dim", indent="  "))
    body.extend(Para(f"note: {note}", style="dim", indent="  ", hanging="        ") for note in report.notes)
    return Details(title + (f": {top}" if top else ""), tuple(body), open=expanded, title=title)


def _shares(report: WhoReport) -> List[str]:
    """``parameters 1.00 GiB (40%)`` per non-empty category, unattributed last."""
    cats = report.categories or {}
    unattributed = cats.get("unattributed")
    whole = report.allocator_total or report.total + max(0, unattributed or 0)
    out = []
    for key in CATEGORIES + ("unattributed",):
        value = cats.get(key)
        if value is None or (value == 0 and key != "unattributed"):
            continue
        share = f" ({100.0 * value / whole:.0f}%)" if whole else ""
        out.append(f"{CATEGORY_LABELS[key]} {format_bytes(value)}{share}")
    return out
