"""The OS-level guard of a sealed run: a seccomp-bpf filter that refuses every system call that could change something outside the child, and private copies of the shared memory the child inherited.

Why at the OS level: the Python shims of :mod:`.shims` only see Python code; a C extension (torch's
C++ ``save``, numpy's ``tofile``, ``ctypes``) calls the kernel directly. The filter is a classic
BPF program handed to ``prctl(PR_SET_SECCOMP)``: it reads the system call's number and arguments
and answers ``EPERM`` (the caller sees ``PermissionError``) or lets it through. It judges an
``open`` by its flags, not its path: any of ``O_WRONLY|O_RDWR|O_CREAT|O_TRUNC|O_APPEND`` is
refused, so no path anywhere can be written, and reads stay free (imports, datasets, source lines).
``openat2`` and ``clone3`` pass their flags in a struct the filter cannot read; they get
``ENOSYS`` so that libc falls back to ``openat`` and ``clone``, which it can. Threads are allowed
(``clone`` with ``CLONE_THREAD``); a new process is not. Signals may only go to the child itself.
Landlock (path rules) would add nothing here: no write-capable ``open`` passes the filter at all.
A top-level child installs the filter with a listener (``notify``): each call it would refuse with
``EPERM`` waits instead for the parent, which names it and answers ``EPERM`` (:mod:`.notify`).

A zygote's filter (``allow_fork``) differs in one thing and adds three refusals. A plain fork passes
(``clone`` without ``CLONE_THREAD`` and without any flag that would share the zygote's memory, files,
working directory or signal handlers, make the new process its parent's sibling, or give it new
namespaces; the ``fork`` call itself on x86_64), so that the zygote can fork a fresh copy of itself
per trial; ``vfork``, ``execve`` and ``execveat`` stay refused, so a forked copy can never become
another program, and it inherits this filter (filters stack: its own, fully sealed, comes on top).
What a process that may fork must not do is leave the process group the parent kills (``setsid``,
``setpgid``), or drop the death signal that ends a trial with its zygote (``prctl(PR_SET_PDEATHSIG)``
with anything but ``SIGKILL``).

Why the shared memory: ``fork`` copies private memory on write, but a ``MAP_SHARED`` mapping (a
numpy ``memmap`` opened ``r+``, ``mmap.mmap(-1, n)``, a ``multiprocessing`` shared array, a
tensor in ``/dev/shm``) stays the same memory in both processes: a plain store in the child would
change the parent's data or the file, and no system call is involved. Each such mapping is
replaced, at the same address, by a private one with the same contents: a file-backed one by a
private mapping of the same file (lazy, nothing is copied), an anonymous one by a copy.

The filter needs the child's own pid (to allow signals to itself), so it is built in the child. In a
child of a zygote the zygote's filter, which allows signals to the zygote only, still holds: such a
child cannot signal itself by pid either (``os.kill(os.getpid(), ...)``, C's ``raise``).

Everything here is plain ctypes on libc; nothing is imported at module level but the standard
library, and ctypes itself is loaded on first use.
"""
from __future__ import annotations

import errno
import functools
import os
import platform
import struct
import sys
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["WRITE_FLAGS", "program", "syscall_names", "unsupported", "libc", "prepare", "install", "die_with_parent",
           "privatise_shared_memory"]

#: Any of these in an open's flags makes it a write: refused.
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_NR, _ARCH, _ARGS = 0, 4, 16
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000  # x86_64's x32 ABI: the same calls under other numbers

# classic BPF opcodes
_LD_ABS = 0x20   # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15      # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35      # BPF_JMP | BPF_JGE | BPF_K
_JSET = 0x45     # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06      # BPF_RET | BPF_K
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
_USER_NOTIF = 0x7FC00000  # the parent decides (and lists the call): kernel 5.0+
_NEW_LISTENER = 1 << 3    # SECCOMP_FILTER_FLAG_NEW_LISTENER
#: The seccomp(2) system call, by architecture.
_SECCOMP_NR = {"x86_64": 317, "aarch64": 277}

