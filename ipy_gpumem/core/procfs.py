"""Read a small /proc file of this process while holding the GIL: a cell's end must not hand the GIL to other threads.

``os.pread`` lets go of the GIL around the call, as every blocking read should. A read of
``/proc/self/statm`` does not block (the kernel formats a few numbers, about a microsecond), but
letting go of the GIL there hands it to whatever thread waits for it, in the middle of our hook:
in IPython that is the history thread, woken by every cell to write it to sqlite. In a shell that
runs cells back to back (``%run``, a script driving ``run_cell``, nbclient) the main thread
otherwise keeps the GIL and the history thread writes a batch of cells every switch interval; our
read made it write one transaction per cell instead, and each cell paid the GIL's round trip and
the caches the writer evicted: 0.2-0.4 ms of the main thread's CPU time per cell for a 1 us read
(benchmarks/RESULTS.md, section 1c). :class:`HeldRead` calls libc's ``pread`` through
``ctypes.PyDLL``, which keeps the GIL, once ctypes is loaded (torch loads it; nothing here imports
it), and ``os.pread`` until then or where libc has no ``pread``.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Optional

__all__ = ["HeldRead"]


class HeldRead:
    """``read(fd) -> bytes``: the first ``size`` bytes of a small /proc file, the GIL held throughout.

    Raises ``OSError`` as ``os.pread`` does. A file longer than ``size`` is read whole with
    ``os.pread`` (up to ``most`` bytes): the held read is for the short answers asked after every cell.
    """

    def __init__(self, size: int = 128, most: Optional[int] = None):
        self.size = size
        self.most = size if most is None else most
        self._call = None  # (libc's pread, a buffer of ``size`` bytes, size and 0 as C values, ctypes.get_errno)
        self._tried = False
        # The buffer is shared by the threads that read (the live chart's sampler reads host RSS too);
        # never waited for: a read that finds it taken makes its own syscall.
        self._lock = threading.Lock()

    def __call__(self, fd: int) -> bytes:
        call = self._call
        if call is None:
            if self._tried or "ctypes" not in sys.modules:
                return os.pread(fd, self.most, 0)
            call = self._prepare()
            if call is None:
                return os.pread(fd, self.most, 0)
        pread, buffer, c_size, c_zero, get_errno = call
        size = self.size
        lock = self._lock
        if not lock.acquire(False):  # another thread's read (or a fork taken during one): its own syscall
            return os.pread(fd, self.most, 0)
        try:
            count = pread(fd, buffer, c_size, c_zero)
            data = buffer.raw[:count] if count > 0 else b""
        finally:
            lock.release()
        if count < 0:
            errno = get_errno()
            raise OSError(errno, os.strerror(errno))
        if count >= size and self.most > size:
            return os.pread(fd, self.most, 0)  # a long answer: read whole, as os.pread would
        return data

    def _prepare(self):
        self._tried = True
        try:
            ctypes = sys.modules["ctypes"]
            libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL is held during the call
            pread = libc.pread
            pread.restype = ctypes.c_ssize_t
            # No argtypes (converting through them costs more than the read): the size and the offset
            # are made once as the C types pread takes, the descriptor is a C int, the buffer a pointer.
            self._call = (pread, ctypes.create_string_buffer(self.size), ctypes.c_size_t(self.size), ctypes.c_long(0),
                          ctypes.get_errno)
        except Exception:  # noqa: BLE001 - no libc pread (not glibc/musl): os.pread, GIL released
            self._call = None
        return self._call
