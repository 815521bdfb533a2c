"""The processes a cell launched, in its line and its report: one row per rank, the worst one named.

Parts (``display.parts``) made from a record's ``ranks`` (``core.records.RankRecord``), rendered to
text and HTML with the rest of the view; the sentences (what could not be seen, how a rank ended)
are made here from the records' fields (``display.words.rank_note``): a rank's record holds none.
"""
from __future__ import annotations

from typing import List

from ..core.records import CellRecord, RankRecord, worst_rank
from ..core.units import format_bytes, format_delta
from ..display.parts import Line, Para, Span
from ..display.tables import bytes_table
from ..display.words import rank_note
from ..display.view import delta_class

__all__ = ["rank_line_parts", "rank_report_parts"]


def _spans(rank: RankRecord) -> List[Span]:
    spans: List[Span] = []
    for dev in rank.devices or ():
        if dev.allocated_after is None and dev.used_after is not None:  # NVML's per-process use, from outside
            spans.append(Span(f"{dev.label} {format_bytes(dev.used_after)} used (NVML)"))
        else:
            spans.append(Span(f"{dev.label} "))
            spans.append(Span(f"{format_delta(dev.allocated_delta)} allocated", delta_class(dev.allocated_delta)))
            if dev.peak_increase is not None:
                spans.append(Span(f" (peak {format_delta(dev.peak_increase)})", "up"))
        spans.append(Span(" │ ", "dim"))
    host = rank.host
    if host.rss_after is None and host.peak_rss is None:
        spans.append(Span("host not read", "dim"))  # it ended before its first reading (its note says so)
        return spans
    spans.append(Span("host "))
    spans.append(Span(f"{format_delta(host.rss_delta)} RSS", delta_class(host.rss_delta)))
    if host.rss_peak_increase is not None:
        spans.append(Span(f" (peak {format_delta(host.rss_peak_increase)})", "up"))
    if host.rss_after is not None:
        spans.append(Span(f" · {format_bytes(host.rss_after)} resident"))
    return spans


def _end_word(rank: RankRecord) -> str:
    if rank.end == "running":
        return "still running"
    if rank.end == "gone":
        if rank.signal or rank.exit_code is not None:
            return f"killed by {rank.signal}" if rank.signal else f"exit code {rank.exit_code}"
        return "ended unrecorded" if rank.seen == "inside" else ""  # a process read from outside never records its end
    return ""


def _title(record: CellRecord) -> Line:
    ranks = record.ranks
    worst = worst_rank(ranks)
    text = f"  {len(ranks)} process{'es' if len(ranks) != 1 else ''} launched"
    spans = [Span(text, "dim")]
    if worst is not None and len(ranks) > 1:
        spans.append(Span(f" · worst: {worst.label} (peak {format_delta(worst.rise)})", "up"))
    return Line(*spans)


def rank_line_parts(record: CellRecord) -> list:
    """Under the per-cell line: one row per launched process, the worst named, and what was not seen."""
    if not record.ranks:
        return []
    worst = worst_rank(record.ranks) if len(record.ranks) > 1 else None
    parts = [_title(record)]
    for rank in record.ranks:
        head = [Span(f"    {rank.label:<7} ", "bold" if rank is worst else ""), Span(f"pid {rank.pid} ", "dim")]
        tail = []
        end = _end_word(rank)
        if end:
            tail.append(Span(f" · {end}", "err" if rank.end == "gone" else "dim"))
        if rank is worst:
            tail.append(Span(" ← worst", "up"))
        parts.append(Line(*head, *_spans(rank), *tail))
    parts.extend(_notes(record.ranks))
    return parts


def _notes(ranks) -> list:
    """Each distinct note once, naming the ranks it is about."""
    notes: dict = {}
    for rank in ranks:
        note = rank_note(rank)
        if note:
            notes.setdefault(note, []).append(rank.label)
    return [Para(f"{', '.join(labels)}: {note}.", "dim", indent="    ", hanging="      ")
            for note, labels in notes.items()]


def rank_report_parts(record: CellRecord) -> list:
    """The ``%%gpumem`` report's rows for the launched processes: before / after / peak per rank."""
    if not record.ranks:
        return []
    rows = []
    for rank in record.ranks:
        for dev in rank.devices or ():
            if dev.allocated_after is not None:
                rows.append((f"{rank.label} {dev.label} allocated", (dev.allocated_before, dev.allocated_after,
                                                                    dev.allocated_delta, dev.peak_allocated,
                                                                    dev.peak_increase)))
            elif dev.used_after is not None:
                rows.append((f"{rank.label} {dev.label} used (NVML)", (dev.used_before, dev.used_after,
                                                                      dev.used_delta, None, None)))
        host = rank.host
        rows.append((f"{rank.label} host RSS", (host.rss_before, host.rss_after, host.rss_delta, host.peak_rss,
                                                host.rss_peak_increase)))
    return [_title(record), bytes_table(["", "start", "end", "Δ", "peak", "peak Δ"], rows,
                                        signed=(False, False, True, False, True))] + _notes(record.ranks)
