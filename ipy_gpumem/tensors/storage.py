"""The memory behind a tensor, counted once: its storages' keys, sizes and devices, whatever kind of tensor it is.

A storage is identified by its device and data pointer, so views, tied weights and two tensors
made from one numpy array count once. A tensor owns memory through one storage (dense tensors,
strided nested tensors, quantized tensors), through several (a sparse tensor's indices and values,
a per-channel quantized tensor's scales and zero points), or through the tensors it wraps (a
traceable wrapper subclass: a jagged nested tensor's values and offsets, DTensor's local shard,
float8's data and scale, read from its attributes: its ``__tensor_flatten__`` never runs). Meta and
fake tensors own none. A CUDA storage counts as the caching
allocator's block: rounded up to 512 bytes, which is what ``torch.cuda.memory_allocated`` adds.

Every read goes through ``TensorBase``'s and ``StorageBase``'s C descriptors (the adapter's), so a
subclass's Python overrides and ``__torch_function__`` never run.
"""
from __future__ import annotations

from itertools import repeat
from typing import Any, Dict, List, Optional, Tuple

from ..core.devices import HOST, Device, cuda, note_seen

__all__ = ["Storages", "NOTHING", "CUDA_BLOCK_BYTES", "HOST", "device_of", "block_bytes"]

# The CUDA caching allocator hands out blocks whose size is the request rounded up to a
# multiple of kMinBlockSize (512 bytes); ``torch.cuda.memory_allocated`` sums block sizes.
CUDA_BLOCK_BYTES = 512
#: What :meth:`Storages.entry` returns for a storage that owns no memory we count.
NOTHING: tuple = ()
#: Wrapper subclasses nested inside wrappers, followed this deep.
_MAX_WRAP = 4

_DEVICES: Dict[Tuple[str, Optional[int]], Device] = {("cpu", None): HOST}


def device_of(dtype: str, index: Optional[int]) -> Device:
    """The one shared :class:`Device` for a torch device's type and index (so ``id()`` keys are stable)."""
    dev = _DEVICES.get((dtype, index))
    if dev is None:
        if dtype == "cpu":
            dev = HOST
        elif dtype == "cuda" and index is not None:
            dev = cuda(index)
        else:
            dev = Device(dtype, index)
            note_seen(dtype)  # the probes read MPS only once a tensor of this process lives there
        _DEVICES[(dtype, index)] = dev
    return dev


def block_bytes(nbytes: int, dev: Device) -> int:
    """What the storage costs on its device: CUDA rounds to the allocator's 512-byte blocks."""
    if dev.type == "cuda":
        return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return nbytes


Entry = Tuple[Tuple[int, int], int, Device]  # ((id of Device, data pointer), bytes, Device)


