"""run_sealed(): a function run in a forked child changes nothing the parent owns (files, sockets, processes, memory, RNG, torch settings), and its value, error, deadline and crash come back."""
import ctypes
import errno
import hashlib
import mmap
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from ipy_gpumem.preflight.result import EstimateError
from ipy_gpumem.sealed import MAX_REFUSED, SealedUnavailable, run_sealed, seccomp

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the seal is built for Linux")
DEADLINE = 60  # generous: a loaded 2-core machine must not fail a test by the clock


def _children():
    """{pid: state} of this process's children, zombies included, from /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid():
            out[int(name)] = fields[0]
    return out


def _reaped(pid):
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    assert pid not in _children()


def _sealed(fn, *args, **kwargs):
    outcome = run_sealed(fn, *args, deadline_s=DEADLINE, **kwargs)
    _reaped(outcome.pid)
    assert outcome.guard == "seccomp", outcome.guard_note
    return outcome


def _tree(path):
    """Every file under ``path`` with its bytes and mode: the file system "exactly as before"."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            st = os.lstat(full)
            data = open(full, "rb").read() if os.path.isfile(full) else None
            out[os.path.relpath(full, path)] = (st.st_mode, st.st_size, st.st_mtime_ns, data)
    return out


# --- files -----------------------------------------------------------------------------------------------


def test_writing_a_new_file_pretends_and_leaves_nothing(tmp_path):
    before = _tree(tmp_path)
    target = tmp_path / "ckpt.txt"

    def step():
        with open(target, "w") as f:
            f.write("x" * 1000)
        return f.name

    outcome = _sealed(step)
    assert outcome.ok and outcome.value == str(target)
    assert outcome.refused == (f"open({str(target)!r}, 'w')",)
    assert _tree(tmp_path) == before


def test_append_to_a_handle_opened_before_the_run_never_reaches_the_file(tmp_path):
    path = tmp_path / "log.txt"
    handle = open(path, "a")
    handle.write("parent\n")  # still in the parent's buffer at the fork

    def step():
        handle.write("child\n")
        handle.flush()
        return handle.tell()

    outcome = _sealed(step)
    handle.write("after\n")
    handle.flush()
    handle.close()
    assert outcome.ok
    assert path.read_text() == "parent\nafter\n"
    assert outcome.refused == (f"write to {path} (opened before the run)",)


def test_a_file_open_for_reading_and_writing_is_a_memory_copy_in_the_child(tmp_path):
    """An "a+" log (or a database a connection holds) opened before the run: the child reads what is
    there, its writes succeed and are listed, and the file is as it was."""
    path = tmp_path / "log.txt"
    path.write_text("hello\n")
    handle = open(path, "a+")

    def step():
        handle.write("child\n" * 2000)
        handle.flush()
        handle.seek(0)
        return handle.read(12)

    try:
        outcome = _sealed(step)
    finally:
        handle.close()
    assert outcome.ok and outcome.value == "hello\nchild\n"
    assert outcome.refused == (f"write to {path} (opened before the run)",)
    assert path.read_text() == "hello\n"


def test_sqlite_opened_in_the_child_is_an_in_memory_copy(tmp_path):
    import sqlite3

    path = tmp_path / "runs.db"
    con = sqlite3.connect(path)
    con.execute("create table t(a)")
    con.execute("insert into t values (1)")
    con.commit()
    con.close()
    before = path.read_bytes()

    def step():
        db = sqlite3.connect(path)
        db.execute("insert into t values (2)")
        db.commit()
        rows = db.execute("select a from t order by a").fetchall()
        db.close()
        fresh = sqlite3.connect(tmp_path / "new.db")
        fresh.execute("create table u(b)")
        return rows

    outcome = _sealed(step)
    assert outcome.ok and outcome.value == [(1,), (2,)]
    assert outcome.refused == (f"writes to the sqlite database {str(path)!r} (kept in memory, not written)",
                               f"sqlite3.connect({str(tmp_path / 'new.db')!r}): a new database, kept in memory")
    assert path.read_bytes() == before and not (tmp_path / "new.db").exists()


def test_logging_to_a_file_handler_from_an_earlier_cell(tmp_path):
    import logging

    path = tmp_path / "train.log"
    logger = logging.getLogger("sealed-test")
    handler = logging.FileHandler(path)
    logger.addHandler(handler)
    try:
        outcome = _sealed(lambda: logger.warning("from the child"))
        logger.warning("from the parent")
        handler.flush()
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert path.read_text() == "from the parent\n"
    assert outcome.ok and outcome.refused == (f"write to {path} (opened before the run)",)


def test_torch_save_to_a_path(tmp_path):
    torch = pytest.importorskip("torch")
    before = _tree(tmp_path)
    target = str(tmp_path / "ckpt.pt")
    outcome = _sealed(lambda: torch.save({"w": torch.ones(3)}, target))
    assert outcome.ok and outcome.refused == (f"torch.save(..., {target!r})",)
    assert _tree(tmp_path) == before


def test_numpy_save(tmp_path):
    np = pytest.importorskip("numpy")
    before = _tree(tmp_path)
    target = str(tmp_path / "a.npy")
    outcome = _sealed(lambda: np.save(target, np.arange(10)))
    assert outcome.ok and outcome.refused == (f"open({target!r}, 'wb')",)
    assert _tree(tmp_path) == before


