"""The result of an estimate (:class:`Estimate`, plain data with ``to_dict()`` and ``fits()``) and the error raised when a step cannot be estimated."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..core.units import format_bytes

__all__ = ["COST_WORDS", "Estimate", "EstimateError", "Fit"]

#: How a fixed cost is named in words.
#: The fixed costs' words (``gpus.fixed_costs`` keys): what the pre-flight tables and the verdict print.
COST_WORDS = {"cuda_context": "CUDA context", "hip_context": "HIP context", "level_zero_context": "Level Zero context"}


class EstimateError(RuntimeError):
    """A step could not be run on fake tensors; the message names the line of the user's code."""

    def __init__(self, message: str, line: Optional[tuple] = None):
        super().__init__(message)
        #: (filename, line number, source) of the user's line, when known
        self.line = line


@dataclass(frozen=True)
class Fit:
    """Whether an estimate fits one GPU, and by how much (bytes)."""

    gpu: str
    capacity: int
    needed: int
    fits: bool
    #: the modelled allocator, replayed with the capacity left after the fixed costs, ran out
    oom: bool

    @property
    def headroom(self) -> int:
        return self.capacity - self.needed

    def __bool__(self) -> bool:
        return self.fits


@dataclass
class Estimate:
    """A training step's memory, worked out on fake tensors (bytes throughout).

    ``peak_allocated`` and ``peak_reserved`` are what torch's own counters
    (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``) would read after the two calls
    from a fresh process holding the step's arguments: cuBLAS's workspaces, which torch takes from
    its caching allocator, are in them (``cublas_workspaces``); ``fixed_costs`` is what the process
    pays outside the allocator on ``gpu`` (its CUDA context); ``total_needed`` is their sum.
    """

    device: str
    peak_allocated: int
    peak_reserved: int
    #: live tensor bytes before the first call (parameters, gradients, optimizer state, inputs)
    start_allocated: int
    #: role table at the peak moment: {device: {role: bytes}}
    roles: Dict[str, Dict[str, int]]
    #: [{"phase", "step", "peak", "roles"}], in order
    phases: List[dict]
    #: top modules by activation bytes: [{"module", "type", "activations", "peak", "calls"}]
    modules: List[dict]
    fixed_costs: Dict[str, int]
    #: which call (1 or 2) and phase the peak happened in
    peak_step: int = 2
    peak_phase: str = "other"
    notes: List[str] = field(default_factory=list)
    seconds: float = 0.0
    #: allocation events, (key, size) with size -1 for a free; kept for fits() (not in to_dict)
    events: list = field(default_factory=list, repr=False)
    #: the GPU whose fixed costs were assumed (a CUDA estimate), by name
    gpu: Optional[str] = None
    #: bytes of cuBLAS workspace in the peaks: one per thread that multiplied matrices (the
    #: forward's, and backward's on the autograd engine's thread), taken at its first GEMM
    cublas_workspaces: int = 0
    #: the scaled_dot_product_attention calls of a step, grouped, with the kernel the GPU picks for
    #: them: [{"kernel" ("flash", "efficient", "cudnn", "math"), "calls", "batch", "heads", "q_len",
    #: "kv_len", "head_dim", "dtype", "mask", "dropout", "causal", "refused": {kernel: why}}]
    attention: List[dict] = field(default_factory=list)
    #: the step after which the modelled caching allocator's peaks stop growing (2: they hold after
    #: two), and the reserved bytes the steady state adds to two steps' (a CUDA estimate's peaks are
    #: the steady state's)
    steady_calls: int = 2
    steady_extra: int = 0

    @property
    def assumed(self) -> str:
        """``"assumed: T4 (CUDA context 300.00 MiB)"``: the card and the fixed costs taken for it ("" on the CPU)."""
        if not self.device.startswith("cuda"):
            return ""
        costs = ", ".join(f"{COST_WORDS.get(k, k)} {format_bytes(v)}" for k, v in self.fixed_costs.items())
        return f"assumed: {self.gpu or 'an unnamed GPU'}" + (f" ({costs})" if costs else "")

    @property
    def total_needed(self) -> int:
        return self.peak_reserved + sum(self.fixed_costs.values())

    def fits(self, gpu=None) -> Fit:
        """Whether the step fits ``gpu`` (a name such as "T4" or "A100-80", "this GPU", or bytes; by
        default the card the estimate assumed).

        The allocations (cuBLAS's workspaces among them) are replayed through the allocator model
        with the GPU's capacity less the fixed costs, so a step that only fits after torch frees its
        cache (as it does before raising out-of-memory) fits.
        """
        from .allocator import replay
        from .gpus import card_named, fixed_costs, resolve_gpu

        card = (card_named(self.gpu) if gpu is None else None) or resolve_gpu("this GPU" if gpu is None else gpu)
        costs = fixed_costs(card) if self.device.startswith("cuda") else {}
        room = card.capacity - sum(costs.values())
        run = replay(self.events, capacity=max(room, 0), series=False)
        needed = self.peak_reserved + sum(costs.values())
        ok = run.oom_at is None
        return Fit(card.name, card.capacity, needed, ok, not ok)

    def to_dict(self) -> dict:
        """Plain, JSON-serialisable data (no events)."""
        return {
            "device": self.device,
            "gpu": self.gpu,
            "cublas_workspaces": self.cublas_workspaces,
            "attention": [dict(row, refused=dict(row["refused"])) for row in self.attention],
            "steady_calls": self.steady_calls,
            "steady_extra": self.steady_extra,
            "peak_allocated": self.peak_allocated,
            "peak_reserved": self.peak_reserved,
            "start_allocated": self.start_allocated,
            "fixed_costs": dict(self.fixed_costs),
            "total_needed": self.total_needed,
            "roles": {d: dict(r) for d, r in self.roles.items()},
            "phases": [dict(p, roles={d: dict(r) for d, r in p["roles"].items()}) for p in self.phases],
            "modules": [dict(m) for m in self.modules],
            "peak_step": self.peak_step,
            "peak_phase": self.peak_phase,
            "notes": list(self.notes),
            "seconds": self.seconds,
        }

    def to_plain(self) -> dict:
        """Everything, events included (packed: little-endian int64 pairs in one bytes), as plain data:
        what the sealed child sends back (:mod:`ipy_gpumem.sealed.plain`); :meth:`from_plain` rebuilds it."""
        import itertools
        from array import array

        out = self.to_dict()
        del out["total_needed"]
        packed = array("q", itertools.chain.from_iterable(self.events))
        if sys.byteorder != "little":
            packed.byteswap()
        out["events"] = packed.tobytes()
        return out

    @classmethod
    def from_plain(cls, data) -> "Estimate":
        """The Estimate ``data`` (from :meth:`to_plain`, read from a sealed child) describes, its types
        checked; :class:`EstimateError` in one line when it does not describe one."""
        try:
            return cls(**_checked(data))
        except (KeyError, TypeError, ValueError) as exc:
            raise EstimateError(f"the estimate's sealed copy sent back a malformed answer ({type(exc).__name__}: "
                                f"{exc}); nothing of it was used") from None

    @property
    def device_name(self) -> str:
        """The device as torch names it on the card assumed: ``cuda:0`` (an AMD card's too: ROCm keeps
        torch.cuda's names), ``xpu:0`` on an Intel card, ``mps`` on Apple silicon; ``device`` is the
        allocator the estimate modelled (``cuda:0`` for each: their caching allocators are modelled alike)."""
        if not self.device.startswith("cuda") or not self.gpu:
            return self.device
        from .gpus import card_named

        card = card_named(self.gpu)
        generation = card.generation if card is not None else None
        return {"xe-hpc": "xpu:0", "apple": "mps"}.get(generation, self.device)

    def __repr__(self) -> str:
        roles = ", ".join(f"{role} {format_bytes(v)}" for row in self.roles.values() for role, v in row.items() if v)
        on = f" on a {self.gpu}" if self.gpu else ""
        assumed = f"; {self.assumed}" if self.assumed else ""
        text = (f"Estimate({self.device_name}{on}: peak allocated {format_bytes(self.peak_allocated)}, "
                f"reserved {format_bytes(self.peak_reserved)}, total needed {format_bytes(self.total_needed)}"
                f"{assumed}; "
                f"at the peak ({self.peak_phase}, call {self.peak_step}): {roles})")
        return text + "".join(f"\n  note: {n}" for n in self.notes)


