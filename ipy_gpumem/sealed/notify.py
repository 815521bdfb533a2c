"""The parent's side of the refusals C code meets: it holds the child's seccomp listener, lists each refused system call in one line, and answers it ``EPERM``.

Why: the Python shims record what Python code tried; what C code tries (sqlite opening its journal,
a ``SemLock`` made in ``/dev/shm``, numpy's ``tofile``, ctypes) reaches the kernel, where the filter
refuses it. A filter that answers ``EPERM`` itself tells nobody, so the child's filter hands each
such call to a listener instead (``SECCOMP_RET_USER_NOTIF``, Linux 5.0+). The child sends the
listener's number on its pipe; the parent takes a copy of the descriptor (``pidfd_getfd``, Linux
5.6+) and tells the child, which closes its own before any code of the user's runs: the step can
never answer its own calls. Each call then waits until the parent has named it (the path is read
from the child's memory, ``/proc/<pid>/mem``) and answered ``EPERM``, as the plain filter would.

Where the parent cannot take the listener, the child covers it with the plain filter (its ``EPERM``
takes precedence) and the run's guard note says that C code's refusals are not listed.
"""
from __future__ import annotations

import errno
import os
import select
import struct
from typing import Callable, List, Optional

from . import seccomp

__all__ = ["Listener", "take_listener", "describe"]

_PIDFD_GETFD = 438
# struct seccomp_notif: u64 id; u32 pid; u32 flags; struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}
_NOTIF = struct.Struct("<QIIiIQ6Q")
_RESP = struct.Struct("<QqiI")  # struct seccomp_notif_resp: u64 id; s64 val; s32 error; u32 flags
_RECV = 0xC0502100              # SECCOMP_IOCTL_NOTIF_RECV = _IOWR('!', 0, struct seccomp_notif)
_SEND = 0xC0182101              # SECCOMP_IOCTL_NOTIF_SEND = _IOWR('!', 1, struct seccomp_notif_resp)
_ID_VALID = 0x40082102          # SECCOMP_IOCTL_NOTIF_ID_VALID = _IOW('!', 2, __u64)
_AT_FDCWD = -100
#: Notifications served in one go before the parent looks at its other work (the pipe, the clock).
_BATCH = 64


def take_listener(pidfd: Optional[int], remote_fd: int) -> int:
    """A copy, in this process, of the child's descriptor ``remote_fd`` (its listener); OSError if it cannot be had."""
    if pidfd is None:
        raise OSError(errno.ENOSYS, "no pidfd for the child (Linux 5.3+)")
    ctypes, libc = seccomp.libc()
    ctypes.set_errno(0)
    fd = libc.syscall(ctypes.c_long(_PIDFD_GETFD), ctypes.c_long(pidfd), ctypes.c_long(remote_fd), ctypes.c_long(0))
    if fd < 0:
        number = ctypes.get_errno()
        raise OSError(number, f"pidfd_getfd: {os.strerror(number)}")
    try:
        kind = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        kind = ""
    if kind != "anon_inode:seccomp notify":  # the number came from the child: it must name a listener
        os.close(fd)
        raise OSError(errno.EINVAL, f"descriptor {remote_fd} of the child is no seccomp listener ({kind or '?'})")
    return fd


