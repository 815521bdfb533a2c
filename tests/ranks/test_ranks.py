"""Several processes (issue 20): ranks launched from a cell, for real, on the CPU with gloo.

A module of rank functions is written to a temporary folder (spawned ranks import it; a notebook's
own functions cannot be pickled for spawn), then one real kernel (nbclient) runs launches through
torch.multiprocessing (fork and spawn, two and four ranks) and accelerate's ``notebook_launcher``:
a rank that allocates more than the others, a rank that fails with a real host out-of-memory
(``torch.empty(2**50)``), and a rank that kills itself with SIGKILL.
"""
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from kernel_helpers import execute, outputs, plain

pytest.importorskip("torch")

from ipy_gpumem.ranks import children  # noqa: E402
from ipy_gpumem.core.records import CellRecord, HostRecord, RankRecord, records_frame, worst_rank  # noqa: E402
from ipy_gpumem.ranks.folder import RankFolder, clean_record  # noqa: E402
from ipy_gpumem.ranks.watch import RankWatch, launcher_failure  # noqa: E402
from ipy_gpumem.display.words import rank_note  # noqa: E402

MiB = 2 ** 20

RANK_MODULE = textwrap.dedent('''
    import os
    import torch
    import torch.distributed as dist

    def work(rank, world, port, big, mode="ok"):
        """A gloo step; rank ``big`` keeps 64 MiB more than the others, then fails as ``mode`` says
        (``kill_now``: killed by SIGKILL at once, the others wait to be terminated)."""
        if mode == "kill_now":
            if rank == big:
                os.kill(os.getpid(), 9)
            import time
            time.sleep(30)
        torch.set_num_threads(1)
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        t = torch.ones(1000)
        dist.all_reduce(t)
        keep = torch.ones((72 if rank == big else 8) * 2 ** 20 // 4)
        if rank == big and mode == "oom":
            torch.empty(2 ** 50)  # a real host out-of-memory: DefaultCPUAllocator
        if rank == big and mode == "kill":
            os.kill(os.getpid(), 9)
        if mode == "ok":
            dist.barrier()
        dist.destroy_process_group()
        return keep.sum()

    def accelerate_work(big, mode="ok"):
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        keep = torch.ones((72 if acc.process_index == big else 8) * 2 ** 20 // 4)
        if acc.process_index == big and mode == "oom":
            torch.empty(2 ** 50)
        if mode == "ok":
            acc.wait_for_everyone()
        return keep.sum()
''')


def _ports(n):
    out, socks = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        out.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return out


# -- without a kernel ---------------------------------------------------------------------------


def test_children_are_read_from_outside_with_their_rank():
    env = dict(os.environ, RANK="3", LOCAL_RANK="1", WORLD_SIZE="4")
    proc = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(40 * 2**20); time.sleep(3)"], env=env)
    try:
        deadline = time.time() + 10
        mem = None
        while time.time() < deadline:
            mem = children.child_memory(proc.pid)
            if mem is not None and mem.hwm and mem.hwm > 40 * MiB:
                break
            time.sleep(0.05)
        assert proc.pid in children.descendants()
        info = children.child_info(proc.pid)
        assert (info.rank, info.local_rank, info.world_size, info.ppid) == (3, 1, 4, os.getpid())
        assert mem.hwm > 40 * MiB and mem.rss > 40 * MiB
    finally:
        proc.kill()
        proc.wait()
    assert children.child_memory(proc.pid) is None  # gone: unavailable is a value


def test_a_cell_that_launches_nothing_lists_children_once_and_gets_no_ranks():
    watch = RankWatch()
    try:
        for _ in range(5):
            watch.cell_started()
            assert watch.cell_finished() is None
        assert watch.listings == 5  # one read of the main thread's children at each cell's end
        assert watch.wakeups == 0 and watch._thread is None  # no thread started, none woken
    finally:
        watch.close()


