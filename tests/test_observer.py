"""The OOM observer: attached once per process, forwards to the current target, never raises.

torch's CPU build has no CUDA OOM observer, so these tests drive the module with a stand-in torch
(a fake, labelled as such) shaped like torch._C's API; the real observer runs in test_gpu.py.
"""
import types

import pytest

from ipy_gpumem.oom import capture as observer


@pytest.fixture
def fake_torch(monkeypatch):
    """A stand-in torch whose CUDA is 'up' and whose _C records attached observers (fake)."""
    attached = []
    stats = {"allocated_bytes": {"all": {"current": 11, "peak": 12}}, "reserved_bytes": {"all": {"current": 14, "peak": 15}}}
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_initialized=lambda: True)
    torch._C = types.SimpleNamespace(_cuda_attach_out_of_memory_observer=attached.append,
                                     _cuda_memoryStats=lambda device: stats)
    monkeypatch.setitem(__import__("sys").modules, "torch", torch)
    monkeypatch.setitem(observer._STATE, "attached", False)
    monkeypatch.setitem(observer._STATE, "target", None)
    return attached


def test_attached_once_and_forwarding_to_the_latest_target(fake_torch):
    seen_a, seen_b = [], []
    assert observer.attach(seen_a.append)
    assert observer.attach(seen_b.append)  # a reload: same observer, new target
    assert len(fake_torch) == 1
    fake_torch[0](0, 2 * 2**30, 16 * 2**30, 100)  # what torch's allocator calls
    assert seen_a == [] and len(seen_b) == 1
    cap = seen_b[0]
    assert (cap.device, cap.requested, cap.limit, cap.device_free, cap.allocated, cap.reserved) == (
        0, 2 * 2**30, 16 * 2**30, 100, 11, 14)
    observer.detach()
    fake_torch[0](0, 1, 2, 3)  # unloaded: the observer does nothing
    assert len(seen_b) == 1 and not observer.attached()


def test_a_raising_target_never_reaches_the_allocator(fake_torch):
    def boom(capture):
        raise RuntimeError("bug in our callback")

    observer.attach(boom)
    fake_torch[0](0, 1, 2, 3)  # must not raise inside torch's allocator


def test_no_torch_or_no_cuda_means_no_observer(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "torch", raising=False)
    assert observer.attach(lambda c: None) is False
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_initialized=lambda: False)
    torch._C = types.SimpleNamespace()
    monkeypatch.setitem(__import__("sys").modules, "torch", torch)
    assert observer.attach(lambda c: None) is False
