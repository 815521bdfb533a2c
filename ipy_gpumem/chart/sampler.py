"""A daemon thread that samples memory at a fixed rate and asks for redraws less often.

The sampler only reads the probe (which never imports torch nor initializes CUDA) and calls the
callbacks it was given; it never prints and never lets an exception out of its thread. The first
error stops it, is kept in :attr:`Sampler.error`, and is reported once through ``on_error``.

Time comes from an injectable ``clock`` and the thread sleeps through an injectable ``wait``, so
tests drive the schedule on a fake clock instead of sleeping through real timing windows.
"""
from __future__ import annotations

import atexit
import math
import threading
import time
from typing import Callable, Optional

__all__ = ["Sampler", "MIN_INTERVAL", "MAX_INTERVAL"]

#: Below this, a Python thread spends more time waking up than sampling.
MIN_INTERVAL = 0.001
#: Above this an interval means "practically never" and only risks overflowing a timeout.
MAX_INTERVAL = 86400.0
#: The longest single sleep: a longer wait is taken in steps (``threading.TIMEOUT_MAX`` is
#: platform-dependent and a huge timeout raises OverflowError).
MAX_WAIT = 60.0


def _checked(value: float, name: str) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not (MIN_INTERVAL <= value <= MAX_INTERVAL) or not math.isfinite(value):  # also rejects NaN
        raise ValueError(f"{name} must be between {MIN_INTERVAL:g} and {MAX_INTERVAL:g} s, got {value!r}")
    return value