def test_forked_ranks_record_themselves_and_the_launchers_exception_names_the_failing_rank(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    made = []  # a spy on the real folder maker: which folders the cells made

    def make(real=RankFolder.make):
        folder = real()
        made.append(folder.path)
        return folder

    monkeypatch.setattr(RankFolder, "make", make)

    (tmp_path / "rank_work_unit.py").write_text(RANK_MODULE.replace("def work(", "def work(").strip())
    sys.path.insert(0, str(tmp_path))
    try:
        import rank_work_unit

        watch = RankWatch()
        try:
            port, port2 = _ports(2)
            watch.cell_started()
            mp.start_processes(rank_work_unit.work, args=(2, port, 1), nprocs=2, start_method="fork")
            ranks = watch.cell_finished()
            assert [(r.rank, r.seen, r.end, r.rank_from) for r in ranks] == [
                (0, "inside", "exited", "launcher"), (1, "inside", "exited", "launcher")]
            assert worst_rank(ranks).rank == 1
            assert ranks[1].host.rss_peak_increase - ranks[0].host.rss_peak_increase > 48 * MiB
            assert ranks[0].devices == () and "CPU-only" in ranks[0].devices_note

            watch.cell_started()
            with pytest.raises(Exception) as info:
                mp.start_processes(rank_work_unit.work, args=(2, port2, 1, "oom"), nprocs=2, start_method="fork")
            failure = launcher_failure(info.value)
            ranks = watch.cell_finished(failure)
            assert (failure.rank, failure.exception, failure.error) == (1, "ProcessRaisedException", "RuntimeError")
            assert "DefaultCPUAllocator" in failure.message and failure.pid == ranks[1].pid
            assert len(made) == 2 and not [p for p in made if os.path.lexists(p)]  # one folder a cell, removed
        finally:
            watch.close()
    finally:
        sys.path.remove(str(tmp_path))


@pytest.mark.slow
def test_a_rank_that_ended_before_its_first_reading_still_gets_its_row(tmp_path):
    """Spawned ranks are read from outside every POLL_S; one killed before its first reading, and
    reaped by the launcher before the cell ends, was never seen (issue 29). The launcher's index for
    each process it spawned, and its exception for the failing one, still give each its row. The
    reading interval is set to a minute here, so that no reading happens while they live."""
    import torch.multiprocessing as mp

    (tmp_path / "rank_work_now.py").write_text(RANK_MODULE)
    sys.path.insert(0, str(tmp_path))
    try:
        import rank_work_now

        watch = RankWatch(poll_s=60)
        try:
            watch.cell_started()
            with pytest.raises(Exception) as info:
                mp.start_processes(rank_work_now.work, args=(2, 0, 1, "kill_now"), nprocs=2, start_method="spawn")
            failure = launcher_failure(info.value)
            ranks = watch.cell_finished(failure)
        finally:
            watch.close()
    finally:
        sys.path.remove(str(tmp_path))
    assert (failure.rank, failure.signal) == (1, "SIGKILL")
    assert [(r.rank, r.end, r.readings, r.rank_from) for r in ranks] == [(0, "gone", 0, "launcher"),
                                                                         (1, "gone", 0, "launcher")]
    assert ranks[1].pid == failure.pid and ranks[1].signal == "SIGKILL"
    note = rank_note(ranks[1])  # the words the views make of the rank's fields
    assert "before its first reading: nothing of its memory is known" in note
    assert "the kernel's OOM killer is the likely cause" in note
    assert "read from outside" not in note  # it never was


def test_history_frame_has_a_row_per_rank():
    pytest.importorskip("pandas")
    rank = RankRecord(1, 4242, HostRecord(100, 150, 300), (), seen="inside", rank_from="launcher")
    rec = CellRecord(3, None, "launch()", 0.0, 1.0, host=HostRecord(10, 11, 12), ranks=(rank,))
    plain_rec = CellRecord(4, None, "x = 1", 0.0, 1.0, host=HostRecord(10, 11, 12))
    frame = records_frame([rec, plain_rec])
    assert list(frame["rank"].astype(object).where(frame["rank"].notna(), None)) == [None, 1, None]
    assert int(frame["peak_increase"][1]) == 200 and int(frame["pid"][1]) == 4242
    assert plain_rec.to_dict()["ranks"] is None
    assert rec.to_dict()["ranks"][0]["host"]["rss_peak_increase"] == 200


# -- harmless while loaded: a private folder, hostile files, no false ranks (issue 27) -------------

PLANTER = textwrap.dedent('''
    import json, os, time

    def _folder():
        """The cell's folder, found as any process of this user could: through its open descriptors."""
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if os.path.basename(target).startswith("ipy_gpumem-ranks-"):
                return target

    def plant(rank, user_file, report):
        """Each rank reports the folder, then plants what a hostile process of this user could."""
        folder, me = _folder(), os.getpid()
        info = os.stat(folder)
        with open(f"{report}.{rank}", "w") as fh:
            json.dump({"folder": folder, "mode": info.st_mode & 0o777, "uid": info.st_uid, "pid": me}, fh)
        if rank == 0:
            os.symlink(user_file, os.path.join(folder, f"{me}.end.json"))  # where its end record goes
            os.unlink(os.path.join(folder, f"{me}.start.json"))
            os.mkfifo(os.path.join(folder, f"{me}.start.json"))  # a FIFO under a name the kernel reads
            os.mkfifo(os.path.join(folder, "x.json"))
            with open(os.path.join(folder, "424242.end.json"), "w") as fh:  # no process of the cell
                json.dump({"pid": 424242, "index": 0, "rank": 0, "rank_from": "env", "world_size": 2,
                           "rss_before": 0, "rss_after": 2 ** 40, "peak_rss": 2 ** 40, "devices": []}, fh)
            os.symlink(user_file, os.path.join(folder, "424243.end.json"))
        else:
            with open(os.path.join(folder, f"{me}.start.json"), "wb") as fh:  # too large for a record
                fh.write(b'{"pid": %d, "index": 1, "rss_before": 1}' % me + b" " * (1 << 20))
        time.sleep(0.3)
''')


class _Hung(BaseException):
    """Raised by the alarm: a read that blocks (a FIFO) ends the test instead of hanging it."""


def _alarm(signum, frame):
    raise _Hung()


def _run(ip, code):
    result = ip.run_cell(code)
    assert result.success, (code, result.error_in_exec)
    return result


def _ranks_of(record):
    return [(r.rank, r.seen, r.end, r.rank_from) for r in record.ranks or ()]


def test_rank_variables_are_validated():
    rv = children.rank_variables
    assert rv({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})[:3] == (3, 1, 4)
    assert rv({"RANK": "3", "WORLD_SIZE": "4"}).says_rank and not rv({"RANK": "3"}).says_rank
    for bad in ("-1", "1" * 23, " 3", "+3", "3_0", "3.0", "", "٣"):
        assert rv({"RANK": bad, "WORLD_SIZE": "4"}).rank is None, bad
    assert rv({"RANK": "4", "WORLD_SIZE": "4"}).rank is None  # below the world size
    assert rv({"RANK": "0", "WORLD_SIZE": "0"}) == children.RankVariables(0, None, None, None)
    assert rv({"RANK": "0", "WORLD_SIZE": "1" * 23}).world_size is None
    assert rv({"TORCHELASTIC_RUN_ID": "x" * 201}).run_id is None and rv({"TORCHELASTIC_RUN_ID": "r1"}).run_id == "r1"


def test_records_read_from_the_folder_are_plausible_values_only():
    good = {"pid": 7, "index": 1, "rank": 1, "rank_from": "env", "world_size": 2, "local_rank": 1,
            "rss_before": 1, "rss_after": 2, "peak_rss": 3, "devices": [{"index": 0, "name": "GPU", "total": 9}],
            "devices_note": None, "extra": "dropped"}
    clean = clean_record(good, 7, "end")
    assert clean["rank"] == 1 and "extra" not in clean and clean["devices"][0]["allocated_after"] is None
    assert clean_record({"pid": 7, "index": 0, "rss_before": 5}, 7, "start") == {"pid": 7, "index": 0, "rss_before": 5}
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for change in ({"pid": 8}, {"pid": True}, {"index": -1}, {"index": True}, {"rank": 2}, {"rank_from": "x"},
                   {"peak_rss": 2 * physical}, {"rss_after": -1}, {"world_size": 0}, {"devices": [{"index": 0}] * 65},
                   {"devices": [{"index": 0, "total": 1 << 51}]}, {"devices_note": "x" * 1001}, {"devices": "no"}):
        assert clean_record({**good, **change}, 7, "end") is None, change
    assert clean_record([good], 7, "end") is None and clean_record("{}", 7, "end") is None


@pytest.mark.slow
def test_planted_files_change_nothing_and_hang_nothing(ip, gpumem, tmp_path, restore_user_ns):
    """Another user's folder at the old predictable names, links to a user's file, a FIFO, a file
    claiming 1 TiB for a pid that is not the cell's, and an oversized record: the user's file is
    untouched, the cell ends at once, the ranks are the two real ones, and the folder was the OS's."""
    import signal
    import tempfile

    import ipy_gpumem

    (tmp_path / "rank_planter.py").write_text(PLANTER)
    sys.path.insert(0, str(tmp_path))
    user_file = tmp_path / "notes.txt"
    user_file.write_text("my notes\n")
    stamp = os.stat(user_file).st_mtime_ns
    last_pid = int(open("/proc/loadavg").read().split()[-1])
    old = []  # the names an earlier version used, planted for the next pids
    for n in range(1, 6):
        folder = os.path.join(tempfile.gettempdir(), f"ipy_gpumem-ranks-{os.getpid()}-{n}")
        os.makedirs(folder, exist_ok=True)
        for pid in range(last_pid + 1, last_pid + 120):
            os.symlink(user_file, os.path.join(folder, f"{pid}.start.json.tmp"))
        old.append((folder, sorted(os.listdir(folder))))
    existing = set(os.listdir(tempfile.gettempdir()))
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(60)
    try:
        ip.run_cell("import torch.multiprocessing as mp, rank_planter")
        started = time.perf_counter()
        ip.run_cell(f"mp.start_processes(rank_planter.plant, args=({str(user_file)!r}, {str(tmp_path / 'report')!r}), "
                    "nprocs=2, start_method='fork')")
        took = time.perf_counter() - started
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        sys.path.remove(str(tmp_path))
        for folder, _names in old:
            for name in os.listdir(folder):
                os.unlink(os.path.join(folder, name))
            os.rmdir(folder)
    record = ipy_gpumem.last()
    assert _ranks_of(record) == [(0, "inside", "exited", "launcher"), (1, "inside", "exited", "launcher")]
    assert all(r.host.peak_rss < 2 ** 40 for r in record.ranks)
    reports = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in (0, 1)]
    assert [r.pid for r in record.ranks] == [rep["pid"] for rep in reports]
    assert user_file.read_text() == "my notes\n" and os.stat(user_file).st_mtime_ns == stamp
    folder = reports[0]["folder"]
    assert reports[1]["folder"] == folder and os.path.basename(folder) not in existing  # new, made for the cell
    assert reports[0]["mode"] == 0o700 and reports[0]["uid"] == os.getuid()
    assert not os.path.lexists(folder)  # removed at the cell's end
    assert all(names == sorted(set(names)) for _f, names in old) and took < 30


