"""Tests for ``ipy_gpumem.oom.rules``: each rule called on its own, and ``explain`` ranking them, on real messages and real tensors."""
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

from ipy_gpumem.core.devices import HOST, cuda  # noqa: E402
from ipy_gpumem.core.memory import DeviceMemory  # noqa: E402
from ipy_gpumem.core.records import CellRecord, DeviceRecord, HostRecord  # noqa: E402
from ipy_gpumem.core.units import GiB, MiB, format_bytes, parse_bytes  # noqa: E402
from ipy_gpumem.oom import rules  # noqa: E402
from ipy_gpumem.oom.parse import parse_oom  # noqa: E402
from ipy_gpumem.oom.rules import CONFIDENCES, FINDING_KEYS, MAX_FINDINGS, RULES, Finding, explain  # noqa: E402
from ipy_gpumem.oom.rules import device, runtimes, session, training  # noqa: E402
from ipy_gpumem.oom.rules.facts import Facts  # noqa: E402
from ipy_gpumem.attribution.who import WhoReport, who  # noqa: E402
from ipy_gpumem.attribution.holders import Holder  # noqa: E402
from tests.conftest import EXACT_S  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, above this room's folder

# The Colab P100 user's error (seeds/000 and 001), verbatim.
SEED = ("RuntimeError: CUDA out of memory. Tried to allocate 2.32 GiB (GPU 0; 15.78 GiB total capacity; "
        "11.91 GiB already allocated; 182.75 MiB free; 14.26 GiB reserved in total by PyTorch)")
# The seed's numbers scaled down to the CPU tensors of :class:`Seed` (who() counts 36 MiB of them), so
# that what each finding frees is set against a request of the same scale: 3 MiB asked with 2 MiB
# free (1 MiB short), 22 MiB reserved but unallocated.
SEED_CPU = ("RuntimeError: CUDA out of memory. Tried to allocate 3.00 MiB (GPU 0; 64.00 MiB total capacity; "
            "36.00 MiB already allocated; 2.00 MiB free; 58.00 MiB reserved in total by PyTorch)")
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
_SIZE_TEXT = re.compile(r"[0-9]+(?:\.[0-9]+)? (?:bytes|KiB|MiB|GiB|TiB|PiB)")


