"""The processes a cell launches (the ranks of a distributed launch), found and recorded through what the launchers already use.

**What is a rank.** A process that torch.distributed, a launcher or ``RANK`` with a ``WORLD_SIZE``
says is one, and nothing else:

- a fork of the kernel running torch.multiprocessing's ``_wrap`` (``start_processes`` and ``spawn``
  with fork, elastic's and accelerate's ``notebook_launcher`` through them) records itself, as the
  kernel records a cell: multiprocessing runs our ``register_after_fork`` callback in it, and it
  writes its start and, from a multiprocessing ``Finalize`` at its exit, its end into the cell's
  private folder (``folder``). Its rank is torch.distributed's while a process group is up,
  else ``RANK`` when its launcher set one (not the value it inherited from the kernel), else the
  process index the launcher passed;
- a process the kernel started through multiprocessing with spawn or forkserver whose target is
  that same ``_wrap``: multiprocessing pickles the ``Process`` to start it, and our reducer reads
  its ``_target`` and ``_args`` then (``start()`` deletes them right after, bpo-30775) and its pid
  from its ``_popen`` later (the fields Python 3.9 to 3.13 keep): its rank is the launcher's index;
- a process whose environment has a valid ``RANK`` below a ``WORLD_SIZE`` (``children``) that
  its launcher set: the pair is not the one the kernel has or was started with, or elastic's
  ``TORCHELASTIC_RUN_ID`` is not the kernel's (torchrun's workers).

Pool and DataLoader workers, ``concurrent.futures`` workers, multiprocessing's helpers,
``subprocess.run`` and ``!cmd`` (whatever ``RANK`` the notebook has), and a rank's own children are
not ranks, and are left out: a worker's RSS is mostly pages it shares with its parent, the cell's
own line already counts what the kernel holds, and a row per worker would read as a rank.

**When.** Reading costs nothing until a cell starts a process. Two hooks tell, both no-ops between
cells and in any process but the kernel: the at-fork hook (every ``os.fork``: multiprocessing's fork,
a kernel's ``!cmd`` through its pty) and multiprocessing's pickler (spawn and forkserver pickle the
new ``Process`` through ``ForkingPickler``, where we register a reducer for multiprocessing's own
``Process`` classes that notes it and returns what the pickler would have used without it). The
first one of a cell wakes a thread (started then), which reads the cell's processes from outside
(``children``: RSS and high-water mark from /proc, identity from the command line and
environment; on a GPU NVML's per-process list at most once a second) every :data:`POLL_S` until the
cell ends, then sleeps again. A cell's end reads the main thread's children once (one ``pread``): a
cell that launched nothing costs that, and a process started another way (``subprocess``) that is
still running is found there (one that already ended is not seen).

**Which.** A cell's processes are those below a child of the kernel that was not running before the
cell launched anything (multiprocessing's fork server and resource tracker count as the kernel): a
server started two cells ago is not this cell's. Only files of pids the kernel saw fork during the
cell, or saw below it, are read.

Nothing here waits for, signals or reaps a child, opens a port or starts a process; nothing
initializes CUDA in the kernel. A child that is killed leaves its start and the readings taken
from outside; one that hangs past the cell's end is recorded as still running.
"""
from __future__ import annotations

import os
import pickle
import re
import sys
import threading
import time
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set

from . import children as _children
from ..tensors.spawn import spawn_index
from .folder import RankFolder

if TYPE_CHECKING:  # the records load with the first launch or failing cell, not with the extension
    from ..core.records import RankFailure

__all__ = ["RankWatch", "launcher_failure", "POLL_S", "NVML_EVERY_S"]

#: While a cell that launched a process runs, its processes are read this often.
POLL_S = 0.1
#: NVML's process list is slow (~5 ms a device, the driver's lock): at most this often, only while children exist.
NVML_EVERY_S = 1.0
#: Characters of a child's traceback kept for the out-of-memory parser (its message is at the end).
MAX_CHILD_MESSAGE = 8000
#: Processes of one cell read from outside, at most (a launch of thousands is read in part).
MAX_SEEN = 4096
#: A process that looked like a copy of the kernel is read again for its first readings (it may have exec'd).
RECHECK_READINGS = 3


