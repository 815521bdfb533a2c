"""A streaming pickle reader for snapshots: plain data only, with each device's events stored as columns instead of dicts.

``pickle.load`` of a snapshot builds a dict per event: about 7x the file's size in memory. This
reader runs the pickle machine itself (protocols 2 to 5) over a buffer refilled from the file, so
the file is never held whole. It keeps the memo (strings, frame dicts: shared, bounded by what is
distinct) and the non-event part as plain objects, but each event in ``device_traces`` goes into
a :class:`~.trace.Trace` (a few bytes of columns) and its memo slot holds a shared placeholder.

Speed comes from the common event shape (``}`` MEMOIZE MARK, key/value pairs of memo references,
ints, short strings and a frames list of memo references, SETITEMS) read with two regex calls;
anything else runs through the general opcode loop, slower and just as exact. Any class
reference, reduce or persistent id raises :class:`SnapshotError` the moment it is seen:
nothing is imported and nothing runs.
"""
from __future__ import annotations

import re
import struct
from typing import Any, Dict, List, Optional

from .trace import NO_TIME, Trace


__all__ = ["read_stream", "Fallback", "CHUNK", "SnapshotError"]


class SnapshotError(ValueError):
    """A snapshot that cannot be read; the message is one line and says why."""


#: Bytes read from the file at a time.
CHUNK = 1 << 20
#: The fast path needs an event whole in the buffer: keep at least this much ahead (an event is
#: ~100-400 bytes; one that is longer only goes the general way).
MARGIN = 1 << 16

_EVENT = object()  # the memo slot of an event dict: it is in the trace's columns, not here
_FLOAT = struct.Struct(">d")


class Fallback(Exception):
    """The file shares an event dict between places (torch never does): read it the plain way."""


class _Traces(list):
    """The ``device_traces`` list: its items are built as :class:`Trace`."""


# Tokens of the fast path (protocol 4/5 output; protocol 2/3 use BINPUT and go the general way).
_REF = rb"h[\s\S]|j[\s\S]{4}"
_INT = rb"K[\s\S]|M[\s\S]{2}|J[\s\S]{4}|\x8a(?:" + b"|".join(
    bytes([n]) + (rb"[\s\S]{%d}" % n if n else b"") for n in range(9)) + rb")"
_STR = rb"\x8c(?:" + b"|".join(
    re.escape(bytes([n])) + (rb"[\s\S]{%d}" % n if n else b"") for n in range(64)) + rb")\x94"
_FRAMES = rb"\]\x94(?:\((?:" + _REF + rb")+e|(?:" + _REF + rb")a)*"
_VALUE = b"|".join((_REF, _INT, _STR, _FRAMES, rb"N|\x88|\x89|G[\s\S]{8}"))
_KEY = _REF + b"|" + _STR
_SPAN = re.compile(rb"\}\x94\((?:(?:" + _KEY + rb")(?:" + _VALUE + rb"))+u")
_PAIR = re.compile(rb"(" + _KEY + rb")(" + _VALUE + rb")")


def read_stream(read, name: str, limit: int) -> Any:
    """The object a protocol 2-5 pickle read through ``read(n)`` holds, its event lists as :class:`Trace`.

    Raises:
        SnapshotError: a class reference, a truncated or broken pickle, more than ``limit`` bytes.
        Fallback: the file needs the plain unpickler (an event shared by reference).
    """
    return _Machine(read, name, limit).run()


