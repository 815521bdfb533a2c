"""Finding and reading the message: the best anchor in cleaned text, where its message ends, its exception type.

The richest family wins, and within it the last message (the one finally raised). A message ends at
a blank line, a traceback line, a new log record or the next message, or at a sentence its family is
known to end with; the text around a candidate in long text is cleaned up as a :class:`Region`,
cut just after newlines so that it reads as it would within the whole text.
"""
from __future__ import annotations

import re
from collections import deque
from typing import Deque, Optional, Tuple

from .clean import lower_same_length, normalise
from .detectors import DETECTORS, Detector
from .numbers import MessageWindow
from .report import OomReport

_WINDOW_CAP = 8000  # longest plausible message: a v5 message listing dozens of processes
_EXTEND_CAP = 400  # how far a message without a known ending may run on to the end of its line
_CONTEXT_BEFORE = 2048  # cleaned up before a candidate: the lead, the exception type on the line above
_CONTEXT_AFTER = 9 * 1024  # and after it: _WINDOW_CAP and the line that stops the message
_LINE_SLACK = 2048  # how far to look for a newline to cut at

# The remedies a message itself names (OomReport.hints), in the order they appear in it.
_HINTS = tuple(
    (name, re.compile(re.escape(name)))
    for name in ("expandable_segments", "max_split_size_mb", "PYTORCH_MPS_HIGH_WATERMARK_RATIO", "empty_cache",
                 "report_tensor_allocations_upon_oom")
)
_STOP_LINE = re.compile(
    r"(?:Traceback \(most recent call last\)|During handling of the above exception"
    r"|The above exception was the direct cause|File \"|In \[[0-9 ]*\]:"
    r"|\[?[0-9]{4}-[0-9]{2}-[0-9]{2}[ T][0-9]{2}:[0-9]{2}|\[?[0-9]{2}:[0-9]{2}:[0-9]{2}"
    r"|(?:INFO|WARNING|WARN|ERROR|DEBUG|CRITICAL|FATAL)\b"
    r"|(?:[A-Za-z_][A-Za-z0-9_]*\.)*[A-Za-z_][A-Za-z0-9_]*(?:Error|Exception|Warning) ?:)",
    re.ASCII,
)
_EXTEND_STOP = re.compile(r"Traceback \(most recent call last\)|During handling of the above| File \"")
_EXCEPTION_BEFORE = re.compile(
    r"(?<![\w.])((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception))"
    r"(?:(?: ?\(see above for traceback\))? ?: ?|\([\"'])$",  # "Type: msg" or repr's "Type('msg')"
    re.ASCII,
)
_EXCEPTION_LINE = re.compile(r"((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)) ?:", re.ASCII)
_WHITESPACE = re.compile(r"\s+")


def _message_start(m: re.Match[str]) -> int:
    return m.start("msg") if m.group("msg") is not None else m.end()


def _verify(det: Detector, lined: str, hit: re.Match[str]) -> Optional[re.Match[str]]:
    """The anchor's match for one finder match, or None where the finder matched more than the anchor."""
    if not det.back:
        return det.anchor.match(lined, hit.start())
    end = lined.find("\n", hit.end())
    found = None
    for m in det.anchor.finditer(lined, max(0, hit.start() - det.back), len(lined) if end < 0 else end):
        if m.start() > hit.start():
            break
        found = m
    return found


def _last_match(det: Detector, lined: str, low: str, lo: int, hi: int) -> Optional[re.Match[str]]:
    """The anchor's last match starting in [lo, hi): the one ``finditer`` would list last."""
    recent: Deque[re.Match[str]] = deque(maxlen=8)
    for hit in det.finder.finditer(low, lo):
        if hit.start() >= hi:
            break
        recent.append(hit)
    seen_all = len(recent) < 8
    while recent:
        m = _verify(det, lined, recent.pop())
        if m is not None and lo <= m.start() < hi:
            return m
    if seen_all:
        return None
    # Eight finder matches in a row that the anchor rejects: settle it with the anchor itself.
    last = None
    for m in det.anchor.finditer(lined, lo):
        if m.start() >= hi:
            break
        last = m
    return last


