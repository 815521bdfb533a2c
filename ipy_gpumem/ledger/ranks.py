"""The processes a cell launches (the ranks of a distributed launch), found and recorded through what the launchers already use.

Three sources, each the launcher's own:

- **The kernel's children**, read from outside while the cell runs (``core.children``: /proc, a
  few microseconds a reading): a thread polls them every :data:`POLL_S` while a cell runs and the
  cell's end reads them once more, so a cell that launches nothing costs one listing of this
  process's children (about 20 us) and a ``threading.Event`` set. A child's RSS and high-water
  mark come from /proc, its identity from its command line and torch.distributed's ``RANK``,
  ``LOCAL_RANK`` and ``WORLD_SIZE`` in its environment; on a GPU, NVML's per-process list (at
  most once a second, only while children exist) gives its device memory.
- **A fork of the kernel records itself**, the same way the kernel records a cell: multiprocessing
  runs our ``register_after_fork`` callback in every child it forks, and in a child that runs
  torch.multiprocessing's ``_wrap`` (``start_processes``, ``spawn`` with fork, elastic's and
  accelerate's ``notebook_launcher`` through them) it writes its start and, from a
  multiprocessing ``Finalize`` at its exit, its end into the cell's folder (one JSON file per pid
  in a per-cell temporary folder, made by the kernel before the fork and removed at the cell's
  end). Its rank is torch.distributed's when a process group is still up, else ``RANK`` from its
  environment, else the process index the launcher passed.
- **The launcher's exception**: torch.multiprocessing's ``ProcessRaisedException`` (the child's
  traceback) and ``ProcessExitedException`` (its signal), and torch.distributed.elastic's
  ``ChildFailedError`` name the failing rank (:func:`launcher_failure`).

Nothing here waits for, signals or reaps a child, opens a port or starts a process; nothing
initializes CUDA in the kernel. A child that is killed leaves its start and the readings taken
from outside; one that hangs past the cell's end is recorded as still running.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from ..core import children as _children
from ..core.records import DeviceRecord, HostRecord, RankFailure, RankRecord

__all__ = ["RankWatch", "launcher_failure", "POLL_S", "NVML_EVERY_S"]

#: While a cell runs, the children are read this often (a cell shorter than this is read once, at its end).
POLL_S = 0.1
#: NVML's process list is slow (~5 ms a device, the driver's lock): at most this often, only while children exist.
NVML_EVERY_S = 1.0
#: How long the polling thread stays awake after a cell, so back-to-back cells do not wake it each time.
LINGER_S = 2.0
#: Characters of a child's traceback kept for the out-of-memory parser (its message is at the end).
MAX_CHILD_MESSAGE = 8000


class _Shared:
    """What a forked child inherits: the running cell's folder, the kernel's pid, the probes' adapter."""

    dir: Optional[str] = None
    dir_made: bool = False
    kernel_pid: int = -1
    internals: Optional[Callable] = None
    fork_hooks: bool = False
    mp_registered: bool = False


_S = _Shared()


class _Token:
    """A weak-referenceable key for multiprocessing's after-fork registry (kept for the process's life)."""


_TOKEN = _Token()


def _before_fork() -> None:
    # In the kernel, before any fork while a cell runs: the child writes into a folder that exists.
    if _S.dir is not None and not _S.dir_made and os.getpid() == _S.kernel_pid:
        try:
            os.mkdir(_S.dir, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return
        _S.dir_made = True


def _ensure_hooks() -> None:
    if not _S.fork_hooks and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_before_fork)  # cannot be unregistered: it does nothing between cells
        _S.fork_hooks = True
    if not _S.mp_registered:
        util = sys.modules.get("multiprocessing.util")
        if util is not None:
            util.register_after_fork(_TOKEN, _in_forked_child)
            _S.mp_registered = True


# ---------------------------------------------------------------------------------------------
# Inside a forked rank
# ---------------------------------------------------------------------------------------------


