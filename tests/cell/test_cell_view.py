"""Renderers: the compact line in torch's spelling, the report tables, escaping, the MIME bundle."""
from ipy_gpumem.core.records import CellRecord, DeviceRecord, HostRecord, LineRecord
from ipy_gpumem.core.memory import DeviceMemory
from ipy_gpumem.display.status import status_view
from ipy_gpumem.display.view import View, text_table
from ipy_gpumem.display import words
from ipy_gpumem.cell.view import cell_report_view, cell_view, history_view


def cell_line(record, threshold=0):
    return cell_view(record, threshold).text
from ipy_gpumem.core.units import GiB, MiB, parse_bytes

from conftest import dev_sample, make_sample


def gpu_record(**kw):
    before = 1 * GiB
    dev = DeviceRecord(
        0, "Tesla P100-PCIE-16GB",
        allocated_before=before, allocated_after=before + parse_bytes("2.81 GiB"),
        peak_allocated=before + parse_bytes("5.62 GiB"),
        reserved_before=2 * GiB, reserved_after=parse_bytes("9.53 GiB"), peak_reserved=parse_bytes("9.53 GiB"),
        used_before=3 * GiB, used_after=parse_bytes("10.00 GiB"), total=parse_bytes("15.78 GiB"),
    )
    args = dict(execution_count=7, cell_id="c7", source="output = model(input, comb)", started_at=0.0,
                duration_s=1.2, host=HostRecord(2 * GiB, 2 * GiB + 10 * MiB, 2 * GiB + 20 * MiB), devices=(dev,))
    args.update(kw)
    return CellRecord(**args)


def test_the_compact_gpu_line_reads_like_the_issue_promised():
    assert cell_line(gpu_record()) == "[7] cuda:0 +2.81 GiB allocated (peak +5.62 GiB) · reserved 9.53 / 15.78 GiB · 1.2 s"


def test_failed_cell_names_its_error_and_no_peak_when_peak_is_the_delta():
    rec = gpu_record(error="OutOfMemoryError")
    assert cell_line(rec).endswith("· 1.2 s · OutOfMemoryError")
    dev = rec.devices[0]
    flat = DeviceRecord(0, None, 0, GiB, GiB, 0, GiB, GiB, None, None, None)
    assert "(peak" not in cell_line(gpu_record(devices=(flat,)))
    assert dev.peak_increase > dev.allocated_delta


def test_cpu_line_uses_host_rss():
    rec = CellRecord(3, None, "x = torch.ones(2**26)", 0.0, 0.4, host=HostRecord(100 * MiB, 356 * MiB, 612 * MiB),
                     devices_note="CUDA not initialized yet")
    assert cell_line(rec) == "[3] host +256.00 MiB RSS (peak +512.00 MiB) · 356.00 MiB resident · 400 ms"


def test_threshold_counts_allocated_reserved_and_peak():
    rec = gpu_record()
    assert rec.moved_bytes >= 1 * GiB and not rec.moved_bytes >= 8 * GiB  # the largest move: reserved +7.53 GiB
    quiet = CellRecord(1, None, "", 0.0, 0.0, host=HostRecord(10, 10 + 5 * MiB, 10 + 5 * MiB))
    assert not quiet.moved_bytes >= 16 * MiB and quiet.moved_bytes >= 4 * MiB


def test_view_is_a_proper_mimebundle():
    view = cell_view(gpu_record())
    bundle = view._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert view._repr_mimebundle_(include=["text/plain"]) == {"text/plain": view.text}
    assert view._repr_mimebundle_(exclude=["text/html"]) == {"text/plain": view.text}
    assert "+2.81 GiB allocated" in bundle["text/html"]


def test_everything_from_the_user_is_escaped():
    evil = "<script>alert('x')</script>"
    rec = gpu_record(source=evil, error="<img src=x onerror=alert(1)>")
    for view in (cell_view(rec), history_view([rec]), cell_report_view(rec)):
        assert "<script>" not in view.html and "<img" not in view.html
        assert "&lt;script&gt;" in view.html or "&lt;img" in view.html


