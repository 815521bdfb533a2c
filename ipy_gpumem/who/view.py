"""``%gpumem who``: who holds the memory, as a table of categories and holders."""
from __future__ import annotations

import textwrap
from typing import Any, List, Optional, Tuple

from ..core.units import format_bytes
from ..display.view import View, details_html, esc, html_table, text_table, wrap_html as _wrap
from .attribution import CATEGORY_LABELS

__all__ = ["who_view", "who_section"]

_DIM = "opacity:0.75"
_TEXT_WIDTH = 100


def who_view(who: Any, max_holders: int = 20) -> View:
    """``%gpumem who``: the categories and the top holders of a ``WhoReport``, expanded."""
    section = who_section(who, max_holders, expanded=True)
    if section is None:
        return View("who: nothing to report", _wrap("<div>who: nothing to report</div>"))
    text, html = section
    notes = [n for n in (getattr(who, "notes", None) or ())]
    if notes:
        text += "\n" + "\n".join(f"  note: {n}" for n in notes)
        html += "".join(f'<div style="{_DIM}">note: {esc(n)}</div>' for n in notes)
    return View(text, _wrap(html))


def who_section(who: Any, max_holders: int, expanded: bool = False) -> Optional[Tuple[str, str]]:
    if who is None:
        return None
    cats = dict(who.categories or {})
    unattributed = cats.get("unattributed")
    whole = who.allocator_total if getattr(who, "allocator_total", None) else who.total + max(0, unattributed or 0)
    rows = []
    for key, label in CATEGORY_LABELS.items():
        value = cats.get(key)
        if value is None or (value == 0 and key != "unattributed"):
            continue
        rows.append([label, format_bytes(value), f"{100.0 * value / whole:.0f}%" if whole else ""])
    holders = [h for h in (who.holders or ()) if h.get("bytes")][: max(0, max_holders)]
    hrows = [[h["name"], CATEGORY_LABELS.get(h.get("category"), str(h.get("category"))), format_bytes(h["bytes"])]
             for h in holders]
    where = getattr(who, "device", None) or "all devices"
    title = f"Who holds it ({where}): {format_bytes(who.total)} in {who.tensor_count} tensor storages"
    if getattr(who, "reason", None):
        title += f" ({who.reason})"
    text = [title]
    if rows:  # one wrapped line: the terminal should still show the diagnosis below
        ranked = sorted(rows, key=lambda r: r[0] == "unattributed")
        words = [f"{label} {size}" + (f" ({share})" if share else "") for label, size, share in ranked]
        text.extend(_wrap_text(" · ".join(words), "  ", "  "))
    if hrows:
        text.append(_indent(text_table(["holder", "category", "bytes"], hrows, left=(0, 1))))
    top = ", ".join(f"{h['name']} {format_bytes(h['bytes'])}" for h in holders[:3])
    summary = title + (f": {top}" if top else "")
    body = (html_table(["category", "bytes", "share"], rows) if rows else "") + (
        html_table(["holder", "category", "bytes"], hrows, left=(0, 1)) if hrows else "")
    return "\n".join(text), details_html(summary, body, expanded)



def _wrap_text(text: str, first: str, rest: str) -> List[str]:
    # Break at spaces only: hyphenated words and long code spans stay whole.
    return textwrap.wrap(text, _TEXT_WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False, break_long_words=False)


def _indent(block: str) -> str:
    return "\n".join("  " + line for line in block.splitlines())
