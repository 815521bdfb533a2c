"""The process limits that refuse host memory before RAM runs out, read at the failure: RLIMIT_AS, RLIMIT_DATA and the cgroup's memory.max.

A host allocation fails under such a limit with plenty of RAM still available, and the words must
say so: which limit, its value, and how much of it this process (or its cgroup) already used. Read
from ``resource.getrlimit`` and, on Linux, ``/proc/self/status`` (VmSize, VmData) and the cgroup
files (v2 ``memory.max``/``memory.current``, v1 ``memory.limit_in_bytes``/``memory.usage_in_bytes``),
each opened read-only without following a link, only as a regular file, 4 KiB at most.
"""
from __future__ import annotations

import os
import stat
from typing import NamedTuple, Optional, Tuple

__all__ = ["HostLimit", "host_limits", "binding_limit"]

_CAP = 4096
#: A cgroup v1 "no limit" is a page-rounded 2**63; anything this large is no limit.
_UNLIMITED = 2 ** 60


class HostLimit(NamedTuple):
    """One limit on this process's memory (bytes).

    Attributes:
        name: ``"RLIMIT_AS"``, ``"RLIMIT_DATA"`` or ``"memory.max"`` (``"memory.limit_in_bytes"`` on cgroup v1).
        words: what it is, for a sentence ("the address-space limit (ulimit -v)").
        limit: its value.
        used: what counts against it now (VmSize, VmData, the cgroup's usage), None when unreadable.
    """

    name: str
    words: str
    limit: int
    used: Optional[int]

    @property
    def headroom(self) -> Optional[int]:
        return None if self.used is None else max(0, self.limit - self.used)


def _read(path: str) -> Optional[str]:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, _CAP).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _status(field: str) -> Optional[int]:
    text = _read("/proc/self/status")
    for line in (text or "").splitlines():
        if line.startswith(field + ":"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024  # "VmSize:  123456 kB"
    return None


def _number(text: Optional[str]) -> Optional[int]:
    value = (text or "").strip()
    return int(value) if value.isdigit() else None


def _cgroup() -> Optional[HostLimit]:
    listing = _read("/proc/self/cgroup") or ""
    for line in listing.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or ".." in parts[2]:
            continue
        hierarchy, controllers, path = parts
        rel = path.strip().lstrip("/")
        if hierarchy == "0" and controllers == "":  # cgroup v2
            base = os.path.join("/sys/fs/cgroup", rel)
            limit, used = _number(_read(os.path.join(base, "memory.max"))), \
                _number(_read(os.path.join(base, "memory.current")))
            if limit is not None and limit < _UNLIMITED:
                return HostLimit("memory.max", "the container's memory limit (cgroup memory.max)", limit, used)
        elif "memory" in controllers.split(","):  # cgroup v1
            for base in (os.path.join("/sys/fs/cgroup/memory", rel), "/sys/fs/cgroup/memory"):
                limit = _number(_read(os.path.join(base, "memory.limit_in_bytes")))
                if limit is not None and limit < _UNLIMITED:
                    used = _number(_read(os.path.join(base, "memory.usage_in_bytes")))
                    return HostLimit("memory.limit_in_bytes", "the container's memory limit (cgroup memory.limit_in_bytes)",
                                     limit, used)
    return None


def host_limits() -> Tuple[HostLimit, ...]:
    """Every memory limit set on this process now; () where none is (or the platform has none). Never raises."""
    out = []
    try:
        import resource

        for name, words, field in (("RLIMIT_AS", "the address-space limit (RLIMIT_AS, ulimit -v)", "VmSize"),
                                   ("RLIMIT_DATA", "the data-segment limit (RLIMIT_DATA, ulimit -d)", "VmData")):
            which = getattr(resource, name, None)
            if which is None:
                continue
            soft, _hard = resource.getrlimit(which)
            if soft != resource.RLIM_INFINITY and 0 < soft < _UNLIMITED:
                out.append(HostLimit(name, words, int(soft), _status(field)))
    except Exception:  # noqa: BLE001 - no resource module (Windows), or a failing call: no limit known
        pass
    try:
        group = _cgroup()
        if group is not None:
            out.append(group)
    except Exception:  # noqa: BLE001
        pass
    return tuple(out)


def binding_limit(limits, requested: Optional[int], available: Optional[int]) -> Optional[HostLimit]:
    """The limit that refused the request: one whose headroom is smaller than the request (or, with the
    request's size unknown, smaller than the RAM available), the tightest first; None when no limit binds,
    or when the request is larger than the RAM available anyway (the limit is then not why it failed)."""
    if requested is not None and available is not None and requested > available:
        return None
    binding = []
    for lim in limits:
        room = lim.headroom
        if room is None:
            continue
        if requested is not None:
            if requested > room:
                binding.append(lim)
        elif available is None or room < available:
            binding.append(lim)
    return min(binding, key=lambda lim: lim.headroom) if binding else None