_CLONE_THREAD = 0x00010000
#: clone flags that make something other than a plain fork: shared memory (CLONE_VM), files, working
#: directory, signal handlers or SysV undo lists, vfork, a sibling (CLONE_PARENT), tracing, namespaces
_CLONE_NOT_A_FORK = 0x7E86EF00
_PR_SET_PDEATHSIG, _SIGKILL = 1, 9
_IOC_WRITE, _IOC_READ = 0x40000000, 0x80000000  # an ioctl's direction bits (x86_64 and aarch64)
#: ioctls without a direction that only read or touch the child's own descriptor: isatty (TCGETS),
#: terminal size, FIONREAD, FIONBIO / FIOCLEX / FIONCLEX / FIOASYNC, FIGETBSZ, BLKGETSIZE...
_IOCTL_READS = (0x5401, 0x540F, 0x5411, 0x5413, 0x541B, 0x5429, 0x5421, 0x5450, 0x5451, 0x5452, 0x5456,
                0x2, 0x1260, 0x1268)
_AF_UNIX, _AF_INET, _AF_INET6 = 1, 2, 10

# Syscalls refused outright, by name. A name missing from an architecture's table is skipped.
_DENY = """
creat truncate unlink unlinkat rename renameat renameat2 mkdir mkdirat mknod mknodat rmdir link linkat
symlink symlinkat chmod fchmod fchmodat fchmodat2 chown fchown lchown fchownat utime utimes utimensat
futimesat setxattr lsetxattr fsetxattr removexattr lremovexattr fremovexattr setxattrat removexattrat
file_setattr name_to_handle_at open_by_handle_at
connect bind listen accept accept4 sendto sendmsg sendmmsg
execve execveat fork vfork tkill ptrace process_vm_readv process_vm_writev pidfd_open pidfd_send_signal
pidfd_getfd kcmp process_madvise process_mrelease
mount umount2 pivot_root chroot swapon swapoff reboot sethostname setdomainname init_module finit_module
delete_module kexec_load kexec_file_load acct settimeofday clock_settime clock_adjtime adjtimex iopl ioperm
quotactl quotactl_fd unshare setns bpf perf_event_open userfaultfd keyctl add_key request_key fanotify_init
move_mount open_tree open_tree_attr fsopen fsconfig fsmount fspick mount_setattr vhangup syslog
io_uring_setup io_uring_enter io_uring_register
shmget shmat shmctl semget semop semctl semtimedop msgget msgsnd msgrcv msgctl
mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify mq_getsetattr
""".split()

# Numbers of the calls named above and below. 424 and up are the same on every architecture.
_COMMON = {"pidfd_send_signal": 424, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
           "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
           "pidfd_open": 434, "clone3": 435, "openat2": 437, "pidfd_getfd": 438, "process_madvise": 440,
           "mount_setattr": 442, "quotactl_fd": 443, "process_mrelease": 448, "fchmodat2": 452,
           "setxattrat": 463, "removexattrat": 466, "open_tree_attr": 467, "file_setattr": 469}
