"""The out-of-memory panel: headline, the device's memory in layers, who holds it, earlier cells and the diagnosis.

``oom_panel_view()`` turns plain data (an ``OomReport``, a ``MemoryState``, ``Finding``s, a
``WhoReport``, ``CellRecord``s) into a ``View``: aligned text for terminal IPython and
self-contained HTML (inline styles, no script, no external resource) for notebooks. Colours are
mid-tone with the text colour inherited, so the panel reads in light and dark themes alike.
Everything that comes from the user or the message is HTML-escaped.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from .diagnose import Finding, MemoryState, cell_deltas
from ..display.view import View, details_html, esc, html_table, text_table, wrap_html as _wrap
from ..who.view import who_section
from ..core.units import format_bytes, format_delta

__all__ = ["oom_panel", "oom_panel_view", "headline", "memory_layers", "Segment", "BAR_WIDTH"]

BAR_WIDTH = 60  # characters of the text bar
_TEXT_WIDTH = 100  # wrap width of the text findings
_MESSAGE_CHARS = 300  # the message is in the traceback above; the panel shows its start

# Layer key -> (bar character, colour). Colours are mid-tones readable on white and on
# JupyterLab's dark grey; "free" is a translucent grey that takes the theme's background.
_STYLE = {
    "allocated": ("█", "#d1495b"),
    "unallocated": ("▓", "#edae49"),
    "outside": ("▒", "#7b6fb0"),
    "process": ("█", "#d1495b"),
    "free": ("·", "rgba(128,128,128,0.18)"),
}
_REQUEST_COLOUR = "#2f80ed"
_BORDER = "1px solid rgba(128,128,128,0.55)"
_DIM = "opacity:0.75"
_CONFIDENCE_COLOUR = {"certain": "#2e9e58", "likely": "#b7791f", "possible": "rgba(128,128,128,0.9)"}


# ==================================================================================================
# The layers
# ==================================================================================================


@dataclass(frozen=True)
class Segment:
    """One drawn part of the device: a layer, or adjacent layers whose split is unknown.

    Attributes:
        keys: Layer keys it covers (``("allocated",)``, or ``("unallocated", "outside")``).
        label: Legend text, e.g. ``"reserved but unallocated"``.
        size: Bytes, or None when unknown.
    """

    keys: Tuple[str, ...]
    label: str
    size: Optional[int]

    @property
    def key(self) -> str:
        return self.keys[0]


def _layer_bounds(state: MemoryState) -> List[Tuple[str, str, Optional[int]]]:
    """``(key, label, upper boundary in bytes)`` from the bottom of the device to its total."""
    kind = state.device_type
    if kind == "cpu":
        return [("process", "this process (RSS)", state.process_used),
                ("outside", "other processes and the OS", state.used),
                ("free", "available", state.total)]
    if kind == "mps":
        return [("allocated", "allocated by PyTorch", state.allocated),
                ("outside", "other allocations", state.used),
                ("free", "free below the limit", state.total)]
    return [("allocated", "allocated by PyTorch", state.allocated),
            ("unallocated", "reserved but unallocated", state.reserved),
            ("outside", "outside PyTorch (CUDA context, other processes)", state.used),
            ("free", "free", state.total)]


def memory_layers(state: MemoryState) -> List[Segment]:
    """The device from bottom to top as segments; a layer whose boundary is unknown merges upward.

    With ``allocated`` and ``used`` known but ``reserved`` unknown, "reserved but unallocated" and
    "outside PyTorch" become one segment. Layers above the last known boundary get size None.
    Boundaries that go backwards (rounded message numbers) count as 0-byte layers.
    """
    out: List[Segment] = []
    prev = 0
    pending: List[Tuple[str, str]] = []
    for key, label, bound in _layer_bounds(state):
        pending.append((key, label))
        if bound is None:
            continue
        size = max(0, int(bound) - prev)
        prev = max(prev, int(bound))
        out.append(Segment(tuple(k for k, _ in pending), " + ".join(lbl for _, lbl in pending), size))
        pending = []
    for key, label in pending:
        out.append(Segment((key,), label, None))
    return out


def _drawable(segments: Sequence[Segment]) -> bool:
    return bool(segments) and segments[-1].size is not None and sum(s.size or 0 for s in segments) > 0


# ==================================================================================================
# The view
# ==================================================================================================


def oom_panel(analysis) -> View:
    """The panel for an ``OomAnalysis`` (see :func:`ipy_gpumem.oom.analysis.analyse`)."""
    return oom_panel_view(analysis.oom, analysis.state, analysis.findings, analysis.who, analysis.records,
                          error_name=analysis.error_name)


def oom_panel_view(
    oom: Any,
    state: MemoryState,
    findings: Sequence[Finding],
    who: Any = None,
    records: Sequence[Any] = (),
    *,
    error_name: str = "",
    max_holders: int = 8,
) -> View:
    """The out-of-memory panel as text and HTML.

    Sections, in order: the headline (request against free), the device's memory in layers with
    the request drawn against the free part, who holds it (when ``who`` is given), what earlier
    cells left behind (when ``records`` show growth), and the numbered diagnosis.

    Args:
        oom: The ``OomReport``, or None.
        state: The device's memory at failure.
        findings: Ranked ``Finding``s from :func:`ipy_gpumem.core.diagnose.explain`.
        who: A ``WhoReport`` for the device, or None.
        records: Recent ``CellRecord``s, oldest first.
        error_name: The exception's name; ``oom.exception_type`` when empty.
        max_holders: Holder rows shown.

    Returns:
        A :class:`~ipy_gpumem.display.view.View`.
    """
    requested = getattr(oom, "requested", None)
    free = oom.free if oom is not None and getattr(oom, "free", None) is not None else state.free
    parts = [
        _headline(oom, state, requested, free, error_name),
        _layers(state, requested, free),
        who_section(who, max_holders),
        _cells_section(records, state),
        _diagnosis(findings),
    ]
    parts = [p for p in parts if p is not None]
    text = "\n\n".join(t for t, _ in parts)
    inner = "".join(h for _, h in parts)
    html = _wrap(f'<div class="gm-oom" style="border-left:3px solid {_STYLE["allocated"][1]};'
                 f'padding:4px 10px;max-width:980px">{inner}</div>')
    return View(text, html)


# --------------------------------------------------------------------------------------------------
# 1. Headline


def headline(state: MemoryState, requested: Optional[int], free: Optional[int]) -> str:
    """``Out of memory on cuda:0: tried to allocate 2.32 GiB with 182.75 MiB free (15.78 GiB total)``."""
    kind = state.device_type
    where = "the host (cpu)" if kind == "cpu" else (state.device or "an unknown device")
    free_word, total_word = {"cpu": ("available", "RAM"), "mps": ("free below the limit", "max allowed")}.get(
        kind, ("free", "total"))
    what = f"tried to allocate {format_bytes(requested)}" if requested is not None \
        else "an allocation of unknown size failed"
    have = f" with {format_bytes(free)} {free_word}" if free is not None else f" with unknown {free_word} memory"
    total = f" ({format_bytes(state.total)} {total_word})" if state.total is not None else f" ({total_word} unknown)"
    return f"Out of memory on {where}: {what}{have}{total}"


def _headline(oom, state, requested, free, error_name) -> Tuple[str, str]:
    line = headline(state, requested, free)
    name = error_name or getattr(oom, "exception_type", None) or ""
    message = getattr(oom, "message", "") or ""
    if len(message) > _MESSAGE_CHARS:
        message = message[: _MESSAGE_CHARS - 1] + "…"
    said = f"{name}: {message}" if name and message else (name or message)
    text = line + (f"\n{said}" if said else "")
    html = (f'<div style="font-size:13px;font-weight:700;margin:2px 0">{esc(line)}</div>'
            + (f'<div style="{_DIM};white-space:pre-wrap;margin-bottom:4px">{esc(said)}</div>' if said else ""))
    return text, html


# --------------------------------------------------------------------------------------------------
# 2. The bar


def _layers(state: MemoryState, requested: Optional[int], free: Optional[int]) -> Tuple[str, str]:
    segments = memory_layers(state)
    drawable = _drawable(segments)
    whole = sum(s.size or 0 for s in segments) if drawable else None
    text_lines, legend_html = [], []
    if drawable:
        text_lines.append("[" + _text_bar(segments, whole) + "]")
        if requested:
            text_lines.append(_text_request(requested, whole, free))
    else:
        text_lines.append(f"{state.device}: no bar (total capacity unknown)")
    for seg in segments:
        char, colour = _seg_style(seg)
        size = format_bytes(seg.size) if seg.size is not None else "unknown"
        share = f"{100.0 * seg.size / whole:5.1f}%" if whole and seg.size is not None else ""
        text_lines.append(f"  {char} {seg.label:<52}{size:>12}  {share}".rstrip())
        legend_html.append(
            f'<span style="white-space:nowrap;margin-right:14px"><span style="display:inline-block;width:10px;'
            f'height:10px;background:{colour};border:{_BORDER};vertical-align:middle;margin-right:4px"></span>'
            f"{esc(seg.label)}: <b>{esc(size)}</b>" + (f" ({share.strip()})" if share else "") + "</span>")
    if state.source:
        text_lines.append(f"  (numbers from: {state.source})")
    html = ""
    if drawable:
        html += _html_bar(segments, whole)
        if requested:
            html += _html_request(requested, whole, free)
    else:
        html += f'<div style="{_DIM}">{esc(state.device)}: no bar (total capacity unknown)</div>'
    html += f'<div style="margin:3px 0 6px 0;line-height:1.7">{"".join(legend_html)}'
    if state.source:
        html += f'<span style="{_DIM}">numbers from: {esc(state.source)}</span>'
    html += "</div>"
    return "\n".join(text_lines), html


def _seg_style(seg: Segment) -> Tuple[str, str]:
    return _STYLE.get(seg.key, ("?", "rgba(128,128,128,0.4)"))


def _chars(segments: Sequence[Segment], whole: int, width: int) -> List[int]:
    """Characters per segment: proportional (largest remainder), at least one for a non-empty layer."""
    exact = [width * (s.size or 0) / whole for s in segments]
    counts = [int(e) for e in exact]
    for i in sorted(range(len(exact)), key=lambda i: exact[i] - counts[i], reverse=True)[: width - sum(counts)]:
        counts[i] += 1
    for i, s in enumerate(segments):
        if s.size and counts[i] == 0:  # a small layer stays visible, at the largest one's expense
            counts[i] = 1
            counts[counts.index(max(counts))] -= 1
    return counts


def _text_bar(segments: Sequence[Segment], whole: int) -> str:
    counts = _chars(segments, whole, BAR_WIDTH)
    return "".join(_seg_style(s)[0] * n for s, n in zip(segments, counts))


def _request_note(requested: int, free: Optional[int], whole: Optional[int] = None) -> str:
    note = f"requested {format_bytes(requested)}"
    if whole and requested > whole:
        note += f" (more than the whole {format_bytes(whole)})"
    elif free is not None and requested > free:
        note += f" ({format_bytes(requested - free)} more than free)"
    elif free is not None:
        note += f" (fits in the {format_bytes(free)} free: not a question of total size)"
    return note


def _text_request(requested: int, whole: int, free: Optional[int]) -> str:
    n = min(BAR_WIDTH, max(1, round(BAR_WIDTH * requested / whole)))
    return " " + " " * (BAR_WIDTH - n) + "^" * n + f" {_request_note(requested, free, whole)}"


def _widths(segments: Sequence[Segment], whole: int) -> List[float]:
    return [100.0 * (s.size or 0) / whole for s in segments]


def _html_bar(segments: Sequence[Segment], whole: int) -> str:
    cells = []
    for seg, width in zip(segments, _widths(segments, whole)):
        _char, colour = _seg_style(seg)
        size = format_bytes(seg.size)
        cells.append(f'<div class="gm-seg" title="{esc(seg.label)}: {esc(size)}" '
                     f'style="width:{width:.3f}%;background:{colour};height:100%"></div>')
    return (f'<div class="gm-bar" style="display:flex;width:100%;height:16px;border:{_BORDER};'
            f'border-radius:2px;overflow:hidden;box-sizing:border-box">{"".join(cells)}</div>')


def _html_request(requested: int, whole: int, free: Optional[int]) -> str:
    width = min(100.0, 100.0 * requested / whole)
    note = esc(_request_note(requested, free, whole))
    return (f'<div style="display:flex;justify-content:flex-end;width:100%;margin-top:2px">'
            f'<div class="gm-request" title="{note}" style="width:{width:.3f}%;min-width:3px;height:8px;'
            f'border:1.5px dashed {_REQUEST_COLOUR};box-sizing:border-box"></div></div>'
            f'<div style="text-align:right;color:{_REQUEST_COLOUR};font-weight:600">{note}</div>')


# --------------------------------------------------------------------------------------------------
# 4. Earlier cells


def _cells_section(records: Sequence[Any], state: MemoryState) -> Optional[Tuple[str, str]]:
    rows = cell_deltas(records or (), state)[:5]
    if not rows:
        return None
    what = "Δhost RSS" if state.device_type == "cpu" else "Δallocated"
    table = []
    for rec, delta in rows:
        first = rec.first_line if len(rec.first_line) <= 60 else rec.first_line[:59] + "…"
        note = f" ({rec.error})" if getattr(rec, "error", None) else ""
        table.append([rec.label + note, format_delta(delta), first])
    title = f"What earlier cells left behind ({what}, largest first)"
    text = title + "\n" + _indent(text_table(["cell", what, "source"], table, left=(0, 2)))
    summary = "What earlier cells left behind: " + ", ".join(f"{r[0]} {r[1]}" for r in table[:3])
    body = html_table(["cell", what, "source"], table, left=(0, 2), src_col=2)
    return text, details_html(summary, body)


# --------------------------------------------------------------------------------------------------
# 5. Diagnosis


def _diagnosis(findings: Sequence[Finding]) -> Tuple[str, str]:
    if not findings:
        msg = "Diagnosis: nothing specific found in the numbers given."
        return msg, f'<div style="{_DIM}">{esc(msg)}</div>'
    text = ["Diagnosis"]
    items = []
    for n, f in enumerate(findings, 1):
        text.append(f"{n}. {f.title}  [{f.confidence}]")
        text.extend(_wrap_text(f.detail, "   ", "   "))
        text.extend(_wrap_text("Fix: " + f.fix, "   ", "        "))
        if f.snippet:
            text.extend("       " + line for line in f.snippet.splitlines())
        colour = _CONFIDENCE_COLOUR.get(f.confidence, _CONFIDENCE_COLOUR["possible"])
        snippet = (f'<pre style="margin:3px 0;padding:4px 6px;background:rgba(128,128,128,0.12);border:{_BORDER};'
                   f'border-radius:3px;white-space:pre;overflow-x:auto;color:inherit">{esc(f.snippet)}</pre>'
                   if f.snippet else "")
        items.append(
            f'<li class="gm-finding" data-key="{esc(f.key)}" style="margin:4px 0">'
            f"<b>{esc(f.title)}</b> "
            f'<span style="font-size:10px;border:1px solid {colour};color:{colour};border-radius:3px;'
            f'padding:0 4px">{esc(f.confidence)}</span>'
            f'<div style="white-space:normal">{esc(f.detail)}</div>'
            f'<div style="white-space:normal"><b>Fix:</b> {esc(f.fix)}</div>{snippet}</li>')
    html = ('<div style="font-weight:700;margin-top:6px">Diagnosis</div>'
            f'<ol style="margin:2px 0;padding-left:22px">{"".join(items)}</ol>')
    return "\n".join(text), html


def _wrap_text(text: str, first: str, rest: str) -> List[str]:
    # Break at spaces only: hyphenated words and long code spans stay whole.
    return textwrap.wrap(text, _TEXT_WIDTH, initial_indent=first, subsequent_indent=rest,
                         break_on_hyphens=False, break_long_words=False)


def _indent(block: str) -> str:
    return "\n".join("  " + line for line in block.splitlines())