def _launcher_index() -> Optional[int]:
    """The process index torch.multiprocessing passed to ``_wrap(fn, i, args, error_file)``; None
    when this multiprocessing child is not one of its ranks (a DataLoader worker, a pool)."""
    import multiprocessing

    proc = multiprocessing.current_process()
    target = getattr(proc, "_target", None)
    if getattr(target, "__name__", None) != "_wrap" or getattr(target, "__module__", None) != "torch.multiprocessing.spawn":
        return None
    args = getattr(proc, "_args", ())
    return args[1] if len(args) > 1 and isinstance(args[1], int) else None


def _in_forked_child(_token) -> None:
    """multiprocessing's after-fork callback, in each child it forks: record a rank of this cell."""
    try:
        folder = _S.dir
        if folder is None or os.getppid() != _S.kernel_pid:
            return  # no cell running, or a grandchild (a rank's own workers)
        index = _launcher_index()
        if index is None:
            return
        recorder = _ChildRecorder(folder, index, _S.internals)
        recorder.begin()
        from multiprocessing import util

        # Runs when the child's bootstrap ends (after the launched function returned or raised).
        util.Finalize(None, recorder.end, exitpriority=-(2 ** 30))
    except Exception:  # noqa: BLE001 - never cost the rank anything
        pass


def _read_self() -> tuple:
    try:
        with open("/proc/self/status", "rb") as fh:
            text = fh.read()
        return _children._status_kb(text, b"VmRSS:"), _children._status_kb(text, b"VmHWM:")
    except OSError:
        from ..core.probes import HostProbe

        probe = HostProbe()
        return probe.rss(), probe.peak_rss()