def test_a_rank_needs_a_launcher_not_a_variable_the_notebook_has(ip, gpumem, restore_user_ns):
    """With RANK and WORLD_SIZE in the notebook's environment, ``subprocess.run``, ``!sleep`` and a
    process that outlives the cell are no ranks; one whose launcher set them is (the control)."""
    import ipy_gpumem

    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK="0", WORLD_SIZE="2")
    try:
        _run(ip, "import os, subprocess, sys")
        _run(ip, "subprocess.run(['sleep', '0.3'])")
        assert ipy_gpumem.last().ranks is None
        _run(ip, "!sleep 0.3")  # the test shell's ! is a subprocess; a kernel's forks a pty (tested there)
        assert ipy_gpumem.last().ranks is None
        _run(ip, "p = subprocess.Popen(['sleep', '5'])")  # still running at the cell's end: read there
        assert ipy_gpumem.last().ranks is None
        _run(ip, "p.kill(); p.wait()")
        for rank in ("-1", "1" * 23):
            _run(ip, f"p = subprocess.Popen(['sleep', '5'], env=dict(os.environ, RANK={rank!r}))")
            assert ipy_gpumem.last().ranks is None, rank
            _run(ip, "p.kill(); p.wait()")
        _run(ip, "p = subprocess.Popen(['sleep', '5'], env=dict(os.environ, RANK='1', WORLD_SIZE='2'))")
        assert _ranks_of(ipy_gpumem.last()) == [(1, "outside", "running", "env")]
        _run(ip, "p.kill(); p.wait()")
        assert ipy_gpumem.last().ranks is None  # the next cell launched nothing: no rank of another cell
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_a_quiet_cell_wakes_no_thread_and_reads_the_children_once(ip, gpumem, restore_user_ns):
    watch = gpumem.watcher.ranks
    listings, wakeups = watch.listings, watch.wakeups
    for _ in range(20):
        ip.run_cell("x = 1")
    assert watch.wakeups == wakeups and watch.listings - listings == 20


