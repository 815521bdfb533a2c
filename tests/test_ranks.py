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

from ipy_gpumem.core import children  # noqa: E402
from ipy_gpumem.core.records import CellRecord, HostRecord, RankRecord, records_frame, worst_rank  # noqa: E402
from ipy_gpumem.ledger.ranks import RankWatch, launcher_failure  # noqa: E402

MiB = 2 ** 20

RANK_MODULE = textwrap.dedent('''
    import os
    import torch
    import torch.distributed as dist

    def work(rank, world, port, big, mode="ok"):
        """A gloo step; rank ``big`` keeps 64 MiB more than the others, then fails as ``mode`` says."""
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
        assert watch.listings == 5  # one listing at each cell's end; cells under POLL_S get no poll
    finally:
        watch.close()


def test_forked_ranks_record_themselves_and_the_launchers_exception_names_the_failing_rank(tmp_path):
    import torch.multiprocessing as mp

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
            assert not [n for n in os.listdir(os.path.dirname(watch._base)) if n.startswith(os.path.basename(watch._base))]
        finally:
            watch.close()
    finally:
        sys.path.remove(str(tmp_path))


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
        "import ipy_gpumem\nframe = ipy_gpumem.history_frame()\n"
        "print(json.dumps({r.execution_count: r.to_dict()['ranks'] for r in ipy_gpumem.history()}))\n"
        "print(json.dumps({r.execution_count: r.to_dict()['rank_failure'] for r in ipy_gpumem.history()}))\n"
        "import pandas as pd\n"
        "print(json.dumps([[None if pd.isna(v) else int(v) if k != 1 else v for k, v in enumerate(row)] for row in "
        "frame[['execution_count', 'device', 'rank', 'pid']].astype(object).values.tolist()]))\n"
        "import threading; print(json.dumps([t.name for t in threading.enumerate()]))",                    # 13
        "import psutil\nprint(json.dumps([' '.join(p.cmdline()) for p in psutil.Process().children(recursive=True)]))",  # 14
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
    assert max(rises, key=rises.get) == big
    assert all(rises[big] - v > 48 * MiB for k, v in rises.items() if k != big), rises
    for r in ranks:
        assert set(r["host"]) >= {"rss_before", "rss_after", "rss_peak", "rss_peak_increase"}
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
    assert all(r["readings"] >= 1 and r["host"]["rss_peak"] > 100 * MiB for r in ranks)  # an interpreter with torch
    rises = {r["rank"]: r["host"]["rss_peak"] for r in ranks}
    assert rises[0] - rises[1] > 48 * MiB  # the high-water mark read from outside is the rank's own
    assert "worst: rank 0" in _text(nb.cells[6])


@pytest.mark.slow
@pytest.mark.parametrize("cell", [4, 7])
def test_an_out_of_memory_in_a_rank_gets_the_panel_naming_the_rank(nb, cell):
    errors = outputs(nb.cells[cell], "error")
    assert [e.ename for e in errors] == ["ProcessRaisedException"]  # the user's error, unchanged
    assert "DefaultCPUAllocator" in "\n".join(errors[0].traceback)
    text = _text(nb.cells[cell])
    assert "Out of memory in rank 1 (pid " in text and "on the host (cpu): tried to allocate 4.00 PiB" in text
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
def test_the_report_has_a_row_per_rank(nb):
    text = _text(nb.cells[9])
    assert "rank 0 host RSS" in text and "rank 1 host RSS" in text and "worst: rank 1" in text


@pytest.mark.slow
def test_accelerate_notebook_launcher_on_the_cpu(nb):
    if "accelerate" not in _text(nb.cells[10]) and not _data(nb)[0][11]:
        pytest.skip("accelerate is not installed")
    ranks = _data(nb)[0][11]
    assert [(r["rank"], r["seen"], r["world_size"]) for r in ranks] == [(0, "inside", 2), (1, "inside", 2)], ranks
    assert worst_rank([RankRecord(r["rank"], r["pid"], HostRecord(r["host"]["rss_before"], None, r["host"]["rss_peak"]))
                       for r in ranks]).rank == 1
    errors = outputs(nb.cells[11], "error")
    assert [e.ename for e in errors] == ["ChildFailedError"]
    text = _text(nb.cells[11])
    assert "Out of memory in rank 1 (pid " in text
    failure = _data(nb)[1][12]
    assert (failure["rank"], failure["launcher"]) == (1, "torch.distributed.elastic")


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
