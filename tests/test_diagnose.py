"""Tests for ``ipy_gpumem.oom.diagnose``: the state at failure and ranked findings, on real messages and real tensors."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import traceback

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from ipy_gpumem.oom import diagnose  # noqa: E402
from ipy_gpumem.who.attribution import who  # noqa: E402
from ipy_gpumem.oom.diagnose import CONFIDENCES, FINDING_KEYS, Finding, MemoryState, explain, host_state  # noqa: E402
from ipy_gpumem.oom.parse import SIZE_FIELDS, parse_oom  # noqa: E402
from ipy_gpumem.core.records import CellRecord, DeviceRecord  # noqa: E402
from ipy_gpumem.core.units import GiB, MiB, format_bytes, parse_bytes  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

# The Colab P100 user's error (seeds/000 and 001), verbatim.
SEED = ("RuntimeError: CUDA out of memory. Tried to allocate 2.32 GiB (GPU 0; 15.78 GiB total capacity; "
        "11.91 GiB already allocated; 182.75 MiB free; 14.26 GiB reserved in total by PyTorch)")
# The seed's traceback frames, innermost last, as the caller extracts them.
SEED_FRAMES = (
    ("<ipython-input-11-f566d09448f9>", "<module>", "optimizer.step()"),
    ("/usr/local/lib/python3.7/dist-packages/torch/optim/optimizer.py", "wrapper", "return func(*args, **kwargs)"),
    ("/usr/local/lib/python3.7/dist-packages/torch/autograd/grad_mode.py", "decorate_context",
     "return func(*args, **kwargs)"),
    ("/usr/local/lib/python3.7/dist-packages/torch/optim/adam.py", "step", "eps=group['eps'])"),
    ("/usr/local/lib/python3.7/dist-packages/torch/optim/_functional.py", "adam",
     "denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)"),
)
# The seed's training loop (its nvidia-smi and print lines dropped).
SEED_SOURCE = """\
learning_rate = 0.001
num_epochs = 50
optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
for epoch in range(num_epochs):
    train_running_loss = 0.0
    model = model.train()
    for i, (name, output_array, input) in enumerate(trainloader):
        output_array = output_array.to(device)
        input = input.to(device)
        comb = torch.zeros(1,1,100,1632).to(device)
        output = model(input, comb)
        loss = my_loss(output, output_array)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        train_running_loss += loss.detach().item()
"""
# The current (torch >= 2.1) message shape, as torch formats it, for scenarios the seed lacks.
V5 = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {req}. GPU 0 has a total capacity of "
      "{total} of which {free} is free. {procs}Of the allocated memory {alloc} is allocated by PyTorch, and "
      "{unalloc} is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
      "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
# A small device whose numbers match the CPU tensors below (who() counts them; the message frames them).
SMALL = V5.format(req="4.00 MiB", total="64.00 MiB", free="1.00 MiB", procs="", alloc="40.00 MiB", unalloc="2.00 MiB")
_SIZE_TEXT = re.compile(r"[0-9]+(?:\.[0-9]+)? (?:bytes|KiB|MiB|GiB)")


@pytest.fixture(autouse=True)
def strict_rules(monkeypatch):
    """A bug in a rule fails the test instead of silently dropping the finding."""
    monkeypatch.setattr(diagnose, "RAISE_RULE_ERRORS", True)


def load_samples():
    with open(os.path.join(HERE, "fixtures", "oom-samples.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class Seed:
    """The seed scenario on the CPU: a real MLP, Adam after one step, the next forward's output and loss kept."""

    def __init__(self, optimizer: bool = True, step: bool = True, keep_graph: bool = True):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))  # 8 MiB of weights
        self.input = torch.randn(256, 1024)
        self.ns = {"model": self.model, "input": self.input}
        if optimizer:
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3)
            self.ns["optimizer"] = self.optimizer
        if step:
            loss = self.model(self.input).pow(2).mean()
            loss.backward()
            if optimizer:
                self.optimizer.step()
        if keep_graph:
            self.ns["output"] = output = self.model(self.input)
            self.ns["loss"] = output.pow(2).mean()
        self.who = who(self.ns)
        self.oom = parse_oom(SEED)
        self.state = MemoryState.from_oom(self.oom)

    def explain(self, **kw):
        kw.setdefault("traceback_frames", SEED_FRAMES)
        kw.setdefault("failing_source", SEED_SOURCE)
        kw.setdefault("env", {})
        kw.setdefault("modules", ())
        return explain(self.oom, self.state, self.who, **kw)


