"""Run cells in a real Jupyter kernel through nbclient and read back what each cell showed."""
from __future__ import annotations

import atexit
import functools
import importlib.util
import itertools
import os
import shutil
import sys
import tempfile

import pytest

#: Skips a test module where nbclient is not installed. Found, not imported: importing it (and nbformat's JSON
#: schemas with it) at collection cost every collecting process 4 CPU-s, and only a kernel test needs it.
needs_nbclient = pytest.mark.skipif(importlib.util.find_spec("nbclient") is None, reason="nbclient is not installed")


def on_private_sockets(km):
    """Make ``km`` talk to its kernel over Unix sockets in a folder of its own, not TCP ports.

    jupyter_client picks a TCP port by binding and releasing it, so two kernels started at once (two
    test workers) can both pick it: one dies with "Address already in use" and its client waits 120 s
    (a CI run failed so). A socket file in a private folder cannot be taken by anyone else. The folder
    is short-named under the temporary directory: a Unix socket's path is at most 107 bytes."""
    km.transport = "ipc"
    km.ip = os.path.join(_socket_folder(), f"k{next(_KERNELS)}")
    return km


_KERNELS = itertools.count()


@functools.lru_cache(maxsize=None)
def _socket_folder():
    """One private folder per test process for its kernels' sockets, removed when the process ends."""
    folder = tempfile.mkdtemp(prefix="k")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def kernel_manager(**kwargs):
    """A KernelManager that runs this interpreter (the venv under test) on private sockets."""
    from jupyter_client.manager import KernelManager

    km = on_private_sockets(KernelManager(kernel_name="python3", **kwargs))
    km.kernel_spec.argv[0] = sys.executable
    return km


def execute(cells, extensions=None, timeout=180, allow_errors=True, cwd=None):
    """Execute ``cells`` (strings) in a fresh python3 kernel; return the executed notebook."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
    extra = []
    if extensions:
        extra.append(f"--InteractiveShellApp.extensions={list(extensions)!r}")
    env = dict(os.environ, PYTHONWARNINGS="ignore::DeprecationWarning")
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=allow_errors,
        extra_arguments=extra,
        resources={"metadata": {"path": cwd or os.getcwd()}},
    )
    # Make sure the kernel runs this interpreter (the venv under test), whatever kernelspecs exist.
    client.km = on_private_sockets(client.create_kernel_manager())
    client.km.kernel_spec.argv[0] = sys.executable
    client.km.kernel_spec.env = env
    client.execute()
    return nb


def outputs(cell, kind=None):
    return [o for o in cell.outputs if kind is None or o.output_type == kind]


def plain(cell):
    """The text/plain of every display_data/execute_result, and every stream's text."""
    out = []
    for o in cell.outputs:
        if o.output_type in ("display_data", "execute_result", "update_display_data"):
            out.append(o.get("data", {}).get("text/plain", ""))
        elif o.output_type == "stream":
            out.append(o.text)
    return out
