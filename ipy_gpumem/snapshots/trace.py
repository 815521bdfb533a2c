"""One device's events held as columns (a few bytes each), read back as the dicts torch wrote, one at a time."""
from __future__ import annotations

import struct
import sys
from array import array
from collections import Counter
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

__all__ = ["Trace", "NO_TIME", "COLUMNS"]

#: ``time_us`` of an event that has none (2024 captures record no times).
NO_TIME = -(1 << 63)
#: The time column's "no time" while it holds offsets (4 bytes each) from the first time.
_NO_OFFSET = (1 << 32) - 1
#: The keys kept in their own columns; every other key goes into the event's interned ``extras``.
COLUMNS = ("action", "addr", "size", "time_us", "frames")
_LOW, _HIGH = -(1 << 63) + 1, (1 << 63) - 1
_WIDER = {"I": "q", "h": "iq", "i": "q", "B": "HIq", "H": "Iq", "q": ""}  # what a column widens to, in order


class Trace(Sequence):
    """A device's events, oldest first: ``trace[i]`` builds event ``i``'s dict on demand.

    Per event it keeps an action code (1 byte), ``addr`` (8 bytes), ``time_us`` as microseconds
    after the first event's (4 bytes: 71 minutes; the absolute 8 once one is not after it or
    later), ``size`` (4 bytes, 8 once one needs it), an index into the shared frames table (2
    bytes, 4 past 32,767 stacks: equal stacks are stored once) and an index into a table of the
    event's other keys and values (1 byte, wider past 255: ``stream``, ``compile_context``, ...,
    which repeat): 20 bytes. A column widens the first time a value does not fit. An event that
    does not fit at all (a value of another type, a huge int) is kept whole in ``odd``; nothing is
    dropped. ``time[i] + time_base`` is event ``i``'s ``time_us``, unless ``time[i] == time_none``
    (:meth:`time_at` says so).
    """

    def __init__(self, frames: Optional[List[Any]] = None):
        self.actions: List[Any] = []
        self._action_code: Dict[Any, int] = {}
        self.act = array("B")
        self.addr = array("q")
        self.size = array("I")  # widens to "q"
        self.time = array("I")  # offsets from ``time_base`` (widens to "q": absolute, base 0)
        self.time_base = 0
        self.time_none = _NO_OFFSET  # NO_TIME once widened
        self._based = False  # time_base is the first time seen
        self.untimed = 0  # events without a time (their column holds ``time_none``)
        self.frame = array("h")  # index into ``frames``; -1: no ``frames`` key (widens to "i")
        self.extra = array("B")  # index into ``extras`` (widens to "H", then "I")
        self.frames: List[Any] = [] if frames is None else frames  # shared between a file's devices
        self.extras: List[Tuple[Tuple[str, ...], Tuple[Tuple[str, Any], ...]]] = []
        self._extra_id: Dict[Any, int] = {}
        self._frames_id: Dict[int, int] = {}  # id(frames object) -> index, for events handed in as dicts
        self.odd: Dict[int, Mapping[str, Any]] = {}

    # -- building -------------------------------------------------------------------------------
    @classmethod
    def from_events(cls, events: Iterable[Mapping[str, Any]]) -> "Trace":
        trace = cls()
        for e in events:
            trace.add(e)
        return trace

    def action_code(self, action: Any) -> Optional[int]:
        code = self._action_code.get(action)
        if code is None:
            if len(self.actions) >= 256:
                return None
            code = self._action_code[action] = len(self.actions)
            self.actions.append(action)
        return code

    def extra_id(self, keys: Tuple[str, ...], others: Tuple[Tuple[str, Any], ...]) -> int:
        key = (keys, others)
        xid = self._extra_id.get(key)
        if xid is None:
            xid = self._extra_id[key] = len(self.extras)
            self.extras.append(key)
        return xid

    def frames_id(self, frames: Any) -> int:
        fid = self._frames_id.get(id(frames))
        if fid is None or self.frames[fid] is not frames:
            fid = self._frames_id[id(frames)] = len(self.frames)
            self.frames.append(frames)
        return fid

    def append_row(self, act: int, addr: int, size: int, time: int, frame: int, extra: int) -> None:
        self.act.append(act)
        self.addr.append(addr)
        for name, value in (("size", size), ("frame", frame), ("extra", extra)):
            try:
                getattr(self, name).append(value)
            except OverflowError:
                self._widen(name, [value])
        self._extend_time([time])

    def _widen(self, name: str, values: List[int]) -> None:
        """Append ``values`` to column ``name``, in a wider type where one of them does not fit its own."""
        column = getattr(self, name)
        for typecode in _WIDER[column.typecode]:
            wider = array(typecode, column)
            try:
                wider.fromlist(values)
            except OverflowError:
                continue
            setattr(self, name, wider)
            return
        raise OverflowError(f"an event's {name} does not fit 64 bits")

    def extend_columns(self, codes: Sequence[int], addr: Optional[Sequence[int]], size: Optional[Sequence[int]],
                       time: Optional[Sequence[int]], frame: Optional[Sequence[int]], extra: Sequence[int],
                       n: int) -> None:
        """Append ``n`` events given as columns (None: the key is absent, as 0, :data:`NO_TIME` or no frames).

        The values must fit (action codes from :meth:`action_code`, 64-bit ints): the streaming
        reader checks them before, so the columns never end up of different lengths."""
        self.act.frombytes(bytes(codes))
        if time is None:
            self._extend_time([NO_TIME] * n)
        elif type(time) is array and time.typecode == "q" and self._offsets(time):
            pass  # 8-byte times from the reader, turned into offsets in bulk
        else:
            self._extend_time(time if type(time) is list else time.tolist())
        for name, values, absent in (("addr", addr, 0), ("size", size, 0), ("frame", frame, -1), ("extra", extra, 0)):
            column = getattr(self, name)
            if values is None:
                values = [absent] * n
            elif type(values) is array and values.typecode == column.typecode:
                column.extend(values)  # a copy of the bytes
                continue
            elif type(values) is not list:
                values = values.tolist()
            try:
                _append(column, values)  # all or nothing
            except OverflowError:
                self._widen(name, values)

    def _offsets(self, times: array) -> bool:
        """Append ``times`` (8-byte ints, none the "no time" mark) as offsets from the first time, all at once: the
        times as one big integer less the first time in every 8 bytes (a time before it borrows, so that its 8 bytes
        are not below 2**32). False (nothing appended) unless each is 0 to 2**32 - 2 after the first time."""
        if self.time.typecode != "I" or not _LITTLE or not len(times):
            return False
        n = len(times)
        if not self._based:
            self.time_base, self._based = times[0], True
        if not 0 <= self.time_base < 1 << 63:
            return False
        every = int.from_bytes(times.tobytes(), "little") - int.from_bytes(self.time_base.to_bytes(8, "little") * n,
                                                                            "little")
        if every < 0:
            return False
        data = every.to_bytes(8 * n, "little")
        zeros = bytes(n)
        if data[4::8] != zeros or data[5::8] != zeros or data[6::8] != zeros or data[7::8] != zeros:
            return False  # one is before the first time, or 71 minutes after it
        out = bytearray(4 * n)
        for b in range(4):
            out[b::4] = data[b::8]
        at = out.find(b"\xff\xff\xff\xff")
        while at >= 0:
            if at % 4 == 0:
                return False  # a real offset equal to "no time"
            at = out.find(b"\xff\xff\xff\xff", at + 1)
        self.time.frombytes(out)
        return True

    def _extend_time(self, values: List[int]) -> None:
        """Append times (``time_us``, or :data:`NO_TIME`) as offsets from the first one, or absolute once one does not fit."""
        column = self.time
        untimed = values.count(NO_TIME)
        self.untimed += untimed
        if column.typecode == "I":
            if not self._based:
                if untimed == len(values):  # no time yet (2024 captures have none at all)
                    column.extend(array("I", [_NO_OFFSET]) * len(values))
                    return
                self.time_base, self._based = next(t for t in values if t != NO_TIME), True
            offsets: Optional[List[int]] = list(map(self.time_base.__rsub__, values))  # ``t - base``, in C
            if _NO_OFFSET in offsets:
                offsets = None  # a real offset equal to "no time": absolute from here
            elif untimed:
                offsets = [_NO_OFFSET if t == NO_TIME else o for t, o in zip(values, offsets)]
            if offsets is not None:
                try:
                    column.fromlist(offsets)  # all or nothing
                    return
                except OverflowError:  # before the first event, or 71 minutes after it
                    pass
            none, base = self.time_none, self.time_base
            column = self.time = array("q", [NO_TIME if o == none else o + base for o in column])
            self.time_base, self.time_none = 0, NO_TIME
        _append(column, values)

    def time_at(self, i: int) -> int:
        """Event ``i``'s ``time_us`` from the column (:data:`NO_TIME`: none)."""
        offset = self.time[i]
        return NO_TIME if offset == self.time_none else offset + self.time_base

    def add(self, e: Mapping[str, Any]) -> None:
        """Append one event given as a dict (columns where it fits, whole in ``odd`` where not)."""
        row = self._row(e) if isinstance(e, Mapping) else None
        if row is None:
            self.odd[len(self.act)] = e
            row = (0, 0, 0, NO_TIME, -1, 0)
        self.append_row(*row)

    def _row(self, e: Mapping[str, Any]):
        try:
            code = self.action_code(e.get("action"))
            addr, size, t = e.get("addr", 0), e.get("size", 0), e.get("time_us")
            if code is None or not (_fits(addr) and _fits(size) and (t is None or _fits(t))):
                return None
            frame = self.frames_id(e["frames"]) if "frames" in e else -1
            keys = tuple(e)
            if not all(type(k) is str for k in keys):
                return None
            others = tuple((k, v) for k, v in e.items() if k not in COLUMNS)
            extra = self.extra_id(keys, others)
        except TypeError:  # an unhashable action or extra value
            return None
        return code, addr, size, NO_TIME if t is None else t, frame, extra

    # -- reading --------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.act)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.event(i) for i in range(*index.indices(len(self)))]
        n = len(self.act)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("trace index out of range")
        return self.event(index)

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        for i in range(len(self.act)):
            yield self.event(i)

    def event(self, i: int) -> Dict[str, Any]:
        """Event ``i`` as the dict torch wrote (a fresh one: the trace keeps only its columns)."""
        odd = self.odd.get(i)
        if odd is not None or i in self.odd:
            return odd
        keys, others = self.extras[self.extra[i]]
        values = dict(others)
        out = {}
        for k in keys:
            if k == "action":
                out[k] = self.actions[self.act[i]]
            elif k == "addr":
                out[k] = self.addr[i]
            elif k == "size":
                out[k] = self.size[i]
            elif k == "time_us":
                out[k] = self.time_at(i)
            elif k == "frames":
                out[k] = list(self.frames[self.frame[i]])
            else:
                out[k] = values[k]
        return out

    def row(self, i: int) -> Tuple[Any, Any, Any, Any]:
        """``(action, addr, size, time_us)`` of event ``i``, as :meth:`rows` gives them."""
        if i in self.odd:
            e = self.odd[i]
            if not isinstance(e, Mapping):
                return None, 0, 0, NO_TIME
            t = e.get("time_us")
            return e.get("action"), e.get("addr", 0), e.get("size", 0), NO_TIME if t is None else t
        return self.actions[self.act[i]], self.addr[i], self.size[i], self.time_at(i)

    def frames_at(self, i: int) -> Any:
        """Event ``i``'s ``frames`` (None without)."""
        if i in self.odd:
            e = self.odd[i]
            return e.get("frames") if isinstance(e, Mapping) else None
        fid = self.frame[i]
        return None if fid < 0 else self.frames[fid]

    def rows(self, reverse: bool = False) -> Iterator[Tuple[Any, Any, Any, Any]]:
        """``(action, addr, size, time_us)`` of every event (``addr``/``size`` 0 and time :data:`NO_TIME` when absent)."""
        columns = (self.act, self.addr, self.size, self.time)
        if reverse:
            columns = tuple(reversed(c) for c in columns)
        act, addr, size, time = columns
        if self.time.typecode != "q":
            none, base = self.time_none, self.time_base
            time = (NO_TIME if t == none else t + base for t in time)
        rows = zip(map(self.actions.__getitem__, act), addr, size, time)
        if not self.odd:
            return rows
        return self._patched(rows, reverse)

    def _patched(self, rows, reverse: bool):
        n = len(self.act)
        for k, row in enumerate(rows):
            i = n - 1 - k if reverse else k
            e = self.odd.get(i)
            if e is None and i not in self.odd:
                yield row
            elif isinstance(e, Mapping):
                t = e.get("time_us")
                yield e.get("action"), e.get("addr", 0), e.get("size", 0), NO_TIME if t is None else t
            else:
                yield None, 0, 0, NO_TIME

    def has_key(self, key: str, first: int = 50) -> bool:
        """Whether any of the first ``first`` events has ``key``."""
        return any(key in e for e in self[:first] if isinstance(e, Mapping))

    def value_counts(self, keys: Sequence[str]) -> Dict[str, Counter]:
        """For each of ``keys`` (keys outside the columns), how many events carry each value."""
        out = {k: Counter() for k in keys}
        if self.extra.typecode == "B":  # one byte an event: counted by bytes.count, a pass in C per extra
            data = self.extra.tobytes()
            per_extra = Counter({xid: data.count(xid) for xid in range(len(self.extras))})
        else:
            per_extra = Counter(self.extra)
        if self.odd:  # their rows hold extra 0 without meaning it
            per_extra[0] -= len(self.odd)
        for xid, n in per_extra.items():
            values = dict(self.extras[xid][1]) if n > 0 and xid < len(self.extras) else {}
            for k in keys:
                if k in values:
                    out[k][values[k]] += n
        for e in self.odd.values():
            if isinstance(e, Mapping):
                for k in keys:
                    if k in e and type(e[k]) in (str, int, float, bool, type(None)):  # a file's odd value may be a list
                        out[k][e[k]] += 1
        return out


_LITTLE = sys.byteorder == "little"


def _append(column: array, values: List[int]) -> None:
    """Append ``values`` to ``column``, all or nothing (OverflowError where one does not fit its type). array's own
    fromlist parses each signed value as a function argument; bytes() and struct pack them several times faster."""
    code = column.typecode
    try:
        if code == "B":
            column.frombytes(bytes(values))
        elif code in "hiq":
            column.frombytes(struct.pack(f"{len(values)}{code}", *values))
        else:
            column.fromlist(values)
    except (ValueError, struct.error):  # bytes(): not 0..255; struct: out of range
        raise OverflowError(f"a value does not fit an array of {code!r}") from None


def _fits(value: Any) -> bool:
    return type(value) is int and _LOW <= value <= _HIGH
