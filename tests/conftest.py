"""Shared fixtures: a real IPython shell, the loaded extension, and scripted probes.

The scripted probes stand in for a GPU that this machine does not have; they are labelled as
fakes and used to drive the CUDA branches. Host memory is always real.
"""
from __future__ import annotations

import ctypes
import gc
import inspect
import os
import sys
import types

import pytest

from ipy_gpumem.core.probes import CudaProbe, DeviceSample, HostProbe, HostSample, MemoryProbe, Sample

# Torch's OpenMP threads wait for work by spinning (GNU OpenMP's default, OMP_WAIT_POLICY=ACTIVE): between
# the many small operators of a real step driven from Python they keep a core busy, and on a busy machine (two
# pytest workers on two cores) each parallel region waits for a thread that is not running. A real LSTM step
# of the estimate's zoo took 1.4-4.5 s where it takes 0.3 s with passive waiting. The wait policy changes no
# result (the same threads, the same allocations); read when torch loads OpenMP, so set before torch is imported
# (kernels and children inherit it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")


def pytest_collection_modifyitems(config, items):
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch  # noqa: F401 - the tests (not the package) may import torch
        except ImportError:
            torch = None
    has_cuda = bool(torch is not None and torch.cuda.is_available())
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_browser = pytest.mark.skip(reason="browser tests run with IPY_GPUMEM_BROWSER=1")
    pins = _PinsCheck()
    for item in items:
        if pins(item):
            item.add_marker(pytest.mark.pins)
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "browser" in item.keywords and os.environ.get("IPY_GPUMEM_BROWSER") != "1":
            item.add_marker(skip_browser)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # On pytest-xdist workers: the modules that start kernels, servers or forks first (in their
        # own order), so that the longest units are not the last ones left to a single worker; the
        # browser tests last, when the other worker has little left (JupyterLab, Chromium and a
        # kernel miss their timeouts beside another worker's kernels on two starved cores). Every
        # worker sorts the same way, as xdist requires.
        heavy = {item.module.__name__ for item in items if "slow" in item.keywords and item.module is not None}

        def order(item):
            if "browser" in item.keywords:
                return 2
            return 0 if item.module is not None and item.module.__name__ in heavy else 1

        items.sort(key=order)


def pytest_collection_finish(session):
    # Everything imported so far (torch, IPython, the test modules: about a million objects) lives until the
    # end: moved out of the collector's reach, so that the tests' own gc.collect() (teardowns that free a
    # test's tensors before the next one reads RSS) scans what the tests made, not the whole of torch. Only the
    # cyclic collector is affected: reference counting frees as always, and gc.get_referents still sees them.
    gc.freeze()


#: The census's and who()'s time budget where a test checks exactness, not speed: the default (0.75 s) can run out
#: on a loaded machine (the first walk of a process classifies every type it meets), and an incomplete count is
#: not the exact one. The tests of the budget itself pass their own.
EXACT_S = 60.0


#: What the Colab-pinned venv pins (IPython, ipykernel, ipywidgets, plotly, traitlets) and what reaches them: a
#: test that names one of these, in its module's imports or its own body, or that runs an IPython shell (the `ip`
#: fixture, directly or through another fixture), is marked `pins`: CI runs it in that venv too. A test that
#: reaches none (the OOM parser, snapshots, tensor accounting, the Python API's estimates) depends on Python and
#: torch only, which both venvs share: it runs once, in the main venv.
PINNED_NAMES = ("IPython", "ipykernel", "ipywidgets", "plotly", "traitlets", "anywidget", "nbformat", "nbclient",
                "jupyter", "ipy_gpumem.chart", "ipy_gpumem.display", "ipy_gpumem.extension", "ipy_gpumem.cell.commands",
                "kernel_helpers", "browser_helpers", "get_ipython", "run_cell", "run_line_magic", "run_cell_magic")


