"""``%gpumem free``'s plan and release (``ipy_gpumem.free``) through a real IPython shell and real CPU tensors.

Only IPython's own references are ever cleared: the displayed results it cached (``Out[N]``,
``_``, ``__``, ``___``, ``_N`` and its copies of them), and the last error's traceback. A name the
user assigned is theirs whatever its spelling (``x, _ = torch.max(t, 0)``, a ``_5``, an ``Out``).
"""
from __future__ import annotations

import gc
import json
import sys
import weakref

import pytest

torch = pytest.importorskip("torch")

from ipy_gpumem.free.release import (  # noqa: E402
    FreeOutcome, ReleasePlan, ReleaseResult, free_memory, last_error, plan_release, release)
from ipy_gpumem.free.view import free_view, freed_view, plan_view  # noqa: E402
from ipy_gpumem.core.probes import DeviceSample, HostSample, MemoryProbe, Sample  # noqa: E402
from ipy_gpumem.core.units import format_bytes  # noqa: E402
from ipy_gpumem.display.view import View  # noqa: E402
from ipy_gpumem.attribution.who import who  # noqa: E402
from ipy_gpumem.attribution.holders import IPythonRefs, ipython_refs  # noqa: E402
from tests.conftest import EXACT_S  # noqa: E402

MiB = 2**20
_SYS = ("last_type", "last_value", "last_traceback", "last_exc")


def refs(ip):
    """What the extension passes: the names IPython itself bound, by identity."""
    return ipython_refs(ip.user_ns, ip.user_ns_hidden, ip.displayhook)


def plan(ip, **kwargs):
    return plan_release(ip.user_ns, refs(ip), last_result=ip.last_execution_result,
                        tb_formatters=(ip.InteractiveTB,), **kwargs)


def carry_out(ip, the_plan):
    return release(the_plan, ip.user_ns, hidden=ip.user_ns_hidden, displayhook=ip.displayhook,
                   last_result=ip.last_execution_result, tb_formatters=(ip.InteractiveTB,))


def run(ip, code):
    """Run a cell as the user would (stored in history, so its result is cached); return its count."""
    result = ip.run_cell(code, store_history=True)
    return result.execution_count


def forget_outputs(ip):
    """Leave the shell as a fresh session would: no cached outputs, IPython owning ``_``/``__``/``___``,
    no last error. (IPython's own ``%reset out`` keeps a stale ``_`` in ``user_ns_hidden``, after
    which it stops updating ``_``; this does not.)"""
    ns, hidden, hook = ip.user_ns, ip.user_ns_hidden, ip.displayhook
    ns["_oh"].clear()
    for name in [n for n in list(ns) if n[:1] == "_" and n[1:].isdecimal()]:
        del ns[name]
    for name in [n for n in list(hidden) if n[:1] == "_" and n[1:].isdecimal()]:
        del hidden[name]
    for name in ("_", "__", "___"):
        ns[name] = hidden[name] = ""
        setattr(hook, name, "")
    ns["Out"] = hidden["Out"] = ns["_oh"]
    for name in _SYS:
        if hasattr(sys, name):
            setattr(sys, name, None)
    ip.InteractiveTB.tb = None
    ip.last_execution_result = None
    gc.collect()


@pytest.fixture
def shell(ip):
    ip.run_cell("import torch, weakref", store_history=False)
    forget_outputs(ip)
    before = set(ip.user_ns)
    yield ip
    for name in set(ip.user_ns) - before:
        if not (name[:1] == "_" and name[1:].isdecimal()) and not name.startswith("_i"):
            del ip.user_ns[name]
    forget_outputs(ip)


# ---------------------------------------------------------------------- through a real shell
@pytest.mark.slow
def test_the_underscore_idiom_is_the_users(shell):
    run(shell, "t = torch.randn(100, 100)\nvalues, _ = torch.max(t, 0)")
    kept = shell.user_ns["_"]
    assert not refs(shell).owns("_")
    report = who(shell.user_ns, refs=refs(shell), budget_s=EXACT_S)
    row = next(h for h in report.holders if h.expr == "_")
    assert (row.kind, row.category, row.roots, row.bytes) == ("variable", "other_tensors", ("_",), 800)
    the_plan = plan(shell)
    assert "_" not in the_plan.names and "_" in the_plan.kept and the_plan.empty
    result = carry_out(shell, the_plan)
    assert shell.user_ns["_"] is kept and not result.names
    assert "left alone: _" in plan_view(the_plan).text


