"""Turn an out-of-memory failure into a few ranked, concrete fixes, each citing a number or a line of the user's code.

:func:`explain` reads plain inputs (an ``OomReport``, the device's ``DeviceMemory``, a ``WhoReport``
with typed holders, the cells' records, the traceback's frames as strings, the environment) and
runs every rule over the same :class:`~.facts.Facts`. The rules live by subject: ``device``
(the request against the device, fragmentation, other processes, the CUDA context),
``training`` (activations, graphs kept, optimizer state, gradients), ``session`` (IPython's
references, earlier cells, checkpoints), and ``runtimes`` (host RAM, cuBLAS/cuDNN, MPS, other
runtimes). Each rule is a plain function of the facts that returns a :class:`~.finding.Finding` or None,
so tests call them one by one. Nothing here imports IPython or torch.

Every fix must be right for the failure at hand: applied, it must be able to make this failure go
away. So a change that frees memory is offered only when what it frees could matter for this
request (``Facts.matters``: a real share of what the request lacked, or of what was free when the
request's size is unknown) and says when it is not enough alone (``Facts.room``); a snippet that
splits work never rebuilds the result that could not fit; and a batch size is named only from an
estimate of the whole step (``oom.batch``), never from a model of what the failure did not reach.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence

from ...core.memory import DeviceMemory
from . import device, operation, runtimes, session, training
from .facts import Facts
from .finding import CONFIDENCES, FINDING_KEYS, Finding

__all__ = ["Finding", "FINDING_KEYS", "CONFIDENCES", "MAX_FINDINGS", "RULES", "Facts", "explain", "findings_of", "rank"]

#: The most findings :func:`explain` returns.
MAX_FINDINGS = 6

#: Every rule, in the order they run (the order only breaks ties in the ranking).
RULES = device.RULES + operation.RULES + training.RULES + session.RULES + runtimes.RULES


def explain(
    oom: Any,
    memory: DeviceMemory,
    who: Any = None,
    earlier: Sequence[Any] = (),
    *,
    failing: Any = None,
    failing_source: Optional[str] = None,
    frames: Sequence[Sequence[str]] = (),
    env: Optional[Mapping[str, str]] = None,
    requested: Optional[int] = None,
    modules: Optional[Iterable[str]] = None,
    maybe_own: Iterable[int] = (),
    on_error: Optional[Callable[[str, BaseException], None]] = None,
    batch: Any = None,
    recorded: Any = None,
    operands: Sequence[Any] = (),
    limits: Sequence[Any] = (),
) -> List[Finding]:
    """Ranked findings, most useful first: certain before likely before possible, then by bytes freed.

    Args:
        oom: the parsed message, or None (a state probed without an error).
        memory: the failing device's memory (see ``DeviceMemory.from_message`` and ``merged``).
        who: a ``WhoReport`` for the failing device, or None.
        earlier: the cells before the failing one, oldest first.
        failing: the failing cell's ``CellRecord`` (its source, its peak), or None.
        failing_source: the failing cell's source; ``failing.source`` when None.
        frames: ``(filename, function, source line)`` of the failing traceback, innermost last.
        env: environment variables (``PYTORCH_CUDA_ALLOC_CONF`` ...); ``os.environ`` when None.
        requested: bytes that failed; overrides ``oom.requested``.
        modules: names of imported modules (to recognise TensorFlow or JAX sharing the GPU);
            ``sys.modules`` when None.
        maybe_own: pids in ``memory.processes`` that may be this kernel: never offered for ``kill``.
        on_error: called with a rule's name and its exception when the rule fails; the other
            findings are returned all the same.
        batch: what is known about the failing cell's batch (``oom.batch.BatchKnown``, read from
            an earlier estimate or run of the cell, never by running it), or None.
        recorded: the allocator's recorded state at the failure (``oom.analysis.RecordedOom``: its
            largest free block tells fragmentation for certain, its frames the operation), or None.
        operands: the shapes the traceback's frames name (``oom.operands.operands_of``), parallel to ``frames``.
        limits: the process's memory limits (``oom.limits.host_limits``): a host failure under one says so.

    Returns:
        At most :data:`MAX_FINDINGS` findings; never empty when ``oom`` is given. When the request
        alone is larger than the device, only what bears on the request's size is returned (the
        request itself, the operation that made it, and what is known about the batch):
        nothing that frees memory can make it fit, so no such finding may look "likely".
    """
    facts = Facts.build(oom, memory, who, earlier, failing=failing, failing_source=failing_source, frames=frames,
                        env=env, requested=requested, modules=modules, maybe_own=maybe_own, batch=batch,
                        recorded=recorded, operands=operands, limits=limits)
    return findings_of(facts, on_error)


def findings_of(facts: "Facts", on_error: Optional[Callable[[str, BaseException], None]] = None) -> List[Finding]:
    """:func:`explain` on facts already built (``Facts.build``): every rule, ranked, at most :data:`MAX_FINDINGS`."""
    oom = facts.oom
    found: List[Finding] = []
    for rule in RULES:
        try:
            finding = rule(facts)
        except Exception as exc:  # one broken rule must not cost the user the other findings
            if on_error is not None:
                on_error(rule.__name__, exc)
            continue
        if finding is not None:
            found.append(finding)
    impossible = [f for f in found if f.key == "request_exceeds_device"]
    if impossible:
        # What is known about the batch, and the operation that asked (its own fix shrinks it), are about the
        # request's size: they stay.
        found = impossible + [f for f in found if f.key in ("batch_size", "operation")]
    if not found and oom is not None:
        found.append(device.shortfall(facts))
    found.sort(key=rank)
    return found[:MAX_FINDINGS]


def rank(f: Finding) -> tuple:
    """The sort key: an impossible request first, then confidence, then bytes freed (known before unknown)."""
    return (f.key != "request_exceeds_device", CONFIDENCES.index(f.confidence), f.frees is None, -(f.frees or 0))