class _PinsCheck:
    """Whether a collected test reaches what the Colab venv pins (see PINNED_NAMES); one read per module."""

    def __init__(self):
        self._modules = {}

    def __call__(self, item) -> bool:
        if "ip" in getattr(item, "fixturenames", ()) or "compat" in item.keywords:
            return True
        module = getattr(item, "module", None)
        if module is None:
            return True
        if module.__name__ not in self._modules:
            self._modules[module.__name__] = self._module_reaches(module)
        if self._modules[module.__name__]:
            return True
        try:
            source = inspect.getsource(item.function)
        except (OSError, TypeError, AttributeError):
            return True
        return any(name in source for name in PINNED_NAMES)

    @staticmethod
    def _module_reaches(module) -> bool:
        for value in vars(module).values():
            # type() only: test modules hold hostile objects (a __getattribute__ that raises) on purpose
            kind = type(value)
            if issubclass(kind, types.ModuleType):
                name = types.ModuleType.__getattribute__(value, "__name__")
            elif kind in (types.FunctionType, types.BuiltinFunctionType) or issubclass(kind, type):
                name = (type.__getattribute__(value, "__module__") if issubclass(kind, type)
                        else value.__module__)
            else:
                continue
            if isinstance(name, str) and any(name == n or name.startswith(n + ".") for n in PINNED_NAMES):
                return True
        return False