def test_a_displayed_tensor_in_out_underscore_and_n_is_freed(shell):
    n = run(shell, "torch.ones(2**18)")  # 1 MiB, displayed: Out[n], _n, _ and IPython's copies hold it
    probe = weakref.ref(shell.user_ns["Out"][n])
    assert shell.user_ns[f"_{n}"] is shell.user_ns["_"] is probe()
    the_plan = plan(shell)
    assert the_plan.out_keys == (n,) and the_plan.cache_bytes == MiB
    assert set(the_plan.names) == {f"_{n}", "_"} and the_plan.error is None
    assert [h.kind for h in the_plan.holders] == ["out_cache"]
    dry = plan_view(the_plan, dry_run=True)
    assert isinstance(dry, View) and dry.data is the_plan
    assert f"Out[{n}]" in dry.text and format_bytes(MiB) in dry.text and "dry run" in dry.text
    result = carry_out(shell, the_plan)
    assert result.out_keys == (n,) and set(result.names) == {f"_{n}", "_"} and f"_{n}" in result.hidden
    assert n not in shell.user_ns["Out"] and f"_{n}" not in shell.user_ns and shell.user_ns["_"] == ""
    gc.collect()
    assert probe() is None  # the megabyte is really gone
    done = freed_view(result)
    assert done.text.startswith("ipy_gpumem free: done.") and f"Out[{n}]" in done.text and done.data is result
    # IPython's bookkeeping stays whole: the next displayed result is its `_` again.
    m = run(shell, "torch.zeros(3)")
    assert shell.user_ns["_"] is shell.user_ns["Out"][m] and refs(shell).owns("_")


def test_a_users_underscore_n_is_left_alone(shell):
    n = run(shell, "torch.ones(2**18)")
    probe = weakref.ref(shell.user_ns["Out"][n])
    run(shell, f"_{n} = torch.zeros(100)\n_tmp = torch.zeros(50)")  # assigned by the user: theirs
    mine = shell.user_ns[f"_{n}"]
    report = who(shell.user_ns, refs=refs(shell), budget_s=EXACT_S)
    rows = {h.expr: h for h in report.holders}
    assert (rows[f"_{n}"].kind, rows[f"_{n}"].category) == ("variable", "other_tensors")
    assert (rows["_tmp"].kind, rows["_tmp"].category, rows["_tmp"].roots) == ("variable", "other_tensors", ("_tmp",))
    assert rows[f"Out[{n}]"].kind == "out_cache"
    the_plan = plan(shell)
    assert f"_{n}" not in the_plan.names and f"_{n}" in the_plan.kept
    result = carry_out(shell, the_plan)
    assert shell.user_ns[f"_{n}"] is mine and shell.user_ns["_tmp"].numel() == 50
    assert f"_{n}" in result.hidden  # IPython's own copy of the displayed tensor, not the user's name
    gc.collect()
    assert probe() is None


def test_a_rebound_out_is_the_users(shell):
    n = run(shell, "torch.ones(2**18)")
    probe = weakref.ref(shell.user_ns["_oh"][n])
    run(shell, "Out = {1: torch.zeros(70)}")  # the user's own dict named Out
    users_out = shell.user_ns["Out"]
    owned = refs(shell)
    assert not owned.owns("Out") and owned.owns("_oh")
    report = who(shell.user_ns, refs=owned, budget_s=EXACT_S)
    rows = {h.expr: h for h in report.holders}
    assert (rows["Out[1]"].kind, rows["Out[1]"].category, rows["Out[1]"].roots) == (
        "variable", "other_tensors", ("Out",))
    assert (rows[f"_oh[{n}]"].kind, rows[f"_oh[{n}]"].keys) == ("out_cache", (n,))  # IPython's dict, by its other name
    the_plan = plan(shell)
    assert the_plan.out_keys == (n,) and "Out" in the_plan.kept
    carry_out(shell, the_plan)
    assert shell.user_ns["Out"] is users_out and list(users_out) == [1] and users_out[1].numel() == 70
    assert n not in shell.user_ns["_oh"]
    gc.collect()
    assert probe() is None


