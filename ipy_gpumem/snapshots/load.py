"""Read a snapshot file (a pickle or JSON, gzipped or not) into plain data, bounded by the file, and say in one line why one cannot be read."""
from __future__ import annotations

import io
import json
import os
import pickle
import stat
import zlib
from typing import Any, Dict, Optional, Union

from .stream import SnapshotError  # defined with the reader that raises it most; named here as before

__all__ = ["SnapshotError", "load_snapshot", "MAX_BYTES", "MAX_RATIO", "MAX_JSON", "JSON_RATIO"]

#: Snapshots above this many bytes of pickle are refused (for a gzipped file: bytes once
#: uncompressed, counted as they stream). The streaming reader holds tens of bytes per event, not
#: the file (benchmarks/RESULTS.md section 13), so the limit only stops a runaway file.
#: ``snapshot(path, max_bytes=...)`` lifts it.
MAX_BYTES = 16 << 30
#: A gzipped file may unpack to this many times the compressed bytes read so far (plus
#: :data:`RATIO_SLACK`): real snapshots unpack 5-36 times; a gzip bomb, a thousand.
MAX_RATIO, RATIO_SLACK = 64, 256 << 10
#: JSON snapshots are read whole (then their events become columns): at most this much text, which
#: unpacks from gzip up to :data:`JSON_RATIO` times (JSON writes every stack out again: 50-100x).
MAX_JSON, JSON_RATIO = 64 << 20, 256
_GZIP_STEP = 4 << 10  # compressed bytes fed at a time, so the ratio is checked as the file unpacks
_UNPACK_STEP = 64 << 10  # bytes unpacked at a time, likewise


class _PlainData(pickle.Unpickler):
    """An unpickler that builds only dicts, lists, tuples, strings and numbers (kept for comparing: the
    streaming reader reads every file; it also bounds what a file may cost, which this one does not)."""

    def find_class(self, module, name):  # noqa: D401 - pickle's hook
        raise SnapshotError(f"not a memory snapshot: it refers to {module}.{name} (only plain data is read)")

    def persistent_load(self, pid):
        raise SnapshotError("not a memory snapshot: it uses persistent ids (only plain data is read)")


class _Gunzip:
    """A gzip stream unpacked as it is read, refused once it unpacks to more than :data:`MAX_RATIO` times what it took."""

    def __init__(self, raw, name: str):
        self.raw, self.name = raw, name
        self.unpack = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self.taken = 0  # compressed bytes fed
        self.given = 0  # bytes unpacked
        self.pending = b""  # compressed bytes not yet fed
        self.done = False
        self.ratio = MAX_RATIO

    def read(self, n: int) -> bytes:
        out = []
        have = 0
        while have < n and not self.done:
            step = min(n - have, _UNPACK_STEP)
            if self.unpack.unconsumed_tail:
                data = self.unpack.decompress(self.unpack.unconsumed_tail, step)
            else:
                chunk = self.pending or self.raw.read(_GZIP_STEP)
                self.pending = b""
                if not chunk:
                    if not self.unpack.eof:
                        raise SnapshotError(f"cannot read {self.name}: the gzip stream ends early (truncated?)")
                    self.done = True
                    break
                self.taken += len(chunk)
                data = self.unpack.decompress(chunk, step)
            if self.unpack.eof:  # a member ends: another may follow (gzip files can be concatenated)
                rest = self.unpack.unused_data
                if rest[:2] == b"\x1f\x8b" or (not rest and self.raw.peek(2)[:2] == b"\x1f\x8b"):
                    self.pending = rest
                    self.unpack = zlib.decompressobj(16 + zlib.MAX_WBITS)
                elif not self.unpack.unconsumed_tail:
                    self.done = True
            self.given += len(data)
            if self.given > self.ratio * self.taken + RATIO_SLACK:
                raise SnapshotError(f"{self.name} unpacks to more than {self.ratio} times its size (a gzip bomb?): "
                                    f"gunzip it first to read it")
            out.append(data)
            have += len(data)
        return b"".join(out)


