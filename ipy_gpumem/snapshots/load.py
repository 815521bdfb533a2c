"""Read a snapshot file into plain data with an unpickler that refuses every class, and say in one line why one cannot be read."""
from __future__ import annotations

import gzip
import io
import os
import pickle
import zlib
from typing import Any, Union

from .stream import SnapshotError  # defined with the reader that raises it most; named here as before

__all__ = ["SnapshotError", "load_snapshot", "MAX_BYTES"]

#: Snapshots above this many bytes of pickle are refused (for a gzipped file: bytes once
#: uncompressed, counted as they stream). The streaming reader holds tens of bytes per event, not
#: the file (a 1 GB snapshot reads in well under 1 GiB: benchmarks/RESULTS.md section 13), so the
#: limit only stops a runaway file. ``snapshot(path, max_bytes=...)`` lifts it.
MAX_BYTES = 16 << 30


class _PlainData(pickle.Unpickler):
    """An unpickler that builds only dicts, lists, tuples, strings and numbers.

    A snapshot from torch is plain data, so any class reference in one is either a different file
    or a crafted one: unpickling it could run code, and refusing it costs nothing.
    """

    def find_class(self, module, name):  # noqa: D401 - pickle's hook
        raise SnapshotError(f"not a memory snapshot: it refers to {module}.{name} (only plain data is read)")

    def persistent_load(self, pid):
        raise SnapshotError("not a memory snapshot: it uses persistent ids (only plain data is read)")


def _unpickle(stream, name: str) -> Any:
    try:
        return _PlainData(stream).load()
    except SnapshotError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            UnicodeDecodeError, OverflowError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SnapshotError(f"{name} is not a readable pickle ({detail[:120]})") from None
    except MemoryError:
        raise SnapshotError(f"{name} does not fit in memory once unpickled") from None


class _Limited(io.RawIOBase):
    """A stream that counts what it gives and stops, with a one-line error, past ``limit`` bytes."""

    def __init__(self, raw, limit: int, name: str):
        self.raw, self.limit, self.name, self.count = raw, limit, name, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.raw.readinto(buffer)
        self.count += n or 0
        if self.count > self.limit:
            raise SnapshotError(f"{self.name} is over the limit of {self.limit} bytes of pickle (pass max_bytes= to read it)")
        return n


def _read(opener, name: str, max_bytes: int) -> Any:
    """Stream the pickle ``opener()`` gives (protocol 2-5: events as columns), or unpickle it plainly (protocol 0-1)."""
    from .stream import Fallback, read_stream

    with opener() as raw:
        stream = io.BufferedReader(_Limited(raw, max_bytes, name), 1 << 20)
        head = stream.peek(2)[:2]
        if len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
            try:
                return read_stream(stream.read, name, max_bytes)
            except Fallback:
                pass  # an event shared by reference (never in torch's files): read the plain way below
            except MemoryError:
                raise SnapshotError(f"{name} does not fit in memory once read") from None
        else:  # protocol 0/1 (torch writes 4 or 5) or not a pickle: the C unpickler says which
            return _unpickle(stream, name)
    with opener() as raw:
        return _unpickle(io.BufferedReader(_Limited(raw, max_bytes, name), 1 << 20), name)


def load_snapshot(source: Union[str, os.PathLike, bytes, bytearray, dict, list], *, max_bytes: int = MAX_BYTES) -> Any:
    """The plain data of ``source``: a path to a pickle (gzipped or not), its bytes, or the object itself.

    ``torch.cuda.memory._snapshot()`` returns a dict and ``torch.cuda.memory_snapshot()`` a list of
    segments; both are returned as they are (nothing is copied). A file or bytes are streamed: each
    device's events come back as a :class:`~.trace.Trace` (columns), never as a dict per event.

    Raises:
        SnapshotError: missing file, not a pickle, a class reference, too large.
    """
    if isinstance(source, (dict, list)):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) > max_bytes:
            raise SnapshotError(f"the snapshot is {len(source)} bytes, over the limit of {max_bytes}")
        return _read(lambda: io.BytesIO(source), "the bytes given", max_bytes)
    if not isinstance(source, (str, os.PathLike)):
        raise SnapshotError(f"a snapshot is a path, bytes or the dict torch.cuda.memory._snapshot() returns, "
                            f"not {type(source).__name__}")
    path = os.path.expanduser(os.fspath(source))
    try:
        size = os.path.getsize(path)
    except OSError as exc:
        raise SnapshotError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if os.path.isdir(path):
        raise SnapshotError(f"{path} is a folder, not a snapshot file")
    try:
        with open(path, "rb") as stream:
            gzipped = stream.read(2) == b"\x1f\x8b"  # gzip: snapshots are often kept compressed
        if not gzipped and size > max_bytes:  # a gzipped file is counted as it unpacks
            raise SnapshotError(f"{path} is {size} bytes, over the limit of {max_bytes} (pass max_bytes= to read it)")
        opener = (lambda: gzip.open(path, "rb")) if gzipped else (lambda: open(path, "rb"))
        return _read(opener, os.path.basename(path), max_bytes)
    except (OSError, EOFError, zlib.error) as exc:
        raise SnapshotError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
