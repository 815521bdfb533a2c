"""%%gpumem --estimate: a cell's code estimated on fake copies of the namespace's objects, never run for real; the table, the verdict, -o, bad GPU names; in a shell and in a real kernel (one, for the module), the usual loop with its DataLoader's workers and a lock held by a thread of the kernel included."""
import pytest

torch = pytest.importorskip("torch")

from conftest import run, texts  # noqa: E402

from ipy_gpumem.cell.header import HeaderError, parse_args, strip_header  # noqa: E402
from ipy_gpumem.preflight.cell import estimate_cell  # noqa: E402
from ipy_gpumem.preflight.gpus import GPUS  # noqa: E402
from ipy_gpumem.preflight.result import Estimate, EstimateError  # noqa: E402

# Names a test makes in the suite's shared shell are removed after it.
pytestmark = pytest.mark.usefixtures("restore_user_ns")

SETUP = """
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
inputs, targets = torch.randn(64, 256), torch.randint(0, 10, (64,))
counter = 0
losses = []
def loss_of(out):
    global counter
    counter += 1
    return F.cross_entropy(out, targets)
"""
STEP = """optimizer.zero_grad()
loss = loss_of(model(inputs))
loss.backward()
optimizer.step()
losses.append(float(loss))
counter += 1
print("THIS MUST NOT APPEAR")
"""


#: The usual training loop (tests/preflight/test_estimate_loop.py has the same in the shared shell).
LOOP_SETUP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
ds = TensorDataset(torch.randn(96, 32), torch.randint(0, 4, (96,)))
"""
LOOP = """for x, y in dl:
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def _state(ns):
    model, opt = ns["model"], ns["optimizer"]
    return {"params": [p.detach().clone() for p in model.parameters()],
            "grads": [p.grad for p in model.parameters()],
            "state": {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in opt.state.items()},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
            "inputs": ns["inputs"].clone(), "rng": torch.random.get_rng_state(),
            "counter": ns["counter"], "losses": list(ns["losses"]), "attrs": (set(vars(model)), set(vars(opt)))}


