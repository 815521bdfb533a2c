"""The out-of-memory panel: the request against the device's memory in layers, who holds it, earlier cells, and the diagnosis.

:func:`oom_panel` turns an ``OomAnalysis`` into one list of parts (``display.parts``) that renders
to aligned text for terminal IPython and to self-contained HTML (inline styles, no script, no
external resource) for notebooks, so the two cannot disagree. The panel sits right under the
user's traceback, so it never repeats the error message: its first line is the answer (what needed
the memory and why it did not fit), and the request is restated once below it, in torch's spelling. Colours are mid-tones with the text colour inherited, so the panel reads in
light and dark themes alike; ``parts`` escapes everything that came from the user or the message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from ..core.memory import DeviceMemory
from ..core.text import cell_name
from ..core.units import format_bytes, format_delta
from ..display.parts import Block, Code, Details, Heading, Line, Numbered, Para, Raw, Span, Table, render
from ..display.view import View, esc
from ..attribution.view import who_section
from .answer import answer, restated, where_words

__all__ = ["oom_panel", "headline", "memory_layers", "Segment", "BAR_WIDTH"]

BAR_WIDTH = 60  # characters of the text bar

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
_CONFIDENCE_COLOUR = {"certain": "#2e9e58", "likely": "#b7791f", "possible": "rgba(128,128,128,0.9)"}
_PANEL_STYLE = f"border-left:3px solid {_STYLE['allocated'][1]};padding:4px 10px;max-width:980px"


def oom_panel(analysis, *, max_holders: int = 8, max_cells: int = 5) -> View:
    """The panel for an ``OomAnalysis`` (see :func:`ipy_gpumem.oom.analysis.analyse`).

    Sections, in order: the answer (what needed the memory and why it did not fit, ``oom.answer``) with
    the error's own numbers below it, the device's memory in layers
    with the request drawn against the free part, what a recording of the failure adds (the
    fragmentation and the failing line), who holds it, what earlier cells left behind,
    and the numbered diagnosis. ``View.data`` is the analysis itself.
    """
    parts = [
        _headline(analysis),
        _layers(analysis),
        _recorded(getattr(analysis, "recorded", None), getattr(analysis, "operation", None)),
        _who(analysis.who, max_holders),
        _earlier(analysis, max_cells),
        _diagnosis(analysis),
    ]
    return render(parts, gap="\n\n", style=_PANEL_STYLE, data=analysis)


# ==================================================================================================
# 1. The headline
# ==================================================================================================


def headline(memory: DeviceMemory, requested: Optional[int], free: Optional[int], sure: bool = True,
             process: Optional[str] = None) -> str:
    """The error's own numbers in one line: ``Out of memory on cuda:0: tried to allocate 2.32 GiB with 182.75 MiB
    free (15.78 GiB total)``; the panel's first line when nothing more is known (see ``oom.answer``).

    ``sure=False`` (a message that is out-of-memory only in most reports, such as cuDNN finding no
    algorithm) starts it with "Probably out of memory". ``process`` names a launched process that
    failed (``rank 1 (pid 4242)``): ``Out of memory in rank 1 (pid 4242) on ...``.
    """
    within = f" in {process}" if process else ""
    return f"{'Out' if sure else 'Probably out'} of memory{within} on {where_words(memory)}: " \
        + restated(memory, requested, free)


def _free(analysis) -> Optional[int]:
    # The message's own "free" is what the allocator saw; a later reading may differ.
    free = getattr(analysis.oom, "free", None)
    return free if free is not None else analysis.memory.free


def _sure(oom) -> bool:
    # The parser says how sure it is that the message is an out-of-memory (OomReport.confidence);
    # a report without the field, or a certain one, is.
    confidence = getattr(oom, "confidence", None)
    if confidence is None or confidence == "certain":
        return True
    return isinstance(confidence, (int, float)) and not isinstance(confidence, bool) and confidence >= 1


def _headline(analysis):
    rank = getattr(analysis, "rank", None)
    process = None
    if rank is not None:
        process = (f"rank {rank.rank}" if rank.rank is not None else "a launched process") + (
            f" (pid {rank.pid})" if rank.pid is not None else "")
    free = _free(analysis)
    text = answer(analysis, free, _sure(analysis.oom), process)
    lines = [Line(Span(text, "font-size:13px;font-weight:700"))]
    said = headline(analysis.memory, getattr(analysis.oom, "requested", None), free, _sure(analysis.oom), process)
    if said != text:  # the answer first; the error's own numbers below it
        lines.append(Para("The error: " + restated(analysis.memory, getattr(analysis.oom, "requested", None), free)
                          + ".", "dim"))
    line = Block(lines) if len(lines) > 1 else lines[0]
    if rank is None:
        return line
    # The launcher's traceback reached the cell; the message explained is the process's own.
    note = (f"{process[0].upper()}{process[1:]} failed with {rank.error or 'an out-of-memory error'}; {rank.launcher}'s "
            f"{rank.exception} brought its traceback back to this cell, and its message is explained below "
            "(the other ranks are in the cell's line).")
    if getattr(rank, "signal", None) == "SIGKILL":
        # Nothing in the process could say why: the kernel's OOM killer sends SIGKILL when RAM runs out.
        note = (f"{process[0].upper()}{process[1:]} was killed by SIGKILL, which nothing in Python can catch: the "
                "kernel's OOM killer is the likely cause (dmesg or journalctl -k shows \"Out of memory: Killed "
                f"process\" with its pid); {rank.launcher}'s {rank.exception} reported it to this cell.")
    return Block(lines + [Para(note, "dim")])


# ==================================================================================================
# 2. The layers
# ==================================================================================================


@dataclass(frozen=True)
class Segment:
    """One drawn part of the device: a layer, or adjacent layers whose split is unknown.

    Attributes:
        keys: layer keys it covers (``("allocated",)``, or ``("unallocated", "outside")``).
        label: legend text, e.g. ``"reserved but unallocated"``.
        size: bytes, or None when unknown.
    """

    keys: Tuple[str, ...]
    label: str
    size: Optional[int]

    @property
    def key(self) -> str:
        return self.keys[0]


def _layer_bounds(memory: DeviceMemory) -> List[Tuple[str, str, Optional[int]]]:
    """``(key, label, upper boundary in bytes)`` from the bottom of the device to its total."""
    kind = memory.device.type if memory.device is not None else ""
    if memory.is_host:
        return [("process", "this process (RSS)", memory.process_used),
                ("outside", "other processes and the OS", memory.used),
                ("free", "available", memory.total)]
    if kind == "mps":
        return [("allocated", "allocated by PyTorch", memory.allocated),
                ("outside", "other allocations", memory.used),
                ("free", "free below the limit", memory.total)]
    return [("allocated", "allocated by PyTorch", memory.allocated),
            ("unallocated", "reserved but unallocated", memory.reserved),
            ("outside", "outside PyTorch (CUDA context, other processes)", memory.used),
            ("free", "free", memory.total)]


def memory_layers(memory: DeviceMemory) -> List[Segment]:
    """The device from bottom to top as segments; a layer whose boundary is unknown merges upward.

    With ``allocated`` and ``used`` known but ``reserved`` unknown, "reserved but unallocated" and
    "outside PyTorch" become one segment. Layers above the last known boundary get size None.
    Boundaries that go backwards (rounded message numbers) count as 0-byte layers.
    """
    out: List[Segment] = []
    prev = 0
    pending: List[Tuple[str, str]] = []
    for key, label, bound in _layer_bounds(memory):
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


def _layers(analysis) -> Raw:
    """The bar, the request marker and the legend, both renderings from one list of segments."""
    memory = analysis.memory
    requested = getattr(analysis.oom, "requested", None)
    free = _free(analysis)
    segments = memory_layers(memory)
    drawable = bool(segments) and segments[-1].size is not None and sum(s.size or 0 for s in segments) > 0
    whole = sum(s.size or 0 for s in segments) if drawable else None
    # A request larger than the whole bar cannot be drawn to scale; the headline states it and
    # the diagnosis says what that means, so the bar does not say it a third time.
    marker = drawable and requested and requested <= whole
    text, html = [], []
    if drawable:
        text.append("[" + _text_bar(segments, whole) + "]")
        html.append(_html_bar(segments, whole))
        if marker:
            note = _request_note(requested, free)
            n = min(BAR_WIDTH, max(1, round(BAR_WIDTH * requested / whole)))
            text.append(" " + " " * (BAR_WIDTH - n) + "^" * n + f" {note}")
            html.append(_html_request(requested, whole, note))
    else:
        no_bar = f"{memory.label}: no bar (total capacity unknown)"
        text.append(no_bar)
        html.append(f'<div style="opacity:0.75">{esc(no_bar)}</div>')
    legend = []
    for seg in segments:
        char, colour = _seg_style(seg)
        size = format_bytes(seg.size) if seg.size is not None else "unknown"
        share = f"{100.0 * seg.size / whole:5.1f}%" if whole and seg.size is not None else ""
        text.append(f"  {char} {seg.label:<52}{size:>12}  {share}".rstrip())
        legend.append(
            f'<span style="white-space:nowrap;margin-right:14px"><span style="display:inline-block;width:10px;'
            f'height:10px;background:{colour};border:{_BORDER};vertical-align:middle;margin-right:4px"></span>'
            f"{esc(seg.label)}: <b>{esc(size)}</b>" + (f" ({share.strip()})" if share else "") + "</span>")
    if memory.source:
        text.append(f"  (numbers from: {memory.source})")
        legend.append(f'<span style="opacity:0.75">numbers from: {esc(memory.source)}</span>')
    html.append(f'<div style="margin:3px 0 6px 0;line-height:1.7">{"".join(legend)}</div>')
    return Raw("\n".join(text), "".join(html))


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


def _request_note(requested: int, free: Optional[int]) -> str:
    """What the marker under the bar means; the request's size is in the headline already."""
    if free is None:
        return "the request"
    if requested > free:
        return f"the request: {format_bytes(requested - free)} more than free"
    return f"the request fits in the {format_bytes(free)} free: not a question of total size"