def load_samples():
    with open(os.path.join(HERE, "fixtures", "oom-samples.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def nbytes(*tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


class Seed:
    """The seed scenario on the CPU: a real MLP, Adam after one step, the next forward's output and loss kept.

    Its message is the seed's at the scale of these tensors (:data:`SEED_CPU`).
    """

    def __init__(self, optimizer: bool = True, step: bool = True, keep_graph: bool = True, message: str = SEED_CPU):
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
        self.who = who(self.ns, budget_s=EXACT_S)
        self.oom = parse_oom(message)
        self.memory = DeviceMemory.from_message(self.oom)

    def facts(self, **kw):
        kw.setdefault("frames", SEED_FRAMES)
        kw.setdefault("failing_source", SEED_SOURCE)
        kw.setdefault("env", {})
        kw.setdefault("modules", ())
        return Facts.build(self.oom, self.memory, self.who, **kw)

    def explain(self, **kw):
        kw.setdefault("frames", SEED_FRAMES)
        kw.setdefault("failing_source", SEED_SOURCE)
        kw.setdefault("env", {})
        kw.setdefault("modules", ())
        return explain(self.oom, self.memory, self.who, **kw)


def facts_for(message, memory=None, who_report=None, **kw):
    oom = parse_oom(message)
    kw.setdefault("env", {})
    kw.setdefault("modules", ())
    return Facts.build(oom, memory if memory is not None else DeviceMemory.from_message(oom), who_report, **kw)


def run_rules(facts):
    """Every rule called directly: a rule that raises fails the test (explain would skip it)."""
    return {f.key: f for f in (rule(facts) for rule in RULES) if f is not None}


def by_key(findings):
    return {f.key: f for f in findings}


def cites(finding: Finding, code: str = "") -> bool:
    """The finding quotes a size in torch's spelling, a ratio, or a line/name from the user's code."""
    text = finding.title + " " + finding.detail
    if _SIZE_TEXT.search(text) or re.search(r"[0-9,.]+x\b", text):
        return True
    return any(line.strip() and line.strip()[:40] in text for line in code.splitlines())


def assert_well_formed(findings, code=""):
    assert len(findings) <= MAX_FINDINGS
    ranks = [rules.rank(f) for f in findings]
    assert ranks == sorted(ranks), [(f.key, f.confidence, f.frees) for f in findings]
    for f in findings:
        assert f.key in FINDING_KEYS
        assert f.confidence in CONFIDENCES
        assert f.title and f.detail and f.fix.strip(), f
        assert "\n" not in f.title
        assert cites(f, code), f


# ================================================================================ the package


def test_every_rule_is_registered_once_and_documented():
    assert len(set(RULES)) == len(RULES) == 18
    for rule in RULES + (device.shortfall,):
        assert rule.__doc__, rule.__name__
        assert rule.__name__ in FINDING_KEYS
    for module in (rules, device, training, session, runtimes, rules.operation):
        assert module.__doc__ and len(module.__doc__.splitlines()[0]) < 140


def test_a_broken_rule_costs_only_its_own_finding(monkeypatch):
    def broken(facts):
        raise KeyError("boom")

    seen = []
    monkeypatch.setattr(rules, "RULES", (broken,) + RULES)
    findings = Seed().explain(on_error=lambda name, exc: seen.append((name, type(exc).__name__)))
    assert seen == [("broken", "KeyError")]
    assert {"optimizer_state", "graphs_kept"} <= set(by_key(findings))


# ================================================================================ the seed scenario


def test_seed_scenario_ranks_optimizer_state_and_graphs_kept_on_top():
    seed = Seed()
    findings = seed.explain()
    assert_well_formed(findings, SEED_SOURCE)
    keys = [f.key for f in findings]
    assert {"optimizer_state", "graphs_kept"} <= set(keys[:3]), keys
    assert by_key(findings) == {k: f for k, f in run_rules(seed.facts()).items() if k in keys}


def test_optimizer_state_in_adams_step():
    seed = Seed()
    cats = seed.who.categories
    opt = training.optimizer_state(seed.facts())
    assert opt.title == f"Adam keeps two buffers the size of the weights: {format_bytes(cats['optimizer_state'])}"
    assert format_bytes(cats["parameters"]) in opt.detail
    assert "2.0x" in opt.detail  # exp_avg + exp_avg_sq: twice the weights
    assert "_functional.py adam()" in opt.detail and "3.00 MiB" in opt.detail
    assert opt.confidence == "certain"
    assert opt.frees == cats["optimizer_state"] * 3 // 4  # 8-bit Adam: 2 of 8 bytes per weight
    assert "Adam8bit(model.parameters(), lr=learning_rate)" in opt.snippet  # the user's own arguments
    # The seed's step is the single-tensor one (_functional.adam): it already makes its temporaries one
    # parameter at a time, so foreach=False would change nothing here and is not offered.
    assert "foreach" not in opt.snippet and "foreach" not in opt.fix


def test_optimizer_advice_fits_the_step_that_failed():
    multi = ("/x/torch/optim/adam.py", "_multi_tensor_adam",
             "exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)")
    frames = SEED_FRAMES[:1] + (multi,)
    seed = Seed()
    # The foreach step: both less state and foreach=False bear on the request.
    both = training.optimizer_state(seed.facts(frames=frames))
    assert "foreach=False" in both.snippet and "Adam8bit" in both.snippet
    # The same step against a request far larger than the state: 8-bit Adam's 12 MiB cannot matter for
    # 2 GiB, so only the step's temporaries are offered (they are the request).
    big = V5.format(req="2.00 GiB", total="15.78 GiB", free="100.00 MiB", procs="", alloc="12.00 GiB",
                    unalloc="10.00 MiB")
    temps = training.optimizer_state(Facts.build(parse_oom(big), DeviceMemory.from_message(parse_oom(big)), seed.who,
                                                 frames=frames, failing_source=SEED_SOURCE, env={}, modules=()))
    assert "Adam8bit" not in temps.snippet and "foreach=False" in temps.snippet and temps.frees is None
    assert "too small to be the fix" in temps.fix
    # A single-tensor step and a state too small to matter: nothing this finding could offer holds.
    assert training.optimizer_state(Facts.build(parse_oom(big), DeviceMemory.from_message(parse_oom(big)), seed.who,
                                                frames=SEED_FRAMES, env={}, modules=())) is None


def test_graphs_kept_read_from_typed_holders():
    seed = Seed()
    cats = seed.who.categories
    graphs = training.graphs_kept(seed.facts())
    assert graphs.confidence == "certain"
    assert format_bytes(cats["retained_graphs"]) in graphs.title and "output, loss" in graphs.title
    assert "output + loss (shared graph)" in graphs.detail
    assert graphs.frees == cats["retained_graphs"] + nbytes(seed.ns["output"], seed.ns["loss"])
    assert "del output, loss" in graphs.snippet


def test_a_graph_that_keeps_a_rebound_model_is_found_with_what_it_frees():
    """The old model's parameters and gradients that the last forward's graph keeps after `model` was
    rebound are parameters and gradients (issue 29), not retained graphs: the finding still fires, and
    what it frees counts them."""
    torch.manual_seed(0)
    old = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))  # 8 MiB of weights
    opt = torch.optim.Adam(old.parameters())
    inputs = torch.randn(256, 1024)
    output = old(inputs)
    loss = output.pow(2).mean()
    loss.backward()
    opt.step()
    ns = {"model": nn.Linear(4, 4), "inputs": inputs, "output": output, "loss": loss}
    report = who(ns, budget_s=EXACT_S)
    params = nbytes(*old.parameters())
    assert report.categories["retained_graphs"] == 0
    assert report.categories["parameters"] >= params and report.categories["gradients"] == params
    f = training.graphs_kept(facts_for(SMALL, who_report=report, failing_source="output = model(inputs)"))
    assert f is not None and f.confidence == "certain"
    assert f"the parameters and gradients ({format_bytes(2 * params)}) of an earlier model" in f.detail
    assert f.frees == 2 * params + nbytes(output, loss) and "del output, loss" in f.snippet
    assert f"`output + loss (shared graph)` {format_bytes(2 * params)}" in f.detail  # one row per graph


