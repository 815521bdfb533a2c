"""The estimate at small and large batches: its error against real runs across batch sizes and precisions, and the two things that made it right at batch 1 and under at larger ones.

1. The caching allocator does not settle after two steps. With larger tensors, the blocks a step
   frees and takes again land in a different layout of cached segments for a few more steps, and
   a step can find no free block large enough and reserve another segment. The estimate stopped
   after two calls; a table measured over a training run (nvidia-smi reads reserved bytes) sees
   the steady state. The estimate now repeats its last call in the allocator model until the peaks
   stop growing (``preflight/steady.py``); here a BERT fine-tune's steady state from two calls
   equals running the step five times, and exceeds two calls' reserved bytes.
2. A CPU kernel's scratch. x86 MKL's bfloat16 GEMM computes into an fp32 buffer of its output that
   no operator hands out: under CPU autocast bf16 an MLP step was exact at batch 1 and 18% under
   what the process allocated at 8x the batch (``preflight/cpulike.py``).

The truth for the CPU table is torch's profiler (``profile_memory=True``): every allocation the CPU
allocator makes, kernels' scratch included, which the storage tracker (what the estimate counts on
fakes) cannot see. Under is the dangerous side (the estimate says "fits" and the step fails), so
it is allowed 0.5%, plus, for a model with convolutions, 64 KiB per intra-op thread: oneDNN's
convolution scratchpad is not modelled; it does not grow with the batch, but with the threads
(measured here on the CNN below: 18 KiB with one thread, 45 KiB with 2, 99 KiB with 4, 170 KiB
with 8, in fp32; 6, 122, 134 and 374 KiB in bf16). Over is allowed 2%.
"""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
nn = torch.nn
F = torch.nn.functional

import ipy_gpumem  # noqa: E402
from ipy_gpumem.preflight.allocator import replay  # noqa: E402
from ipy_gpumem.preflight.cpulike import applies  # noqa: E402
from ipy_gpumem.preflight.cudalike import cuda_emulation  # noqa: E402
from ipy_gpumem.preflight.gpus import GPUS, cublas_workspace  # noqa: E402
from ipy_gpumem.preflight.steps import run_steps, to_cpu  # noqa: E402
from ipy_gpumem.preflight.steady import repeat  # noqa: E402
from ipy_gpumem.preflight.world import FakeWorld  # noqa: E402
from ipy_gpumem.tensors.torch_api import api  # noqa: E402
from ipy_gpumem.tensors.tracker import StorageTracker  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
transformers.utils.logging.set_verbosity_error()

#: Allowed error of the estimate against the profiler's peak, as a fraction, and the bytes a model with
#: convolutions may be under per intra-op thread (see the docstring).
UNDER, OVER, CONV_SCRATCH = 0.005, 0.02, 64 * 1024


# -- the models -------------------------------------------------------------------------------------

def bert_classifier():
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512,
                                     vocab_size=2000, max_position_embeddings=256, num_labels=3)
    return transformers.BertForSequenceClassification(config)  # dropouts 0.1, SDPA attention


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(0.1), nn.Linear(1024, 1024), nn.GELU(),
                         nn.Linear(1024, 10))


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16 * 16, 10))


MODELS = {  # name -> (model, inputs at batch size b)
    "BERT fine-tune (seq 128)": (bert_classifier, lambda b: (torch.randint(0, 2000, (b, 128)), torch.randint(0, 3, (b,)))),
    "MLP (512 rows a batch)": (mlp, lambda b: (torch.randn(512 * b, 256), torch.randint(0, 10, (512 * b,)))),
    "CNN (8 images a batch)": (cnn, lambda b: (torch.randn(8 * b, 3, 32, 32), torch.randint(0, 10, (8 * b,)))),
}


def train_step(model, opt, x, y, bf16):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(x)
        loss = F.cross_entropy(getattr(out, "logits", out), y)
    loss.backward()
    opt.step()
    return loss.detach()


def profiled_peak(step, args) -> int:
    """Every allocation of the CPU allocator over two calls of ``step`` on a copy of ``args``: the peak of
    live bytes, the parameters, buffers and inputs there before included."""
    from torch.profiler import ProfilerActivity, profile

    args = copy.deepcopy(args)
    model, x, y = args[0], args[2], args[3]
    start = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for t in [*model.parameters(), *model.buffers(), x, y]}.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = None
        for _ in range(2):
            out = step(*args)
        del out
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _t, n in events:
        live += n
        peak = max(peak, live)
    return start + peak


#: Each model and precision at 1x and 8x the batch, the two ends: a kernel's scratch that grows with the batch
#: is missed most at 8x (the bf16 GEMM's: nothing at 1x, 18% of the MLP's peak at 8x), one that does not is
#: largest beside the peak at 1x (oneDNN's convolution scratchpad). 2x and 4x were dropped for the suite's
#: time (issue 30); benchmarks/bench_estimate.py's batch table measures all four (RESULTS.md 8c).
CASES = [(name, precision, batch) for name in MODELS for precision in ("fp32", "bf16") for batch in (1, 8)]