def _write(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def _int_env(name: str) -> Optional[int]:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


class _ChildRecorder:
    """A forked rank's own record: its start, and at its exit its end, peak and devices."""

    def __init__(self, folder: str, index: int, internals):
        self.folder, self.index, self.internals = folder, index, internals
        self.pid = os.getpid()

    def begin(self) -> None:
        rss, _hwm = _read_self()
        # A fork's high-water mark starts at its RSS at the fork: it measures from here, untouched.
        self.rss_before = rss
        _write(os.path.join(self.folder, f"{self.pid}.start.json"),
               {"pid": self.pid, "index": self.index, "rss_before": rss})

    def end(self) -> None:
        try:
            if os.getpid() != self.pid or not os.path.isdir(self.folder):
                return  # a fork of the rank, or the cell is over
            rss, hwm = _read_self()
            rank, rank_from, world = self.index, "launcher", None
            env_rank = _int_env("RANK")
            if env_rank is not None:
                rank, rank_from = env_rank, "env"
            world = _int_env("WORLD_SIZE")
            dist = sys.modules.get("torch.distributed")
            try:
                if dist is not None and dist.is_available() and dist.is_initialized():
                    rank, rank_from, world = int(dist.get_rank()), "torch.distributed", int(dist.get_world_size())
            except Exception:  # noqa: BLE001
                pass
            devices, note = self._devices()
            _write(os.path.join(self.folder, f"{self.pid}.end.json"), {
                "pid": self.pid, "index": self.index, "rank": rank, "rank_from": rank_from, "world_size": world,
                "local_rank": _int_env("LOCAL_RANK"), "rss_before": self.rss_before, "rss_after": rss,
                "rss_peak": hwm, "devices": devices, "devices_note": note})
        except Exception:  # noqa: BLE001 - never cost the rank its exit
            pass

    def _devices(self) -> tuple:
        """torch's counters on the devices this rank initialized (read as the kernel reads its own)."""
        from ..core.probes import CudaProbe

        try:
            probe = CudaProbe(internals=self.internals)
            samples, reason = probe.sample()
            out = []
            for s in samples:
                try:
                    name = probe.properties(s.index)[0]
                except Exception:  # noqa: BLE001
                    name = None
                # CUDA came up in this process: every counter started at zero with it.
                out.append({"index": s.index, "name": name, "allocated_after": s.allocated,
                            "allocated_peak": s.peak_allocated, "reserved_after": s.reserved,
                            "reserved_peak": s.peak_reserved, "used_after": s.used, "total": s.total})
            return out, (reason if not out else None)
        except Exception as exc:  # noqa: BLE001
            return [], f"CUDA counters unavailable ({type(exc).__name__})"


# ---------------------------------------------------------------------------------------------
# In the kernel
# ---------------------------------------------------------------------------------------------


class _Seen:
    """One child as read from outside during a cell."""

    __slots__ = ("info", "order", "first_rss", "last_rss", "max_rss", "max_hwm", "readings", "alive",
                 "nvml_first", "nvml_last", "nvml_max")

    def __init__(self, info, order: int):
        self.info, self.order = info, order
        self.first_rss = self.last_rss = self.max_rss = self.max_hwm = None
        self.readings = 0
        self.alive = True
        self.nvml_first: Dict[int, int] = {}
        self.nvml_last: Dict[int, int] = {}
        self.nvml_max: Dict[int, int] = {}

    def fold(self, mem) -> None:
        self.readings += 1
        if mem.rss is not None:
            if self.first_rss is None:
                self.first_rss = mem.rss
            self.last_rss = mem.rss
            self.max_rss = mem.rss if self.max_rss is None else max(self.max_rss, mem.rss)
        if mem.hwm is not None:
            self.max_hwm = mem.hwm if self.max_hwm is None else max(self.max_hwm, mem.hwm)

    def fold_nvml(self, used: Dict[int, int]) -> None:
        for index, value in used.items():
            self.nvml_first.setdefault(index, value)
            self.nvml_last[index] = value
            self.nvml_max[index] = max(self.nvml_max.get(index, 0), value)


class RankWatch:
    """The processes each cell launches: :meth:`cell_started`, then :meth:`cell_finished` returns
    the cell's ``RankRecord``s (None when it launched none).

    Args:
        internals: the probes' adapter to torch's private names (``CudaProbe(internals=...)``),
            handed to forked ranks so they read their devices as the kernel does.
        nvml: the ``NvmlProbe`` for per-process device memory (None: no NVML reading).
        poll_s: how often the children are read while a cell runs.
    """

    def __init__(self, internals: Optional[Callable] = None, nvml=None, poll_s: float = POLL_S):
        self.nvml = nvml
        self.poll_s = poll_s
        _S.kernel_pid = os.getpid()
        _S.internals = internals
        self._base: Optional[str] = None  # the per-cell folders' prefix, found at the first cell
        self._seq = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._running = False
        self._last_end = 0.0
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._seen: Dict[int, _Seen] = {}
        self._nvml_at = 0.0
        self._main = _children.MainThreadChildren()
        #: Listings of the children made (the benchmark reads it: one per cell that launched nothing).
        self.listings = 0

    # -- the cell's bounds ---------------------------------------------------------------------------

    def cell_started(self) -> None:
        _ensure_hooks()
        if self._base is None:
            self._base = os.path.join(tempfile.gettempdir(), f"ipy_gpumem-ranks-{os.getpid()}")
        self._seq += 1
        with self._lock:
            self._seen = {}
            self._running = True
        _S.dir, _S.dir_made = f"{self._base}-{self._seq}", False
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ipy_gpumem-ranks", daemon=True)
            self._thread.start()
        if not self._wake.is_set():
            self._wake.set()

    def cell_finished(self, failure: Optional[RankFailure] = None) -> Optional[tuple]:
        """The cell's ranks, by rank (None when it launched none). Never raises."""
        folder, made = _S.dir, _S.dir_made
        _S.dir, _S.dir_made = None, False
        self._last_end = time.perf_counter()
        try:
            with self._lock:
                self._running = False
                self._poll(final=True)
                seen = self._seen
                self._seen = {}
            files = _read_folder(folder) if made and folder else {}
            if made and folder:
                shutil.rmtree(folder, ignore_errors=True)
            return _ranks(seen, files, failure)
        except Exception:  # noqa: BLE001 - ranks are a nicety: the cell's own record stands
            return None

    def close(self) -> None:
        self._closed = True
        _S.dir = None
        self._main.close()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)  # unload leaves no thread of ours behind (it wakes and returns)

    # -- reading from outside ------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            if self._closed:
                return
            time.sleep(self.poll_s)
            with self._lock:
                if self._running:
                    try:
                        self._poll()
                    except Exception:  # noqa: BLE001 - the next reading or the cell's end will do
                        pass
                elif time.perf_counter() - self._last_end > LINGER_S:
                    self._wake.clear()  # idle: sleep until the next cell

    def _poll(self, final: bool = False) -> None:
        if final and not self._seen:
            # The cell's end: one read of the main thread's children answers "did anything run below
            # us" for a cell that launched nothing (a walk of every thread is for cells that did).
            direct = self._main.read()
            if direct is not None and not direct:
                self.listings += 1
                return
        pids = _children.descendants()
        self.listings += 1
        if not pids and not self._seen:
            return
        current = set(pids or ())
        for pid in pids or ():
            seen = self._seen.get(pid)
            if seen is None:
                info = _children.child_info(pid)
                if info is None or _children.is_launcher_helper(info):
                    continue
                seen = self._seen[pid] = _Seen(info, len(self._seen))
            mem = _children.child_memory(pid)
            if mem is not None and (mem.rss is not None or mem.hwm is not None):
                seen.fold(mem)
        for pid, seen in self._seen.items():
            seen.alive = pid in current
        now = time.perf_counter()
        if self.nvml is not None and current and (final or now - self._nvml_at >= NVML_EVERY_S):
            self._nvml_at = now
            try:
                for pid, used in self.nvml.process_memory(current).items():
                    if pid in self._seen:
                        self._seen[pid].fold_nvml(used)
            except Exception:  # noqa: BLE001
                pass