WORKERS = textwrap.dedent('''
    import json, os, subprocess, sys, time
    sys.path.insert(0, sys.argv[1])
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "ipy_gpumem")
    import ipy_gpumem
    from ipy_gpumem.extension import current_magics

    watch = current_magics().watcher.ranks
    assert "multiprocessing" not in sys.modules
    cells = {
        # the cell that first imports multiprocessing (through torch) and forks: still recorded inside
        "first fork": "import os, torch, torch.multiprocessing as mp, multiprocessing, time, subprocess, slow_data; "
                      "mp.start_processes(slow_data.rank, nprocs=2, start_method='fork')",
        "fork loader": "for _ in torch.utils.data.DataLoader(slow_data.SlowSet(), batch_size=2, num_workers=2): pass",
        "spawn loader": "for _ in torch.utils.data.DataLoader(slow_data.SlowSet(), batch_size=2, num_workers=2, "
                        "multiprocessing_context='spawn'): pass",
        "spawn pool": "with multiprocessing.get_context('spawn').Pool(4) as pool: pool.map(time.sleep, [0.3] * 4)",
        "RANK=-1": "p = subprocess.Popen(['sleep', '5'], env=dict(os.environ, RANK='-1'))",
        "23 digits": "p = subprocess.Popen(['sleep', '5'], env=dict(os.environ, RANK='1' * 23))",
        "fork ranks": "mp.start_processes(slow_data.rank, nprocs=2, start_method='fork')",
        "spawn ranks": "mp.start_processes(slow_data.rank, nprocs=2, start_method='spawn')",
    }
    out = {}
    for name, code in cells.items():
        listings = watch.listings
        result = ip.run_cell(code)
        rec = ipy_gpumem.last()
        out[name] = {"ok": result.success, "readings": watch.listings - listings,
                     "ranks": [[r.rank, r.seen, r.rank_from] for r in rec.ranks or ()]}
        ip.run_cell("if 'p' in dir(): p.kill(); p.wait(); del p")
    print(json.dumps(out))
''')