class _Machine:
    """The pickle machine: a stack, marks, the memo, and a buffer refilled from the file."""

    def __init__(self, read, name: str, limit: int):
        self.read, self.name, self.limit = read, name, limit
        self.buf = b""
        self.base = 0  # file offset of buf[0]
        self.eof = False
        self.memo: List[Any] = []
        self.strings: Dict[str, str] = {}  # equal strings share one object (torch writes "N/A" afresh per event)
        self.frames: List[Any] = []  # every device's stacks, each once
        self.frames_of_run: Dict[bytes, int] = {}
        self.frames_of_obj: Dict[int, int] = {}
        self.frames_of_ref: Dict[bytes, int] = {}  # a reference's bytes -> frames index (shared lists)
        self.pending: Optional[int] = None  # memo slot of an event going the general way
        # Memo slots never change once written, so a reference's bytes always mean the same object.
        self.refs: Dict[bytes, Any] = {}
        self.strtok: Dict[bytes, str] = {}  # a short string's bytes -> the one str (torch repeats "N/A")
        self.templates: Dict[tuple, "_Template"] = {}
        self.recent: Optional["_Template"] = None

    # -- the buffer -----------------------------------------------------------------------------
    def more(self, pos: int, need: int) -> int:
        """Refill so that ``need`` bytes from ``pos`` are in ``self.buf`` where the file has them; the new ``pos``."""
        buf = self.buf[pos:]
        self.base += pos
        parts = [buf]
        have = len(buf)
        while have < need and not self.eof:
            data = self.read(max(CHUNK, need - have))
            if not data:
                self.eof = True
                break
            parts.append(data)
            have += len(data)
            if self.base + have > self.limit:
                raise SnapshotError(f"{self.name} is over the limit of {self.limit} bytes of pickle "
                                    f"(pass max_bytes= to read it)")
        self.buf = b"".join(parts) if len(parts) > 1 else buf
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
        try:
            obj = self.memo[index]
        except IndexError:
            raise self.bad(pos, f"memo entry {index} is missing") from None
        if obj is _EVENT:
            raise Fallback()
        return obj

    # -- the machine ----------------------------------------------------------------------------
    def run(self) -> Any:
        pos = self.more(0, MARGIN)
        buf = self.buf
        if len(buf) < 2 or buf[0] != 0x80 or not 2 <= buf[1] <= 5:
            raise self.bad(0, "not a protocol 2-5 pickle")
        pos = 2
        stack: List[Any] = []
        marks: List[List[Any]] = []
        memo = self.memo
        while True:
            if len(buf) - pos < MARGIN and not self.eof:
                pos = self.more(pos, MARGIN)
                buf = self.buf
            try:
                op = buf[pos]
            except IndexError:
                raise self.truncated(pos) from None
            if op == 0x7D and marks and type(marks[-1][-1]) is Trace and len(stack) <= 1:  # an event
                trace = marks[-1][-1]
                if stack:
                    self.add(trace, stack.pop())
                end = self.event(trace, buf, pos)
                if end > 0:
                    pos = end
                    continue
                self.pending = len(memo) if buf[pos + 1:pos + 2] == b"\x94" else None
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
        if slot is not None and slot < len(self.memo) and self.memo[slot] is item:
            self.memo[slot] = _EVENT

    def arg(self, pos: int, n: int) -> bytes:
        """``n`` bytes of argument from ``pos`` (refilling for a long one)."""
        if pos + n > len(self.buf):
            raise _Short(pos, n)
        return self.buf[pos:pos + n]

    def step(self, op: int, buf: bytes, pos: int, stack: list, marks: list) -> int:
        """Run the opcode at ``pos``; the position after it, or -1 at STOP."""
        memo = self.memo
        if op == 0x68:  # BINGET
            stack.append(self.get(buf[pos + 1], pos))
            return pos + 2
        if op == 0x6A:  # LONG_BINGET
            stack.append(self.get(int.from_bytes(self.arg(pos + 1, 4), "little"), pos))
            return pos + 5
        if op == 0x94:  # MEMOIZE
            obj = stack[-1]
            memo.append(self.intern(obj) if type(obj) is str else obj)
            return pos + 1
        if op == 0x8C:  # SHORT_BINUNICODE
            n = buf[pos + 1]
            stack.append(self.text(pos + 2, n))
            return pos + 2 + n
        if op == 0x4B:  # BININT1
            stack.append(buf[pos + 1])
            return pos + 2
        if op == 0x4D:  # BININT2
            stack.append(int.from_bytes(self.arg(pos + 1, 2), "little"))
            return pos + 3
        if op == 0x4A:  # BININT
            stack.append(int.from_bytes(self.arg(pos + 1, 4), "little", signed=True))
            return pos + 5
        if op == 0x8A:  # LONG1
            n = buf[pos + 1]
            stack.append(int.from_bytes(self.arg(pos + 2, n), "little", signed=True))
            return pos + 2 + n
        if op == 0x28:  # MARK
            marks.append(stack[:])
            stack.clear()
            return pos + 1
        if op == 0x7D:  # EMPTY_DICT
            stack.append({})
            return pos + 1
        if op == 0x5D:  # EMPTY_LIST
            stack.append(self.new_list(stack, marks))
            return pos + 1
        if op == 0x75:  # SETITEMS
            items = self.pop_mark(stack, marks)
            target = stack[-1]
            for i in range(0, len(items) - 1, 2):
                target[items[i]] = items[i + 1]
            return pos + 1
        if op == 0x73:  # SETITEM
            value = stack.pop()
            key = stack.pop()
            stack[-1][key] = value
            return pos + 1
        if op == 0x65:  # APPENDS
            items = self.pop_mark(stack, marks)
            self.extend(stack[-1], items)
            return pos + 1
        if op == 0x61:  # APPEND
            item = stack.pop()
            self.extend(stack[-1], [item])
            return pos + 1
        if op == 0x95:  # FRAME: frames end on opcode boundaries, so the bytes read on as one stream
            self.arg(pos + 1, 8)
            return pos + 9
        if op == 0x71:  # BINPUT
            self.put(buf[pos + 1], stack[-1])
            return pos + 2
        if op == 0x72:  # LONG_BINPUT
            self.put(int.from_bytes(self.arg(pos + 1, 4), "little"), stack[-1])
            return pos + 5
        if op == 0x58:  # BINUNICODE
            n = int.from_bytes(self.arg(pos + 1, 4), "little")
            stack.append(self.text(pos + 5, n))
            return pos + 5 + n
        if op == 0x8D:  # BINUNICODE8
            n = int.from_bytes(self.arg(pos + 1, 8), "little")
            stack.append(self.text(pos + 9, n))
            return pos + 9 + n
        if op == 0x4E:  # NONE
            stack.append(None)
            return pos + 1
        if op == 0x88 or op == 0x89:  # NEWTRUE, NEWFALSE
            stack.append(op == 0x88)
            return pos + 1
        if op == 0x47:  # BINFLOAT
            stack.append(_FLOAT.unpack(self.arg(pos + 1, 8))[0])
            return pos + 9
        if op == 0x8B:  # LONG4
            n = int.from_bytes(self.arg(pos + 1, 4), "little", signed=True)
            if n < 0:
                raise self.bad(pos, "LONG4 with a negative length")
            stack.append(int.from_bytes(self.long_arg(pos + 5, n), "little", signed=True))
            return pos + 5 + n
        if op in (0x43, 0x42, 0x8E, 0x96):  # SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8
            width = {0x43: 1, 0x42: 4, 0x8E: 8, 0x96: 8}[op]
            n = int.from_bytes(self.arg(pos + 1, width), "little")
            data = self.long_arg(pos + 1 + width, n)
            stack.append(bytearray(data) if op == 0x96 else data)
            return pos + 1 + width + n
        if op == 0x29:  # EMPTY_TUPLE
            stack.append(())
            return pos + 1
        if op in (0x85, 0x86, 0x87):  # TUPLE1..3
            n = op - 0x84
            if len(stack) < n:
                raise IndexError
            items = tuple(stack[-n:])
            del stack[-n:]
            stack.append(items)
            return pos + 1
        if op == 0x74:  # TUPLE
            stack.append(tuple(self.pop_mark(stack, marks)))
            return pos + 1
        if op == 0x6C:  # LIST
            stack.append(list(self.pop_mark(stack, marks)))
            return pos + 1
        if op == 0x64:  # DICT
            items = self.pop_mark(stack, marks)
            stack.append({items[i]: items[i + 1] for i in range(0, len(items) - 1, 2)})
            return pos + 1
        if op == 0x8F:  # EMPTY_SET
            stack.append(set())
            return pos + 1
        if op == 0x90:  # ADDITEMS
            items = self.pop_mark(stack, marks)
            stack[-1].update(items)
            return pos + 1
        if op == 0x91:  # FROZENSET
            stack.append(frozenset(self.pop_mark(stack, marks)))
            return pos + 1
        if op == 0x30:  # POP
            if stack:
                stack.pop()
            else:
                self.pop_mark(stack, marks)
            return pos + 1
        if op == 0x31:  # POP_MARK
            self.pop_mark(stack, marks)
            return pos + 1
        if op == 0x32:  # DUP
            stack.append(stack[-1])
            return pos + 1
        if op == 0x98:  # READONLY_BUFFER: a no-op on in-band data
            return pos + 1
        if op == 0x80:  # PROTO (again)
            return pos + 2
        if op == 0x2E:  # STOP
            if len(stack) != 1 or marks:
                raise self.bad(pos, "STOP with an unfinished stack")
            return -1
        raise self.refused(op, buf, pos, stack)

    def refused(self, op: int, buf: bytes, pos: int, stack: list) -> SnapshotError:
        """The one-line error for an opcode that would build an object, or one this reader does not know."""
        if op == 0x93 and len(stack) >= 2:  # STACK_GLOBAL
            return SnapshotError(f"not a memory snapshot: it refers to {stack[-2]}.{stack[-1]} (only plain data is read)")
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
        try:
            return str(self.long_arg(pos, n), "utf-8", "surrogatepass")
        except UnicodeDecodeError:
            raise self.bad(pos, "a string that is not UTF-8") from None

    def long_arg(self, pos: int, n: int) -> bytes:
        if pos + n > len(self.buf):
            if n > self.limit:
                raise self.bad(pos, f"an argument of {n} bytes")
            shift = pos - self.more(pos, n)  # the buffer now starts at ``pos``
            pos -= shift
            if pos + n > len(self.buf):
                raise self.truncated(len(self.buf))
            # Callers return positions relative to the old buffer: keep ``pos`` where it was by
            # putting back as many bytes in front (the old buffer's prefix is not needed again).
            self.buf = b"\0" * shift + self.buf
            self.base -= shift
            pos += shift
        return self.buf[pos:pos + n]

    def put(self, index: int, obj: Any) -> None:
        memo = self.memo
        if type(obj) is str:
            obj = self.intern(obj)
        if index == len(memo):
            memo.append(obj)
        elif index < len(memo):
            memo[index] = obj
        else:  # protocol 2/3 number the memo themselves: fill any gap
            memo.extend([None] * (index - len(memo)))
            memo.append(obj)

    def pop_mark(self, stack: list, marks: list) -> list:
        items = stack[:]
        stack[:] = marks.pop()
        return items

    def new_list(self, stack: list, marks: list):
        """A plain list, or the ``device_traces`` list and each device's trace inside it."""
        top = marks[-1][-1] if marks and marks[-1] else None
        if type(top) is _Traces or (stack and type(stack[-1]) is _Traces):
            return Trace(self.frames)
        if stack and stack[-1] == "device_traces" and type(stack[-1]) is str:
            at_top = (len(marks) == 1 and len(marks[0]) == 1 and type(marks[0][0]) is dict and len(stack) % 2 == 1) \
                or (not marks and len(stack) == 2 and type(stack[0]) is dict)
            if at_top:
                return _Traces()
        return []

    def extend(self, target: Any, items: list) -> None:
        if type(target) is Trace:
            for item in items:
                self.add(target, item)
        else:
            target.extend(items)

    # -- the fast path: one event in two regex calls --------------------------------------------
    def event(self, trace: Trace, buf: bytes, pos: int) -> int:
        """Read the event at ``pos`` into ``trace``'s columns; its end, or -1 to read it the general way."""
        tpl = self.recent
        if tpl is not None:
            m = tpl.regex.match(buf, pos)
            if m is not None and tpl.handle(self, trace, m.groups(), len(self.memo)):
                return m.end()
        m = _SPAN.match(buf, pos)
        if m is None:
            return -1
        end = m.end()
        pairs = _PAIR.findall(buf, pos + 3, end - 1)
        ktoks = tuple(k for k, _v in pairs)
        tpl = self.templates.get(ktoks)
        if tpl is None and all(k[0] != 0x8C for k in ktoks) and len(self.templates) < 64:
            keys = [self.token(k, [], len(self.memo)) for k in ktoks]
            if all(type(k) is str for k in keys) and len(set(keys)) == len(keys):
                tpl = self.templates[ktoks] = _Template(ktoks, tuple(keys))
        if tpl is not None:
            m = tpl.regex.match(buf, pos)
            if m is not None and tpl.handle(self, trace, m.groups(), len(self.memo)):
                self.recent = tpl
                return m.end()
        return self.generic_event(trace, pairs, end)

    def generic_event(self, trace: Trace, pairs: list, end: int) -> int:
        """An event of the common shape whose keys are not all memo references yet (the first ones of a file)."""
        memo = self.memo
        base = len(memo)
        new: List[Any] = [_EVENT]
        keys: List[str] = []
        others: list = []
        action = None
        addr = size = 0
        t = NO_TIME
        fid = -1
        for ktok, vtok in pairs:
            key = self.token(ktok, new, base)
            if ktok[0] == 0x8C:
                new.append(key)
            if type(key) is not str:
                return -1
            keys.append(key)
            if key == "frames":
                fid = self.frames_token(vtok, new, base)
                if fid < 0:
                    return -1
                continue
            value = self.token(vtok, new, base)
            if vtok[0] == 0x8C:
                new.append(value)
            if key == "action":
                action = value
            elif key == "addr":
                addr = value
            elif key == "size":
                size = value
            elif key == "time_us":
                t = value
            else:
                others.append((key, value))
        if not (type(addr) is int and type(size) is int and type(t) is int):
            return -1
        code = trace.action_code(action)
        if code is None:
            return -1
        try:
            extra = trace.extra_id(tuple(keys), tuple(others))
        except TypeError:
            return -1
        memo.extend(new)
        trace.append_row(code, addr, size, t, fid, extra)
        return end

    def token(self, tok: bytes, new: list, base: int) -> Any:
        """The value of one fast-path token (a short string's memo entry is the caller's to add to ``new``)."""
        c = tok[0]
        if c == 0x68 or c == 0x6A:
            index = tok[1] if c == 0x68 else int.from_bytes(tok[1:], "little")
            if index < base:
                obj = self.memo[index]
                if obj is not _EVENT:
                    self.refs[tok] = obj
            elif index - base < len(new):
                obj = new[index - base]
            else:
                return _EVENT  # a reference past the memo: the general way says why
            if obj is _EVENT:
                raise Fallback()
            return obj
        if c == 0x8A:
            return int.from_bytes(tok[2:], "little", signed=True)
        if c == 0x4A:
            return int.from_bytes(tok[1:], "little", signed=True)
        if c == 0x4B:
            return tok[1]
        if c == 0x4D:
            return tok[1] | tok[2] << 8
        if c == 0x8C:
            s = self.strtok.get(tok)
            if s is None:
                try:
                    s = self.strtok[tok] = self.intern(str(tok[2:-1], "utf-8", "surrogatepass"))
                except UnicodeDecodeError:
                    return _EVENT  # not a str: the general way says why
            return s
        if c == 0x4E:
            return None
        if c == 0x88 or c == 0x89:
            return c == 0x88
        if c == 0x47:
            return _FLOAT.unpack(tok[1:])[0]
        return _EVENT  # a list where a plain value was expected: not the common shape

    def frames_token(self, tok: bytes, new: list, base: int) -> int:
        """The frames index of an event's ``frames`` value: a list of memo references, or a reference to one."""
        if tok[0] != 0x5D:
            obj = self.token(tok, new, base)
            if obj is _EVENT or not isinstance(obj, (list, tuple)):
                return -1
            fid = self.frames_of_obj.get(id(obj))
            if fid is None or self.frames[fid] is not obj:
                fid = self.frames_of_obj[id(obj)] = len(self.frames)
                self.frames.append(obj)
            if tok in self.refs:  # a settled memo slot: the same bytes mean the same frames from now on
                self.frames_of_ref[tok] = fid
            return fid
        run = tok[2:]
        fid = self.frames_of_run.get(run)
        if fid is None:
            stack = self.unpack_run(run, new, base)
            fid = self.frames_of_run[run] = len(self.frames)
            self.frames.append(stack)
            self.frames_of_obj[id(stack)] = fid
        new.append(self.frames[fid])
        return fid

    def unpack_run(self, run: bytes, new: list, base: int) -> tuple:
        out = []
        i, n = 0, len(run)
        while i < n:
            c = run[i]
            if c == 0x68:
                out.append(self.token(run[i:i + 2], new, base))
                i += 2
            elif c == 0x6A:
                out.append(self.token(run[i:i + 5], new, base))
                i += 5
            else:  # MARK, APPENDS, APPEND between batches
                i += 1
        return tuple(out)


