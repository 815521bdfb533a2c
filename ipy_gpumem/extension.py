"""The IPython adapter: ``GpuMemMagics`` (configuration, ``%gpumem``, ``%%gpumem``), the hooks, load and unload.

Load it with ``%load_ext ipy_gpumem`` or ``c.InteractiveShellApp.extensions = ["ipy_gpumem"]``.
Configure it with ``%config GpuMemMagics.<name> = value`` or in ``ipython_config.py``::

    c.GpuMemMagics.threshold = "16 MiB"   # show the per-cell line when memory moved this much
    c.GpuMemMagics.track_peaks = True     # per-cell peaks (resets torch's peak counters)
    c.GpuMemMagics.quiet = False          # record every cell, print nothing
    c.GpuMemMagics.devices = "all"        # or "0,1": the CUDA devices to watch
    c.GpuMemMagics.history_size = 10000   # records kept (oldest dropped)
    c.GpuMemMagics.sample_rate = 4.0      # live chart: background samples per second (0: cell ends only)
    c.GpuMemMagics.oom_panel = True       # explain out-of-memory errors after the traceback

The work happens elsewhere: the cell room's ``CellWatcher`` measures every cell and returns an
outcome, each room builds its view, the presenter (``present/presenter.py``) puts what a cell or a
mode shows in order, and this module connects them to IPython: configuration, hooks that display
the presenter's outputs, and the modes' dispatch. How ``%%gpumem`` runs a cell: an input transformer blanks the
``%%gpumem ...`` line, so the cell runs as an ordinary cell (its last expression is displayed,
``await`` works, and its error shows exactly as without the magic), while the watcher measures it
and the report follows. Called programmatically (``run_cell_magic("gpumem", ...)``), the magic
runs its body as a nested cell instead, the way ``%%capture`` does.
"""
from __future__ import annotations

import math
import sys
from functools import partial
import warnings
import weakref
from typing import TYPE_CHECKING, Optional

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from traitlets import Bool, Float, Int, TraitError, Unicode, Union, observe, validate

from .cell import commands as _commands
from .cell import header as _header
from .cell.names import CellNames
from .cell.recorder import Ledger
from .cell.stack import live_runners
from .cell.watcher import CellWatcher, Settings
from .core.devices import cuda, parse_device_list
from .core.errors import GpuMemWarning
from .core.probes import CudaProbe, MemoryProbe
from .core.reach import device_problem
from .core.units import parse_bytes
from .present.presenter import Presenter
from .present.shell import ipython_refs
from .reruns.tracker import RerunTracker
from .tensors.torch_api import api as _torch_api

# Everything else (line markers, the chart, the OOM panel, who, free) is imported where it is
# first used: %load_ext must stay fast, and most sessions never need most of it.

if TYPE_CHECKING:  # pragma: no cover
    from IPython.core.interactiveshell import InteractiveShell as _Shell

__all__ = ["GpuMemMagics", "load", "unload", "current_magics", "current_ledger", "user_namespace"]

#: The most records the ledger keeps; a bigger history would only hold memory nobody reads.
MAX_HISTORY = 1_000_000
#: Sampling rates below this are refused: at 0.01 the chart moves once every 100 s.
MIN_RATE, MAX_RATE = 0.01, 100.0
#: The run_cell_async whose frames tell nested cells from frames of cells that ended (see watcher).
_RUNNER_CODE = InteractiveShell.run_cell_async.__code__


#: How long after a cell's end its idle-time work waits: long enough for the kernel to send the
#: reply and publish "idle" first (a ``call_soon`` ran before both, and the client waited for it);
#: a cell that starts sooner does the work itself, at its start.
IDLE_DELAY_S = 0.02


def _when_idle(fn) -> None:
    """Run ``fn`` (guarded) when the event loop that runs the cells is next idle: in a Jupyter kernel,
    shortly after the cell's reply is sent. Outside a running loop (terminal IPython) it raises, and
    the caller does the work at the next cell's start instead."""
    import asyncio

    loop = asyncio.get_running_loop()

    def guarded():
        try:
            fn()
        except Exception:  # noqa: BLE001 - an idle-time census must never reach the loop
            pass

    loop.call_later(IDLE_DELAY_S, guarded)


def _display(obj) -> None:
    from IPython.display import display

    display(obj)


def _emit(outputs) -> None:
    """Display the presenter's outputs in order."""
    from IPython.display import display

    for kind, value in outputs:
        if kind == "view":
            display(value)
        elif kind == "raw":
            display(value, raw=True)
        else:
            _say(value)