class _Cell:
    """One running cell as the hooks see it: whether it launched, its folder, the pids it forked.

    A cell that launches nothing only ever has ``watch`` (the rest is made at its first launch)."""

    launched = False
    folder: Optional[RankFolder] = None
    folder_tried = False
    nvml_at = 0.0

    def __init__(self, watch: "RankWatch"):
        self.watch = watch

    def launch(self) -> None:
        """The cell starts a process (a hook says so): learn what ran before it, the first time."""
        if not self.launched:
            self.forked: Set[int] = set()
            self.pre: Dict[int, List[int]] = {}  # the forking thread's children just before its fork
            self.pickled: List[tuple] = []  # (weak Process, rank index or None) for each one spawned
            self.indices: Dict[int, Optional[int]] = {}  # and by pid, once it has one
            self.seen: Dict[int, _Seen] = {}
            self.launched = True  # last: a reading thread that sees it finds the rest
            self.watch.learn_before()

    def resolve(self) -> None:
        """The pids of the processes pickled to be spawned (multiprocessing gives one once started)."""
        count = len(self.pickled)  # another thread may append meanwhile: those wait for the next reading
        waiting = []
        for ref, index in self.pickled[:count]:
            proc = ref()
            popen = vars(proc).get("_popen") if proc is not None else None
            pid = vars(popen).get("pid") if popen is not None and hasattr(popen, "__dict__") else None
            if type(pid) is int:
                self.indices[pid] = index
            elif proc is not None:
                waiting.append((ref, index))
        del self.pickled[:count]
        self.pickled.extend(waiting)


class _Shared:
    """What the process-wide hooks read: the running cell, the kernel's pid, the probes' adapter."""

    cell: Optional[_Cell] = None
    kernel_pid: int = -1
    internals: Optional[Callable] = None
    fork_hooks: bool = False
    mp_registered: bool = False
    pickler_registered: bool = False
    hooked: bool = False  # all three


_S = _Shared()


class _Token:
    """A weak-referenceable key for multiprocessing's after-fork registry (kept for the process's life)."""


_TOKEN = _Token()


def _kernel_cell() -> Optional[_Cell]:
    cell = _S.cell
    return cell if cell is not None and os.getpid() == _S.kernel_pid else None


def _before_fork() -> None:
    """In the forking thread, before any fork while a cell runs: the folder the child writes into,
    and the thread's children now (the new one is what appears after)."""
    try:
        cell = _kernel_cell()
        if cell is None:
            return
        if not _S.hooked:
            _ensure_hooks()  # multiprocessing imported by this very cell: its fork still records itself
        cell.launch()
        if not cell.folder_tried:
            cell.folder_tried = True
            cell.folder = RankFolder.make()
        kids = _children.thread_children()
        if kids is not None:
            cell.pre[threading.get_ident()] = kids
    except Exception:  # noqa: BLE001 - never cost the user's fork anything
        pass


def _after_fork_in_parent() -> None:
    """In the kernel, right after a fork: the new child is a process this cell launched."""
    try:
        cell = _kernel_cell()
        if cell is None or not cell.launched:
            return  # the cell ended during another thread's fork
        before = cell.pre.pop(threading.get_ident(), None)
        kids = _children.thread_children()
        if kids is not None and before is not None:
            cell.forked.update(set(kids) - set(before))
        cell.watch.wake()
    except Exception:  # noqa: BLE001
        pass


def _pickling_process(proc):
    """``ForkingPickler``'s reducer for multiprocessing's ``Process`` classes: a process is pickled
    when it is started with spawn or forkserver (a fork is not). Notes the launch and, while they
    are still there, its target and arguments; then reduces it as the pickler would have."""
    try:
        cell = _kernel_cell()
        if cell is not None:
            cell.launch()
            cell.pickled.append((weakref.ref(proc), _launch_index(vars(proc))))
            cell.watch.wake()
    except Exception:  # noqa: BLE001 - never cost the user's launch anything
        pass
    return proc.__reduce_ex__(pickle.DEFAULT_PROTOCOL)


def _ensure_hooks() -> None:
    """Registered once per process (none of them can be unregistered: each does nothing between cells);
    multiprocessing's two once it is imported."""
    if not _S.fork_hooks and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent)
        _S.fork_hooks = True
    if not _S.mp_registered:
        util = sys.modules.get("multiprocessing.util")
        if util is not None:
            util.register_after_fork(_TOKEN, _in_forked_child)
            _S.mp_registered = True
    if not _S.pickler_registered:
        reduction, context = sys.modules.get("multiprocessing.reduction"), sys.modules.get("multiprocessing.context")
        if reduction is not None and context is not None:
            # The exact classes only (the pickler's table is by type): a user's subclass is left alone.
            for name in ("Process", "SpawnProcess", "ForkServerProcess"):
                cls = getattr(context, name, None)
                if isinstance(cls, type):
                    reduction.ForkingPickler.register(cls, _pickling_process)
            _S.pickler_registered = True
    _S.hooked = _S.fork_hooks and _S.mp_registered and _S.pickler_registered