class Storages:
    """Reads the storages behind tensors for one count (``wanted``: only those on that device).

    Attributes are the C descriptors, for callers that read many tensors at once (``map`` over a
    list of tensors costs no Python step per tensor).
    """

    def __init__(self, api: Any, wanted: Optional[Device] = None):
        self.api = api
        self.wanted = wanted
        base = api.tensor_base
        self.untyped_storage = base.untyped_storage
        self.get_grad_fn = base.grad_fn.__get__
        self.get_grad = base.grad.__get__
        self.get_retains_grad = base.retains_grad.__get__
        self.get_layout = base.layout.__get__
        self.get_is_cpu = base.is_cpu.__get__
        self.get_is_cuda = base.is_cuda.__get__
        self.get_is_quantized = base.is_quantized.__get__
        self.get_device = base.get_device
        try:  # what a view was made from (None for a tensor that is not a view)
            self.get_base = base.__dict__["_base"].__get__
        except Exception:  # noqa: BLE001 - another torch: no view is traced back to its parameter
            self.get_base = lambda t: None
        storage_base = api.storage_base
        try:  # the C descriptors behind UntypedStorage's device, nbytes() and data_ptr()
            self.storage_device = storage_base.__dict__["device"].__get__
            self.storage_nbytes = storage_base.__dict__["nbytes"]
            self.storage_ptr = storage_base.__dict__["data_ptr"]
        except Exception:  # noqa: BLE001 - another torch: every tensor takes the careful path
            self.storage_device = None
            self.storage_nbytes = lambda st: st.nbytes()
            self.storage_ptr = lambda st: st.data_ptr()
        self.torch_devices: Dict[Any, Device] = {}  # torch.device -> Device, for bulk reads
        self.memo: Dict[int, Tuple[Any, List[Entry]]] = {}  # id(tensor) -> (tensor, entries), for one count

    # -- one storage ------------------------------------------------------------------------------
    def entry(self, storage: Any) -> Any:
        """One storage's ``(key, bytes, device)``.

        ``NOTHING`` for a storage that owns no memory here (meta or fake, empty, or on another
        device than wanted); None for one that cannot be read (the "storage" of a wrapper
        subclass), whose parts are then looked at.
        """
        try:
            device = storage.device
            dtype, index = device.type, device.index
            if dtype == "meta":  # meta and fake tensors own no memory
                return NOTHING
            nbytes = storage.nbytes()
            if nbytes <= 0:
                return NOTHING
            ptr = storage.data_ptr()
        except Exception:  # noqa: BLE001
            return None
        if not ptr:
            return None
        dev = device_of(dtype, index)
        if self.wanted is not None and not self.wanted.covers(dev):
            return NOTHING
        return (id(dev), ptr), block_bytes(nbytes, dev), dev

    # -- one tensor -------------------------------------------------------------------------------
    def entries(self, t: Any, depth: int = 0) -> List[Entry]:
        """``[(key, bytes, device)]`` of every storage behind ``t`` (none for meta, fake or empty).

        Remembered per tensor for the life of this reader (one count), so a parameter reached
        through its module and its optimizer is read once.
        """
        known = self.memo.get(id(t))
        if known is not None and known[0] is t:
            return known[1]
        out = self._fast(t)
        if out is None:
            out = self._entries(t, depth)
        self.memo[id(t)] = (t, out)
        return out

    def _fast(self, t: Any) -> Optional[List[Entry]]:
        """The usual tensor (dense, on the CPU or one CUDA device, not quantized) through C
        descriptors only, without a ``torch.device`` object; None for anything else."""
        try:
            if self.get_is_cpu(t):
                dev = HOST
            elif self.get_is_cuda(t):
                dev = cuda(self.get_device(t))
            else:
                return None
            if self.get_is_quantized(t):
                return None
            storage = self.untyped_storage(t)
            ptr = self.storage_ptr(storage)
            nbytes = self.storage_nbytes(storage)
        except Exception:  # noqa: BLE001 - sparse, wrappers, an odd subclass: the careful path
            return None
        if not ptr:
            return None  # a fake or meta tensor on a "cpu" device, or an empty one: the careful path
        if nbytes <= 0:
            return []
        if self.wanted is not None and not self.wanted.covers(dev):
            return []
        return [((id(dev), ptr), block_bytes(nbytes, dev), dev)]

    def bulk(self, tensors: List[Any]) -> Optional[List[Entry]]:
        """One entry per tensor, read with ``map`` over C descriptors when every tensor is a plain
        CPU tensor with real memory (the usual parameters, gradients and optimizer state); None
        otherwise (the caller then reads them one by one)."""
        if not tensors:
            return []
        try:
            if not all(map(self.get_is_cpu, tensors)) or any(map(self.get_is_quantized, tensors)):
                return None
            storages = list(map(self.untyped_storage, tensors))
            ptrs = list(map(self.storage_ptr, storages))
            nbytes = list(map(self.storage_nbytes, storages))
        except Exception:  # noqa: BLE001
            return None
        if not all(ptrs) or min(nbytes) <= 0:
            return None
        if self.wanted is not None and not self.wanted.covers(HOST):
            return None
        host = id(HOST)
        return list(zip(zip(repeat(host), ptrs), nbytes, repeat(HOST)))

    def _entries(self, t: Any, depth: int) -> List[Entry]:
        try:
            entry = self.entry(self.untyped_storage(t))
        except Exception:  # noqa: BLE001 - sparse layouts and wrapper subclasses have no storage
            entry = None
        if entry is NOTHING:
            return []
        out = [] if entry is None else [entry]
        api = self.api
        for part in api.quantizer_tensors(t) if entry is not None else self._parts(t, depth):
            try:
                found = self.entry(self.untyped_storage(part))
            except Exception:  # noqa: BLE001
                found = None
            if found is None and depth < _MAX_WRAP:
                out.extend(self._entries(part, depth + 1))  # a wrapper inside a wrapper
            elif found:
                out.append(found)
        return out

    def _parts(self, t: Any, depth: int) -> tuple:
        """What a tensor without a readable storage is made of: sparse parts, or a wrapper's inner tensors."""
        api = self.api
        try:
            parts = api.component_tensors(t, self.get_layout(t))
        except Exception:  # noqa: BLE001
            parts = ()
        if parts:
            return parts
        # A wrapper subclass (NJT, DTensor, float8, a user's): the tensors it keeps as attributes,
        # read without running its ``__tensor_flatten__`` (a user's subclass's method is user code).
        return tuple(api.inner_tensors(t))

    def nbytes(self, t: Any) -> int:
        """The bytes of every storage behind ``t``."""
        return sum(nbytes for _key, nbytes, _dev in self.entries(t))

    def device(self, device: Any) -> Optional[Device]:
        """Our :class:`Device` for a ``torch.device`` (None for meta: it owns no memory), remembered."""
        dev = self.torch_devices.get(device)
        if dev is not None:
            return dev
        try:
            dtype, index = device.type, device.index
        except Exception:  # noqa: BLE001
            return None
        if dtype == "meta":
            return None
        dev = self.torch_devices[device] = device_of(dtype, index)
        return dev
