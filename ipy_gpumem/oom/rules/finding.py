"""A :class:`Finding`: one cause of an out-of-memory failure and the change that addresses it, as every rule returns it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

__all__ = ["Finding", "FINDING_KEYS", "CONFIDENCES"]

#: Every key ``explain()`` can return, roughly in the order they usually rank.
FINDING_KEYS = (
    "request_exceeds_device", "operation", "process_limit", "activations", "graphs_kept", "optimizer_state", "gradients",
    "fragmentation", "other_processes", "cuda_context_and_libraries", "checkpoint_on_gpu",
    "ipython_refs", "earlier_cells", "cpu_oom", "cublas_cudnn", "mps", "other_runtime", "shortfall",
    "batch_size",
)
CONFIDENCES = ("certain", "likely", "possible")


@dataclass(frozen=True)
class Finding:
    """One cause of the failure and the change that addresses it.

    Attributes:
        key: stable id, one of :data:`FINDING_KEYS`.
        title: one line with the number, e.g. "Adam keeps two buffers the size of the weights: 1.50 GiB".
        detail: why, with numbers, in torch's vocabulary; 1-3 sentences.
        fix: the concrete change, one sentence.
        snippet: code the user can paste (may be "").
        frees: bytes the change would free or avoid, for ranking; None if unknown.
        confidence: ``"certain"``, ``"likely"`` or ``"possible"``.
    """

    key: str
    title: str
    detail: str
    fix: str
    snippet: str = ""
    frees: Optional[int] = None
    confidence: str = "likely"

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-serialisable copy."""
        return {"key": self.key, "title": self.title, "detail": self.detail, "fix": self.fix,
                "snippet": self.snippet, "frees": self.frees, "confidence": self.confidence}