def test_graphs_kept_by_ipython_are_not_deleted_by_name():
    # A graph only Out[3] keeps: %gpumem free clears it; `del Out` would break IPython.
    report = WhoReport(categories={"retained_graphs": 8 * MiB, "ipython_caches": 4 * MiB},
                       holders=(Holder("graph", "retained_graphs", HOST, 8 * MiB, ("Out",), "Out[3]"),
                                Holder("out_cache", "ipython_caches", HOST, 4 * MiB, ("Out",), "Out[3]")))
    f = training.graphs_kept(facts_for(SMALL, who_report=report))
    assert "del Out" not in f.snippet and "%gpumem free" in f.snippet
    assert f.title == "Graphs kept alive by IPython's output cache: 8.00 MiB"
    # A graph that only the last traceback's local `out` keeps.
    kept = Holder("graph", "retained_graphs", HOST, 8 * MiB, (), "out", frame="forward")
    g = training.graphs_kept(facts_for(SMALL, who_report=WhoReport({"retained_graphs": 8 * MiB}, (kept,))))
    assert g.title == "Graphs kept alive by the last traceback: 8.00 MiB" and "del " not in g.snippet


def test_seed_scenario_also_finds_fragmentation_from_the_message_numbers():
    frag = device.fragmentation(facts_for(SEED, frames=SEED_FRAMES))
    # 14.26 GiB reserved - 11.91 GiB allocated = 2.35 GiB cached, more than the 2.32 GiB request.
    assert frag.title == "Fragmentation: 2.35 GiB reserved but unallocated"
    assert "2.32 GiB" in frag.detail and frag.frees == parse_bytes("14.26 GiB") - parse_bytes("11.91 GiB")
    assert 'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"' in frag.snippet


def test_gradients_needed_by_the_step_are_not_blamed():
    assert training.gradients(Seed().facts()) is None


# ================================================================================ an impossible request


def test_request_larger_than_the_device_is_the_only_finding():
    # The seed's model, optimizer and kept graph are all there: none of it can make 20 GiB fit in 15.78 GiB.
    msg = V5.format(req="20.00 GiB", total="15.78 GiB", free="10.00 GiB", procs="", alloc="4.00 GiB",
                    unalloc="1.50 GiB")
    seed = Seed()
    oom = parse_oom(msg)
    memory = DeviceMemory.from_message(oom)
    every = run_rules(Facts.build(oom, memory, seed.who, frames=SEED_FRAMES, env={}, modules=()))
    assert {"fragmentation", "request_exceeds_device"} <= set(every)  # true, and 1.50 GiB matters for 10 GiB...
    assert "optimizer_state" not in every and "graphs_kept" not in every  # (a few MiB cannot)
    findings = explain(oom, memory, seed.who, frames=SEED_FRAMES, env={}, modules=())
    assert [f.key for f in findings] == ["request_exceeds_device"]  # ...but only one bears on the request
    first = findings[0]
    assert first.confidence == "certain"
    assert first.title == "No amount of freeing helps: the request alone is 1.3x all 15.78 GiB of cuda:0"
    assert "20.00 GiB" not in first.title + first.detail  # the headline states the request, once
    assert "chunk(" in first.snippet and "torch.cat" not in first.snippet  # the pieces are never put back
    assert "cannot exist on cuda:0" in first.fix


def test_request_larger_than_the_memory_fraction_cap():
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 5.00 GiB. GPU 0 has a total capacity of "
           "15.78 GiB of which 9.00 GiB is free. Including non-PyTorch memory, this process has 6.00 GiB memory in "
           "use. 4.00 GiB allowed; Of the allocated memory 3.00 GiB is allocated by PyTorch, and 1.00 GiB is "
           "reserved by PyTorch but unallocated.")
    facts = facts_for(msg)
    assert facts.oom.allowed == 4 * GiB
    f = device.request_exceeds_device(facts)
    assert "set_per_process_memory_fraction" in f.title and "4.00 GiB" in f.title
    # Below the device's total, raising the cap makes the whole tensor fit: it comes first.
    assert f.fix.startswith("Raise the cap") and "15.78 GiB" in f.fix and "torch.cat" not in f.snippet


def test_absurd_request_names_the_failing_line_and_its_clues():
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**60)
    frames = tuple((fs.filename, fs.name, fs.line or "") for fs in traceback.extract_tb(caught.value.__traceback__))
    oom = parse_oom(str(caught.value))
    memory = DeviceMemory.from_message(oom).merged(DeviceMemory(HOST, total=16 * GiB, used=4 * GiB))
    findings = explain(oom, memory, frames=frames, failing_source="x = torch.empty(2**60)", env={}, modules=())
    assert [f.key for f in findings] == ["request_exceeds_device"]  # cpu_oom would only say it again
    f = findings[0]
    assert f.title == "No amount of freeing helps: the request alone is 268,435,456x all 16.00 GiB of the machine's RAM"
    assert "bug in the shape arithmetic" in f.detail and "`torch.empty(2**60)`" in f.detail  # this test's real line
    assert f.snippet == ""  # nothing but a literal sizes that line: no placeholder code to paste
    assert_well_formed(findings)


def test_absurd_request_prints_the_failing_lines_inputs():
    msg = V5.format(req="2352.00 TiB", total="79.10 GiB", free="10.00 GiB", procs="", alloc="60.00 GiB",
                    unalloc="1.00 GiB")
    frames = (("/tmp/ipykernel_7/1.py", "<module>", "attn = q @ k.transpose(-1, -2) * scale  # (B, H, T, T)"),)
    f = device.request_exceeds_device(facts_for(msg, frames=frames))
    assert f.snippet.startswith("print([getattr(v, 'shape', v) for v in (q, k, scale,)])")
    assert f.fix.startswith("The size itself is wrong") and "print the shapes and values the failing line computes with" in f.fix
    assert "`attn = q @ k.transpose(-1, -2) * scale # (B, H, T, T)`" in f.detail


