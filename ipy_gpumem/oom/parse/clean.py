"""Text clean-up: undo what renderers, terminals and issue trackers did to a copied message.

Line by line, the result is the same as cleaning each line on its own (the old per-line loop), but
every step runs over the whole text at once: a loop over lines cost half a microsecond per line, and
one callback per HTML entity cost 0.3 us per entity.
"""
from __future__ import annotations

import html
import re

_ANSI = re.compile(r"\x1b\[[0-?]{0,32}[ -/]{0,8}[@-~]|\x1b\][^\x07\x1b\n]{0,512}(?:\x07|\x1b\\)?|\x1b")
# Copies from rendered notebooks often lose the ESC byte but keep "[0;31m".
_BARE_SGR = re.compile(r"\[(?:[0-9]{1,3};){0,6}[0-9]{1,3}m")
# Tags never contain "<", ">" or a newline, so removing line-breaking tags first and the others second
# gives what one pass with a callback gave.
_TAG_BREAKS = re.compile(r"</?(?:br|p|div)\b[^<>\n]{0,200}>", re.IGNORECASE)
_TAG_OTHERS = re.compile(r"</?(?:pre|code|span|b|i|em|strong|tt|kbd|samp)\b[^<>\n]{0,200}>", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f\u200b-\u200d\u2060\ufeff]")
_SPACES = re.compile(r"[ \t\x0b\x0c\xa0\u1680\u2000-\u200a\u202f\u205f\u3000]+")
_WIDE_SPACES = re.compile(r"[\xa0\u1680\u2000-\u200a\u202f\u205f\u3000]")
# What str.strip() still finds at a line's ends once _SPACES and _CONTROL have run.
_EDGE_SPACES = re.compile(r"^[ \x85\u2028\u2029]+|[ \x85\u2028\u2029]+$", re.MULTILINE)
_QUOTE_MARKERS = re.compile(r"^(?:>(?!>) ?)+")  # markdown quotes, but not ">>>" prompts or ">>"
_LINE_QUOTE_MARKERS = re.compile(r"\n(?:>(?!>) ?)+")


def _unescape(text: str) -> str:
    """``html.unescape(text)``, without a Python call per entity when the same few repeat."""
    count = text.count("&")
    if count <= 256:
        return html.unescape(text)
    # An entity starts at an "&" and never contains another, so each piece between two "&" unescapes
    # on its own; a text with thousands of entities holds few distinct pieces.
    pieces = text.split("&")
    first = pieces.pop(0)
    distinct = set(pieces)
    if 3 * len(distinct) > count:
        return html.unescape(text)
    done = {piece: html.unescape("&" + piece) for piece in distinct}
    return first + "".join(map(done.__getitem__, pieces))


def _strip_lines(text: str) -> str:
    """``"\\n".join(line.strip() for line in text.split("\\n"))`` once _SPACES has collapsed every run."""
    if "\x85" in text or "\u2028" in text or "\u2029" in text:
        return _EDGE_SPACES.sub("", text)
    if " " not in text:
        return text
    # A space run is a single space by now, so at most one sits on each side of a newline.
    return text.replace(" \n", "\n").replace("\n ", "\n").strip(" ")


def normalise(text: str) -> str:
    """Undo what renderers and terminals did; keep line breaks, collapse every other whitespace run."""
    if "&" in text:
        for _ in range(2):  # twice: issue trackers sometimes escape "&gt;" again as "&amp;gt;"
            unescaped = _unescape(text)
            if unescaped == text:
                break
            text = unescaped
    if "<" in text:
        text = _TAG_OTHERS.sub("", _TAG_BREAKS.sub("\n", text))
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    if "m" in text:
        text = _BARE_SGR.sub("", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL.sub("", text)
    # Most text has single spaces only; a substitution that replaces each of them with itself costs
    # 30 ms per MiB for nothing.
    if "  " in text or "\t" in text or "\x0b" in text or "\x0c" in text or (
        not text.isascii() and _WIDE_SPACES.search(text) is not None
    ):
        text = _SPACES.sub(" ", text)
    text = _strip_lines(text)
    if ">" in text:
        start = _QUOTE_MARKERS.match(text)
        if start is not None:
            text = text[start.end():]
        text = _strip_lines(_LINE_QUOTE_MARKERS.sub("\n", text))
    return text


def lower_same_length(text: str) -> str:
    """A lower-cased copy of the same length, for the finders and screens.

    The anchors fold case for ASCII letters only. Two other characters need care: the Kelvin sign
    lower-cases to an ASCII "k" (and would then fail a finder's "no letter before" check that its
    anchor passes), and "İ" lower-cases to two characters; both stand in as NUL, which no anchor
    treats as a letter either.
    """
    if text.isascii():
        return text.lower()
    if "\u212a" in text or "\u0130" in text:
        text = text.replace("\u212a", "\x00").replace("\u0130", "\x00")
    return text.lower()