def _best_anchor(lined: str, low: str, lo: int, hi: int) -> Optional[Tuple[Detector, re.Match[str]]]:
    """The richest message family starting in [lo, hi); within it, the last occurrence (the one finally
    raised)."""
    best: Optional[Tuple[Tuple[int, int, int], Detector, re.Match[str]]] = None
    for order, det in enumerate(DETECTORS):
        if best is not None and det.rank > best[0][0]:
            break  # detectors are sorted by rank
        last = _last_match(det, lined, low, lo, hi)
        if last is None:
            continue
        key = (det.rank, -_message_start(last), order)
        if best is None or key < best[0]:
            best = (key, det, last)
    return None if best is None else (best[1], best[2])


def _window_end(lined: str, low: str, det: Detector, start: int, anchor_end: int) -> int:
    """Where the message can end at the latest: a blank line, a traceback line, a new log record or
    the next message."""
    limit = min(len(lined), start + _WINDOW_CAP)
    for other in DETECTORS:
        # The finder only rules detectors out cheaply; the cut itself comes from the anchor.
        if other.cuts and other.finder.search(low, anchor_end, limit) is not None:
            nxt = other.anchor.search(lined, anchor_end, limit)
            if nxt is not None:
                limit = min(limit, nxt.start())
    pos = lined.find("\n", anchor_end, limit)
    while pos != -1:
        nxt_nl = lined.find("\n", pos + 1, limit)
        line = lined[pos + 1: nxt_nl if nxt_nl != -1 else limit]
        if not line:
            resumed = _resume_after_blank(lined, det, pos, limit)
            if resumed is None:
                return pos
            nxt_nl = resumed
        elif _STOP_LINE.match(line[:200]):
            return pos
        pos = nxt_nl
    return limit


def _resume_after_blank(lined: str, det: Detector, pos: int, limit: int) -> Optional[int]:
    """The newline before the next text line when that line continues ``det``'s message, else None."""
    if det.resumes is None:
        return None
    blank = pos + 1
    for _ in range(3):  # at most two blank lines in a row
        if blank >= limit or lined[blank] != "\n":
            break
        blank += 1
    else:
        return None
    if blank >= limit or not det.resumes.match(lined, blank, min(limit, blank + 200)):
        return None
    return blank - 1


def _exception_type(lined: str, line_start: int, start: int) -> Optional[str]:
    before = lined[max(line_start, start - 200): start]
    m = _EXCEPTION_BEFORE.search(before)
    if m is not None:
        return m.group(1)
    if before.strip() or line_start == 0:
        return None
    # The message may start on the line after its type: "RuntimeError: TensorStorage ...\ncuda failed".
    prev_start = lined.rfind("\n", 0, line_start - 1) + 1
    m = _EXCEPTION_LINE.match(lined[prev_start: min(line_start, prev_start + 200)])
    return m.group(1) if m is not None else None