# ---------------------------------------------------------------------------------------------
# Inside a forked rank
# ---------------------------------------------------------------------------------------------


def _launch_index(fields: dict) -> Optional[int]:
    """The process index torch.multiprocessing gave the process with instance dict ``fields``, if a rank's."""
    index = spawn_index(fields)
    return index if index is not None and index < _children.MAX_WORLD_SIZE else None


def _launcher_index() -> Optional[int]:
    """In a multiprocessing child: the index torch.multiprocessing passed; None when this child is
    not one of its ranks (a DataLoader worker, a pool)."""
    import multiprocessing

    return _launch_index(vars(multiprocessing.current_process()))


def _in_forked_child(_token) -> None:
    """multiprocessing's after-fork callback, in each child it forks: record a rank of this cell."""
    try:
        cell = _S.cell
        if cell is None or cell.folder is None or os.getppid() != _S.kernel_pid:
            return  # no cell running, no folder, or a grandchild (a rank's own workers)
        index = _launcher_index()
        if index is None:
            return
        recorder = _ChildRecorder(cell.folder, index, _S.internals)
        recorder.begin()
        from multiprocessing import util

        # Runs when the child's bootstrap ends (after the launched function returned or raised).
        util.Finalize(None, recorder.end, exitpriority=-(2 ** 30))
    except Exception:  # noqa: BLE001 - never cost the rank anything
        pass


def _read_self() -> tuple:
    mem = _children.child_memory(os.getpid())
    if mem is not None:
        return mem.rss, mem.hwm
    from ..core.probes import HostProbe

    probe = HostProbe()
    return probe.rss(), probe.peak_rss()


def _set_by_launcher(now: _children.RankVariables, others) -> bool:
    """``RANK`` with ``WORLD_SIZE`` that is not one of ``others`` (what the process inherited, the
    kernel's): set for this process, so its launcher's word."""
    if not now.says_rank:
        return False
    if all((now.rank, now.world_size) != (o.rank, o.world_size) for o in others):
        return True
    return now.run_id is not None and all(now.run_id != o.run_id for o in others)


class _ChildRecorder:
    """A forked rank's own record: its start, and at its exit its end, peak and devices."""

    def __init__(self, folder: RankFolder, index: int, internals):
        self.folder, self.index, self.internals = folder, index, internals
        self.pid = os.getpid()
        # What it inherited from the kernel at the fork: a RANK the kernel had is not this rank's.
        self.inherited = _children.rank_variables(os.environ)

    def begin(self) -> None:
        rss, _hwm = _read_self()
        # A fork's high-water mark starts at its RSS at the fork: it measures from here, untouched.
        self.rss_before = rss
        self.folder.write(f"{self.pid}.start.json", {"pid": self.pid, "index": self.index, "rss_before": rss})

    def end(self) -> None:
        try:
            if os.getpid() != self.pid:
                return  # a fork of the rank
            rss, hwm = _read_self()
            rank, rank_from, world, local = self.index, "launcher", None, None
            env = _children.rank_variables(os.environ)
            if _set_by_launcher(env, (self.inherited,)):
                rank, rank_from, world, local = env.rank, "env", env.world_size, env.local_rank
            dist = sys.modules.get("torch.distributed")
            try:
                if dist is not None and dist.is_available() and dist.is_initialized():
                    rank, rank_from, world = int(dist.get_rank()), "torch.distributed", int(dist.get_world_size())
            except Exception:  # noqa: BLE001
                pass
            devices, note = self._devices()
            self.folder.write(f"{self.pid}.end.json", {
                "pid": self.pid, "index": self.index, "rank": rank, "rank_from": rank_from, "world_size": world,
                "local_rank": local, "rss_before": self.rss_before, "rss_after": rss,
                "peak_rss": hwm, "devices": devices, "devices_note": note})
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
                            "peak_allocated": s.peak_allocated, "reserved_after": s.reserved,
                            "peak_reserved": s.peak_reserved, "used_after": s.used, "total": s.total})
            return out, (reason if not out else None)
        except Exception as exc:  # noqa: BLE001
            return [], f"CUDA counters unavailable ({type(exc).__name__})"