class Sampler:
    """Call ``probe.sample()`` every ``interval`` seconds on a daemon thread.

    Args:
        probe: anything with ``sample(with_device_memory=...)``, usually a
            :class:`~ipy_gpumem.core.probes.MemoryProbe`.
        interval: seconds between samples (settable while running).
        on_sample: called with each sample, on the sampler thread (e.g. ``Timeline.add``).
        redraw_interval: least seconds between two ``on_redraw`` calls (settable while running).
        on_redraw: called without arguments at most every ``redraw_interval`` seconds, after a
            sample; whether anything changed is the callback's business (``Timeline.version``).
        name: the thread's name.
        on_error: called once with :attr:`error` when a probe or callback raised.
        with_device_memory: passed to ``probe.sample``; False skips the device-wide reads
            (NVML / cudaMemGetInfo) and samples the allocator counters only.
        clock: monotonic seconds (default ``time.perf_counter``).
        wait: ``wait(event, timeout)`` sleeps until ``event`` is set or ``timeout`` seconds pass
            (default ``event.wait``); a fake clock's wait advances the clock instead.

    Attributes:
        error: ``"where: ExceptionClass: message"`` of the error that stopped the thread, or None.
        samples: samples taken since the last :meth:`start`.
        redraws: ``on_redraw`` calls since the last :meth:`start`.
        cpu_seconds: CPU time the sampler thread used since the last :meth:`start`
            (``time.thread_time()`` read inside the thread).
        wall_seconds: wall time the thread has been running since the last :meth:`start`.
    """

    def __init__(
        self,
        probe,
        interval: float = 0.25,
        on_sample: Optional[Callable] = None,
        redraw_interval: float = 1.0,
        on_redraw: Optional[Callable] = None,
        name: str = "ipy_gpumem-sampler",
        on_error: Optional[Callable] = None,
        with_device_memory: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        wait: Optional[Callable] = None,
    ):
        self.probe = probe
        self.on_sample = on_sample
        self.on_redraw = on_redraw
        self.on_error = on_error
        self.name = name
        self.with_device_memory = with_device_memory
        self.clock = clock
        self._wait = wait if wait is not None else (lambda event, timeout: event.wait(timeout))
        self._interval = _checked(interval, "interval")
        self._redraw_interval = _checked(redraw_interval, "redraw_interval")
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()  # set by stop(): the thread exits
        self._wake = threading.Event()  # set by stop() and the interval setters: re-plan now
        self._state_lock = threading.Lock()
        self.error: Optional[str] = None
        self.samples = 0
        self.redraws = 0
        self.cpu_seconds = 0.0
        self.wall_seconds = 0.0

    # -- settings -----------------------------------------------------------------------------

    @property
    def interval(self) -> float:
        """Seconds between samples; a new value takes effect at once, also while waiting."""
        return self._interval

    @interval.setter
    def interval(self, value: float) -> None:
        self._interval = _checked(value, "interval")
        self._wake.set()

    @property
    def redraw_interval(self) -> float:
        """Least seconds between two ``on_redraw`` calls."""
        return self._redraw_interval

    @redraw_interval.setter
    def redraw_interval(self, value: float) -> None:
        self._redraw_interval = _checked(value, "redraw_interval")
        self._wake.set()

    @property
    def running(self) -> bool:
        """True while the sampling thread is alive."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start sampling on a daemon thread; does nothing if already running."""
        with self._state_lock:
            if self.running:
                return
            self._stop.clear()
            self._wake.clear()
            self.error = None
            self.samples = self.redraws = 0
            self.cpu_seconds = self.wall_seconds = 0.0
            thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread = thread
            # At interpreter exit, stop before module globals are torn down under the thread.
            atexit.register(self.stop)
            thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread and wait up to ``timeout`` seconds for it; safe to call repeatedly,
        from ``atexit``, from a callback on the sampler thread, and after KeyboardInterrupt."""
        self._stop.set()
        self._wake.set()
        atexit.unregister(self.stop)  # no-op when not registered; avoids one leak per start()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return  # a callback stopping its own sampler: the loop sees _stop and exits
        thread.join(timeout)
        if not thread.is_alive():
            with self._state_lock:
                if self._thread is thread:
                    self._thread = None

    # -- the thread ---------------------------------------------------------------------------

    def run(self) -> None:
        """The sampling loop, in the calling thread, until :meth:`stop` or an error (``start`` runs
        it on a daemon thread; tests with a fake clock call it directly)."""
        self._stop.clear()
        self._run()

    def _run(self) -> None:
        clock = self.clock
        cpu0, wall0 = time.thread_time(), clock()
        next_sample = wall0
        next_redraw = wall0 + self._redraw_interval
        try:
            while not self._stop.is_set():
                now = clock()
                if now >= next_sample:
                    if not self._step("probe.sample / on_sample", self._sample):
                        break
                    # A fixed schedule, not "interval after the work": the rate does not drift
                    # by the probe's cost. After a stall (laptop sleep), resume from now.
                    next_sample += self._interval
                    if next_sample < now:
                        next_sample = now + self._interval
                    if self.on_redraw is not None and now >= next_redraw:
                        if not self._step("on_redraw", self._redraw):
                            break
                        next_redraw = now + self._redraw_interval
                self.cpu_seconds = time.thread_time() - cpu0
                self.wall_seconds = clock() - wall0
                # Event.wait sleeps in the OS: no busy-wait, and stop() or a new interval wakes it.
                # Long waits are taken in steps: a huge timeout would raise OverflowError.
                self._wait(self._wake, min(MAX_WAIT, max(0.0, next_sample - clock())))
                if self._wake.is_set():
                    self._wake.clear()
                    next_sample = min(next_sample, clock() + self._interval)
                    next_redraw = min(next_redraw, clock() + self._redraw_interval)
        finally:
            self.cpu_seconds = time.thread_time() - cpu0
            self.wall_seconds = clock() - wall0
            if self.error is not None:
                atexit.unregister(self.stop)  # stopped by an error: nothing left to stop at exit

    def _sample(self) -> None:
        sample = self.probe.sample(with_device_memory=self.with_device_memory)
        self.samples += 1
        if self.on_sample is not None:
            self.on_sample(sample)

    def _redraw(self) -> None:
        self.on_redraw()
        self.redraws += 1

    def _step(self, where: str, fn) -> bool:
        """Run one step; on any exception record it, report it once, and return False."""
        try:
            fn()
            return True
        except BaseException as exc:  # noqa: BLE001 - nothing may escape (threading would print it)
            self.error = f"{where}: {type(exc).__name__}: {exc}"
            self._stop.set()
            self._report(self.error)
            return False

    def _report(self, message: str) -> None:
        callback = self.on_error
        if callback is None:
            return
        try:
            callback(message)
        except BaseException:  # noqa: BLE001 - a failing error callback must stay silent too
            pass
