"""The session chart's layout: what the SVG picture and the plotly figure both draw, computed once from a snapshot.

A :class:`SessionLayout` is plain data (numbers, names, colours): the series drawn and how, the cell
bands by kind, each cell's exact peak where the samples missed it, the processes a cell launched,
the device capacities on and off the scale, the byte unit and ticks, the time range and the legend.
``svg.line_chart`` turns it into a picture and ``figures.session`` into a plotly figure, as Rich
renders one segment list to text and to HTML, so the two can never disagree. Words (hovers,
titles) come from :mod:`.words` where a renderer places them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional, Tuple

from ..core.devices import Device
from ..core.units import MiB
from . import words
from .scale import ByteUnit, byte_ticks, byte_unit
from .style import INK, PEAK_COLOR, RANK_COLORS, device_color, line_kind
from .timeline import HOST_RSS, MissedPeak, SeriesKey, Span, TimelineSnapshot

__all__ = ["SeriesPlan", "CellSlot", "RankSeries", "LegendItem", "SessionLayout", "session_layout", "drawn_keys",
           "CAPACITY_ON_SCALE", "PEAK_KIND"]

#: A capacity line is drawn (and included in the y range) when the data reach this fraction of
#: it; below that, an 80 GiB line would squash a 2 GiB session into the bottom pixels, so the
#: capacity is only written as a note.
CAPACITY_ON_SCALE = 0.3
#: The legend kind of a cell's exact peak: its own glyph (a short bar with end ticks), never a line.
PEAK_KIND = "peak"
_QUANTITY_ORDER = {"allocated": 0, "reserved": 1, "used": 2, "rss": 3}


class SeriesPlan(NamedTuple):
    """One series as drawn: its key, name, colour, line kind (``solid``/``dash``/``dot``), values
    (the bucket maxima), and ``lows`` where the merged points' min-max band is drawn (else None)."""

    key: SeriesKey
    name: str
    color: str
    kind: str
    values: tuple
    lows: Optional[tuple]
    group: str  # legend group: the quantity with one device, the device with several


class CellSlot(NamedTuple):
    """One cell band: its span, where it starts and ends (the running cell ends at the chart's end),
    and its kind: ``running``, ``failed``, or ``even``/``odd`` (back-to-back cells alternate)."""

    span: Span
    start: float
    end: float
    kind: str


class RankSeries(NamedTuple):
    """A process a cell launched: its host RSS at the cell's start, mid-cell (its peak) and end; None
    values break the line between cells."""

    label: str
    color: str
    xs: tuple
    ys: tuple


class LegendItem(NamedTuple):
    """A legend entry: its words, colour (None: words alone) and glyph: a line kind, :data:`PEAK_KIND`,
    ``box``/``box-out`` (a role added/released), or ``""``."""

    label: str
    color: Optional[str]
    kind: str


@dataclass(frozen=True)
class SessionLayout:
    """The session chart, ready to draw (see the module docstring).

    Attributes:
        t: sample times (seconds from the session start); ``merged`` leading points are buckets.
        series: the series drawn, in legend order.
        cells: the cell bands, oldest first (the running cell last).
        peaks: each closed cell's exact peak above every sample of the series it belongs to.
        ranks: the processes cells launched, one series each.
        capacities: ``(device, bytes)`` drawn as lines; ``off_scale`` those only written.
        several: more than one device is drawn (names then carry the device).
        x0, x1: the time range; ``top`` and ``ticks``: the byte axis (from 0).
        unit: the byte unit of the values (figures divide by it; the ticks are written in it).
        exact_peak: a cell chart's exact peak from its record (a dashed line), else None.
        legend: the legend entries, in order (the exact peak's line carries its own label).
        empty: why there is nothing to draw ("no samples yet"), else "".
        end: the latest time the snapshot knows of.
    """

    t: tuple = ()
    merged: int = 0
    series: Tuple[SeriesPlan, ...] = ()
    cells: Tuple[CellSlot, ...] = ()
    peaks: Tuple[MissedPeak, ...] = ()
    ranks: Tuple[RankSeries, ...] = ()
    capacities: tuple = ()
    off_scale: tuple = ()
    several: bool = False
    x0: float = 0.0
    x1: float = 1.0
    top: float = float(MiB)
    ticks: tuple = (0, MiB)
    unit: ByteUnit = ByteUnit(MiB, "MiB")
    exact_peak: Optional[int] = None
    legend: Tuple[LegendItem, ...] = ()
    empty: str = ""
    end: float = 0.0


def _max(values) -> int:
    try:
        return max(values, default=0)
    except TypeError:  # None among the values (a series that started late)
        return max((v for v in values if v is not None), default=0)


def drawn_keys(series: Mapping) -> list:
    """The series a chart draws: CUDA ones when any device has data (device order, then allocated,
    reserved, used), else host RSS."""
    cuda_keys = [k for k, v in series.items() if k.device.is_cuda and any(x is not None for x in v)]
    if cuda_keys:
        return sorted(cuda_keys, key=lambda k: (k.device.index or 0, _QUANTITY_ORDER.get(k.quantity, 9)))
    return [k for k in series if k == HOST_RSS and any(x is not None for x in series[k])]