def _table(value) -> Dict[str, Dict[str, int]]:
    """{device: {role: bytes}}, checked."""
    return {_str(d): {_str(role): _int(n) for role, n in _dict(row).items()} for d, row in _dict(value).items()}


def _checked(data) -> dict:
    """The keyword arguments of an Estimate from its plain form, every field of the right type."""
    from array import array

    data = _dict(data)
    raw = data["events"]
    if type(raw) is not bytes or len(raw) % 16:
        raise TypeError("events must be bytes of int64 pairs")
    packed = array("q")
    packed.frombytes(raw)
    if sys.byteorder != "little":
        packed.byteswap()
    flat = packed.tolist()
    phases = []
    for phase in _list(data["phases"]):
        phase = _dict(phase)
        phases.append({"phase": _str(phase["phase"]), "step": _int(phase["step"]), "peak": _int(phase["peak"]),
                       "roles": _table(phase["roles"])})
    modules = []
    for module in _list(data["modules"]):
        module = _dict(module)
        modules.append({"module": _str(module["module"]), "type": _str(module["type"]),
                        **{k: _int(module[k]) for k in ("activations", "calls", "peak")}})
    gpu = data["gpu"]
    return dict(device=_str(data["device"]), peak_allocated=_int(data["peak_allocated"]),
                peak_reserved=_int(data["peak_reserved"]), start_allocated=_int(data["start_allocated"]),
                roles=_table(data["roles"]), phases=phases, modules=modules,
                fixed_costs={_str(k): _int(v) for k, v in _dict(data["fixed_costs"]).items()},
                peak_step=_int(data["peak_step"]), peak_phase=_str(data["peak_phase"]),
                notes=[_str(n) for n in _list(data["notes"])], seconds=_number(data["seconds"]),
                events=list(zip(flat[0::2], flat[1::2])), gpu=None if gpu is None else _str(gpu),
                cublas_workspaces=_int(data["cublas_workspaces"]),
                attention=[_attention_row(row) for row in _list(data["attention"])],
                steady_calls=_int(data["steady_calls"]), steady_extra=_int(data["steady_extra"]))