def test_moderate_request_on_the_host_suggests_chunks_and_names_float64():
    msg = ("RuntimeError: [enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: can't allocate memory: "
           "you tried to allocate 80000000000 bytes. Error code 12 (Cannot allocate memory)")
    source = "points = torch.rand(100000, 3, dtype=torch.float64)\nd = (points[:, None] - points[None, :]).norm(dim=-1)"
    memory = DeviceMemory.from_message(parse_oom(msg)).merged(DeviceMemory(HOST, total=32 * GiB, used=2 * GiB))
    f = device.request_exceeds_device(facts_for(msg, memory, failing_source=source))
    assert "2.3x all 32.00 GiB" in f.title and "x.chunk(6" in f.snippet
    assert "torch.cat" not in f.snippet and "total += out.sum()" in f.snippet and "torch.save(out" in f.snippet
    assert "The full result cannot exist in RAM" in f.fix and "never concatenating" in f.fix
    assert "N×N" in f.detail and "float64 takes twice" in f.detail


# ================================================================================ each finding


def test_fragmentation_depends_on_the_environment():
    plain = device.fragmentation(facts_for(SEED))
    assert "expandable_segments:True" in plain.fix
    on = device.fragmentation(facts_for(SEED, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}))
    assert "empty_cache" in on.fix and "os.environ" not in on.snippet
    other = device.fragmentation(facts_for(SEED, env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}))
    assert '"max_split_size_mb:128,expandable_segments:True"' in other.snippet
    assert device.fragmentation(facts_for(SEED, env={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})) is None


def test_no_fragmentation_when_little_is_cached():
    msg = V5.format(req="3.31 GiB", total="128.00 GiB", free="780.24 MiB", procs="", alloc="57.70 GiB",
                    unalloc="75.82 MiB")
    assert device.fragmentation(facts_for(msg)) is None


def _nvml_memory(message, *processes):
    """The message's memory, merged with NVML's process list as the probe would read it (a labelled fake)."""
    oom = parse_oom(message)
    return DeviceMemory.from_message(oom).merged(DeviceMemory(cuda(0), processes=tuple(processes), source="NVML"))


def test_other_processes_are_named_with_their_sizes():
    sample = next(d for d in load_samples() if "procinfo=this+other2" in d["variant"])
    memory = _nvml_memory(sample["message"], (3893521, parse_bytes("618.00 MiB"), "python3 (other kernel)"),
                          (1493972, parse_bytes("1.28 GiB"), "ollama"))
    f = device.other_processes(facts_for(sample["message"], memory))
    assert "2 other processes hold 1.88 GiB on cuda:0" == f.title
    assert "PID 3893521 (python3 (other kernel)) 618.00 MiB" in f.detail and "PID 1493972 (ollama) 1.28 GiB" in f.detail
    assert "!kill 3893521" in f.snippet and "nvidia-smi" in f.snippet
    assert "host PIDs" in f.detail  # the containers caveat
    assert f.frees == parse_bytes("618.00 MiB") + parse_bytes("1.28 GiB")


def test_a_process_that_may_be_this_kernel_is_never_offered_for_kill():
    # A container (labelled fake): NVML lists two python processes under host pids; one is this kernel.
    msg = V5.format(req="2.00 GiB", total="23.65 GiB", free="100.00 MiB",
                    procs="Process 4001 has 12.00 GiB memory in use. Process 4002 has 11.50 GiB memory in use. ",
                    alloc="10.50 GiB", unalloc="500.00 MiB")
    both = ((4001, 12 * GiB, None), (4002, parse_bytes("11.50 GiB"), None))
    memory = DeviceMemory(cuda(0), total=parse_bytes("23.65 GiB"), used=parse_bytes("23.55 GiB"),
                          allocated=parse_bytes("10.50 GiB"), reserved=11 * GiB, processes=both)
    f = device.other_processes(facts_for(msg, memory, maybe_own=(4001, 4002)))
    assert "kill" not in f.snippet and "never a PID that may be this kernel" in f.fix
    assert "PID 4001 12.00 GiB and PID 4002 11.50 GiB: one of these is this kernel" in f.detail
    assert f.title == "Other processes hold at least 11.50 GiB on cuda:0"  # all but the largest are others
    # With a third process that cannot be this kernel, that one (only) may be killed.
    memory = memory.merged(DeviceMemory(cuda(0), processes=((4003, 300 * MiB, "ollama"),)))
    g = device.other_processes(facts_for(msg, memory, maybe_own=(4001, 4002)))
    assert "!kill 4003" in g.snippet and "!kill 4001" not in g.snippet and "!kill 4002" not in g.snippet


def test_no_other_processes_without_evidence():
    assert device.other_processes(Seed().facts()) is None


def test_cuda_context_and_libraries_with_jax_imported():
    msg = V5.format(req="1.00 GiB", total="15.78 GiB", free="200.00 MiB",
                    procs="Including non-PyTorch memory, this process has 15.58 GiB memory in use. ",
                    alloc="3.00 GiB", unalloc="500.00 MiB")
    f = device.cuda_context_and_libraries(facts_for(msg, modules=("jax", "torch")))
    inside = parse_bytes("15.58 GiB") - parse_bytes("3.00 GiB") - parse_bytes("500.00 MiB")
    assert f.title.startswith(f"{format_bytes(inside)} of this process's cuda:0 memory")
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" in f.snippet and "jax" in f.detail
    small = V5.format(req="1.00 GiB", total="15.78 GiB", free="200.00 MiB",
                      procs="Including non-PyTorch memory, this process has 12.00 GiB memory in use. ",
                      alloc="11.00 GiB", unalloc="600.00 MiB")
    assert device.cuda_context_and_libraries(facts_for(small)) is None