def test_report_lists_every_source_line_and_the_devices():
    lines = (
        LineRecord(2, "a = f()", 1, HostRecord(0, 10, 10, 10), (DeviceRecord(0, None, 0, GiB, GiB, 0, GiB, GiB, allocated_delta_sum=GiB, reserved_delta_sum=GiB),), 0.5),
        LineRecord(4, "    del a", 3, HostRecord(10, 0, 10, -10), (DeviceRecord(0, None, GiB, 0, GiB, GiB, GiB, GiB, allocated_delta_sum=-GiB, reserved_delta_sum=0),), 0.1),
    )
    rec = gpu_record(lines=lines, source="%%gpumem --lines\na = f()\nfor i in range(3):\n    del a")
    view = cell_report_view(rec, rec.source.splitlines())
    text = view.text
    assert text.splitlines()[0] == "%%gpumem [7] · 1.2 s"
    assert "cuda:0 (Tesla P100-PCIE-16GB) allocated" in text
    assert "cuda:0: 9.53 GiB reserved of 15.78 GiB total" in text
    rows = [r for r in text.splitlines() if r.strip().startswith(("1 ", "2 ", "3 ", "4 "))]
    # every line of the cell's code, hit or not; the %%gpumem header line runs nothing: no row (issue 31)
    assert [r.split()[0] for r in rows] == ["2", "3", "4"] and "%%gpumem --lines" not in "".join(rows)
    assert "+1024.00 MiB" in rows[0] and "a = f()" in rows[0]
    assert rows[1].split()[1:] == ["for", "i", "in", "range(3):"]  # a line that did not run: its source only
    assert rows[2].split()[1] == "3" and "-1024.00 MiB" in rows[2]


def test_history_names_a_magic_cell_by_its_code():
    """Issue 31: the history showed a ``%%gpumem --lines`` cell as its magic line."""
    view = history_view([gpu_record(source="%%gpumem --lines\n\nloss = model(x).sum()\nloss.backward()"),
                         gpu_record(execution_count=8, source="%%time")])
    assert "loss = model(x).sum()" in view.text and "%%gpumem" not in view.text
    assert "%%time" in view.text  # a magic line with nothing after it is all the cell says


def test_history_and_status_tables():
    empty = history_view([])
    assert "No cells recorded yet" in empty.text
    view = history_view([gpu_record(), gpu_record(execution_count=8, devices=())], limit=1)
    assert "[8]" in view.text and "[7]" not in view.text
    dev = dev_sample(0, allocated=4 * GiB, reserved=5 * GiB, used=6 * GiB, total=16 * GiB)
    view = status_view([DeviceMemory.from_sample(dev)], 3 * GiB, names={0: "H100"})
    assert view.data[0].free == 10 * GiB
    text = view.text
    row = [r for r in text.splitlines() if r.startswith("cuda:0")][0]
    assert row.split()[2:] == ["4.00", "GiB", "1024.00", "MiB", "1024.00", "MiB", "10.00", "GiB", "16.00", "GiB"]
    assert "host: 3.00 GiB resident" in text
    cpu = status_view([], GiB, reason="torch is not imported").text
    assert cpu.startswith("No GPU in use: torch is not imported.")


def test_text_table_alignment():
    out = text_table(["a", "bb"], [["x", "1"], ["yyy", "22"]])
    assert out.splitlines() == ["a    bb", "---  --", "x     1", "yyy  22"]
    assert isinstance(View("t", "<b>t</b>").text, str)


# -- numbers in records, words in views ---------------------------------------------------------------------


def _why(**kw):
    from ipy_gpumem.core.why import OwnerInfo, Why

    base = dict(parts=(("cuda:0", "activations", "output", 2600 * MiB), ("cuda:0", "other_tensors", "output", 64 * MiB),
                       ("cuda:0", "parameters", "model", 8 * MiB)),
                owners={"model": OwnerInfo("module", "Sequential", 8 * MiB)}, temporaries=3 * GiB)
    base.update(kw)
    return Why(**base)


def test_the_second_line_is_made_from_the_records_data_when_shown():
    rec = gpu_record(why=_why())
    lines = cell_line(rec).splitlines()
    # The biggest two clauses of what the cell kept (temporaries are the report's, not the line's).
    assert lines[1] == ("  +2.54 GiB activations saved for backward, kept by `output`; +64.00 MiB tensors held by "
                        "`output`; …")
    reason = words.cell_reason(rec)
    assert reason.endswith("+8.00 MiB parameters of `model` (Sequential)") and "temporaries" in reason
    data = rec.to_dict()  # the data the sentence is made from, and no sentence
    assert "reason" not in data and data["why"]["owners"]["model"]["class"] == "Sequential"
    assert data["why"]["parts"][0] == {"device": "cuda:0", "role": "activations", "owner": "output",
                                       "bytes": 2600 * MiB}
    partial = gpu_record(why=_why(complete=False, left_out=("stopped after 0.01 s (the time budget)",)))
    assert cell_line(partial).splitlines()[1].endswith("… (at least)")
    assert words.cell_reason(partial).endswith("(at least: the count of tensors stopped early, stopped after 0.01 s "
                                               "(the time budget))")
    assert words.cell_reason(gpu_record()) is None
    assert words.cell_reason(gpu_record(why=_why(parts=(), temporaries=None))) is None