def by_key(findings):
    return {f.key: f for f in findings}


def cites(finding: Finding, code: str = "") -> bool:
    """The finding quotes a size in torch's spelling, or a line/name from the user's code."""
    text = finding.title + " " + finding.detail
    if _SIZE_TEXT.search(text):
        return True
    return any(line.strip() and line.strip()[:40] in text for line in code.splitlines())


def assert_well_formed(findings, code=""):
    assert len(findings) <= diagnose.MAX_FINDINGS
    ranks = [(f.key != "request_exceeds_device", CONFIDENCES.index(f.confidence), f.frees is None,
              -(f.frees or 0)) for f in findings]
    assert ranks == sorted(ranks), [(f.key, f.confidence, f.frees) for f in findings]
    for f in findings:
        assert f.key in FINDING_KEYS
        assert f.confidence in CONFIDENCES
        assert f.title and f.detail and f.fix.strip(), f
        assert "\n" not in f.title
        assert cites(f, code), f


# ================================================================================ MemoryState


def test_seed_message_gives_exact_state():
    oom = parse_oom(SEED)
    s = MemoryState.from_oom(oom)
    assert (s.device, s.source) == ("cuda:0", "OOM message")
    assert s.total == parse_bytes("15.78 GiB")
    assert s.allocated == parse_bytes("11.91 GiB")
    assert s.reserved == parse_bytes("14.26 GiB")
    assert s.free == parse_bytes("182.75 MiB")
    assert s.used == s.total - s.free
    assert s.reserved_unallocated == s.reserved - s.allocated
    assert s.outside_pytorch == s.used - s.reserved
    assert s.process_used is None and s.processes == () and s.other_processes_bytes is None
    # Back in torch's spelling, the numbers read as in the message.
    assert [format_bytes(v) for v in (s.total, s.allocated, s.reserved, s.free)] == \
        ["15.78 GiB", "11.91 GiB", "14.26 GiB", "182.75 MiB"]
    assert format_bytes(s.reserved_unallocated) == "2.35 GiB"
    assert format_bytes(s.outside_pytorch) == "1.34 GiB"


def test_processes_and_this_process_from_a_v5_message():
    sample = next(d for d in load_samples() if "procinfo=this+other2" in d["variant"])
    s = MemoryState.from_oom(parse_oom(sample["message"]))
    assert s.process_used == parse_bytes("9.74 GiB")
    assert [(pid, b) for pid, b, _ in s.processes] == [(3893521, parse_bytes("618.00 MiB")),
                                                       (1493972, parse_bytes("1.28 GiB"))]
    assert s.other_processes_bytes == parse_bytes("618.00 MiB") + parse_bytes("1.28 GiB")
    assert s.non_pytorch_in_process == s.process_used - s.reserved


def test_this_process_listed_under_its_host_pid_is_recognised():
    # In a container NVML reports the host pid, so torch prints this process as "Process N".
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity "
           "of 47.53 GiB of which 16.88 MiB is free. Process 3652628 has 47.51 GiB memory in use. Of the allocated "
           "memory 47.14 GiB is allocated by PyTorch, and 57.79 MiB is reserved by PyTorch but unallocated.")
    s = MemoryState.from_oom(parse_oom(msg))
    assert s.process_used == parse_bytes("47.51 GiB")
    assert s.processes == ()
    assert "other_processes" not in by_key(explain(parse_oom(msg), s, env={}, modules=()))