class Listener:
    """A child's seccomp listener, held by the parent: :meth:`serve` names and refuses what is waiting."""

    def __init__(self, fd: int, show: Callable[[str], str] = lambda path: path):
        self.fd = fd
        #: it failed in a way that will not pass (the caller stops polling it)
        self.dead = False
        self._show = show
        self._names = seccomp.syscall_names()
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def fileno(self) -> int:
        return self.fd

    def serve(self) -> List[str]:
        """Answer every call waiting now with EPERM; one line for each (the caller deduplicates)."""
        import fcntl

        lines = []
        for _ in range(_BATCH):
            if not self._poll.poll(0):
                break
            buf = bytearray(_NOTIF.size)  # the kernel wants it zeroed
            try:
                fcntl.ioctl(self.fd, _RECV, buf, True)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.EINTR):
                    self.dead = True  # not a listener that works: the caller stops polling it
                break  # the caller was killed, or the child is gone: nothing to answer
            call_id, pid, _flags, nr, _arch, _ip, *args = _NOTIF.unpack(buf)
            name = self._names.get(nr, f"system call {nr}")
            memory = _Memory(pid)
            try:
                line = describe(name, args, memory, self._show)
                fcntl.ioctl(self.fd, _ID_VALID, struct.pack("<Q", call_id))  # the memory read was that call's
            except Exception:  # noqa: BLE001 - naming a call must never stop the answer
                line = f"{name}() (C code)"
            finally:
                memory.close()
            lines.append(line)
            try:
                fcntl.ioctl(self.fd, _SEND, bytearray(_RESP.pack(call_id, 0, -errno.EPERM, 0)), True)
            except OSError:
                pass  # the caller was killed meanwhile
        return lines

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Memory:
    """Bounded reads of the calling thread's memory (strings and small structs)."""

    def __init__(self, pid: int):
        self.pid = pid
        self._fd: Optional[int] = None

    def read(self, address: int, size: int) -> bytes:
        if self._fd is None:
            self._fd = os.open(f"/proc/{self.pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(self._fd, size, address)
        except OSError:
            return b""

    def string(self, address: int, limit: int = 1024) -> Optional[bytes]:
        if not address:
            return None
        out = b""
        while len(out) < limit:
            page_left = 4096 - (address + len(out)) % 4096
            chunk = self.read(address + len(out), min(page_left, limit - len(out)))
            if not chunk:
                break
            end = chunk.find(b"\0")
            if end >= 0:
                return out + chunk[:end]
            out += chunk
        return out

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


#: call name -> (positions of its path arguments, position of its directory descriptor or None)
_PATHS = {
    "open": ((0,), None), "creat": ((0,), None), "truncate": ((0,), None), "unlink": ((0,), None),
    "mkdir": ((0,), None), "rmdir": ((0,), None), "mknod": ((0,), None), "chmod": ((0,), None),
    "chown": ((0,), None), "lchown": ((0,), None), "utime": ((0,), None), "utimes": ((0,), None),
    "setxattr": ((0,), None), "lsetxattr": ((0,), None), "removexattr": ((0,), None),
    "lremovexattr": ((0,), None), "execve": ((0,), None), "chroot": ((0,), None), "acct": ((0,), None),
    "swapon": ((0,), None), "umount2": ((0,), None), "rename": ((0, 1), None), "link": ((0, 1), None),
    "symlink": ((0, 1), None), "pivot_root": ((0, 1), None), "mount": ((0, 1), None),
    "openat": ((1,), 0), "unlinkat": ((1,), 0), "mkdirat": ((1,), 0), "mknodat": ((1,), 0),
    "fchmodat": ((1,), 0), "fchmodat2": ((1,), 0), "fchownat": ((1,), 0), "utimensat": ((1,), 0),
    "futimesat": ((1,), 0), "execveat": ((1,), 0), "renameat": ((1, 3), 0), "renameat2": ((1, 3), 0),
    "linkat": ((1, 3), 0), "symlinkat": ((0, 2), None),
}
_ADDRESSES = {"connect": (1, 2), "bind": (1, 2), "sendto": (4, 5)}
_FLAGS = ("O_WRONLY", "O_RDWR", "O_CREAT", "O_EXCL", "O_TRUNC", "O_APPEND")


def _flags(value: int) -> str:
    names = [name for name in _FLAGS if value & getattr(os, name)]
    return "|".join(names) or "O_RDONLY"


def _int(value: int) -> int:
    """A system call's int argument (the low 32 bits, signed)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def describe(name: str, args, memory, show: Callable[[str], str] = lambda path: path) -> str:
    """One line for a refused call of C code: ``openat('x.db-journal', O_RDWR|O_CREAT) (C code)``."""
    parts: List[str] = []
    if name in _PATHS:
        positions, dirfd = _PATHS[name]
        for index in positions:
            raw = memory.string(args[index])
            path = os.fsdecode(raw) if raw is not None else "NULL"
            if dirfd is not None and _int(args[dirfd]) != _AT_FDCWD and raw and not raw.startswith(b"/"):
                path = f"fd {_int(args[dirfd])}/{path}"
            parts.append(repr(show(path)))
        if name in ("open", "openat"):
            parts.append(_flags(args[positions[0] + 1]))
    elif name in _ADDRESSES:
        where, size = _ADDRESSES[name]
        parts.append(_address(memory.read(args[where], min(args[size], 128)) if args[where] else b""))
    elif name in ("kill", "tkill"):
        parts += [str(_int(args[0])), _signal(args[1])]
    elif name == "tgkill":
        parts += [str(_int(args[0])), _signal(args[2])]
    elif name in ("clone", "fork", "vfork"):
        return "a new process (fork) (C code)"
    elif name == "socket":
        parts.append(_family(_int(args[0])))
    elif name in ("ioctl", "fcntl"):
        parts += [str(_int(args[0])), hex(args[1] & 0xFFFFFFFF)]
    line = f"{name}({', '.join(parts)}) (C code)"
    return line if len(line) <= 160 else line[:157] + "..."


def _signal(number: int) -> str:
    import signal

    try:
        return signal.Signals(_int(number)).name
    except ValueError:
        return str(_int(number))


def _family(number: int) -> str:
    import socket

    try:
        return socket.AddressFamily(number).name
    except ValueError:
        return str(number)


def _address(raw: bytes) -> str:
    """A struct sockaddr as Python writes an address: ('127.0.0.1', 8080), '/run/x.sock'."""
    import socket

    if len(raw) < 2:
        return "?"
    family = struct.unpack_from("=H", raw)[0]
    if family == socket.AF_INET and len(raw) >= 8:
        return repr((socket.inet_ntop(socket.AF_INET, raw[4:8]), struct.unpack_from(">H", raw, 2)[0]))
    if family == socket.AF_INET6 and len(raw) >= 24:
        return repr((socket.inet_ntop(socket.AF_INET6, raw[8:24]), struct.unpack_from(">H", raw, 2)[0]))
    if family == socket.AF_UNIX:
        path = raw[2:].split(b"\0", 1)[0] if raw[2:3] != b"\0" else b"@" + raw[3:].split(b"\0", 1)[0]
        return repr(os.fsdecode(path))
    return _family(family)
