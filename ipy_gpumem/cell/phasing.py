"""The training phases of a whole-cell ``%%gpumem``: start the phase watcher, and read memory at each of its boundaries.

A whole-cell ``%%gpumem`` (no ``--lines``) watches forward / backward / optimizer step / zero_grad
through torch's global hooks for that cell only (``anatomy.phases.PhaseWatcher``), also inside the
functions the cell calls. Each boundary needs a reading: current and peak per device, the peaks
folded into the cell's own and reset so each phase gets its own.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

__all__ = ["start_phases", "phase_reader"]


def _max2(a, b):
    return b if a is None else a if b is None else max(a, b)


def start_phases(probe, measurement, census: Callable):
    """Start watching the phases of the cell ``measurement`` measures; the watcher, or None (torch
    is not imported, or the hooks are unavailable: the phases are an addition, never a failure).

    ``census(extra)`` counts the user's names and the ``extra`` roots (the modules and optimizers
    the phase saw).
    """
    if "torch" not in sys.modules:
        return None
    try:
        from ..anatomy.phases import PhaseWatcher

        def phase_census(modules=(), optimizers=(), tensors=()):
            return census(extra=list(modules) + list(optimizers) + list(tensors))

        # Roles on the first two steps only (the first and the steady one, which the report shows);
        # later steps get their peaks, without a census.
        watcher = PhaseWatcher(phase_reader(probe, measurement), phase_census, every=0)
        watcher.start()
        return watcher
    except Exception:  # noqa: BLE001
        return None


def phase_reader(probe, measurement) -> Callable[[], tuple]:
    """A phase boundary's reading when no line tracer runs: ``(t, {device: (current, peak)})``.

    On Linux the host part is the line tracer's trick: read the peak, reset the mark, read the RSS
    back from it (one ``/proc`` access per boundary).
    """
    host = probe.host
    resets = measurement.peak_rss_reset and host.can_reset_peak
    counters = probe.cuda.counters
    indices = [d.index for d in measurement.start.devices]
    # No device at the start: on a machine with CUDA one may come up during the cell (read the
    # devices each time then); a CPU-only build never has one.
    look = not indices and probe.cuda.device_count() > 0

    def read():
        t = time.perf_counter()
        out, device_peaks, peak_rss = {}, {}, None
        if resets:
            peak = host.peak_rss()
            rss = host.rss_after_reset() if host.reset_peak() else host.rss()
            peak_rss = _max2(peak, rss)
        else:
            rss = host.rss()
            peak_rss = rss
        if rss is not None:
            out["cpu"] = (rss, peak_rss)
        for index in ([d.index for d in probe.sample(measurement.devices).devices] if look else indices):
            try:
                allocated, reserved, peak_a, peak_r = counters(index)
            except Exception:  # noqa: BLE001 - a device that went away: no reading
                continue
            own = index in measurement.reset_devices
            peak = _max2(peak_a, allocated) if own else allocated
            out[f"cuda:{index}"] = (allocated, peak)
            device_peaks[index] = (peak, _max2(peak_r, reserved) if own else reserved)
            if own and (peak_a != allocated or peak_r != reserved):
                try:
                    probe.cuda.reset_peak(index)
                except Exception:  # noqa: BLE001
                    pass
        measurement.observe_peaks(peak_rss, device_peaks)
        return t, out

    return read

