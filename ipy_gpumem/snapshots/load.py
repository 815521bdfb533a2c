"""Read a snapshot file into plain data with an unpickler that refuses every class, and say in one line why one cannot be read."""
from __future__ import annotations

import gzip
import io
import os
import pickle
import zlib
from typing import Any, Union

__all__ = ["SnapshotError", "load_snapshot", "MAX_BYTES"]

#: Files above this many bytes are refused before reading (a snapshot of torch's default
#: ``max_entries=100000`` with deep stacks is tens of MB; 2 GiB of pickle needs several times that
#: in memory once unpickled). ``snapshot(path, max_bytes=...)`` lifts it.
MAX_BYTES = 2 << 30


class SnapshotError(ValueError):
    """A snapshot that cannot be read; the message is one line and says why."""


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


def load_snapshot(source: Union[str, os.PathLike, bytes, bytearray, dict, list], *, max_bytes: int = MAX_BYTES) -> Any:
    """The plain data of ``source``: a path to a pickle (gzipped or not), its bytes, or the object itself.

    ``torch.cuda.memory._snapshot()`` returns a dict and ``torch.cuda.memory_snapshot()`` a list of
    segments; both are returned as they are (nothing is copied).

    Raises:
        SnapshotError: missing file, not a pickle, a class reference, too large.
    """
    if isinstance(source, (dict, list)):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) > max_bytes:
            raise SnapshotError(f"the snapshot is {len(source)} bytes, over the limit of {max_bytes}")
        return _unpickle(io.BytesIO(source), "the bytes given")
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
    if size > max_bytes:
        raise SnapshotError(f"{path} is {size} bytes, over the limit of {max_bytes} (pass max_bytes= to read it)")
    try:
        with open(path, "rb") as stream:
            if stream.read(2) == b"\x1f\x8b":  # gzip: snapshots are often kept compressed
                stream.seek(0)
                with gzip.open(stream, "rb") as unzipped:
                    return _unpickle(io.BufferedReader(unzipped, 1 << 20), os.path.basename(path))
            stream.seek(0)
            return _unpickle(io.BufferedReader(stream, 1 << 20), os.path.basename(path))
    except (OSError, EOFError, zlib.error) as exc:
        raise SnapshotError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