def test_merged_fills_unknowns_and_keeps_known_numbers():
    oom_state = MemoryState.from_oom(parse_oom(SEED))
    probe = MemoryState("cuda:0", total=1, allocated=2, used=3, process_used=15 * GiB,
                        processes=((4242, 512 * MiB, "python3"),), source="probe")
    m = oom_state.merged(probe)
    assert (m.total, m.allocated, m.used) == (oom_state.total, oom_state.allocated, oom_state.used)
    assert m.process_used == 15 * GiB and m.processes == probe.processes
    assert m.source == "OOM message + probe"
    assert oom_state.merged(MemoryState("cuda:0")) is oom_state


def test_host_state_reads_this_machine():
    h = host_state()
    assert h.device == "cpu" and h.source == "probe"
    if sys.platform.startswith("linux"):
        assert h.total > h.used > 0 and h.process_used > 0 and h.free > 0


# ================================================================================ the seed scenario


def test_seed_scenario_ranks_optimizer_state_and_graphs_kept_on_top():
    seed = Seed()
    findings = seed.explain()
    assert_well_formed(findings, SEED_SOURCE)
    keys = [f.key for f in findings]
    assert {"optimizer_state", "graphs_kept"} <= set(keys[:3]), keys
    cats = seed.who.categories

    opt = by_key(findings)["optimizer_state"]
    assert opt.title == f"Adam keeps two buffers the size of the weights: {format_bytes(cats['optimizer_state'])}"
    assert format_bytes(cats["parameters"]) in opt.detail
    assert "2.0x" in opt.detail  # exp_avg + exp_avg_sq: twice the weights
    assert "_functional.py adam()" in opt.detail and "2.32 GiB" in opt.detail
    assert opt.confidence == "certain"
    assert opt.frees == cats["optimizer_state"] * 3 // 4  # 8-bit Adam: 2 of 8 bytes per weight
    assert "Adam8bit(model.parameters(), lr=learning_rate)" in opt.snippet  # the user's own arguments
    assert "foreach=False" in opt.snippet and "foreach" in opt.fix

    graphs = by_key(findings)["graphs_kept"]
    assert graphs.confidence == "certain"
    assert format_bytes(cats["retained_graphs"]) in graphs.title
    assert "output + loss (shared graph)" in graphs.detail
    own = sum(t.untyped_storage().nbytes() for t in (seed.ns["output"], seed.ns["loss"]))
    assert graphs.frees == cats["retained_graphs"] + own
    assert "del output, loss" in graphs.snippet


def test_seed_scenario_also_finds_fragmentation_from_the_message_numbers():
    frag = by_key(Seed().explain())["fragmentation"]
    # 14.26 GiB reserved - 11.91 GiB allocated = 2.35 GiB cached, more than the 2.32 GiB request.
    assert frag.title == "Fragmentation: 2.35 GiB reserved but unallocated"
    assert "2.32 GiB" in frag.detail and frag.frees == parse_bytes("14.26 GiB") - parse_bytes("11.91 GiB")
    assert 'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"' in frag.snippet


def test_gradients_needed_by_the_step_are_not_blamed():
    assert "gradients" not in by_key(Seed().explain())


# ================================================================================ each finding


def test_request_larger_than_the_device_comes_first():
    msg = V5.format(req="20.00 GiB", total="15.78 GiB", free="10.00 GiB", procs="", alloc="4.00 GiB",
                    unalloc="1.50 GiB")
    seed = Seed()
    oom = parse_oom(msg)
    findings = explain(oom, MemoryState.from_oom(oom), seed.who, traceback_frames=SEED_FRAMES, env={}, modules=())
    assert_well_formed(findings)
    first = findings[0]
    assert first.key == "request_exceeds_device" and first.confidence == "certain"
    assert "20.00 GiB" in first.title and "15.78 GiB" in first.title
    assert "chunk(" in first.snippet