def test_checkpoint_loaded_without_map_location():
    source = 'ckpt = torch.load("runs/best.pt")\nmodel.load_state_dict(ckpt["model_state_dict"])\n'
    f = session.checkpoint_on_gpu(Seed().facts(failing_source=source))
    assert 'torch.load("runs/best.pt")' in f.detail
    assert 'ckpt = torch.load("runs/best.pt", map_location="cpu")' in f.snippet and "del ckpt" in f.snippet
    assert "model.load_state_dict(ckpt['model_state_dict'])" in f.snippet  # the key the user's code uses
    with_map = 'ckpt = torch.load("runs/best.pt", map_location="cpu")\n'
    assert session.checkpoint_on_gpu(Seed().facts(failing_source=with_map)) is None


def test_checkpoint_dict_still_held_is_measured():
    model = nn.Linear(512, 512)
    checkpoint = {"model_state_dict": {k: v.clone() for k, v in model.state_dict().items()}, "epoch": 3}
    model.load_state_dict(checkpoint["model_state_dict"])
    held = nbytes(*checkpoint["model_state_dict"].values())
    report = who({"model": model, "checkpoint": checkpoint}, budget_s=EXACT_S)
    msg = ("RuntimeError: [enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough memory: "
           "you tried to allocate 2147483648 bytes.")
    f = session.checkpoint_on_gpu(facts_for(msg, who_report=report))
    assert f.frees == held and format_bytes(held) in f.title
    assert "`checkpoint`" in f.detail and "del checkpoint" in f.snippet


def test_ipython_caches_are_named():
    seed = Seed(keep_graph=False)
    big = torch.zeros(512, 1024)
    report = WhoReport(categories={**seed.who.categories, "ipython_caches": nbytes(big)},
                       holders=seed.who.holders + (Holder("out_cache", "ipython_caches", HOST, nbytes(big), ("Out",),
                                                          "Out[7]"),))
    f = session.ipython_refs(facts_for(SEED_CPU, who_report=report))
    assert f.frees == nbytes(big) and "2.00 MiB" in f.title
    assert "Out[7]" in f.detail and "%gpumem free" in f.snippet and "%reset -f out" in f.snippet


def test_cpu_oom_from_a_real_allocation_without_a_known_ram_size():
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**60)
    facts = facts_for(str(caught.value), failing_source="x = torch.empty(2**60)")
    assert facts.oom.kind == "cpu" and facts.requested == 2**62 and facts.memory.total is None
    f = runtimes.cpu_oom(facts)
    assert f.title == "`x = torch.empty(2**60)` asks for more RAM than any machine has"
    assert "wrong number" in f.detail
    assert device.request_exceeds_device(facts) is None  # no RAM size: no ratio to state


def test_cpu_oom_names_broadcasting_and_float64():
    msg = ("RuntimeError: [enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: can't allocate memory: "
           "you tried to allocate 80000000000 bytes. Error code 12 (Cannot allocate memory)")
    source = "points = torch.rand(100000, 3, dtype=torch.float64)\nd = (points[:, None] - points[None, :]).norm(dim=-1)"
    f = runtimes.cpu_oom(facts_for(msg, failing_source=source))
    assert f.title.startswith("A broadcast builds an N×N result: `d = (points[:, None] - points[None, :])")
    assert "points[:, None] - points[None, :]" in f.detail and "N×N" in f.detail
    assert "float64" in f.detail and f.frees == 40000000000


def _real_forward_failure():
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
    return model, batch, kept, frames


def test_activations_in_a_real_forward_pass_suggest_a_batch_size():
    model, batch, kept, frames = _real_forward_failure()
    report = who({"model": model, "batch": batch, "kept": kept}, budget_s=EXACT_S)
    source = "batch_size = 64\nout = model(batch)\nloss = out.sum()\nloss.backward()"
    f = training.activations(facts_for(SMALL, who_report=report, failing_source=source, frames=frames))
    acts = report.categories["retained_graphs"]
    assert acts > 0 and f.title == f"Activations of the forward pass: {format_bytes(acts)}"
    assert "test_oom_rules.py forward()" in f.detail  # the real innermost frame
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
    f = training.activations(facts_for(SMALL, who_report=seed.who, frames=frames,
                                       failing_source="model.eval()\noutput = model(input)"))
    assert "inference_mode" in f.fix and "with torch.inference_mode():" in f.snippet
    assert "output = model(input)" in f.snippet and f.frees == seed.who.categories["retained_graphs"]


def test_activations_without_who_read_the_failing_cells_peak():
    failing = CellRecord(5, None, "out = model(batch)", 0.0, 1.0, error="OutOfMemoryError",
                         devices=(DeviceRecord(0, allocated_before=10 * MiB, peak_allocated=50 * MiB),))
    frames = (("/x/torch/nn/modules/linear.py", "forward", "return F.linear(input, self.weight, self.bias)"),)
    f = training.activations(facts_for(SMALL, failing=failing, frames=frames))
    assert f.title == "Activations of the forward pass: 40.00 MiB"
    assert "how far allocated memory rose in the failing cell" in f.detail