@pytest.mark.slow
def test_an_unformattable_last_error_is_released(shell):
    """An error whose ``__str__``, ``__repr__`` and ``__bool__`` raise: IPython's own formatter fails
    on it (and keeps its failure as the last error, the original chained inside); the plan reads
    types only, and releasing really frees the frame's tensor."""
    run(shell, "class Unprintable(Exception):\n"
               "    def __str__(self):\n        raise RuntimeError('no str')\n"
               "    __repr__ = __str__\n"
               "    def __bool__(self):\n        raise RuntimeError('no bool')\n"
               "def step():\n    big = torch.ones(2**20)\n    raise Unprintable()\n")
    shell.run_cell("step()", store_history=True)
    original = shell.last_execution_result.error_in_exec
    assert type(original).__name__ == "Unprintable"
    probe = weakref.ref(next(tb.tb_frame.f_locals["big"] for tb in _frames(original.__traceback__)
                             if "big" in tb.tb_frame.f_locals))
    del original
    the_plan = plan(shell)
    assert the_plan.error == type(sys.last_value).__name__ and the_plan.traceback_bytes == 4 * MiB
    big = next(h for h in the_plan.holders if h.expr == "big")
    assert (big.kind, big.frame, big.bytes) == ("traceback_local", "step", 4 * MiB)
    assert f"IPython's last error ({the_plan.error})" in plan_view(the_plan).text
    result = carry_out(shell, the_plan)
    assert result.error == the_plan.error
    assert all(getattr(sys, name, None) is None for name in _SYS)
    assert shell.InteractiveTB.tb is None and shell.last_execution_result.error_in_exec is None
    gc.collect()
    assert probe() is None
    assert f"IPython's last error ({the_plan.error})" in freed_view(result).text


def test_nothing_to_release(shell):
    run(shell, "kept = torch.ones(10)")
    the_plan = plan(shell)
    assert the_plan.empty and the_plan.total == 0 and the_plan.complete
    assert "no IPython error or cached output" in plan_view(the_plan).text
    result = carry_out(shell, the_plan)
    assert not result.released and "kept" in shell.user_ns
    assert "none was holding tensors" in freed_view(result).text


def test_free_memory_is_the_whole_command(shell):
    """What ``%gpumem free [--dry-run]`` runs: the plan, then release, gc.collect() and the readings."""
    n = run(shell, "torch.ones(2**24)")  # 64 MiB, displayed and cached by IPython only
    probe = weakref.ref(shell.user_ns["Out"][n])
    ipython = dict(last_result=shell.last_execution_result, tb_formatters=(shell.InteractiveTB,),
                   displayhook=shell.displayhook, hidden=shell.user_ns_hidden)
    dry = free_memory(shell.user_ns, refs(shell), MemoryProbe(), dry_run=True, **ipython)
    assert isinstance(dry, FreeOutcome) and dry.dry_run and dry.result is None and dry.after is None
    assert n in shell.user_ns["Out"] and probe() is not None  # a dry run changes nothing
    view = free_view(dry)
    assert view.data is dry and "would release" in view.text and "dry run" in view.text
    done = free_memory(shell.user_ns, refs(shell), MemoryProbe(), **ipython)
    assert done.result.out_keys == (n,) and probe() is None
    assert not done.cache_emptied and not torch.cuda.is_initialized()  # never initializes CUDA
    if sys.platform.startswith("linux"):  # a 64 MiB block is its own mmap: given back to the OS at once
        assert done.before.host.rss - done.after.host.rss >= 48 * MiB
    text = free_view(done).text
    assert "releases" in text and "ipy_gpumem free: done." in text and "host RSS" in text