def _cell_kind(span: Span, index: int) -> str:
    if span.end is None:
        return "running"
    if span.failed:
        return "failed"
    return "odd" if index % 2 else "even"


def _ranks(spans) -> Tuple[RankSeries, ...]:
    series: dict = {}
    for span in spans:
        if not span.ranks or span.end is None:
            continue
        mid = (span.start + span.end) / 2
        for r in span.ranks:
            xs, ys = series.setdefault(r.label, ([], []))
            for t, v in ((span.start, r.rss_before), (mid, r.peak_rss), (span.end, r.rss_after)):
                if v is not None:
                    xs.append(round(t, 3))
                    ys.append(v)
            xs.append(None)
            ys.append(None)
    names = sorted(series, key=lambda name: (not name.startswith("rank"), len(name), name))
    return tuple(RankSeries(name, RANK_COLORS[i % len(RANK_COLORS)], tuple(series[name][0]), tuple(series[name][1]))
                 for i, name in enumerate(names))


def _legend(plans, several: bool, peaks, ranks) -> Tuple[LegendItem, ...]:
    """One entry per series for one device, compact (quantities in ink, devices in colour) for several."""
    if not several:
        items = [LegendItem(plan.name, plan.color, plan.kind) for plan in plans]
    else:
        quantities = sorted({p.key.quantity for p in plans}, key=lambda q: _QUANTITY_ORDER.get(q, 9))
        devices = sorted({p.key.device for p in plans}, key=lambda d: d.index or 0)
        items = [LegendItem(words.quantity_name(q), INK, line_kind(q)) for q in quantities]
        items += [LegendItem(d.label, device_color(d), "solid") for d in devices]
    items += [LegendItem(f"{rank.label} RSS", rank.color, "dot") for rank in ranks]
    if peaks:
        items.append(LegendItem(words.PEAK_LEGEND, PEAK_COLOR, PEAK_KIND))
    return tuple(items)


def session_layout(snapshot: Optional[TimelineSnapshot], *, exact_peak: Optional[int] = None,
                   capacities: Optional[Mapping[Device, int]] = None) -> SessionLayout:
    """The layout of ``snapshot``'s chart; never raises on empty or None data.

    Args:
        exact_peak: a cell chart's exact peak (its record's), drawn as a dashed line when the chart
            draws that quantity.
        capacities: capacities known besides the snapshot's (a cell record's device total).
    """
    if snapshot is None or snapshot.empty:
        return SessionLayout(empty="no samples yet")
    keys = drawn_keys(snapshot.series)
    if not keys and not snapshot.spans:
        return SessionLayout(empty="no memory readings yet", end=snapshot.end)
    several = len({k.device for k in keys}) > 1
    plans = tuple(SeriesPlan(key, words.series_name(key), device_color(key.device), line_kind(key.quantity),
                             snapshot.series[key],
                             snapshot.lows.get(key) if key.quantity in ("allocated", "rss") and snapshot.merged else None,
                             key.device.label if several else key.quantity) for key in keys)
    peaks = snapshot.missed_peaks(keys) if snapshot.t else ()
    ranks = _ranks(snapshot.spans)
    known = dict(snapshot.capacities)
    for device, total in (capacities or {}).items():
        known.setdefault(device, total)
    data_max = max([_max(p.values) for p in plans] + [m.peak for m in peaks] + [exact_peak or 0]
                   + [v for r in ranks for v in r.ys if v is not None], default=0)
    on, off = [], []
    for device in sorted({k.device for k in keys if k.device.is_cuda}, key=lambda d: d.index or 0):
        total = known.get(device)
        if total:
            (on if data_max >= CAPACITY_ON_SCALE * total else off).append((device, int(total)))
    top_value = max([data_max] + [total for _, total in on])
    top, ticks = byte_ticks(max(top_value * 1.04, MiB))  # all zeros still get a sane axis
    starts = ([snapshot.t[0]] if snapshot.t else []) + [s.start for s in snapshot.spans]
    x0 = min(starts, default=0.0)
    x1 = max([snapshot.end if snapshot.end is not None else x0, x0 + 1e-6] + list(snapshot.t[-1:]))
    cells = tuple(CellSlot(span, span.start, span.end if span.end is not None else max(x1, span.start),
                           _cell_kind(span, i)) for i, span in enumerate(snapshot.spans))
    shown_peak = exact_peak if exact_peak is not None and plans else None
    return SessionLayout(
        t=snapshot.t, merged=snapshot.merged, series=plans, cells=cells, peaks=peaks, ranks=ranks,
        capacities=tuple(on), off_scale=tuple(off), several=several, x0=x0, x1=x1,
        top=top, ticks=tuple(ticks), unit=byte_unit(data_max), exact_peak=shown_peak,
        legend=_legend(plans, several, peaks, ranks), end=snapshot.end)
