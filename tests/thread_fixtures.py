"""The real out-of-memory threads and NVML readings under ``tests/fixtures/threads``, read into numbers, and a replay of NVML built from them.

Everything here reads the fixtures' own text (the messages, nvidia-smi tables, the XML) with its own
small parsers, independent of ``ipy_gpumem``, so that a test comparing the two compares our reading
with the thread, not with ourselves. ``replay_pynvml`` is a stand-in ``pynvml`` module: it answers
with exactly the values copied from a thread and raises for anything the thread does not give.
"""
from __future__ import annotations

import json
import os
import re
import types
import xml.etree.ElementTree as ET
from decimal import Decimal
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
THREADS = os.path.join(HERE, "fixtures", "threads")

#: The OOM threads, by fixture name; each has ``message`` and ``message_figures``.
OOM_THREADS = ("pytorch-35901", "pytorch-37250", "mask2dit-4", "pytorch-111729")

_UNITS = {"B": 1, "KB": 2**10, "KiB": 2**10, "MB": 2**20, "MiB": 2**20, "GB": 2**30, "GiB": 2**30}
_FIGURE = re.compile(r"^([0-9]+(?:\.[0-9]+)?) ?(B|KiB|MiB|GiB|KB|MB|GB)$")
MiB = 2**20
GiB = 2**30


def load(name: str) -> dict:
    with open(os.path.join(THREADS, name + ".json"), encoding="utf-8") as f:
        return json.load(f)


def text_of(name: str) -> str:
    with open(os.path.join(THREADS, name), encoding="utf-8") as f:
        return f.read()


def to_bytes(figure: str, binary_mb: bool = True) -> float:
    """``"10.84 GiB"`` -> bytes, exactly as written (a float: the text's decimals are kept).

    torch's messages, memory_summary ("MB") and nvidia-smi ("MiB") are binary; ``binary_mb=False``
    reads a bare "MB" as 10**6 (the nvml-wrapper thread's figures).
    """
    m = _FIGURE.match(figure.strip())
    if m is None:
        raise ValueError(f"not a size: {figure!r}")
    number, unit = Decimal(m.group(1)), m.group(2)
    factor = 10**6 if (unit == "MB" and not binary_mb) else _UNITS[unit]
    return float(number * factor)


def rounding(figure: str) -> float:
    """Half of the last printed digit, in bytes: how far the exact value may be from the figure."""
    m = _FIGURE.match(figure.strip())
    decimals = len(m.group(1).split(".")[1]) if "." in m.group(1) else 0
    return 0.5 * 10**-decimals * _UNITS[m.group(2)]


def summary_rows(lines: List[str]) -> Dict[str, List[str]]:
    """``memory_summary()`` rows: metric -> [Cur Usage, Peak Usage, Tot Alloc, Tot Freed] as written."""
    rows = {}
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] and not cells[0].startswith("Metric") and not cells[0].startswith("from"):
            rows[cells[0]] = cells[1:]
    return rows


# ---------------------------------------------------------------------------------------------
# nvidia-smi: the XML of gpustack's detector and nvitop's table
# ---------------------------------------------------------------------------------------------


def gpustack_mig() -> Dict[str, Dict[str, int]]:
    """``{"gpu": {...}, "mig": {...}}`` of the XML's ``fb_memory_usage`` (total, reserved, used, free) in MiB."""
    root = ET.parse(os.path.join(THREADS, "gpustack-nvidia-smi-mig.xml")).getroot()

    def usage(elem) -> Dict[str, int]:
        fb = elem.find("fb_memory_usage")
        return {key: int(fb.find(key).text.split()[0]) for key in ("total", "reserved", "used", "free")}

    gpu = root.find("gpu")
    return {"gpu": usage(gpu), "mig": usage(gpu.find("mig_devices/mig_device"))}


_SMI_GPU = re.compile(r"^\|\s+(\d+)\s+NVIDIA")
_SMI_MEM = re.compile(r"\|\s+(\d+)MiB / (\d+)MiB \|")
_MIG_ROW = re.compile(r"^\|\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\|\s+(\d+)MiB / (\d+)MiB \|")
_PROC_ROW = re.compile(r"^\|\s+(\d+)\s+(\S+)\s+(\S+)\s+(\d+)\s+C\s+(\S+)\s+(\d+)MiB \|")