# ---------------------------------------------------------------------------------------------
# In the kernel
# ---------------------------------------------------------------------------------------------


class _Seen:
    """One process of the cell as read from outside: who it is, what the launcher says, its readings."""

    __slots__ = ("info", "labelled", "index", "first_rss", "last_rss", "max_rss", "max_hwm", "readings", "alive",
                 "nvml_first", "nvml_last", "nvml_max")

    def __init__(self, info):
        self.info = info
        self.labelled = False  # a process multiprocessing spawned (its target known)
        self.index: Optional[int] = None  # and its torch.multiprocessing rank index, if it is one
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
        poll_s: how often the processes are read while a cell that launched some runs.
    """

    def __init__(self, internals: Optional[Callable] = None, nvml=None, poll_s: float = POLL_S):
        self.nvml = nvml
        self.poll_s = poll_s
        self.internals = internals
        _S.kernel_pid = os.getpid()
        self._cell: Optional[_Cell] = None
        self._spare: Optional[_Cell] = None  # a cell that launched nothing, for the next one
        #: The kernel's direct children known to run before the current cell (learnt at the first cell).
        self._before: Optional[Set[int]] = None
        #: The kernel's children and whether each is one of multiprocessing's helpers (read once each).
        self._helpers: Dict[int, bool] = {}
        self._started_with: Optional[_children.RankVariables] = None
        self._quiet: Optional[bytes] = None  # the main thread's children file as the last quiet cell ended
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()  # two threads forking at once start one reader
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._main = _children.MainThreadChildren()
        #: Listings of the children made (the benchmark reads it: one per cell that launched nothing).
        self.listings = 0
        #: Times the reading thread woke (none for a cell that launched nothing).
        self.wakeups = 0

    # -- the cell's bounds ---------------------------------------------------------------------------

    def cell_started(self) -> None:
        if not _S.hooked:
            _ensure_hooks()
        if self._cell is not None:
            self._drop(self._cell)  # a cell that never finished (an internal error): its folder goes
        # The last quiet cell's, untouched (it launched nothing, so it has only ``watch``), or a new one.
        cell, self._spare = self._spare, None
        if cell is None or cell.launched or cell.folder_tried:  # a fork in another thread may have reached it late
            cell = _Cell(self)
        self._cell = cell
        _S.internals = self.internals
        _S.cell = cell
        if not _S.fork_hooks:
            cell.launch()  # no at-fork hook on this platform: read every cell, as a launch
            self.wake()

    def cell_finished(self, failure: Optional[RankFailure] = None) -> Optional[tuple]:
        """The cell's ranks, by rank (None when it launched none). Never raises."""
        cell, self._cell = self._cell, None
        if _S.cell is cell:
            _S.cell = None
        if cell is None:
            return None
        try:
            if not cell.launched:
                # One read of the main thread's children answers "did anything start below us" for
                # a cell that launched nothing (a walk of every thread is for cells that did); no
                # lock: the reading thread touches nothing of a cell that launched nothing.
                raw = self._main.read_bytes()
                self.listings += 1
                if raw is not None and raw == self._quiet and not cell.launched:
                    self._spare = cell  # nothing happened to it: the next cell's
                    return None  # the very children the last quiet cell's end found
                direct = _children.parse_pids(raw) if raw is not None else None
                if direct is not None and self._before is None:
                    self._before = set(direct)  # the first cell: what runs now ran before it
                if direct is not None and self._before.issuperset(direct):
                    self._quiet = raw
                    return None
                cell.launch()  # something new runs below the kernel (a subprocess): read it as a launch
            with self._lock:
                tree = self._poll(cell, final=True)
                if tree is not None:
                    self._before = self._known(tree)  # what still runs is no later cell's
                    self._quiet = None
            files = cell.folder.read(self._eligible(cell)) if cell.folder is not None else {}
            return _ranks(cell.seen, files, failure, self._kernel_variables(), cell.indices if cell.launched else {})
        except Exception:  # noqa: BLE001 - ranks are a nicety: the cell's own record stands
            return None
        finally:
            if cell.folder is not None:
                self._drop(cell)

    def learn_before(self) -> None:
        """At a cell's first launch: the kernel's children that ran before it, if not known yet."""
        if self._before is None:
            tree = _children.descendant_tree()
            self.listings += 1
            self._before = self._known(tree) if tree is not None else set()

    def wake(self) -> None:
        """A cell launched a process: the reading thread (started on first use) reads until it ends."""
        if self._closed:
            return
        if self._thread is None:
            with self._start_lock:
                if self._thread is None and not self._closed:
                    thread = threading.Thread(target=self._loop, name="ipy_gpumem-ranks", daemon=True)
                    thread.start()
                    self._thread = thread
        if not self._wake.is_set():
            self._wake.set()

    def close(self) -> None:
        self._closed = True
        cell, self._cell = self._cell, None
        if cell is not None:
            if _S.cell is cell:
                _S.cell = None
            self._drop(cell)
        self._main.close()
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)  # unload leaves no thread of ours behind (it wakes and returns)

    # -- reading from outside ------------------------------------------------------------------------

    def _drop(self, cell: _Cell) -> None:
        folder = cell.folder
        if folder is not None:
            cell.folder = None
            folder.remove()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            if self._closed:
                return
            self._wake.clear()
            self.wakeups += 1
            while not self._stop.wait(self.poll_s):
                with self._lock:
                    cell = self._cell
                    if cell is None or not cell.launched:
                        break  # the cell ended: sleep until one launches again
                    try:
                        self._poll(cell)
                    except Exception:  # noqa: BLE001 - the next reading or the cell's end will do
                        pass
            if self._closed:
                return

    def _poll(self, cell: _Cell, final: bool = False) -> Optional[Dict[int, int]]:
        """Read the cell's processes once (at its end, NVML too); the tree of every process below the
        kernel (None: unknown)."""
        tree = _children.descendant_tree()
        self.listings += 1
        if tree is None:
            return None
        before = self._before or set()
        cell.resolve()
        current = set()
        for pid, root in self._roots(tree).items():
            if root is None or root in before:
                continue  # a helper, or below a process that ran before this cell launched anything
            seen = cell.seen.get(pid)
            if seen is None:
                info = _children.child_info(pid) if len(cell.seen) < MAX_SEEN else None
                if info is None:
                    continue
                seen = cell.seen[pid] = _Seen(info)
            elif seen.readings < RECHECK_READINGS and not _children.is_fresh_program(seen.info):
                # First read between its fork and its exec, a spawned interpreter looked like a copy of the
                # kernel (whose memory it started from): read who it is again while it is young.
                info = _children.child_info(pid)
                if info is not None:
                    seen.info = info
            if not seen.labelled and pid in cell.indices:
                seen.labelled, seen.index = True, cell.indices[pid]
            current.add(pid)
            mem = _children.child_memory(pid)
            if mem is not None and (mem.rss is not None or mem.hwm is not None):
                seen.fold(mem)
        for pid, seen in cell.seen.items():
            seen.alive = pid in current
        now = time.perf_counter()
        if self.nvml is not None and current and (final or now - cell.nvml_at >= NVML_EVERY_S):
            cell.nvml_at = now
            try:
                for pid, used in self.nvml.process_memory(current).items():
                    if pid in cell.seen:
                        cell.seen[pid].fold_nvml(used)
            except Exception:  # noqa: BLE001
                pass
        return tree

    def _roots(self, tree: Dict[int, int]) -> Dict[int, Optional[int]]:
        """Each process below the kernel with the process it was launched as part of: the kernel's
        child it descends from, or the child of multiprocessing's fork server (which starts processes
        for the kernel); None for the helpers themselves."""
        kernel = os.getpid()
        helpers = self._helpers
        direct = {pid for pid, parent in tree.items() if parent == kernel}
        for pid in list(helpers):
            if pid not in direct:
                helpers.pop(pid, None)  # gone: forget it (pids are reused)
        roots: Dict[int, Optional[int]] = {}
        for pid, parent in tree.items():
            if parent == kernel:
                helper = helpers.get(pid)
                if helper is None:
                    info = _children.child_info(pid)
                    helper = helpers[pid] = info is not None and _children.is_launcher_helper(info)
                roots[pid] = None if helper else pid
            elif helpers.get(parent):
                roots[pid] = pid
            else:
                roots[pid] = roots.get(parent)
        return roots

    def _known(self, tree: Dict[int, int]) -> Set[int]:
        """What runs now, as seen by the next cell: every root and helper (none of it is that cell's)."""
        roots = self._roots(tree)
        return {pid for pid, root in roots.items() if root == pid} | {pid for pid, h in self._helpers.items() if h}

    def _eligible(self, cell: _Cell) -> Set[int]:
        """The pids whose own records are read: the kernel's children this cell forked or started."""
        kernel = os.getpid()
        return cell.forked | {pid for pid, s in cell.seen.items() if s.info.ppid == kernel}

    def _kernel_variables(self) -> tuple:
        """The kernel's ``RANK`` and ``WORLD_SIZE``: those it was started with and those it has now."""
        if self._started_with is None:
            self._started_with = _children.environment_of()
        return self._started_with, _children.rank_variables(os.environ)


