"""The regex building blocks every field parser shares: sizes, integers, and the window they are read from.

Every pattern is written with single spaces that compile to ``\\s?``: the input has its whitespace
runs collapsed, so this accepts normal text, hard-wrapped text (a newline instead of the space) and
text whose spaces a renderer dropped ("out of memorySearch for").
"""
from __future__ import annotations

import re
from typing import List, Optional

from ...core.units import parse_bytes

# The lookbehinds keep a match from starting inside a number ("16.83" must not be read as "6.83"
# or "83", not even when a terminal wrapped the line inside it) and make a digit run cost linear time.
# A size at the very end of truncated text has no unit yet, so it never matches: a cut number is
# dropped rather than misread. A bare unit must be an upper-case "B" (TensorFlow's "256B"); a
# lower-case "b" is what is left of a cut "bytes".
_SIZE = (
    r"(?<![0-9])(?<![0-9]\.)(?<![0-9]\n)(?<![0-9]\.\n)"
    r"(?P<n>[0-9]+(?:\.[0-9]*)?)\s?(?P<u>bytes|[KMGTPE]i?B|(?-i:B))"
)
_INT = r"(?P<i>[0-9]+)(?![0-9])"


def regex(template: str, flags: int = 0) -> re.Pattern[str]:
    # Case-insensitive because log aggregators and user code lowercase messages; parse_bytes reads
    # "mib" and "MiB" alike.
    pattern = template.replace("{SIZE}", _SIZE).replace("{INT}", _INT).replace(" ", r"\s?")
    return re.compile(pattern, re.ASCII | re.IGNORECASE | flags)


def bytes_of(match: re.Match[str]) -> Optional[int]:
    number = match.group("n").replace(",", "")
    unit = match.group("u") or ""
    try:
        return parse_bytes(f"{number} {unit}")
    except (ValueError, ArithmeticError):  # decimal.InvalidOperation is an ArithmeticError
        return None


class MessageWindow:
    """The text from the message start to where the message can end, and what was found in it."""

    def __init__(self, text: str):
        self.text = text
        self.ends: List[int] = []
        self.tail_end: Optional[int] = None
        self._joined: Optional[str] = None

    @property
    def joined(self) -> str:
        # Terminal copies wrap at a fixed column, even inside words and numbers.
        if self._joined is None:
            self._joined = self.text.replace("\n", "")
        return self._joined

    def search(self, rx: re.Pattern[str]) -> Optional[re.Match[str]]:
        """First match; its end counts towards the message's extent. Falls back to the unwrapped text."""
        m = rx.search(self.text)
        if m is not None:
            self.ends.append(m.end())
            return m
        if "\n" in self.text:
            return rx.search(self.joined)
        return None

    def peek(self, rx: re.Pattern[str]) -> bool:
        """Whether ``rx`` occurs, without letting it stretch the message."""
        return rx.search(self.text) is not None

    def size(self, *rxs: re.Pattern[str]) -> Optional[int]:
        for rx in rxs:
            m = self.search(rx)
            if m is not None:
                value = bytes_of(m)
                if value is not None:
                    return value
        return None

    def integer(self, *rxs: re.Pattern[str]) -> Optional[int]:
        for rx in rxs:
            m = self.search(rx)
            if m is not None:
                return int(m.group("i"))
        return None

    def tails(self, *rxs: re.Pattern[str]) -> None:
        """Known last sentences: when one is present the message ends exactly there."""
        for rx in rxs:
            m = rx.search(self.text)
            if m is not None and (self.tail_end is None or m.end() > self.tail_end):
                self.tail_end = m.end()