_X86_64 = dict(_COMMON, **{
    "open": 2, "ioctl": 16, "shmget": 29, "shmat": 30, "shmctl": 31, "socket": 41, "connect": 42, "accept": 43,
    "sendto": 44, "sendmsg": 46, "bind": 49, "listen": 50, "clone": 56, "fork": 57, "vfork": 58, "execve": 59,
    "kill": 62, "semget": 64, "semop": 65, "semctl": 66, "msgget": 68, "msgsnd": 69, "msgrcv": 70,
    "msgctl": 71, "truncate": 76, "rename": 82, "mkdir": 83, "rmdir": 84, "creat": 85, "link": 86,
    "unlink": 87, "symlink": 88, "chmod": 90, "fchmod": 91, "chown": 92, "fchown": 93, "lchown": 94,
    "ptrace": 101, "rt_sigqueueinfo": 129, "utime": 132, "mknod": 133, "setpriority": 141, "vhangup": 153,
    "pivot_root": 155, "adjtimex": 159, "chroot": 161, "acct": 163, "settimeofday": 164, "mount": 165,
    "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171,
    "iopl": 172, "ioperm": 173, "init_module": 175, "delete_module": 176, "quotactl": 179, "setxattr": 188,
    "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199,
    "tkill": 200, "semtimedop": 220, "clock_settime": 227, "tgkill": 234, "utimes": 235, "mq_open": 240,
    "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243, "mq_notify": 244, "mq_getsetattr": 245,
    "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "ioprio_set": 251,
    "migrate_pages": 256, "openat": 257, "mkdirat": 258, "mknodat": 259, "fchownat": 260, "futimesat": 261,
    "unlinkat": 263, "renameat": 264, "linkat": 265, "symlinkat": 266, "fchmodat": 268, "unshare": 272,
    "move_pages": 279, "utimensat": 280, "accept4": 288, "rt_tgsigqueueinfo": 297, "perf_event_open": 298,
    "fanotify_init": 300, "prlimit64": 302, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "clock_adjtime": 305, "sendmmsg": 307, "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311,
    "kcmp": 312, "finit_module": 313, "renameat2": 316, "kexec_file_load": 320, "bpf": 321,
    "execveat": 322, "userfaultfd": 323, "sched_setparam": 142, "sched_setscheduler": 144,
    "sched_setaffinity": 203, "sched_setattr": 314, "fcntl": 72, "syslog": 103,
    "setpgid": 109, "setsid": 112, "prctl": 157,
})
_AARCH64 = dict(_COMMON, **{
    "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "removexattr": 14, "lremovexattr": 15,
    "fremovexattr": 16, "ioctl": 29, "ioprio_set": 30, "mknodat": 33, "mkdirat": 34, "unlinkat": 35,
    "symlinkat": 36, "linkat": 37, "renameat": 38, "umount2": 39, "mount": 40, "pivot_root": 41,
    "truncate": 45, "chroot": 51, "fchmod": 52, "fchmodat": 53, "fchownat": 54, "fchown": 55, "openat": 56,
    "vhangup": 58, "quotactl": 60, "utimensat": 88, "acct": 89, "unshare": 97, "kexec_load": 104,
    "init_module": 105, "delete_module": 106, "clock_settime": 112, "ptrace": 117, "kill": 129, "tkill": 130,
    "tgkill": 131, "rt_sigqueueinfo": 138, "setpriority": 140, "reboot": 142, "sethostname": 161,
    "setdomainname": 162, "settimeofday": 170, "adjtimex": 171, "mq_open": 180, "mq_unlink": 181,
    "mq_timedsend": 182, "mq_timedreceive": 183, "mq_notify": 184, "mq_getsetattr": 185, "msgget": 186,
    "msgctl": 187, "msgrcv": 188, "msgsnd": 189, "semget": 190, "semctl": 191, "semtimedop": 192,
    "semop": 193, "shmget": 194, "shmctl": 195, "shmat": 196, "socket": 198, "bind": 200, "listen": 201,
    "accept": 202, "connect": 203, "sendto": 206, "sendmsg": 211, "add_key": 217, "request_key": 218,
    "keyctl": 219, "clone": 220, "execve": 221, "swapon": 224, "swapoff": 225, "migrate_pages": 238,
    "move_pages": 239, "rt_tgsigqueueinfo": 240, "perf_event_open": 241, "accept4": 242, "prlimit64": 261,
    "fanotify_init": 262, "name_to_handle_at": 264, "open_by_handle_at": 265, "clock_adjtime": 266,
    "setns": 268, "sendmmsg": 269, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
    "finit_module": 273, "renameat2": 276, "bpf": 280, "execveat": 281, "userfaultfd": 282,
    "kexec_file_load": 294, "sched_setparam": 118, "sched_setscheduler": 119, "sched_setaffinity": 122,
    "sched_setattr": 274, "fcntl": 25, "syslog": 116,
    "setpgid": 154, "setsid": 157, "prctl": 167,
})
_TABLES = {"x86_64": _X86_64, "aarch64": _AARCH64}

