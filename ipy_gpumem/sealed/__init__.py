"""Sealed runs: a function run in a forked child that cannot change anything the user owns (files, network, processes, objects), and what it returned or raised brought back.

    run.py       run_sealed(), SealedOutcome, SealedUnavailable: the fork, the deadline, the reaping (the parent)
    protocol.py  the pipe between child and parent: length-prefixed frames; ChildError, an exception as data
    child.py     the child from fork to os._exit: signals, output, torch threads, descriptors, then fn
    shims.py     the Python-level guard: shims that pretend or refuse, the audit hook, the record of each refusal
    seccomp.py   the OS-level guard: the seccomp-bpf filter, private copies of inherited shared memory

The mechanism is generic (the pre-flight estimate is one user): ``run_sealed(fn, *args, deadline_s)``
runs ``fn`` in a copy of this process that is thrown away, and ``allow_fork=True`` makes that copy a
zygote, whose ``fn`` may run many sealed trials, each from a fresh copy of the zygote's warmed state.

What the seal does not give:

- reading stays free: the child can read any file the user can (that is how a step loads data);
- a write the step makes and then reads back by path (a temporary file) finds nothing: the write
  went to ``/dev/null``; a file the parent holds open read-write is read-only in the child, so a
  write to it fails (``EBADF``) instead of pretending, and is not recorded;
- a lock (``flock``, ``fcntl``) the child takes on a file holds until the child ends (at most the
  deadline); mappings of devices (``/dev/nvidia*``) stay shared, as copying device memory is unsafe;
- with ``guard == "python"`` (no seccomp: another OS or architecture, or the kernel refused the
  filter), C code is not stopped: torch's C++ ``save`` to a path, numpy's ``tofile``, ``ctypes``.
  Python code still is (shims, audit hook), and no inherited descriptor reaches the parent's files;
- in a zygote, C code may fork (the filter cannot tell ``run_sealed``'s fork from another): what it
  forks is as sealed as the zygote, can never exec, and dies with the zygote's process group.

Importing the room imports nothing heavy: only the standard library (ctypes on first use).
"""
from .run import MAX_REFUSED, ChildError, SealedOutcome, SealedUnavailable, run_sealed
from .shims import unreported

__all__ = ["run_sealed", "SealedOutcome", "ChildError", "SealedUnavailable", "MAX_REFUSED", "unreported"]