def test_request_larger_than_the_memory_fraction_cap():
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 5.00 GiB. GPU 0 has a total capacity of "
           "15.78 GiB of which 9.00 GiB is free. Including non-PyTorch memory, this process has 6.00 GiB memory in "
           "use. 4.00 GiB allowed; Of the allocated memory 3.00 GiB is allocated by PyTorch, and 1.00 GiB is "
           "reserved by PyTorch but unallocated.")
    oom = parse_oom(msg)
    assert oom.allowed == 4 * GiB
    first = explain(oom, MemoryState.from_oom(oom), env={}, modules=())[0]
    assert first.key == "request_exceeds_device"
    assert "set_per_process_memory_fraction" in first.title and "4.00 GiB" in first.title


def test_fragmentation_depends_on_the_environment():
    oom = parse_oom(SEED)
    state = MemoryState.from_oom(oom)
    plain = by_key(explain(oom, state, env={}, modules=()))["fragmentation"]
    assert "expandable_segments:True" in plain.fix
    on = by_key(explain(oom, state, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, modules=()))
    assert "empty_cache" in on["fragmentation"].fix and "os.environ" not in on["fragmentation"].snippet
    other = by_key(explain(oom, state, env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, modules=()))
    assert '"max_split_size_mb:128,expandable_segments:True"' in other["fragmentation"].snippet
    asynchronous = explain(oom, state, env={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, modules=())
    assert "fragmentation" not in by_key(asynchronous)


def test_no_fragmentation_when_little_is_cached():
    msg = V5.format(req="3.31 GiB", total="128.00 GiB", free="780.24 MiB", procs="", alloc="57.70 GiB",
                    unalloc="75.82 MiB")
    oom = parse_oom(msg)
    assert "fragmentation" not in by_key(explain(oom, MemoryState.from_oom(oom), env={}, modules=()))


def test_other_processes_are_named_with_their_sizes():
    sample = next(d for d in load_samples() if "procinfo=this+other2" in d["variant"])
    oom = parse_oom(sample["message"])
    # NVML's process names, as a probe would add them, merged into what the message says.
    nvml = MemoryState("cuda:0", processes=((3893521, parse_bytes("618.00 MiB"), "python3 (other kernel)"),
                                            (1493972, parse_bytes("1.28 GiB"), "ollama")), source="NVML")
    state = MemoryState.from_oom(oom).merged(nvml)
    f = by_key(explain(oom, state, env={}, modules=()))["other_processes"]
    assert "2 other processes hold 1.88 GiB on cuda:0" == f.title
    assert "PID 3893521 (python3 (other kernel)) 618.00 MiB" in f.detail and "PID 1493972 (ollama) 1.28 GiB" in f.detail
    assert "!kill 3893521" in f.snippet and "nvidia-smi" in f.snippet
    assert "host PIDs" in f.detail  # the containers caveat
    assert f.frees == parse_bytes("618.00 MiB") + parse_bytes("1.28 GiB")


def test_no_other_processes_without_evidence():
    assert "other_processes" not in by_key(Seed().explain())


def test_cuda_context_and_libraries_with_jax_imported():
    msg = V5.format(req="1.00 GiB", total="15.78 GiB", free="200.00 MiB",
                    procs="Including non-PyTorch memory, this process has 15.58 GiB memory in use. ",
                    alloc="3.00 GiB", unalloc="500.00 MiB")
    oom = parse_oom(msg)
    f = by_key(explain(oom, MemoryState.from_oom(oom), env={}, modules=("jax", "torch")))["cuda_context_and_libraries"]
    inside = parse_bytes("15.58 GiB") - parse_bytes("3.00 GiB") - parse_bytes("500.00 MiB")
    assert f.title.startswith(f"{format_bytes(inside)} of this process's cuda:0 memory")
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" in f.snippet and "jax" in f.detail
    small = V5.format(req="1.00 GiB", total="15.78 GiB", free="200.00 MiB",
                      procs="Including non-PyTorch memory, this process has 12.00 GiB memory in use. ",
                      alloc="11.00 GiB", unalloc="600.00 MiB")
    oom = parse_oom(small)
    assert "cuda_context_and_libraries" not in by_key(explain(oom, MemoryState.from_oom(oom), env={}, modules=()))


def test_checkpoint_loaded_without_map_location():
    source = 'ckpt = torch.load("runs/best.pt")\nmodel.load_state_dict(ckpt["model_state_dict"])\n'
    f = by_key(Seed().explain(failing_source=source))["checkpoint_on_gpu"]
    assert 'torch.load("runs/best.pt")' in f.detail
    assert 'ckpt = torch.load("runs/best.pt", map_location="cpu")' in f.snippet and "del ckpt" in f.snippet
    with_map = 'ckpt = torch.load("runs/best.pt", map_location="cpu")\n'
    assert "checkpoint_on_gpu" not in by_key(Seed().explain(failing_source=with_map))


def test_checkpoint_dict_still_held_is_measured():
    model = nn.Linear(512, 512)
    checkpoint = {"model_state_dict": {k: v.clone() for k, v in model.state_dict().items()}, "epoch": 3}
    model.load_state_dict(checkpoint["model_state_dict"])
    report = who({"model": model, "checkpoint": checkpoint})
    held = sum(t.untyped_storage().nbytes() for t in checkpoint["model_state_dict"].values())
    msg = ("RuntimeError: [enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough memory: "
           "you tried to allocate 2147483648 bytes.")
    oom = parse_oom(msg)
    state = MemoryState.from_oom(oom).merged(host_state())
    f = by_key(explain(oom, state, report, env={}, modules=()))["checkpoint_on_gpu"]
    assert f.frees == held and format_bytes(held) in f.title
    assert "`checkpoint`" in f.detail and "del checkpoint" in f.snippet


def test_ipython_caches_are_named():
    seed = Seed(keep_graph=False)
    big = torch.zeros(512, 1024)
    report = who({**seed.ns, "Out": {7: big}, "_7": big})
    f = by_key(explain(seed.oom, seed.state, report, env={}, modules=()))["ipython_refs"]
    assert f.frees == big.untyped_storage().nbytes() and "2.00 MiB" in f.title
    assert "Out[7]" in f.detail and "%gpumem free" in f.snippet and "%reset -f out" in f.snippet


def test_cpu_oom_from_a_real_allocation():
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**60)
    oom = parse_oom(str(caught.value))
    assert oom.kind == "cpu" and oom.requested == 2**62
    state = MemoryState.from_oom(oom).merged(host_state())
    findings = explain(oom, state, failing_source="x = torch.empty(2**60)", env={}, modules=())
    assert_well_formed(findings, "x = torch.empty(2**60)")
    found = by_key(findings)
    assert "4294967296.00 GiB" in found["cpu_oom"].title
    assert "wrong number" in found["cpu_oom"].detail
    if state.total:  # RAM known (Linux): no amount of freeing helps
        assert findings[0].key == "request_exceeds_device"
        assert "the machine's RAM" in findings[0].title