def test_gradients_held_outside_the_step():
    seed = Seed(optimizer=False, keep_graph=False)
    frames = (("<ipython-input-4-abc>", "<module>", "output = model(input)"),
              ("/x/torch/nn/modules/linear.py", "forward", "return F.linear(input, self.weight, self.bias)"))
    f = training.gradients(seed.facts(frames=frames, failing_source="output = model(input)"))
    grads = seed.who.categories["gradients"]
    assert f.frees == grads and format_bytes(grads) in f.title and "`model (grads)`" in f.detail
    assert "zero_grad(set_to_none=True)" in f.snippet
    source = "optimizer.zero_grad(set_to_none=False)\nloss = model(input).sum()\nloss.backward()\noptimizer.step()"
    g = training.gradients(Seed(keep_graph=False).facts(failing_source=source))
    assert "optimizer.zero_grad(set_to_none=False)" in g.detail


def test_graphs_accumulated_in_the_source():
    seed = Seed(keep_graph=False)
    source = "for x in loader:\n    loss = model(x).sum()\n    total_loss += loss\n"
    f = training.graphs_kept(seed.facts(failing_source=source))
    assert "`total_loss += loss`" in f.detail and "total_loss += loss.item()" in f.snippet
    assert f.confidence == "likely"
    clean = "for x in loader:\n    loss = model(x).sum()\n    total_loss += loss.item()\n    out += residual\n"
    assert training.graphs_kept(seed.facts(failing_source=clean)) is None


def test_a_kept_graph_fix_never_calls_item_on_what_may_have_many_elements():
    """``.item()`` raises on a tensor of more than one element (issue 29): only a loss is a scalar, and not one
    computed with reduction="none"; everything else is detached."""
    seed = Seed()  # `output` (256 x 1024) holds its graph
    outputs = "outs = []\nfor x in loader:\n    output = model(x)\n    outs.append(output)\n"
    f = training.graphs_kept(seed.facts(failing_source=outputs))
    assert "outs.append(output.detach())" in f.snippet and ".item()" not in f.snippet
    seed = Seed(keep_graph=False)
    per_sample = ("for x, y in loader:\n    loss = F.cross_entropy(model(x), y, reduction=\"none\")\n"
                  "    losses.append(loss)\n")
    f = training.graphs_kept(seed.facts(failing_source=per_sample))
    assert "losses.append(loss.detach())" in f.snippet and ".item()" not in f.snippet


def _seed_steps():
    # The seed's nvidia-smi readings (MiB) around each step, as if each step had been its own cell.
    steps = [(3, "model = model.to(device)", 2, 3769),
             (4, "optimizer = torch.optim.Adam(model.parameters())", 3769, 3769),
             (5, "output = model(input, comb)", 3847, 6725), (6, "loss.backward()", 6725, 9761),
             (7, "optimizer.step()", 9761, 16053)]
    return [CellRecord(n, None, src, 0.0, 1.0,
                       devices=(DeviceRecord(0, "Tesla P100-PCIE-16GB", allocated_before=b * MiB,
                                             allocated_after=a * MiB, total=16160 * MiB),))
            for n, src, b, a in steps]


def _seed_who():
    """who() on the seed's P100 at its scale (typed holders, as the attribution room reports them)."""
    holders = (Holder("optimizer", "optimizer_state", cuda(0), 6292 * MiB, ("optimizer",), "optimizer"),
               Holder("module", "parameters", cuda(0), 3767 * MiB, ("model",), "model"),
               Holder("module_grads", "gradients", cuda(0), 3036 * MiB, ("model",), "model"))
    return WhoReport({"optimizer_state": 6292 * MiB, "parameters": 3767 * MiB, "gradients": 3036 * MiB}, holders,
                     device=cuda(0))


def test_earlier_cells_from_the_seed_checkpoints():
    oom = parse_oom(SEED)
    facts = Facts.build(oom, DeviceMemory.from_message(oom), _seed_who(), earlier=_seed_steps(), env={}, modules=())
    f = session.earlier_cells(facts)
    assert "[7] `optimizer.step()` +6.14 GiB" in f.detail and "[3] `model = model.to(device)` +3.68 GiB" in f.detail
    assert f.snippet.startswith("del model   #")  # [3] assigned model; [7] and [6] assigned nothing
    assert f.frees == (3767 + 3036) * MiB  # what `del model` frees: its parameters and gradients, not the cells' growth


def test_earlier_cells_are_offered_only_when_deleting_could_matter():
    # The seed's CPU-scale tensors against the seed's 2.14 GiB shortfall: `del model` would free 16 MiB.
    oom = parse_oom(SEED)
    facts = Facts.build(oom, DeviceMemory.from_message(oom), Seed().who, earlier=_seed_steps(), env={}, modules=())
    assert facts.shortfall > 2 * GiB and session.earlier_cells(facts) is None


def test_the_failing_cell_is_never_an_earlier_cell():
    *earlier, failing = _seed_steps()
    f = session.earlier_cells(Seed().facts(earlier=earlier, failing=failing))
    assert "[7]" not in f.detail and "[5] `output = model(input, comb)`" in f.detail


def test_cublas_and_mps_messages():
    samples = load_samples()
    cublas = parse_oom(next(d for d in samples if d["variant"].startswith("cublas"))["message"])
    memory = DeviceMemory.from_message(cublas).merged(
        DeviceMemory(cuda(0), total=16 * GiB, used=15 * GiB + 900 * MiB, reserved=15 * GiB, allocated=12 * GiB))
    f = runtimes.cublas_cudnn(Facts.build(cublas, memory, env={}, modules=()))
    assert "cuBLAS" in f.title and "15.88 GiB of 16.00 GiB in use" in f.title and f.frees == 3 * GiB
    # cuBLAS's own workspace variable, the cache the device could get back; cuDNN's autotuning is not cuBLAS's.
    assert "CUBLAS_WORKSPACE_CONFIG" in f.snippet and "empty_cache" in f.snippet and "cudnn" not in f.snippet
    mps = parse_oom(next(d for d in samples if d["variant"].startswith("mps_v2"))["message"])
    m = runtimes.mps(Facts.build(mps, DeviceMemory.from_message(mps), env={}, modules=()))
    assert "9.57 GiB allocated" in m.title and "27.20 GiB max allowed" in m.title
    assert "PYTORCH_MPS_HIGH_WATERMARK_RATIO" in m.snippet and "freeze" in m.fix


