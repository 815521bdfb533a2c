"""Read the processes this process started, from outside them: who they are and what memory they use.

A probe like the others (``core.probes``): cheap reads, unavailability is a value. On Linux the children
come from ``/proc/<pid>/task/<tid>/children`` (each thread's direct children, a few microseconds a
thread) and each child's memory from ``/proc/<pid>/status`` (``VmRSS`` and the high-water mark
``VmHWM``, which the kernel keeps for the whole life of the process, so the peak read from outside
is exact up to the last reading); psutil elsewhere. A child's identity is read once: its command
line and, for a distributed worker, torch.distributed's ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``
(and elastic's ``TORCHELASTIC_RUN_ID``) from its environment (``/proc/<pid>/environ``: the
environment it was started with; a fork's is its parent's). Values are validated
(:func:`rank_variables`): a rank is a non-negative integer of at most 8 digits, below the world
size when one is given. Nothing here waits for a child, signals one or reaps one: the launcher owns them.
"""
from __future__ import annotations

import os
import re
import sys
import weakref
from typing import Dict, List, Mapping, NamedTuple, Optional

from ..core.procfs import HeldRead

__all__ = ["ChildInfo", "ChildMemory", "RankVariables", "MainThreadChildren", "MAX_WORLD_SIZE", "rank_variables",
           "environment_of", "parse_pids", "descendants", "descendant_tree", "thread_children", "child_info", "child_memory",
           "is_launcher_helper", "is_fresh_program"]

_PROC = "/proc"
_LINUX = sys.platform.startswith("linux")
#: The largest world size believed: ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` beyond it are not ranks.
MAX_WORLD_SIZE = 1 << 24
#: torch.distributed's variables, and elastic's run id (a worker torchrun started has one).
_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
_KEYS_B = tuple(k.encode() for k in _KEYS)
_DIGITS = re.compile(r"[0-9]{1,8}")
#: A process's environment is read up to this many bytes (an environment is a few KiB).
_MAX_ENVIRON = 1 << 20


class RankVariables(NamedTuple):
    """torch.distributed's variables in one environment, validated (None where absent or invalid)."""

    rank: Optional[int] = None
    local_rank: Optional[int] = None
    world_size: Optional[int] = None
    #: ``TORCHELASTIC_RUN_ID`` (set by torchrun and elastic for their workers), at most 200 characters.
    run_id: Optional[str] = None

    @property
    def says_rank(self) -> bool:
        """``RANK`` together with a ``WORLD_SIZE`` it is below: what a launcher sets for a rank."""
        return self.rank is not None and self.world_size is not None


class ChildInfo(NamedTuple):
    """Who a process is (read once): its parent, command line and torch.distributed's variables."""

    pid: int
    ppid: Optional[int]
    cmdline: tuple
    rank: Optional[int] = None
    local_rank: Optional[int] = None
    world_size: Optional[int] = None
    run_id: Optional[str] = None

    @property
    def variables(self) -> RankVariables:
        """The variables of its environment as one value (compared with the kernel's own)."""
        return RankVariables(self.rank, self.local_rank, self.world_size, self.run_id)


class ChildMemory(NamedTuple):
    """A process's RSS and its high-water mark now, in bytes (None where unreadable)."""

    rss: Optional[int]
    hwm: Optional[int]


def _number(value) -> Optional[int]:
    """A non-negative integer written as plain digits (no sign, spaces or underscores), below the cap."""
    if not isinstance(value, str) or not _DIGITS.fullmatch(value):
        return None
    number = int(value)
    return number if number < MAX_WORLD_SIZE else None


