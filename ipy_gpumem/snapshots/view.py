"""A snapshot report drawn: the headline figures, the chart with the peak marked, the sites live at the peak, fragmentation, and the OOM panel."""
from __future__ import annotations

import sys
from typing import List, Mapping, Optional

from ..chart.svg.line_chart import draw_timeline
from ..chart.timeline import SeriesKey, Span, TimelineSnapshot
from ..core.devices import cuda
from ..core.memory import DeviceMemory
from ..core.units import format_bytes as b
from ..core.units import format_seconds
from ..display.parts import Blank, Details, Heading, Line, Para, Raw, Span as Text, Table, render
from ..display.view import esc
from ..oom.analysis import analyse_recording
from ..oom.operation import allocation_name
from ..oom.panel import oom_panel
from ..oom.parse.report import OomReport
from .load import MAX_BYTES
from .report import SnapshotReport, read_snapshot

__all__ = ["open_snapshot", "snapshot_view", "oom_view", "timeline_of", "snapshot_figure", "figure_bundle",
           "MAX_POINTS"]

#: Points per series in the chart: longer windows keep each bucket's highest and lowest value.
MAX_POINTS = 1200
#: Annotated spans drawn on the chart (optimizer steps, data loading, ...).
MAX_SPANS = 60
_STYLE = "font-family:sans-serif;font-family:var(--jp-ui-font-family,sans-serif);font-size:13px;line-height:1.45"


def _when(report, t: Optional[float], device: int) -> str:
    if t is None:
        return ""
    return f" at {format_seconds(t)}" if report.replay(device).timed else f" at event {int(t)}"