def test_no_findings_without_evidence_but_the_shortfall():
    # No optimizer, no graph, no gradients, no checkpoint, no IPython caches, nothing else running.
    seed = Seed(optimizer=False, step=False, keep_graph=False)
    msg = V5.format(req="26.00 MiB", total="11.66 GiB", free="9.81 MiB",
                    procs="Including non-PyTorch memory, this process has 11.64 GiB memory in use. ",
                    alloc="10.80 GiB", unalloc="10.00 MiB")
    facts = facts_for(msg, who_report=seed.who, failing_source="y = x @ x.T")
    assert run_rules(facts) == {}
    findings = explain(facts.oom, facts.memory, seed.who, failing_source="y = x @ x.T", env={}, modules=())
    assert [f.key for f in findings] == ["shortfall"]  # only the numbers themselves are left to report
    assert findings[0].title == "Free at least 16.19 MiB on cuda:0"  # not the headline again
    assert_well_formed(findings)


def test_every_sample_message_gets_well_formed_findings():
    for sample in load_samples():
        oom = parse_oom(sample["message"])
        assert oom is not None, sample["variant"]
        facts = Facts.build(oom, DeviceMemory.from_message(oom), env={}, modules=())
        run_rules(facts)  # no rule raises on any real message
        findings = explain(oom, DeviceMemory.from_message(oom), env={}, modules=())
        assert findings, sample["variant"]
        # A message without sizes can only be quoted: its first words count as the "code" cited.
        assert_well_formed(findings, oom.message[:30])


#: Findings whose ``frees`` is memory the user would release (not a smaller request or a batch).
_RELEASES = ("graphs_kept", "optimizer_state", "gradients", "fragmentation", "other_processes",
             "cuda_context_and_libraries", "checkpoint_on_gpu", "ipython_refs", "earlier_cells", "cublas_cudnn")


@pytest.mark.parametrize("scale", ["cpu", "seed"])
def test_no_fix_frees_too_little_to_matter_or_rebuilds_what_did_not_fit(scale):
    """Issue 17's class of advice that does not hold, over every real message: a change that frees
    memory frees a size that could matter for that request, and no snippet concatenates pieces back."""
    seed = Seed()
    who_report = seed.who if scale == "cpu" else _seed_who()
    source = SEED_SOURCE + 'ckpt = torch.load("best.pt")\noptimizer.zero_grad(set_to_none=False)\n'
    for sample in load_samples():
        oom = parse_oom(sample["message"])
        facts = Facts.build(oom, DeviceMemory.from_message(oom), who_report, earlier=_seed_steps(),
                            frames=SEED_FRAMES, failing_source=source, env={}, modules=())
        for f in run_rules(facts).values():
            assert "torch.cat(" not in f.snippet, (sample["variant"], f)
            if f.key in _RELEASES and f.frees is not None:
                assert facts.matters(f.frees), (sample["variant"], f.key, f.frees, facts.shortfall)