Insn = Tuple[int, int, int, int]  # (code, jt, jf, k), one struct sock_filter


def _ret(value: int) -> Insn:
    return (_RET, 0, 0, value)


def _deny(code: int = errno.EPERM) -> Insn:
    return _ret(_ERRNO | code)


def _arg(index: int) -> Insn:
    """Load the low 32 bits of argument ``index`` (little-endian): the int the kernel reads."""
    return (_LD_ABS, 0, 0, _ARGS + 8 * index)


def _all_args_in(conditions: Sequence[Tuple[int, Sequence[int]]]) -> List[Insn]:
    """Allow when every (argument, allowed values) holds, else EPERM."""
    body: List[Insn] = []
    size = sum(1 + len(values) for _, values in conditions)
    deny, allow = size, size + 1
    for number, (index, values) in enumerate(conditions):
        body.append(_arg(index))
        target = len(body) + len(values) if number + 1 < len(conditions) else allow
        for i, value in enumerate(values):
            here = len(body)
            last = i + 1 == len(values)
            body.append((_JEQ, target - here - 1, deny - here - 1 if last else 0, value))
    return body + [_deny(), _ret(_ALLOW)]


def _no_flag(index: int, mask: int) -> List[Insn]:
    """EPERM when argument ``index`` has any bit of ``mask``."""
    return [_arg(index), (_JSET, 0, 1, mask), _deny(), _ret(_ALLOW)]


def _needs_flag(index: int, mask: int) -> List[Insn]:
    """EPERM unless argument ``index`` has a bit of ``mask``."""
    return [_arg(index), (_JSET, 1, 0, mask), _deny(), _ret(_ALLOW)]


def _not_in(index: int, values: Sequence[int]) -> List[Insn]:
    """EPERM when argument ``index`` is one of ``values``."""
    n = len(values)
    return [_arg(index)] + [(_JEQ, n - i, 0, v) for i, v in enumerate(values)] + [_ret(_ALLOW), _deny()]


def _clone(allow_fork: bool) -> List[Insn]:
    """A thread always passes; a plain fork only in a zygote."""
    if not allow_fork:
        return _needs_flag(0, _CLONE_THREAD)
    return [_arg(0), (_JSET, 2, 0, _CLONE_THREAD), (_JSET, 0, 1, _CLONE_NOT_A_FORK), _deny(), _ret(_ALLOW)]


def _prctl() -> List[Insn]:
    """A death signal may be set to SIGKILL (a child of a zygote does so), never cleared or changed."""
    return [_arg(0), (_JEQ, 0, 3, _PR_SET_PDEATHSIG), _arg(1), (_JEQ, 1, 0, _SIGKILL), _deny(), _ret(_ALLOW)]


def _ioctl() -> List[Insn]:
    """An ioctl that passes data to the kernel (_IOW, _IOWR) can set anything, on any descriptor the
    child can open read-only (a terminal's modes, TIOCSTI, a file's immutable flag): refused.
    One that only reads (_IOR) passes; of the old ones without a direction, only known readers."""
    known = len(_IOCTL_READS)
    body: List[Insn] = [_arg(1), (_JSET, known + 1, 0, _IOC_WRITE), (_JSET, known + 1, 0, _IOC_READ)]
    for i, value in enumerate(_IOCTL_READS):
        body.append((_JEQ, known - i, 0, value))
    return body + [_deny(), _ret(_ALLOW)]