def rank_variables(env: Mapping[str, str]) -> RankVariables:
    """torch.distributed's variables from ``env`` (``os.environ`` or the like), validated:
    ``WORLD_SIZE`` from 1 to :data:`MAX_WORLD_SIZE`, ``RANK`` and ``LOCAL_RANK`` non-negative and
    below it when it is given (``RANK=-1`` or a 23-digit ``RANK`` is no rank)."""
    world = _number(env.get("WORLD_SIZE"))
    if world == 0:
        world = None
    rank, local = _number(env.get("RANK")), _number(env.get("LOCAL_RANK"))
    if world is not None:
        rank = rank if rank is not None and rank < world else None
        local = local if local is not None and local < world else None
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if not isinstance(run_id, str) or not run_id or len(run_id) > 200:
        run_id = None
    return RankVariables(rank, local, world, run_id)


def _environ(pid: int) -> Dict[str, str]:
    """The variables of :data:`_KEYS` in ``/proc/<pid>/environ`` (empty when unreadable)."""
    out: Dict[str, str] = {}
    try:
        with open(f"{_PROC}/{pid}/environ", "rb") as fh:
            data = fh.read(_MAX_ENVIRON)
    except OSError:
        return out
    for item in data.split(b"\0"):
        key, _, value = item.partition(b"=")
        if key in _KEYS_B:
            out[key.decode()] = value.decode("utf-8", "replace")
    return out


def environment_of(pid: Optional[int] = None) -> RankVariables:
    """The validated variables ``pid`` (default: this process) was started with; empty where unreadable."""
    pid = os.getpid() if pid is None else pid
    if _LINUX:
        return rank_variables(_environ(pid))
    try:
        import psutil

        return rank_variables(psutil.Process(pid).environ())
    except Exception:  # noqa: BLE001 - unknown, not an error
        return RankVariables()


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


def descendant_tree(pid: Optional[int] = None, psutil_module=None) -> Optional[Dict[int, int]]:
    """Every process below ``pid`` (default: this one) with its parent, parents before their
    children; None when the platform cannot tell (no /proc children files and no psutil)."""
    pid = os.getpid() if pid is None else pid
    if _LINUX and os.path.exists(f"{_PROC}/{pid}/task"):
        out: Dict[int, int] = {}
        todo = [pid]
        while todo:
            parent = todo.pop(0)
            for kid in _children_linux(parent):
                if kid not in out and kid != pid:
                    out[kid] = parent
                    todo.append(kid)
        return out
    try:
        psutil = psutil_module
        if psutil is None:
            import psutil
        out = {}
        for proc in psutil.Process(pid).children(recursive=True):
            try:
                out[proc.pid] = proc.ppid()
            except Exception:  # noqa: BLE001 - gone meanwhile
                continue
        return out
    except Exception:  # noqa: BLE001 - unknown, not an error
        return None


def descendants(pid: Optional[int] = None, psutil_module=None) -> Optional[List[int]]:
    """Every process below ``pid`` (default: this one), parents before their children; None when
    the platform cannot tell (no /proc children files and no psutil)."""
    tree = descendant_tree(pid, psutil_module)
    return None if tree is None else list(tree)


def thread_children() -> Optional[List[int]]:
    """The direct children of the calling thread (a fork lands there): one small /proc read; None
    where it cannot be read."""
    if not _LINUX:
        return None
    try:
        import threading

        with open(f"{_PROC}/{os.getpid()}/task/{threading.get_native_id()}/children", "rb") as fh:
            return [int(p) for p in fh.read().split()]
    except (OSError, ValueError, AttributeError):
        return None