class _Short(IndexError):
    """An argument runs past the buffer (handled as truncation or refilled by ``long_arg``)."""


class _Template:
    """The regex and the straight-line reader of one event shape: its keys, in order, as memo references.

    Torch writes every event of a kind with the same keys, so after the first few events each one
    is a single ``match`` and a few lines of generated Python, with no loop over its keys.
    """

    def __init__(self, ktoks: tuple, keys: tuple):
        self.keys = keys
        self.regex = re.compile(rb"\}\x94\(" + b"".join(re.escape(k) + rb"(" + _VALUE + rb")" for k in ktoks) + rb"u")
        self.xids: Dict[tuple, int] = {}
        space = {"_EVENT": _EVENT, "NO_TIME": NO_TIME, "_from": int.from_bytes, "KEYS": keys}
        exec(compile(self.source(keys), "<snapshot event template>", "exec"), space)
        self.handle = space["handle"]

    @staticmethod
    def source(keys: tuple) -> str:
        out = ["def handle(self, trace, g, base, xids={}):",
               "    new = [_EVENT]",
               "    refs = self.refs",
               "    addr = size = 0",
               "    t = NO_TIME",
               "    fid = -1",
               "    action = None"]
        others = []
        for i, key in enumerate(keys):
            v = f"v{i}"
            out.append(f"    {v} = g[{i}]")
            if key == "frames":
                out += [f"    if {v}[0] == 0x5D:",
                        f"        fid = self.frames_of_run.get({v}[2:])",
                        "        if fid is not None:",
                        "            new.append(self.frames[fid])",
                        "    else:",
                        f"        fid = self.frames_of_ref.get({v})",
                        "    if fid is None:",
                        f"        fid = self.frames_token({v}, new, base)",
                        "        if fid < 0:",
                        "            return False"]
                continue
            name = {"addr": "addr", "size": "size", "time_us": "t"}.get(key)
            if name is not None:
                out += [f"    c = {v}[0]",
                        f"    if c == 0x8A:\n        {name} = _from({v}[2:], 'little', signed=True)",
                        f"    elif c == 0x4A:\n        {name} = _from({v}[1:], 'little', signed=True)",
                        f"    elif c == 0x4B:\n        {name} = {v}[1]",
                        f"    elif c == 0x4D:\n        {name} = {v}[1] | {v}[2] << 8",
                        "    else:\n        return False"]
                continue
            name = "action" if key == "action" else f"x{i}"
            if key != "action":
                others.append((key, name))
            out += [f"    if {v}[0] == 0x8C:",
                    f"        {name} = self.strtok.get({v}) or self.token({v}, new, base)",
                    f"        new.append({name})",
                    "    else:",
                    f"        {name} = refs.get({v})",
                    f"        if {name} is None:",
                    f"            {name} = self.token({v}, new, base)",
                    f"    if {name} is _EVENT:",
                    "        return False"]
        values = "(" + "".join(f"{n}, " for _k, n in others) + ")"
        pairs = "(" + "".join(f"({k!r}, {n}), " for k, n in others) + ")"
        out += ["    code = trace._action_code.get(action)",
                "    if code is None:",
                "        code = trace.action_code(action)",
                "        if code is None:",
                "            return False",
                "    try:",
                f"        xk = (trace, {values})",
                "        xid = xids.get(xk)",
                "        if xid is None:",
                f"            xid = xids[xk] = trace.extra_id(KEYS, {pairs})",
                "    except TypeError:",
                "        return False",
                "    self.memo.extend(new)",
                "    trace.act.append(code)",
                "    trace.addr.append(addr)",
                "    trace.size.append(size)",
                "    trace.time.append(t)",
                "    trace.frame.append(fid)",
                "    trace.extra.append(xid)",
                "    return True"]
        return "\n".join(out) + "\n"