def test_a_reruns_warning_is_made_from_its_suspects():
    from ipy_gpumem.core.why import Rerun, Suspect

    said = Suspect("opt", "optimizer", "rerun_cell", 96 * MiB, new=False, cell=4, model="model")
    new = Suspect("losses", "appended_graph", "append_item", 32 * MiB, item="loss")
    rec = gpu_record(rerun=Rerun(3, 3, 5, 128 * MiB, (said, new)))
    text = cell_line(rec)
    assert "Re-run of [3] (run 3) kept 128.00 MiB more than the previous run:" in text
    # Only what this run names for the first time is said under the line.
    assert "`losses.append(loss)` keeps each run's graph (32.00 MiB): append `loss.item()`" in " ".join(text.split())
    assert "`opt`" not in text
    assert len(words.causes(rec.rerun)) == 2 and len(words.causes(rec.rerun, new_only=True)) == 1
    assert words.causes(rec.rerun)[0] == ("`opt` (built in [4]) still holds the old `model`'s parameters (96.00 MiB): "
                                          "re-run [4] after this cell")
    data = rec.to_dict()["rerun"]  # the suspects as data: the words are the view's
    assert data == {"of": 3, "runs": 3, "previous": 5, "growth": 128 * MiB, "suspects": ["opt", "losses"],
                    "holders": [s.to_dict() for s in (said, new)]}
    assert data["holders"][1]["fix"] == "append_item" and data["holders"][1]["item"] == "loss"
    quiet = gpu_record(rerun=Rerun(3, 4, 6, 128 * MiB, (said,)))
    assert "Re-run" not in cell_line(quiet) and words.rerun_warning(quiet.rerun) is None
    assert "↻[3] +128.00 MiB" in history_view([rec]).text


def test_the_measured_and_the_estimated_reports_draw_the_same_tables():
    from ipy_gpumem.core.why import Why
    from ipy_gpumem.preflight.cell import CellEstimate, LineEstimate
    from ipy_gpumem.preflight.result import Estimate
    from ipy_gpumem.preflight.view import estimate_view

    roles = {"cuda:0": {"activations": 16 * MiB}}
    phases = ({"phase": "forward", "step": 1, "peak": {"cuda:0": 24 * MiB}, "roles": roles},
              {"phase": "forward", "step": 2, "peak": {"cuda:0": 24 * MiB}, "roles": roles})
    line = LineRecord(2, "out = model(x)", 1, HostRecord(0, 10, 10, 10),
                      (DeviceRecord(0, None, 0, 16 * MiB, 24 * MiB, 0, 0, 0, allocated_delta_sum=16 * MiB,
                                    reserved_delta_sum=0, peak_increase_max=24 * MiB),), 0.5, roles=roles,
                      why=Why((("cuda:0", "activations", "out", 16 * MiB),)))
    measured = cell_report_view(gpu_record(lines=(line,), phases=phases, layers=(("0", 8 * MiB),),
                                           source="%%gpumem --lines\nout = model(x)")).text
    est = Estimate("cuda:0", 24 * MiB, 32 * MiB, 0, roles, [dict(p, peak=24 * MiB) for p in phases],
                   [{"module": "0", "type": "Linear", "activations": 8 * MiB, "peak": 8 * MiB, "calls": 1}], {})
    predicted = estimate_view(CellEstimate(est, [LineEstimate(2, 1, 16 * MiB, 0, 24 * MiB)],
                                           ("%%gpumem --estimate", "out = model(x)"))).text

    def row(text, start):
        return next(r for r in text.splitlines() if r.lstrip().startswith(start))

    # The same per-line columns, the same cells for the same numbers.
    assert row(measured, "line").split()[:5] == row(predicted, "line").split()[:5] == [
        "line", "hits", "Δallocated", "Δreserved", "peak"]
    assert row(measured, "2 ").split()[:5] == row(predicted, "2 ").split()[:5] == [
        "2", "1", "+16.00", "MiB", "+0"]
    # The same phase table: count, the worst peak, the first and the steady step's roles.
    assert row(measured, "forward").split() == row(predicted, "forward").split() == [
        "forward", "2", "24.00", "MiB", "act", "+16.00", "MiB", "act", "+16.00", "MiB"]
    assert "line 2: +16.00 MiB activations saved for backward, kept by `out`" in measured
