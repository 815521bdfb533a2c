"""Turn a finished cell, an OOM, a snapshot, the history or an estimate into the outputs the user sees, in order.

The extension (the one IPython module) hands the presenter what happened and displays what comes
back: a list of :class:`Output` (a view, a raw MIME bundle, or one line of text). Everything the
OOM analysis needs from the session is gathered here, once. In a notebook a report is followed by
its chart as an output of its own (a plotly figure with the SVG picture beside it for viewers
without plotly), so the report's text stays whole; a terminal gets the text alone.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, List, NamedTuple, Optional

from .shell import cell_files, ipython_refs

__all__ = ["Output", "Presenter"]


class Output(NamedTuple):
    """One thing to show: ``kind`` is ``"view"`` (an object with reprs), ``"raw"`` (a MIME bundle) or ``"say"`` (a line)."""

    kind: str
    value: Any


def _view(value) -> Output:
    return Output("view", value)


def _say(text: str) -> Output:
    return Output("say", text)


class Presenter:
    """The outputs of one session's shell; ``ledger``, ``probe`` and ``threshold`` are read when asked (they change)."""

    def __init__(self, shell, ledger, probe: Callable[[], Any], threshold: Callable[[], int]):
        self.shell = shell
        self.ledger = ledger
        self._probe = probe
        self._threshold = threshold

    @property
    def in_kernel(self) -> bool:
        from ..chart.views import in_kernel

        return in_kernel(self.shell)

    def refs(self):
        """IPython's own names in the namespace (``Out``, ``_5``, ...): what every walk leaves to IPython."""
        return ipython_refs(self.shell)

    def cells(self) -> dict:
        """Each cell's file name -> its execution count (a snapshot's frames say ``In [7]``)."""
        return cell_files(self.shell)

    def _with_chart(self, out: List[Output], figure: Optional[dict], svg: Callable[[], str], text: str) -> None:
        """In a notebook, the chart after the text, as an output of its own (plotly, the SVG picture beside it)."""
        if figure is None:
            return
        from ..chart.views import figure_output

        out.append(Output("raw", figure_output(figure, svg(), text=text)))

    # -- a finished cell -------------------------------------------------------------------------

    def cell(self, outcome) -> List[Output]:
        """What a finished cell shows: its OOM panel, its ``%%gpumem`` report (with a ``--trace`` recording's
        report after it), or its line.

        A ``--trace`` cell's recording is read first: when the cell died of out-of-memory, the panel
        takes the recorded state at the failure, and the trace's report leaves its own panel out."""
        out: List[Output] = []
        trace = self._read_trace(outcome, out) if outcome.trace is not None else None
        if outcome.oom is not None:
            out.append(_view(self.oom(outcome, trace)))
        if outcome.header is not None:
            out.extend(self.report(outcome))
            if trace is not None:
                out.extend(self.snapshot(trace, panel=outcome.oom is None))  # one OOM panel, not two
            if outcome.trace_note:  # why there is no trace, or what was cut or kept
                out.append(_say(f"ipy_gpumem: {'' if outcome.trace is None else '--trace: '}{outcome.trace_note}"))
        elif outcome.show_line:
            from ..cell.view import cell_view

            out.append(_view(cell_view(outcome.record, self._threshold())))
        if outcome.chart_message:
            out.append(_say(outcome.chart_message))
        return out

    def report(self, outcome) -> List[Output]:
        """The ``%%gpumem`` report, then (in a notebook) its chart."""
        from ..cell.view import cell_report_view

        record, samples = outcome.record, outcome.measurement.samples
        out = [_view(cell_report_view(record, outcome.header.source_lines, stopped=outcome.stopped,
                                      counted=outcome.counted))]
        if self.in_kernel:
            from ..chart.figures.cell import cell_figure
            from ..chart.svg import IMG_INK, cell_svg

            self._with_chart(out, cell_figure(record, samples),
                             lambda: cell_svg(record, samples, width=640, height=200, ink=IMG_INK),
                             f"(chart of {record.label})")
        return out

    def _read_trace(self, outcome, out: List[Output]):
        """The allocator's events of a ``--trace`` cell, read as any snapshot is (its lines named ``In [n]``); None
        (said in one line) when they cannot be read."""
        from ..snapshots import SnapshotError
        from ..snapshots.view import open_snapshot

        try:
            report = open_snapshot(outcome.trace, cells=self.cells())
        except SnapshotError as exc:
            out.append(_say(f"ipy_gpumem: --trace: {exc}"))
            return None
        report.source = f"of In [{outcome.record.execution_count}]" if outcome.record.execution_count else "of the cell"
        return report

    def oom(self, outcome, trace=None):
        """The OOM panel: the analysis gathers the session's state here; with a ``--trace`` recording of the cell,
        from the allocator's recorded state at the failure."""
        from ..oom.analysis import analyse
        from ..oom.panel import oom_panel

        recorded = trace.recorded_ooms(source="the cell's allocator trace") if trace is not None else ()
        record = outcome.record
        failure, rss = record.rank_failure, None  # a launched process's out-of-memory (issue 20)
        for rank in record.ranks or ():
            if failure is not None and rank.pid == failure.pid:
                rss = rank.host.peak_rss
        analysis = analyse(outcome.oom, record, namespace=self.shell.user_ns, records=self.ledger.tail(50),
                           probe=self._probe(), capture=outcome.capture, tb=getattr(sys, "last_traceback", None),
                           refs=self.refs(), recorded=recorded, rank=failure, rank_rss=rss)
        return oom_panel(analysis)

    # -- the modes -------------------------------------------------------------------------------

    def status(self, devices):
        """``%gpumem``: each watched device's memory now, and the host's."""
        from ..core.memory import DeviceMemory
        from ..display.status import status_view
        from ..oom import capture

        probe = self._probe()
        sample = probe.sample(devices)
        names = {}
        for dev in sample.devices:
            try:
                names[dev.index] = probe.cuda.properties(dev.index)[0]
            except Exception:  # noqa: BLE001 - a name is a nicety
                pass
        note = capture.describe() if sample.devices else None  # about CUDA: only where CUDA is up
        return status_view([DeviceMemory.from_sample(d) for d in sample.devices], sample.host.rss,
                           reason=sample.reason, names=names, notes=[note] if note else [])

    def _kept(self):
        """What IPython keeps of the last error: its last result and its traceback formatter (an error it could
        not format is kept only there)."""
        formatters = [f for f in (getattr(self.shell, "InteractiveTB", None),) if f is not None]
        return getattr(self.shell, "last_execution_result", None), formatters

    def who(self, device):
        """``%gpumem who``: who holds the memory (of ``device``), measured against the allocator's total."""
        from ..attribution.view import who_view
        from ..attribution.who import who
        from ..free.release import kept_errors

        total = None
        if device is not None and device.is_cuda and device.index is not None:
            for dev in self._probe().sample([device.index]).devices:
                total = dev.allocated
        last, formatters = self._kept()
        return who_view(who(self.shell.user_ns, device=device, allocator_total=total, refs=self.refs(),
                            errors=kept_errors(last, formatters)))

    def free(self, dry_run: bool):
        """``%gpumem free``: what IPython and the allocator keep for nobody, released (or only listed)."""
        from ..free.release import free_memory
        from ..free.view import free_view

        shell = self.shell
        last, formatters = self._kept()
        return free_view(free_memory(shell.user_ns, self.refs(), self._probe(), dry_run=dry_run, last_result=last,
                                     tb_formatters=formatters, displayhook=getattr(shell, "displayhook", None),
                                     hidden=getattr(shell, "user_ns_hidden", None)))


    def snapshot(self, report, start=None, end=None, device=None, panel: bool = True) -> List[Output]:
        """A snapshot's report, then (in a notebook) its chart."""
        if not self.in_kernel:
            return [_view(report.view(start=start, end=end, device=device, panel=panel))]
        from ..snapshots.view import figure_bundle

        return [_view(report.view(start=start, end=end, device=device, chart=False, panel=panel)),
                Output("raw", figure_bundle(report, start, end, device))]

    def open_snapshot(self, path, device):
        """``%gpumem snapshot``'s file, read (its frames named ``In [n]``), and the index of ``device`` in it;
        a ``CommandError`` in one line when it cannot be read or has no such device."""
        from ..cell.commands import CommandError
        from ..snapshots import SnapshotError
        from ..snapshots.view import open_snapshot

        try:
            report = open_snapshot(path, cells=self.cells())
        except SnapshotError as exc:
            raise CommandError(f"%gpumem snapshot: {exc}") from None
        index = device.index if device is not None else None
        if index is not None and index not in report.replays:
            kind = device.type  # a snapshot file names no backend: the kind the user typed
            raise CommandError(f"%gpumem snapshot: {report.source} has no {kind}:{index}; it has "
                               + ", ".join(f"{kind}:{d}" for d in sorted(report.replays)))
        return report, index

    def history(self, records) -> List[Output]:
        """The history table, then (in a notebook) its chart: one column per cell."""
        from ..cell.view import history_view

        out = [_view(history_view(records))]
        if records and self.in_kernel:
            from ..chart.figures.history import history_figure
            from ..chart.svg import IMG_INK, history_svg

            self._with_chart(out, history_figure(records), lambda: history_svg(records, 720, 220, ink=IMG_INK),
                             f"(chart of {len(records)} recorded cells)")
        return out

    def estimate_cell(self, source: str, gpu) -> tuple:
        """``%%gpumem --estimate``: the cell's code run twice on fake copies of the objects it reads, never for
        real: ``(outputs, the CellEstimate)``, or ``(one line saying why not, None)``."""
        from ..cell.commands import NO_TORCH
        from ..preflight.cell import estimate_cell
        from ..preflight.result import EstimateError

        try:
            result = estimate_cell(source, self.shell.user_ns, gpu=gpu, first_line=2)
        except EstimateError as exc:
            return [_say(f"%%gpumem --estimate: {exc}")], None
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("torch"):
                raise
            return [_say(NO_TORCH)], None
        return self.estimate(result), result

    def estimate(self, result) -> List[Output]:
        """A ``%%gpumem --estimate`` table, then (in a notebook) its lines drawn."""
        from ..preflight.view import estimate_view

        out = [_view(estimate_view(result))]
        if self.in_kernel:
            from ..chart.figures.estimate import estimate_figure
            from ..chart.svg import IMG_INK, estimate_svg

            self._with_chart(out, estimate_figure(result), lambda: estimate_svg(result, 640, 220, ink=IMG_INK),
                             "(chart of the estimate's lines)")
        return out