def _ranks(seen: Dict[int, _Seen], files: Dict[int, dict], failure: Optional[RankFailure],
           kernel: tuple, launched: Optional[Dict[int, Optional[int]]] = None) -> Optional[tuple]:
    """The cell's ranks: the processes a launcher, torch.distributed or their environment says are
    ranks (see the module's docstring), from what they recorded inside and what was read outside.

    ``launched`` (pid -> torch.multiprocessing's index, from the processes pickled to be spawned)
    and the launcher's ``failure`` also name ranks that ended before any reading (the first is
    :data:`POLL_S` after the launch): they get their row, with nothing of their memory known."""
    from ..core.records import DeviceRecord, HostRecord, RankRecord  # noqa: PLC0415 - loaded with the first launch

    how: Dict[int, str] = {pid: "inside" for pid in files}
    for pid, s in seen.items():
        if pid in how:
            continue
        if s.labelled:
            if s.index is not None:
                how[pid] = "launcher"
        elif _set_by_launcher(s.info.variables, kernel):
            how[pid] = "env"
    # A rank's own children (its DataLoader workers inherit its RANK) are not ranks.
    how = {pid: h for pid, h in how.items() if pid not in seen or seen[pid].info.ppid not in how}
    unread: Dict[int, int] = {pid: index for pid, index in (launched or {}).items()
                              if index is not None and pid not in how and pid not in seen}
    if failure is not None and type(failure.pid) is int and failure.rank is not None and failure.pid not in how \
            and failure.pid not in seen:
        unread.setdefault(failure.pid, failure.rank)
    for pid in unread:
        how[pid] = "launcher"
    if not how:
        return None
    out: List[RankRecord] = []
    for pid, source in how.items():
        s, rec = seen.get(pid), files.get(pid, {})
        start, end = rec.get("start"), rec.get("end")
        if end is not None:
            host = HostRecord(end["rss_before"], end["rss_after"], _max(end["peak_rss"], s.max_hwm if s else None))
            devices = tuple(DeviceRecord(index=d["index"], name=d["name"], allocated_before=0,
                                         allocated_after=d["allocated_after"], peak_allocated=d["peak_allocated"],
                                         reserved_before=0, reserved_after=d["reserved_after"],
                                         peak_reserved=d["peak_reserved"], used_after=d["used_after"],
                                         total=d["total"]) for d in end["devices"])
            rank = RankRecord(end["rank"], pid, host, devices, end["local_rank"], end["world_size"],
                              "inside", end["rank_from"], "exited", devices_note=end["devices_note"],
                              readings=s.readings if s else 0)
        else:
            # Read from outside, a program of its own started from nothing (its first reading can come late,
            # after it imported torch); a copy of the kernel started from what it copied, as first read.
            fresh = s is not None and _children.is_fresh_program(s.info)
            before = start["rss_before"] if start else (0 if fresh else (s.first_rss if s else None))
            host = HostRecord(before, s.last_rss if s else None, _max(s.max_hwm, s.max_rss) if s else None)
            devices = None
            if s is not None and s.nvml_last:
                devices = tuple(DeviceRecord(index=i, used_before=s.nvml_first.get(i), used_after=v)
                                for i, v in sorted(s.nvml_last.items()))
            local = world = None
            if start is not None:
                number, rank_from = start["index"], "launcher"
            elif s is None:  # ended before any reading: the launcher's index is all there is
                number, rank_from = unread[pid], "launcher"
            elif source == "launcher":
                number, rank_from = s.index, "launcher"
            else:
                number, rank_from = s.info.rank, "env"
                local, world = s.info.local_rank, s.info.world_size
            rank = RankRecord(number, pid, host, devices, local, world, "inside" if start is not None else "outside",
                              rank_from, "running" if s is not None and s.alive else "gone",
                              readings=s.readings if s else 0)
        if failure is not None and failure.pid == pid:
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
    them); None when ``exc`` is not a launcher's. Reads attributes only: imports nothing of torch."""
    from ..core.records import RankFailure  # noqa: PLC0415 - loaded with the first failing cell

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
    from ..core.records import RankFailure  # noqa: PLC0415 - loaded with the first failing launch

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