def _read_folder(folder: str) -> Dict[int, dict]:
    out: Dict[int, dict] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return out
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as fh:
                data = json.load(fh)
            pid = int(data["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        entry = out.setdefault(pid, {})
        entry["end" if name.endswith(".end.json") else "start"] = data
    return out


def _ranks(seen: Dict[int, _Seen], files: Dict[int, dict], failure: Optional[RankFailure]) -> Optional[tuple]:
    """The cell's ranks from what was seen outside and what the forks recorded inside."""
    def candidate(pid: int, s: _Seen) -> bool:
        return pid in files or s.info.rank is not None or _children.is_spawned_worker(s.info)

    chosen = {pid: s for pid, s in seen.items() if candidate(pid, s)}
    # A rank's own children (its DataLoader workers inherit RANK) are not ranks.
    chosen = {pid: s for pid, s in chosen.items() if s.info.ppid not in chosen}
    pids = set(chosen) | set(files)
    if not pids:
        return None
    out: List[RankRecord] = []
    unnumbered = sorted((p for p in pids if p not in files and chosen[p].info.rank is None),
                        key=lambda p: (chosen[p].order, p))
    for pid in pids:
        s, rec = chosen.get(pid), files.get(pid, {})
        start, end = rec.get("start"), rec.get("end")
        if end is not None:
            host = HostRecord(end.get("rss_before"), end.get("rss_after"),
                              _max(end.get("rss_peak"), s.max_hwm if s else None))
            devices = tuple(DeviceRecord(index=d["index"], name=d.get("name"), allocated_before=0,
                                         allocated_after=d.get("allocated_after"), allocated_peak=d.get("allocated_peak"),
                                         reserved_before=0, reserved_after=d.get("reserved_after"),
                                         reserved_peak=d.get("reserved_peak"), used_after=d.get("used_after"),
                                         total=d.get("total")) for d in end.get("devices") or ())
            rank = RankRecord(end.get("rank"), pid, host, devices, end.get("local_rank"), end.get("world_size"),
                              "inside", end.get("rank_from"), "exited", devices_note=end.get("devices_note"),
                              readings=s.readings if s else 0)
        else:
            before = start.get("rss_before") if start else (s.first_rss if s else None)
            host = HostRecord(before, s.last_rss if s else None, _max(s.max_hwm, s.max_rss) if s else None)
            devices = None
            if s is not None and s.nvml_last:
                devices = tuple(DeviceRecord(index=i, used_before=s.nvml_first.get(i), used_after=v)
                                for i, v in sorted(s.nvml_last.items()))
            if start is not None:
                number, rank_from = start.get("index"), "launcher"
            elif s.info.rank is not None:
                number, rank_from = s.info.rank, "env"
            else:
                number, rank_from = unnumbered.index(pid), "start order"
            rank = RankRecord(number, pid, host, devices, s.info.local_rank if s else None,
                              s.info.world_size if s else None, "inside" if start is not None else "outside",
                              rank_from, "running" if s is not None and s.alive else "gone",
                              readings=s.readings if s else 0)
        if failure is not None and failure.pid == pid:
            from dataclasses import replace

            rank = replace(rank, exit_code=failure.exit_code, signal=failure.signal)
        out.append(rank)
    out.sort(key=lambda r: (r.rank is None, r.rank if r.rank is not None else 0, r.pid))
    return tuple(out)


def _max(*values):
    present = [v for v in values if v is not None]
    return max(present) if present else None


# ---------------------------------------------------------------------------------------------
# The launcher's exception
# ---------------------------------------------------------------------------------------------

_LAST_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure))\b:?", re.M)


