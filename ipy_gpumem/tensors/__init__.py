"""Tensors as memory: the one room that talks to torch's internals, and the one count of every tensor storage.

    torch_api.py   the adapter: every private torch name once, with its fallback and the versions checked
    storage.py     a tensor's storages: key, size and device (dense, sparse, nested, quantized, wrappers; CUDA blocks)
    saved.py       what an autograd node keeps alive (saved tensors, pack-hook payloads, checkpointed inputs)
    claims.py      the one role order, tiers and holder relations of a walk's claims
    kinds.py       how each type is walked, and the cheap proof that a container holds only scalars
    userfiles.py   whose code a file holds: the user's, or Python's, a package's or ours
    readers.py     holders read their own way (lru_cache, generators' frames, object arrays, data frames, futures...)
    paths.py       how a walk names what it reached (``batch[0]``, ``type(trainer).history``)
    graphs.py      the autograd half of the walk
    walk.py        the walk: namespace -> (storage, role, holder path), counted once, on a budget
    census.py      the role view of a walk: bytes by (device, role, owner)
    watch.py       whether a cell changed what the last census depended on, answered without a walk
    hooks.py       the global hooks that mark training phases (forward, backward, optimizer step)
    tracker.py     live storages of a run as it executes (the estimate's accounting), by dispatch
    loaders.py     the estimate's sealed child reads a DataLoader with workers in its own thread
    module_tables.py  an nn.Module's parameters, buffers, submodules and hooks, from its instance dict
    spawn.py       the index torch.multiprocessing gave a process it started

The census, ``who()``, re-runs, phases, the estimate and the OOM analysis count through this room
and nowhere else; no other module names a private torch attribute (``tests/whole/test_layering.py`` checks it).
Importing it imports nothing heavy: torch is read from ``sys.modules`` when the user imported it.
"""