def _returned(outputs):
    """A mode's outputs: a lone view is returned (a terminal, ``run_mode`` and IPython's display of the
    magic's result all take it); more are displayed in order."""
    if len(outputs) == 1 and outputs[0].kind == "view":
        return outputs[0].value
    _emit(outputs)
    return None


def _say(message: str) -> None:
    """One line to the user; stdout, so a notebook shows no red block for it."""
    print(message)


@magics_class
class GpuMemMagics(Magics):
    """``%gpumem`` and ``%%gpumem``; configure with ``%config GpuMemMagics`` (see the module docstring)."""

    threshold = Union(
        [Int(), Unicode()], default_value="16 MiB",
        help=("Show the one-line summary after a cell when allocated, reserved or the peak moved by at least this "
              "much (host RSS on a machine without a GPU). A size such as '16 MiB' or bytes."),
    ).tag(config=True)
    track_peaks = Bool(
        True,
        help=("Measure each cell's own peak. To do so ipy_gpumem resets torch's peak counters "
              "(torch.cuda.reset_peak_memory_stats) before every cell, and before every line of a %%gpumem --lines "
              "cell, which also resets the values your code reads with torch.cuda.max_memory_allocated(); on Linux it "
              "also resets the process's peak RSS (VmHWM). Set False to leave all peak counters alone: peaks are then "
              "the highest values sampled."),
    ).tag(config=True)
    quiet = Bool(False, help="Record every cell but never print the per-cell line.").tag(config=True)
    devices = Unicode(
        "all", help=("CUDA devices to watch: 'all' (every device your code initialized) or indices like '0,1' (each "
                     "once; an index past the devices this process sees is refused). A listed device your code never "
                     "used is not read: reading it would create a CUDA context there."),
    ).tag(config=True)
    history_size = Int(10_000, help=f"How many cell records to keep (1 to {MAX_HISTORY:,}); the oldest are dropped.").tag(config=True)
    oom_panel = Bool(
        True,
        help=("When a cell fails with any out-of-memory error, show after its traceback what was asked for, the "
              "device's memory in layers, who holds it, what earlier cells left behind, and the changes that fix it."),
    ).tag(config=True)
    sample_rate = Float(
        4.0,
        help=(f"While a live chart is open, how many times per second a background thread reads memory "
              f"({MIN_RATE} to {MAX_RATE:g}; 0 updates the chart at cell boundaries only). Redraws stay within "
              "0.3% of a core: fast cells are drawn together, an idle chart every 10 s."),
    ).tag(config=True)

    def __init__(self, shell=None, probe: Optional[MemoryProbe] = None, ledger: Optional[Ledger] = None, **kwargs):
        # Made before the traitlets' __init__: it applies the shell's configuration, whose
        # observers (below) update these.
        self.ledger = ledger if ledger is not None else Ledger()
        self.broken: Optional[str] = None
        self.live = None  # the live chart, made by %gpumem chart / sidebar
        # The namespace and IPython's own names in it: what the anatomy's census (at the end of
        # each cell once torch is imported) and the re-run tracker (after a run kept memory) count.
        names = CellNames(shell) if shell is not None else None
        # torch's private fast paths (the allocator's nested stats, which devices have a context) come
        # through the one adapter to torch's internals.
        probe = probe if probe is not None else MemoryProbe(cuda=CudaProbe(internals=_torch_api))
        self.watcher = CellWatcher(probe, self.ledger, Settings(),
                                   runner_code=_RUNNER_CODE, ast_transformers=getattr(shell, "ast_transformers", None),
                                   names=names, reruns=RerunTracker(names),
                                   check_plan=self._check_plan,  # a %%gpumem naming a missing device is not measured
                                   listener=partial(getattr, self, "live"), schedule=_when_idle)  # C: no frame per cell
        # What each cell and mode shows, built without IPython; the magics only display it.
        self.presenter = Presenter(shell, self.ledger, lambda: self.watcher.probe,
                                   lambda: self.watcher.settings.threshold)
        super().__init__(shell=shell, **kwargs)
        if self.ledger.maxlen != self.history_size:
            self.ledger.resize(self.history_size)
        self._settings()

    @property
    def probe(self) -> MemoryProbe:
        """Where every number comes from (the watcher's, the chart's and the modes' probe)."""
        return self.watcher.probe

    @probe.setter
    def probe(self, probe: MemoryProbe) -> None:
        self.watcher.probe = probe
        if self.live is not None:
            self.live.probe = probe

    # -- configuration ---------------------------------------------------------------------------

    @validate("threshold")
    def _check_threshold(self, proposal):
        try:
            value = parse_bytes(proposal["value"])
        except ValueError as exc:
            raise TraitError(f"GpuMemMagics.threshold: {exc}") from None
        if value < 0:
            raise TraitError("GpuMemMagics.threshold must not be negative")
        return proposal["value"]

    @validate("devices")
    def _check_devices(self, proposal):
        try:
            indices = parse_device_list(proposal["value"])
        except ValueError as exc:
            raise TraitError(f"GpuMemMagics.devices: {exc}") from None
        for index in indices or ():
            problem = device_problem(cuda(index), self.probe.cuda)
            if problem:
                raise TraitError(f"GpuMemMagics.devices: {problem}")
        return proposal["value"]

    @validate("sample_rate")
    def _check_sample_rate(self, proposal):
        rate = proposal["value"]
        if not math.isfinite(rate) or rate < 0 or rate > MAX_RATE or 0 < rate < MIN_RATE:
            raise TraitError(f"GpuMemMagics.sample_rate must be 0 (cell boundaries only) or between {MIN_RATE} and "
                             f"{MAX_RATE:g} samples per second, not {rate!r}")
        return rate

    @validate("history_size")
    def _check_history_size(self, proposal):
        size = proposal["value"]
        if not 1 <= size <= MAX_HISTORY:
            raise TraitError(f"GpuMemMagics.history_size must be between 1 and {MAX_HISTORY:,}, not {size}")
        return size

    @observe("history_size")
    def _resize(self, change) -> None:
        self.ledger.resize(change["new"])

    @observe("sample_rate")
    def _rate(self, change) -> None:
        if self.live is not None:
            self.live.set_rate(change["new"])

    @observe("threshold", "devices", "track_peaks", "quiet", "oom_panel")
    def _settings(self, change=None) -> None:
        # The hooks run around every cell: they read these plain values, not the traitlets
        # (a traitlet read costs about as much as one of our syscalls).
        s = self.watcher.settings
        s.threshold, s.devices = parse_bytes(self.threshold), parse_device_list(self.devices)
        s.track_peaks, s.quiet, s.oom_panel = self.track_peaks, self.quiet, self.oom_panel

    # -- hooks -----------------------------------------------------------------------------------

    # The two hooks guard their step themselves (what _guarded does, one call less around every cell).

    def pre_run_cell(self, info=None) -> None:
        if self.broken is None:
            try:
                self.watcher.start(info)
            except BaseException as exc:  # noqa: BLE001 - see _failed
                self._failed(exc)

    def post_run_cell(self, result=None) -> None:
        if self.broken is not None:
            return
        try:
            outcome = self.watcher.finish(result)
        except BaseException as exc:  # noqa: BLE001 - see _failed
            self._failed(exc)
            return
        if outcome is not None:
            self._guarded(self._show, outcome)

    def _guarded(self, step, arg):
        """Run one step of our own; whatever it raises stays here (the user's error is theirs)."""
        if self.broken is not None:
            return None
        try:
            return step(arg)
        except BaseException as exc:  # noqa: BLE001 - see _failed
            self._failed(exc)
        return None

    def _failed(self, exc: BaseException) -> None:
        """One of our steps raised: the user's cell is not told, except in one line where it must be."""
        if isinstance(exc, KeyboardInterrupt):
            # Ctrl-C during our work (an OOM panel being built): abandon it, one line, no traceback.
            _say("ipy_gpumem: interrupted; this cell's memory report was skipped.")
        elif isinstance(exc, Exception):  # an ipy_gpumem bug must never cost the user a cell
            self._stop_after_error(exc)
        else:  # SystemExit from a user __str__/__del__ run on our behalf
            _say(f"ipy_gpumem: this cell's memory report was skipped ({type(exc).__name__} during it).")

    def _stop_after_error(self, exc: BaseException) -> None:
        try:
            self.broken = f"{type(exc).__name__}: {exc}"
        except BaseException:  # noqa: BLE001 - an exception whose str() raises
            self.broken = type(exc).__name__
        try:
            self.watcher.reset()
            if self.live is not None:
                self.live.stop_sampler()
            warnings.warn(f"ipy_gpumem stopped recording after an internal error ({self.broken}). Your cell ran "
                          "normally. Run %gpumem on to resume.", GpuMemWarning, stacklevel=2)
        except BaseException:  # noqa: BLE001 - even the clean-up failing must stay silent here
            pass

    def _show(self, outcome) -> None:
        """Show what a finished cell has to show (the presenter says what, in order)."""
        if outcome.header is not None and outcome.header.plan.output:
            self.shell.user_ns[outcome.header.plan.output] = outcome.record  # -o NAME: asked for by name
        _emit(self.presenter.cell(outcome))

    # -- %gpumem and %%gpumem --------------------------------------------------------------------

    @line_magic("gpumem")
    def gpumem_line(self, line: str = ""):
        view = self.run_mode(line)
        if view is not None:
            _display(view)

    gpumem_line.__doc__ = _commands.LINE_HELP

    def run_mode(self, line: str = ""):
        """Run one ``%gpumem`` mode and return its view (None for modes that only act or print)."""
        try:
            command = _commands.parse_command(line)
            return getattr(self, f"_mode_{command.mode}")(command)
        except _commands.CommandError as exc:
            raise UsageError(str(exc)) from None

    def _mode_status(self, command):
        return self.presenter.status(self.watcher.settings.devices)

    def _mode_history(self, command):
        records = self.ledger.records()
        if command.limit is not None and command.limit > 0:
            records = list(records)[-command.limit:]
        return _returned(self.presenter.history(records))

    def _live(self):
        """The live chart, made on the first chart request."""
        if self.live is None:
            from .chart.live import LiveChart

            self.live = LiveChart(self.probe, self.ledger.records, self.watcher.in_flight)
            self.live.sample_rate = self.sample_rate  # the watcher's listener from now on
        return self.live

    def _mode_chart(self, command):
        self._live().show(self.shell, command.tier, run=self.watcher.enabled)

    def _mode_sidebar(self, command):
        from .chart.views import sidebar_unavailable

        reason = sidebar_unavailable(self.shell)
        if reason is not None:
            self._live().show(self.shell, note=f"{reason}; showing the chart here instead", run=self.watcher.enabled)
        else:
            self._live().show_sidebar(run=self.watcher.enabled)

    def _check_plan(self, plan) -> None:
        problem = device_problem(plan.device, self.probe.cuda)
        if problem:
            raise _header.HeaderError(f"-d {plan.device}: {problem}")

    def _mode_who(self, command):
        problem = device_problem(command.device, self.probe.cuda)
        if problem:
            raise _commands.CommandError(f"%gpumem who: {problem}")
        return self.presenter.who(command.device)

    def _mode_free(self, command):
        return self.presenter.free(command.dry_run)

    def _mode_on(self, command):
        self.broken = None
        self.watcher.reset()  # nothing left from before: the next cell is measured from a clean slate
        self.watcher.enabled = True
        if self.live is not None:
            self.live.ensure_sampler()
        _say("ipy_gpumem: recording every cell.")

    def _mode_off(self, command):
        self.watcher.enabled = False
        if self.live is not None:
            self.live.stop_sampler()
        _say("ipy_gpumem: recording paused (%%gpumem still measures on request). %gpumem on resumes.")

    def _mode_clear(self, command):
        from .preflight.known import forget

        count = len(self.ledger)
        self.ledger.clear()
        forget()  # the estimates the OOM panel could cite go with the cells
        _say(f"ipy_gpumem: forgot {count} recorded cell{'s' if count != 1 else ''}.")

    def _mode_export(self, command):
        _say(_commands.export(command.path, self.ledger.records()))

    def _mode_snapshot(self, command):
        report, device = self.presenter.open_snapshot(command.path, command.device)
        return _returned(self.presenter.snapshot(report, command.start, command.end, device))

    @cell_magic("gpumem")
    def gpumem_cell(self, line: str, cell: str):
        # Reached only when the input transformer left the line in place: bad arguments (raise
        # UsageError here) or a programmatic run_cell_magic call (measure the body as a nested
        # cell, as %%capture does).
        try:
            plan = _header.parse_args(line)
            self._check_plan(plan)
        except _header.HeaderError as exc:
            raise UsageError(str(exc)) from None
        if plan.estimate is not None:
            return self._estimate_cell(plan, cell)
        self.watcher.arm(_header.CellHeader(plan, 0, tuple(cell.splitlines())))
        self.shell.run_cell(cell, store_history=False)

    gpumem_cell.__doc__ = _commands.CELL_HELP

    def _estimate_cell(self, plan, cell: str) -> None:
        """``--estimate``: the body's code runs twice on fake copies of the objects it reads, never for real
        (the transformer leaves an --estimate header in place, so every such cell comes here)."""
        unavailable = _commands.estimate_unavailable()
        if unavailable:
            _say(unavailable)
            return
        from .preflight.known import remember

        # The cell that runs this magic is ipy_gpumem's work (the fake run's imports), not the user's:
        # no per-cell line for it.
        self.watcher.no_line_for_running_cells()
        outputs, result = self.presenter.estimate_cell(self.shell.transform_cell(cell), plan.estimate)
        if result is not None:
            remember(cell, result)  # the OOM panel may cite it if this cell later runs out of memory
            if plan.output:
                self.shell.user_ns[plan.output] = result.estimate  # -o NAME: asked for by name
        _emit(outputs)