def test_cpu_oom_names_broadcasting_and_float64():
    msg = ("RuntimeError: [enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: can't allocate memory: "
           "you tried to allocate 80000000000 bytes. Error code 12 (Cannot allocate memory)")
    source = "points = torch.rand(100000, 3, dtype=torch.float64)\nd = (points[:, None] - points[None, :]).norm(dim=-1)"
    oom = parse_oom(msg)
    f = by_key(explain(oom, MemoryState.from_oom(oom), failing_source=source, env={}, modules=()))["cpu_oom"]
    assert "points[:, None] - points[None, :]" in f.detail and "N×N" in f.detail
    assert "float64" in f.detail and f.frees == 40000000000


def test_activations_in_a_real_forward_pass_suggest_a_batch_size():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(256, 256)

        def forward(self, x):
            h = self.fc(x)
            return torch.empty(2**60) if x.shape[0] > 0 else h  # a real allocator failure inside forward

    model = Block()
    batch = torch.randn(4096, 256)
    kept = model.fc(batch).tanh() * 2  # an earlier output whose graph (tanh's 4 MiB result) is still alive
    try:
        model(batch)
    except RuntimeError as exc:
        frames = tuple((fs.filename, fs.name, fs.line or "") for fs in traceback.extract_tb(exc.__traceback__))
    report = who({"model": model, "batch": batch, "kept": kept}, allocator_total=None)
    oom = parse_oom(SMALL)
    source = "batch_size = 64\nout = model(batch)\nloss = out.sum()\nloss.backward()"
    f = by_key(explain(oom, MemoryState.from_oom(oom), report, failing_source=source, traceback_frames=frames,
                       env={}, modules=()))["activations"]
    acts = report.categories["retained_graphs"]
    assert acts > 0 and f.title == f"Activations of the forward pass: {format_bytes(acts)}"
    assert "test_diagnose.py forward()" in f.detail  # the real innermost frame
    assert f"frees about {format_bytes(acts // 2)}" in f.detail and "batch_size=64" in f.detail
    assert "torch.autocast" in f.snippet and "checkpoint(" in f.snippet
    assert f.frees == acts // 2


