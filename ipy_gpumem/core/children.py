"""Read the processes this process started, from outside them: who they are and what memory they use.

A probe like the others (``probes``): cheap reads, unavailability is a value. On Linux the children
come from ``/proc/<pid>/task/<tid>/children`` (each thread's direct children, a few microseconds a
thread) and each child's memory from ``/proc/<pid>/status`` (``VmRSS`` and the high-water mark
``VmHWM``, which the kernel keeps for the whole life of the process, so the peak read from outside
is exact up to the last reading); psutil elsewhere. A child's identity is read once: its command
line and, for a distributed worker, torch.distributed's ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``
from its environment (``/proc/<pid>/environ``: the environment it was started with). Nothing here
waits for a child, signals one or reaps one: the launcher owns them.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, NamedTuple, Optional

__all__ = ["ChildInfo", "ChildMemory", "MainThreadChildren", "descendants", "child_info", "child_memory", "is_launcher_helper", "is_spawned_worker"]

_PROC = "/proc"
_LINUX = sys.platform.startswith("linux")


class ChildInfo(NamedTuple):
    """Who a process is (read once): its parent, command line and torch.distributed's variables."""

    pid: int
    ppid: Optional[int]
    cmdline: tuple
    rank: Optional[int] = None
    local_rank: Optional[int] = None
    world_size: Optional[int] = None


class ChildMemory(NamedTuple):
    """A process's RSS and its high-water mark now, in bytes (None where unreadable)."""

    rss: Optional[int]
    hwm: Optional[int]


def _children_linux(pid: int) -> List[int]:
    out: List[int] = []
    try:
        tids = os.listdir(f"{_PROC}/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{_PROC}/{pid}/task/{tid}/children", "rb") as fh:
                out.extend(int(p) for p in fh.read().split())
        except (OSError, ValueError):
            continue
    return out


def descendants(pid: Optional[int] = None, psutil_module=None) -> Optional[List[int]]:
    """Every process below ``pid`` (default: this one), parents before their children; None when
    the platform cannot tell (no /proc children files and no psutil)."""
    pid = os.getpid() if pid is None else pid
    if _LINUX and os.path.exists(f"{_PROC}/{pid}/task"):
        out, todo = [], [pid]
        while todo:
            kids = _children_linux(todo.pop(0))
            out.extend(kids)
            todo.extend(kids)
        return out
    try:
        psutil = psutil_module
        if psutil is None:
            import psutil
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 - unknown, not an error
        return None


class MainThreadChildren:
    """This process's main thread's direct children, with one ``pread`` of a file kept open (~2 us).

    The end of every cell asks whether anything is running below the kernel: the main thread is
    where cells (and the launchers they call) fork, so that one file answers it, where a full
    :func:`descendants` walk opens a file per thread. None where it cannot be read (then walk).
    """

    def __init__(self):
        self._pid = None
        self._fd = None

    def read(self) -> Optional[List[int]]:
        pid = os.getpid()
        if self._pid != pid:
            self.close()
            self._pid = pid
            if _LINUX:
                try:
                    self._fd = os.open(f"{_PROC}/{pid}/task/{pid}/children", os.O_RDONLY)
                except OSError:
                    self._fd = None
        if self._fd is None:
            return None
        try:
            return [int(p) for p in os.pread(self._fd, 65536, 0).split()]
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = None


def _int(value) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def child_info(pid: int, psutil_module=None) -> Optional[ChildInfo]:
    """The process's parent, command line and torch.distributed's variables; None once it is gone."""
    env: Dict[str, str] = {}
    try:
        if _LINUX:
            with open(f"{_PROC}/{pid}/cmdline", "rb") as fh:
                cmdline = tuple(a.decode(errors="replace") for a in fh.read().split(b"\0") if a)
            with open(f"{_PROC}/{pid}/stat", "rb") as fh:
                stat = fh.read()
            ppid = _int(stat[stat.rindex(b")") + 2:].split()[1])
            try:
                with open(f"{_PROC}/{pid}/environ", "rb") as fh:
                    for item in fh.read().split(b"\0"):
                        key, _, value = item.partition(b"=")
                        if key in (b"RANK", b"LOCAL_RANK", b"WORLD_SIZE"):
                            env[key.decode()] = value.decode(errors="replace")
            except OSError:
                pass
        else:
            psutil = psutil_module
            if psutil is None:
                import psutil
            proc = psutil.Process(pid)
            cmdline, ppid = tuple(proc.cmdline()), proc.ppid()
            try:
                env = {k: v for k, v in proc.environ().items() if k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
            except Exception:  # noqa: BLE001 - AccessDenied: no variables
                env = {}
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return None
    return ChildInfo(pid, ppid, cmdline, _int(env.get("RANK")), _int(env.get("LOCAL_RANK")),
                     _int(env.get("WORLD_SIZE")))


def child_memory(pid: int, psutil_module=None) -> Optional[ChildMemory]:
    """RSS and high-water mark of ``pid`` now (one read of /proc/<pid>/status); None once it is gone."""
    if _LINUX:
        try:
            with open(f"{_PROC}/{pid}/status", "rb") as fh:
                text = fh.read()
        except OSError:
            return None
        return ChildMemory(_status_kb(text, b"VmRSS:"), _status_kb(text, b"VmHWM:"))
    try:
        psutil = psutil_module
        if psutil is None:
            import psutil
        info = psutil.Process(pid).memory_info()
        return ChildMemory(int(info.rss), getattr(info, "peak_wset", None))
    except Exception:  # noqa: BLE001
        return None


def _status_kb(text: bytes, key: bytes) -> Optional[int]:
    start = text.find(key)
    if start < 0:
        return None  # a zombie has no memory lines
    start += len(key)
    end = text.find(b"kB", start)
    return _int(text[start:end]) * 1024 if end > 0 and _int(text[start:end]) is not None else None


#: multiprocessing's own helper processes: never a rank.
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "multiprocessing.semaphore_tracker")


def is_launcher_helper(info: ChildInfo) -> bool:
    """multiprocessing's resource tracker or fork server: started by a launcher, never a rank."""
    return any(h in arg for arg in info.cmdline for h in _HELPERS)


def is_spawned_worker(info: ChildInfo) -> bool:
    """A process multiprocessing started with ``spawn`` (a fresh interpreter running the launcher's target)."""
    return "--multiprocessing-fork" in info.cmdline