SLOW_DATA = textwrap.dedent('''
    import time
    import torch

    class SlowSet(torch.utils.data.Dataset):
        """Eight items, each 50 ms: the workers live long enough to be read."""

        def __len__(self):
            return 8

        def __getitem__(self, i):
            time.sleep(0.05)
            return torch.zeros(4)

    def rank(i):
        time.sleep(0.3)
''')


@pytest.mark.slow
def test_workers_are_not_ranks_in_a_kernel_started_with_RANK(tmp_path):
    """A shell started with RANK=0 and WORLD_SIZE=2 (as under a launcher): fork and spawn DataLoader
    workers, a spawn Pool(4), and processes with RANK=-1 or a 23-digit RANK are no ranks; torch's own
    ranks, forked or spawned, are numbered by the launcher, not by the RANK they inherited."""
    (tmp_path / "slow_data.py").write_text(SLOW_DATA)
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", WORKERS, str(tmp_path)], env=env, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(v["ok"] for v in out.values()), out
    for name in ("fork loader", "spawn loader", "spawn pool", "RANK=-1", "23 digits"):
        assert out[name]["ranks"] == [] and out[name]["readings"] >= 1, (name, out[name])
    for name in ("fork loader", "spawn loader", "spawn pool"):
        assert out[name]["readings"] >= 2, (name, out[name])  # read while they ran, not only at the end
    assert out["fork ranks"]["ranks"] == [[0, "inside", "launcher"], [1, "inside", "launcher"]], out
    assert out["first fork"]["ranks"] == out["fork ranks"]["ranks"], out
    assert out["spawn ranks"]["ranks"] == [[0, "outside", "launcher"], [1, "outside", "launcher"]], out


