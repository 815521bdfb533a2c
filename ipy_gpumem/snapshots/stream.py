"""A streaming pickle reader for snapshots: plain data only, bounded by the file, with each device's events stored as columns instead of dicts.

``pickle.load`` of a snapshot builds a dict per event: about 7x the file's size in memory, and it
trusts the file (a 9-byte file can ask for a 2 GiB memo; memo references can make a 16 KB file
stand for millions of objects). This reader runs the pickle machine itself (protocols 0 to 5)
over a buffer refilled from the file, so the file is never held whole, and bounds everything by
the bytes read so far:

- memo references are shared, never copied, and what they stand for once expanded is counted
  (:data:`EXPAND_PER_BYTE` items per byte); a container is frozen once referenced again, so
  nothing is cyclic, and no container is ever hashed (dict keys and set items are scalars);
- the memo holds what was stored, no more (an index past it, or written twice, is refused);
- MARK is an index, never a copy of the stack, and the stack holds what a pickler writes (:data:`MAX_STACK`);
- what the general opcode loop builds is costed (:data:`COST_PER_BYTE`), and the whole read has a
  time budget (:data:`SECONDS_PER_BYTE`);
- any class reference, reduce or persistent id is refused the moment it is seen: nothing is
  imported and nothing runs.

Events (``device_traces``) go a faster way: the common event shape is matched by one regex per
shape over 64 KiB at a time (``findall``, in C), and its columns are converted in bulk (the
numbers by the C unpickler over a pickle made only of the number tokens the regex checked). The
memo keeps 4 bytes per slot an event makes (the event itself, torch's fresh "N/A" strings, its
frames list), not the objects. Anything else goes through the general opcode loop, slower and
just as exact.
"""
from __future__ import annotations

import bisect
import codecs
import pickle
import re
import struct
import sys
import time
from array import array
from itertools import chain, compress, repeat
from operator import is_, itemgetter
from typing import Any, Dict, List, Optional

from .trace import Trace


__all__ = ["read_stream", "Fallback", "CHUNK", "MARGIN", "SnapshotError", "COST_PER_BYTE", "EXPAND_PER_BYTE",
           "SECONDS_PER_BYTE"]


class SnapshotError(ValueError):
    """A snapshot that cannot be read; the message is one line and says why."""


#: Bytes read from the file at a time.
CHUNK = 1 << 20
#: Bytes kept ahead of the machine; events are matched this many bytes at a time.
MARGIN = 1 << 16
#: What the general opcode loop builds, in bytes of Python objects per byte of pickle read (plus
#: :data:`COST_FLOOR`). Torch's snapshots cost 3-10x (dicts of a few keys, short strings).
COST_PER_BYTE, COST_FLOOR = 32, 32 << 20
#: Items that memo references stand for once expanded, per byte read (plus :data:`EXPAND_FLOOR`).
#: Torch shares stack frames and their lists: 0.1-1.5 per byte in real captures.
EXPAND_PER_BYTE, EXPAND_FLOOR = 32, 1 << 20
#: The time budget, in seconds of this process's CPU: ten, plus this per byte of pickle. Real files
#: read at 1-50 MB/s (the slowest: segments without events); the budget is a last resort against a
#: file slow in a way the other bounds do not see, never met by one they bound.
SECONDS_PER_BYTE, SECONDS_FLOOR = 20e-6, 10.0
#: Items the pickle stack may hold (marks included): a pickler writes at most 2,000 between two
#: marks (items of a dict are set 1,000 at a time), and nests a few deep.
MAX_STACK = 1 << 16
#: The longest integer argument read (torch's fit 8 bytes; Python cannot print an int over ~1,800).
MAX_INT_BYTES = 255
#: Dicts in lists (blocks, frames) read the general way before the fast way is tried: making its regex for a shape
#: of dict (about 6 ms) costs what the general way spends on a few hundred dicts.
DICTS_AFTER = 256
#: The longest text line of protocol 0 (numbers, memo indices, strings).
MAX_LINE = 1 << 16

_FLOAT = struct.Struct(">d")
_SCALARS = (str, int, float, bool, type(None), bytes)
_CONTAINERS = (dict, list, tuple, set, frozenset)
_CONTAINER_TYPES = frozenset(_CONTAINERS)
_SKIP = 0x7FFFFFFF  # a column's "no memo slot here" in the bulk event path
_EVENT = -1  # the memo kind of an event (it lives in the trace's columns)
_WINDOW = -(1 << 31)  # the memo kind of a slot made by a run of events of one layout (see _Window)


class Fallback(Exception):
    """The file refers to an event dict from another place (torch never does): read it again keeping events whole."""


class _Traces(list):
    """The ``device_traces`` list: its items are built as :class:`Trace`."""


def read_stream(read, name: str, limit: int, *, size: Optional[int] = None, keep_events: bool = False) -> Any:
    """The object a protocol 0-5 pickle read through ``read(n)`` holds, its event lists as :class:`Trace`.

    ``size`` is the pickle's length when known (a plain file): an argument longer than what is
    left is then refused at once. ``keep_events`` keeps each event's dict in the memo (for a file
    that refers to one again: :class:`Fallback` asks for it).

    Raises:
        SnapshotError: a class reference, a truncated or broken pickle, more than ``limit`` bytes,
            or a file that would cost more than its bounds (time, memory, expansion).
        Fallback: the file refers to an event from another place.
    """
    return _Machine(read, name, limit, size, keep_events).run()


# -- the tokens of the common event shape (checked by regex, then converted in bulk) ---------------
_REF = rb"h.|j...."
_INT = rb"K.|M..|J....|\x8a(?:" + b"|".join(bytes([n]) + b"." * n for n in (5, 6, 7, 8, 4, 3, 2, 1, 0)) + rb")"
# A string's bytes: n dots for short ones (a dot is matched faster than a repeat), a repeat for longer ones (a
# pattern of 64 alternatives of up to 63 dots each takes milliseconds to compile, once per template).
_STR = rb"\x8c(?:" + b"|".join(re.escape(bytes([n])) + (b"." * n if n < 8 else b".{%d}" % n) for n in range(64)) + rb")\x94"
_RUN = rb"\]\x94(?:\((?:h.|j....)+e)*(?:(?:h.|j....)a)?"
# Every alternative of an event's pattern starts with its own byte, so a match never needs to go
# back: from Python 3.11 on the event is matched atomically and its runs possessively, which spares
# the regex engine its backtracking bookkeeping (a third of its time per event).
_ATOMIC = sys.version_info >= (3, 11)
if _ATOMIC:
    _RUN = rb"\]\x94(?:\((?:h.|j....)++e)*+(?:(?:h.|j....)a)?+"
_SCALAR = b"|".join((_REF, _INT, _STR, rb"N|\x88|\x89|G.{8}"))
_KEY = _REF + b"|" + _STR
# One event of the common shape, its key tokens captured (to find or make its template).
_SPAN = re.compile(rb"\}\x94\((?:(?:" + _KEY + rb")(?:" + _SCALAR + b"|" + _RUN + rb"))+u", re.S)
_PAIR = re.compile(rb"(" + _KEY + rb")(" + _SCALAR + b"|" + _RUN + rb")", re.S)
_INT_KEYS = {"addr": "addr", "size": "size", "time_us": "time"}
_INT_OPS = frozenset(b"KMJ\x8a")
_LITTLE = sys.byteorder == "little"  # array's 8-byte ints are the machine's own  # the first bytes of an int token
_MAKERS = frozenset(b"\x8c]")  # the first bytes of a value that makes a memo slot (a fresh string, a new list)