def _html_bar(segments: Sequence[Segment], whole: int) -> str:
    cells = []
    for seg in segments:
        _char, colour = _seg_style(seg)
        width = 100.0 * (seg.size or 0) / whole
        cells.append(f'<div class="gm-seg" title="{esc(seg.label)}: {esc(format_bytes(seg.size))}" '
                     f'style="width:{width:.3f}%;background:{colour};height:100%"></div>')
    return (f'<div class="gm-bar" style="display:flex;width:100%;height:16px;border:{_BORDER};'
            f'border-radius:2px;overflow:hidden;box-sizing:border-box">{"".join(cells)}</div>')


def _html_request(requested: int, whole: int, note: str) -> str:
    width = min(100.0, 100.0 * requested / whole)
    return (f'<div style="display:flex;justify-content:flex-end;width:100%;margin-top:2px">'
            f'<div class="gm-request" title="{esc(note)}" style="width:{width:.3f}%;min-width:3px;height:8px;'
            f'border:1.5px dashed {_REQUEST_COLOUR};box-sizing:border-box"></div></div>'
            f'<div style="text-align:right;color:{_REQUEST_COLOUR};font-weight:600">{esc(note)}</div>')


def _recorded(recorded, operation=None) -> Optional[Block]:
    """What the allocator's recording adds to the layers: free space inside the reserved segments
    against the largest free block, and the line whose allocation failed (an allocation with no Python
    frame by what made it, never by a C++ signature)."""
    if recorded is None:
        return None
    free = format_bytes(recorded.free_in_reserved)
    if recorded.largest_free_block is None:
        pieces = f"{free} free inside reserved segments (expandable segments: free pages are unmapped, not split)"
    else:
        fits = "large enough" if recorded.largest_free_block >= recorded.requested else "too small"
        pieces = (f"{free} free inside reserved segments, the largest free block "
                  f"{format_bytes(recorded.largest_free_block)} ({fits} for the {format_bytes(recorded.requested)} "
                  "request)")
    lines = [Line(Span(f"Recorded at the failure ({recorded.source}): ", "bold"), pieces)]
    site = recorded.site
    if site and site.startswith("(C++ only)"):
        site = operation.what if operation is not None else "made in C++, with no Python frame recorded"
    elif site and operation is not None and operation.frame is None:
        site = f"{site}, {operation.what[0].lower() + operation.what[1:]}"
    if site:
        lines.append(Line("  the failing allocation: ", Span(site, "bold")))
    return Block(lines)