def _rules(pid: int, allow_fork: bool = False, nested: bool = False) -> List[Tuple[str, List[Insn]]]:
    """(syscall name, the block that decides it), in the order they are tested."""
    rules: List[Tuple[str, List[Insn]]] = [
        ("open", _no_flag(1, WRITE_FLAGS)),
        ("openat", _no_flag(2, WRITE_FLAGS)),
        ("openat2", [_deny(errno.ENOSYS)]),
        ("clone3", [_deny(errno.ENOSYS)]),
        ("clone", _clone(allow_fork)),
        ("socket", _all_args_in([(0, (_AF_UNIX, _AF_INET, _AF_INET6))])),
        ("ioctl", _ioctl()),
        # F_SETOWN, F_SETSIG, F_SETOWN_EX: SIGIO to another process; F_SETLEASE: a lease that stalls
        # the parent's next open of the file
        ("fcntl", _not_in(1, (8, 10, 15, 1024))),
        ("kill", _all_args_in([(0, (pid,))])),
        ("tgkill", _all_args_in([(0, (pid,))])),
        ("rt_sigqueueinfo", _all_args_in([(0, (pid,))])),
        ("rt_tgsigqueueinfo", _all_args_in([(0, (pid,))])),
        ("prlimit64", _all_args_in([(0, (0, pid))])),
        ("migrate_pages", _all_args_in([(0, (0, pid))])),
        ("move_pages", _all_args_in([(0, (0, pid))])),
        ("setpriority", _all_args_in([(0, (0,)), (1, (0, pid))])),   # PRIO_PROCESS, this process only
        ("ioprio_set", _all_args_in([(0, (1,)), (1, (0, pid))])),    # IOPRIO_WHO_PROCESS, this process only
    ] + [
        (name, _all_args_in([(0, (0, pid))]))  # the parent's CPUs and scheduling are not the child's to set
        for name in ("sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr")
    ]
    if not allow_fork:
        # A zygote's trial refuses what its zygote's filter refuses too (its own EPERM comes first, so
        # the zygote's listener is not asked about it).
        keep = [("prctl", _prctl())] + [(name, [_deny()]) for name in ("setsid", "setpgid")] if nested else []
        return rules + keep + [(name, [_deny()]) for name in _DENY]
    rules.append(("prctl", _prctl()))
    return rules + [(name, [_deny()]) for name in _DENY + ["setsid", "setpgid"] if name != "fork"]


def program(machine: str, pid: int, allow_fork: bool = False, notify: bool = False,
            nested: bool = False) -> List[Insn]:
    """The filter for ``machine`` ("x86_64" or "aarch64"), allowing signals to ``pid`` only, and a
    plain fork when ``allow_fork`` (a zygote); ``nested``: a zygote's trial. With ``notify``, every
    call refused with ``EPERM`` goes to the filter's listener instead, whose holder (the parent)
    lists it and answers ``EPERM``."""
    table = _TABLES[machine]
    insns: List[Insn] = [
        (_LD_ABS, 0, 0, _ARCH),
        (_JEQ, 1, 0, _AUDIT_ARCH[machine]),
        _deny(),  # another ABI in this process (i386 through int 0x80): nothing passes
        (_LD_ABS, 0, 0, _NR),
    ]
    if machine == "x86_64":
        insns += [(_JGE, 0, 1, _X32_BIT), _deny()]
    header = len(insns)  # its refusals stay EPERM: a call of another ABI has no name to list
    for name, block in _rules(pid, allow_fork, nested):
        if name in table:  # each block ends in a return, so a chain of (test, block) needs no long jumps
            insns.append((_JEQ, 0, len(block), table[name]))
            insns.extend(block)
    insns.append(_ret(_ALLOW))
    if notify:
        eperm = _deny()
        insns[header:] = [_ret(_USER_NOTIF) if insn == eperm else insn for insn in insns[header:]]
    return insns


