"""Inside the sealed child only: a torch DataLoader with worker processes read as with ``num_workers=0``, and the notes that say so.

Why: worker processes cannot start in a sealed copy (no new process may), and the workers a
``persistent_workers`` loader or an iterator made before the estimate already has belong to the
user's process, not to the copy (asking them anything fails: "can only test a child process").
Reading the batches in the step's own thread gives the same batches (same dataset, sampler and
collate function; a shuffle draws its order from the copy's random state), hence the same
tensors and memory: only the time differs, which an estimate does not measure.

So, in the child (whose objects are its own copies), ``DataLoader.__iter__`` sets ``num_workers``
to 0 on a loader that has workers before iterating it, and an iterator with workers made before
the run reads its next batches itself. Which indices its workers were already given is not in
the copy (they went to the workers' queues), so it reads a fresh pass of its sampler, skipping as
many batches as it has given: the same batches for a sequential sampler, batches of the same
shapes for a shuffled one (a stream of an IterableDataset starts again). Pinned memory is left
off (pinning would touch CUDA). Each loader read so is one note.

The loader's bookkeeping (the seed it draws when an iterator starts, the sampler's shuffled
indices) runs outside the fake tensors: those are small real CPU tensors, no part of the step's
GPU memory, and a fake index has no value (the estimate would note a "value read" on the ``for``
line and read batch 0 over and over). The batches themselves are made on the fakes.
"""
from __future__ import annotations

import sys
from typing import List

__all__ = ["read_without_workers", "notes"]

_NOTES: List[str] = []


def notes() -> List[str]:
    """The notes of this run: one per DataLoader configuration read without its workers."""
    return list(_NOTES)


def _note(line: str) -> None:
    if line not in _NOTES:
        _NOTES.append(line)


def read_without_workers() -> None:
    """Patch torch's DataLoader classes in this (sealed) process; nothing when torch.utils.data is not imported."""
    _NOTES.clear()
    module = sys.modules.get("torch.utils.data.dataloader")
    if module is None or getattr(module, "_ipy_gpumem_no_workers", False):
        return
    loader_cls = module.DataLoader
    single_cls = module._SingleProcessDataLoaderIter
    multi_cls = module._MultiProcessingDataLoaderIter
    kinds = module._DatasetKind
    real_iter = loader_cls.__iter__
    base_cls = module._BaseDataLoaderIter
    real_next_index = base_cls._next_index

    def __iter__(self):
        workers = self.num_workers
        if workers and workers > 0:
            persistent = " and persistent_workers=True" if self.persistent_workers else ""
            _note(f"a DataLoader with num_workers={workers}{persistent} was read in the sealed copy as with "
                  "num_workers=0 (worker processes cannot start there): the same batches, in this thread")
            self.num_workers = 0  # the copy's loader: the user's keeps its workers
            self.timeout = 0
            self._iterator = None
        with _real_tensors():
            iterator = real_iter(self)
        iterator._pin_memory = False
        return iterator

    def _next_index(self):
        with _real_tensors():
            return real_next_index(self)

    def own_batches(self):
        single = self.__dict__.get("_ipy_gpumem_single")
        if single is None:
            _note(f"an iterator over a DataLoader with {self._num_workers} workers, made before the estimate, was "
                  f"read in the sealed copy without them: a fresh pass of its sampler, past the {self._num_yielded} "
                  "batches it had given (batches of the same shapes)")
            single = single_cls.__new__(single_cls)
            single.__dict__.update(self.__dict__)
            single._num_workers, single._pin_memory, single._timeout = 0, False, 0
            single._dataset_fetcher = kinds.create_fetcher(self._dataset_kind, self._dataset, self._auto_collation,
                                                           self._collate_fn, self._drop_last)
            with _real_tensors():
                single._sampler_iter = iter(self._index_sampler)
                if self._dataset_kind == kinds.Map:
                    for _ in range(self._num_yielded):
                        if next(single._sampler_iter, None) is None:
                            break
            self.__dict__["_ipy_gpumem_single"] = single
        return single._next_data()

    loader_cls.__iter__ = __iter__
    base_cls._next_index = _next_index
    multi_cls._next_data = own_batches
    multi_cls._shutdown_workers = lambda self: None  # its workers are the user's process's, not the copy's
    module._ipy_gpumem_no_workers = True


def _real_tensors():
    """A context in which torch makes real tensors: the dispatch modes (the fakes, the tracker) are off."""
    import contextlib

    from .torch_api import api

    adapter = api()
    disable = getattr(adapter, "disable_current_modes", None) if adapter is not None else None
    if disable is None:  # another torch: the bookkeeping runs on fakes (values read as 0, with a note)
        return contextlib.nullcontext()
    return disable()
