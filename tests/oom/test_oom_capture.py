"""The OOM capture: attached once per process (also when CUDA comes up mid-cell), never on cudaMallocAsync.

torch's CPU build has no CUDA OOM observer, so these tests drive the module with a stand-in torch
(a FAKE, labelled as such) shaped like torch._C's API and torch.cuda's lazy-init queue; the real
observer runs in test_gpu.py on a GPU machine.
"""
import sys
import types

import pytest

from ipy_gpumem.oom import capture


class FakeTorch(types.ModuleType):
    """A stand-in torch (fake): CUDA initializes on demand and runs queued calls, as torch does."""

    def __init__(self, initialized=True, backend="native", has_observer=True):
        backend_name = backend
        super().__init__("torch")
        self.attached = []
        self.queued = []
        self.backend_reads = 0
        self._initialized = initialized
        stats = {"allocated_bytes": {"all": {"current": 11, "peak": 12}},
                 "reserved_bytes": {"all": {"current": 14, "peak": 15}}}

        def read_backend():
            self.backend_reads += 1
            return backend_name

        def attach(fn):
            if backend_name != "native":
                raise RuntimeError("cudaMallocAsync does not yet support attachOutOfMemoryObserver")
            self.attached.append(fn)

        c = types.SimpleNamespace(_cuda_memoryStats=lambda device: stats, _cuda_getAllocatorBackend=read_backend)
        if has_observer:
            c._cuda_attach_out_of_memory_observer = attach
        self._C = c
        self.cuda = types.SimpleNamespace(is_initialized=lambda: self._initialized, _lazy_call=self._lazy_call)

    def _lazy_call(self, fn):
        if self._initialized:
            fn()
        else:
            self.queued.append(fn)

    def init_cuda(self):
        """What torch.cuda._lazy_init does: initialize, then run the queued calls."""
        self._initialized = True
        for fn in self.queued:
            fn()  # torch turns an exception here into DeferredCudaCallError for the user


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(capture, "_STATE", {"state": "new", "target": None, "reason": None})

    def install(**kwargs):
        torch = FakeTorch(**kwargs)
        monkeypatch.setitem(sys.modules, "torch", torch)
        return torch

    return install


def test_attached_once_and_forwarding_to_the_latest_target(fresh):
    torch = fresh()
    seen_a, seen_b = [], []
    assert capture.watch(seen_a.append)
    assert capture.watch(seen_b.append)  # a reload: same observer, new target
    assert len(torch.attached) == 1 and capture.state() == "attached"
    torch.attached[0](0, 2 * 2**30, 16 * 2**30, 100)  # what torch's allocator calls
    assert seen_a == [] and len(seen_b) == 1
    cap = seen_b[0]
    assert (cap.device, cap.requested, cap.limit, cap.device_free, cap.allocated, cap.reserved) == (
        0, 2 * 2**30, 16 * 2**30, 100, 11, 14)
    capture.unwatch(seen_b.append)
    torch.attached[0](0, 1, 2, 3)  # unloaded: the observer does nothing
    assert len(seen_b) == 1 and not capture.attached()


def test_an_observer_waits_for_cuda_and_catches_the_first_cuda_cells_oom(fresh):
    torch = fresh(initialized=False)
    seen = []
    assert capture.watch(seen.append) and capture.state() == "queued"
    assert torch.attached == []  # nothing touched CUDA
    torch.init_cuda()  # the user's first CUDA op, in the same cell that then runs out of memory
    assert len(torch.attached) == 1 and capture.state() == "attached"
    torch.attached[0](0, 5, 6, 7)
    assert len(seen) == 1


def test_cuda_malloc_async_is_read_from_torch_and_never_retried(fresh):
    torch = fresh(backend="cudaMallocAsync")
    for _ in range(5):
        assert capture.watch(lambda c: None)  # every cell asks; torch is asked once
    assert capture.state() == "unsupported" and torch.backend_reads == 1 and torch.attached == []


def test_a_queued_attach_never_breaks_cuda_initialization(fresh):
    torch = fresh(initialized=False, backend="cudaMallocAsync")
    capture.watch(lambda c: None)
    torch.init_cuda()  # must not raise: torch would turn it into DeferredCudaCallError
    assert capture.state() == "unsupported"


def test_a_raising_target_never_reaches_the_allocator(fresh):
    torch = fresh()

    def boom(_capture):
        raise KeyboardInterrupt  # even a BaseException stays in the callback

    capture.watch(boom)
    torch.attached[0](0, 1, 2, 3)  # must not raise inside torch's allocator


def test_no_torch_means_try_later_and_a_cpu_build_means_never(fresh, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert capture.watch(lambda c: None) is False and capture.state() == "new"
    torch = fresh()
    torch._C._has_cuda = False
    assert capture.watch(lambda c: None) is True and capture.state() == "unsupported"


def test_status_says_whether_an_oom_will_be_captured(fresh):
    assert capture.describe() is None  # nothing known before torch
    torch = fresh(initialized=False)
    capture.watch(lambda c: None)
    assert "waiting for CUDA" in capture.describe()
    torch.init_cuda()
    assert capture.describe().startswith("out-of-memory capture: on")


def test_status_names_the_allocator_that_has_no_observer(fresh):
    fresh(backend="cudaMallocAsync")
    capture.watch(lambda c: None)
    assert "cudaMallocAsync allocator has no out-of-memory observer" in capture.describe()