def syscall_names(machine: Optional[str] = None) -> Dict[int, str]:
    """{number: name} of the system calls the filter decides, on ``machine`` (this one by default)."""
    table = _TABLES.get(machine or platform.machine(), {})
    return {number: name for name, number in table.items()}


def unsupported() -> Optional[str]:
    """Why no filter can be installed here (one line), or None."""
    if not sys.platform.startswith("linux"):
        return f"seccomp needs Linux, not {sys.platform}"
    machine = platform.machine()
    if machine not in _TABLES:
        return f"no seccomp filter for the {machine} architecture (only x86_64 and aarch64)"
    if sys.byteorder != "little":
        return "no seccomp filter for a big-endian system"
    return None


@functools.lru_cache(maxsize=None)
def _libc():
    """(ctypes, libc) with the prototypes used here; loaded once per process (the parent warms it
    through :func:`prepare`, so that each child finds it ready)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    size, ptr, c_int, c_ulong = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int, ctypes.c_ulong
    libc.prctl.argtypes = [c_int, c_ulong, c_ulong, c_ulong, c_ulong]
    libc.syscall.restype = ctypes.c_long
    libc.mmap.restype = libc.mremap.restype = ptr
    libc.mmap.argtypes = [ptr, size, c_int, c_int, c_int, ctypes.c_long]
    libc.mremap.argtypes = [ptr, size, size, c_int, ptr]
    libc.mprotect.argtypes = [ptr, size, c_int]
    libc.munmap.argtypes = [ptr, size]
    return ctypes, libc


def libc():
    """(ctypes, libc) with the prototypes this room uses, loaded once per process."""
    return _libc()


def prepare() -> None:
    """Load what a child needs, in the parent, once."""
    if unsupported() is None:
        _libc()


def install(pid: int, allow_fork: bool = False, notify: bool = False,
            nested: bool = False) -> Tuple[Optional[str], Optional[int]]:
    """Install the filter on this process for good: (None when it holds, else why not in one line;
    the listener's descriptor when ``notify`` and the kernel gave one, else None).

    ``PR_SET_NO_NEW_PRIVS`` comes first: the kernel requires it of an unprivileged process, and
    it means no later ``execve`` could gain privileges (none may run anyway). With ``notify`` the
    refused calls wait for the listener's holder (:mod:`.notify`); the caller must hand the listener
    over and close its own descriptor before any code of the user's runs, or cover it with
    :func:`install` ``(notify=False)``, whose ``EPERM`` takes precedence. A kernel without listeners
    (before 5.0) gets the plain filter.
    """
    reason = unsupported()
    if reason:
        return reason, None
    ctypes, libc = _libc()
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        return f"prctl(PR_SET_NO_NEW_PRIVS) failed: {os.strerror(ctypes.get_errno())}", None
    machine = platform.machine()
    if notify:
        prog, _keep = _prog(ctypes, program(machine, pid, allow_fork, notify=True, nested=nested))
        listener = libc.syscall(ctypes.c_long(_SECCOMP_NR[machine]), ctypes.c_long(1),  # SECCOMP_SET_MODE_FILTER
                                ctypes.c_long(_NEW_LISTENER), ctypes.c_void_p(ctypes.addressof(prog)))
        if listener >= 0:
            return None, listener
    prog, _keep = _prog(ctypes, program(machine, pid, allow_fork, nested=nested))
    if libc.prctl(22, 2, ctypes.addressof(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        return f"the kernel refused the seccomp filter: {os.strerror(ctypes.get_errno())}", None
    return None, None


def _prog(ctypes, insns: List[Insn]):
    """(struct sock_fprog, the instructions it points to: keep them alive while it is used)."""
    filters = ctypes.create_string_buffer(b"".join(struct.pack("<HBBI", *insn) for insn in insns))
    return ctypes.create_string_buffer(struct.pack("@HP", len(insns), ctypes.addressof(filters))), filters


def die_with_parent(parent: int, thread: Optional[int] = None) -> None:
    """SIGKILL this process when its parent dies (a kernel restarted mid-run leaves no orphan).

    The kernel sends the signal when the parent *thread* that forked us ends: a zygote forks each
    trial from a thread that waits, and ends that thread to kill the trial (it may signal no other
    process). ``thread`` is that thread's native id, checked like the parent itself.
    """
    if not sys.platform.startswith("linux"):
        return
    _ctypes, libc = _libc()
    libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request: nothing would ever kill us
        os._exit(1)
    if thread is not None and not os.path.exists(f"/proc/{parent}/task/{thread}"):
        os._exit(1)  # the forking thread ended before the request (the trial's deadline passed)


# --- private copies of inherited shared memory ---------------------------------------------------------

_PROT = {"r": 1, "w": 2, "x": 4}
_MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x02, 0x10, 0x20
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
#: Anonymous shared memory copied into the child, at most; past it a mapping is made inaccessible.
COPY_BUDGET = 1 << 30


def _shared_mappings() -> List[Tuple[int, int, int, int, int, str]]:
    """(start, end, prot, offset, inode, path) of every MAP_SHARED mapping of this process."""
    with open("/proc/self/maps", "rb") as f:  # read whole before changing anything it lists
        lines = f.read().decode("utf-8", "surrogateescape").splitlines()
    out = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 5 or parts[1][3:4] != "s":
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        prot = sum(_PROT[c] for c in parts[1][:3] if c in _PROT)
        out.append((start, end, prot, int(parts[2], 16), int(parts[4]), parts[5] if len(parts) > 5 else ""))
    return out


def _is_device(path: str) -> bool:
    return path.startswith("/dev/") and not path.startswith(("/dev/shm/", "/dev/zero"))


def _map_file_privately(libc, start, size, prot, offset, inode, path) -> bool:
    """Map the same file, privately, over the shared mapping: same bytes, nothing copied."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_ino != inode:  # the path names another file now
            return False
        addr = libc.mmap(start, size, prot, _MAP_PRIVATE | _MAP_FIXED, fd, offset)
        return addr == start
    finally:
        os.close(fd)


def _copy_privately(libc, ctypes, start, size, prot) -> bool:
    """Replace [start, start+size) by a private anonymous copy, in one atomic mremap."""
    tmp = libc.mmap(None, size, 3, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
    if tmp in (None, ctypes.c_void_p(-1).value):
        return False
    if not prot & 1:
        libc.mprotect(start, size, 1)  # readable long enough to copy
    ctypes.memmove(tmp, start, size)
    libc.mprotect(tmp, size, prot)
    if libc.mremap(tmp, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, start) != start:
        libc.munmap(tmp, size)
        return False
    return True


def privatise_shared_memory() -> Optional[str]:
    """Make every shared mapping private to this process; one line on what could not be, or None.

    Device mappings (``/dev/nvidia*`` and the like) are left alone: copying device memory is
    not safe, and CUDA marks its own mappings ``MADV_DONTFORK`` so a child does not have them.
    """
    if not os.path.exists("/proc/self/maps"):
        return "shared memory mappings stay shared (no /proc/self/maps to find them)"
    ctypes, libc = _libc()
    budget, left_shared = COPY_BUDGET, []
    for start, end, prot, offset, inode, path in _shared_mappings():
        size = end - start
        if _is_device(path):
            continue
        if path.startswith("/") and not path.endswith(" (deleted)"):
            if _map_file_privately(libc, start, size, prot, offset, inode, path):
                continue
        if size <= budget and _copy_privately(libc, ctypes, start, size, prot):
            budget -= size
            continue
        libc.mprotect(start, size, 0)  # neither copied nor remapped: at least it cannot be written
        left_shared.append(path or "anonymous")
    if left_shared:
        return f"{len(left_shared)} shared memory mapping(s) made inaccessible (e.g. {left_shared[0]})"
    return None