# ==================================================================================================
# 3. Who holds it, 4. earlier cells
# ==================================================================================================


def _who(who: Any, max_holders: int):
    try:
        return who_section(who, max_holders)
    except Exception as exc:  # noqa: BLE001 - a section that cannot be drawn must not cost the panel
        return Para(f"(who holds it: not shown, {type(exc).__name__}: {exc})", "dim")


def _earlier(analysis, max_cells: int) -> Optional[Details]:
    rows = analysis.earlier[:max_cells]
    if not rows:
        return None
    what = "Δhost RSS" if analysis.memory.is_host else "Δallocated"
    table = [[rec.label + (f" ({rec.error})" if getattr(rec, "error", None) else ""), format_delta(delta),
              cell_name(rec.source, 60)] for rec, delta in rows]
    summary = "What earlier cells left behind: " + ", ".join(f"{r[0]} {r[1]}" for r in table[:3])
    return Details(summary, (Table(["cell", what, "source"], table, left=(0, 2), src_col=2, indent="  "),),
                   title=f"What earlier cells left behind ({what}, largest first)")


# ==================================================================================================
# 5. The diagnosis
# ==================================================================================================


def _diagnosis(analysis) -> Block:
    notes = [Para(f"(ipy_gpumem could not use {error}; the rest is complete)", "dim") for error in analysis.errors]
    if not analysis.findings:
        return Block([Para("Diagnosis: nothing specific found in the numbers given.", "dim")] + notes)
    items = []
    for f in analysis.findings:
        colour = _CONFIDENCE_COLOUR.get(f.confidence, _CONFIDENCE_COLOUR["possible"])
        badge = f"font-size:10px;border:1px solid {colour};color:{colour};border-radius:3px;padding:0 4px"
        item = [Line(Span(f.title, "bold"), "  ", Span(f"[{f.confidence}]", badge)),
                Para(f.detail),
                Para("Fix: " + f.fix, hanging="     ")]
        if f.snippet:
            item.append(Code(f.snippet))
        items.append(item)
    return Block([Heading("Diagnosis"), Numbered(items)] + notes)