# -- in a real kernel -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nb(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ranks")
    (folder / "rank_work.py").write_text(RANK_MODULE)
    p = _ports(9)
    launch = "mp.start_processes(rank_work.work, args=({world}, {port}, {big}, '{mode}'), nprocs={world}, start_method='{how}')"
    cells = [
        "import json, os, sys, torch, torch.multiprocessing as mp\nsys.path.insert(0, os.getcwd())\nimport rank_work",  # 0
        "x = 1",                                                                                            # 1
        launch.format(world=2, port=p[0], big=1, mode="ok", how="fork"),                                     # 2
        launch.format(world=4, port=p[1], big=2, mode="ok", how="fork"),                                     # 3
        launch.format(world=2, port=p[2], big=1, mode="oom", how="fork"),                                    # 4
        launch.format(world=2, port=p[3], big=1, mode="kill", how="fork"),                                   # 5
        launch.format(world=2, port=p[4], big=0, mode="ok", how="spawn"),                                    # 6
        launch.format(world=2, port=p[5], big=1, mode="oom", how="spawn"),                                   # 7
        launch.format(world=2, port=p[6], big=1, mode="kill", how="spawn"),                                  # 8
        "%%gpumem\n" + launch.format(world=2, port=p[7], big=1, mode="ok", how="fork"),                     # 9
        "try:\n    import accelerate\nexcept ImportError:\n    accelerate = None\n"
        f"if accelerate is not None:\n    from accelerate import notebook_launcher\n"
        f"    notebook_launcher(rank_work.accelerate_work, args=(1,), num_processes=2, use_port='{p[8]}')",   # 10
        "if accelerate is not None:\n"
        f"    notebook_launcher(rank_work.accelerate_work, args=(1, 'oom'), num_processes=2, use_port='{_ports(1)[0]}')",  # 11
        "y = torch.ones(2**22)",                                                                            # 12
        "import ipy_gpumem\nfrom ipy_gpumem.display.words import rank_note\nframe = ipy_gpumem.history_frame()\n"
        # each rank's data, and the note the views make of it (the record holds no sentence)
        "print(json.dumps({r.execution_count: None if r.ranks is None else [dict(k.to_dict(), note=rank_note(k)) "
        "for k in r.ranks] for r in ipy_gpumem.history()}))\n"
        "print(json.dumps({r.execution_count: r.to_dict()['rank_failure'] for r in ipy_gpumem.history()}))\n"
        "import pandas as pd\n"
        "print(json.dumps([[None if pd.isna(v) else int(v) if k != 1 else v for k, v in enumerate(row)] for row in "
        "frame[['execution_count', 'device', 'rank', 'pid']].astype(object).values.tolist()]))\n"
        "import threading; print(json.dumps([t.name for t in threading.enumerate()]))",                    # 13
        "import psutil\nprint(json.dumps([' '.join(p.cmdline()) for p in psutil.Process().children(recursive=True)]))",  # 14
        "from ipy_gpumem.extension import current_magics\n_watch = current_magics().watcher.ranks\n"
        "_listed = _watch.listings\nos.environ.update(RANK='0', WORLD_SIZE='2')\n!sleep 0.5",                 # 15
        "print(json.dumps([ipy_gpumem.history()[-1].to_dict()['ranks'], _watch.listings - _listed]))",       # 16
        "del os.environ['RANK'], os.environ['WORLD_SIZE']",                                                # 17
        launch.format(world=2, port=0, big=1, mode="kill_now", how="fork"),                                # 18
    ]
    started = time.perf_counter()
    out = execute(cells, extensions=["ipy_gpumem"], cwd=str(folder), timeout=150)
    out.metadata["took_s"] = time.perf_counter() - started
    return out


