"""The docs a newcomer reads stay true: the README stays short, every link between the pages resolves,
docs/configuration.md is what tools/make_config_docs.py writes from the traits, and each record table of
docs/api.md lists exactly the keys its ``to_dict()`` writes."""
import gzip
import importlib.util
import os
import pickle
import re

import pytest

from tests.conftest import EXACT_S

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/whole/ -> the checkout
DOCS = os.path.join(ROOT, "docs")
SNAPSHOTS = os.path.join(ROOT, "tests", "fixtures", "snapshots")
PAGES = ["README.md"] + sorted(os.path.join("docs", n) for n in os.listdir(DOCS) if n.endswith(".md"))


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        return fh.read()


# -- the README ---------------------------------------------------------------------------------------


def test_the_readme_is_one_or_two_screens_and_use_comes_before_develop():
    readme = read("README.md")
    assert len(readme.splitlines()) <= 200
    order = [readme.index(h) for h in ("## What you see", "## Install", "## Use", "## Develop", "## Read more")]
    assert order == sorted(order)
    for page in ("usage", "api", "configuration", "architecture", "development"):
        assert f"(docs/{page}.md)" in readme, page


# -- links ------------------------------------------------------------------------------------------


def slug(heading):
    """The anchor GitHub gives a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    text = re.sub(r"```.*?```", "", read(path), flags=re.S)  # a "# comment" in a code block is no heading
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES)
def test_every_link_between_the_pages_resolves(page):
    text = re.sub(r"```.*?```", "", read(page), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links or page.endswith("configuration.md")
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        target, _, anchor = link.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
        assert os.path.exists(os.path.join(ROOT, path)), f"{page}: {link} (no {path})"
        if anchor:
            assert path.endswith(".md") and anchor in anchors(path), f"{page}: {link} (no such heading in {path})"


def test_the_slug_is_githubs():
    assert slug("Estimates: `%%gpumem --estimate`, `estimate()`, `max_batch_size()`") == \
        "estimates-gpumem---estimate-estimate-max_batch_size"
    assert slug("`CellRecord.to_dict()`") == "cellrecordto_dict"


# -- the configuration page is generated -----------------------------------------------------------


def test_the_configuration_page_is_what_the_traits_say():
    path = os.path.join(ROOT, "tools", "make_config_docs.py")
    spec = importlib.util.spec_from_file_location("make_config_docs", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert read(os.path.join("docs", "configuration.md")) == tool.render(), \
        "docs/configuration.md is out of date: run python tools/make_config_docs.py"
    from ipy_gpumem.extension import GpuMemMagics

    assert {name for name, *_ in tool.options()} == set(GpuMemMagics.class_traits(config=True))  # every option


# -- the record tables ------------------------------------------------------------------------------


def tables():
    """``{heading: (keys, optional keys)}`` of every table of docs/api.md whose first column is ``key``."""
    out, heading, keyed = {}, None, False
    for line in read(os.path.join("docs", "api.md")).splitlines():
        if line.startswith("#"):
            heading, keyed = line.lstrip("#").strip(), False
        elif line.startswith("| key |"):
            keyed = True
        elif line.startswith("| `") and keyed:
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            keys, optional = out.setdefault(heading, ([], set()))
            keys.append(cells[0].strip("`"))
            if cells[-1].startswith("(when set)"):
                optional.add(cells[0].strip("`"))
    return out


def check(heading, sample):
    keys, optional = tables()[heading]
    assert len(keys) == len(set(keys)), f"{heading}: a key listed twice"
    assert set(sample) <= set(keys), f"{heading}: not documented: {sorted(set(sample) - set(keys))}"
    unwritten = set(keys) - optional - set(sample)
    assert not unwritten, f"{heading}: documented but not written: {sorted(unwritten)}"


def a_full_cell_record():
    """A CellRecord with every optional part present, built from the record classes themselves."""
    from ipy_gpumem.core.records import (CellRecord, DeviceRecord, HostRecord, JoinedLines, LineRecord, LoopSpan,
                                         RankFailure, RankRecord)
    from ipy_gpumem.core.why import Imports, Moved, OwnerInfo, Rerun, Suspect, Why

    why = Why(parts=(("cpu", "parameters", "model", 4096),), owners={"model": OwnerInfo("module", "Linear", 4096)},
              moved=(Moved("parameters", "model", "loss", 4096),), imports=Imports(3, (("torch", 3),), 0))
    host = HostRecord(100, 200, 300)
    dev = DeviceRecord(0, "a card", 1, 2, 3, 4, 5, 6, 7, 8, 9)
    line = LineRecord(2, "y = model(x)", 1, host, (dev,), 0.1, roles={"cuda:0": {"activations": 8}},
                      temporaries={"cuda:0": 0}, why=why, why_last=why)
    rerun = Rerun(1, 2, 1, 4096, (Suspect("keep", "variable", "del", 4096, hook=("model", "forward hook", 2)),))
    return CellRecord(3, "cell-id", "%%gpumem --lines\ny = model(x)", 0.0, 0.1, host=host, devices=(dev,),
                      roles={"cuda:0": {"activations": 8}}, why=why, layers=(("0", 8),), rerun=rerun,
                      ranks=(RankRecord(0, 4242, host, (dev,)),),
                      rank_failure=RankFailure(0, 4242, "torch.multiprocessing", "ProcessRaisedException"),
                      lines=(line,), loops=(LoopSpan(2, 2),), joined=(JoinedLines((2,), 1),))


def test_the_cell_record_tables_list_exactly_what_to_dict_writes():
    from ipy_gpumem.core.records import ROW_FIELDS, record_rows

    record = a_full_cell_record()
    d = record.to_dict()
    for heading, sample in (("`CellRecord.to_dict()`", d), ("`host`", d["host"]), ("`devices[]`", d["devices"][0]),
                            ("`why`", d["why"]), ("`layers[]`", d["layers"][0]), ("`lines[]`", d["lines"][0]),
                            ("`loops[]`", d["loops"][0]), ("`joined[]`", d["joined"][0]), ("`rerun`", d["rerun"]),
                            ("`holders[]`", d["rerun"]["holders"][0]), ("`ranks[]`", d["ranks"][0]),
                            ("`rank_failure`", d["rank_failure"])):
        check(heading, sample)
    rows = list(record_rows([record]))
    assert all(list(row) == list(ROW_FIELDS) for row in rows) and len(rows) == 4  # host and device, the rank's too
    check("The rows of `history_frame()` and the CSV export", dict.fromkeys(ROW_FIELDS))


def test_the_oom_report_and_who_tables_list_exactly_what_to_dict_writes():
    torch = pytest.importorskip("torch")
    import ipy_gpumem
    from ipy_gpumem.attribution.who import who

    oom = ipy_gpumem.parse_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
                               "total capacity of 14.75 GiB of which 3.06 MiB is free. Process 1234 has 14.74 GiB memory "
                               "in use. Of the allocated memory 14.56 GiB is allocated by PyTorch, and 20.00 MiB is "
                               "reserved by PyTorch but unallocated.")
    check("`OomReport.to_dict()`", oom.to_dict())
    report = who({"w": torch.zeros(4)}, budget_s=EXACT_S).to_dict()
    check("`WhoReport.to_dict()`", report)
    check("`holders` of `who()`", report["holders"][0])


def test_the_types_table_lists_every_public_type():
    import ipy_gpumem

    listed = set(re.findall(r"^\| `(\w+)`", read(os.path.join("docs", "api.md")).split("## Types and errors")[1]
                            .split("\n## ")[0], flags=re.M))
    assert listed == {name for name in ipy_gpumem.__all__ if isinstance(getattr(ipy_gpumem, name), type)}


def test_the_estimate_table_lists_exactly_what_to_dict_writes():
    from ipy_gpumem.preflight.result import Estimate

    est = Estimate("cuda:0", 4096, 2 << 20, 0, {"cuda:0": {"activations": 4096}},
                   [{"phase": "forward", "step": 1, "peak": 4096, "roles": {"cuda:0": {"activations": 4096}}}],
                   [{"module": "model", "type": "Linear", "activations": 4096, "peak": 4096, "calls": 1}],
                   {"cuda_context": 300 << 20}, gpu="T4")
    est = Estimate.from_plain(est.to_plain())  # the rows as the sealed child's answer is checked
    check("`Estimate.to_dict()`", est.to_dict())


def _snapshot(name):
    with gzip.open(os.path.join(SNAPSHOTS, name)) as fh:
        return pickle.load(fh)  # a fixture of this repository (the package itself never unpickles)


def test_the_snapshot_tables_list_exactly_what_to_dict_writes():
    import ipy_gpumem

    d = ipy_gpumem.snapshot(_snapshot("sil_mem_snapshot.pickle.gz")).to_dict()
    check("`SnapshotReport.to_dict()`", d)
    check("`devices[]` of a snapshot", d["devices"][0])


def test_the_phase_rows_table_lists_exactly_what_the_phase_watcher_writes():
    torch = pytest.importorskip("torch")
    from ipy_gpumem.anatomy.phases import PhaseWatcher

    model = torch.nn.Linear(4, 4)
    watcher = PhaseWatcher(lambda: (0.0, {"cpu": (0, 0)}))  # readings of a machine whose memory never moves
    watcher.start()
    try:
        for _ in range(2):  # no optimizer: its first step imports torch's compiler (seconds)
            model(torch.ones(2, 4)).sum().backward()
            model.zero_grad()
    finally:
        watcher.stop()
    check("`phases[]`", watcher.phases[0])
    assert watcher.summary() and all(set(row) == {"count", "peak", "first", "steady"}
                                     for row in watcher.summary().values())


@pytest.mark.slow
def test_the_oom_table_lists_exactly_what_a_recorded_failure_writes():
    import ipy_gpumem

    d = ipy_gpumem.snapshot(os.path.join(SNAPSHOTS, "Constructor-Sun_memory_snapshot.pickle.gz")).to_dict()
    check("`oom`", d["oom"])
    check("`oom`", d["devices"][1]["oom"])