def timeline_of(report, device: Optional[int] = None, start: Optional[float] = None,
                end: Optional[float] = None) -> TimelineSnapshot:
    """The chart's data: allocated and reserved after each event in ``[start, end]``, at most :data:`MAX_POINTS` each."""
    r = report.replay(device)
    lo, hi = report.window(r.device, start, end)
    step = max(1, -(-(hi - lo) // MAX_POINTS))
    t: List[float] = []
    keys = (SeriesKey(cuda(r.device), "allocated"), SeriesKey(cuda(r.device), "reserved"))
    high = {k: [] for k in keys}
    low = {k: [] for k in keys}
    for i in range(lo, hi, step):  # a bucket at a time: a long capture's series are never copied whole
        t.append(r.times[i])
        for key, values in zip(keys, (r.allocated, r.reserved)):
            chunk = values[i:min(hi, i + step)]
            high[key].append(max(chunk))
            low[key].append(min(chunk))
    spans = []
    for a in report.annotations():
        if a.device not in (None, r.device) or a.start is None or a.end is None:
            continue
        if (start is not None and a.end < start) or (end is not None and a.start > end):
            continue
        label = a.name.split("#")[-1].rsplit(".", 1)[-1][:14]
        spans.append(Span(a.start, a.end, label, a.name[:80], recorded=True, duration=a.end - a.start))
        if len(spans) >= MAX_SPANS:
            break
    return TimelineSnapshot(t=tuple(t), series={k: tuple(v) for k, v in high.items()},
                            lows={k: tuple(v) for k, v in low.items()}, spans=tuple(spans),
                            end=r.times[hi - 1] if hi > lo else 0.0, merged=len(t) if step > 1 else 0, stride=step,
                            added=hi - lo)


def _title(report, device: int, start, end, solid: bool = True) -> str:
    peak, _ = report.peak(device, "allocated", start, end)
    over = "over time" if report.replay(device).timed else "over events"
    lines = " (solid) and reserved (dashed)" if solid else " and reserved"
    return f"cuda:{device}: allocated{lines} {over}, peak allocated {b(peak)}"


def _svg(report, device: int, start, end, ink: Optional[str] = None) -> str:
    snap = timeline_of(report, device, start, end)
    if snap.empty:
        return ""
    return draw_timeline(snap, title=_title(report, device, start, end), ink=ink, titles=ink is None).svg


def _chart(report, device: int, start, end) -> Raw:
    """The chart as an image of the SVG: an untrusted notebook's sanitizer strips an inline <svg> (its
    axis labels would spill out as a run-on line of text) but keeps an image."""
    from ..chart.style import IMG_INK
    from ..chart.views import svg_data_uri

    svg = _svg(report, device, start, end, ink=IMG_INK)
    if not svg:
        return Raw("", "")
    title = _title(report, device, start, end)
    return Raw("", f'<div style="margin:4px 0"><img alt="{esc(title)}" src=\'{svg_data_uri(svg)}\' '
                   f'style="max-width:100%;display:block"></div>')


def snapshot_figure(report, start: Optional[float] = None, end: Optional[float] = None,
                    device: Optional[int] = None) -> dict:
    """The chart as a plotly figure dict: allocated and reserved over the window, the peak marked,
    the annotations as bands; the x axis in seconds, or in events when the capture has no times."""
    from ..chart.figures.timeline import byte_unit, timeline_figure

    d = report.device if device is None else device
    snap = timeline_of(report, d, start, end)
    timed = report.replay(d).timed
    figure = timeline_figure(snap, height=300, title=_title(report, d, start, end, solid=False),
                             filename=f"snapshot-cuda{d}")
    xaxis = figure["layout"]["xaxis"]
    if not timed:
        xaxis["title"]["text"] = "event (no times recorded)"
        xaxis["ticksuffix"] = ""
    for trace in figure["data"]:  # the bands are the program's annotations here, not cells
        if str(trace.get("name", "")).startswith("cells"):
            trace["name"] = "annotations" + trace["name"][len("cells"):]
    for note in figure["layout"]["annotations"]:
        if note.get("text") == "no samples yet":
            note["text"] = "no allocator events recorded"
    if not snap.empty:
        peak, at = report.peak(d, "allocated", start, end)
        t = report.time_of(at, d)
        top = max(max(v) for v in snap.series.values() if v)
        divisor, unit = byte_unit(top)
        when = (f"{format_seconds(t)}" if timed else f"event {int(t)}") if t is not None else "the start"
        figure["data"].append({
            "type": "scatter", "mode": "markers", "name": f"peak allocated {b(peak)}",
            "x": [t if t is not None else (snap.t[0] if snap.t else 0.0)], "y": [round(peak / divisor, 4)],
            "marker": {"symbol": "triangle-down", "size": 11, "color": "#d1495b"},
            "hovertemplate": f"peak allocated {b(peak)} at {when}<extra></extra>",
        })
    return figure


def figure_bundle(report, start: Optional[float] = None, end: Optional[float] = None,
                  device: Optional[int] = None) -> dict:
    """One output: the plotly figure, the SVG chart as an image for viewers without plotly, a line of text."""
    from ..chart.style import IMG_INK
    from ..chart.views import figure_output

    d = report.device if device is None else device
    return figure_output(snapshot_figure(report, start, end, d), _svg(report, d, start, end, ink=IMG_INK),
                         text=f"(chart of {report.source}, cuda:{d})")


def _sites_table(rows) -> Table:
    body = [(r["name"], b(r["bytes"]), str(r["blocks"])) for r in rows]
    return Table(("allocated at", "bytes", "blocks"), body, left=(0,), indent="  ")


def _frag_line(frag: Optional[dict], what: str) -> Optional[Line]:
    if not frag:
        return None
    largest = frag["largest_free_block"]
    tail = (f", the largest free block {b(largest)}" if largest is not None
            else " (expandable segments: free pages are unmapped, not split)")
    return Line(f"  {what}: {b(frag['free_in_reserved'])} free inside reserved segments{tail}")


def snapshot_view(report, start: Optional[float] = None, end: Optional[float] = None, device: Optional[int] = None,
                  chart: bool = True, panel: bool = True):
    """Text and HTML for ``report`` (``View.data`` is the device's ``device_dict()``, zoomed).

    ``chart=False`` leaves the inline SVG chart out (a notebook shows :func:`figure_bundle` after it);
    ``panel=False`` leaves the OOM panel out (a live panel already shows this failure)."""
    d = report.device if device is None else device
    data = report.device_dict(d)
    r = report.replay(d)
    if start is not None or end is not None:
        peak_a, at = report.peak(d, "allocated", start, end)
        peak_r, at_r = report.peak(d, "reserved", start, end)
        rows = [dict(s.site._asdict(), name=s.site.label, bytes=s.bytes, blocks=s.blocks)
                for s in report.sites_at(at, d)[:12]]
        data = dict(data, peak_allocated=peak_a, peak_allocated_at=report.time_of(at, d), peak_reserved=peak_r,
                    peak_reserved_at=report.time_of(at_r, d), sites=rows)
    events = f"{r.events} event" + ("" if r.events == 1 else "s")
    window = (f"{events} over {format_seconds(data['window_s'])}" if r.timed
              else f"{events} (no times recorded)")
    zoom = ""
    if start is not None or end is not None:
        zoom = f"; showing {format_seconds(start or 0.0)} to {format_seconds(end) if end is not None else 'the end'}"
    parts: list = [
        Heading(f"Memory snapshot {report.source}: cuda:{d}"),
        Line(Text(f"{report.generation} format, {window}{zoom}", "dim")),
        Line("Peak allocated ", Text(b(data["peak_allocated"]), "bold"), _when(report, data["peak_allocated_at"], d),
             "; peak reserved ", Text(b(data["peak_reserved"]), "bold"), _when(report, data["peak_reserved_at"], d)),
        Line(f"When recording began: {b(data['start']['allocated'])} allocated, {b(data['start']['reserved'])} "
             f"reserved ({data['start']['blocks']} blocks); at the end: {b(data['end']['allocated'])} allocated, "
             f"{b(data['end']['reserved'])} reserved"),
    ]
    oom = data["oom"]
    if oom:
        largest = oom["largest_free_block"]
        parts.append(Line(Text("Out of memory", "err"), _when(report, oom["t"], d),
                          f": tried to allocate {b(oom['tried_to_allocate'])} with {b(oom['device_free'])} free on "
                          f"the device; {b(oom['allocated'])} allocated, {b(oom['reserved'])} reserved "
                          f"({b(oom['reserved_unallocated'])} reserved but unallocated"
                          + (f", largest free block {b(largest)}" if largest is not None else "") + ")"))
        if oom["site"]:
            name = oom["site"]["name"]
            if not oom["site"]["file"]:  # C++ only: what made it (autograd's node, the operator), not a signature
                name = allocation_name(report.recorded_ooms(d)[0].frames) or "made in C++, no Python frame recorded"
            parts.append(Line(Text(f"  the failing allocation: {name}", "dim")))
    if chart:
        parts.append(_chart(report, d, start, end))
    if data["sites"]:
        parts += [Heading("Allocated at the peak, by site"), _sites_table(data["sites"])]
    frag = data["fragmentation"]
    lines = [_frag_line(frag["most_free"], "most free space"), _frag_line(frag["at_oom"], "at the failure"),
             _frag_line(frag["at_end"], "at the end")]
    if any(lines):
        parts += [Heading("Fragmentation")] + [x for x in lines if x is not None]
    notes = report.annotations()
    if notes:
        counts: dict = {}
        for a in notes:
            counts[a.name] = counts.get(a.name, 0) + 1
        parts.append(Details(f"Annotations: {len(notes)} spans", [Para("; ".join(f"{n} ×{c}" for n, c in counts.items()))]))
    others = [x for x in sorted(report.replays) if x != d]
    if others:
        parts.append(Line(Text("Other devices: " + "; ".join(
            f"cuda:{x} peak allocated {b(report.replays[x].peak()[0])}" for x in others)
            + " (report.view(device=N))", "dim")))
    check = r.check
    if not check.ok:
        parts.append(Line(Text(f"Replay check: {check.exact} of {check.blocks} block sizes exact, "
                               f"{check.anomalies} events outside the recorded state", "dim")))
    if oom and panel:
        shown = oom_view(report, d)
        if shown is not None:
            parts += [Blank(), Raw(shown.text, shown.html)]
    return render(parts, style=_STYLE, data=data)


def oom_view(report, device: Optional[int] = None):
    """The live OOM panel, fed from the recorded failure instead of a message; None without one."""
    oom = report.oom(device)
    if oom is None:
        return None
    d = oom["device"]
    memory = DeviceMemory(device=cuda(d), allocated=oom["allocated"], reserved=oom["reserved"])
    message = (f"CUDA out of memory. Tried to allocate {b(oom['tried_to_allocate'])}. GPU {d} has "
               f"{b(oom['device_free'])} free. Of the allocated memory {b(oom['allocated'])} is allocated by "
               f"PyTorch, and {b(oom['reserved_unallocated'])} is reserved by PyTorch but unallocated. "
               "(rebuilt from the snapshot's oom event)")
    report_ = OomReport("cuda_allocator", message, exception_type="torch.OutOfMemoryError", backend="native",
                        device_type="cuda", gpu_index=d, requested=oom["tried_to_allocate"], free=oom["device_free"],
                        allocated_by_pytorch=oom["allocated"], reserved_unallocated=oom["reserved_unallocated"])
    conf = report.settings.get("PYTORCH_CUDA_ALLOC_CONF")
    env = {"PYTORCH_CUDA_ALLOC_CONF": conf} if conf else {}
    # The recorded stack (its C++ frames too) names the operation and the phase.
    return oom_panel(analyse_recording(report_, memory, report.recorded_ooms(d)[0], env=env))


def open_snapshot(source, *, cells: Optional[Mapping[str, int]] = None, max_bytes: int = MAX_BYTES) -> SnapshotReport:
    """:func:`~.report.read_snapshot` with this module as its views: what ``ipy_gpumem.snapshot()`` returns."""
    return read_snapshot(source, cells=cells, max_bytes=max_bytes, views=sys.modules[__name__])
