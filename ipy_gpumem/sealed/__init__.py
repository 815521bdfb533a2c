"""Sealed runs: a function run in a forked child that cannot change anything the user owns (files, network, processes, objects), and what it returned or raised brought back.

    run.py       run_sealed(), SealedUnavailable: the fork, the deadline, the reaping (the parent)
    answer.py    SealedOutcome, and the parent's reading of the child: every frame checked, nothing trusted
    protocol.py  the pipe between child and parent: length-prefixed frames with caps; ChildError, an exception as data
    plain.py     the format of what crosses: plain data (numbers, strings, bytes, lists, dicts), never a pickle
    notify.py    the parent names each call C code had refused (seccomp's listener) and answers it EPERM
    stuck.py     a child every thread of which waits forever (a lock held at the fork): ended early
    child.py     the child from fork to os._exit: signals, output, torch threads, descriptors, then fn
    shims.py     the Python-level guard: shims that pretend or refuse, the audit hook, the record of each refusal
    seccomp.py   the OS-level guard: the seccomp-bpf filter, private copies of inherited shared memory

The mechanism is generic (the pre-flight estimate is one user): ``run_sealed(fn, *args, deadline_s)``
runs ``fn`` in a copy of this process that is thrown away, and ``allow_fork=True`` makes that copy a
zygote, whose ``fn`` may run many sealed trials, each from a fresh copy of the zygote's warmed state.
What ``fn`` returns must be plain data: the step runs in the child and C code there can write on
its pipe, so the parent decodes nothing that could run code and checks every size before it
allocates (a forged frame ends the run with ``broken``, in one line).

What the seal does not give:

- reading stays free: the child can read any file the user can (that is how a step loads data);
- a write the step makes and then reads back by path (a temporary file) finds nothing: the write
  went to ``/dev/null``; a file the parent holds open read-write (an ``a+`` log, a database) is a
  memory copy in the child up to 64 MiB, so writes to it pretend and are recorded; a larger one is
  read-only there, and a write to it fails (``EBADF``); ``sqlite3.connect`` opens an in-memory copy;
- a lock (``flock``, ``fcntl``) the child takes on a file holds until the child ends (at most the
  deadline); mappings of devices (``/dev/nvidia*``) stay shared, as copying device memory is unsafe;
- with ``guard == "python"`` (no seccomp: another OS or architecture, or the kernel refused the
  filter), C code is not stopped: torch's C++ ``save`` to a path, numpy's ``tofile``, ``ctypes``.
  Python code still is (shims, audit hook), and no inherited descriptor reaches the parent's files.
  What C code is refused is listed from Linux 5.6 (the guard note says when it cannot be);
- the step can always write on its own pipe from C code (it is its process's descriptor): what it
  writes there is checked like anything else the child sends, so it can garble or forge numbers,
  never run code or take memory in the parent (Python code is refused the pipe);
- in a zygote, C code may fork (the filter cannot tell ``run_sealed``'s fork from another): what it
  forks is as sealed as the zygote, can never exec, and dies with the zygote's process group.

Importing the room imports nothing heavy: only the standard library (ctypes on first use).
"""
from .run import MAX_REFUSED, ChildError, SealedOutcome, SealedUnavailable, check_seconds, run_sealed
from .shims import unreported

__all__ = ["run_sealed", "check_seconds", "SealedOutcome", "ChildError", "SealedUnavailable", "MAX_REFUSED",
           "unreported"]
