"""The batch size that fits, for the OOM panel: the failing cell's code re-estimated on fake tensors at other batch sizes, within a strict time budget.

The failing cell's source (its record's ``source``) becomes a step as for ``%%gpumem --estimate``
(``preflight/cell.py``: the code runs on fake copies of the namespace objects it reads, never for
real); the batch is the leading dimension of the input tensor it reads (``inputs``, ``x``,
``batch``... or the first tensor that no module owns), and ``max_batch_size`` searches the largest
batch for which the step fits what the failing device has for it. Everything is guarded: when the
step or its batch cannot be identified, the estimate fails or runs past :data:`BUDGET_S`, the
result says why and carries the ``%%gpumem --estimate`` line to run instead; nothing here raises.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ..core.units import format_bytes

__all__ = ["BatchFit", "fit_batch", "BUDGET_S", "BATCH_NAMES", "estimate_line"]

#: Seconds the whole search may take before it is abandoned (an OOM panel must not hang).
BUDGET_S = 5.0
#: Names that usually hold a step's input batch, preferred in this order.
BATCH_NAMES = ("inputs", "input", "x", "xb", "batch", "images", "imgs", "input_ids", "data", "features", "X",
               "src", "tokens", "idx")


@dataclass(frozen=True)
class BatchFit:
    """What the panel can say about the batch size.

    Attributes:
        line: the ``%%gpumem --estimate`` line to run on the (fixed) cell; always set.
        name: the variable the batch was read from (``inputs``), None when none was found.
        size: its batch size now (the leading dimension).
        best: the largest batch size that fits (0: not even 1); None when not worked out.
        needed: bytes the step needs at ``size``; best_needed: at ``best``.
        capacity: what the failing device has for the step (bytes).
        reason: why ``best`` is None (in words), or None.
        seconds: how long the search took.
        faked: the namespace names the step was estimated on.
    """

    line: str
    name: Optional[str] = None
    size: Optional[int] = None
    best: Optional[int] = None
    needed: Optional[int] = None
    best_needed: Optional[int] = None
    capacity: Optional[int] = None
    reason: Optional[str] = None
    seconds: float = 0.0
    faked: Tuple[str, ...] = ()

    @property
    def known(self) -> bool:
        return self.best is not None and self.size is not None

    @property
    def spare(self) -> Optional[int]:
        if self.capacity is None or self.best_needed is None:
            return None
        return self.capacity - self.best_needed

    def sentence(self) -> str:
        """``batch 32 needs 17.90 GiB; 24 fits with 612.00 MiB to spare`` (or why it is not known)."""
        if not self.known:
            return f"the batch that fits could not be worked out here ({self.reason})"
        head = f"batch {self.size} needs {format_bytes(self.needed)}"
        if self.best == 0:
            return head + f"; not even a batch of 1 fits in {format_bytes(self.capacity)}"
        if self.best >= self.size:
            return head + f", which fits in {format_bytes(self.capacity)}: the batch size alone is not the cause"
        return head + f"; {self.best} fits with {format_bytes(self.spare)} to spare"


def estimate_line(gpu: Optional[str] = None) -> str:
    """The header line to put on the failing cell to estimate it before running it again."""
    return "%%gpumem --estimate" + (f" {gpu}" if gpu else "")


def _strip_magics(source: str) -> Tuple[Optional[str], int]:
    """The cell's Python below its leading cell-magic lines, and the user's number of its first line;
    None when what is left still has IPython syntax (a line magic, a shell command)."""
    lines = source.splitlines()
    k = 0
    while k < len(lines) and (not lines[k].strip() or lines[k].startswith("%%")):
        k += 1
    body = lines[k:]
    if any(line.lstrip().startswith(("%", "!")) for line in body):
        return None, k + 1
    return "\n".join(body) + "\n", k + 1


def _batch_of(value) -> Optional[int]:
    import torch

    if isinstance(value, torch.Tensor):
        if isinstance(value, torch.nn.Parameter) or value.dim() < 1 or (value.is_leaf and value.requires_grad):
            return None
        return int(value.shape[0])
    if isinstance(value, dict):
        sizes = [_batch_of(v) for v in list(value.values())[:16]]
    elif isinstance(value, (list, tuple)):
        sizes = [_batch_of(v) for v in list(value)[:16]]
    else:
        return None
    return next((s for s in sizes if s is not None), None)


def _pick_batch(world: Dict[str, Any]) -> Tuple[Optional[str], Optional[int]]:
    for name in BATCH_NAMES:
        if name in world:
            size = _batch_of(world[name])
            if size:
                return name, size
    for name, value in world.items():
        size = _batch_of(value)
        if size:
            return name, size
    return None, None


def _resident(world: Dict[str, Any]) -> int:
    """Bytes of the real tensors the step's objects hold (already resident in the process)."""
    from ..preflight.fake import collect_tensors

    seen, total = set(), 0
    for tensor, _role in collect_tensors([list(world.values())]).values():
        try:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        except Exception:  # noqa: BLE001 - sparse or odd tensors: not counted
            continue
    return total