@pytest.mark.slow
@pytest.mark.skipif(not applies(api()), reason="the bf16 GEMM scratch was measured on x86-64 builds with MKL")
@pytest.mark.parametrize("name, precision, batch", CASES, ids=[f"{n.split()[0]}-{p}-b{b}" for n, p, b in CASES])
def test_the_cpu_estimate_meets_what_the_process_allocated_at_1x_and_8x_the_batch(name, precision, batch):
    build, inputs = MODELS[name]
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    args = (model, opt, *inputs(batch), precision == "bf16")
    real = profiled_peak(train_step, args)
    est = ipy_gpumem.estimate(train_step, *args, device="cpu")
    error = (est.peak_allocated - real) / real
    convolutions = any(isinstance(m, nn.Conv2d) for m in model.modules())
    under = UNDER + (CONV_SCRATCH * torch.get_num_threads() / real if convolutions else 0)
    assert -under <= error <= OVER, (name, precision, batch, est.peak_allocated, real, f"{error:+.2%}")


# -- the caching allocator's steady state ------------------------------------------------------------

def bert_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=x, labels=y).loss
    loss.backward()
    opt.step()
    return loss.detach()


def fake_run(step, args, calls: int, gpu: str) -> StorageTracker:
    """What the estimate runs in its sealed child, here and with ``calls`` calls: the step on fakes, as on ``gpu``."""
    adapter = api()
    mode = adapter.fake_tensor_mode()(allow_non_fake_inputs=False)
    world = FakeWorld(adapter, mode, [("args", copy.deepcopy(args))])
    world.substitute()
    existing, world.existing = world.existing, []
    tracker = StorageTracker(fake=True, redirect=to_cpu)
    card = GPUS[gpu]
    with mode, cuda_emulation(adapter, tracker, cublas_workspace(card), world.optimizers, sm=card.sm):
        run_steps(step, world.root("args"), {}, tracker, existing, world.modules, world.optimizers, calls=calls)
    return tracker


def _bert_base_like(batch):
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=6, vocab_size=8000, max_position_embeddings=512, num_labels=2,
                                     attn_implementation="eager")
    model = transformers.BertForSequenceClassification(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return model, opt, torch.randint(0, 8000, (batch, 512)), torch.randint(0, 2, (batch,))


@pytest.fixture(scope="module")
def bert_base():
    """A 6-layer BERT-base fine-tune with AdamW, built once: its step's arguments at batch 2 (x 512 tokens)."""
    return _bert_base_like(2)


@pytest.fixture(scope="module")
def five_calls(bert_base):
    """The step run five times on fakes, as on an A100 (the truth the steady state is checked against)."""
    return fake_run(bert_step, bert_base, 5, "A100-80")


@pytest.fixture(scope="module")
def estimated(bert_base):
    """The estimate of the step (two calls, in its sealed copy) on an A100."""
    return ipy_gpumem.estimate(bert_step, *bert_base, gpu="A100-80")


@pytest.mark.slow
def test_the_steady_state_from_two_calls_is_what_five_calls_reach(five_calls, estimated):
    """A 6-layer BERT-base fine-tune at batch 2 x 512 (fp32, on an A100): two calls reserve 24 MiB less
    than the steady state, which the third call reaches. The copies of the last of two calls replayed
    through the allocator model give what running the step five times gives, to the byte. The two calls
    are the first two of the five-call run (what a run of two calls makes, event for event and mark for
    mark), and the estimate, which runs two calls of its own, lands on the same steady state."""
    five = five_calls
    marks = list(five.run.phase_marks)
    end = [i for i, phase, _step in marks if phase == "end"][-1]
    ran = replay(five.run.events[:end], series=False)
    third = next(i for i, _phase, step in marks if step == 3)  # where the third call starts
    two_events, two_marks = five.run.events[:third], [m for m in marks if m[2] <= 2] + [(third, "end", 2)]
    repeated = repeat(two_events, two_marks, limit=5)
    assert repeated is not None and repeated.calls == 5
    projected = replay(repeated.events, series=False)
    assert (projected.peak_allocated, projected.peak_reserved) == (ran.peak_allocated, ran.peak_reserved)
    two_calls = replay(two_events, series=False)
    assert ran.peak_reserved > two_calls.peak_reserved  # the growth the estimate missed
    assert estimated.peak_reserved == ran.peak_reserved and estimated.steady_calls == repeated.settled == 3
    assert estimated.steady_extra == ran.peak_reserved - two_calls.peak_reserved
    # The events kept for fits() are the steady state's: on a card with room for two calls' reserved bytes
    # only, the step fits because the allocator releases its cached segments and retries, as torch does
    # before it raises out-of-memory.
    assert replay(estimated.events, series=False).peak_reserved == estimated.peak_reserved
    tight = replay(estimated.events, capacity=two_calls.peak_reserved, series=False)
    assert tight.oom_at is None and tight.num_releases >= 1
    assert replay(two_events, capacity=two_calls.peak_reserved, series=False).num_releases == 0


@pytest.mark.slow
def test_the_estimate_reports_the_steady_state(bert_base, estimated):
    est = estimated
    assert est.steady_calls == 3 and est.steady_extra > 0
    assert est.to_dict()["steady_calls"] == 3 and est.to_dict()["steady_extra"] == est.steady_extra
    assert any("keep growing after two steps" in n and "by step 3" in n for n in est.notes)
    assert est.fits(est.total_needed).fits and not est.fits(est.total_needed - est.peak_reserved // 2).fits
    model, opt, x, y = bert_base
    small = ipy_gpumem.estimate(bert_step, model, opt, x[:1].clone(), y[:1].clone(), gpu="A100-80")
    assert small.steady_calls == 2 and small.steady_extra == 0  # batch 1: settled after two
    assert not any("after two steps" in n for n in small.notes)