def _frames(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


# ------------------------------------------------------------------------- without a shell
def test_without_refs_no_name_is_ipythons():
    t = torch.ones(100)
    ns = {"Out": {3: t}, "_": t, "_3": t}
    the_plan = plan_release(ns)
    assert the_plan.out_keys == () and the_plan.names == () and the_plan.cache_bytes == 0
    result = release(the_plan, ns)
    assert ns["Out"][3] is t and ns["_"] is t and ns["_3"] is t and not result.out_keys


def test_release_checks_ownership_again():
    t = torch.ones(100)
    out = {3: t}
    ns = {"Out": out, "_3": t}
    hidden = {"Out": out, "_3": t}
    owned = IPythonRefs(frozenset({"Out", "_3"}))
    the_plan = plan_release(ns, owned)
    assert the_plan.names == ("_3",)
    ns["_3"] = mine = torch.zeros(5)  # rebound between the plan and the release
    result = release(the_plan, ns, hidden=hidden)
    assert ns["_3"] is mine and result.skipped == ("_3",) and result.out_keys == (3,)


def test_last_error_reads_types_only(restore_sys):
    class Odd(Exception):
        def __bool__(self):
            raise RuntimeError("no bool")

    for name in _SYS:
        if hasattr(sys, name):
            setattr(sys, name, None)
    assert last_error() is None
    sys.last_value = Odd()
    assert last_error() == "Odd"
    sys.last_value = None
    sys.last_traceback = object()
    assert last_error() == "an error"


@pytest.fixture
def restore_sys():
    saved = {name: getattr(sys, name) for name in _SYS if hasattr(sys, name)}
    yield
    for name in _SYS:
        if name in saved:
            setattr(sys, name, saved[name])
        elif hasattr(sys, name):
            delattr(sys, name)


def test_views_show_the_allocator_and_the_change():
    before = Sample(0.0, HostSample(900 * MiB, None), (DeviceSample(0, 3 * 2**30, 5 * 2**30, None, None, None, None),))
    after = Sample(1.0, HostSample(600 * MiB, None), (DeviceSample(0, 2**30, 2**30, None, None, None, None),))
    the_plan = ReleasePlan(error="OutOfMemoryError", traceback_bytes=2 * 2**30, out_keys=(4,), names=("_4",),
                           cache_bytes=2**20)
    text = " ".join(plan_view(the_plan, before, dry_run=False).text.split())
    assert "releases" in text and "dry run" not in text
    assert "torch.cuda.empty_cache(): 2.00 GiB reserved but unallocated now" in text
    done = freed_view(ReleaseResult(the_plan, error="OutOfMemoryError", out_keys=(4,), names=("_4",)), before, after)
    assert "cuda:0 allocated" in done.text and "-2.00 GiB" in done.text and "-4.00 GiB" in done.text
    assert "host RSS" in done.text and "-300.00 MiB" in done.text
    assert "down" in done.html  # the deltas are coloured as memory given back


def test_plan_is_plain_data():
    the_plan = plan_release({"x": torch.ones(3)})
    json.dumps([the_plan.error, the_plan.out_keys, the_plan.names, the_plan.kept, the_plan.total])
    assert [h.to_dict() for h in the_plan.holders] == []


@pytest.mark.slow
def test_without_torch_free_says_nothing_holds_tensors_not_that_who_stopped():
    """A shell where torch cannot be imported: who() answers "torch is not imported" at once, and
    the plan says no tensor exists rather than that the walk was cut short."""
    import subprocess

    code = (
        "import sys\n"
        "sys.modules['torch'] = None   # `import torch` raises ImportError: as if it were not installed\n"
        "from IPython.testing.globalipapp import start_ipython\n"
        "from IPython.utils.capture import capture_output\n"
        "ip = start_ipython()\n"
        "ip.run_line_magic('load_ext', 'ipy_gpumem')\n"
        "ip.run_cell('1/0', store_history=True)\n"
        "for line in ('free --dry-run', 'free'):\n"
        "    with capture_output() as cap:\n"
        "        ip.run_line_magic('gpumem', line)\n"
        "    print('VIEW', repr('\\n'.join(o.data['text/plain'] for o in cap.outputs)))\n"
        "from ipy_gpumem.free.release import plan_release\n"
        "p = plan_release(ip.user_ns)\n"
        "print('PLAN', p.tensors, p.complete, p.incomplete)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    views = [eval(ln[5:]) for ln in lines if ln.startswith("VIEW ")]  # noqa: S307 - our own repr
    assert len(views) == 2, out.stdout + out.stderr
    for text in views:
        assert "torch is not imported, so no tensors exist" in text, text
        assert "did not count" not in text and "stopped" not in text and "may keep more" not in text, text
    assert "IPython's last error (ZeroDivisionError)" in views[0] and "dry run" in views[0]
    assert "ipy_gpumem free: done." in views[1]
    assert "PLAN False True None" in lines, out.stdout


def test_a_walk_cut_short_is_said_with_its_reason():
    report = who({"x": torch.ones(3)}, budget_s=EXACT_S)
    cut = type(report)(report.categories, report.holders, stopped="the time budget (0.5 s) ran out")
    the_plan = plan_release({"x": torch.ones(3)}, report=cut)
    assert not the_plan.complete and the_plan.tensors and the_plan.incomplete == "the time budget (0.5 s) ran out"
    text = plan_view(the_plan).text
    assert "who() did not count everything (the time budget (0.5 s) ran out)" in text
    assert "no tensors exist" not in text
