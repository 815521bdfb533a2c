"""The only IPython-aware module: GpuMemMagics (config, ``%gpumem``, ``%%gpumem``), guarded hooks, load/unload.

Load it with ``%load_ext ipy_gpumem`` or ``c.InteractiveShellApp.extensions = ["ipy_gpumem"]``.
Configure it with ``%config GpuMemMagics.<name> = value`` or in ``ipython_config.py``::

    c.GpuMemMagics.threshold = "16 MiB"   # show the per-cell line when memory moved this much
    c.GpuMemMagics.track_peaks = True     # per-cell peaks (resets torch's peak counters)
    c.GpuMemMagics.quiet = False          # record every cell, print nothing
    c.GpuMemMagics.devices = "all"        # or "0,1": the CUDA devices to watch
    c.GpuMemMagics.history_size = 10000   # records kept (oldest dropped)
    c.GpuMemMagics.sample_rate = 4.0      # live chart: background samples per second (0: cell ends only)
    c.GpuMemMagics.oom_panel = True       # explain out-of-memory errors after the traceback

How ``%%gpumem`` runs a cell: an input transformer blanks the ``%%gpumem ...`` line, so the cell
runs as an ordinary cell (its last expression is displayed, ``await`` works, and its error shows
exactly as without the magic), while the hooks measure it in detail and show the report after
it. Called programmatically (``run_cell_magic("gpumem", ...)``), the magic runs its body as a
nested cell instead, the way ``%%capture`` does.
"""
from __future__ import annotations

import gc
import json
import os
import shlex
import sys
import warnings
from typing import TYPE_CHECKING, Optional

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Float, Int, TraitError, Unicode, Union, observe, validate

from .core.errors import GpuMemWarning
from .oom import capture as observer
from .core.probes import MemoryProbe
from .ledger.recorder import Ledger, Measurement
from .core.units import format_bytes, parse_bytes
from .display.status import status_view
from .free.view import freed_report
from .ledger.view import cell_moved, cell_report_view, cell_view, history_view

# Everything else (the line markers, the chart, the OOM parser and panel, who, free) is imported
# where it is first used: %load_ext must stay fast, and most sessions never need most of it.

if TYPE_CHECKING:  # pragma: no cover
    from IPython.core.interactiveshell import InteractiveShell

__all__ = ["GpuMemMagics", "load", "unload", "current_ledger", "user_namespace"]

_MODES = "status, history [N], chart [widget|html|text], sidebar, who [DEVICE], free [--dry-run], on, off, clear, export PATH"


def _display(obj) -> None:
    from IPython.display import display

    display(obj)


def _exception_marker():
    """Something that changes whenever IPython records a new error in ``sys.last_value``.

    Exceptions cannot be weakly referenced and we must not keep one alive, so the marker is the
    object's id and type: a new error replaces the old one while both are alive, so its id differs.
    """
    value = getattr(sys, "last_value", None)
    return None if value is None else (id(value), type(value))


class _Plan:
    """What ``%%gpumem`` asked for, parsed from its line."""

    __slots__ = ("lines", "output", "devices", "host_only", "offset", "source_lines", "device_text")

    def __init__(self, lines=False, output=None, devices=None, host_only=False, device_text=None):
        self.lines = lines
        self.output = output
        self.devices = devices
        self.host_only = host_only
        self.device_text = device_text
        self.offset = 0
        self.source_lines = None


class _Frame:
    """One ``run_cell`` in flight (cells nest: ``%%capture``, ``%rerun``, ``run_cell`` calls)."""

    __slots__ = ("info", "measurement", "plan", "tracer", "marker", "reported_inside")

    def __init__(self, info, measurement, plan, tracer, marker):
        self.info = info
        self.measurement = measurement
        self.plan = plan
        self.tracer = tracer
        self.marker = marker
        self.reported_inside = False