#: Test files whose tests each set up all they use (a kernel or a notebook of their own), spread test by
#: test over the pytest-xdist workers; every other file runs whole on one worker, in its own order, as
#: without xdist (module fixtures made once, tests that share artifacts/browser/ one after the other).
SPREAD_TEST_BY_TEST = ("test_chart_in_kernel.py", "test_notebooks.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduling by file, except the files in SPREAD_TEST_BY_TEST (CI runs ``-n 2``)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def __init__(self, config, log=None):
            config.option.loadscopereorder = False  # keep the order the workers collected (above)
            super().__init__(config, log)

        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return nodeid if os.path.basename(path) in SPREAD_TEST_BY_TEST else path

    return FileScheduling(config, log)


@pytest.fixture(scope="session")
def ip():
    """The process-wide test InteractiveShell (IPython's own testing shell)."""
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    if shell is None:  # already started by another plugin
        from IPython.testing.globalipapp import get_ipython

        shell = get_ipython()
    gc.freeze()  # the shell's own objects too (see pytest_collection_finish)
    return shell


@pytest.fixture
def restore_user_ns(ip):
    """The test shell is shared by the whole suite: names a test makes are removed after it, and names it
    rebound get their earlier objects back (a hostile object left under a common name such as ``w`` broke a
    later test's estimate, which fakes the whole namespace)."""
    before = dict(ip.user_ns)
    yield
    for name in set(ip.user_ns) - set(before):
        ip.user_ns.pop(name, None)
    for name, value in before.items():
        if ip.user_ns.get(name, value) is not value:
            ip.user_ns[name] = value


@pytest.fixture
def default_threshold(request):
    """The tests that use ``gpumem`` run at the default threshold whatever earlier tests configured on the shared
    shell (a module applies it to all its tests: ``pytestmark = pytest.mark.usefixtures("default_threshold")``)."""
    if "gpumem" not in request.fixturenames:
        yield
        return
    magics = request.getfixturevalue("gpumem")
    before = magics.threshold
    magics.threshold = "16 MiB"
    try:
        yield
    finally:
        magics.threshold = before


@pytest.fixture
def gpumem(ip):
    """The extension loaded on the test shell; unloaded (and checked clean) afterwards."""
    ip.run_line_magic("load_ext", "ipy_gpumem")
    magics = ip.magics_manager.registry["GpuMemMagics"]
    try:
        yield magics
    finally:
        ip.run_line_magic("unload_ext", "ipy_gpumem")
        assert "GpuMemMagics" not in ip.magics_manager.registry


class FakeCuda:
    """A scripted stand-in for torch's CUDA counters (no GPU here): a fake, labelled as such.

    ``script`` is a list of ``(allocated, reserved)`` pairs returned by successive reads; peaks
    follow the values since the last reset, exactly like torch's allocator.
    """

    def __init__(self, script, total=16 * 2**30, used_extra=512 * 2**20, name="Fake GPU (test)"):
        self.script = list(script)
        self.pos = 0
        self.total = total
        self.used_extra = used_extra
        self.name = name
        self.peak = [0, 0]
        self.resets = 0
        self.initialized = True

    def _current(self):
        return self.script[min(self.pos, len(self.script) - 1)]

    def advance(self, n=1):
        self.pos += n
        a, r = self._current()
        self.peak = [max(self.peak[0], a), max(self.peak[1], r)]


class ScriptedCudaProbe(CudaProbe):
    """CudaProbe reading a FakeCuda instead of torch (fake: no GPU on this machine)."""

    def __init__(self, fake: FakeCuda):
        super().__init__()
        self.fake = fake

    def status(self):
        return (self, None) if self.fake.initialized else (None, "CUDA not initialized yet")

    def device_indices(self, cuda):
        return [0]

    def counters(self, index):
        a, r = self.fake._current()
        self.fake.peak = [max(self.fake.peak[0], a), max(self.fake.peak[1], r)]
        return a, r, self.fake.peak[0], self.fake.peak[1]

    def reset_peak(self, index):
        self.fake.resets += 1
        self.fake.peak = list(self.fake._current())

    def properties(self, index):
        return (self.fake.name, self.fake.total, None)

    def device_memory(self, index):
        return self.fake._current()[1] + self.fake.used_extra, self.fake.total


@pytest.fixture
def fake_gpu():
    """A MemoryProbe whose CUDA side is scripted (fake) and whose host side is real."""

    def make(script, **kwargs):
        fake = FakeCuda(script, **kwargs)
        return fake, MemoryProbe(HostProbe(), ScriptedCudaProbe(fake))

    return make


def make_sample(t=0.0, rss=None, devices=(), reason=None, peak_rss=None):
    """A Sample built by hand (for pure recorder/render tests)."""
    return Sample(t, HostSample(rss, peak_rss), tuple(devices), reason)


def dev_sample(index=0, allocated=0, reserved=0, peak_allocated=None, peak_reserved=None, used=None, total=None):
    return DeviceSample(index, allocated, reserved,
                        allocated if peak_allocated is None else peak_allocated,
                        reserved if peak_reserved is None else peak_reserved, used, total)


def run(ip, source, store_history=True):
    """Run ``source`` as a real cell of the test shell; return (ExecutionResult, captured output)."""
    from IPython.utils.capture import capture_output

    with capture_output() as cap:
        result = ip.run_cell(source, store_history=store_history)
    return result, cap


def texts(cap):
    """The text/plain of every display in a ``capture_output`` result."""
    return [o.data.get("text/plain", "") for o in cap.outputs]


def htmls(cap):
    """The text/html of every display in a ``capture_output`` result."""
    return [o.data.get("text/html", "") for o in cap.outputs]


def touched(nbytes: int):
    """``nbytes`` of fresh anonymous memory with every page written: RSS grows by that much at once and
    drops when it is freed, whatever malloc holds. (A 48 MiB ``bytearray`` once came back from memory
    the heap had kept resident after earlier tests, and RSS did not move: two tests failed in full
    runs, never alone.)"""
    import mmap

    memory = mmap.mmap(-1, nbytes)
    for offset in range(0, nbytes, mmap.PAGESIZE):
        memory[offset] = 1
    return memory


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.sbrk.restype = ctypes.c_size_t
        libc.sbrk.argtypes = [ctypes.c_ssize_t]
        return libc
    except (OSError, AttributeError):  # not glibc >= 2.33: nothing to plug
        return None


def plug_heap_holes():
    """Take the main heap's free holes of 1 MiB and more (never written: nothing becomes resident); the
    pointers, for :func:`unplug`. One ``mallinfo2`` (it walks the free lists), then a malloc per size tried."""
    libc = _LIBC
    plugs = []
    if libc is None:
        return plugs
    size = libc.mallinfo2().fordblks
    while size >= 2**20 and len(plugs) < 64:
        end_of_heap = libc.sbrk(0)
        pointer = libc.malloc(size)
        if not pointer:
            size //= 2
            continue
        mapped = ctypes.c_size_t.from_address(pointer - ctypes.sizeof(ctypes.c_size_t)).value & 2  # IS_MMAPPED
        if mapped or pointer + size > end_of_heap:  # a mapping of its own, or the heap grew: no hole that large
            libc.free(pointer)
            size //= 2
            continue
        plugs.append(pointer)  # a hole of at least `size`: kept; the next may be as large
    return plugs


def unplug(plugs) -> None:
    for pointer in plugs:
        _LIBC.free(pointer)


@pytest.fixture(autouse=True)
def _heap_holes_plugged():
    """A tensor's pages are its own, as in a fresh process: the main heap's free holes are taken for the test
    (:func:`plug_heap_holes`) and given back after it.

    Tests that build millions of small objects leave the heap with holes of hundreds of MiB once they are
    freed; glibc serves a later large request (a 128 MiB ``torch.ones``) from such a hole instead of a fresh
    mapping, and ``del`` then gives nothing back to the OS. The exact-RSS tests of a worker that ran such a
    test first saw +100 MiB that stayed, or a 64 MiB line that moved nothing (CI dry runs, never alone)."""
    plugs = plug_heap_holes()
    try:
        yield
    finally:
        unplug(plugs)


_LIBC = _libc() if sys.platform.startswith("linux") else None
