"""The names the end-of-cell census counts: the shell's namespace, and which of IPython's own names in it still hold what IPython put there.

Read at the end of every cell once torch is imported (``explain.py``), so it must not cost more the
longer the session runs. IPython's input history (``In``, ``_ih``, ``_i``, ``_ii``, ``_iii``,
``_iN``: strings) and ``_dh`` (directories) never hold a tensor, and there is one ``_iN`` per cell
run: they are left out of the question ``attribution.holders.ipython_refs`` answers. Nothing here
imports IPython: the shell is read through its attributes.
"""
from __future__ import annotations

import itertools
import re

__all__ = ["CellNames"]


class CellNames:
    """``() -> (namespace, refs)`` of one shell, for the census at the end of every cell.

    IPython's hidden names (``shell.user_ns_hidden``) are read once, then only those IPython added
    since (it appends them); a table that shrank, lost the last name read, or changed without
    growing is read again.
    """

    _TEXT = re.compile(r"_i+[0-9]*|_ih|In|_dh")

    def __init__(self, shell):
        self.shell = shell
        self._seen = (0, None)  # (how many hidden names, the last one) when last read
        self._keys: list = []

    def namespace(self) -> dict:
        """The shell's namespace alone (what a quiet cell's check needs; no question asked of IPython)."""
        return self.shell.user_ns

    def __call__(self):
        from ..attribution.holders import ipython_refs

        shell = self.shell
        hidden = getattr(shell, "user_ns_hidden", None) or {}
        count, last = len(hidden), next(reversed(hidden), None) if hidden else None
        seen, seen_last = self._seen
        if count < seen or (count == seen and last != seen_last) or (seen_last is not None and seen_last not in hidden):
            seen, self._keys = 0, []
        if count > seen:
            new = list(itertools.islice(reversed(hidden), count - seen))[::-1]
            self._keys.extend(k for k in new if type(k) is str and not self._TEXT.fullmatch(k))
        self._seen = (count, last)
        kept = {k: hidden[k] for k in self._keys if k in hidden}
        return shell.user_ns, ipython_refs(shell.user_ns, kept, getattr(shell, "displayhook", None))