_ATTENTION_INTS = ("calls", "batch", "heads", "q_len", "kv_len", "head_dim")


def _attention_row(value) -> dict:
    """One group of attention calls, checked."""
    row = _dict(value)
    causal = row["causal"]
    if type(causal) is not bool:
        raise TypeError("causal must be a bool")
    return {"kernel": _str(row["kernel"]), **{k: _int(row[k]) for k in _ATTENTION_INTS}, "dtype": _str(row["dtype"]),
            "mask": _str(row["mask"]), "dropout": _number(row["dropout"]), "causal": causal,
            "refused": {_str(k): _str(v) for k, v in _dict(row["refused"]).items()}}


def _dict(value) -> dict:
    if type(value) is not dict:
        raise TypeError(f"expected a dict, got a {type(value).__name__}")
    return value


def _list(value) -> list:
    if type(value) is not list:
        raise TypeError(f"expected a list, got a {type(value).__name__}")
    return value


def _str(value) -> str:
    if type(value) is not str:
        raise TypeError(f"expected a string, got a {type(value).__name__}")
    return value


def _int(value) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an int, got a {type(value).__name__}")
    return value


def _number(value) -> float:
    if type(value) not in (int, float):
        raise TypeError(f"expected a number, got a {type(value).__name__}")
    return float(value)
