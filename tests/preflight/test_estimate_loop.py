"""%%gpumem --estimate and estimate() over the usual training loop, in a real IPython shell with real torch on the CPU: DataLoader workers, a lock held at the fork, timeout_s, every refusal listed (C code's too), files and databases written, get_ipython() lines, and a forged answer."""
import math
import sys
import os
import sqlite3
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from conftest import run, texts  # noqa: E402

import ipy_gpumem  # noqa: E402
from ipy_gpumem.preflight.result import Estimate, EstimateError  # noqa: E402

pytestmark = [pytest.mark.usefixtures("restore_user_ns"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the seal is built for Linux")]

SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
ds = TensorDataset(torch.randn(96, 32), torch.randint(0, 4, (96,)))
"""
LOOP = """for x, y in {loader}:
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
"""
NOT_DONE = "not done (the estimate runs sealed off from your files, network and processes): "


def _estimate(ip, body, header="%%gpumem --estimate T4 -o est_loop"):
    """Run ``body`` as a --estimate cell: (what it printed, the Estimate or None)."""
    ip.user_ns.pop("est_loop", None)
    result, cap = run(ip, f"{header}\n{body}")
    assert result.success, result.error_in_exec
    return cap.stdout + "\n".join(texts(cap)), ip.user_ns.get("est_loop")


# --- DataLoader workers ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_dataloader_with_workers_is_read_as_with_none_and_the_notes_say_so(ip, gpumem):
    run(ip, SETUP + "dl0 = DataLoader(ds, batch_size=16, shuffle=True)\n"
                    "dl2 = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2)\n"
                    "dlp = DataLoader(ds, batch_size=16, num_workers=2, persistent_workers=True)\n"
                    "it = iter(dlp)\nfirst = next(it)\n")
    _, without = _estimate(ip, LOOP.format(loader="dl0"))
    for loader, said in (("dl2", "num_workers=2 was read"), ("dlp", "persistent_workers=True was read")):
        shown, est = _estimate(ip, LOOP.format(loader=loader))
        assert "Verdict: fits" in shown, shown
        assert est.peak_allocated == without.peak_allocated  # the same batches, hence the same memory
        assert any(said in note and "num_workers=0" in note for note in est.notes), est.notes
        assert not any("read a tensor's value" in note for note in est.notes), est.notes  # the sampler ran on real ints
    # an iterator made before the estimate, its workers running in this kernel
    shown, est = _estimate(ip, "x, y = next(it)\nloss = nn.functional.cross_entropy(model(x), y)\nloss.backward()\n")
    assert "Verdict: fits" in shown, shown
    assert any("made before the estimate" in note for note in est.notes), est.notes
    # the user's loaders, iterator and workers are untouched: they go on here
    ns = ip.user_ns
    assert ns["dl2"].num_workers == 2 and ns["dlp"].num_workers == 2
    x, y = next(ns["it"])
    assert x.shape == (16, 32) and len(list(ns["dl2"])) == 6
    del ns["it"]


# --- a lock held by another thread when the copy was made ---------------------------------------------


@pytest.mark.slow
def test_a_lock_held_by_another_kernel_thread_is_found_before_the_deadline(ip, gpumem):
    run(ip, SETUP + "import threading, time\nheld = threading.Lock()\nrelease = threading.Event()\n"
                    "def hold():\n    with held:\n        release.wait(60)\n"
                    "holder = threading.Thread(target=hold, name='data-feeder', daemon=True)\nholder.start()\n"
                    "time.sleep(0.1)\n")
    try:
        began = time.monotonic()
        result, cap = run(ip, "%%gpumem --estimate T4\ny = model(torch.randn(2, 32))\nwith held:\n    z = y * 2\n")
        took = time.monotonic() - began
        said = cap.stdout.strip()
        assert result.success and said.count("\n") == 0, said
        assert said.startswith("%%gpumem --estimate: line 3 of the cell (`with held:`) waits for a lock")
        assert "data-feeder" in said and "a larger timeout_s would not help" in said
        assert took < 60  # the deadline is 120 s: found long before
        # estimate() on a function, with a deadline it never reaches
        def step(m):
            with ip.user_ns["held"]:
                return m(torch.randn(2, 32)).sum()

        began = time.monotonic()
        with pytest.raises(EstimateError, match="waits for a lock") as info:
            ipy_gpumem.estimate(step, ip.user_ns["model"], device="cpu", timeout_s=100)
        assert time.monotonic() - began < 60 and "pass a larger timeout_s" not in str(info.value)
    finally:
        ip.user_ns["release"].set()
        ip.user_ns["holder"].join()


# --- timeout_s -------------------------------------------------------------------------------------------


def _step(m, x):
    return m(x).sum()


@pytest.mark.slow
@pytest.mark.parametrize("value", [math.inf, 1e7, 30])
def test_a_large_or_infinite_timeout_is_accepted(value):
    est = ipy_gpumem.estimate(_step, torch.nn.Linear(8, 8), torch.randn(4, 8), device="cpu", timeout_s=value)
    assert isinstance(est, Estimate) and est.peak_allocated > 0


@pytest.mark.parametrize("value", [-1, 0, math.nan, -math.inf, "10", None, True])
def test_a_bad_timeout_is_a_one_line_error_before_anything_runs(value):
    for call in (lambda: ipy_gpumem.estimate(_step, torch.nn.Linear(8, 8), torch.randn(4, 8), timeout_s=value),
                 lambda: ipy_gpumem.max_batch_size(_step, torch.nn.Linear(8, 8), torch.randn(4, 8), gpu="T4",
                                                   timeout_s=value)):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert "timeout_s" in message and "\n" not in message and not isinstance(info.value, OverflowError)


# --- what the step writes: pretended, and listed (C code's refusals too) --------------------------------


@pytest.mark.slow
def test_files_databases_and_c_code_are_listed_in_the_notes_not_failures(ip, gpumem, tmp_path):
    db, log, new_db, cdir = (str(tmp_path / n) for n in ("old.db", "log.txt", "new.db", "cdir"))
    con = sqlite3.connect(db)
    con.execute("create table t(a)")
    con.execute("insert into t values (1)")
    con.commit()
    con.close()
    with open(log, "w") as f:
        f.write("hello\n")
    before = {db: open(db, "rb").read(), log: open(log, "rb").read()}
    run(ip, SETUP + f"import sqlite3, ctypes\ncon = sqlite3.connect({db!r})\nlogf = open({log!r}, 'a+')\n")
    try:
        body = (f"mine = sqlite3.connect({db!r})\n"
                "rows = mine.execute('select count(*) from t').fetchone()[0]\n"
                "mine.execute('insert into t values (2)')\nmine.commit()\nmine.close()\n"
                f"fresh = sqlite3.connect({new_db!r})\nfresh.execute('create table u(b)')\nfresh.commit()\n"
                "con.execute('insert into t values (3)')\ncon.commit()\n"
                "logf.write('x' * 100_000)\nlogf.flush()\nlogf.seek(0)\nassert logf.read(5) == 'hello'\n"
                f"with open({log!r}, 'a+') as again:\n    again.write('y')\n"
                f"ctypes.CDLL(None).mkdir({cdir.encode()!r}, 0o755)\n"
                "y = model(torch.randn(4, 32))\n")
        shown, est = _estimate(ip, body)
        assert "Verdict: fits" in shown, shown
        listed = [note[len(NOT_DONE):] for note in est.notes if note.startswith(NOT_DONE)]
        assert f"writes to the sqlite database {db!r} (kept in memory, not written)" in listed, listed
        assert f"sqlite3.connect({new_db!r}): a new database, kept in memory" in listed
        assert f"write to {db} (opened before the run)" in listed  # the connection of an earlier cell
        assert f"write to {log} (opened before the run)" in listed  # the a+ file of an earlier cell
        assert f"open({log!r}, 'a+')" in listed
        assert f"mkdir({cdir!r}) (C code)" in listed  # refused by the OS guard, named by the parent
        assert not any("fake tensors" in note for note in est.notes)
        # and a step that cannot go on without what was refused says that, not "failed on fake tensors"
        result, cap = run(ip, "%%gpumem --estimate T4\nimport multiprocessing\nlock = multiprocessing.Lock()\n")
        said = cap.stdout.strip()
        assert said.count("\n") == 0 and "line 3 of the cell (`lock = multiprocessing.Lock()`) failed because " \
            "the estimate's sealed copy refused what it tried (openat('/dev/shm/sem." in said, said
        assert "fake tensors" not in said
    finally:
        ip.user_ns["logf"].close()
        ip.user_ns["con"].close()
    assert {db: open(db, "rb").read(), log: open(log, "rb").read()} == before
    assert not os.path.exists(new_db) and not os.path.exists(cdir)


# --- get_ipython() ---------------------------------------------------------------------------------------


def test_a_get_ipython_line_that_only_reads_runs_and_magics_stay_refused(ip, gpumem):
    run(ip, SETUP)
    shown, est = _estimate(ip, "names = len(get_ipython().user_ns)\nm = get_ipython().user_ns['model']\n"
                               "y = m(torch.randn(4, 32))\n")
    assert "Verdict: fits" in shown and est.peak_allocated > 0
    for body, line in (("x = 1\n%time y = model(torch.randn(4, 32))\n", 3), ("files = !ls\n", 2),
                       ("get_ipython().system('touch nothing')\n", 2)):
        result, cap = run(ip, "%%gpumem --estimate T4\n" + body)
        said = cap.stdout.strip()
        assert said.startswith(f"%%gpumem --estimate: line {line} of the cell") and "magic or shell command" in said
    # reached another way, it is refused when called, in the sealed copy, naming the line
    result, cap = run(ip, "%%gpumem --estimate T4\nshell = get_ipython()\nshell.run_line_magic('time', 'x = 1')\n")
    said = cap.stdout.strip()
    assert said.count("\n") == 0 and "line 3 of the cell (`shell.run_line_magic('time', 'x = 1')`)" in said, said
    assert "magic or shell command" in said


# --- a forged answer -------------------------------------------------------------------------------------


def _forger(payload, marker):
    """A step that finds its answer pipe as hostile code would and writes ``payload`` on it from C."""
    def step(m):
        import ctypes

        for name in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{name}").startswith("pipe:"):
                    ctypes.CDLL(None).write(int(name), payload, len(payload))
                    ctypes.CDLL(None)._exit(0)
            except OSError:
                continue  # the listing's own descriptor

    return step


@pytest.mark.slow
def test_a_forged_pickle_or_a_3_gib_header_from_the_step_runs_nothing_and_is_one_line(tmp_path, ip, gpumem):
    import pickle

    from ipy_gpumem.sealed.protocol import HEAD, VALUE

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    evil = pickle.dumps(Evil())
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1])
    for payload in (HEAD.pack(VALUE, len(evil)) + evil, HEAD.pack(VALUE, 3 << 30), b"garbage!" * 4,
                    HEAD.pack(VALUE, 4096) + b"cut"):
        with pytest.raises(EstimateError) as info:
            ipy_gpumem.estimate(_forger(payload, marker), torch.nn.Linear(8, 8), device="cpu")
        message = str(info.value)
        assert message.startswith("the estimate's sealed copy sent back an answer that was refused")
        assert "\n" not in message and "nothing of it was used" in message
    with open("/proc/self/statm") as f:
        grown = (int(f.read().split()[1]) - rss) * os.sysconf("SC_PAGE_SIZE")
    assert grown < 64 << 20 and not marker.exists()
    # the same from a cell
    ip.user_ns["forge_step"] = _forger(HEAD.pack(VALUE, len(evil)) + evil, marker)
    result, cap = run(ip, "%%gpumem --estimate T4\nforge_step(None)\n")
    assert result.success and cap.stdout.strip().startswith("%%gpumem --estimate: the estimate's sealed copy sent "
                                                             "back an answer that was refused")
    assert not marker.exists()


# The usual loop in a real kernel (its own threads, its workers' processes) is in test_preflight_cell.py, in the
# one kernel that module starts.