def _child_error(text: Optional[str]) -> Optional[str]:
    """The class name of the child's error: the last exception line of its traceback text."""
    if not text:
        return None
    found = _LAST_ERROR.findall(text)
    return found[-1].rsplit(".", 1)[-1] if found else None


def _tail(text: Optional[str]) -> Optional[str]:
    if text is None:
        return None
    return text if len(text) <= MAX_CHILD_MESSAGE else "... " + text[-MAX_CHILD_MESSAGE:]


def launcher_failure(exc: Any) -> Optional[RankFailure]:
    """The failing rank named by a launcher's exception (or one it caused, as accelerate wraps
    them); None when ``exc`` is not a launcher's. Reads attributes only: imports nothing."""
    seen = 0
    while exc is not None and seen < 6:
        seen += 1
        name, module = type(exc).__name__, type(exc).__module__ or ""
        if module.startswith("torch.multiprocessing") and hasattr(exc, "error_index"):
            pid = getattr(exc, "error_pid", None)
            if name == "ProcessRaisedException":
                text = getattr(exc, "msg", None) or str(exc)
                return RankFailure(exc.error_index, pid, "torch.multiprocessing", name, _child_error(text), _tail(text))
            return RankFailure(exc.error_index, pid, "torch.multiprocessing", name,
                               exit_code=getattr(exc, "exit_code", None), signal=getattr(exc, "signal_name", None))
        if name == "ChildFailedError" and module.startswith("torch.distributed"):
            return _elastic_failure(exc)
        exc = exc.__cause__ or exc.__context__
    return None


def _elastic_failure(exc) -> RankFailure:
    try:
        rank, failure = exc.get_first_failure()
    except Exception:  # noqa: BLE001
        return RankFailure(None, None, "torch.distributed.elastic", type(exc).__name__, message=_tail(str(exc)))
    message = getattr(failure, "message", None)
    if isinstance(message, dict):
        info = message.get("extraInfo") or {}
        message = "\n".join(str(p) for p in (info.get("py_callstack"), message.get("message")) if p)
    code = getattr(failure, "exitcode", None)
    signal = None
    if isinstance(code, int) and code < 0:
        try:
            signal = failure.signal_name()
        except Exception:  # noqa: BLE001
            signal = None
    text = message if isinstance(message, str) and message else None
    return RankFailure(rank, getattr(failure, "pid", None), "torch.distributed.elastic", type(exc).__name__,
                       _child_error(text), _tail(text), code, signal)