def fit_batch(source: Optional[str], namespace: Optional[dict], memory, *, budget_s: float = BUDGET_S,
              gpu: Optional[str] = None) -> BatchFit:
    """The largest batch for which the failing cell's step fits the failing device; never raises.

    Args:
        source: the failing cell's source.
        namespace: the user's namespace (read, never changed; the cell never runs for real).
        memory: the failing device's ``DeviceMemory`` (its total, and what other processes or, on the
            host, everything else already use).
        budget_s: abandon the search after this many seconds.
        gpu: the GPU name for the line to run (``T4``); None: this GPU.
    """
    began = time.perf_counter()
    line = estimate_line(gpu)
    try:
        return _fit(source, namespace, memory, budget_s, line, began)
    except BaseException as exc:  # noqa: BLE001 - the panel must never fail because of this
        if isinstance(exc, KeyboardInterrupt):
            raise
        return BatchFit(line, reason=f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - began)


def _fit(source, namespace, memory, budget_s, line, began) -> BatchFit:
    def give_up(reason, **known):
        return BatchFit(line, reason=reason, seconds=time.perf_counter() - began, **known)

    if "torch" not in sys.modules:
        return give_up("torch is not imported")
    if not source or not source.strip() or namespace is None:
        return give_up("the failing cell's source or namespace is unknown")
    code, first_line = _strip_magics(source)
    if code is None:
        return give_up("the cell runs IPython magics or shell commands, which would run for real")
    capacity = _capacity(memory)
    if capacity is None:
        return give_up("the device's capacity is unknown")

    from ..preflight.batch import max_batch_size
    from ..preflight.cell import BudgetExceeded, cell_program, run_cell
    from ..preflight.gpus import fixed_costs
    from ..preflight.result import EstimateError

    try:
        program = cell_program(code, namespace, first_line)
    except EstimateError as exc:
        return give_up(str(exc))
    name, size = _pick_batch(program.world)
    if name is None:
        return give_up("no input tensor with a batch dimension among the cell's variables", faked=tuple(program.world))
    # The batch first: max_batch_size resizes the first input tensor it meets and those of its size.
    program.world = {name: program.world[name], **{k: v for k, v in program.world.items() if k != name}}
    if memory.is_host:
        # The step's own tensors are already resident, so they count as room; the search models a
        # CUDA process, whose fixed costs (context, cuBLAS workspace) a CPU run does not pay.
        capacity += _resident(program.world) + sum(fixed_costs(None).values())
    program.deadline = began + budget_s
    try:
        best = max_batch_size(run_cell, program.world, program, gpu=int(capacity), limit=max(4 * size, 64))
    except EstimateError as exc:
        original = getattr(exc, "original", None)
        if isinstance(original, BudgetExceeded) or time.perf_counter() - began > budget_s:
            return give_up(f"the estimate took longer than {budget_s:g} s", name=name, size=size,
                           faked=tuple(program.world))
        return give_up(str(exc), name=name, size=size, faked=tuple(program.world))
    finally:
        program.deadline = None
    tried = best.tried
    needed = tried.get(size, (None, None))[1]
    best_needed = tried.get(int(best), (None, None))[1] if int(best) else None
    if memory.is_host:  # report what the CPU run needs: no CUDA fixed costs
        offset = sum(fixed_costs(None).values())
        needed = None if needed is None else needed - offset
        best_needed = None if best_needed is None else best_needed - offset
        capacity -= offset
    return BatchFit(line, name, size, int(best), needed, best_needed, int(capacity),
                    seconds=time.perf_counter() - began, faked=tuple(program.world))


def _capacity(memory) -> Optional[int]:
    """What the failing device has for the step: a GPU's total less other processes' use; the
    host's available RAM."""
    if memory is None or memory.total is None:
        return None
    if memory.is_host:
        if memory.used is None:
            return None
        return max(0, memory.total - memory.used)
    return max(0, memory.total - (memory.other_processes_bytes or 0))