def _data(nb):
    lines = plain(nb.cells[13])[0].splitlines()
    ranks = {int(k): v for k, v in json.loads(lines[0]).items()}
    failures = {int(k): v for k, v in json.loads(lines[1]).items()}
    return ranks, failures, json.loads(lines[2]), json.loads(lines[3])


def _text(cell):
    return "\n".join(plain(cell))


@pytest.mark.slow
def test_no_ranks_for_a_cell_that_launched_nothing(nb):
    ranks, failures, _rows, _threads = _data(nb)
    assert ranks[2] is None and ranks[13] is None and failures[2] is None


@pytest.mark.slow
@pytest.mark.parametrize("cell, world, big", [(2, 2, 1), (3, 4, 2)])
def test_forked_ranks_are_recorded_inside_and_the_worst_is_named(nb, cell, world, big):
    ranks = _data(nb)[0][cell + 1]  # execution counts start at 1
    assert [r["rank"] for r in ranks] == list(range(world))
    assert all(r["seen"] == "inside" and r["end"] == "exited" for r in ranks), ranks
    rises = {r["rank"]: r["host"]["rss_peak_increase"] for r in ranks}
    assert max(rises, key=rises.get) == big, ranks  # (a rare failure under load: every figure of each rank)
    assert all(rises[big] - v > 48 * MiB for k, v in rises.items() if k != big), rises
    for r in ranks:
        assert set(r["host"]) >= {"rss_before", "rss_after", "peak_rss", "rss_peak_increase"}
        assert r["devices"] == []  # a CPU build: recorded, and no CUDA device
    text = _text(nb.cells[cell])
    assert f"{world} processes launched · worst: rank {big}" in text
    assert len(re.findall(r"^ +rank \d+ +pid \d+ host ", text, re.M)) == world
    assert outputs(nb.cells[cell], "error") == []


@pytest.mark.slow
def test_spawned_ranks_are_read_from_outside_and_say_what_could_not_be_seen(nb):
    ranks = _data(nb)[0][7]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["seen"] == "outside" for r in ranks), ranks
    assert all(r["devices"] is None and "device memory not visible" in r["note"] for r in ranks)
    assert all(r["readings"] >= 1 and r["host"]["peak_rss"] > 100 * MiB for r in ranks)  # an interpreter with torch
    rises = {r["rank"]: r["host"]["peak_rss"] for r in ranks}
    assert rises[0] - rises[1] > 48 * MiB  # the high-water mark read from outside is the rank's own
    # A spawned interpreter starts from nothing: its rise is its whole peak, not the peak over its first reading
    # (which a loaded machine makes late: rank 0 read after its 64 MiB was named rank 1 the worst).
    assert all(r["host"]["rss_before"] == 0 and r["host"]["rss_peak_increase"] == r["host"]["peak_rss"] for r in ranks)
    assert "worst: rank 0" in _text(nb.cells[6])


@pytest.mark.slow
@pytest.mark.parametrize("cell", [4, 7])
def test_an_out_of_memory_in_a_rank_gets_the_panel_naming_the_rank(nb, cell):
    errors = outputs(nb.cells[cell], "error")
    assert [e.ename for e in errors] == ["ProcessRaisedException"]  # the user's error, unchanged
    assert "DefaultCPUAllocator" in "\n".join(errors[0].traceback)
    text = _text(nb.cells[cell])
    # The answer first (issue 29), the error's own numbers below it.
    assert "Out of memory in rank 1 (pid " in text and "on the host (cpu): a 4.00 PiB allocation; " in text
    assert "The error: tried to allocate 4.00 PiB" in text
    assert "No amount of freeing helps" in text  # the child's message, explained as the kernel's would be
    failure = _data(nb)[1][cell + 1]
    assert (failure["rank"], failure["error"], failure["launcher"]) == (1, "RuntimeError", "torch.multiprocessing")
    ranks = _data(nb)[0][cell + 1]
    assert failure["pid"] in [r["pid"] for r in ranks]


