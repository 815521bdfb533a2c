"""The shipped notebooks run top to bottom in a real kernel and show what they promise."""
import importlib.util
import os
import shlex
import subprocess
import sys

import pytest

from kernel_helpers import needs_nbclient

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, needs_nbclient,
              pytest.mark.skipif(importlib.util.find_spec("nbconvert") is None, reason="nbconvert is not installed")]

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "notebooks")


def readme_demo_args():
    """The arguments of the README's demo command (``.venv/bin/python -m ipy_gpumem demo``), run here by this
    interpreter: this test is what checks the README's third command."""
    with open(os.path.join(os.path.dirname(NOTEBOOKS), "README.md"), encoding="utf-8") as fh:
        block = fh.read().split("<!-- ci:demo -->", 1)[1].split("<!-- /ci:demo -->", 1)[0]
    (command,) = [line for line in block.splitlines() if line.strip() and not line.startswith("```")]
    python, *args = shlex.split(command)
    assert python == ".venv/bin/python" and args[:3] == ["-m", "ipy_gpumem", "demo"], command
    return args


def run(name, tmp_path):
    """The README's demo command on ``name``, as a user runs it: it says where it wrote, and prints nothing else
    (no traceback, no kernel warning)."""
    import nbformat

    done = subprocess.run([sys.executable, *readme_demo_args(), name, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    html = os.path.join(tmp_path, name + ".html")
    assert done.stdout.startswith(f"executed {name}.ipynb in ") and done.stdout.rstrip().endswith(html), done.stdout
    assert "Traceback" not in done.stderr and "without encryption" not in done.stderr, done.stderr[-3000:]
    assert os.path.getsize(html) > 10_000
    assert not [f for f in os.listdir(tmp_path) if "ipc" in f]  # the kernel's sockets live in a private folder
    return nbformat.read(os.path.join(tmp_path, name + ".ipynb"), as_version=4)


def texts(cell):
    out = []
    for o in cell.outputs:
        out.append(o.get("text", "") or o.get("data", {}).get("text/plain", "") or o.get("evalue", ""))
    return "\n".join(out)


def find(nb, start):
    return next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith(start))


def test_quickstart(tmp_path):
    nb = run("quickstart", tmp_path)
    assert "host:" in texts(find(nb, "%gpumem status"))
    report = texts(find(nb, "%%gpumem --lines -o rec"))
    assert report.startswith("%%gpumem [") and "optimizer.step()" in report
    # The anatomy: the table's roles and the reasons in the user's names.
    assert "by role" in report and "grad +" in report and "optim +" in report and "act +" in report
    assert "Adam state (exp_avg, exp_avg_sq) in `optimizer`" in report and "first backward" in report
    roles = texts(find(nb, "# The record is plain data"))
    assert "optimizer_state" in roles and "created on the first step" in roles
    again = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith("%%gpumem --lines\noutput")]
    assert "re-made after" in texts(again[0])
    phases = texts(find(nb, "%%gpumem -o epoch"))
    assert "Training phases" in phases and "optimizer step" in phases and "Heaviest activations" in phases
    assert "cell" in texts(find(nb, "%gpumem history")) and "wrote" in texts(find(nb, "%gpumem export"))
    assert "UsageError" in texts(find(nb, "%gpumem sideways"))
    # Pre-flight: the step's peak on fake tensors, the verdict for a T4, the batch that fits, and a cell estimated.
    est = texts(find(nb, "def train_step"))
    # (the estimate names the GPU whose fixed costs it assumed: "Estimate(cuda:0 on a T4: ...")
    assert est.startswith("Estimate(cuda:0") and "peak allocated " in est and "total needed" in est
    assert "optimizer_state" in est
    assert texts(find(nb, 'fit = est.fits("T4")')).startswith("(True, '")
    best = texts(find(nb, "best = ipy_gpumem.max_batch_size"))
    assert best.startswith("(MaxBatch(") and "gpu='T4'" in best
    assert int(best.split("MaxBatch(")[1].split(",")[0]) > 512  # a small MLP: a T4 takes far more than 512
    cell = texts(find(nb, "%%gpumem --estimate T4"))
    assert cell.startswith("%%gpumem --estimate") and "Verdict: fits with " in cell and "on T4 (14.75 GiB usable)" in cell
    assert "Δallocated" in cell and "optimizer.step()" in cell and "At the peak" in cell


@pytest.mark.compat  # the README demo command and a real OOM panel in a kernel of each venv
def test_oom_walkthrough_ends_in_a_real_oom_and_its_panel(tmp_path):
    nb = run("oom_walkthrough", tmp_path)
    who = texts(find(nb, "%gpumem who"))
    assert "optimizer state" in who and "retained graphs" in who and "output + loss (shared graph)" in who
    failing = find(nb, "batch_size = 4096")
    kinds = [o.output_type for o in failing.outputs]
    assert kinds[0] == "error"
    assert any(word in failing.outputs[0].evalue for word in ("DefaultCPUAllocator", "CUDA out of memory"))
    panel = texts(failing)
    assert "Out of memory on" in panel and "Diagnosis" in panel and "Who holds it" in panel
    assert "ipy_gpumem free: done." in texts(find(nb, "%gpumem free"))