class _Template:
    """One event shape (its keys, in order, as memo references): a regex that matches a run of such events.

    Torch writes every event of a device with the same keys, so one template reads nearly all of
    a trace. Its regex matches, at each place, an event (values captured) after any batch
    boundaries or frame headers (no-ops here), or else the rest of the window (where the run
    stops). Torch also writes some keys with the same value token in every event (``stream``,
    ``compile_context``'s "N/A"): once a run of events showed it, a variant of the template has
    those tokens written in (``fixed``), so their values are neither matched by alternatives nor
    captured (a capture costs about a tenth of an event's match); an event that does not fit the
    variant is read by the general template.
    """

    def __init__(self, ktoks: tuple, keys: tuple, fixed: Optional[Dict[str, bytes]] = None):
        self.ktoks, self.keys = ktoks, keys
        self.fixed: Dict[str, bytes] = dict(fixed or {})  # key -> the value token every event has
        self.general = self  # the template without fixed values (a variant's is its general one)
        self.variant: Optional[_Template] = None
        self.tries = 0  # runs of events looked at for fixed values
        parts = []
        self.ints: Dict[str, int] = {}  # column name -> group
        self.action = self.frames = -1
        self.others: List[tuple] = []  # (key, group, token) of keys kept in the extras table (group -1: fixed token)
        self.slots: List[tuple] = []  # (group, token), in the file's order: values that may make a memo slot
        g = 0
        for ktok, key in zip(ktoks, keys):
            if key in self.fixed:
                tok = self.fixed[key]
                parts.append(re.escape(ktok + tok))
                self.others.append((key, -1, tok))
                self.slots.append((-1, tok))
            elif key in _INT_KEYS:
                parts.append(re.escape(ktok) + b"(" + _INT + b")")
                self.ints[_INT_KEYS[key]] = g
                g += 1
            elif key == "frames":  # a run of references (a new list, a memo slot) or a reference to a list
                parts.append(re.escape(ktok) + b"(" + _RUN + b"|" + _REF + b")")
                self.frames = g
                self.slots.append((g, None))
                g += 1
            else:
                parts.append(re.escape(ktok) + b"(" + _SCALAR + b")")
                if key == "action":
                    self.action = g
                else:
                    self.others.append((key, g, None))
                self.slots.append((g, None))
                g += 1
        self.groups = g  # the stray rest's group
        event = rb"(?:e\(|\x95.{8})*\}\x94\(" + b"".join(parts) + rb"u"
        if _ATOMIC:
            event = rb"(?>(?:e\(|\x95.{8})*+\}\x94\(" + b"".join(parts) + rb"u)"
        self.regex = re.compile(rb"(?:" + event + rb"|(.+))", re.S)
        self.extras: Dict[Any, Dict[tuple, int]] = {}  # trace -> (other tokens) -> extra id

    def fit(self, cols: list, n: int) -> None:
        """Make the variant with the values of ``cols`` (a run of ``n`` events) that every event had, if any."""
        if n < 64:  # too few to tell
            return
        self.tries += 1
        fixed = {key: cols[g][0] for key, g, _tok in self.others if cols[g].count(cols[g][0]) == n}
        if fixed:
            variant = self.variant = _Template(self.ktoks, self.keys, fixed)
            variant.general = self


class _Shape:
    """One shape of dict outside the events (its keys, in order, as memo references): a regex that matches a run of
    such dicts in a list, each value a scalar, a memo reference or a new list of memo references.

    Most of a big snapshot besides its events is such runs: the segments' blocks (address, size,
    requested_size, state, frames) and the frames of a stack (name, filename, line). The general
    opcode loop takes a dozen steps or more per dict; a run of them is matched at once and each
    becomes the same dict, with the same memo slots, costs and counts, the general way would make.
    """

    def __init__(self, ktoks: tuple, keys: tuple):
        self.keys = keys
        self.groups = len(ktoks)  # the stray rest's group
        body = rb"\}\x94\(" + b"".join(re.escape(k) + b"(" + _SCALAR + b"|" + _RUN + b")" for k in ktoks) + rb"u"
        if _ATOMIC:
            body = rb"(?>" + body + rb")"
        self.regex = re.compile(rb"(?:" + body + rb"|(.+))", re.S)


class _Window:
    """The memo kinds of the slots a run of ``n`` events of one layout made: each event makes ``width`` slots (the
    event, then fixed strings and its new frames list, as ``pattern`` says: a kind, or None for the frames list),
    so a slot's kind is worked out from its place and, for a frames list, from the event's frames index (in
    ``fids`` while the run is read, then in the trace's column from event ``first``); the memo keeps a mark per slot."""

    __slots__ = ("width", "pattern", "n", "fids", "trace", "first")

    def __init__(self, width: int, pattern: tuple, n: int, fids: Optional[list], trace: Any = None, first: int = 0):
        self.width, self.pattern, self.n, self.fids, self.trace, self.first = width, pattern, n, fids, trace, first

    def __len__(self) -> int:
        return self.n * self.width

    def __getitem__(self, i: int) -> int:
        j, p = divmod(i, self.width)
        k = self.pattern[p]
        if k is not None:
            return k
        return -2 - (self.fids[j] if self.fids is not None else self.trace.frame[self.first + j])


def _run_references(tok: bytes) -> List[int]:
    """The memo indices a run token references, in order: its BINGET (``h``, one byte) and LONG_BINGET (``j``,
    four bytes) opcodes after the two that open it; MARK, APPEND and APPENDS between batches are skipped."""
    out = []
    i, n = 2, len(tok)
    while i < n:
        c = tok[i]
        if c == 0x68:
            out.append(tok[i + 1])
            i += 2
        elif c == 0x6A:
            out.append(int.from_bytes(tok[i + 1:i + 5], "little"))
            i += 5
        else:
            i += 1
    return out