# ---------------------------------------------------------------------------------------------
# The %%gpumem input transformer, load and unload
# ---------------------------------------------------------------------------------------------


def _make_transformer(magics: GpuMemMagics):
    def strip_gpumem_header(lines):
        """Blank a leading ``%%gpumem`` line so the cell runs as an ordinary cell (see module doc)."""
        try:
            if not lines or not lines[0].startswith("%%gpumem"):
                return lines
            return _header.strip_header(lines, check=magics._check_plan)
        except Exception:  # noqa: BLE001 - a raising transformer would cost the user the cell
            return lines

    # IPython's check_complete (terminal IPython, jupyter console) runs the cleanup transforms
    # that declare no side effects: had it run this one, "%%gpumem --lines" + Enter would run at
    # once with an empty body. Declared, it is left out, and a typed %%gpumem cell continues
    # like %%time until a blank line.
    strip_gpumem_header.has_side_effects = True
    return strip_gpumem_header


_ATTR = "_ipy_gpumem_state"
# A ledger put aside by unload, taken back by the next load into the same shell: %reload_ext
# keeps the session's history (this module is not reloaded by %reload_ext, only the package).
_PARKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def load(shell: "_Shell") -> None:
    """Register the magics, hooks and transformer once (loading twice changes nothing)."""
    if getattr(shell, _ATTR, None) is not None:
        return
    magics = GpuMemMagics(shell=shell, ledger=_PARKED.pop(shell, None))
    shell.register_magics(magics)
    pre, post = magics.pre_run_cell, magics.post_run_cell
    shell.events.register("pre_run_cell", pre)
    shell.events.register("post_run_cell", post)
    transformer = _make_transformer(magics)
    shell.input_transformers_cleanup.append(transformer)
    setattr(shell, _ATTR, {"magics": magics, "pre": pre, "post": post, "transformer": transformer})


