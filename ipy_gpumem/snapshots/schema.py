"""Every generation of torch's snapshot format, read into one shape: segments with their blocks, and each device's events.

Generations seen in real captures (``../shared/gpu-captures``):

- ``torch.cuda.memory_snapshot()``: a bare list of segments, no events;
- 2023 (torch 2.0/2.1): blocks carry ``history`` (their last allocation's frames) and no address;
- 2024: blocks carry ``address`` and ``frames``; events may lack ``time_us``;
- 2025: ``allocator_settings``, ``external_annotations``, events with ``compile_context``;
- 2026: events with ``user_metadata``.

Expandable segments (``is_expandable``) report each mapped range as a segment and grow and shrink
through ``segment_map``/``segment_unmap`` events. Each device's events become a
:class:`~.trace.Trace` (columns: a big snapshot is mostly events); one read from a file is one
already, without a dict per event ever made.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, NamedTuple, Sequence, Tuple

from .load import SnapshotError
from .trace import Trace

__all__ = ["Block", "Segment", "Parsed", "parse"]

#: Block states in ``segments[i]["blocks"]``; pending-free blocks still occupy their place.
ALLOCATED, PENDING, INACTIVE = "active_allocated", "active_pending_free", "inactive"


class Block(NamedTuple):
    """One block of a segment when the snapshot was taken."""

    addr: int
    size: int
    requested: int
    state: str
    frames: Sequence[Mapping[str, Any]] = ()  # shared with the file's other references to it


class Segment(NamedTuple):
    """One segment (for expandable segments: one mapped range) when the snapshot was taken."""

    device: int
    addr: int
    size: int
    small: bool
    expandable: bool
    blocks: Tuple[Block, ...]


class Parsed(NamedTuple):
    """A snapshot in one shape, whatever its generation."""

    segments: Tuple[Segment, ...]
    traces: Dict[int, Trace]
    settings: Mapping[str, Any]
    annotations: Tuple[Mapping[str, Any], ...]
    generation: str


def _frames(block: Mapping[str, Any]) -> Sequence[Any]:
    """A block's stack, the object itself (blocks share stacks: never copied)."""
    frames = block.get("frames")
    if frames is None:
        history = block.get("history")
        last = history[-1] if isinstance(history, list) and history else None
        frames = last.get("frames") if isinstance(last, Mapping) else None
    return frames if isinstance(frames, (list, tuple)) else ()


def _segment(raw: Any, index: int) -> Segment:
    if not isinstance(raw, Mapping):
        raise SnapshotError(f"not a memory snapshot: segment {index} is a {type(raw).__name__}, not a dict")
    try:
        addr, size = int(raw["address"]), int(raw["total_size"])
    except (KeyError, TypeError, ValueError):
        raise SnapshotError(f"not a memory snapshot: segment {index} has no address and total_size") from None
    blocks: List[Block] = []
    at = addr
    for raw_block in raw.get("blocks") or ():
        if type(raw_block) is not dict and not isinstance(raw_block, Mapping):  # typing.Mapping checks are slow
            continue
        bsize = int(raw_block.get("size", 0) or 0)
        # 2023 blocks have no address: they tile their segment in order.
        baddr = int(raw_block.get("address", at))
        blocks.append(Block(baddr, bsize, int(raw_block.get("requested_size", bsize) or 0),
                            str(raw_block.get("state", INACTIVE)), _frames(raw_block)))
        at = baddr + bsize
    small = raw.get("segment_type") == "small" if "segment_type" in raw else size <= (2 << 20)
    return Segment(int(raw.get("device", 0) or 0), addr, size, small, bool(raw.get("is_expandable", False)),
                   tuple(blocks))


def _generation(data: Any, segments: Sequence[Segment], traces: Mapping[int, Sequence]) -> str:
    if isinstance(data, list):
        return "segments only (torch.cuda.memory_snapshot())"
    events = [e for t in traces.values() for e in t[:50]]
    if any("user_metadata" in e for e in events):
        return "2026 (user_metadata)"
    if "allocator_settings" in data or "external_annotations" in data or any("compile_context" in e for e in events):
        return "2025 (allocator_settings)"
    raws = data.get("segments") or ()
    if raws and any("history" in b for b in (raws[0].get("blocks") or ()) if isinstance(b, Mapping)):
        return "2023 (history on blocks)"
    if events and not any("time_us" in e for e in events):
        return "2024 (no time_us)"
    return "2024"


def parse(data: Any) -> Parsed:
    """``data`` (a snapshot dict or a list of segments) in one shape.

    Raises:
        SnapshotError: ``data`` is not a snapshot.
    """
    if isinstance(data, list):
        raw_segments, raw_traces, settings, annotations = data, [], {}, ()
    elif isinstance(data, Mapping) and "segments" in data:
        raw_segments = data.get("segments") or []
        raw_traces = data.get("device_traces") or []
        settings = data.get("allocator_settings") or {}
        annotations = tuple(a for a in (data.get("external_annotations") or ()) if isinstance(a, Mapping))
    else:
        what = f"a dict with keys {sorted(map(str, data))[:6]}" if isinstance(data, Mapping) else type(data).__name__
        raise SnapshotError(f"not a memory snapshot: {what} (expected 'segments' and 'device_traces')")
    if not isinstance(raw_segments, list) or not isinstance(raw_traces, list):
        raise SnapshotError("not a memory snapshot: 'segments' and 'device_traces' must be lists")
    segments = tuple(_segment(raw, i) for i, raw in enumerate(raw_segments))
    traces: Dict[int, Trace] = {}
    for device, trace in enumerate(raw_traces):
        if not isinstance(trace, (list, Trace)):
            raise SnapshotError(f"not a memory snapshot: device_traces[{device}] is not a list")
        if trace:
            traces[device] = trace if isinstance(trace, Trace) else Trace.from_events(trace)
    return Parsed(segments, traces, settings if isinstance(settings, Mapping) else {}, annotations,
                  _generation(data, segments, traces))


def devices(parsed: Parsed) -> List[int]:
    """The devices that have segments or events, in order."""
    return sorted({s.device for s in parsed.segments} | set(parsed.traces))