def nvitop_mig() -> dict:
    """nvitop PR #8's table: ``pid`` of test.py, ``gpus`` {index: (used, total)}, ``migs`` [(gpu, gi, used,
    total)], ``processes`` [(gpu, gi or None, pid, name, MiB)], all in MiB as printed."""
    text = text_of("nvitop-pr8-a100-mig.txt")
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    pid = int(next(line for line in lines if line.startswith("PID:")).split()[1])
    gpus, migs, procs = {}, [], []
    current = None
    for line in lines:
        m = _SMI_GPU.match(line)
        if m:
            current = int(m.group(1))
            continue
        m = _MIG_ROW.match(line)
        if m:
            migs.append((int(m.group(1)), int(m.group(2)), int(m.group(5)), int(m.group(6))))
            continue
        m = _PROC_ROW.match(line)
        if m:
            gi = None if m.group(2) == "N/A" else int(m.group(2))
            procs.append((int(m.group(1)), gi, int(m.group(4)), m.group(5), int(m.group(6))))
            continue
        m = _SMI_MEM.search(line)
        if m and current is not None and current not in gpus:
            gpus[current] = (int(m.group(1)), int(m.group(2)))
    return {"pid": pid, "gpus": gpus, "migs": migs, "processes": procs}


# ---------------------------------------------------------------------------------------------
# A replay of nvidia-ml-py built from those values
# ---------------------------------------------------------------------------------------------


class NotInTheSource(Exception):
    """Asked for a value the thread does not give: the replay cannot answer it."""


class ReplayDevice:
    """One device as a thread shows it; a field left None is one the thread does not give."""

    def __init__(self, uuid: str, v1: Optional[dict] = None, v2: Optional[dict] = None,
                 processes: Optional[List[Tuple[int, int, str]]] = None):
        self.uuid, self.v1, self.v2, self.processes = uuid, v1, v2, processes


def replay_pynvml(devices: List[ReplayDevice], v2_supported: bool = True) -> types.ModuleType:
    """A stand-in ``pynvml`` module (a replay, not a driver) answering with the given devices' real values.

    ``nvmlMemory_v2`` is nvidia-ml-py's own constant. ``v2_supported=False`` answers the v2 call as
    a driver before R510 does (Function Not Found). Whatever the thread did not show raises
    :class:`NotInTheSource` (an ``NVMLError``), so a test also proves which values the probe read.
    """
    mod = types.ModuleType("pynvml")
    mod.__doc__ = "Replay of NVML answers copied from public threads (tests/fixtures/threads); not a driver."

    class NVMLError(Exception):
        pass

    class _Missing(NVMLError, NotInTheSource):
        pass

    mod.NVMLError = NVMLError
    mod.nvmlMemory_v2 = 0x02000028  # nvidia-ml-py 13.x: sizeof(c_nvmlMemory_v2_t) | 2 << 24
    handles = {("h", i): d for i, d in enumerate(devices)}
    mod.calls = []

    def record(name):
        def wrap(fn):
            def call(*args, **kwargs):
                mod.calls.append(name)
                return fn(*args, **kwargs)
            setattr(mod, name, call)
            return call
        return wrap

    @record("nvmlInit")
    def _init():
        return None

    @record("nvmlShutdown")
    def _shutdown():
        return None

    @record("nvmlDeviceGetCount")
    def _count():
        return len(devices)

    @record("nvmlDeviceGetHandleByIndex")
    def _by_index(i):
        if not 0 <= i < len(devices):
            raise NVMLError("Invalid Argument")
        return ("h", i)

    @record("nvmlDeviceGetHandleByUUID")
    def _by_uuid(uuid):
        for h, d in handles.items():
            if d.uuid == uuid:
                return h
        raise NVMLError("Not Found")

    @record("nvmlDeviceGetUUID")
    def _uuid(h):
        return handles[h].uuid.encode()

    @record("nvmlDeviceGetMemoryInfo")
    def _memory(h, version=None):
        d = handles[h]
        if version:
            if not v2_supported:
                raise NVMLError("Function Not Found")
            if version != mod.nvmlMemory_v2:
                raise NVMLError("Argument Version Mismatch")
            info = d.v2
        else:
            info = d.v1
        if info is None:
            raise _Missing(f"{d.uuid}: the thread gives no {'v2' if version else 'v1'} reading")
        return _Struct(d.uuid, info)

    @record("nvmlDeviceGetComputeRunningProcesses")
    def _procs(h):
        d = handles[h]
        if d.processes is None:
            raise _Missing(f"{d.uuid}: the thread gives no process list")
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used, _name in d.processes]

    @record("nvmlSystemGetProcessName")
    def _name(pid):
        for d in devices:
            for p, _used, name in d.processes or ():
                if p == pid:
                    return name.encode()
        raise NVMLError("Not Found")

    return mod


class _Struct:
    """A memory struct whose fields exist only where the thread gives them."""

    def __init__(self, uuid: str, values: dict):
        self._uuid, self._values = uuid, values

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._values:
            raise NotInTheSource(f"{self._uuid}: the thread gives no '{name}'")
        return self._values[name]
