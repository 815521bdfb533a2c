"""The result of reading a snapshot: per device, the replayed counters, the sites live at the peak, fragmentation and the OOM, as data."""
from __future__ import annotations

import bisect
import os
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

from ..oom.analysis import RecordedOom
from ..preflight.allocator import segment_size
from .load import MAX_BYTES, SnapshotError, load_snapshot
from .replay import DeviceReplay, Fragmentation, replay_device, top_of
from .schema import Parsed, devices, parse
from .sites import UNKNOWN, Site, site_of

__all__ = ["SiteBytes", "Annotation", "SnapshotReport", "read_snapshot", "MAX_SITES"]

#: Sites listed at the peak; the rest are summed into one row.
MAX_SITES = 12
#: The label of blocks allocated before recording began whose stack the snapshot does not keep.
BEFORE = Site("", 0, "", "(allocated before recording began)", False)


class SiteBytes(NamedTuple):
    """Bytes (block sizes) one site held at a moment, in how many blocks."""

    site: Site
    bytes: int
    blocks: int


class Annotation(NamedTuple):
    """A span the program marked (``external_annotations``: optimizer steps, DataLoader fetches, ...)."""

    name: str
    device: Optional[int]
    start: Optional[float]  # seconds on the device's clock (the first event is 0)
    end: Optional[float]