class MainThreadChildren:
    """This process's main thread's direct children, with one ``pread`` of a file kept open (~2 us).

    The end of every cell asks whether anything new is running below the kernel: the main thread is
    where cells (and the launchers they call) start processes, so that one file answers it, where a
    full :func:`descendants` walk opens a file per thread. None where it cannot be read (then walk).
    """

    def __init__(self):
        self._pid = None  # whose children the open file lists (None after a fork: open again)
        self._fd = None
        # Read holding the GIL (``procfs``): usually empty or a few pids; a long list is read whole.
        self._read = HeldRead(256, 65536)
        _FORKED.add(self)
        if not _FORK_HOOK["registered"] and hasattr(os, "register_at_fork"):
            # A fork's child must not read its parent's file: told at the fork, not by a getpid() per read.
            os.register_at_fork(after_in_child=_forget_after_fork)
            _FORK_HOOK["registered"] = True

    def read(self) -> Optional[List[int]]:
        """The pids (None where unreadable)."""
        raw = self.read_bytes()
        return None if raw is None else parse_pids(raw)

    def read_bytes(self) -> Optional[bytes]:
        """The file as read (compared with an earlier reading without parsing it); None where unreadable."""
        if self._pid is None:
            self.close()
            pid = self._pid = os.getpid()
            if _LINUX:
                try:
                    self._fd = os.open(f"{_PROC}/{pid}/task/{pid}/children", os.O_RDONLY)
                except OSError:
                    self._fd = None
        if self._fd is None:
            return None
        try:
            return self._read(self._fd)
        except OSError:
            return None

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = None


# Every MainThreadChildren, forgotten by a fork's child (one at-fork hook per process: it cannot be removed).
_FORKED: "weakref.WeakSet[MainThreadChildren]" = weakref.WeakSet()
_FORK_HOOK = {"registered": False}


def _forget_after_fork() -> None:
    for reader in list(_FORKED):
        reader._pid = None  # the inherited descriptor lists the parent's children: left to the parent


def parse_pids(raw: bytes) -> Optional[List[int]]:
    """The pids of a /proc ``children`` file's bytes (None when they are not pids)."""
    try:
        return [int(p) for p in raw.split()]
    except ValueError:
        return None


def _int(value) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def child_info(pid: int, psutil_module=None) -> Optional[ChildInfo]:
    """The process's parent, command line and validated torch.distributed variables; None once it is gone."""
    try:
        if _LINUX:
            with open(f"{_PROC}/{pid}/cmdline", "rb") as fh:
                cmdline = tuple(a.decode(errors="replace") for a in fh.read(65536).split(b"\0") if a)
            with open(f"{_PROC}/{pid}/stat", "rb") as fh:
                stat = fh.read(4096)
            ppid = _int(stat[stat.rindex(b")") + 2:].split()[1])
            variables = rank_variables(_environ(pid))
        else:
            psutil = psutil_module
            if psutil is None:
                import psutil
            proc = psutil.Process(pid)
            cmdline, ppid = tuple(proc.cmdline()), proc.ppid()
            try:
                variables = rank_variables(proc.environ())
            except Exception:  # noqa: BLE001 - AccessDenied: no variables
                variables = RankVariables()
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return None
    return ChildInfo(pid, ppid, cmdline, *variables)


def is_fresh_program(info: ChildInfo) -> bool:
    """Whether ``info`` is a program of its own (exec'd: a spawned interpreter, a launcher's worker), whose
    whole memory is its own, rather than a copy of this process (forked without exec: same command line).
    Read in the window between a fork and its exec, a fresh program still looks like a copy: the safe side."""
    return bool(info.cmdline) and info.cmdline != _own_cmdline()


_OWN_CMDLINE: Optional[tuple] = None


def _own_cmdline() -> tuple:
    global _OWN_CMDLINE
    if _OWN_CMDLINE is None:
        own = child_info(os.getpid())
        _OWN_CMDLINE = own.cmdline if own is not None else ()
    return _OWN_CMDLINE


def child_memory(pid: int, psutil_module=None) -> Optional[ChildMemory]:
    """RSS and high-water mark of ``pid`` now (one read of /proc/<pid>/status); None once it is gone."""
    if _LINUX:
        try:
            with open(f"{_PROC}/{pid}/status", "rb") as fh:
                text = fh.read(65536)
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
    value = _int(text[start:end]) if end > 0 else None
    return value * 1024 if value is not None else None


#: multiprocessing's own helper processes: never a rank.
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "multiprocessing.semaphore_tracker")


def is_launcher_helper(info: ChildInfo) -> bool:
    """multiprocessing's resource tracker or fork server: started by a launcher, never a rank."""
    return any(h in arg for arg in info.cmdline for h in _HELPERS)
