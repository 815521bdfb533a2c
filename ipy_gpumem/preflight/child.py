"""What runs inside the sealed child of an estimate: fake the world in place, run the step twice under the storage tracker, and return plain data.

Everything here runs in a forked copy of the user's process (``ipy_gpumem.sealed``): it may
change any object it finds, because those objects are the child's own copies. It never runs in
the user's process. What it returns (an :class:`~.result.Estimate`, per-line marks) travels back
as plain data (numbers, strings, lists: ``Estimate.to_plain``), never a pickle;
an error travels back as an :class:`~.result.EstimateError` whose message names the user's line.
"""
from __future__ import annotations

import contextlib
import io
import logging
import sys
import time
from typing import Any, Dict, Optional, Tuple

from ..tensors.loaders import notes as loader_notes, read_without_workers
from ..tensors.torch_api import api as torch_api
from ..tensors.tracker import StorageTracker
from .attention import summary, words as attention_words
from .cpulike import cpu_emulation
from .result import Estimate, EstimateError
from .steady import words as steady_words
from .steps import analyse, explain_error, line_words, run_steps, to_cpu, warnings_quiet
from .world import FakeWorld, SubstitutionError

__all__ = ["estimate_here", "RUNNERS"]


def estimate_here(step: Any, args: tuple, kwargs: dict, *, label: str, costs: Dict[str, int], gpu: Optional[str],
                  namespace: Optional[dict] = None, batch: Optional[Dict[int, tuple]] = None,
                  program: Any = None, notes: Tuple[str, ...] = (), whole: bool = False) -> Tuple[dict, list, list]:
    """Estimate ``step(*args, **kwargs)`` here (in the sealed child), as plain data: ``(the estimate's
    to_plain(), the markers' (event, line, call) of a cell as one flat list of ints, the namespace's
    names that held tensors)``; ``run.answer_of`` rebuilds them in the parent. Raises :class:`EstimateError`.

    The names of ``namespace`` faked are those the step (a cell: ``program``'s code) can reach
    (``tensors.reach``); ``whole``: every name. A step that then uses a real tensor raises an
    EstimateError with ``reach_missed`` set, so that the parent estimates again with ``whole``."""
    began = time.perf_counter()
    api = torch_api()
    if api is None:
        raise EstimateError("torch is not imported")
    torch = api.torch
    torch.set_num_threads(1)  # a forked child of a process that used the intra-op pool (NOTES §11)
    for name in api.fake_loggers():
        logging.getLogger(name).setLevel(logging.CRITICAL)
    from ..sealed import unreported

    with unreported():
        # FakeTensorMode's first use imports torch's compiler (about 800 modules), which probes the
        # temporary directory: torch's doing, not the step's, so not reported as the step's side effect.
        FakeTensorMode = api.fake_tensor_mode()
        with FakeTensorMode():
            (torch.ones(2, 2) @ torch.ones(2, 2)).sum()
    cuda = label.startswith("cuda")
    read_without_workers()  # a DataLoader's workers cannot start here: its batches are read in this thread
    no_magics()
    with unreported():
        _journals_in_memory(namespace)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    names = None if whole or namespace is None else _reached(api, namespace, step, args, kwargs, program)
    # A cell's step is run_cell(namespace, program): the namespace is faked name by name, never again as
    # an argument (that faked each of its tensors a second time, and the first fakes, dropped when the
    # run began, counted in the peak until then: every tensor a name held, used or not).
    roots = [] if program is not None else [("step", step), ("args", args), ("kwargs", kwargs)]
    world = FakeWorld(api, fake_mode, roots, namespace=namespace, batch=batch, names=names)
    try:
        world.substitute()
    except SubstitutionError as exc:
        raise EstimateError(str(exc)) from None
    if roots:
        step, args, kwargs = world.root("step"), world.root("args"), world.root("kwargs")
    existing, world.existing = world.existing, []
    tracker = StorageTracker(fake=True, redirect=to_cpu)
    printed = io.StringIO()
    # A CUDA step computes on CPU fakes: where CUDA allocates differently (autocast's lists and weight
    # cache, dropout, the attention kernel the GPU picks, cuBLAS's workspaces, foreach optimizers), the
    # run emulates it (.cudalike, .attention); a CPU step counts its kernels' scratch (.cpulike).
    emulation = _cuda_emulation(api, tracker, gpu, world.optimizers) if cuda else cpu_emulation(api, tracker)
    with fake_mode, emulation as emulated, warnings_quiet(), contextlib.redirect_stdout(printed):
        try:
            run_steps(step, args, kwargs, tracker, existing, world.modules, world.optimizers)
        except EstimateError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported with the user's line, never a raw traceback
            err = explain_error(exc)
            if world.partial and getattr(err, "real_tensor", False):
                err.reach_missed = True  # read by a way its code does not show: the parent fakes every name
            raise err from None
    notes = list(notes) + loader_notes()
    if printed.getvalue():
        notes.append(f"the step printed {len(printed.getvalue().splitlines())} line(s) on fake values; not shown")
    for _filename, line, source in tracker.run.value_reads:
        notes.append(f"line {line} (`{source}`) read a tensor's value (.item(), print, or an `if` on a tensor): a "
                     "fake tensor has none, so 0 was used; a branch on it follows the 0 path")
    cuda_run = emulated if cuda else None
    attention = []
    if cuda_run is not None:
        if not cuda_run.autocast:
            notes.append("this torch cannot take Python autocast kernels: a CUDA autocast region was estimated with "
                         "the CPU's autocast op lists")
        notes.extend(_gpu_notes(cuda_run, gpu))
        attention = summary(cuda_run.attention.calls)
    facts = analyse(tracker, label, costs)
    if facts.get("steady_calls", 2) > 2:
        notes.append(steady_words(facts))
    marks = [n for mark in program.marks for n in mark] if program is not None else []
    est = Estimate(device=label, fixed_costs=costs, notes=notes, seconds=time.perf_counter() - began,
                   gpu=gpu, cublas_workspaces=cuda_run.workspaces.total if cuda_run is not None else 0,
                   attention=attention, **facts)
    return est.to_plain(), marks, list(world.names)


