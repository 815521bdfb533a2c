"""A cell's private folder where its forked ranks record themselves: made by the OS, written without following links, read as small regular files.

The kernel makes the folder at the cell's first fork with ``tempfile.mkdtemp`` (a new random name,
mode 0700, its owner checked), so no other user can plant anything in it and no folder left by a
crashed kernel is ever used again. It keeps the folder open; a forked rank inherits that
descriptor and writes each record into a new file of its own (``O_CREAT|O_EXCL|O_NOFOLLOW``, a
random name), then renames it inside the folder: a planted link is replaced, never followed. The
kernel reads only ``<pid>.start.json`` and ``<pid>.end.json`` of the pids it was told are its
cell's processes, each opened with ``O_NOFOLLOW|O_NONBLOCK`` (a FIFO never blocks), read only when
it is a regular file of ours under :data:`MAX_RECORD` bytes, and kept only when every field is a
plausible value (:func:`clean_record`). Records are JSON: nothing read here can run.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from typing import Collection, Dict, Optional

from .children import MAX_WORLD_SIZE

__all__ = ["RankFolder", "MAX_RECORD", "clean_record"]

#: A record is a few hundred bytes (a few KiB with many devices); a larger file is not one of ours.
MAX_RECORD = 64 * 1024
#: Folder entries looked at, at most (a cell's ranks write two files each).
MAX_ENTRIES = 4096
#: Devices in one record, at most.
MAX_DEVICES = 64
#: A device counter above this (1 PiB) is not a reading.
MAX_DEVICE_BYTES = 1 << 50
_NAME = re.compile(r"([1-9][0-9]{0,9})\.(start|end)\.json")
_RANK_FROM = ("torch.distributed", "env", "launcher")
_HOST_KEYS = ("rss_before", "rss_after", "peak_rss")
_DEVICE_KEYS = ("allocated_after", "peak_allocated", "reserved_after", "peak_reserved", "used_after", "total")
_DIR_FD = os.open in os.supports_dir_fd and os.rename in os.supports_dir_fd


def _physical_memory() -> int:
    """This machine's memory in bytes: no process's RSS or high-water mark can exceed it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 1 << 50


class RankFolder:
    """One cell's private folder, open in the kernel and inherited by its forks (:meth:`make`)."""

    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def make(cls) -> Optional["RankFolder"]:
        """A new folder only this user can enter (None when it cannot be made, or is not what was asked)."""
        try:
            path = tempfile.mkdtemp(prefix="ipy_gpumem-ranks-")
        except OSError:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            shutil.rmtree(path, ignore_errors=True)
            return None
        info = os.fstat(fd)
        owner = os.geteuid() if hasattr(os, "geteuid") else info.st_uid
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != owner or info.st_mode & 0o077:
            os.close(fd)
            return None  # not the folder mkdtemp promises: write nothing there
        return cls(path, fd)

    # -- in a forked rank ------------------------------------------------------------------------

    def write(self, name: str, data: dict) -> bool:
        """Write ``data`` as ``name`` (a new file, then renamed into place); False when it could not be."""
        payload = json.dumps(data, allow_nan=False).encode()
        if len(payload) > MAX_RECORD:
            return False
        tmp = f".{os.getpid()}.{os.urandom(6).hex()}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            if _DIR_FD:
                fd = os.open(tmp, flags, 0o600, dir_fd=self.fd)
            else:
                fd = os.open(os.path.join(self.path, tmp), flags, 0o600)
            try:
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            if _DIR_FD:
                os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            else:
                os.rename(os.path.join(self.path, tmp), os.path.join(self.path, name))
            return True
        except OSError:  # the cell is over (the folder is gone), or the disk is full
            return False

    # -- in the kernel ---------------------------------------------------------------------------

    def read(self, pids: Collection[int]) -> Dict[int, dict]:
        """``{pid: {"start": record, "end": record}}`` for the given pids only (the cell's processes)."""
        out: Dict[int, dict] = {}
        try:
            entries = os.scandir(self.fd if os.scandir in os.supports_fd else self.path)
        except OSError:
            return out
        with entries:
            for count, entry in enumerate(entries):
                if count >= MAX_ENTRIES:
                    break
                match = _NAME.fullmatch(entry.name)
                if match is None or int(match[1]) not in pids:
                    continue
                pid, kind = int(match[1]), match[2]
                record = clean_record(self._load(entry.name), pid, kind)
                if record is not None:
                    out.setdefault(pid, {})[kind] = record
        return out

    def _load(self, name: str) -> Optional[object]:
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(name, flags, dir_fd=self.fd) if _DIR_FD else os.open(os.path.join(self.path, name), flags)
        except OSError:
            return None  # a link (O_NOFOLLOW), gone, or not ours to read
        try:
            info = os.fstat(fd)
            owner = os.geteuid() if hasattr(os, "geteuid") else info.st_uid
            if not stat.S_ISREG(info.st_mode) or info.st_uid != owner or info.st_size > MAX_RECORD:
                return None  # a FIFO, a device, a folder, someone else's file or too large
            raw = os.read(fd, MAX_RECORD + 1)
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(raw) > MAX_RECORD:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None

    def remove(self) -> None:
        """The folder and what is in it, gone (a rank that writes later writes nothing)."""
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            os.close(self.fd)
        except OSError:
            pass


def _count(value, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high


def clean_record(data, pid: int, kind: str) -> Optional[dict]:
    """The record with only its known fields when every one is plausible, else None: the pid is
    the file's, numbers are integers in range (a host size within this machine's memory), strings short."""
    if not isinstance(data, dict) or data.get("pid") != pid or type(data.get("pid")) is not int:
        return None
    host_max = _physical_memory()
    out = {"pid": pid}
    index = data.get("index")
    if not _count(index, 0, MAX_WORLD_SIZE - 1):
        return None
    out["index"] = index
    keys = ("rss_before",) if kind == "start" else _HOST_KEYS
    for key in keys:
        value = data.get(key)
        if value is not None and not _count(value, 0, host_max):
            return None
        out[key] = value
    if kind == "start":
        return out
    for key in ("rank", "local_rank"):
        value = data.get(key)
        if value is not None and not _count(value, 0, MAX_WORLD_SIZE - 1):
            return None
        out[key] = value
    world = data.get("world_size")
    if world is not None and not _count(world, 1, MAX_WORLD_SIZE):
        return None
    if world is not None and out["rank"] is not None and out["rank"] >= world:
        return None
    out["world_size"] = world
    rank_from = data.get("rank_from")
    if rank_from not in _RANK_FROM:
        return None
    out["rank_from"] = rank_from
    note = data.get("devices_note")
    if note is not None and not (isinstance(note, str) and len(note) <= 1000):
        return None
    out["devices_note"] = note
    devices = data.get("devices") or []
    if not isinstance(devices, list) or len(devices) > MAX_DEVICES:
        return None
    out["devices"] = []
    for device in devices:
        if not isinstance(device, dict) or not _count(device.get("index"), 0, 4095):
            return None
        name = device.get("name")
        if name is not None and not (isinstance(name, str) and len(name) <= 256):
            return None
        clean = {"index": device["index"], "name": name}
        for key in _DEVICE_KEYS:
            value = device.get(key)
            if value is not None and not _count(value, 0, MAX_DEVICE_BYTES):
                return None
            clean[key] = value
        out["devices"].append(clean)
    return out