def _build(det: Detector, m: re.Match[str], lined: str, low: str) -> OomReport:
    start = _message_start(m)
    line_start = lined.rfind("\n", 0, start) + 1
    prefix = lined[max(line_start, start - 400): start]
    if det.lead is not None:
        lead = det.lead.search(prefix)
        if lead is not None:
            start -= len(prefix) - lead.start()
            prefix = prefix[: lead.start()]
    anchor_end = max(m.end(), start)
    window = MessageWindow(lined[start: _window_end(lined, low, det, start, anchor_end)])
    found = det.parse(window, m, prefix)

    end = max([anchor_end - start] + window.ends)
    window.tails(*found.pop("tails", ()))
    if window.tail_end is not None:
        end = max(end, window.tail_end)
    else:  # unknown ending: the rest of the line still belongs to the message
        eol = window.text.find("\n", end)
        eol = min(len(window.text) if eol == -1 else eol, end + _EXTEND_CAP)
        stop = _EXTEND_STOP.search(window.text, end, eol)
        end = stop.start() if stop is not None else eol
    message = _WHITESPACE.sub(" ", window.text[:end]).strip()
    opener = lined[start - 1] if start > 0 else ""
    if opener and opener in "\"'`":  # quoted, or a repr such as RuntimeError('...')
        for closing in (opener + ")", opener):
            if message.endswith(closing):
                message = message[: -len(closing)].rstrip()
                break

    exception_type = m.group("etype") if "etype" in m.re.groupindex else None
    if exception_type is None:
        exception_type = _exception_type(lined, line_start, start)
    if not message and exception_type:  # "MemoryError", "MemoryError: ", "MemoryError()": the name is all
        message = exception_type

    hint_positions = sorted((pos, name) for name, rx in _HINTS for pos in [_first(rx, message)] if pos >= 0)
    found.setdefault("kind", det.kind)
    found.setdefault("device_type", det.device_type)
    found.setdefault("confidence", det.confidence)
    return OomReport(
        message=message,
        exception_type=exception_type,
        hints=tuple(name for _, name in hint_positions),
        **found,
    )


def _first(rx: re.Pattern[str], text: str) -> int:
    m = rx.search(text)
    return -1 if m is None else m.start()


class Region:
    """Part of the raw text, cleaned up with some context around it, and the best message in it.

    The cuts fall just after a newline wherever one is near, so cleaning the parts one by one gives
    the same text as cleaning them together; ``lo:hi`` is where the part itself lies in ``lined``.
    """

    def __init__(self, raw: str, core_lo: int, core_hi: int):
        self.core_lo = core_lo
        ctx_lo = line_start_near(raw, core_lo - _CONTEXT_BEFORE)
        ctx_hi = line_end_near(raw, core_hi + _CONTEXT_AFTER)
        before = normalise(raw[ctx_lo:core_lo])
        core = normalise(raw[core_lo:core_hi])
        self.lined = before + core + normalise(raw[core_hi:ctx_hi])
        self.lo, self.hi = len(before), len(before) + len(core)
        self.low = lower_same_length(self.lined)
        self.found = _best_anchor(self.lined, self.low, self.lo, self.hi)

    def key(self) -> Tuple[int, int, int]:
        """Smaller is better: the richer family, then the later message in the whole text."""
        assert self.found is not None
        det, m = self.found
        return (det.rank, -self.core_lo, -_message_start(m))

    def report(self) -> OomReport:
        assert self.found is not None
        return _build(self.found[0], self.found[1], self.lined, self.low)

    def joined(self) -> Optional[OomReport]:
        """A terminal copy can wrap inside the anchor words themselves ("CUDA out of mem\\nory")."""
        if "\n" not in self.lined:
            return None
        lined = self.lined.replace("\n", "")
        low = lower_same_length(lined)
        found = _best_anchor(lined, low, 0, len(lined))
        return None if found is None else _build(found[0], found[1], lined, low)


def line_start_near(raw: str, pos: int) -> int:
    """The start of the line holding ``pos``, or ``pos`` itself when that line is very long."""
    if pos <= 0:
        return 0
    nl = raw.rfind("\n", max(0, pos - _LINE_SLACK), pos)
    return nl + 1 if nl >= 0 else (0 if pos <= _LINE_SLACK else pos)


def line_end_near(raw: str, pos: int) -> int:
    """Just past the end of the line holding ``pos``, or ``pos`` itself when that line is very long."""
    if pos >= len(raw):
        return len(raw)
    nl = raw.find("\n", pos, pos + _LINE_SLACK)
    return nl + 1 if nl >= 0 else min(len(raw), pos)