def test_activations_during_evaluation_suggest_inference_mode():
    seed = Seed(optimizer=False, step=False)
    frames = (("<ipython-input-3-abc>", "<module>", "output = model(input)"),
              ("/opt/conda/lib/python3.11/site-packages/torch/nn/modules/module.py", "_call_impl",
               "return forward_call(*args, **kwargs)"),
              ("/opt/conda/lib/python3.11/site-packages/torch/nn/modules/linear.py", "forward",
               "return F.linear(input, self.weight, self.bias)"))
    oom = parse_oom(SMALL)
    f = by_key(explain(oom, MemoryState.from_oom(oom), seed.who, traceback_frames=frames,
                       failing_source="model.eval()\noutput = model(input)", env={}, modules=()))["activations"]
    assert "inference_mode" in f.fix and "with torch.inference_mode():" in f.snippet
    assert "output = model(input)" in f.snippet and f.frees == seed.who.categories["retained_graphs"]


def test_gradients_held_outside_the_step():
    seed = Seed(optimizer=False, keep_graph=False)
    frames = (("<ipython-input-4-abc>", "<module>", "output = model(input)"),
              ("/x/torch/nn/modules/linear.py", "forward", "return F.linear(input, self.weight, self.bias)"))
    f = by_key(seed.explain(traceback_frames=frames, failing_source="output = model(input)"))["gradients"]
    grads = seed.who.categories["gradients"]
    assert f.frees == grads and format_bytes(grads) in f.title and "`model (grads)`" in f.detail
    assert "zero_grad(set_to_none=True)" in f.snippet
    source = "optimizer.zero_grad(set_to_none=False)\nloss = model(input).sum()\nloss.backward()\noptimizer.step()"
    g = by_key(Seed(keep_graph=False).explain(failing_source=source))["gradients"]
    assert "optimizer.zero_grad(set_to_none=False)" in g.detail


def test_graphs_accumulated_in_the_source():
    seed = Seed(keep_graph=False)
    source = "for x in loader:\n    loss = model(x).sum()\n    total_loss += loss\n"
    f = by_key(seed.explain(failing_source=source))["graphs_kept"]
    assert "`total_loss += loss`" in f.detail and "total_loss += loss.item()" in f.snippet
    assert f.confidence == "likely"
    clean = "for x in loader:\n    loss = model(x).sum()\n    total_loss += loss.item()\n    out += residual\n"
    assert "graphs_kept" not in by_key(seed.explain(failing_source=clean))


def test_earlier_cells_from_the_seed_checkpoints():
    # The seed's nvidia-smi readings (MiB) around each step, as if each step had been its own cell.
    steps = [(3, "model = model.to(device)", 2, 3769),
             (4, "optimizer = torch.optim.Adam(model.parameters())", 3769, 3769),
             (5, "output = model(input, comb)", 3847, 6725), (6, "loss.backward()", 6725, 9761),
             (7, "optimizer.step()", 9761, 16053)]
    records = [CellRecord(n, None, src, 0.0, 1.0,
                          devices=(DeviceRecord(0, "Tesla P100-PCIE-16GB", allocated_before=b * MiB,
                                                allocated_after=a * MiB, total=16160 * MiB),))
               for n, src, b, a in steps]
    seed = Seed()
    f = by_key(seed.explain(records=records))["earlier_cells"]
    assert "[7] `optimizer.step()` +6.14 GiB" in f.detail and "[3] `model = model.to(device)` +3.68 GiB" in f.detail
    assert f.frees == (6292 + 3767 + 3036) * MiB
    assert f.snippet.startswith("del model   #")  # [3] assigned model; [7] and [6] assigned nothing