@pytest.mark.slow
@pytest.mark.parametrize("cell", [5, 8])
def test_a_killed_rank_leaves_the_recording_intact_with_a_clear_note(nb, cell):
    errors = outputs(nb.cells[cell], "error")
    assert [e.ename for e in errors] == ["ProcessExitedException"]
    ranks = {r["rank"]: r for r in _data(nb)[0][cell + 1]}
    assert ranks[1]["end"] == "gone" and ranks[1]["signal"] == "SIGKILL"
    assert "killed by SIGKILL" in ranks[1]["note"]
    assert "killed by SIGKILL" in _text(nb.cells[cell])
    # the kernel goes on recording: the cells after it have their records
    assert _data(nb)[0][13] is None and outputs(nb.cells[12], "error") == []


@pytest.mark.slow
def test_a_rank_killed_at_once_gets_its_line_and_the_oom_killer_is_named(nb):
    """Forked ranks killed within their first moments moved nothing: the cell's line is still shown
    (issue 29), each rank with what is known of it, and SIGKILL's likely cause."""
    text = _text(nb.cells[18])
    assert [e.ename for e in outputs(nb.cells[18], "error")] == ["ProcessExitedException"]
    assert "2 processes launched" in text, text
    assert re.search(r"^ +rank 1 +pid \d+ .*killed by SIGKILL", text, re.M), text
    flat = " ".join(text.split())
    assert "the kernel's OOM killer is the likely cause (`dmesg` or `journalctl -k` shows \"Out of memory: " \
           "Killed process" in flat, text


@pytest.mark.slow
def test_the_report_has_a_row_per_rank(nb):
    text = _text(nb.cells[9])
    assert "rank 0 host RSS" in text and "rank 1 host RSS" in text and "worst: rank 1" in text


@pytest.mark.slow
def test_accelerate_notebook_launcher_on_the_cpu(nb):
    if "accelerate" not in _text(nb.cells[10]) and not _data(nb)[0][11]:
        pytest.skip("accelerate is not installed")
    ranks = _data(nb)[0][11]
    assert [(r["rank"], r["seen"], r["world_size"]) for r in ranks] == [(0, "inside", 2), (1, "inside", 2)], ranks
    assert worst_rank([RankRecord(r["rank"], r["pid"], HostRecord(r["host"]["rss_before"], None, r["host"]["peak_rss"]))
                       for r in ranks]).rank == 1
    errors = outputs(nb.cells[11], "error")
    assert [e.ename for e in errors] == ["ChildFailedError"]
    text = _text(nb.cells[11])
    assert "Out of memory in rank 1 (pid " in text
    failure = _data(nb)[1][12]
    assert (failure["rank"], failure["launcher"]) == (1, "torch.distributed.elastic")


@pytest.mark.slow
def test_a_shell_command_with_RANK_in_the_notebook_is_read_and_is_no_rank(nb):
    ranks, listed = json.loads(plain(nb.cells[16])[0])
    assert ranks is None and listed >= 3, (ranks, listed)  # the kernel's ! forks a pty: read while it ran


@pytest.mark.slow
def test_history_frame_has_the_rank_column_and_nothing_is_left_behind(nb):
    _ranks, _failures, rows, threads = _data(nb)
    by_cell = {}
    for count, device, rank, _pid in rows:
        by_cell.setdefault(count, []).append(rank)
    assert by_cell[2] == [None] and by_cell[4] == [None, 0, 1, 2, 3]
    assert threads.count("ipy_gpumem-ranks") == 1
    left = json.loads(plain(nb.cells[14])[0])  # no process left behind but multiprocessing's own tracker (spawn's)
    assert [c for c in left if "multiprocessing.resource_tracker" not in c] == [], left
    assert nb.metadata["took_s"] < 150