class _Machine:
    """The pickle machine: a stack with marks as indices, a memo of what was stored, a buffer refilled from the file."""

    def __init__(self, read, name: str, limit: int, size: Optional[int], keep_events: bool):
        self.read, self.name, self.limit, self.size, self.keep_events = read, name, limit, size, keep_events
        self.buf = b""
        self.base = 0  # file offset of buf[0]
        self.eof = False
        # The memo: a kind per slot (>= 0: an index into ``objs``; -1: an event, in its trace;
        # <= -2: a stack in ``frames``), and slots stored past the end (protocols 0-3 number them).
        self.kinds = array("i")
        self.objs: List[Any] = []
        self.sparse: Dict[int, Any] = {}
        self.strings: Dict[str, str] = {}  # equal strings share one object (torch writes "N/A" afresh per event)
        self.string_slot: Dict[str, int] = {}  # an interned string's index in ``objs``
        self.frames: List[Any] = []  # every device's stacks, each once
        self.frames_of_run: Dict[bytes, int] = {}  # a run of references' bytes -> frames index
        self.kind_of_run: Dict[bytes, int] = {}  # the same -> the memo kind of the list it makes
        self.frames_of_obj: Dict[int, int] = {}
        self.frames_of_ref: Dict[bytes, int] = {}  # a reference's bytes -> frames index (a few recent ones)
        self.pending: Optional[int] = None  # memo slot of an event going the general way
        self.templates: Dict[tuple, _Template] = {}
        self.shapes: Dict[tuple, Optional[_Shape]] = {}  # dicts outside the events, by their key tokens
        self.no_dicts: set = set()  # ids of lists whose dicts have no shape the fast way reads
        self.dicts_after = DICTS_AFTER
        self.runs: Dict[bytes, tuple] = {}  # a run of references in a dict -> (its items, what they stand for)
        self.recent: Optional[_Template] = None
        self.token_values: Dict[bytes, Any] = {}  # a scalar token's value (memo slots never change)
        self.token_slots: Dict[bytes, int] = {}  # the memo kind a value token makes (_SKIP: none)
        self.action_codes: Dict[Any, Dict[bytes, int]] = {}  # trace -> action token -> code
        self.batch: Optional[Any] = None  # the memo kinds of the run of events being read
        self.windows: List[_Window] = []  # runs of events whose slots the memo marks _WINDOW
        self.window_starts: List[int] = []  # the first memo slot of each
        # Bounds.
        self.sealed: set = set()  # ids of containers met a second time: never changed again
        self.weights: Dict[int, int] = {}  # id -> items a container stands for, expanded
        self.expanded = 0
        self.expand_limit = EXPAND_FLOOR
        self.cost = 0
        self.cost_limit = COST_FLOOR
        self.started = time.process_time()
        self.ticks = 4096

    # -- bounds -----------------------------------------------------------------------------------
    def consumed(self) -> int:
        return self.base + len(self.buf)

    def spend(self, n: int) -> None:
        """Count ``n`` bytes of objects the general loop builds; refuse past the file's share."""
        self.cost += n
        if self.cost > self.cost_limit:
            self.cost_limit = COST_FLOOR + COST_PER_BYTE * self.consumed()
            if self.cost > self.cost_limit:
                raise SnapshotError(f"{self.name} is not a memory snapshot: it builds more than {COST_PER_BYTE} bytes "
                                    f"of objects per byte (a crafted file?)")

    def clock(self) -> None:
        spent = time.process_time() - self.started
        if spent > SECONDS_FLOOR + SECONDS_PER_BYTE * self.consumed():
            raise SnapshotError(f"{self.name} takes too long to read ({spent:.1f} s of CPU for {self.consumed()} "
                                f"bytes, over the budget of {SECONDS_FLOOR:.0f} s + {SECONDS_PER_BYTE * 1e6:.0f} s "
                                f"per MB: a crafted file?)")

    def weigh(self, obj: Any) -> int:
        """How many items ``obj`` stands for, expanded as a tree (containers counted once, by identity)."""
        weights = self.weights
        w = weights.get(id(obj))
        if w is not None:
            return w
        todo = [(obj, False)]
        while todo:
            o, done = todo.pop()
            if id(o) in weights:
                continue
            items = o.values() if type(o) is dict else o
            if done:
                total = 1 + (len(o) if type(o) is dict else 0)
                for x in items:
                    total += weights.get(id(x), 1) if type(x) in _CONTAINERS else 1
                weights[id(o)] = total
                self.spend(100)
                continue
            todo.append((o, True))
            todo.extend((x, False) for x in items if type(x) in _CONTAINERS and id(x) not in weights)
        return weights[id(obj)]

    def shared(self, obj: Any, pos: int) -> Any:
        """``obj`` met again (a memo reference or DUP): frozen from now on, and what it stands for counted."""
        if type(obj) in _CONTAINER_TYPES:
            w = self.weights.get(id(obj))
            if w is None:
                if type(obj) is not tuple and type(obj) is not frozenset:
                    self.sealed.add(id(obj))
                w = self.weigh(obj)
            self.expanded += w
            if self.expanded > self.expand_limit:
                self.expand_limit = EXPAND_FLOOR + EXPAND_PER_BYTE * self.consumed()
                if self.expanded > self.expand_limit:
                    raise SnapshotError(f"{self.name} is not a memory snapshot: its memo references stand for more "
                                        f"than {EXPAND_PER_BYTE} items per byte (a crafted file?)")
        return obj

    # -- the buffer -----------------------------------------------------------------------------
    def more(self, pos: int, need: int) -> int:
        """Refill so that ``need`` bytes from ``pos`` are in ``self.buf`` where the file has them; the new ``pos`` (0)."""
        buf = self.buf[pos:]
        self.base += pos
        parts = [buf]
        have = len(buf)
        while have < need and not self.eof:
            data = self.read(CHUNK)
            if not data:
                self.eof = True
                break
            parts.append(data)
            have += len(data)
            if self.base + have > self.limit:
                raise SnapshotError(f"{self.name} is over the limit of {self.limit} bytes of pickle "
                                    f"(pass max_bytes= to read it)")
        self.buf = b"".join(parts) if len(parts) > 1 else buf
        self.clock()
        return 0

    def truncated(self, pos: int) -> SnapshotError:
        return SnapshotError(f"{self.name} is not a readable pickle (it ends early, at byte {self.base + pos}: "
                             f"truncated?)")

    def bad(self, pos: int, what: str) -> SnapshotError:
        return SnapshotError(f"{self.name} is not a readable pickle ({what} at byte {self.base + pos})")

    # -- the memo -------------------------------------------------------------------------------
    def intern(self, s: str) -> str:
        return self.strings.setdefault(s, s)

    def get(self, index: int, pos: int) -> Any:
        if index < len(self.kinds):
            k = self.kinds[index]
            if k < 0 and k == _WINDOW:
                k = self.window_kind(index)
            if k >= 0:
                obj = self.objs[k]
            elif k == _EVENT:
                raise Fallback()
            else:
                obj = self.frames[-2 - k]
        else:
            try:
                obj = self.sparse[index]
            except KeyError:
                raise self.bad(pos, f"memo entry {index} is missing") from None
        return self.shared(obj, pos) if type(obj) in _CONTAINER_TYPES else obj

    def put(self, index: int, obj: Any, pos: int) -> None:
        if type(obj) is str:
            obj = self.intern(obj)
        kinds = self.kinds
        if index == len(kinds) and index not in self.sparse:
            kinds.append(len(self.objs))
            self.objs.append(obj)
            self.spend(12)
        elif index < len(kinds) or index in self.sparse or index < 0:
            raise self.bad(pos, f"memo entry {index} written twice")
        else:  # past what was stored (protocols 0-3 number the memo themselves): no gap is filled
            self.sparse[index] = obj
            self.spend(100)

    def memoize(self, obj: Any, pos: int) -> None:
        self.put(len(self.kinds) + len(self.sparse), obj, pos)

    # -- the machine ----------------------------------------------------------------------------
    def run(self) -> Any:
        pos = self.more(0, MARGIN)
        buf = self.buf
        if not buf:
            raise self.bad(0, "an empty file")
        if buf[0] == 0x80:
            if len(buf) < 2 or not 2 <= buf[1] <= 5:
                raise self.bad(0, "not a protocol 0-5 pickle")
            pos = 2
        self.stack: List[Any] = []
        self.marks: List[int] = []
        stack, marks = self.stack, self.marks
        while True:
            if len(buf) - pos < MARGIN and not self.eof:
                pos = self.more(pos, MARGIN)
                buf = self.buf
            try:
                op = buf[pos]
            except IndexError:
                raise self.truncated(pos) from None
            if op == 0x7D and marks and not self.keep_events and marks[-1] and type(stack[marks[-1] - 1]) is Trace \
                    and len(stack) - marks[-1] <= 1:  # an event
                trace = stack[marks[-1] - 1]
                if len(stack) > marks[-1]:
                    self.add(trace, stack.pop())
                end = self.events(trace, buf, pos)
                if end > pos:
                    pos = end
                    continue
                self.pending = len(self.kinds) + len(self.sparse) if buf[pos + 1:pos + 2] == b"\x94" else None
            elif op == 0x7D and marks and marks[-1] and type(stack[marks[-1] - 1]) is list and not self.sparse \
                    and id(stack[marks[-1] - 1]) not in self.no_dicts:  # a dict in a list: blocks, frames
                if self.dicts_after:  # a snapshot with few of them reads them the general way (no regex made)
                    self.dicts_after -= 1
                else:
                    end = self.dicts(stack[marks[-1] - 1], buf, pos)
                    if end > pos:
                        pos = end
                        continue
            self.ticks -= 1
            if not self.ticks:
                self.ticks = 4096
                self.clock()
                if len(stack) + len(marks) > MAX_STACK:
                    raise SnapshotError(f"{self.name} is not a memory snapshot: its pickle stack holds more than "
                                        f"{MAX_STACK} items (a crafted file?)")
            try:
                pos = self.step(op, buf, pos, stack, marks)
            except (IndexError, struct.error):
                if self.eof and pos >= len(self.buf) - 16:
                    raise self.truncated(len(self.buf)) from None
                raise self.bad(pos, f"opcode {bytes([op])!r} on a stack it does not fit") from None
            if pos < 0:
                return stack.pop()
            buf = self.buf

    def add(self, trace: Trace, item: Any) -> None:
        """An event built the general way goes into the trace's columns, and out of the memo."""
        if not isinstance(item, dict):
            raise SnapshotError(f"not a memory snapshot: an event of device_traces is a {type(item).__name__}")
        slot, self.pending = self.pending, None
        trace.add(item)
        if self.keep_events or slot is None or slot >= len(self.kinds):
            return
        k = self.kinds[slot]
        if k >= 0 and self.objs[k] is item:
            self.kinds[slot] = _EVENT
            self.objs[k] = None

    def arg(self, pos: int, n: int) -> bytes:
        """``n`` bytes of argument from ``pos`` (refilling for a long one)."""
        if pos + n > len(self.buf):
            raise _Short(pos, n)
        return self.buf[pos:pos + n]

    def target(self, pos: int, obj: Any) -> Any:
        """The container an opcode adds to, refused once it was met a second time (no cycles, no change after sharing)."""
        if id(obj) in self.sealed and type(obj) is not Trace:
            raise self.bad(pos, "a change to a container after a reference to it")
        return obj

    def step(self, op: int, buf: bytes, pos: int, stack: list, marks: list) -> int:
        """Run the opcode at ``pos``; the position after it, or -1 at STOP."""
        if op == 0x68:  # BINGET
            stack.append(self.get(buf[pos + 1], pos))
            return pos + 2
        if op == 0x6A:  # LONG_BINGET
            stack.append(self.get(int.from_bytes(self.arg(pos + 1, 4), "little"), pos))
            return pos + 5
        if op == 0x94:  # MEMOIZE
            self.memoize(stack[-1], pos)
            return pos + 1
        if op == 0x8C:  # SHORT_BINUNICODE
            n = buf[pos + 1]
            stack.append(self.text(pos + 2, n))
            return pos + 2 + n
        if op == 0x4B:  # BININT1 (a small int: Python's own, nothing made)
            stack.append(buf[pos + 1])
            return pos + 2
        if op == 0x4D:  # BININT2
            stack.append(int.from_bytes(self.arg(pos + 1, 2), "little"))
            self.cost += 32
            return pos + 3
        if op == 0x4A:  # BININT
            stack.append(int.from_bytes(self.arg(pos + 1, 4), "little", signed=True))
            self.cost += 32
            return pos + 5
        if op == 0x8A:  # LONG1
            n = buf[pos + 1]
            stack.append(int.from_bytes(self.arg(pos + 2, n), "little", signed=True))
            self.cost += 32 + n
            return pos + 2 + n
        if op == 0x28:  # MARK
            marks.append(len(stack))
            self.spend(8)  # checks the bill of the cheap opcodes above too
            return pos + 1
        if op == 0x7D:  # EMPTY_DICT
            stack.append({})
            self.spend(64)
            return pos + 1
        if op == 0x5D:  # EMPTY_LIST
            stack.append(self.new_list(stack, marks))
            self.spend(56)
            return pos + 1
        if op == 0x75:  # SETITEMS
            k = marks.pop()
            if k == 0:
                raise IndexError
            target = self.target(pos, stack[k - 1])
            if type(target) is not dict:
                raise self.bad(pos, "SETITEMS on something not a dict")
            items = stack[k:]
            del stack[k:]
            self.spend(40 * len(items))
            for i in range(0, len(items) - 1, 2):
                target[self.key(items[i], pos)] = items[i + 1]
            return pos + 1
        if op == 0x73:  # SETITEM
            value = stack.pop()
            key = stack.pop()
            target = self.target(pos, stack[-1])
            if type(target) is not dict:
                raise self.bad(pos, "SETITEM on something not a dict")
            target[self.key(key, pos)] = value
            self.spend(80)
            return pos + 1
        if op == 0x65:  # APPENDS
            k = marks.pop()
            items = stack[k:]
            del stack[k:]
            self.extend(self.target(pos, stack[-1]), items, pos)
            return pos + 1
        if op == 0x61:  # APPEND
            item = stack.pop()
            self.extend(self.target(pos, stack[-1]), [item], pos)
            return pos + 1
        if op == 0x95:  # FRAME: frames end on opcode boundaries, so the bytes read on as one stream
            self.arg(pos + 1, 8)
            return pos + 9
        if op == 0x71:  # BINPUT
            self.put(buf[pos + 1], stack[-1], pos)
            return pos + 2
        if op == 0x72:  # LONG_BINPUT
            self.put(int.from_bytes(self.arg(pos + 1, 4), "little"), stack[-1], pos)
            return pos + 5
        if op == 0x4E:  # NONE
            stack.append(None)
            return pos + 1
        if op == 0x88 or op == 0x89:  # NEWTRUE, NEWFALSE
            stack.append(op == 0x88)
            return pos + 1
        if op == 0x86:  # TUPLE2 (torch's segment_pool_id)
            if len(stack) - (marks[-1] if marks else 0) < 2:
                raise IndexError
            items = (stack[-2], stack[-1])
            del stack[-2:]
            stack.append(items)
            self.spend(56)
            return pos + 1
        handler = _RARE.get(op)
        if handler is None:
            raise self.refused(op, buf, pos, stack)
        return handler(self, buf, pos, stack, marks)

    def key(self, key: Any, pos: int) -> Any:
        """A dict key: a scalar (hashing a container could take any time)."""
        if type(key) not in _SCALARS:
            raise SnapshotError(f"{self.name} is not a memory snapshot: a dict key is a {type(key).__name__} "
                                f"(at byte {self.base + pos})")
        return key

    def refused(self, op: int, buf: bytes, pos: int, stack: list) -> SnapshotError:
        """The one-line error for an opcode that would build an object, or one this reader does not know."""
        if op == 0x93 and len(stack) >= 2:  # STACK_GLOBAL
            return SnapshotError(f"not a memory snapshot: it refers to {str(stack[-2])[:80]}.{str(stack[-1])[:80]} "
                                 f"(only plain data is read)")
        if op in (0x63, 0x69):  # GLOBAL, INST: module and name on two lines
            line = buf[pos + 1:pos + 200].split(b"\n")
            what = ".".join(x.decode("utf-8", "replace") for x in line[:2])
            return SnapshotError(f"not a memory snapshot: it refers to {what} (only plain data is read)")
        if op in (0x50, 0x51):
            return SnapshotError("not a memory snapshot: it uses persistent ids (only plain data is read)")
        if op in (0x52, 0x62, 0x6F, 0x81, 0x92, 0x82, 0x83, 0x84, 0x93):
            return SnapshotError("not a memory snapshot: it builds an object (only plain data is read)")
        if op == 0x97:
            return SnapshotError("not a memory snapshot: it uses out-of-band buffers (only plain data is read)")
        return self.bad(pos, f"opcode {bytes([op])!r} is not one of plain data's")

    # -- general helpers ------------------------------------------------------------------------
    def text(self, pos: int, n: int) -> str:
        data = self.long_arg(pos, n)
        self.spend(56 + n)
        try:
            return str(data, "utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise self.bad(pos, "a string that is not UTF-8") from None

    def long_arg(self, pos: int, n: int) -> bytes:
        if pos + n > len(self.buf):
            if n > self.limit or (self.size is not None and self.base + pos + n > self.size):
                raise self.truncated(pos) if n <= self.limit else self.bad(pos, f"an argument of {n} bytes")
            self.spend(n)  # held while it is read: refused here when the file has not earned it
            self.fill(pos, n)
            if pos + n > len(self.buf):
                raise self.truncated(len(self.buf))
        return self.buf[pos:pos + n]

    def fill(self, pos: int, n: int) -> None:
        """Read on until ``n`` bytes from ``pos`` are in the buffer, or the file ends; ``pos`` keeps its meaning."""
        shift = pos - self.more(pos, n)  # the buffer now starts at ``pos``
        # Callers return positions relative to the old buffer: keep ``pos`` where it was by
        # putting back as many bytes in front (the old buffer's prefix is not needed again).
        self.buf = b"\0" * shift + self.buf
        self.base -= shift

    def line(self, pos: int) -> tuple:
        """Protocol 0's text argument at ``pos``: its bytes (without the newline) and the position after it."""
        end = self.buf.find(b"\n", pos, pos + MAX_LINE)
        if end < 0 and len(self.buf) - pos < MAX_LINE and not self.eof:
            self.fill(pos, MAX_LINE)  # a line is at most MAX_LINE bytes
            end = self.buf.find(b"\n", pos, pos + MAX_LINE)
        if end < 0:
            if self.eof and len(self.buf) - pos < MAX_LINE:
                raise self.truncated(len(self.buf))
            raise self.bad(pos, f"a text line longer than {MAX_LINE} bytes")
        return self.buf[pos:end], end + 1

    def number(self, text: bytes, pos: int, kind=int) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise self.bad(pos, f"{text[:40]!r} is not a number") from None

    def extend(self, target: Any, items: list, pos: int) -> None:
        if type(target) is Trace:
            for item in items:
                self.add(target, item)
        elif type(target) is list or type(target) is _Traces:
            self.spend(8 * len(items))
            target.extend(items)
        else:
            raise self.bad(pos, "APPENDS on something not a list")

    def new_list(self, stack: list, marks: list):
        """A plain list, or the ``device_traces`` list and each device's trace inside it."""
        top = stack[marks[-1] - 1] if marks and marks[-1] else None
        if type(top) is _Traces or (stack and type(stack[-1]) is _Traces):
            return Trace(self.frames)
        if stack and type(stack[-1]) is str and stack[-1] == "device_traces":
            at_top = (len(marks) == 1 and marks[0] == 1 and type(stack[0]) is dict and len(stack) % 2 == 0) \
                or (not marks and len(stack) == 2 and type(stack[0]) is dict)
            if at_top:
                return _Traces()
        return []

    # -- the fast path: events in bulk ----------------------------------------------------------
    def events(self, trace: Trace, buf: bytes, pos: int) -> int:
        """Read the events from ``pos`` on into ``trace``'s columns, as many as match a template; the position after them."""
        tpl = self.recent
        if tpl is None:
            tpl = self.template(buf, pos)
            if tpl is None:
                return pos
        while True:
            end = min(len(buf), pos + MARGIN)
            rows = tpl.regex.findall(buf, pos, end)
            stray = tpl.groups
            if rows and rows[-1][stray]:
                end -= len(rows.pop()[stray])
            if rows and not self.bulk(tpl, trace, rows):
                return self.after(tpl, buf, pos, self.take(tpl, trace, rows))
            if end > pos:
                pos = end
                if tpl.variant is not None:  # the general template read past a misfit: the variant reads on
                    tpl = self.recent = tpl.variant
                if len(buf) - pos < MARGIN and not self.eof:
                    return pos  # the main loop refills, then comes back
                continue
            if tpl.general is not tpl:  # an event the variant does not fit: the general template reads on, and
                tpl = tpl.general  # looks again for the values every event has (a few times per template)
                tpl.variant = None
                continue
            other = self.template(buf, pos)  # nothing taken here: an event of another shape?
            if other is None or other.general is tpl:
                return pos
            tpl = other

    def take(self, tpl: _Template, trace: Trace, rows: list) -> int:
        """Put in the events before the first that does not fit (halving), so each misfit costs a few tries; how many went in."""
        if len(rows) <= 1:
            return len(rows) if rows and self.bulk(tpl, trace, rows) else 0
        half = len(rows) // 2
        if self.bulk(tpl, trace, rows[:half]):
            return half + self.take(tpl, trace, rows[half:])
        return self.take(tpl, trace, rows[:half])

    @staticmethod
    def after(tpl: _Template, buf: bytes, pos: int, taken: int) -> int:
        """The position after the first ``taken`` events matched from ``pos`` (where the first not taken starts, or
        the batch boundary before it)."""
        if taken:
            for m in tpl.regex.finditer(buf, pos, min(len(buf), pos + MARGIN)):
                taken -= 1
                if not taken:
                    return m.end()
        return pos

    def template(self, buf: bytes, pos: int) -> Optional[_Template]:
        """The template of the event at ``pos`` (made the first time its keys are met), or None."""
        m = _SPAN.match(buf, pos)
        if m is None:
            return None
        ktoks = tuple(k for k, _v in _PAIR.findall(buf, pos + 3, m.end() - 1))
        tpl = self.templates.get(ktoks)
        if tpl is None:
            if any(k[0] == 0x8C for k in ktoks) or len(self.templates) >= 64:
                return None  # keys not yet in the memo (the first events): the general way
            try:
                keys = tuple(self.value(k) for k in ktoks)
            except (KeyError, _NotScalar):
                return None
            if not all(type(k) is str for k in keys) or len(set(keys)) != len(keys):
                return None
            tpl = self.templates[ktoks] = _Template(ktoks, keys)
        tpl = self.recent = tpl.variant or tpl
        return tpl

    # -- the fast path: dicts outside the events ------------------------------------------------
    def dicts(self, target: list, buf: bytes, pos: int) -> int:
        """Read the dicts of one shape from ``pos`` on, onto the stack (as the general way puts them there, for
        ``target``'s APPENDS); the position after them."""
        shape = self.shape(buf, pos)
        if shape is None:
            self.no_dicts.add(id(target))  # not a run of plain dicts (segments, ...): not asked again for this list
            return pos
        if shape is _MISSING:  # keys met for the first time
            return pos
        stray = shape.groups
        if shape.regex.match(buf, pos, min(len(buf), pos + 4096)).group(stray + 1):  # a misfit, told from 4 KB
            return pos
        span = 4096  # a segment's blocks take a few hundred bytes: the rest of the window is not copied as the stray
        while True:
            end = min(len(buf), pos + span)
            span = MARGIN
            rows = shape.regex.findall(buf, pos, end)
            if rows and rows[-1][stray]:
                end -= len(rows.pop()[stray])
            if not rows:
                return pos
            taken = self.take_dicts(shape, rows)
            if len(self.stack) + len(self.marks) > MAX_STACK:
                raise SnapshotError(f"{self.name} is not a memory snapshot: its pickle stack holds more than "
                                    f"{MAX_STACK} items (a crafted file?)")
            if taken < len(rows):
                for m in shape.regex.finditer(buf, pos, end):  # where the first dict not taken starts
                    if not taken:
                        return m.start()
                    taken -= 1
            pos = end
            if len(buf) - pos < MARGIN and not self.eof:
                return pos  # the main loop refills, then comes back

    def shape(self, buf: bytes, pos: int) -> Any:
        """The shape of the dict at ``pos`` (made the first time its keys are met), None for a dict the fast way does
        not read, or _MISSING for one whose keys are not yet all in the memo."""
        m = _SPAN.match(buf, pos)
        if m is None:
            return None
        ktoks = tuple(k for k, _v in _PAIR.findall(buf, pos + 3, m.end() - 1))
        shape = self.shapes.get(ktoks, _MISSING)
        if shape is _MISSING:
            if any(k[0] == 0x8C for k in ktoks):
                return _MISSING  # keys not yet in the memo (the first dict of its kind): the general way
            if len(self.shapes) >= 256:
                return None
            try:
                keys = tuple(self.value(k) for k in ktoks)
            except (KeyError, _NotScalar, Fallback):
                return None
            ok = all(type(k) is str for k in keys) and len(set(keys)) == len(keys)
            shape = self.shapes[ktoks] = _Shape(ktoks, keys) if ok else None
        return shape

    def take_dicts(self, shape: _Shape, rows: list) -> int:
        """Put in the dicts before the first one the fast way cannot make (halving); how many went in."""
        if self.put_dicts(shape, rows):
            return len(rows)
        if len(rows) == 1:
            return 0
        half = len(rows) // 2
        taken = self.take_dicts(shape, rows[:half])
        return taken if taken < half else half + self.take_dicts(shape, rows[half:])

    def put_dicts(self, shape: _Shape, rows: list) -> bool:
        """Make the dicts of ``rows`` (token tuples) and push them, with the memo slots, costs and counts the general
        way would make; False (nothing changed) where one of them needs the general way."""
        n = len(rows)
        cols = list(zip(*rows))[:shape.groups]
        memo = len(self.kinds)  # references must be to slots made before this run of dicts
        cost = n * (84 + 80 * shape.groups)  # EMPTY_DICT, MEMOIZE, MARK and SETITEMS of each
        expanded = 0  # what containers met again stand for (their weights known)
        unweighed = []  # containers met again whose weight the general way works out the first time (shared())
        values = []
        makes = []  # per column: which of its values make a memo slot (None: none, True: all, else per dict)
        try:
            for col in cols:
                firsts = set(map(itemgetter(0), col))
                if firsts <= _INT_OPS:
                    data = b"".join(col)
                    values.append(pickle.loads(b"\x80\x04(" + data + b"l."))
                    cost += 32 * n + len(data)
                    makes.append(None)
                    continue
                vals = []
                for tok in col:
                    c = tok[0]
                    if c == 0x68 or c == 0x6A:  # a reference: a scalar, or a container met again
                        v = self.token_values.get(tok, _MISSING)
                        if v is _MISSING:
                            index = tok[1] if c == 0x68 else int.from_bytes(tok[1:], "little")
                            if index >= memo:
                                return False
                            k = self.kinds[index]
                            if k == _WINDOW:
                                k = self.window_kind(index)
                            if k == _EVENT:
                                return False
                            v = self.objs[k] if k >= 0 else self.frames[-2 - k]
                            if type(v) in _CONTAINER_TYPES:
                                w = self.weights.get(id(v))
                                if w is None:
                                    unweighed.append(v)
                                else:
                                    expanded += w
                            else:
                                v = self.value(tok)
                    elif c == 0x5D:  # a new list of references
                        items, containers = self.run_items(tok, memo)
                        v = list(items)
                        for o in containers:
                            w = self.weights.get(id(o))
                            if w is None:
                                unweighed.append(o)
                            else:
                                expanded += w
                        cost += 76 + 8 * len(items)
                    else:  # a number, a fresh string, None, True, False
                        v = self.value(tok)
                        cost += 68 + len(tok)
                    vals.append(v)
                values.append(vals)
                if 0x5D in firsts or 0x8C in firsts:
                    makes.append(True if firsts <= _MAKERS else [t[0] in _MAKERS for t in col])
                else:
                    makes.append(None)
        except (_NotScalar, KeyError, IndexError, TypeError, ValueError, OverflowError, pickle.UnpicklingError):
            return False
        dicts = list(map(dict, map(zip, repeat(shape.keys), zip(*values))))
        # The memo slots, in the order the file makes them: each dict, then its new strings and lists.
        slotted = [vals for vals, m in zip(values, makes) if m is True]
        if all(m is None or m is True for m in makes):
            made = list(chain.from_iterable(zip(dicts, *slotted))) if slotted else dicts
        else:
            made = []
            for i, d in enumerate(dicts):
                made.append(d)
                for vals, m in zip(values, makes):
                    if m is True or (m is not None and m[i]):
                        made.append(vals[i])
        self.spend(cost + 12 * len(made))
        for o in unweighed:
            self.shared(o, 0)
        if expanded:
            self.expanded += expanded
            if self.expanded > self.expand_limit:
                self.expand_limit = EXPAND_FLOOR + EXPAND_PER_BYTE * self.consumed()
                if self.expanded > self.expand_limit:
                    raise SnapshotError(f"{self.name} is not a memory snapshot: its memo references stand for more "
                                        f"than {EXPAND_PER_BYTE} items per byte (a crafted file?)")
        start = len(self.objs)
        self.objs.extend(made)
        self.kinds.extend(array("i", range(start, start + len(made))))
        self.stack.extend(dicts)
        return True

    def run_items(self, tok: bytes, memo: int) -> tuple:
        """The items a run of references in a dict stands for, and those of them that are containers (KeyError:
        a reference past ``memo`` or to an event; the general way says why)."""
        run = self.runs.get(tok)
        if run is None:
            items = []
            for index in _run_references(tok):
                if index >= memo:
                    raise KeyError(index)
                k = self.kinds[index]
                if k == _WINDOW:
                    k = self.window_kind(index)
                if k == _EVENT:
                    raise KeyError(index)
                items.append(self.objs[k] if k >= 0 else self.frames[-2 - k])
            containers = tuple(o for o in items if type(o) in _CONTAINER_TYPES)
            if len(self.runs) > 65536:
                self.runs.clear()
            run = self.runs[tok] = (tuple(items), containers)
        return run

    def value(self, tok: bytes) -> Any:
        """The scalar a checked token stands for (a memo reference resolved, a string interned)."""
        v = self.token_values.get(tok, _MISSING)
        if v is not _MISSING:
            return v
        c = tok[0]
        if c == 0x68 or c == 0x6A:
            index = tok[1] if c == 0x68 else int.from_bytes(tok[1:], "little")
            v = self.slot(index)
            if type(v) not in _SCALARS:
                raise _NotScalar()
        elif c == 0x8C:
            try:
                v = self.intern(str(tok[2:-1], "utf-8", "surrogatepass"))
            except UnicodeDecodeError:
                raise _NotScalar() from None
        elif c == 0x4E:
            v = None
        elif c == 0x88 or c == 0x89:
            v = c == 0x88
        elif c == 0x47:
            v = _FLOAT.unpack(tok[1:])[0]
        else:
            v = pickle.loads(b"\x80\x04" + tok + b".")  # an int token the regex checked
        if len(self.token_values) > 65536:
            self.token_values.clear()
        self.token_values[tok] = v
        return v

    def slot(self, index: int) -> Any:
        """The object in memo slot ``index`` (KeyError: none; Fallback: an event)."""
        k = self.kind(index)
        if k is not None:
            if k >= 0:
                return self.objs[k]
            if k == _EVENT:
                raise Fallback()
            return self.frames[-2 - k]
        return self.sparse[index]

    def kind(self, index: int) -> Optional[int]:
        """The memo kind of slot ``index``, from the memo or the run of events being read; None past both."""
        n = len(self.kinds)
        if index < n:
            k = self.kinds[index]
            return self.window_kind(index) if k == _WINDOW else k
        if self.batch is not None and index - n < len(self.batch):
            return self.batch[index - n]
        return None

    def window_kind(self, index: int) -> int:
        """The memo kind of slot ``index``, made by a run of events kept as a :class:`_Window`."""
        w = bisect.bisect_right(self.window_starts, index) - 1
        return self.windows[w][index - self.window_starts[w]]

    def frames_id(self, tok: bytes) -> int:
        """The frames index of an event's ``frames`` token: a run of memo references, or a reference to a list."""
        if tok[0] == 0x5D:
            fid = self.frames_of_run.get(tok)
            if fid is None:
                stack = tuple(self.slot(index) for index in _run_references(tok))
                fid = self.frames_of_run[tok] = len(self.frames)
                self.kind_of_run[tok] = -2 - fid
                self.frames.append(stack)
            return fid
        index = tok[1] if tok[0] == 0x68 else int.from_bytes(tok[1:], "little")
        k = self.kind(index)
        if k is not None and k <= -2:
            return -2 - k
        obj = self.slot(index)
        if not isinstance(obj, (list, tuple)):
            raise _NotScalar()
        fid = self.frames_of_obj.get(id(obj))
        if fid is None or self.frames[fid] is not obj:
            fid = self.frames_of_obj[id(obj)] = len(self.frames)
            self.frames.append(obj)
        return fid

    def token_slot(self, tok: bytes) -> int:
        """The memo kind a value token makes: a string's index in ``objs``, or _SKIP for a reference or number."""
        k = self.token_slots.get(tok)
        if k is None:
            if tok[0] == 0x8C:
                s = self.value(tok)
                k = self.string_slot.get(s)
                if k is None:
                    k = self.string_slot[s] = len(self.objs)
                    self.objs.append(s)
            else:
                k = _SKIP
            if len(self.token_slots) > 65536:
                self.token_slots.clear()
            self.token_slots[tok] = k
        return k

    def bulk(self, tpl: _Template, trace: Trace, rows: list) -> bool:
        """Put ``rows`` (a run of events of one template, as token tuples) into the trace; False (nothing
        changed) when one of them does not fit the columns."""
        n = len(rows)
        cols = list(zip(*rows))
        try:
            ints = {}
            for name, g in tpl.ints.items():
                data = b"".join(cols[g])
                column = _long1_column(data, n)  # addresses: LONG1 tokens of one width, turned into bytes in C
                ints[name] = pickle.loads(b"\x80\x04(" + data + b"l.") if column is None else column
            # Frames, as indices into the stacks table: a run of references is a stack (known, or read now from
            # the memo); a reference to a list is resolved once the slots this run of events makes are known.
            fids = None
            if tpl.frames >= 0:
                frames = cols[tpl.frames]
                fids = list(map(self.frames_of_run.get, frames))
                if None in fids:
                    for i in compress(range(n), map(is_, fids, repeat(None))):
                        if frames[i][0] == 0x5D:
                            fids[i] = self.frames_id(frames[i])
            # Actions, as codes in the trace's table of the tokens that make no memo slot (references): an action
            # column of known tokens makes none.
            if tpl.action >= 0:
                table = self.action_codes.setdefault(trace, {})
                codes = list(map(table.get, cols[tpl.action]))
                known = None not in codes
            # The memo slots the events make, in the order the file holds them: the event, its fresh
            # strings, its frames list (a run of references, so its stack is known before the slots).
            making = []  # the kind of slot every event makes there (an int), None for its frames list, or a kind each
            skips = False  # whether some event makes no slot at one of those places (_SKIP)
            for g, tok in tpl.slots:
                if g < 0:  # a value written into the template
                    k = self.token_slot(tok)
                    if k != _SKIP:
                        making.append(k)
                    continue
                col = cols[g]
                if g == tpl.frames:  # a reference makes no slot
                    making.append(None)
                    skips = skips or None in fids
                    continue
                if g == tpl.action and known:
                    continue
                if col.count(col[0]) == n:  # the same token in every event (torch's "N/A", a stream)
                    k = self.token_slot(col[0])
                    if k != _SKIP:
                        making.append(k)
                    continue
                if b"\x8c" not in b"".join(col):  # references and numbers only (actions): no slots
                    continue
                kinds = list(map(self.token_slots.get, col))
                if None in kinds:
                    kinds = [self.token_slot(t) if k is None else k for t, k in zip(col, kinds)]
                skipped = kinds.count(_SKIP)
                if skipped != n:
                    making.append(array("i", kinds))
                    skips = skips or skipped > 0
            width = 1 + len(making)
            if not skips and all(type(k) is not array for k in making):  # one layout: the memo keeps a mark per slot
                slots = _Window(width, (_EVENT, *making), n, fids)
            else:
                slots = array("i", [_EVENT]) * (n * width)
                for j, kinds in enumerate(making, 1):
                    if kinds is None:
                        kinds = array("i", map(self.kind_of_run.get, frames, repeat(_SKIP)))
                    elif type(kinds) is int:
                        kinds = array("i", [kinds]) * n
                    slots[j::width] = kinds
                if skips:
                    slots = array("i", filter(_SKIP.__ne__, slots))
            self.batch = slots  # references to slots made earlier in this run of events resolve here
            if fids is not None and None in fids:  # references to stacks (a free may refer to its allocation's)
                fids = list(map(self.frames_of_ref.get, frames, fids))  # a run's stays as found
                if None in fids:  # a reference met for the first time
                    for i in compress(range(n), map(is_, fids, repeat(None))):
                        fids[i] = self.frame_ref(frames[i])
            if tpl.action >= 0:
                if not known:
                    for i, tok in enumerate(cols[tpl.action]):
                        if codes[i] is None:
                            code = codes[i] = trace.action_code(self.value(tok))
                            if code is None:
                                return False
                            if tok[0] != 0x8C:  # a fresh string makes a slot each time: never "known"
                                table[tok] = code
            else:
                code = trace.action_code(None)
                if code is None:
                    return False
                codes = [code] * n
            # The other keys, as an index into the trace's table of extras.
            per_trace = tpl.extras.setdefault(trace, {})
            others = [cols[g] if g >= 0 else (tok,) * n for _k, g, tok in tpl.others]
            if all(col.count(col[0]) == n for col in others):
                toks = tuple(col[0] for col in others)
                xid = per_trace.get(toks)
                if xid is None:
                    xid = per_trace[toks] = trace.extra_id(
                        tpl.keys, tuple((k, self.value(t)) for (k, _g, _t), t in zip(tpl.others, toks)))
                xids = [xid] * n
            else:
                xt = list(zip(*others))
                xids = list(map(per_trace.get, xt))
                if None in xids:
                    for i, toks in enumerate(xt):
                        if xids[i] is None:
                            pairs = tuple((k, self.value(t)) for (k, _g, _t), t in zip(tpl.others, toks))
                            xids[i] = per_trace[toks] = trace.extra_id(tpl.keys, pairs)
                if len(per_trace) > 65536:
                    per_trace.clear()
        except (_NotScalar, KeyError, TypeError, OverflowError, pickle.UnpicklingError, ValueError):
            return False
        finally:
            self.batch = None
        first = len(trace)
        trace.extend_columns(codes, ints.get("addr"), ints.get("size"), ints.get("time"), fids, xids, n)
        if type(slots) is _Window:
            slots.fids, slots.trace, slots.first = None, trace, first  # from now on read from the trace's column
            self.window_starts.append(len(self.kinds))
            self.windows.append(slots)
            self.kinds.extend(array("i", [_WINDOW]) * len(slots))
        else:
            self.kinds.extend(slots)
        if tpl.variant is None and tpl.general is tpl and tpl.tries < 16:
            tpl.fit(cols, n)
        return True

    def frame_ref(self, tok: bytes) -> int:
        """:meth:`frames_id` of a reference, remembered (a stack is referred to by its free events again)."""
        fid = self.frames_id(tok)
        if len(self.frames_of_ref) > 65536:
            self.frames_of_ref.clear()
        self.frames_of_ref[tok] = fid
        return fid


def _long1_column(data: bytes, n: int) -> Optional[array]:
    """The ints of ``n`` LONG1 tokens of one width and not negative (``data``: the tokens one after another, each
    checked by the regex) as an array of 8-byte ints, its bytes moved by slices; None for any other run of tokens."""
    width = len(data) // n
    if width * n != len(data) or not 3 <= width <= 9 or not _LITTLE:
        return None
    if data[0::width] != b"\x8a" * n or data[1::width] != bytes([width - 2]) * n or max(data[width - 1::width]) >= 0x80:
        return None
    out = bytearray(8 * n)
    for b in range(width - 2):
        out[b::8] = data[2 + b::width]
    column = array("q")
    column.frombytes(out)
    return column


class _Short(IndexError):
    """An argument runs past the buffer (handled as truncation or refilled by ``long_arg``)."""


class _NotScalar(Exception):
    """A token stands for something an event's columns cannot hold: the event goes the general way."""


_MISSING = object()


# -- opcodes met rarely in torch's files (protocols 0-3, sets, bytes, floats, ...) ------------------
def _pop_mark(m: _Machine, stack: list, marks: list) -> list:
    k = marks.pop()
    items = stack[k:]
    del stack[k:]
    return items


def _longint(m, buf, pos, stack, marks, width):
    n = int.from_bytes(m.arg(pos + 1, width), "little", signed=True)
    if n < 0 or n > MAX_INT_BYTES:
        raise m.bad(pos, f"an integer of {n} bytes (torch's have 8)")
    stack.append(int.from_bytes(m.long_arg(pos + 1 + width, n), "little", signed=True))
    m.spend(32 + n)
    return pos + 1 + width + n


def _bytes(m, buf, pos, stack, marks, width, kind):
    n = int.from_bytes(m.arg(pos + 1, width), "little")
    data = m.long_arg(pos + 1 + width, n)
    m.spend(40 + n)
    stack.append(kind(data))
    return pos + 1 + width + n


def _unicode(m, buf, pos, stack, marks, width):
    n = int.from_bytes(m.arg(pos + 1, width), "little")
    stack.append(m.text(pos + 1 + width, n))
    return pos + 1 + width + n


def _tuple(m, buf, pos, stack, marks, n):
    if len(stack) - (marks[-1] if marks else 0) < n:
        raise IndexError
    items = tuple(stack[len(stack) - n:]) if n else ()
    del stack[len(stack) - n:]
    stack.append(items)
    m.spend(40 + 8 * n)
    return pos + 1


def _from_mark(m, buf, pos, stack, marks, kind):
    items = _pop_mark(m, stack, marks)
    if kind is dict:
        m.spend(64 + 40 * len(items))
        stack.append({m.key(items[i], pos): items[i + 1] for i in range(0, len(items) - 1, 2)})
    elif kind is frozenset:
        m.spend(216 + 40 * len(items))
        stack.append(frozenset(m.key(x, pos) for x in items))
    else:
        m.spend(64 + 8 * len(items))
        stack.append(kind(items))
    return pos + 1


def _additems(m, buf, pos, stack, marks):
    items = _pop_mark(m, stack, marks)
    target = m.target(pos, stack[-1])
    if type(target) is not set:
        raise m.bad(pos, "ADDITEMS on something not a set")
    m.spend(40 * len(items))
    target.update(m.key(x, pos) for x in items)
    return pos + 1


def _pop(m, buf, pos, stack, marks):
    if marks and len(stack) == marks[-1]:
        _pop_mark(m, stack, marks)
    else:
        stack.pop()
    return pos + 1


def _dup(m, buf, pos, stack, marks):
    stack.append(m.shared(stack[-1], pos))
    return pos + 1


def _stop(m, buf, pos, stack, marks):
    if len(stack) != 1 or marks:
        raise m.bad(pos, "STOP with an unfinished stack")
    return -1


def _text_int(m, buf, pos, stack, marks):  # INT: protocol 0 (I01/I00 are True/False)
    text, end = m.line(pos + 1)
    if len(text) > 40:
        raise m.bad(pos, "an integer of more than 40 digits")
    stack.append(True if text == b"01" else False if text == b"00" else m.number(text, pos))
    return end


def _text_long(m, buf, pos, stack, marks):  # LONG: protocol 0
    text, end = m.line(pos + 1)
    if len(text) > 40:
        raise m.bad(pos, "an integer of more than 40 digits")
    stack.append(m.number(text[:-1] if text.endswith(b"L") else text, pos))
    return end


def _text_float(m, buf, pos, stack, marks):  # FLOAT: protocol 0
    text, end = m.line(pos + 1)
    stack.append(m.number(text, pos, float))
    return end


def _text_string(m, buf, pos, stack, marks):  # STRING: a quoted Python 2 str
    text, end = m.line(pos + 1)
    if len(text) < 2 or text[:1] != text[-1:] or text[:1] not in (b"'", b'"'):
        raise m.bad(pos, "a STRING that is not quoted")
    try:
        value = codecs.escape_decode(text[1:-1])[0].decode("ascii")
    except (ValueError, UnicodeDecodeError):
        raise m.bad(pos, "a STRING that is not ASCII") from None
    m.spend(56 + len(value))
    stack.append(value)
    return end


def _text_unicode(m, buf, pos, stack, marks):  # UNICODE: raw-unicode-escape text
    text, end = m.line(pos + 1)
    try:
        value = str(text, "raw-unicode-escape")
    except UnicodeDecodeError:
        raise m.bad(pos, "a UNICODE string that does not decode") from None
    m.spend(56 + len(text))
    stack.append(value)
    return end


def _binstring(m, buf, pos, stack, marks, width):  # BINSTRING, SHORT_BINSTRING: Python 2 str, read as ASCII
    n = int.from_bytes(m.arg(pos + 1, width), "little", signed=width == 4)
    if n < 0:
        raise m.bad(pos, "a string of negative length")
    data = m.long_arg(pos + 1 + width, n)
    try:
        value = data.decode("ascii")
    except UnicodeDecodeError:
        raise m.bad(pos, "a Python 2 string that is not ASCII") from None
    m.spend(56 + n)
    stack.append(value)
    return pos + 1 + width + n


def _text_get(m, buf, pos, stack, marks):
    text, end = m.line(pos + 1)
    if len(text) > 20:
        raise m.bad(pos, "a memo index of more than 20 digits")
    stack.append(m.get(m.number(text, pos), pos))
    return end


def _text_put(m, buf, pos, stack, marks):
    text, end = m.line(pos + 1)
    if len(text) > 20:
        raise m.bad(pos, "a memo index of more than 20 digits")
    m.put(m.number(text, pos), stack[-1], pos)
    return end


def _binfloat(m, buf, pos, stack, marks):
    stack.append(_FLOAT.unpack(m.arg(pos + 1, 8))[0])
    m.spend(24)
    return pos + 9


_RARE = {
    0x58: lambda m, b, p, s, k: _unicode(m, b, p, s, k, 4),  # BINUNICODE
    0x8D: lambda m, b, p, s, k: _unicode(m, b, p, s, k, 8),  # BINUNICODE8
    0x47: _binfloat,  # BINFLOAT
    0x8B: lambda m, b, p, s, k: _longint(m, b, p, s, k, 4),  # LONG4
    0x43: lambda m, b, p, s, k: _bytes(m, b, p, s, k, 1, bytes),  # SHORT_BINBYTES
    0x42: lambda m, b, p, s, k: _bytes(m, b, p, s, k, 4, bytes),  # BINBYTES
    0x8E: lambda m, b, p, s, k: _bytes(m, b, p, s, k, 8, bytes),  # BINBYTES8
    0x96: lambda m, b, p, s, k: _bytes(m, b, p, s, k, 8, bytearray),  # BYTEARRAY8
    0x29: lambda m, b, p, s, k: _tuple(m, b, p, s, k, 0),  # EMPTY_TUPLE
    0x85: lambda m, b, p, s, k: _tuple(m, b, p, s, k, 1),  # TUPLE1
    0x87: lambda m, b, p, s, k: _tuple(m, b, p, s, k, 3),  # TUPLE3
    0x74: lambda m, b, p, s, k: _from_mark(m, b, p, s, k, tuple),  # TUPLE
    0x6C: lambda m, b, p, s, k: _from_mark(m, b, p, s, k, list),  # LIST
    0x64: lambda m, b, p, s, k: _from_mark(m, b, p, s, k, dict),  # DICT
    0x91: lambda m, b, p, s, k: _from_mark(m, b, p, s, k, frozenset),  # FROZENSET
    0x8F: lambda m, b, p, s, k: (s.append(set()), m.spend(216), p + 1)[2],  # EMPTY_SET
    0x90: _additems,  # ADDITEMS
    0x30: _pop,  # POP
    0x31: lambda m, b, p, s, k: (_pop_mark(m, s, k), p + 1)[1],  # POP_MARK
    0x32: _dup,  # DUP
    0x98: lambda m, b, p, s, k: p + 1,  # READONLY_BUFFER: a no-op on in-band data
    0x80: lambda m, b, p, s, k: p + 2,  # PROTO (again)
    0x2E: _stop,  # STOP
    # Protocols 0 and 1.
    0x49: _text_int,  # INT
    0x4C: _text_long,  # LONG
    0x46: _text_float,  # FLOAT
    0x53: _text_string,  # STRING
    0x56: _text_unicode,  # UNICODE
    0x54: lambda m, b, p, s, k: _binstring(m, b, p, s, k, 4),  # BINSTRING
    0x55: lambda m, b, p, s, k: _binstring(m, b, p, s, k, 1),  # SHORT_BINSTRING
    0x67: _text_get,  # GET
    0x70: _text_put,  # PUT
}