def test_cublas_and_mps_messages():
    samples = load_samples()
    cublas = parse_oom(next(d for d in samples if d["variant"].startswith("cublas"))["message"])
    state = MemoryState("cuda:0", total=16 * GiB, used=15 * GiB + 900 * MiB, reserved=15 * GiB, allocated=12 * GiB)
    f = by_key(explain(cublas, MemoryState.from_oom(cublas).merged(state), env={}, modules=()))["cublas_cudnn"]
    assert "cuBLAS" in f.title and "15.88 GiB of 16.00 GiB in use" in f.title and f.frees == 3 * GiB
    assert "cudnn.benchmark = False" in f.snippet
    mps = parse_oom(next(d for d in samples if d["variant"].startswith("mps_v2"))["message"])
    m = by_key(explain(mps, MemoryState.from_oom(mps), env={}, modules=()))["mps"]
    assert "9.57 GiB allocated" in m.title and "27.20 GiB max allowed" in m.title
    assert "PYTORCH_MPS_HIGH_WATERMARK_RATIO" in m.snippet and "freeze" in m.fix


def test_no_findings_without_evidence():
    # No optimizer, no graph, no gradients, no checkpoint, no IPython caches, nothing else running.
    seed = Seed(optimizer=False, step=False, keep_graph=False)
    msg = V5.format(req="26.00 MiB", total="11.66 GiB", free="9.81 MiB",
                    procs="Including non-PyTorch memory, this process has 11.64 GiB memory in use. ",
                    alloc="10.80 GiB", unalloc="10.00 MiB")
    oom = parse_oom(msg)
    findings = explain(oom, MemoryState.from_oom(oom), seed.who, failing_source="y = x @ x.T", env={}, modules=())
    keys = set(by_key(findings))
    assert not keys & {"optimizer_state", "graphs_kept", "gradients", "checkpoint_on_gpu", "ipython_refs",
                       "fragmentation", "other_processes", "activations", "earlier_cells"}, keys
    assert keys == {"shortfall"}  # only the numbers themselves are left to report
    assert_well_formed(findings)


def test_every_sample_message_gets_a_finding_that_quotes_it():
    for sample in load_samples():
        oom = parse_oom(sample["message"])
        assert oom is not None, sample["variant"]
        findings = explain(oom, MemoryState.from_oom(oom), env={}, modules=())
        assert findings, sample["variant"]
        # A message without sizes can only be quoted: its first words count as the "code" cited.
        assert_well_formed(findings, oom.message[:30])
        sizes = [format_bytes(getattr(oom, n)) for n in SIZE_FIELDS if getattr(oom, n) is not None]
        texts = [f.title + " " + f.detail for f in findings]
        if sizes:
            assert any(size in text for size in sizes for text in texts), (sample["variant"], texts)
        else:
            assert any(oom.message[:30] in text for text in texts), (sample["variant"], texts)


def test_requested_argument_overrides_the_message():
    oom = parse_oom(SEED)
    findings = explain(oom, MemoryState.from_oom(oom), env={}, modules=(), requested=40 * GiB)
    assert findings[0].key == "request_exceeds_device" and "40.00 GiB" in findings[0].title


def test_state_without_a_message():
    state = MemoryState("cuda:0", total=16 * GiB, allocated=10 * GiB, reserved=14 * GiB, used=15 * GiB)
    findings = explain(None, state, env={}, modules=(), requested=2 * GiB)
    assert by_key(findings)["fragmentation"].frees == 4 * GiB


def test_core_module_imports_nothing_heavy():
    code = ("import sys, ipy_gpumem.oom.diagnose, ipy_gpumem.oom.panel\n"
            "print(sorted(m for m in ('IPython', 'torch', 'plotly', 'ipywidgets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