def _same(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_the_header_reads_estimate_and_leaves_the_cell_to_the_magic():
    assert parse_args("--estimate").estimate == "this GPU"
    plan = parse_args("--estimate T4 -o est")
    assert (plan.estimate, plan.output) == ("T4", "est")
    assert parse_args("-o est --estimate").estimate == "this GPU"
    assert parse_args("-l").estimate is None
    with pytest.raises(HeaderError) as err:
        parse_args("--estimate GTX9999")
    assert "\n" not in str(err.value) and "T4" in str(err.value) and "A100-80" in str(err.value)
    with pytest.raises(HeaderError):
        parse_args("--estimate T4 -d cuda:0")
    lines = ["%%gpumem --estimate T4\n", "x = 1\n"]
    assert strip_header(list(lines)) == lines  # the magic must run: the cell is not run as itself


def test_estimate_cell_is_exact_about_roles_and_leaves_everything_alone():
    ns = {}
    exec(SETUP, ns)
    before = _state(ns)
    cell = estimate_cell(STEP, ns, gpu="T4", first_line=2)
    assert _same(before, _state(ns))  # weights, grads, optimizer state, RNG, the counter, the list
    assert all(p.grad is None for p in ns["model"].parameters()) and not ns["optimizer"].state
    est = cell.estimate
    # torch's CUDA counters count blocks, rounded up to 512 bytes
    params = sum(-(-p.numel() * 4 // 512) * 512 for p in ns["model"].parameters())
    row = est.roles["cuda:0"]
    assert row["parameters"] == params and row["gradients"] == params
    steps = 512 * len(list(ns["model"].parameters()))  # Adam's step count per parameter, one block each
    assert row["optimizer_state"] == 2 * params + steps  # exp_avg and exp_avg_sq
    assert est.peak_allocated >= 4 * params and est.total_needed == est.peak_reserved + sum(est.fixed_costs.values())
    assert cell.fit is not None and cell.fit.fits and cell.fit.gpu == "T4"
    # per line, numbered as the user sees them under the %%gpumem line
    by_line = {ln.lineno: ln for ln in cell.lines}
    assert sorted(by_line) == list(range(2, 9))
    assert by_line[4].allocated_delta > 0  # backward makes the gradients (steady state: zero_grad freed them)
    assert by_line[2].allocated_delta == -params  # zero_grad(set_to_none=True) frees them
    assert by_line[8].allocated_delta == 0
    assert any("printed" in note for note in est.notes)
    assert set(cell.faked) >= {"model", "optimizer", "inputs", "targets"}  # the names holding tensors


def test_a_cell_that_cannot_be_estimated_names_its_line():
    ns = {}
    exec(SETUP, ns)
    with pytest.raises(EstimateError) as err:
        estimate_cell("y = inputs.sum()\nidx = inputs.nonzero()\n", ns, first_line=2)
    assert "line 3" in str(err.value)
    with pytest.raises(EstimateError):
        estimate_cell("get_ipython().run_line_magic('time', 'x = 1')\n", ns)


@pytest.mark.slow
def test_estimate_in_a_shell(ip, gpumem):
    run(ip, SETUP)
    ns = ip.user_ns
    before = _state(ns)
    result, cap = run(ip, "%%gpumem --estimate T4 -o est\n" + STEP)
    assert result.success, result.error_in_exec
    assert "THIS MUST NOT APPEAR" not in cap.stdout
    shown = "\n".join(texts(cap))
    assert "%%gpumem --estimate" in shown and "peak allocated" in shown and "total needed" in shown
    assert "Verdict: fits with " in shown and "to spare on T4 (14.75 GiB usable)" in shown
    est = ns.get("est")
    # (a rare failure under load left "optimizer state" out of the peak's roles: say what the peak held)
    assert "At the peak" in shown and "optimizer state" in shown, (
        None if est is None else (est.peak_phase, est.peak_step, est.roles, est.notes))
    assert "Δallocated" in shown and "loss.backward()" in shown and "forward" in shown
    assert "CUDA context (assumed)" in shown
    est = ns["est"]
    assert isinstance(est, Estimate) and est.fits("T4")
    assert _same(before, _state(ns))
    assert ns["counter"] == 0 and ns["losses"] == []
    # the verdict the other way round, and a size
    _, cap = run(ip, "%%gpumem --estimate 100MiB\n" + STEP)
    assert "does not fit on 100MiB: needs " in "\n".join(texts(cap))
    # no GPU named on a machine without one: it says what it compared with
    if not torch.cuda.is_available():
        _, cap = run(ip, "%%gpumem --estimate\n" + STEP)
        assert "no GPU here: compared with a T4" in "\n".join(texts(cap))


def test_bad_gpu_name_is_a_one_line_usage_error(ip, gpumem):
    run(ip, SETUP)
    result, cap = run(ip, "%%gpumem --estimate GTX9999\n" + STEP)
    assert not result.success and type(result.error_in_exec).__name__ == "UsageError"
    message = str(result.error_in_exec)
    assert "\n" not in message and "GTX9999" in message and all(name in message for name in GPUS)
    assert ip.user_ns["counter"] == 0


def test_an_estimate_that_fails_says_so_in_one_line(ip, gpumem):
    run(ip, SETUP)
    ip.user_ns.pop("idx", None)  # an earlier test of the shared shell may have made one
    result, cap = run(ip, "%%gpumem --estimate T4\nidx = inputs.nonzero()\n")
    assert result.success
    assert cap.stdout.strip().startswith("%%gpumem --estimate: ") and "line 2" in cap.stdout
    assert "idx" not in ip.user_ns


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """One real kernel for the module's kernel tests: their cells in one notebook, run once
    (``(notebook, the first cell of each test's part, the files the second part's cell tries to write)``)."""
    from kernel_helpers import execute

    tmp_path = tmp_path_factory.mktemp("estimated_cell")
    files = ckpt, log, opened, touched = tuple(tmp_path / n for n in ("ckpt.pt", "log.txt", "open.log", "touched"))
    side_effects = (f"torch.save(model.state_dict(), {str(ckpt)!r})\n"
                    f"with open({str(log)!r}, 'a') as fh:\n    fh.write('x')\n"
                    "logf.write('y' * 100_000)\nlogf.flush()\n"
                    f"os.system('touch {touched}')\n"
                    "os.environ['IPG_ESTIMATE'] = '1'\ntorch.set_grad_enabled(False)\n")
    in_a_kernel = [SETUP,
                   "%%gpumem --estimate T4 -o est\n" + STEP,
                   "print('RESULT', counter, len(losses), all(p.grad is None for p in model.parameters()), "
                   "len(optimizer.state), type(est).__name__, est.fits('T4').fits)",
                   "%%gpumem --estimate NoSuchGPU\nx = 1"]
    changes_nothing = [SETUP + f"import os\nlogf = open({str(opened)!r}, 'a')\n",
                       "%%gpumem --estimate T4\ntorch.set_grad_enabled(True)\n" + STEP + side_effects,
                       "logf.close()\nprint('RESULT', counter, len(losses), os.environ.get('IPG_ESTIMATE'), "
                       "torch.is_grad_enabled())",
                       "%%gpumem --estimate T4\nimport asyncio\nawait asyncio.sleep(0)\n"]
    # last: a DataLoader's persistent workers and a thread that holds a lock until the end
    usual_loop = [LOOP_SETUP + "dl = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2, persistent_workers=True)\n"
                  "batches = sum(1 for _ in dl)\n"
                  "import threading\nheld, release = threading.Lock(), threading.Event()\n"
                  "def hold():\n    with held:\n        release.wait(120)\n"
                  "threading.Thread(target=hold, name='my-feeder', daemon=True).start()\n",
                  "%%gpumem --estimate T4 -o est\n" + LOOP,
                  "print('RESULT', batches, sum(1 for _ in dl), dl.num_workers, "
                  "any('num_workers=0' in n for n in est.notes))",
                  "%%gpumem --estimate T4\nwith held:\n    y = model(torch.randn(2, 32))\n",
                  "release.set()"]
    nb = execute(["%load_ext ipy_gpumem"] + in_a_kernel + changes_nothing + usual_loop, timeout=240)
    first = {"in_a_kernel": 1, "changes_nothing": 1 + len(in_a_kernel)}
    first["usual_loop"] = first["changes_nothing"] + len(changes_nothing)
    return nb, first, files


@pytest.mark.slow
def test_estimate_in_a_real_kernel(kernel):
    from kernel_helpers import plain

    nb, first, _files = kernel
    cells = nb.cells[first["in_a_kernel"]:]
    report = "\n".join(plain(cells[1]))
    printed = "".join(o.text for o in cells[1].outputs if o.output_type == "stream")
    assert "THIS MUST NOT APPEAR" not in printed and "THIS MUST NOT APPEAR" in report  # shown as source only
    assert "Verdict: fits with " in report and "on T4" in report and "Δallocated" in report
    line = next(t for t in plain(cells[2]) if t.startswith("RESULT"))
    assert line.split() == ["RESULT", "0", "0", "True", "0", "Estimate", "True"]
    # IPython shows a UsageError as one line on stderr, never a traceback
    streams = [o for o in cells[3].outputs if o.output_type == "stream"]
    assert len(streams) == 1 and streams[0].name == "stderr"
    assert streams[0].text.startswith("UsageError: --estimate NoSuchGPU: unknown GPU; name one of K80")
    assert streams[0].text.strip().count("\n") == 0


@pytest.mark.slow
def test_an_estimated_cell_changes_nothing_in_a_real_kernel(kernel):
    """Files, the environment, torch's settings and the namespace stay as they were; what the cell tried is listed."""
    from kernel_helpers import plain

    nb, first, (ckpt, log, opened, touched) = kernel
    cells = nb.cells[first["changes_nothing"]:]
    report = " ".join(" ".join(plain(cells[1])).split())
    assert "Verdict: fits with " in report
    for tried in ("ckpt.pt", "log.txt", "touch", "open.log"):
        assert tried in report, (tried, report[-2000:])
    line = next(t for t in plain(cells[2]) if t.startswith("RESULT"))
    assert line.split() == ["RESULT", "0", "0", "None", "True"]
    assert not ckpt.exists() and not log.exists() and not touched.exists() and opened.read_text() == ""
    streams = [o for o in cells[3].outputs if o.output_type == "stream"]
    text = " ".join(o.text for o in streams)
    assert "awaits at the top level" in text and "Traceback" not in text


@pytest.mark.slow
def test_the_usual_loop_and_a_held_lock_in_a_real_kernel(kernel):
    """The kernel's DataLoader with persistent workers is read in the estimate's copy as without workers, and
    goes on in the kernel; a step that takes a lock another thread of the kernel holds is ended in one line."""
    nb, first, _files = kernel
    cells = nb.cells[first["usual_loop"]:]
    report = "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in cells[1].outputs)
    assert "Verdict: fits" in report, report[-2000:]
    printed = "".join(o.get("text", "") for o in cells[2].outputs)
    assert "RESULT 6 6 2 True" in printed, printed  # the kernel's loader and its workers go on
    said = "".join(o.get("text", "") for o in cells[3].outputs).strip()
    assert said.count("\n") == 0 and said.startswith("%%gpumem --estimate: line 2 of the cell (`with held:`) waits "
                                                     "for a lock"), said
    assert "my-feeder" in said and "Traceback" not in said