def test_os_remove_of_an_existing_file(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("keep me")
    before = _tree(tmp_path)
    outcome = _sealed(lambda: os.remove(path))
    assert outcome.ok and outcome.refused == (f"os.remove({str(path)!r})",)
    assert _tree(tmp_path) == before


def test_file_system_changes_that_bypass_the_shims_are_refused_by_the_audit_hook(tmp_path):
    import _io
    import posix

    path = tmp_path / "x.txt"
    path.write_text("keep me")
    before = _tree(tmp_path)

    def step():
        errors = []
        for attempt in (lambda: posix.remove(path), lambda: _io.FileIO(tmp_path / "new", "w"),
                        lambda: posix.mkdir(tmp_path / "d")):
            try:
                attempt()
            except PermissionError as exc:
                errors.append(type(exc).__name__)
        return errors

    outcome = _sealed(step)
    assert outcome.value == ["PermissionError"] * 3
    assert f"os.remove({str(path)!r})" in outcome.refused
    assert f"os.mkdir({str(tmp_path / 'd')!r})" in outcome.refused
    assert _tree(tmp_path) == before


def test_the_os_guard_alone_refuses_what_c_code_does(tmp_path):
    """ctypes goes straight to libc: no Python shim or audit hook sees these calls, the filter does."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    before = _tree(tmp_path)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]

    def step():
        libc = ctypes.CDLL(None, use_errno=True)
        calls = {
            "open": lambda: libc.open(str(tmp_path / "new").encode(), os.O_WRONLY | os.O_CREAT, 0o644),
            "open_trunc": lambda: libc.open(str(victim).encode(), os.O_RDONLY | os.O_TRUNC),
            "unlink": lambda: libc.unlink(str(victim).encode()),
            "mkdir": lambda: libc.mkdir(str(tmp_path / "d").encode(), 0o755),
            "chmod": lambda: libc.chmod(str(victim).encode(), 0o777),
            "rename": lambda: libc.rename(str(victim).encode(), str(tmp_path / "moved").encode()),
            "kill_parent": lambda: libc.kill(os.getppid(), 0),
            "fork": lambda: libc.fork(),
            "connect": lambda: _c_connect(libc, port),
            "tiocsti": lambda: libc.ioctl(0, 0x5412, ctypes.c_char_p(b"x")),
        }
        out = {}
        for name, call in calls.items():
            ctypes.set_errno(0)
            out[name] = (call(), errno.errorcode.get(ctypes.get_errno()))
        # still allowed: reading, threads, signals to itself
        out["read"] = victim.read_text()
        box = []
        worker = threading.Thread(target=lambda: box.append(sum(range(10))))
        worker.start()
        worker.join()
        out["thread"] = box
        out["self_signal"] = libc.kill(os.getpid(), 0)
        ctypes.set_errno(0)
        out["isatty"] = (libc.ioctl(0, 0x5401, ctypes.create_string_buffer(64)), ctypes.get_errno())
        return out

    outcome = _sealed(step)
    server.setblocking(False)
    with pytest.raises(BlockingIOError):
        server.accept()  # nobody connected
    server.close()
    value = outcome.value
    for name in ("open", "open_trunc", "unlink", "mkdir", "chmod", "rename", "kill_parent", "fork", "connect",
                 "tiocsti"):
        assert value[name] == (-1, "EPERM"), (name, value[name])
    assert value["read"] == "keep me" and value["thread"] == [45] and value["self_signal"] == 0
    assert value["isatty"] == (-1, errno.ENOTTY)  # the filter let TCGETS through; /dev/null is no terminal
    # nothing went through Python: the filter refused, and the parent named each call it was handed
    new, moved = str(tmp_path / "new"), str(tmp_path / "moved")
    assert outcome.refused[:5] == (f"openat({new!r}, O_WRONLY|O_CREAT) (C code)",
                                   f"openat({str(victim)!r}, O_TRUNC) (C code)", f"unlink({str(victim)!r}) (C code)",
                                   f"mkdir({str(tmp_path / 'd')!r}) (C code)", f"chmod({str(victim)!r}) (C code)")
    assert (outcome.refused[5] + ")").startswith(f"rename({str(victim)!r}, {moved!r}"[:150])
    assert outcome.refused[6:] == (f"kill({os.getpid()}, 0) (C code)", "a new process (fork) (C code)",
                                   f"connect(('127.0.0.1', {port})) (C code)", "ioctl(0, 0x5412) (C code)")
    assert _tree(tmp_path) == before


def _c_connect(libc, port):
    fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
    address = socket.inet_aton("127.0.0.1")
    sockaddr = (ctypes.c_ubyte * 16)(2, 0, port >> 8, port & 0xFF, *address)
    return libc.connect(fd, sockaddr, 16)


def test_reading_a_file_opened_before_the_run_does_not_move_the_parents_offset(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("0123456789")
    raw = os.open(path, os.O_RDONLY)
    try:
        os.read(raw, 2)
        outcome = _sealed(lambda: os.read(raw, 4))
        assert outcome.value == b"2345"
        assert os.read(raw, 3) == b"234"
    finally:
        os.close(raw)


def test_shared_memory_stays_the_parents(tmp_path):
    np = pytest.importorskip("numpy")
    anonymous = mmap.mmap(-1, 4096)  # MAP_SHARED: without the seal the child's store would show here
    path = tmp_path / "m.bin"
    path.write_bytes(bytes(4096))
    mapped = np.memmap(path, dtype=np.uint8, mode="r+")

    def step():
        anonymous[:4] = b"CHLD"
        mapped[:4] = 7
        mapped.flush()  # msync: the child's own private copy, nothing to write back
        return bytes(anonymous[:4]), mapped[:4].tolist()

    outcome = _sealed(step)
    assert outcome.value == (b"CHLD", [7, 7, 7, 7])  # the child saw its own stores
    assert bytes(anonymous[:4]) == bytes(4) and mapped[:4].tolist() == [0, 0, 0, 0]
    del mapped
    assert path.read_bytes() == bytes(4096)


def test_a_process_with_descriptors_past_1024_and_a_caller_thread():
    """A kernel with many open files (select() stops at 1024), and run_sealed called off the main thread."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if max(soft, hard) < 1200 and hard != resource.RLIM_INFINITY:
        pytest.skip("cannot open 1100 descriptors here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    box = []
    try:
        worker = threading.Thread(target=lambda: box.append(run_sealed(lambda: "fine", deadline_s=DEADLINE)))
        worker.start()
        worker.join()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert box[0].value == "fine" and box[0].guard == "seccomp", box[0]
    _reaped(box[0].pid)


# --- processes and network ----------------------------------------------------------------------------


def test_os_system_is_pretended_not_run(tmp_path):
    target = tmp_path / "x"
    outcome = _sealed(lambda: os.system(f"touch {target}"))
    assert outcome.ok and outcome.value == 0  # the step goes on, as after a command that succeeded
    assert outcome.refused == (f"os.system('touch {target}')",)
    assert not target.exists()


def test_subprocess_run(tmp_path):
    target = str(tmp_path / "x")
    outcome = _sealed(lambda: subprocess.run(["touch", target]))
    assert outcome.error.type_name == "PermissionError"
    assert outcome.refused == (f"subprocess ['touch', {target!r}]",)
    assert not os.path.exists(target)


def test_a_socket_connect_to_a_local_server_is_refused():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    address = server.getsockname()

    def step():
        results = []
        for attempt in (lambda: socket.create_connection(address, timeout=2),
                        lambda: socket.socket().connect(address)):
            try:
                attempt()
            except PermissionError:
                results.append("refused")
        return results

    outcome = _sealed(step)
    server.setblocking(False)
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()
    assert outcome.value == ["refused", "refused"]
    assert outcome.refused == (f"socket connect to {address!r}",)


def test_signals_to_the_parent_are_refused():
    outcome = _sealed(lambda: os.kill(os.getppid(), signal.SIGTERM))
    assert outcome.error.type_name == "PermissionError"
    assert outcome.refused == (f"os.kill({os.getpid()}, SIGTERM)",)


# --- memory the child changes in its own copy --------------------------------------------------------

STATE = {"a": 1}
ITEMS = [1, 2]


def test_global_mutations_and_environment_stay_in_the_child():
    os.environ["SEALED_TEST"] = "parent"

    def step():
        STATE["a"] = 2
        STATE["new"] = 3
        ITEMS.append(3)
        os.environ["SEALED_TEST"] = "child"
        os.environ["SEALED_TEST_NEW"] = "child"
        os.chdir("/")
        return dict(STATE), list(ITEMS)

    cwd = os.getcwd()
    outcome = _sealed(step)
    assert outcome.value == ({"a": 2, "new": 3}, [1, 2, 3])
    assert STATE == {"a": 1} and ITEMS == [1, 2]
    assert os.environ["SEALED_TEST"] == "parent" and "SEALED_TEST_NEW" not in os.environ
    assert os.getcwd() == cwd
    assert outcome.refused == ()
    del os.environ["SEALED_TEST"]


def test_rng_states_are_unchanged():
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    states = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone()
    outcome = _sealed(lambda: (random.random(), float(np.random.rand()), float(torch.rand(1))))
    assert outcome.ok
    assert random.getstate() == states[0]
    assert (np.random.get_state()[1] == states[1]).all()
    assert torch.equal(torch.get_rng_state(), states[2])


def test_torch_global_settings_are_unchanged():
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()

    def step():
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        return str(torch.ones(1).dtype), torch.is_grad_enabled()

    outcome = _sealed(step)
    assert outcome.value == ("torch.float64", False)
    assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
    assert torch.get_num_threads() == threads


@pytest.mark.slow
def test_a_torch_op_after_the_parent_used_its_thread_pool_completes():
    torch = pytest.importorskip("torch")
    a = torch.randn(2048, 2048)
    (a @ a).sum()  # the parent's intra-op pool now has threads the child will not
    started = time.monotonic()
    outcome = run_sealed(lambda: float((a @ a)[0, 0]), deadline_s=30)
    assert outcome.ok, outcome
    assert outcome.value == pytest.approx(float((a @ a)[0, 0]), rel=1e-4)
    assert time.monotonic() - started < 20


# --- what comes back ------------------------------------------------------------------------------------


def test_output_is_counted_and_discarded(capfd):
    def step():
        print("one")
        print("two", file=sys.stderr)
        sys.stdout.write("three")
        os.write(1, b"fd level\n")
        import warnings

        warnings.warn("not shown")
        return "done"

    outcome = _sealed(step)
    assert outcome.value == "done" and outcome.printed == 3
    assert capfd.readouterr() == ("", "")


def test_input_raises():
    outcome = _sealed(input)
    assert outcome.error.type_name == "EOFError"


@pytest.mark.slow
def test_a_20_mb_value_arrives_intact():
    def step():
        data = os.urandom(20 * 2**20)
        return data, hashlib.sha256(data).hexdigest()

    outcome = _sealed(step)
    data, digest = outcome.value
    assert len(data) == 20 * 2**20 and hashlib.sha256(data).hexdigest() == digest


@pytest.mark.slow
def test_the_parents_memory_does_not_stay_higher():
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    _sealed(lambda: 1)
    before = rss()
    outcome = _sealed(lambda: b"x" * (64 * 2**20))
    assert len(outcome.value) == 64 * 2**20
    del outcome
    assert rss() - before < 16 * 2**20


def test_an_unpicklable_value_is_an_error_naming_its_type():
    outcome = _sealed(lambda: threading.Lock())
    assert outcome.value is None and not outcome.ok
    assert "_thread.lock" in outcome.error.message


def test_a_value_that_is_not_plain_data_is_an_error_naming_its_type():
    """Only plain data comes back (never a pickle): an object of any class is refused in the child."""
    def step():
        import types

        module = types.ModuleType("made_in_the_child")
        sys.modules[module.__name__] = module
        exec("class Thing:\n    pass\n", module.__dict__)
        return {"ok": [1, 2], "thing": module.Thing()}

    outcome = _sealed(step)
    assert outcome.value is None
    assert "made_in_the_child.Thing is not plain data" in outcome.error.message
    assert _sealed(lambda: (None, True, -2**70, 1.5, "é\ud800", b"\0", [()], {(1, "a"): frozenset({2})}, {3})).value \
        == (None, True, -2**70, 1.5, "é\ud800", b"\0", [()], {(1, "a"): frozenset({2})}, {3})


def test_an_exception_comes_back_with_its_frames_and_attributes():
    def inner():
        raise EstimateError("the step failed", line=("train.py", 7, "loss.backward()"))

    def step():
        inner()

    outcome = _sealed(step)
    error = outcome.error
    assert (error.type_name, error.message, error.module) == ("EstimateError", "the step failed",
                                                              "ipy_gpumem.preflight.result")
    assert error.attrs == {"line": ("train.py", 7, "loss.backward()")}
    raised = 'raise EstimateError("the step failed", line=("train.py", 7, "loss.backward()"))'
    assert [(f[0], f[2], f[3]) for f in error.frames] == [(__file__, "step", "inner()"), (__file__, "inner", raised)]


def test_refusals_are_deduplicated_and_capped(tmp_path):
    def step():
        for i in range(MAX_REFUSED + 5):
            os.remove(tmp_path / f"f{i}")
            os.remove(tmp_path / f"f{i}")

    outcome = _sealed(step)
    assert len(outcome.refused) == MAX_REFUSED + 1
    assert outcome.refused[-1] == "... and 5 more"


# --- how the child ends ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_deadline_kills_the_child_and_leaves_no_zombie():
    started = time.monotonic()
    outcome = run_sealed(time.sleep, 30, deadline_s=1)
    assert time.monotonic() - started < 2
    assert outcome.timed_out and not outcome.ok and outcome.exit is None
    _reaped(outcome.pid)


@pytest.mark.slow
def test_a_run_killed_at_its_deadline_still_reports_what_it_tried(tmp_path):
    def step():
        os.remove(tmp_path / "x")
        time.sleep(30)

    outcome = run_sealed(step, deadline_s=1)
    assert outcome.timed_out and outcome.refused == (f"os.remove({str(tmp_path / 'x')!r})",)


def test_a_segfault_is_reported():
    outcome = _sealed(lambda: ctypes.string_at(0))
    assert outcome.exit == "killed by SIGSEGV" and not outcome.ok


def test_an_exit_without_a_report():
    outcome = _sealed(lambda: os._exit(3))
    assert outcome.exit == "exited with status 3 without a report"


def test_keyboard_interrupt_kills_and_reaps_the_child_then_propagates():
    before = _children()

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    started = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            run_sealed(time.sleep, 30, deadline_s=20)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - started < 3
    assert _children() == before  # the child is gone, not even a zombie


@pytest.mark.slow
def test_a_child_waiting_forever_on_a_lock_held_at_the_fork_is_ended_early():
    lock, release = threading.Lock(), threading.Event()

    def hold():
        with lock:
            release.wait(60)

    holder = threading.Thread(target=hold, name="the-holder")
    holder.start()

    def step():
        with lock:  # held by the-holder, which the fork did not copy
            return 1

    began = time.monotonic()
    try:
        outcome = run_sealed(step, deadline_s=60)
    finally:
        release.set()
        holder.join()
    _reaped(outcome.pid)
    assert outcome.stuck and not outcome.ok and not outcome.timed_out and outcome.value is None
    assert time.monotonic() - began < 30  # seen in about two seconds, not at the deadline
    assert outcome.stuck_frames[-1][2:] == ("step", "with lock:  # held by the-holder, which the fork did not copy")
    assert "the-holder" in outcome.threads


@pytest.mark.slow
def test_a_child_that_waits_with_a_timeout_or_sleeps_is_not_stuck():
    lock, release = threading.Lock(), threading.Event()

    def hold():
        with lock:
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        outcome = run_sealed(lambda: (lock.acquire(timeout=3), time.sleep(1)), deadline_s=60)
    finally:
        release.set()
        holder.join()
    assert outcome.ok and outcome.value == (False, None)


@pytest.mark.parametrize("value", [0, -1, float("nan"), "5", None, True])
def test_a_bad_deadline_is_a_one_line_value_error(value):
    with pytest.raises(ValueError) as info:
        run_sealed(lambda: 1, deadline_s=value)
    assert "deadline_s" in str(info.value) and "\n" not in str(info.value)


def test_an_infinite_or_huge_deadline_is_no_deadline():
    for value in (float("inf"), 1e7, 10**30):
        outcome = _sealed_with(value)
        assert outcome.ok and outcome.value == 1


def _sealed_with(deadline):
    outcome = run_sealed(lambda: 1, deadline_s=deadline)
    _reaped(outcome.pid)
    return outcome


def test_no_fork_no_sealed_run(monkeypatch):
    monkeypatch.delattr(os, "fork")
    with pytest.raises(SealedUnavailable, match="os.fork"):
        run_sealed(lambda: 1, deadline_s=1)


# --- a zygote: a sealed run whose fn runs sealed trials ----------------------------------------------------

COUNTER = {"n": 0}


def _state(pid, started=None):
    """(state letter, start time) of a process, or None when it is gone (or the pid is another process's now)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if started is not None and fields[19] != started:
        return None
    return fields[0], fields[19]


def _descendants(root):
    """{pid: start time} of every process under ``root``, from /proc."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents.setdefault(int(fields[1]), []).append((int(name), fields[19]))
    out, todo = {}, [root]
    while todo:
        for pid, started in parents.get(todo.pop(), []):
            out[pid] = started
            todo.append(pid)
    return out


def _dead(pid, started, within=30):
    """Wait until ``pid`` runs no more (gone, or a zombie its new parent has yet to reap)."""
    until = time.monotonic() + within
    while time.monotonic() < until:
        state = _state(pid, started)
        if state is None or state[0] == "Z":
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_a_zygote_runs_each_trial_from_its_own_pristine_copy():
    def trial(i):
        COUNTER["n"] += 1  # a trial changes the world it runs in
        COUNTER[i] = True
        return dict(COUNTER), os.getppid()

    def zygote():
        COUNTER["n"] = 100  # the warm-up: paid once, seen by every trial
        trials = [run_sealed(trial, i, deadline_s=DEADLINE) for i in range(5)]
        reaped = []
        for t in trials:
            try:
                os.waitpid(t.pid, os.WNOHANG)
            except ChildProcessError:
                reaped.append(t.pid)
        return [(t.ok, t.guard, t.value) for t in trials], reaped, dict(COUNTER), os.getpid()

    outcome = _sealed(zygote, allow_fork=True)
    trials, reaped, after, zygote_pid = outcome.value
    for i, (ok, guard, (seen, parent)) in enumerate(trials):
        assert ok and guard == "seccomp"
        assert seen == {"n": 101, i: True}
        assert parent == zygote_pid
    assert len(set(reaped)) == 5
    assert after == {"n": 100} and COUNTER == {"n": 0}
    assert outcome.refused == ()


def test_a_trial_in_a_zygote_is_sealed_again(tmp_path):
    before = _tree(tmp_path)
    target = tmp_path / "out.txt"

    def trial():
        libc = ctypes.CDLL(None, use_errno=True)
        with open(target, "w") as f:
            f.write("x")
        out = {}
        calls = {
            "fork": lambda: libc.fork(),
            "open": lambda: libc.open(str(tmp_path / "c").encode(), os.O_WRONLY | os.O_CREAT, 0o644),
            "kill_zygote": lambda: libc.kill(os.getppid(), 0),
            "keep_alive_after_the_zygote": lambda: libc.prctl(1, 0, 0, 0, 0),  # PR_SET_PDEATHSIG 0
        }
        for name, call in calls.items():
            ctypes.set_errno(0)
            result = call()
            if name == "fork" and result == 0:
                os._exit(0)
            out[name] = (result, errno.errorcode.get(ctypes.get_errno()))
        try:
            os.fork()
        except PermissionError:
            out["os.fork"] = "refused"
        return out

    def zygote():
        nested = run_sealed(trial, deadline_s=DEADLINE)
        return nested.value, nested.refused, nested.guard

    outcome = _sealed(zygote, allow_fork=True)
    value, refused, guard = outcome.value
    assert guard == "seccomp"
    for name in ("fork", "open", "kill_zygote", "keep_alive_after_the_zygote"):
        assert value[name] == (-1, "EPERM"), (name, value[name])
    assert value["os.fork"] == "refused"
    assert refused == (f"open({str(target)!r}, 'w')", "os.fork()")
    assert outcome.refused == ()  # the trial's refusals are the trial's, not counted again for the zygote
    assert _tree(tmp_path) == before


def test_in_a_zygote_only_run_sealed_may_fork():
    def zygote():
        import posix

        out = []
        for attempt in (os.fork, posix.fork, lambda: subprocess.run(["true"]),
                        lambda: os.posix_spawn("/bin/true", ["true"], {})):
            try:
                if attempt() == 0:
                    os._exit(0)  # a fork that should not have happened: its child must not go on
                out.append("ran")
            except PermissionError:
                out.append("refused")
        return out, run_sealed(lambda: "trial", deadline_s=DEADLINE).value

    outcome = _sealed(zygote, allow_fork=True)
    assert outcome.value == (["refused"] * 4, "trial")
    assert outcome.refused == ("os.fork()", "subprocess ['true']", "os.posix_spawn('/bin/true')")


def test_refusals_of_the_zygote_and_of_its_trials_are_each_counted_once(tmp_path):
    path = tmp_path / "log.txt"
    handle = open(path, "a")
    (tmp_path / "x").write_text("zygote's")
    (tmp_path / "y").write_text("trial's")

    def trial():
        os.remove(tmp_path / "y")
        handle.write("trial\n")
        handle.flush()

    def zygote():
        os.remove(tmp_path / "x")
        nested = [run_sealed(trial, deadline_s=DEADLINE) for _ in range(2)]
        return [t.refused for t in nested]

    outcome = _sealed(zygote, allow_fork=True)
    handle.close()
    trial_refused = (f"os.remove({str(tmp_path / 'y')!r})", f"write to {path} (opened before the run)")
    assert outcome.value == [trial_refused, trial_refused]  # each trial writes to its own copy of the log
    assert outcome.refused == (f"os.remove({str(tmp_path / 'x')!r})",)
    assert path.read_text() == ""
    assert (tmp_path / "x").exists() and (tmp_path / "y").exists()


@pytest.mark.slow
def test_a_trials_deadline_in_a_zygote_kills_the_trial_and_the_zygote_goes_on():
    def zygote():
        started = time.monotonic()
        slow = run_sealed(time.sleep, 120, deadline_s=1)
        took = time.monotonic() - started
        try:
            os.waitpid(slow.pid, os.WNOHANG)
            reaped = False
        except ChildProcessError:
            reaped = True
        return slow.timed_out, took, reaped, run_sealed(lambda: "next", deadline_s=DEADLINE).value

    timed_out, took, reaped, after = _sealed(zygote, allow_fork=True).value
    assert timed_out and reaped and after == "next"
    assert took < 15


@pytest.mark.slow
def test_the_deadline_kills_a_zygote_its_trials_and_what_c_code_forked():
    before = _children()
    seen, stop = {}, threading.Event()

    def watch():
        while not stop.is_set():
            seen.update(_descendants(os.getpid()))
            time.sleep(0.01)

    def zygote():
        libc = ctypes.CDLL(None)
        if libc.fork() == 0:  # behind run_sealed's back: the filter lets a zygote fork, its group dies
            while True:
                libc.pause()
        run_sealed(time.sleep, 120, deadline_s=120)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        outcome = run_sealed(zygote, deadline_s=4, allow_fork=True)
    finally:
        stop.set()
        watcher.join()
    assert outcome.timed_out
    _reaped(outcome.pid)
    assert _children() == before
    below = {pid: started for pid, started in seen.items() if pid != outcome.pid and pid not in before}
    assert len(below) >= 2, seen  # the trial and the C fork, seen running
    for pid, started in below.items():
        assert _dead(pid, started), (pid, _state(pid))


def test_a_sealed_run_inside_a_sealed_run_needs_a_zygote():
    outcome = _sealed(lambda: run_sealed(lambda: 1, deadline_s=DEADLINE))
    assert outcome.error.type_name == "SealedUnavailable" and "allow_fork=True" in outcome.error.message
    assert outcome.refused == ()


# --- the filter itself -----------------------------------------------------------------------------------


def _run_filter(insns, nr, args=(), arch=None, machine="x86_64"):
    """A classic-BPF interpreter over one struct seccomp_data: what the kernel would answer."""
    data = struct.pack("<iIQ6Q", nr, seccomp._AUDIT_ARCH[machine] if arch is None else arch, 0,
                       *[a % 2**64 for a in list(args) + [0] * (6 - len(args))])
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x06:
            return "allow" if k == 0x7FFF0000 else errno.errorcode[k & 0xFFFF]
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_filter_decides_as_designed(machine):
    pid = 4321
    insns = seccomp.program(machine, pid)
    assert 10 < len(insns) < 4096
    nr = dict(seccomp._TABLES[machine], read=0 if machine == "x86_64" else 63)

    def decide(name, *args, **kw):
        return _run_filter(insns, nr[name] if isinstance(name, str) else name, args, machine=machine, **kw)

    assert decide("read", 3) == "allow"
    assert decide("openat", -100, 0, os.O_RDONLY | os.O_CLOEXEC) == "allow"
    for flag in (os.O_WRONLY, os.O_RDWR, os.O_CREAT, os.O_TRUNC, os.O_APPEND):
        assert decide("openat", -100, 0, flag) == "EPERM"
    assert decide("openat", -100, 0, os.O_RDONLY | (1 << 40)) == "allow"  # the kernel reads an int
    assert decide("openat2") == decide("clone3") == "ENOSYS"
    assert decide("clone", 0x3D0F00) == "allow"          # pthread_create's flags (CLONE_THREAD...)
    assert decide("clone", 0x01200011) == "EPERM"        # fork()'s flags
    assert decide("kill", pid, 0) == decide("tgkill", pid, pid + 1, 10) == "allow"
    assert decide("kill", 1, 9) == decide("kill", 0, 9) == decide("kill", 2**32 - 1, 9) == "EPERM"
    assert decide("socket", 2) == decide("socket", 10) == decide("socket", 1) == "allow"
    assert decide("socket", 16) == decide("socket", 17) == "EPERM"  # netlink, packet
    assert decide("ioctl", 0, 0x5401) == decide("ioctl", 0, 0x80086601) == "allow"  # TCGETS, FS_IOC_GETFLAGS
    assert decide("ioctl", 0, 0x5412) == decide("ioctl", 0, 0x5402) == "EPERM"      # TIOCSTI, TCSETS
    assert decide("ioctl", 0, 0x40086602) == decide("ioctl", 0, 0xC0046D00) == "EPERM"  # FS_IOC_SETFLAGS, _IOWR
    assert decide("fcntl", 3, 3) == "allow" and decide("fcntl", 3, 8) == decide("fcntl", 3, 1024) == "EPERM"
    assert decide("setpriority", 0, 0, 5) == "allow" and decide("setpriority", 1, 0, 5) == "EPERM"
    assert decide("sched_setaffinity", 0) == "allow" and decide("sched_setaffinity", 1) == "EPERM"
    for name in ("unlinkat", "renameat2", "mkdirat", "execve", "connect", "sendto", "ptrace", "mount",
                 "io_uring_setup", "fchmodat", "bpf", "process_vm_writev"):
        assert decide(name) == "EPERM", name
    assert decide("read", arch=0x40000003) == "EPERM"  # i386 calls in a 64-bit process
    if machine == "x86_64":
        assert decide(0x40000000 + 2) == "EPERM"  # the x32 ABI
        assert decide("fork") == decide("vfork") == decide("creat") == "EPERM"
        assert decide("open", 0, os.O_RDONLY) == "allow" and decide("open", 0, os.O_WRONLY) == "EPERM"
    assert insns[-1] == (0x06, 0, 0, 0x7FFF0000)  # the default: allow


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_a_zygotes_filter_lets_a_plain_fork_through_and_nothing_more(machine):
    pid = 4321
    zygote, plain = seccomp.program(machine, pid, allow_fork=True), seccomp.program(machine, pid)
    nr = seccomp._TABLES[machine]

    def decide(insns, name, *args):
        return _run_filter(insns, nr[name], args, machine=machine)

    assert decide(zygote, "clone", 0x01200011) == "allow"      # fork()'s flags
    assert decide(zygote, "clone", 0x3D0F00) == "allow"        # a thread
    for flags in (0x4111,        # vfork (CLONE_VM | CLONE_VFORK)
                  0x10000011,    # a new user namespace
                  0x8011,        # CLONE_PARENT: a sibling, not a child
                  0x411,         # CLONE_FILES: the zygote's descriptor table
                  0x211):        # CLONE_FS: the zygote's working directory
        assert decide(zygote, "clone", flags) == "EPERM", hex(flags)
    for name in ("execve", "execveat", "setsid", "setpgid", "kill", "ptrace", "unlinkat"):
        assert decide(zygote, name, 1) == "EPERM", name
    assert decide(zygote, "prctl", 1, 9) == "allow" and decide(zygote, "prctl", 1, 0) == "EPERM"  # PDEATHSIG
    assert decide(zygote, "prctl", 15, 0) == "allow"  # PR_SET_NAME, and the rest
    assert decide(plain, "clone", 0x01200011) == "EPERM"
    assert decide(plain, "prctl", 1, 0) == decide(plain, "setsid") == "allow"  # only a zygote needs these kept
    if machine == "x86_64":
        assert decide(zygote, "fork") == "allow" and decide(zygote, "vfork") == "EPERM"


def test_this_machine_supports_the_filter():
    assert seccomp.unsupported() is None


# --- a real kernel --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_in_a_real_kernel_the_child_prints_nothing_and_the_kernel_answers(tmp_path):
    pytest.importorskip("nbclient")
    pytest.importorskip("torch")
    from kernel_helpers import execute, outputs, plain

    cells = [
        "import logging, os, sys, torch\n"
        "from ipy_gpumem.sealed import run_sealed\n"
        f"d = {str(tmp_path)!r}\n"
        "log = logging.getLogger('sealed-kernel'); log.addHandler(logging.StreamHandler(sys.stderr))\n"
        "a = torch.randn(2048, 2048); b = a @ a\n"
        "def step():\n"
        "    print('hello from the child')\n"
        "    sys.stderr.write('err\\n')\n"
        "    os.write(1, b'fd level\\n')\n"
        "    log.warning('via logging')\n"
        "    from IPython.display import display; display('displayed')\n"
        "    open(os.path.join(d, 'out.txt'), 'w').write('x')\n"
        "    return float((a @ a)[0, 0])\n",
        "o = run_sealed(step, deadline_s=60)",
        "print(o.ok, o.printed, o.refused, os.listdir(d), o.value == float((a @ a)[0, 0]))",
    ]
    nb = execute(cells, timeout=120)
    assert outputs(nb.cells[1]) == []
    out = plain(nb.cells[2])
    assert out == [f"True 3 (\"open('{tmp_path}/out.txt', 'w')\",) [] True\n"], out


# --- the answer: plain data, checked before anything is allocated; the step cannot forge a pickle -------------


class _RunsACommand:
    """A pickle of this runs ``touch <path>`` wherever it is unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _answer_pipe():
    """In the child: the descriptor of its answer pipe, found as hostile code would (the only pipe it has)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("pipe:"):
                return int(name)
        except OSError:
            continue
    raise AssertionError("no pipe")


def _c_write_then(payload, end):
    """A step that writes ``payload`` on the answer pipe from C (no Python shim sees it), then ends."""
    def step():
        libc = ctypes.CDLL(None)
        libc.write(_answer_pipe(), payload, len(payload))
        if end == "exit":
            libc._exit(0)
        return "the real answer"

    return step


def _forged_frames(tmp_path):
    from ipy_gpumem.sealed.protocol import HEAD, VALUE
    from ipy_gpumem.sealed import plain
    import pickle

    evil = pickle.dumps(_RunsACommand(tmp_path / "ran"))
    forged_value = plain.encode({"peak_allocated": 1})
    return {
        "a pickle that runs a command": (HEAD.pack(VALUE, len(evil)) + evil, "exit", "not plain data"),
        "a header claiming 3 GiB": (HEAD.pack(VALUE, 3 << 30), "return", "3221225472 bytes"),
        "garbage": (b"\xde\xad\xbe\xef" * 8, "return", "unknown kind"),
        "a truncated frame": (HEAD.pack(VALUE, 1000) + b"x" * 10, "exit", "ends inside a frame"),
        "a plain frame before the real answer": (HEAD.pack(VALUE, len(forged_value)) + forged_value, "return",
                                                 "after its answer"),
    }


@pytest.mark.parametrize("case", ["a pickle that runs a command", "a header claiming 3 GiB", "garbage",
                                  "a truncated frame", "a plain frame before the real answer"])
def test_a_forged_frame_runs_nothing_allocates_nothing_and_is_refused_in_one_line(tmp_path, case):
    payload, end, said = _forged_frames(tmp_path)[case]
    _sealed(lambda: 1)
    before = _rss()
    outcome = run_sealed(_c_write_then(payload, end), deadline_s=DEADLINE)
    _reaped(outcome.pid)
    assert _rss() - before < 32 << 20  # a 3 GiB claim allocated nothing
    assert not (tmp_path / "ran").exists()  # nothing was unpickled
    assert not outcome.ok and outcome.value is None and outcome.error is None
    assert said in outcome.broken and "\n" not in outcome.broken, outcome.broken


def test_a_forged_listener_frame_is_refused():
    from ipy_gpumem.sealed import plain
    from ipy_gpumem.sealed.protocol import HEAD, LISTEN

    body = plain.encode(0)  # "take my descriptor 0": the parent took the real listener before fn ran
    outcome = run_sealed(_c_write_then(HEAD.pack(LISTEN, len(body)) + body, "return"), deadline_s=DEADLINE)
    _reaped(outcome.pid)
    assert not outcome.ok and "not asked for" in outcome.broken


def test_where_the_parent_cannot_take_the_listener_c_code_is_still_refused(monkeypatch):
    """A fault this machine does not have (Yama's ptrace_scope 3 refuses pidfd_getfd), made by a fake."""
    import ipy_gpumem.sealed.answer as answer

    def refused(pidfd, remote):
        raise OSError(errno.EPERM, "pidfd_getfd: Operation not permitted (a fake, for the test)")

    monkeypatch.setattr(answer, "take_listener", refused)

    def step():
        libc = ctypes.CDLL(None, use_errno=True)
        ctypes.set_errno(0)
        return libc.mkdir(b"/nonexistent-sealed-test", 0o755), errno.errorcode.get(ctypes.get_errno())

    outcome = _sealed(step)
    assert outcome.value == (-1, "EPERM")  # the plain filter covers the listener nobody holds
    assert outcome.refused == () and "the refusals of C code are not listed" in outcome.guard_note


def test_python_code_cannot_write_on_dup_or_close_the_answer_pipe():
    def step():
        fd = _answer_pipe()
        tried = []
        for attempt in (lambda: os.write(fd, b"V" + bytes(8)), lambda: os.dup(fd), lambda: os.dup2(0, fd),
                        lambda: open(fd, "wb", closefd=False), lambda: os.fdopen(fd, "wb", closefd=False),
                        lambda: os.set_blocking(fd, False)):
            try:
                attempt()
                tried.append("done")
            except PermissionError:
                tried.append("refused")
        os.close(fd)  # pretends: the answer still goes out
        os.closerange(3, 1 << 16)
        return tried

    outcome = _sealed(step)
    assert outcome.ok and outcome.value == ["refused"] * 6, outcome
    assert sum("the sealed run's own pipe" in line for line in outcome.refused) == 8


@pytest.mark.slow
def test_plain_data_is_bounded_by_the_bytes_received():
    from ipy_gpumem.sealed import plain

    value = {"events": list(range(-5, 100_000)), "t": (1, 2.5, None), "b": b"\x00\xff", "s": {"x", 3}}
    assert plain.decode(plain.encode(value)) == value
    with pytest.raises(plain.PlainError, match="not plain data"):
        plain.encode({"x": object()})
    deep = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(plain.PlainError, match="nested deeper"):
        plain.encode(deep)
    with pytest.raises(plain.PlainError, match="nested deeper"):
        plain.decode(b"l\x01\x00\x00\x00" * 200 + b"N")
    # lengths and counts that the bytes cannot hold are refused before anything is set aside
    for forged in (b"s\xff\xff\xff\xff", b"l\xff\xff\xff\x7f", b"q\xff\xff\xff\x0f", b"b\x10\x00\x00\x00abc",
                   b"d\x02\x00\x00\x00", b"X", b"i\x01", b""):
        with pytest.raises(plain.PlainError):
            plain.decode(forged)
    # int keys whose hashes collide (2**61 - 1 is the modulus of int hashes) are capped, and quick to refuse
    colliding = {k * (2**61 - 1): 0 for k in range(1, 4200)}
    started = time.monotonic()
    with pytest.raises(plain.PlainError, match="not strings"):
        plain.decode(plain.encode(colliding))
    assert time.monotonic() - started < 10