def _reached(api, namespace: dict, step, args, kwargs, program) -> Optional[frozenset]:
    """The names of ``namespace`` the step can reach (a cell's: its code's), or None (all of them)."""
    from ..tensors.reach import reach

    if program is not None:
        return reach(api, namespace, codes=[program.code])
    return reach(api, namespace, roots=[step, args, kwargs])


def _gpu_notes(cuda_run, gpu: Optional[str]) -> list:
    """What the run assumed the GPU does: each group of attention calls' kernel, and cuDNN's convolutions."""
    from .gpus import card_named

    card = card_named(gpu)
    sm = card.sm if card is not None else None
    notes = [attention_words(row, gpu, sm) for row in summary(cuda_run.attention.calls)]
    convs = cuda_run.convolutions
    if convs.forward or convs.backward:
        notes.append(f"{convs.forward} convolution call(s) forward and {convs.backward} backward over the two steps: "
                     "cuDNN picks each one's algorithm when it runs (torch.backends.cudnn.benchmark tries several) "
                     "and takes its workspace from PyTorch's allocator for the call, often tens of MiB; that "
                     "workspace is not counted here")
    return notes


def _journals_in_memory(namespace: Optional[dict]) -> None:
    """The sqlite connections the user's names hold keep their journal in memory here: a commit then
    writes only the database file, which the seal made a memory copy of (a journal file could not be
    created), and the run lists it as a write to that file."""
    sqlite3 = sys.modules.get("sqlite3")
    if sqlite3 is None or not namespace:
        return
    for value in list(dict.values(namespace)):
        if isinstance(value, sqlite3.Connection):
            try:
                value.execute("PRAGMA journal_mode=MEMORY")
            except Exception:  # noqa: BLE001 - closed, or in WAL mode: its writes fail, and the error says why
                continue


#: The shell's methods that run magics, shell commands or other cells: ``get_ipython().<one of these>``
#: is refused; what only reads (``get_ipython().user_ns``, ``.config``) is allowed.
RUNNERS = frozenset(("run_line_magic", "run_cell_magic", "magic", "system", "system_piped", "system_raw",
                     "getoutput", "run_cell", "run_cell_async", "run_code", "run_ast_nodes", "safe_execfile",
                     "safe_execfile_ipy", "safe_run_module", "ex", "ev", "push", "del_var", "reset",
                     "enable_gui", "enable_matplotlib", "enable_pylab", "extension_manager", "magics_manager"))


def no_magics() -> None:
    """In the child: the shell's methods that run magics, shell commands or cells raise an
    EstimateError naming the user's line (:data:`RUNNERS`; a cell's source is checked first, this
    catches the ones reached some other way, such as ``ip = get_ipython(); ip.system(...)``)."""
    shell_module = sys.modules.get("IPython.core.interactiveshell")
    if shell_module is None:
        return
    shell = shell_module.InteractiveShell
    for name in RUNNERS:
        if callable(getattr(shell, name, None)):
            setattr(shell, name, _refuse_magic(name))


def _refuse_magic(name: str):
    def refused(self, *args, **kwargs):
        from ..tensors.userfiles import is_user_file

        frame = sys._getframe(1)
        while frame is not None and not is_user_file(frame.f_code.co_filename):
            frame = frame.f_back
        where = None
        if frame is not None:
            import linecache

            filename = frame.f_code.co_filename
            where = (filename, frame.f_lineno, linecache.getline(filename, frame.f_lineno).strip())
        at = line_words((where[0], where[1], "", where[2])) if where else "the step"
        raise EstimateError(f"{at} runs an IPython magic or shell command (get_ipython().{name}), which the "
                            "estimate does not run; estimate plain Python", where)

    refused.__name__ = name
    return refused


def _cuda_emulation(api, tracker, gpu: Optional[str], optimizers):
    from .cudalike import cuda_emulation
    from .gpus import card_named, cublas_workspace

    card = card_named(gpu)
    return cuda_emulation(api, tracker, cublas_workspace(card), optimizers, sm=card.sm if card is not None else None)