def test_checkpoint_advice_on_the_host_never_moves_it_to_the_host():
    model = nn.Linear(512, 512)
    ckpt = {"model_state_dict": {k: v.clone() for k, v in model.state_dict().items()}}
    report = who({"model": model, "ckpt": ckpt}, budget_s=EXACT_S)
    msg = ("RuntimeError: [enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough memory: "
           "you tried to allocate 1048576 bytes.")
    memory = DeviceMemory.from_message(parse_oom(msg)).merged(
        DeviceMemory(HOST, total=16 * GiB, used=16 * GiB - MiB // 2))
    f = session.checkpoint_on_gpu(facts_for(msg, memory, report, failing_source='ckpt = torch.load("best.pt")'))
    assert "map_location" not in f.snippet + f.fix and "del ckpt" in f.snippet and "mmap=True" in f.snippet


def test_fragmentation_too_small_for_the_request_says_so():
    # 3 GiB cached and 1 GiB free against a 5 GiB request: defragmenting cannot make it fit alone.
    msg = V5.format(req="5.00 GiB", total="15.78 GiB", free="1.00 GiB", procs="", alloc="10.00 GiB",
                    unalloc="3.00 GiB")
    f = device.fragmentation(facts_for(msg))
    assert f.confidence == "possible" and f"{format_bytes(GiB)} short of the request" in f.detail
    tiny = V5.format(req="50.00 GiB", total="79.10 GiB", free="1.00 GiB", procs="", alloc="60.00 GiB",
                     unalloc="600.00 MiB")
    assert device.fragmentation(facts_for(tiny)) is None  # 600 MiB cannot matter for 49 GiB


def test_other_processes_too_small_for_the_request_say_so_and_kill_the_one_that_helps():
    msg = V5.format(req="4.00 GiB", total="23.65 GiB", free="500.00 MiB", procs="", alloc="12.00 GiB",
                    unalloc="100.00 MiB")
    three = ((11, 1 * GiB, "a"), (12, 5 * GiB, "b"), (13, 8 * GiB, "c"))
    f = device.other_processes(facts_for(msg, _nvml_memory(msg, *three)))
    assert "!kill 12   # 5.00 GiB" in f.snippet  # the smallest that alone makes room for the 3.51 GiB short
    short = ((11, 1 * GiB, "a"),)
    g = device.other_processes(facts_for(msg, _nvml_memory(msg, *short)))
    assert g.confidence == "possible" and "not enough alone for the 3.51 GiB the request lacked" in g.detail


def test_cpu_oom_offers_only_changes_that_shrink_this_request():
    msg = ("RuntimeError: [enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: can't allocate memory: "
           "you tried to allocate 20000000000 bytes. Error code 12 (Cannot allocate memory)")
    memory = DeviceMemory.from_message(parse_oom(msg)).merged(DeviceMemory(HOST, total=32 * GiB, used=28 * GiB))
    plain = runtimes.cpu_oom(facts_for(msg, memory, failing_source="y = model(x)"))
    assert "float32" not in plain.snippet + plain.fix and "mmap" not in plain.snippet  # neither is in play
    assert "torch.cat" not in plain.snippet and "total += f(piece).sum()" in plain.snippet
    loaded = runtimes.cpu_oom(facts_for(msg, memory, failing_source="data = np.load('big.npy').astype('float64')"))
    assert 'np.load(path, mmap_mode="r")' in loaded.snippet and "float32" in loaded.snippet
    # float32 halves 18.63 GiB to 9.31 GiB: still more than the 4 GiB available, and the fix says so.
    assert "still 5.31 GiB more than was available: chunks are needed too" in loaded.fix


def test_requested_argument_overrides_the_message():
    oom = parse_oom(SEED)
    findings = explain(oom, DeviceMemory.from_message(oom), env={}, modules=(), requested=40 * GiB)
    assert [f.key for f in findings] == ["request_exceeds_device"] and "2.5x" in findings[0].title


def test_memory_without_a_message():
    memory = DeviceMemory(cuda(0), total=16 * GiB, allocated=10 * GiB, reserved=14 * GiB, used=15 * GiB)
    findings = explain(None, memory, env={}, modules=(), requested=2 * GiB)
    assert by_key(findings)["fragmentation"].frees == 4 * GiB


def test_host_memory_records_read_rss():
    records = [CellRecord(2, None, "a = torch.rand(8192, 8192)", 0.0, 1.0,
                          host=HostRecord(rss_before=500 * MiB, rss_after=756 * MiB))]
    memory = DeviceMemory(HOST, total=16 * GiB, used=15 * GiB, process_used=800 * MiB)
    msg = ("RuntimeError: [enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough memory: "
           "you tried to allocate 2147483648 bytes.")
    f = session.earlier_cells(facts_for(msg, memory, earlier=records))
    assert "[2] `a = torch.rand(8192, 8192)` +256.00 MiB" in f.detail and "host RSS" in f.title


@pytest.mark.slow
def test_rules_import_nothing_heavy():
    code = ("import sys, ipy_gpumem.oom.rules, ipy_gpumem.oom.analysis, ipy_gpumem.oom.panel\n"
            "print(sorted(m for m in ('IPython', 'torch', 'plotly', 'ipywidgets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


#: Shorthand that has leaked into advice before: a verb the reader cannot parse ("print what sizes
#: the failing line"), the rules' own names ("the shortfall"), slang ("the big op", "gc").
_SHORTHAND = re.compile(r"(?i)\bwhat sizes\b|\bsizes the\b|\bthe shortfall\b|\bbig op\b|\bgc\b(?!\.collect)")


def _every_fix():
    """Every rule's finding over every sample message and the failures built above (the absurd
    request on a GPU and on the host, a host failure of unknown size, a plain shortfall)."""
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**60)
    absurd_gpu = V5.format(req="2352.00 TiB", total="79.10 GiB", free="10.00 GiB", procs="", alloc="60.00 GiB",
                           unalloc="1.00 GiB")
    frames = (("/tmp/ipykernel_7/1.py", "<module>", "attn = q @ k.transpose(-1, -2) * scale  # (B, H, T, T)"),)
    messages = [(sample["message"], ()) for sample in load_samples()]
    messages += [(absurd_gpu, frames), (str(caught.value), frames), (SMALL, frames), ("MemoryError", frames),
                 ("RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed.", frames)]
    for message, frames in messages:
        oom = parse_oom(message)
        if oom is None:
            continue
        for memory in (DeviceMemory.from_message(oom), DeviceMemory(HOST, total=16 * GiB, used=15 * GiB)):
            facts = Facts.build(oom, memory, None, frames=frames, env={}, modules=())
            for f in list(run_rules(facts).values()) + [device.shortfall(facts)]:
                yield message, f


def test_every_fix_is_a_sentence_a_user_reads():
    """A fix is written for the user: whole sentences, none of the rules' shorthand, and the
    snippet's comments likewise."""
    seen = set()
    for message, f in _every_fix():
        seen.add(f.key)
        assert f.fix[:1].isupper() or f.fix[:1] in "`%", (f.key, f.fix)
        assert f.fix.rstrip().endswith("."), (f.key, f.fix)
        assert not _SHORTHAND.search(f.fix), (f.key, f.fix)
        comments = " ".join(line.split("#", 1)[1] for line in f.snippet.splitlines() if "#" in line)
        assert not _SHORTHAND.search(comments), (f.key, f.snippet)
    assert {"request_exceeds_device", "shortfall", "cpu_oom"} <= seen