def _parse_device(text: str):
    """``-d`` value -> (cuda indices or None, host_only). Raises UsageError with the fix."""
    value = text.strip().lower()
    if value in ("host", "cpu"):
        return (), True
    if value in ("cuda", "all", "gpu"):
        return None, False
    if value.startswith("cuda:"):
        value = value[5:]
    if value.isdigit():
        return (int(value),), False
    raise UsageError(f"unknown device {text!r}: use cuda:N (e.g. -d cuda:0), cuda for all GPUs, or host")


@magics_class
class GpuMemMagics(Magics):
    """``%gpumem`` and ``%%gpumem``; configure with ``%config GpuMemMagics`` (see the module docstring)."""

    threshold = Union(
        [Int(), Unicode()],
        default_value="16 MiB",
        help=(
            "Show the one-line summary after a cell when allocated, reserved or the peak moved by at "
            "least this much (host RSS on a machine without a GPU). A size such as '16 MiB' or bytes."
        ),
    ).tag(config=True)
    track_peaks = Bool(
        True,
        help=(
            "Measure each cell's own peak. To do so ipy_gpumem resets torch's peak counters "
            "(torch.cuda.reset_peak_memory_stats) before every cell, which also resets the values "
            "your code reads with torch.cuda.max_memory_allocated(); on Linux it also resets the "
            "process's peak RSS (VmHWM). Set False to leave all peak counters alone: peaks are then "
            "the highest values sampled."
        ),
    ).tag(config=True)
    quiet = Bool(False, help="Record every cell but never print the per-cell line.").tag(config=True)
    devices = Unicode(
        "all", help="CUDA devices to watch: 'all' (every device your code initialized) or indices like '0,1'."
    ).tag(config=True)
    history_size = Int(10_000, help="How many cell records to keep; the oldest are dropped.").tag(config=True)
    oom_panel = Bool(
        True,
        help=(
            "When a cell fails with any out-of-memory error, show after its traceback what was asked "
            "for, the device's memory in layers, who holds it, what earlier cells left behind, and "
            "the changes that fix it."
        ),
    ).tag(config=True)
    sample_rate = Float(
        4.0,
        help=(
            "While a live chart is open, how many times per second a background thread reads memory "
            "(about 0.1% of one core at 4). 0 updates the chart at cell boundaries only. The chart "
            "redraws at most once a second."
        ),
    ).tag(config=True)

    def __init__(self, shell=None, probe: Optional[MemoryProbe] = None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.probe = probe if probe is not None else MemoryProbe()
        self._cache_config()
        self.ledger = Ledger(self.history_size)
        self.enabled = True
        self.broken: Optional[str] = None
        self._stack: list = []
        self._armed: Optional[_Plan] = None
        self._line_markers = None  # the AST transformer of --lines cells, made on first use
        # The live chart: created by %gpumem chart / sidebar, fed by the hooks and the sampler.
        self.live = None
        # The allocator's state at the last CUDA out-of-memory (torch's OOM observer, once CUDA is up).
        self._observing = False
        self.last_capture = None

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
        self._device_indices(proposal["value"])  # raises TraitError when unreadable
        return proposal["value"]

    @validate("sample_rate")
    def _check_sample_rate(self, proposal):
        rate = proposal["value"]
        if rate < 0 or rate > 100:
            raise TraitError("GpuMemMagics.sample_rate must be between 0 and 100 samples per second")
        if getattr(self, "live", None) is not None:
            self.live.set_rate(rate)
        return rate

    @validate("history_size")
    def _check_history_size(self, proposal):
        if proposal["value"] < 1:
            raise TraitError("GpuMemMagics.history_size must be at least 1")
        if hasattr(self, "ledger"):
            self.ledger.resize(proposal["value"])
        return proposal["value"]

    @staticmethod
    def _device_indices(text: str):
        text = (text or "all").strip().lower()
        if text in ("all", ""):
            return None
        try:
            return tuple(int(part.strip().replace("cuda:", "")) for part in text.split(",") if part.strip())
        except ValueError:
            raise TraitError(f"GpuMemMagics.devices: {text!r} is not 'all' or a list like '0,1'") from None

    @property
    def threshold_bytes(self) -> int:
        return self._threshold

    @observe("threshold", "devices", "track_peaks", "quiet")
    def _cache_config(self, change=None) -> None:
        # The hooks run around every cell: they read these plain attributes, not the traitlets
        # (a traitlet read costs about as much as one of our syscalls).
        self._threshold = parse_bytes(self.threshold)
        self._watch = self._device_indices(self.devices)
        self._track = self.track_peaks
        self._quiet = self.quiet

    # -- hooks -----------------------------------------------------------------------------------

    def pre_run_cell(self, info=None) -> None:
        self._guarded(self._pre, info)

    def post_run_cell(self, result=None) -> None:
        self._guarded(self._post, result)

    def _guarded(self, step, arg) -> None:
        if self.broken is not None:
            return
        try:
            step(arg)
        except Exception as exc:  # noqa: BLE001 - an ipy_gpumem bug must never cost the user a cell
            try:
                self._stop_after_error(exc)
            except Exception:  # noqa: BLE001 - even the clean-up failing must stay silent here
                self.broken = self.broken or f"{type(exc).__name__}: {exc}"

    def _stop_after_error(self, exc: BaseException) -> None:
        self.broken = f"{type(exc).__name__}: {exc}"
        if self.live is not None:
            self.live.stop_sampler()
        frames = list(self._stack)
        self._stack.clear()
        for frame in frames:
            if frame.tracer is not None:
                self._stop_tracer(frame.tracer)
        warnings.warn(
            f"ipy_gpumem stopped recording after an internal error ({self.broken}). Your cell ran "
            "normally. Run %gpumem on to resume.",
            GpuMemWarning,
            stacklevel=2,
        )

    def _plan_for(self, raw_cell: str) -> Optional[_Plan]:
        """The ``%%gpumem`` request in a cell's leading magic lines, or None."""
        if "%%gpumem" not in raw_cell[:4096]:
            return None
        lines = raw_cell.splitlines()
        blank = 0
        while blank < len(lines) and not lines[blank].strip():
            blank += 1
        magics = []
        for line in lines[blank:]:
            if line.startswith("%%"):
                magics.append(line)
            else:
                break
        for k, line in enumerate(magics):
            arg = _gpumem_args(line)
            if arg is None:
                continue
            plan = self._parse_plan(arg, strict=False)
            if plan is None:
                return None
            # The traced code starts after the magic lines, except that our transformer blanks
            # (rather than removes) the %%gpumem line when it is the last one, keeping numbering.
            plan.offset = blank + len(magics) - (1 if k == len(magics) - 1 else 0)
            plan.source_lines = lines
            return plan
        return None

    def _parse_plan(self, arg: str, strict: bool = True) -> Optional[_Plan]:
        try:
            args = parse_argstring(self.gpumem_cell, arg)
            if args.output is not None and not args.output.isidentifier():
                raise UsageError(f"-o needs a Python name to store the record in, not {args.output!r}")
            devices, host_only = (None, False) if args.device is None else _parse_device(args.device)
        except UsageError:
            if strict:
                raise
            return None
        return _Plan(args.lines, args.output, devices, host_only, args.device)

    def _pre(self, info) -> None:
        raw = getattr(info, "raw_cell", "") or ""
        stack = self._stack
        plan = None
        if self._armed is not None or "%%gpumem" in raw:
            if not any(frame.plan is not None for frame in stack):
                plan = self._armed or self._plan_for(raw)
            self._armed = None
        measurement = tracer = None
        if plan is not None or (not stack and self.enabled):
            devices = self._watch
            host_only = False
            if plan is not None:
                if plan.devices is not None:
                    devices = plan.devices
                host_only = plan.host_only
                if host_only:
                    devices = ()
            measurement = Measurement(
                self.probe,
                cell_id=getattr(info, "cell_id", None),
                source=raw,
                devices=devices,
                track_peaks=self._track,
                detailed=plan is not None,
            )
            if plan is not None and plan.lines:
                from .ledger.lines import LineMarkers, LineTracer

                if self._line_markers is None:
                    self._line_markers = LineMarkers()
                tracer = LineTracer(self.probe, self.shell.user_global_ns, devices, track_peaks=self._track)
                tracer.start()
                # Markers go into the cell's syntax tree, which IPython builds after this hook.
                self._line_markers.armed = True
                if self._line_markers not in self.shell.ast_transformers:
                    self.shell.ast_transformers.append(self._line_markers)
            if measurement.start.devices and not self._observing:
                self._observing = observer.attach(self._on_oom)
            live = self.live
            if live is not None:
                if plan is not None and live.sampler is not None:
                    measurement.samples = []  # the sampler's readings make the report's cell chart
                if not stack:
                    live.cell_started(measurement.start, raw)
        stack.append(_Frame(info, measurement, plan, tracer, _exception_marker()))

    def _stop_tracer(self, tracer) -> None:
        tracer.stop()
        if not any(f.tracer is not None for f in self._stack) and self._line_markers is not None:
            self._line_markers.armed = False
            if self._line_markers in self.shell.ast_transformers:
                self.shell.ast_transformers.remove(self._line_markers)

    def _pop_frame(self, result) -> Optional[_Frame]:
        if not self._stack:
            return None  # an empty cell, or the cell that loaded the extension
        info = getattr(result, "info", None)
        if info is None or self._stack[-1].info is info:
            return self._stack.pop()
        for k in range(len(self._stack) - 1, -1, -1):
            if self._stack[k].info is info:
                # Frames above it never got their post_run_cell (an interrupted nested cell).
                orphans = self._stack[k + 1:]
                del self._stack[k + 1:]
                for orphan in orphans:
                    if orphan.tracer is not None:
                        self._stop_tracer(orphan.tracer)
                return self._stack.pop()
        return None  # post_run_cell of a cell whose pre_run_cell we never saw (an empty cell)

    def _post(self, result) -> None:
        frame = self._pop_frame(result)
        if frame is None or frame.measurement is None:
            return
        if frame.tracer is not None:
            self._stop_tracer(frame.tracer)
        error, message = self._cell_error(result, frame.marker)
        measurement = frame.measurement
        plan = frame.plan
        if frame.tracer is not None:
            tracer = frame.tracer
            measurement.observe_peaks(tracer.host_peak, tracer.device_peaks)
            names = {}
            for index in tracer.device_peaks:
                try:
                    names[index] = self.probe.cuda.properties(index)[0]
                except Exception:  # noqa: BLE001
                    pass
            measurement.lines = tracer.records(plan.source_lines or measurement.source.splitlines(), plan.offset, names)
        outermost = not self._stack
        count = getattr(result, "execution_count", None) if outermost else None
        record = measurement.finish(error, message, execution_count=count)
        if outermost:
            self.ledger.append(record)
        if error is not None and self.oom_panel and (outermost or plan is not None):
            self._explain_oom(record, message, measurement.t0)
        if plan is not None:
            if plan.output:
                self.shell.user_ns[plan.output] = record
            note = frame.tracer.reason if frame.tracer is not None else None
            from .chart.svg import cell_svg

            chart = cell_svg(record, measurement.samples, width=640, height=200)
            _display(cell_report_view(record, plan.source_lines, note=note, chart_html=chart))
            for parent in self._stack:
                parent.reported_inside = True
        elif outermost and not frame.reported_inside and not self._quiet and cell_moved(record, self._threshold):
            _display(cell_view(record, self._threshold))
        if outermost and self.live is not None:
            message = self.live.cell_finished(measurement.end, record)
            if message:
                print(message, file=sys.stderr)

    def _measurement_in_flight(self):
        """The measurement of the cell running now (read from the sampler thread)."""
        try:
            frame = self._stack[-1] if self._stack else None
        except IndexError:  # the main thread popped it meanwhile
            return None
        return None if frame is None else frame.measurement

    # -- out-of-memory -----------------------------------------------------------------------------

    def _on_oom(self, capture) -> None:
        # Runs inside torch's allocator (GIL held, allocator lock released): store, nothing more.
        self.last_capture = capture

    def _explain_oom(self, record, message: Optional[str], started: float) -> None:
        """Show the OOM panel after the user's traceback, if the cell's error is an out-of-memory."""
        if not message:
            return
        from .oom.parse import parse_oom

        oom = parse_oom(message)
        if oom is None:
            return
        from .oom.analysis import analyse
        from .oom.panel import oom_panel

        capture = self.last_capture
        if capture is not None and capture.t < started:
            capture = None  # from an earlier cell
        self.last_capture = None
        try:
            view = oom_panel(analyse(
                oom, record, namespace=self.shell.user_ns, records=self.ledger.records()[-50:], probe=self.probe,
                capture=capture, tb=getattr(sys, "last_traceback", None),
            ))
        except Exception as exc:  # noqa: BLE001 - the user's own error is already shown; say why not more
            print(f"ipy_gpumem: could not explain this out-of-memory error ({type(exc).__name__}: {exc})",
                  file=sys.stderr)
            return
        _display(view)

    @staticmethod
    def _cell_error(result, marker):
        """The class name and message of the cell's error, also when ``%%time`` swallowed it."""
        exc = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
        if exc is None and _exception_marker() not in (None, marker):
            exc = getattr(sys, "last_value", None)
        if exc is None:
            return None, None
        try:
            message = str(exc)
        except Exception:  # noqa: BLE001 - a user __str__ may raise
            message = None
        return type(exc).__name__, message

    # -- magics ----------------------------------------------------------------------------------

    @line_magic("gpumem")
    def gpumem_line(self, line: str = ""):
        """Inspect and control ipy_gpumem's per-cell memory ledger.

        Usage::

            %gpumem                 same as %gpumem status
            %gpumem status          memory now: per device, allocated by PyTorch, reserved but
                                    unallocated, used outside PyTorch (CUDA context, other
                                    processes), free and total; and this process's host RSS
            %gpumem history [N]     a table of the recorded cells (the last N)
            %gpumem chart [KIND]    a live chart of the session: per device allocated, reserved
                                    and device used (host RSS without a GPU), each cell marked
                                    [n] (hover: its first line, deltas, peak), the running cell
                                    highlighted, the capacity drawn. KIND is widget (plotly,
                                    default where widgets work), html (updated in place; Colab's
                                    default) or text (terminal IPython). Asking again moves it.
            %gpumem sidebar         the live chart in JupyterLab's right sidebar (sidecar), with
                                    a live line of numbers left inline; elsewhere, shown inline
            %gpumem who [DEVICE]    who holds the memory: parameters, gradients, optimizer
                                    state, graphs kept by your variables, other tensors,
                                    IPython's caches, and the variables holding them
            %gpumem free [--dry-run]  release what costs you nothing: IPython's last error and
                                    its frames, cached outputs holding tensors, then garbage
                                    collection and the CUDA cache; shows the plan first and
                                    what was freed after. Never deletes a variable of yours.
            %gpumem on | off        resume / pause recording (``on`` also recovers after an
                                    internal error; ``off`` also stops the chart's sampler)
            %gpumem clear           forget the recorded cells
            %gpumem export PATH     write the records to PATH as .json or .csv

        Example::

            In [3]: %gpumem status
            device                allocated by PyTorch  reserved but unallocated  ...
            cuda:0 (Tesla P100)               3.68 GiB                 20.00 MiB  ...

        Configuration: ``%config GpuMemMagics`` (threshold, track_peaks, quiet, devices,
        history_size, sample_rate, oom_panel). When a cell fails with out-of-memory, a panel
        after its traceback explains it (``oom_panel``). From Python: ``ipy_gpumem.history()``, ``ipy_gpumem.last()``.
        """
        try:
            words = shlex.split(line)
        except ValueError as exc:
            raise UsageError(f"%gpumem: {exc}") from None
        mode = words[0].lower() if words else "status"
        rest = words[1:]
        handler = getattr(self, f"_mode_{mode}", None)
        if handler is None:
            raise UsageError(f"%gpumem: unknown mode {mode!r}; use one of: {_MODES} (see %gpumem?)")
        handler(rest)

    def _no_args(self, mode, rest):
        if rest:
            raise UsageError(f"%gpumem {mode} takes no arguments (got {' '.join(rest)!r})")

    def _mode_status(self, rest):
        self._no_args("status", rest)
        sample = self.probe.sample(self._device_indices(self.devices))
        names = {}
        for dev in sample.devices:
            try:
                names[dev.index] = self.probe.cuda.properties(dev.index)[0]
            except Exception:  # noqa: BLE001
                pass
        _display(status_view(sample, names))

    def _mode_history(self, rest):
        limit = None
        if rest:
            if len(rest) > 1 or not rest[0].isdigit():
                raise UsageError("%gpumem history takes an optional number of cells, e.g. %gpumem history 20")
            limit = int(rest[0])
        _display(history_view(self.ledger.records(), limit))

    def _live(self):
        """The live-chart controller, made on the first chart request."""
        if self.live is None:
            from .chart.live import LiveChart

            self.live = LiveChart(self.probe, self.ledger.records, self._measurement_in_flight)
            self.live.sample_rate = self.sample_rate
        return self.live

    def _mode_chart(self, rest):
        from .chart.views import TIERS

        if len(rest) > 1 or (rest and rest[0].lower() not in TIERS):
            raise UsageError(f"%gpumem chart takes an optional kind: {', '.join(TIERS)} (e.g. %gpumem chart html)")
        self._live().show(self.shell, rest[0].lower() if rest else None, run=self.enabled)

    def _mode_sidebar(self, rest):
        from .chart.views import sidebar_unavailable

        self._no_args("sidebar", rest)
        reason = sidebar_unavailable(self.shell)
        if reason is not None:
            self._live().show(self.shell, note=f"{reason}; showing the chart here instead", run=self.enabled)
        else:
            self._live().show_sidebar(run=self.enabled)

    def _mode_who(self, rest):
        if len(rest) > 1:
            raise UsageError("%gpumem who takes an optional device: cuda:N, cuda or cpu (e.g. %gpumem who cuda:0)")
        device = rest[0] if rest else None
        total = None
        if device is not None:
            try:
                indices, host_only = _parse_device(device)
            except UsageError:
                raise UsageError(f"%gpumem who: unknown device {device!r}: use cuda:N, cuda or cpu") from None
            device = "cpu" if host_only else ("cuda" if indices is None else f"cuda:{indices[0]}")
            if indices:
                total = self._allocated_now(indices[0])
        from .who.attribution import who
        from .who.view import who_view

        report = who(self.shell.user_ns, device=device, allocator_total=total)
        _display(who_view(report))

    def _allocated_now(self, index: int) -> Optional[int]:
        cuda, _ = self.probe.cuda.status()
        if cuda is None:
            return None
        try:
            return self.probe.cuda.counters(index)[0]
        except Exception:  # noqa: BLE001
            return None

    def _mode_free(self, rest):
        if rest and rest != ["--dry-run"]:
            raise UsageError("%gpumem free takes only --dry-run (show what would be released, release nothing)")
        dry = bool(rest)
        ns = self.shell.user_ns
        from .who.attribution import who
        from .free.release import plan_release, release

        plan = plan_release(ns, who(ns))
        before = self.probe.sample()
        lines = plan.lines()
        cuda, _ = self.probe.cuda.status()
        steps = ["garbage collection (gc.collect())"]
        if cuda is not None:
            unalloc = sum((d.reserved or 0) - (d.allocated or 0) for d in before.devices)
            steps.append(f"the CUDA allocator's cache (torch.cuda.empty_cache(): {format_bytes(unalloc)} "
                         "reserved but unallocated now)")
        print("ipy_gpumem free " + ("would release" if dry else "releases") + " (never a variable of yours):")
        for line in lines or ["no IPython error or cached output is keeping tensors alive"]:
            print(f"  - {line}")
        print("  then: " + "; ".join(steps))
        if dry:
            print("(dry run: nothing was released)")
            return
        formatters = [f for f in (getattr(self.shell, "InteractiveTB", None),) if f is not None]
        release(plan, ns, getattr(self.shell, "last_execution_result", None), formatters,
                getattr(self.shell, "displayhook", None), getattr(self.shell, "user_ns_hidden", None))
        gc.collect()  # asked for explicitly by %gpumem free
        if cuda is not None:
            cuda.empty_cache()
        after = self.probe.sample()
        print(freed_report(before, after))

    def _mode_on(self, rest):
        self._no_args("on", rest)
        self.enabled = True
        self.broken = None
        if self.live is not None:
            self.live.ensure_sampler()
        print("ipy_gpumem: recording every cell.")

    def _mode_off(self, rest):
        self._no_args("off", rest)
        self.enabled = False
        if self.live is not None:
            self.live.stop_sampler()
        print("ipy_gpumem: recording paused (%%gpumem still measures on request). %gpumem on resumes.")

    def _mode_clear(self, rest):
        self._no_args("clear", rest)
        count = len(self.ledger)
        self.ledger.clear()
        print(f"ipy_gpumem: forgot {count} recorded cell{'s' if count != 1 else ''}.")

    def _mode_export(self, rest):
        if len(rest) != 1:
            raise UsageError("%gpumem export needs one path ending in .json or .csv, e.g. %gpumem export cells.json")
        path = os.path.expanduser(rest[0])
        suffix = os.path.splitext(path)[1].lower()
        if suffix not in (".json", ".csv"):
            raise UsageError(f"%gpumem export: unknown format {suffix or '(none)'!r}; the path must end in .json or .csv")
        records = self.ledger.records()
        try:
            if suffix == ".json":
                with open(path, "w", encoding="utf-8") as fh:
                    json.dump([r.to_dict() for r in records], fh, indent=1)
            else:
                from .core.records import write_csv

                write_csv(path, records)
        except OSError as exc:
            raise UsageError(f"%gpumem export: cannot write {path!r}: {exc.strerror or exc}") from None
        print(f"ipy_gpumem: wrote {len(records)} cell record{'s' if len(records) != 1 else ''} to {path}")

    @magic_arguments()
    @argument("-l", "--lines", action="store_true", help="Also measure every line of the cell: hits, Δallocated, Δreserved, peak within the line, Δhost RSS.")
    @argument("-o", "--output", metavar="NAME", help="Store the CellRecord in the user namespace as NAME.")
    @argument("-d", "--device", metavar="DEVICE", help="Measure only this device: cuda:N, cuda (all GPUs) or host.")
    @cell_magic("gpumem")
    def gpumem_cell(self, line: str, cell: str):
        """Measure one cell in detail: before / after / peak per device and host, optionally per line.

        The cell runs exactly as it would without the magic (its output, its last expression and
        its error are unchanged); the report follows it.

        Example::

            In [4]: %%gpumem --lines -o rec
               ...: x = torch.ones(2**28, device="cuda")
               ...: y = x * 2
               ...: del x
            %%gpumem [4] · 12 ms
                                  before     after         Δ      peak     peak Δ
            cuda:0 allocated     0 bytes  1.00 GiB  +1.00 GiB  2.00 GiB  +2.00 GiB
            ...
            line  hits  Δallocated  Δreserved  peak in line  ...  source
               2     1   +1.00 GiB  +1.00 GiB     +1.00 GiB  ...  x = torch.ones(2**28, device="cuda")

            In [5]: rec.devices[0].peak_increase
            Out[5]: 2147483648

        Per-line deltas are summed over a line's executions (hits), so a loop body line that
        keeps memory each iteration shows the total it kept.
        """
        # Reached only when the input transformer left the line in place: bad arguments (raise
        # UsageError here) or a programmatic run_cell_magic call (measure the body as a nested
        # cell, as %%capture does).
        plan = self._parse_plan(line, strict=True)
        plan.source_lines = cell.splitlines()
        self._armed = plan
        try:
            self.shell.run_cell(cell, store_history=False)
        finally:
            self._armed = None


def _gpumem_args(line: str) -> Optional[str]:
    """The argument string of a ``%%gpumem ...`` line, or None for any other line."""
    if not line.startswith("%%gpumem"):
        return None
    rest = line[len("%%gpumem"):]
    if rest and not rest[0].isspace():
        return None  # %%gpumem? (help) or %%gpumemx
    return rest.strip()


# ---------------------------------------------------------------------------------------------
# The %%gpumem input transformer
# ---------------------------------------------------------------------------------------------


def _make_transformer(magics: GpuMemMagics):
    def strip_gpumem_line(lines):
        """Blank a leading ``%%gpumem`` line so the cell runs as an ordinary cell (see module doc)."""
        try:
            if not lines or not lines[0].startswith("%%gpumem"):
                return lines
            arg = _gpumem_args(lines[0].rstrip("\r\n"))
            if arg is None or magics._parse_plan(arg, strict=False) is None:
                return lines  # bad arguments: let the magic itself raise the UsageError
            if len(lines) > 1 and lines[1].startswith("%%"):
                return lines[1:]  # another cell magic follows: it must stay first
            return ["\n"] + lines[1:]
        except Exception:  # noqa: BLE001 - a raising transformer would cost the user the cell
            return lines

    strip_gpumem_line.has_side_effects = False
    return strip_gpumem_line


# ---------------------------------------------------------------------------------------------
# load / unload
# ---------------------------------------------------------------------------------------------

_ATTR = "_ipy_gpumem_state"


def load(shell: "InteractiveShell") -> None:
    """Register the magics, hooks and transformer once (loading twice changes nothing)."""
    if getattr(shell, _ATTR, None) is not None:
        return
    magics = GpuMemMagics(shell=shell)
    shell.register_magics(magics)
    pre, post = magics.pre_run_cell, magics.post_run_cell
    shell.events.register("pre_run_cell", pre)
    shell.events.register("post_run_cell", post)
    transformer = _make_transformer(magics)
    shell.input_transformers_cleanup.append(transformer)
    setattr(shell, _ATTR, {"magics": magics, "pre": pre, "post": post, "transformer": transformer})


def unload(shell: "InteractiveShell") -> None:
    """Remove exactly what :func:`load` added: hooks, transformer, magics, configurable."""
    state = getattr(shell, _ATTR, None)
    if state is None:
        return
    magics = state["magics"]
    observer.detach()  # torch's observer cannot be removed: it now forwards to nothing
    if magics.live is not None:
        magics.live.close()  # stops the sampler, leaves a static snapshot where each view was
    frames = list(magics._stack)
    magics._stack.clear()
    for frame in frames:
        if frame.tracer is not None:
            magics._stop_tracer(frame.tracer)
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
    delattr(shell, _ATTR)


def _running_shell():
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    return get_ipython()


def current_magics() -> Optional[GpuMemMagics]:
    shell = _running_shell()
    state = getattr(shell, _ATTR, None) if shell is not None else None
    return None if state is None else state["magics"]


def current_ledger() -> Optional[Ledger]:
    """The running shell's ledger, or None when the extension is not loaded."""
    magics = current_magics()
    return None if magics is None else magics.ledger


def user_namespace() -> dict:
    """The running shell's user namespace (for ``ipy_gpumem.who()``)."""
    shell = _running_shell()
    if shell is None:
        raise RuntimeError("no IPython shell is running: pass the namespace, e.g. who(globals())")
    return shell.user_ns