def _open_regular(path: str):
    """The file at ``path``, opened without blocking and only if it is a regular file (a FIFO or a device is refused at once)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise SnapshotError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise SnapshotError(f"{path} is a folder, not a snapshot file")
        if not stat.S_ISREG(info.st_mode):
            what = "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a socket" if stat.S_ISSOCK(info.st_mode) \
                else "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) else "not a regular file"
            raise SnapshotError(f"{path} is {what}, not a snapshot file (only regular files are read)")
        return io.BufferedReader(io.FileIO(fd, "rb", closefd=True), 1 << 20), info.st_size
    except BaseException:
        os.close(fd)
        raise


def _frames_key(frames: Any) -> Optional[tuple]:
    try:
        return tuple(tuple(f.items()) for f in frames)
    except (AttributeError, TypeError):
        return None


def _from_json(data: Any, name: str) -> Any:
    """A JSON snapshot's data as the pickle reader gives it: each device's events as a :class:`~.trace.Trace`,
    equal stacks shared (JSON writes each one out again)."""
    from .trace import Trace

    if not isinstance(data, dict) or not isinstance(data.get("device_traces"), list):
        return data  # a list of segments, or not a snapshot: parse() says which
    stacks: Dict[tuple, Any] = {}
    traces = []
    for events in data["device_traces"]:
        if not isinstance(events, list):
            traces.append(events)
            continue
        for e in events:
            frames = e.get("frames") if isinstance(e, dict) else None
            if isinstance(frames, list):
                key = _frames_key(frames)
                if key is not None:
                    e["frames"] = stacks.setdefault(key, frames)
        traces.append(Trace.from_events(events))
        events.clear()  # the dicts go as the columns fill
    data["device_traces"] = traces
    return data


def _read_json(stream, name: str, max_bytes: int) -> Any:
    limit = min(max_bytes, MAX_JSON)
    if isinstance(getattr(stream, "stream", None), _Gunzip):
        stream.stream.ratio = JSON_RATIO
    text = stream.read(limit + 1)
    if len(text) > limit:
        if limit < max_bytes:
            raise SnapshotError(f"{name} is a JSON snapshot of more than {MAX_JSON >> 20} MiB, over what is read whole: "
                                f"save it as a pickle to read it (pickle.dump(json.load(src), dst))")
        raise SnapshotError(f"{name} is over the limit of {max_bytes} bytes (pass max_bytes= to read it)")
    try:
        data = json.loads(text)
    except RecursionError:
        raise SnapshotError(f"{name} is not a memory snapshot: its JSON is nested too deep") from None
    except MemoryError:
        raise SnapshotError(f"{name} does not fit in memory once read") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int too long to convert
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SnapshotError(f"{name} is not a readable JSON snapshot ({detail[:120]})") from None
    del text
    return _from_json(data, name)


def _read(reopen, name: str, max_bytes: int, size: Optional[int]) -> Any:
    """Read the stream ``reopen()`` gives from its start: JSON whole, a pickle streamed (events as columns)."""
    from .stream import Fallback, read_stream

    stream = reopen()
    head = stream.peek(64)[:64].lstrip(b" \t\r\n\xef\xbb\xbf") if hasattr(stream, "peek") else b""
    if head[:1] in (b"{", b"["):
        return _read_json(stream, name, max_bytes)
    try:
        return read_stream(stream.read, name, max_bytes, size=size)
    except Fallback:  # an event referred to from another place (never in torch's files): keep events whole
        return read_stream(reopen().read, name, max_bytes, size=size, keep_events=True)
    except MemoryError:
        raise SnapshotError(f"{name} does not fit in memory once read") from None


class _Peeking:
    """A read(n) stream with peek(), for the gzip stream (JSON is told from a pickle by its first bytes)."""

    def __init__(self, stream):
        self.stream, self.head = stream, b""

    def peek(self, n: int) -> bytes:
        if len(self.head) < n:
            self.head += self.stream.read(n - len(self.head))
        return self.head

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            parts = [self.head]
            while True:
                data = self.stream.read(1 << 20)
                if not data:
                    break
                parts.append(data)
            self.head = b""
            return b"".join(parts)
        if self.head:
            out, self.head = self.head[:n], self.head[n:]
            return out + (self.stream.read(n - len(out)) if len(out) < n else b"")
        return self.stream.read(n)


def load_snapshot(source: Union[str, os.PathLike, bytes, bytearray, dict, list], *, max_bytes: int = MAX_BYTES) -> Any:
    """The plain data of ``source``: a path to a pickle or JSON snapshot (gzipped or not), its bytes, or the object itself.

    ``torch.cuda.memory._snapshot()`` returns a dict and ``torch.cuda.memory_snapshot()`` a list of
    segments; both are returned as they are (nothing is copied). A pickle is streamed: each
    device's events come back as a :class:`~.trace.Trace` (columns), never as a dict per event. A
    JSON file (``json.dump`` of what ``_snapshot()`` returns) is read whole, then its events become
    columns. Only regular files are read.

    Raises:
        SnapshotError: missing file, not a regular file, not a snapshot, a class reference, too large,
            or a file that would cost more than its bounds (a gzip bomb, crafted memo references).
    """
    if isinstance(source, (dict, list)):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) > max_bytes:
            raise SnapshotError(f"the snapshot is {len(source)} bytes, over the limit of {max_bytes}")
        data = bytes(source)
        return _read(lambda: io.BufferedReader(io.BytesIO(data)), "the bytes given", max_bytes, len(data))
    if not isinstance(source, (str, os.PathLike)):
        raise SnapshotError(f"a snapshot is a path, bytes or the dict torch.cuda.memory._snapshot() returns, "
                            f"not {type(source).__name__}")
    path = os.path.expanduser(os.fspath(source))
    name = os.path.basename(path)
    stream, size = _open_regular(path)
    with stream:
        try:
            gzipped = stream.peek(2)[:2] == b"\x1f\x8b"  # gzip: snapshots are often kept compressed
            if not gzipped and size > max_bytes:  # a gzipped file is counted as it unpacks
                raise SnapshotError(f"{path} is {size} bytes, over the limit of {max_bytes} (pass max_bytes= to read it)")

            def reopen():
                stream.seek(0)
                return _Peeking(_Gunzip(stream, name)) if gzipped else stream

            return _read(reopen, name, max_bytes, None if gzipped else size)
        except (OSError, EOFError, zlib.error) as exc:
            raise SnapshotError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