class SnapshotReport:
    """A snapshot read and replayed: what ``ipy_gpumem.snapshot()`` and ``%gpumem snapshot`` return.

    Attributes:
        source: the file's name, or ``"torch.cuda.memory._snapshot()"`` for a dict.
        generation: which format generation it was written in.
        replays: per device (with segments or events), its :class:`~.replay.DeviceReplay`.
        device: the device the summary is about: the one that ran out of memory, else the one with
            the highest allocated peak.
        settings: the allocator settings it recorded (empty before 2025).
        cells: notebook cell files of this session by execution count, to name frames ``In [7]``.
        views: what draws it (a module with ``snapshot_view(report, ...)`` and ``oom_view(report,
            device)``: ``snapshots.view``); None leaves it data only (``str()`` is then one line).
    """

    def __init__(self, parsed: Parsed, source: str, cells: Optional[Mapping[str, int]] = None, views: Any = None):
        self.source = source
        self._views = views
        self.generation = parsed.generation
        self.settings = dict(parsed.settings)
        self.cells = dict(cells or {})
        self._parsed = parsed
        self.replays: Dict[int, DeviceReplay] = {}
        for d in devices(parsed):
            self.replays[d] = replay_device(d, [s for s in parsed.segments if s.device == d],
                                            parsed.traces.get(d, ()), parsed.settings)
        if not self.replays:
            raise SnapshotError(f"{source} holds no segments and no events: nothing was recorded")
        with_oom = [d for d, r in self.replays.items() if r.ooms]
        self.device = with_oom[0] if with_oom else max(self.replays, key=lambda d: self.replays[d].peak()[0])

    # -- reading ------------------------------------------------------------------------------------
    def replay(self, device: Optional[int] = None) -> DeviceReplay:
        return self.replays[self.device if device is None else device]

    def window(self, device: Optional[int] = None, start: Optional[float] = None,
               end: Optional[float] = None) -> Tuple[int, int]:
        """Event indices ``[lo, hi)`` whose times fall in ``[start, end]`` seconds (everything when both are None)."""
        r = self.replay(device)
        lo = 0 if start is None else bisect.bisect_left(r.times, start)
        hi = len(r.times) if end is None else bisect.bisect_right(r.times, end)
        return lo, max(lo, hi)

    def peak(self, device: Optional[int] = None, series: str = "allocated", start: Optional[float] = None,
             end: Optional[float] = None) -> Tuple[int, int]:
        """``(bytes, event index)`` of the highest ``series`` value, within ``[start, end]`` seconds if given."""
        r = self.replay(device)
        if start is None and end is None:
            return r.peak(series)
        lo, hi = self.window(device, start, end)
        every = r.allocated if series == "allocated" else r.reserved
        if hi <= lo:  # no event inside: the state the last event before it left
            if lo == 0:
                return (r.initial_allocated if series == "allocated" else r.initial_reserved), -1
            return every[lo - 1], lo - 1
        return top_of(every, lo, hi)

    def site(self, allocation) -> Site:
        if not allocation.frames and allocation.born < 0:
            return BEFORE
        return site_of(allocation.frames, self.cells)

    def sites_at(self, index: int, device: Optional[int] = None) -> List[SiteBytes]:
        """What was allocated just after event ``index``, by site, largest first."""
        totals: Dict[Site, List[int]] = {}
        sites: Dict[int, Site] = {}  # by stack: blocks share their stacks (a file's may be long), each is read once
        for frames, size, before in self.replay(device).allocations.live_stacks(index):
            if not frames and before:
                site = BEFORE
            else:
                site = sites.get(id(frames))
                if site is None:
                    site = sites[id(frames)] = site_of(frames, self.cells)
            row = totals.setdefault(site, [0, 0])
            row[0] += size
            row[1] += 1
        return sorted((SiteBytes(s, b, n) for s, (b, n) in totals.items()), key=lambda r: (-r.bytes, r.site.label))

    def time_of(self, index: int, device: Optional[int] = None) -> Optional[float]:
        r = self.replay(device)
        return r.times[index] if 0 <= index < len(r.times) else None

    def annotations(self) -> List[Annotation]:
        """The program's marked spans, START matched with END, on each device's clock."""
        out: List[Annotation] = []
        open_: Dict[Tuple[Any, Any], List[Optional[float]]] = {}
        for a in self._parsed.annotations:
            device = a.get("device")
            r = self.replays.get(device) if isinstance(device, int) else None
            t = a.get("time_us")
            at = (t - r.start_us) / 1e6 if r is not None and r.start_us is not None and t is not None else None
            key = (a.get("name"), device)
            if a.get("stage") == "START":
                open_.setdefault(key, []).append(at)
            elif a.get("stage") == "END":
                starts = open_.get(key)
                out.append(Annotation(str(a.get("name")), device, starts.pop() if starts else None, at))
        for (name, device), starts in open_.items():
            out.extend(Annotation(str(name), device, s, None) for s in starts)
        return sorted(out, key=lambda a: (a.start is None, a.start or 0.0))

    def metadata(self) -> Dict[str, Dict[str, int]]:
        """Counts of the non-empty ``user_metadata`` and ``compile_context`` values events carry."""
        out: Dict[str, Dict[str, int]] = {"user_metadata": {}, "compile_context": {}}
        for trace in self._parsed.traces.values():
            for key, counts in trace.value_counts(tuple(out)).items():
                for value, n in counts.items():
                    if value and value != "N/A" and n > 0:
                        out[key][value] = out[key].get(value, 0) + n
        return out

    # -- data ---------------------------------------------------------------------------------------
    def _frag(self, f: Optional[Fragmentation], device: int) -> Optional[dict]:
        if f is None:
            return None
        return {"t": self.time_of(f.index, device), "event": f.index, "free_in_reserved": f.free,
                "largest_free_block": f.largest}

    def oom(self, device: Optional[int] = None) -> Optional[dict]:
        """The first out-of-memory event of ``device`` as numbers, or None."""
        r = self.replay(device)
        if not r.ooms:
            return None
        o = r.ooms[0]
        site = site_of(o.frames, self.cells)
        return {
            "device": r.device, "event": o.index, "t": self.time_of(o.index, r.device),
            "requested": o.requested, "tried_to_allocate": segment_size(o.requested),
            "device_free": o.device_free, "allocated": o.allocated, "reserved": o.reserved,
            "reserved_unallocated": o.reserved - o.allocated,
            "free_in_reserved": o.fragmentation.free, "largest_free_block": o.fragmentation.largest,
            "expandable_segments": r.expandable,
            "site": None if site is UNKNOWN else _site_dict(site),
            "ooms": len(r.ooms),
        }

    def recorded_ooms(self, device: Optional[int] = None, source: str = "the snapshot") -> List[RecordedOom]:
        """Every out-of-memory event, in order, as the OOM analysis reads a recorded failure (every
        device's when ``device`` is None); the failing allocation's site names a cell ``In [n], line L``."""
        out: List[RecordedOom] = []
        for d in sorted(self.replays) if device is None else (device,):
            for o in self.replays[d].ooms:
                site = site_of(o.frames, self.cells)
                out.append(RecordedOom(d, segment_size(o.requested), o.device_free, o.allocated, o.reserved,
                                       o.fragmentation.free, o.fragmentation.largest,
                                       None if site is UNKNOWN else site.label, source, tuple(o.frames or ())))
        return out

    def device_dict(self, device: int, max_sites: int = MAX_SITES) -> dict:
        r = self.replays[device]
        peak_a, at_a = r.peak("allocated")
        peak_r, at_r = r.peak("reserved")
        sites = self.sites_at(at_a, device)
        rows = [dict(_site_dict(s.site), bytes=s.bytes, blocks=s.blocks) for s in sites[:max_sites]]
        rest = sites[max_sites:]
        if rest:
            rows.append({"file": "", "line": 0, "function": "", "name": f"{len(rest)} other sites", "user": False,
                         "bytes": sum(s.bytes for s in rest), "blocks": sum(s.blocks for s in rest)})
        frag = r.fragmentation
        worst = max(frag, key=lambda f: f.free, default=None)
        return {
            "device": device, "events": r.events, "timed": r.timed,
            "window_s": (r.times[-1] if r.times else 0.0) if r.timed else None,
            "start": {"allocated": r.initial_allocated, "reserved": r.initial_reserved, "blocks": r.initial_blocks},
            "end": {"allocated": r.allocated[-1] if r.events else r.initial_allocated,
                    "reserved": r.reserved[-1] if r.events else r.initial_reserved},
            "peak_allocated": peak_a, "peak_allocated_at": self.time_of(at_a, device),
            "peak_reserved": peak_r, "peak_reserved_at": self.time_of(at_r, device),
            "oom": self.oom(device),
            "sites": rows,
            "fragmentation": {
                "over_time": [self._frag(f, device) for f in frag],
                "most_free": self._frag(worst, device),
                "at_oom": self._frag(r.ooms[0].fragmentation, device) if r.ooms else None,
                "at_end": self._frag(frag[-1] if frag else None, device),
            },
            "expandable_segments": r.expandable,
            "check": dict(r.check._asdict(), ok=r.check.ok),
        }

    def to_dict(self) -> dict:
        """Everything as JSON-serialisable data: the summary device's figures at the top, every device in ``devices``."""
        per_device = [self.device_dict(d) for d in sorted(self.replays)]
        main = next(d for d in per_device if d["device"] == self.device)
        out = {"source": self.source, "generation": self.generation, "device": self.device}
        out.update({k: main[k] for k in ("peak_allocated", "peak_allocated_at", "peak_reserved", "peak_reserved_at",
                                         "start", "end", "oom", "sites", "fragmentation", "events", "window_s")})
        out["annotations"] = [a._asdict() for a in self.annotations()]
        out["metadata"] = self.metadata()
        out["allocator_settings"] = self.settings
        out["devices"] = per_device
        return out

    # -- display (through the views handed in: this module computes, it never draws) ------------
    def view(self, start: Optional[float] = None, end: Optional[float] = None, device: Optional[int] = None,
             chart: bool = True, panel: bool = True):
        """The report as a ``View`` (text and HTML with the chart), zoomed to ``[start, end]`` seconds if given;
        ``chart=False`` leaves the chart out, ``panel=False`` the OOM panel."""
        if self._views is None:
            raise SnapshotError("this report was read without views: use ipy_gpumem.snapshot() to read it")
        return self._views.snapshot_view(self, start=start, end=end, device=device, chart=chart, panel=panel)

    def figure(self, start: Optional[float] = None, end: Optional[float] = None, device: Optional[int] = None) -> dict:
        """The chart as a plotly figure dict (``data``, ``layout``, ``config``): allocated and reserved
        over ``[start, end]``, the peak marked, the annotations as bands; x in seconds, or in events
        when the capture has no times. ``plotly.graph_objects.Figure(**fig)`` or ``plotly.io.show(fig)`` draws it."""
        if self._views is None:
            raise SnapshotError("this report was read without views: use ipy_gpumem.snapshot() to read it")
        return self._views.snapshot_figure(self, start=start, end=end, device=device)

    def oom_panel(self, device: Optional[int] = None):
        """The OOM panel of the recorded failure, as a live OOM would show it; None without one."""
        if self._views is None:
            raise SnapshotError("this report was read without views: use ipy_gpumem.snapshot() to read it")
        return self._views.oom_view(self, device)

    def __str__(self) -> str:
        return self.view().text if self._views is not None else repr(self)

    def __repr__(self) -> str:
        r = self.replay()
        return (f"<SnapshotReport {self.source}: cuda:{self.device} peak allocated {r.peak()[0]} bytes, "
                f"{r.events} events, {len(self.replays)} device(s)>")

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        if self._views is None:
            return {"text/plain": repr(self)}
        return self.view()._repr_mimebundle_(include, exclude)

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))


def _site_dict(site: Site) -> dict:
    return {"file": site.file, "line": site.line, "function": site.function, "name": site.label, "user": site.user}


def read_snapshot(source, *, cells: Optional[Mapping[str, int]] = None, max_bytes: int = MAX_BYTES,
                  views: Any = None) -> SnapshotReport:
    """Read ``source`` (a path, bytes, or the dict/list torch returns) and replay it.

    Raises:
        SnapshotError: it cannot be read (one line that says why).
    """
    data = load_snapshot(source, max_bytes=max_bytes)
    if isinstance(source, (str, os.PathLike)):
        name = os.path.basename(os.fspath(source))
    elif isinstance(source, list):
        name = "torch.cuda.memory_snapshot()"
    elif isinstance(source, dict):
        name = "torch.cuda.memory._snapshot()"
    else:
        name = "snapshot bytes"
    parsed = parse(data)
    del data  # a file's segment dicts go before the replay (the parsed segments keep what it needs)
    return SnapshotReport(parsed, name, cells, views)
