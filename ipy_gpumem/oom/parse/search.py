"""``parse_oom``: how much of a text is read closely and where, so that any input up to 1 MiB takes at most 20 ms.

benchmarks/bench_parse.py measures it. The old parser took 55-115 ms on most megabyte inputs, though
it read only their first and last 64 KiB: it cleaned that text up (one Python call per line and per
HTML entity), then ran about 45 case-insensitive regexes over it, twice when nothing matched. A
case-insensitive pattern, or one that starts with a lookbehind or ``^``, gives the regex engine no
literal to skip to, so it tries every position, about 15 ns each. Now:

- Every detector has a finder: its pattern with the literals lower-cased, compiled without IGNORECASE,
  run on a lower-cased copy of the text, and starting with a literal (written by hand where the anchor
  does not), so the engine skips to candidates at the speed of a substring search. The anchor itself
  only checks what a finder found.
- Text is cleaned up as a whole (each step over all of it at once, never line by line) only when it
  is short: up to 32 KiB, or up to 128 KiB when it holds little markup; within those sizes it is
  searched as before, step for step. In longer text only the last 16 KiB is read that way; elsewhere
  screens (literals found with ``str.rfind`` from the end) point at candidates, and a window around
  each is cleaned up and read. Screens see the raw text with its newlines as spaces, so they find a
  message wherever its words are separated by single spaces or hard wraps, which is how messages are
  printed; a message split inside a word, wrapped behind quote markers, or with markup inside it is
  found in long text only in its last 16 KiB.
"""
from __future__ import annotations

from typing import Any, Optional

from .read import line_end_near, line_start_near, Region
from .report import OomReport
from .screens import ScreenSearch

_READ_CAP = 1 << 20  # text read at most: the first 64 KiB and the rest from the end
_HEAD_CAP = 64 * 1024
_EXACT_ALL = 32 * 1024  # text up to this size is cleaned up and searched as a whole
_EXACT_PLAIN = 128 * 1024  # and up to this size when it holds little markup (_MARKUP_CAP at most)
_MARKUP_CAP = 8192  # substitutions at about 0.3 us each: a few ms of clean-up at most
_TAIL = 16 * 1024  # longer text: its end is read in full, where a traceback's last message sits
_WINDOWS = 6  # candidates read in full per text, beyond its end; each costs at most about 1.5 ms
_RANKS = 4
_SCREEN_BACK = 160  # a screen may match this far into its message


def _coerce(text: Any) -> Optional[str]:
    """The text to read, its middle dropped beyond 1 MiB; None for anything that is not text."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        data = bytes(text)
        if len(data) > _READ_CAP:
            data = data[:_HEAD_CAP] + b"\n\n" + data[-(_READ_CAP - _HEAD_CAP - 2):]
        return data.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        return None
    if len(text) > _READ_CAP:
        # The blank line keeps a message cut in half from being glued to unrelated text.
        text = text[:_HEAD_CAP] + "\n\n" + text[-(_READ_CAP - _HEAD_CAP - 2):]
    return str.__str__(text)  # a plain copy: a str subclass's own __str__ is not ours to call


def _parse_long(raw: str) -> Optional[OomReport]:
    """Long text: the last 16 KiB in full, then the screens' candidates from the end, richest family
    first, until one is a message of the family searched for or _WINDOWS candidates have been read."""
    tail_lo = line_start_near(raw, len(raw) - _TAIL)
    tail = Region(raw, tail_lo, len(raw))
    best = tail if tail.found is not None else None
    screen = ScreenSearch(raw, tail_lo)
    windows = _WINDOWS
    for rank in range(best.found[0].rank if best is not None else _RANKS):
        hi = tail_lo
        while windows > 0:
            hit = screen.last(rank, hi)
            if hit is None:
                break
            windows -= 1
            # From the line before the candidate (a hard-wrapped anchor starts up there) to the end of
            # its own line; the region adds the context the message and its type need.
            core_lo = line_start_near(raw, max(0, hit[0] - _SCREEN_BACK))
            window = Region(raw, core_lo, min(hi, line_end_near(raw, hit[1])))
            if window.found is not None and (best is None or window.key() < best.key()):
                best = window
            if best is not None and best.found[0].rank <= rank:
                break
            hi = core_lo
        if best is not None and best.found[0].rank <= rank:
            break
    if best is not None:
        return best.report()
    return tail.joined()


def _markup(text: str) -> int:
    """About how many substitutions cleaning ``text`` up takes: the cost that grows with markup."""
    return (text.count("&") + text.count("<") + text.count("\x1b") + text.count("[") + text.count("\t")
            + text.count("  ") + text.count("\n>"))


def _parse(text: Any) -> Optional[OomReport]:
    raw = _coerce(text)
    if not raw:
        return None
    # Text up to 128 KiB is read as a whole, as the old parser read it, unless cleaning it up would
    # take a substitution per character or two (a flood of entities, tags or colour codes).
    if len(raw) > _EXACT_PLAIN or (len(raw) > _EXACT_ALL and _markup(raw) > _MARKUP_CAP):
        return _parse_long(raw)
    region = Region(raw, 0, len(raw))
    if region.found is not None:
        return region.report()
    return region.joined()


def parse_oom(text: Any) -> Optional[OomReport]:
    """Find an out-of-memory message anywhere in ``text`` and read what it says.

    ``text`` may be a bare message, a whole traceback or log, with log prefixes, ANSI colours, HTML
    escapes, markdown quotes, hard wraps, collapsed whitespace or a truncated end. Up to 1 MiB is read
    (beyond that, the first 64 KiB and the rest from the end); see the module docstring for which
    copies are found in the middle of long text. When several messages are present the richest family
    wins (an allocator report over a bare ``CUDA error: out of memory``, any message that says it ran
    out of memory over one that only usually means it), and within it the last one.

    Python's ``MemoryError`` counts as a host (``"cpu"``) out-of-memory error: numpy's ``Unable to
    allocate 7.45 GiB for an array with shape ...`` gives ``requested``, and a bare ``MemoryError``
    line (the exception line of a traceback, with or without a message, or ``MemoryError()``) gives a
    report without numbers. The words "MemoryError" inside prose or source lines are ignored, and
    errors that merely mention memory (``an illegal memory access was encountered``) are not
    out-of-memory errors. ``DataLoader worker (pid N) is killed by signal: Killed.``, cuDNN's ``Unable
    to find a valid cuDNN algorithm to run convolution`` and ``CUBLAS_STATUS_NOT_INITIALIZED`` are
    reported with ``confidence`` ``"likely"`` or ``"possible"``.

    Args:
        text: Error text as ``str``, or ``bytes`` (decoded as UTF-8 with replacement).

    Returns:
        An :class:`OomReport`, or None when ``text`` is not text or holds no out-of-memory message.
        Never raises.

    Examples:
        >>> r = parse_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. "
        ...               "GPU 0 has a total capacity of 4.00 GiB of which 0 bytes is free.")
        >>> r.kind, r.requested, r.total, r.free, r.device, r.exception_type
        ('cuda_allocator', 20971520, 4294967296, 0, 'cuda:0', 'torch.OutOfMemoryError')
        >>> parse_oom("RuntimeError: CUDA error: an illegal memory access was encountered") is None
        True
        >>> parse_oom("RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed.").confidence
        'likely'
    """
    try:
        return _parse(text)
    except Exception:  # a bug here must never turn the user's one error into two
        return None