def unload(shell: "_Shell") -> None:
    """Remove exactly what :func:`load` added: hooks, transformer, magics, configurable."""
    state = getattr(shell, _ATTR, None)
    if state is None:
        return
    magics = state["magics"]
    if magics.live is not None:
        magics.live.close()  # stops the sampler, leaves a static snapshot where each view was
    if magics.watcher.close():
        _remove_hook_after_the_cell(shell)
    for event, callback in (("pre_run_cell", state["pre"]), ("post_run_cell", state["post"])):
        try:
            shell.events.unregister(event, callback)
        except ValueError:
            pass
    if state["transformer"] in shell.input_transformers_cleanup:
        shell.input_transformers_cleanup.remove(state["transformer"])
    manager = shell.magics_manager
    for kind in ("line", "cell"):
        table = manager.magics.get(kind, {})
        bound = table.get("gpumem")
        if bound is not None and getattr(bound, "__self__", None) is magics:
            del table["gpumem"]
    if manager.registry.get("GpuMemMagics") is magics:
        del manager.registry["GpuMemMagics"]
    if magics in shell.configurables:
        shell.configurables.remove(magics)
    magics.probe.close()
    _PARKED[shell] = magics.ledger
    delattr(shell, _ATTR)


def _remove_hook_after_the_cell(shell) -> None:
    """The cell unloading us is a ``--lines`` cell: its markers still call their (idle) hook, so it
    leaves ``builtins`` once that cell is over, by a post_run_cell callback that removes itself."""
    from .cell.markers import remove_hook

    def remove_when_done(result=None):
        if live_runners(_RUNNER_CODE) == 0:  # no cell is running any more
            remove_hook()
            try:
                shell.events.unregister("post_run_cell", remove_when_done)
            except ValueError:
                pass

    shell.events.register("post_run_cell", remove_when_done)


def running_shell():
    """The IPython shell this code runs in, or None (IPython not imported, or no shell running)."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    return get_ipython()


def current_magics() -> Optional[GpuMemMagics]:
    shell = running_shell()
    state = getattr(shell, _ATTR, None) if shell is not None else None
    return None if state is None else state["magics"]


def current_ledger() -> Optional[Ledger]:
    """The running shell's ledger, or None when the extension is not loaded."""
    magics = current_magics()
    return None if magics is None else magics.ledger


def user_namespace():
    """``(namespace, refs)`` of the running shell: its user namespace and IPython's own names in it."""
    shell = running_shell()
    if shell is None:
        raise RuntimeError("no IPython shell is running: pass the namespace, e.g. who(globals())")
    return shell.user_ns, ipython_refs(shell)
