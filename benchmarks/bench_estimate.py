"""The pre-flight estimate: accuracy on the zoo against real CPU runs, and the time of a GPT-2-small estimate and of a max-batch search.

Accuracy: each member of tests/preflight/test_estimate_zoo.py runs twice for real on the CPU under the exact
storage tracker (the ground truth) and is estimated on fake tensors with ``device="cpu"``.
Speed: a GPT-2-small-sized model (124 M parameters, nanoGPT's layout, tied embedding and head)
with AdamW, batch 8 x 1024 tokens, estimated with ``device="cuda"`` (in its sealed copy of the
process, as always); a real CPU step at batch 1 beside the estimate of the same step, as a ratio;
then the largest batch that fits an A100-80 (the search starts at batch 8). Real GPU captures
(tests/fixtures/sil_captures.json: allocator snapshots recorded on a GPU by a public project)
against the estimate of the same step with ``device="cuda"``. The usual training loop: a
``DataLoader`` with two workers (read in the sealed copy as with none) beside the same loop without
workers, side by side, times and peaks. The max-batch searches of the tests, with the estimates each
took (in the order tried) and the CPU time of the sealed copies. The estimate at every batch size
(issue 29): its error against what the process really allocated (torch's profiler) by batch size and
precision on the models of tests/preflight/test_estimate_batch.py, with and without the CPU kernels' scratch; the
caching allocator's steady state against two calls for a BERT-base-like fine-tune on an A100; and GPT-2
small at 8 x 1024 on a T4 with the attention kernel the GPU picks against the math kernel (the CPU's
choice, which the estimate used to inherit). An estimate beside N unrelated tensors in its namespace,
every name faked (as before) against what the step reaches (now). Prints markdown tables.

    python benchmarks/bench_estimate.py [--skip-zoo] [--skip-gpt2] [--skip-captures] [--skip-loop] [--skip-max-batch]
        [--skip-batch] [--skip-steady] [--skip-attention] [--skip-namespace] [--only NAME,...]
        [--namespace-sizes 0,20000,100000] [--no-namespace-big]
        [--max-batch-against OLD/batch.py] [--max-batch-gpt2-small] [--gpu A100-80]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# the estimate's test modules (tests/preflight/), whose models and steps the tables measure
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "preflight"))


def zoo_table():
    from test_estimate_zoo import ZOO, real_peak

    from ipy_gpumem.preflight.run import estimate

    print("| architecture | optimizer | real peak (bytes) | estimated | error | estimate time |")
    print("|---|---|---:|---:|---:|---:|")
    worst = 0.0
    for name, opt, step, args in ZOO:
        real = real_peak(step, args)
        t0 = time.perf_counter()
        est = estimate(step, *args, device="cpu")
        took = time.perf_counter() - t0
        err = (est.peak_allocated - real) / real * 100
        worst = max(worst, abs(err))
        print(f"| {name} | {opt} | {real:,} | {est.peak_allocated:,} | {err:+.2f}% | {took:.2f} s |")
    print(f"\nworst error {worst:.2f}%\n")


def gpt2(batch=8, context=1024):
    import torch
    from torch import nn

    from test_estimate_zoo import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=50257, dim=768, heads=12, layers=12, context=context)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(0, 50257, (batch, context))
    return model, opt, idx, torch.roll(idx, -1, 1)


def gpt2_table(gpu):
    import ipy_gpumem
    from ipy_gpumem.core.units import format_bytes
    from test_estimate_zoo import lm_step

    t0 = time.perf_counter()
    model, opt, idx, targets = gpt2()
    built = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    est = ipy_gpumem.estimate(lm_step, model, opt, idx, targets, device="cuda", gpu=gpu)
    took = time.perf_counter() - t0
    print(f"GPT-2-small-sized: {params / 1e6:.1f} M parameters, batch 8 x 1024, AdamW (model built in {built:.1f} s)\n")
    print("| measure | value |")
    print("|---|---|")
    print(f"| estimate time | {took:.2f} s |")
    print(f"| peak allocated | {format_bytes(est.peak_allocated)} |")
    print(f"| peak reserved | {format_bytes(est.peak_reserved)} |")
    print(f"| total needed ({gpu} fixed costs) | {format_bytes(est.total_needed)} |")
    print(f"| peak in | {est.peak_phase}, call {est.peak_step} |")
    roles = ", ".join(f"{k} {format_bytes(v)}" for k, v in est.roles["cuda:0"].items())
    print(f"| at the peak | {roles} |")
    # The estimate beside the real thing, in this process: one real CPU step at batch 1 (a real step at
    # batch 8 needs ~20 GB of RAM on the CPU), and the estimate of that same step, isolation included.
    import copy

    small = copy.deepcopy((model, opt))
    one, one_targets = idx[:1].clone(), targets[:1].clone()
    t0 = time.perf_counter()
    lm_step(small[0], small[1], one, one_targets)
    real_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ipy_gpumem.estimate(lm_step, small[0], small[1], one, one_targets, device="cuda", gpu=gpu)
    est_s = time.perf_counter() - t0
    del small
    print(f"| real CPU step, batch 1 x 1024 | {real_s:.2f} s |")
    print(f"| its estimate (sealed copy included) | {est_s:.2f} s ({est_s / real_s:.2f}x the real step) |")
    t0, c0 = time.perf_counter(), children_cpu()
    best = ipy_gpumem.max_batch_size(lm_step, model, opt, idx, targets, gpu=gpu)
    took, cpu = time.perf_counter() - t0, children_cpu() - c0
    print(f"| max batch on {gpu} | {int(best)} ({len(best.tried)} estimates: {sorted(best.tried)}) |")
    print(f"| max-batch search time | {took:.2f} s ({cpu:.2f} s of CPU in its sealed copies) |\n")


def children_cpu() -> float:
    """CPU seconds of the reaped child processes (the sealed copies): steadier than wall time on a busy machine."""
    import resource

    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def max_batch_table(against=None, gpt2_small=False):
    """The searches of the tests (tests/preflight/test_estimate.py, test_estimate_attention.py): how many estimates each
    takes. With ``against`` (the path of another version of ipy_gpumem/preflight/batch.py, loaded beside this
    one), each search runs with both, one after the other, in this process."""
    import torch

    import ipy_gpumem
    from test_estimate import wide_mlp, wide_step
    from test_estimate_attention import BATCH, SEQ, gpt2 as small_gpt2, lm_step

    searches_with = {"this": ipy_gpumem.max_batch_size}
    if against:
        import importlib.util

        spec = importlib.util.spec_from_file_location("ipy_gpumem.preflight.batch_against", against)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        searches_with["against"] = module.max_batch_size
    model = small_gpt2(layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 8000, (BATCH, SEQ))
    wide, sgd = wide_mlp()
    searches = [
        ("GPT-2 (2 layers) 8 x 1024, fp16 autocast, T4", lambda search: search(
            lm_step, model, opt, x, torch.float16, gpu="T4")),
        ("the same, math attention only (reserved passes the card before it stops fitting)", lambda search: _math_only(
            lambda: search(lm_step, model, opt, x, torch.float16, gpu="T4"))),
        ("MLP 1024-4096-1024 from batch 8, 900 MiB (30 KiB a batch: 2 MiB steps)", lambda search: search(
            wide_step, wide, sgd, torch.randn(8, 1024), gpu=900 * 2 ** 20)),
        ("the same from batch 60000 (does not fit)", lambda search: search(
            wide_step, wide, sgd, torch.randn(60000, 1024), gpu=900 * 2 ** 20)),
    ]
    if gpt2_small:
        from test_estimate_zoo import lm_step as zoo_step

        big = gpt2()
        searches.append(("GPT-2-small-sized 8 x 1024, A100-80", lambda search: search(zoo_step, *big, gpu="A100-80")))
    print("| max_batch_size | search | answer | estimates | time | CPU of the sealed copies |")
    print("|---|---|---:|---|---:|---:|")
    for label, search in searches:
        for version, function in searches_with.items():
            t0, c0 = time.perf_counter(), children_cpu()
            best = search(function)
            took, cpu = time.perf_counter() - t0, children_cpu() - c0
            print(f"| {label} | {version} | {int(best)} | {len(best.tried)}: {', '.join(map(str, best.tried))} "
                  f"| {took:.2f} s | {cpu:.2f} s |", flush=True)
    print()


def _math_only(run):
    import torch

    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        return run()


def captures_table():
    import torch
    import test_estimate_cuda as t

    import ipy_gpumem

    data = t._fixture()
    print("| GPU capture | peak allocated, real | estimated | error | reserved, real | estimated | error |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    runs = []
    for precision in ("fp32", "bf16"):
        config = data["model"]
        model = t.TransformerLM(**config)
        ids = torch.randint(0, config["vocab_size"], (config["batch_size"], config["context_length"]))
        runs.append((f"transformer step, {precision}", data["captures"][precision],
                     lambda m=model, i=ids, p=precision: ipy_gpumem.estimate(t._benchmark_step, m, i, p,
                                                                           device="cuda", gpu="A100-80")))
    attention = data["captures"]["attention"]
    qkv = [torch.randn(*attention["shape"], requires_grad=True) for _ in range(3)]
    runs.append(("attention forward + backward", attention,
                 lambda: ipy_gpumem.estimate(t._attention_step, *qkv, device="cuda", gpu="A100-80")))
    for label, capture, run in runs:
        est = run()
        real_a, real_r = capture["peak_allocated"], capture["reserved"]
        print(f"| {label} | {real_a:,} | {est.peak_allocated:,} | {(est.peak_allocated - real_a) / real_a * 100:+.2f}% "
              f"| {real_r:,} | {est.peak_reserved:,} | {(est.peak_reserved - real_r) / real_r * 100:+.2f}% |")
    print()


def loop_table(repeat=3):
    """%%gpumem --estimate's path (estimate_cell) over a DataLoader loop, with and without workers."""
    import statistics

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from ipy_gpumem.preflight.cell import estimate_cell

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    ns = {"torch": torch, "nn": nn, "model": model, "opt": torch.optim.AdamW(model.parameters()),
          "ds": TensorDataset(torch.randn(2048, 256), torch.randint(0, 10, (2048,)))}
    ns["with_workers"] = DataLoader(ns["ds"], batch_size=64, shuffle=True, num_workers=2, persistent_workers=True)
    ns["without"] = DataLoader(ns["ds"], batch_size=64, shuffle=True)
    body = ("for x, y in {}:\n    loss = nn.functional.cross_entropy(model(x), y)\n    loss.backward()\n"
            "    opt.step()\n    opt.zero_grad()\n")
    times = {"without": [], "with_workers": []}
    peaks = {}
    for _ in range(repeat):
        for name in times:
            t0 = time.perf_counter()
            cell = estimate_cell(body.format(name), ns, gpu="T4")
            times[name].append(time.perf_counter() - t0)
            peaks[name] = cell.estimate.peak_allocated
    a, b = (statistics.median(times[n]) for n in ("without", "with_workers"))
    print("| a 32-batch training loop, %%gpumem --estimate | estimate time (median) | peak allocated |")
    print("|---|---:|---:|")
    print(f"| DataLoader, num_workers=0 | {a:.2f} s | {peaks['without']:,} |")
    print(f"| DataLoader, num_workers=2, persistent | {b:.2f} s ({b / a:.2f}x) | {peaks['with_workers']:,} |\n")


def batch_table():
    """The CPU estimate against torch's profiler (every allocation of the process) by batch size and
    precision; "without scratch" is the estimate before x86 MKL's bf16 GEMM buffer was counted."""
    import torch

    import ipy_gpumem
    from ipy_gpumem.preflight import cpulike
    from test_estimate_batch import MODELS, profiled_peak, train_step

    print("| model | precision | batch | allocated, real (profiler) | estimated | error | without scratch | error |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    worst_under = 0.0
    for name, (build, inputs) in MODELS.items():
        for precision in ("fp32", "bf16"):
            for batch in (1, 2, 4, 8):
                model = build()
                args = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), *inputs(batch), precision == "bf16")
                real = profiled_peak(train_step, args)
                est = ipy_gpumem.estimate(train_step, *args, device="cpu").peak_allocated
                applies, cpulike.applies = cpulike.applies, lambda api: False  # the sealed copy inherits it
                try:
                    before = ipy_gpumem.estimate(train_step, *args, device="cpu").peak_allocated
                finally:
                    cpulike.applies = applies
                err, err0 = (est - real) / real * 100, (before - real) / real * 100
                worst_under = min(worst_under, err)
                print(f"| {name} | {precision} | {batch} | {real:,} | {est:,} | {err:+.2f}% | {before:,} | {err0:+.2f}% |",
                      flush=True)
    print(f"\nworst under: {worst_under:+.2f}% (intra-op threads: {torch.get_num_threads()})\n")


def steady_table(gpu="A100-80"):
    """A BERT-base-like fine-tune (6 layers, 512 tokens) estimated for a GPU: two calls' reserved bytes
    against the steady state the allocator model reaches by repeating the last call."""
    import torch
    import transformers

    import ipy_gpumem
    from ipy_gpumem.core.units import format_bytes

    transformers.utils.logging.set_verbosity_error()
    print(f"| BERT-base-like, 6 layers x 512 tokens, AdamW, {gpu} | batch | reserved after 2 steps | steady state "
          "| growth | settled at step | estimate time |")
    print("|---|---:|---:|---:|---:|---:|---:|")

    def step(model, opt, x, y, half):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=half):
            loss = model(input_ids=x, labels=y).loss
        loss.backward()
        opt.step()
        return loss.detach()

    for half in (False, True):
        for batch in (1, 2, 4, 8):
            torch.manual_seed(0)
            config = transformers.BertConfig(num_hidden_layers=6, vocab_size=8000, max_position_embeddings=512,
                                             num_labels=2, attn_implementation="eager")
            model = transformers.BertForSequenceClassification(config)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
            x, y = torch.randint(0, 8000, (batch, 512)), torch.randint(0, 2, (batch,))
            t0 = time.perf_counter()
            est = ipy_gpumem.estimate(step, model, opt, x, y, half, gpu=gpu)
            took = time.perf_counter() - t0
            two = est.peak_reserved - est.steady_extra
            print(f"| {'fp16 autocast' if half else 'fp32'} | {batch} | {format_bytes(two)} | "
                  f"{format_bytes(est.peak_reserved)} | {est.steady_extra / two * 100:+.2f}% | {est.steady_calls} | "
                  f"{took:.1f} s |", flush=True)
    print()


def attention_table(gpu="T4"):
    """GPT-2 small (transformers, 124 M parameters, SDPA, dropout 0.1) at 8 x 1024 on a GPU: the kernel the
    GPU picks against the math kernel, the CPU's choice, which the estimate inherited before issue 29."""
    import torch
    import transformers

    import ipy_gpumem
    from ipy_gpumem.core.units import format_bytes

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(attn_implementation="sdpa"))
    x = torch.randint(0, 50257, (8, 1024))

    def step(model, opt, x, dtype):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
            loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        return loss.detach()

    print(f"| GPT-2 small, 8 x 1024, AdamW, {gpu} | kernel | peak allocated | activations at the peak | "
          "max batch | estimate time | search time |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, dtype in (("fp32", None), ("fp16 autocast", torch.float16), ("bf16 autocast", torch.bfloat16)):
        for forced in (False, True):
            ctx = torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]) if forced else None
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            if ctx is not None:
                ctx.__enter__()
            try:
                t0 = time.perf_counter()
                est = ipy_gpumem.estimate(step, model, opt, x, dtype, gpu=gpu)
                took = time.perf_counter() - t0
                t0 = time.perf_counter()
                best = ipy_gpumem.max_batch_size(step, model, opt, x, dtype, gpu=gpu)
                search = time.perf_counter() - t0
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
            kernels = ", ".join(sorted({r["kernel"] for r in est.attention}))
            acts = est.roles["cuda:0"].get("activations", 0)
            print(f"| {label}{' (math forced: the old estimate)' if forced else ''} | {kernels} | "
                  f"{format_bytes(est.peak_allocated)} | {format_bytes(acts)} | {int(best)} | {took:.1f} s | "
                  f"{search:.1f} s |", flush=True)
    print()


STEP_SOURCE = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
opt = torch.optim.AdamW(model.parameters())
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
def step():
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""
STEP_CELL = "opt.zero_grad()\nloss = nn.functional.cross_entropy(model(x), y)\nloss.backward()\nopt.step()\n"


def namespace_table(sizes=(0, 20_000, 100_000), big=True):
    """An estimate of one small MLP step beside N unrelated tensors in its namespace: faking every name (what
    the estimate did before it followed the step's reach; ``whole=True`` now) against faking what the step
    reaches, side by side in this process, through ``estimate()`` and the ``%%gpumem --estimate`` path."""
    import torch

    from ipy_gpumem.preflight.cell import cell_program, run_cell
    from ipy_gpumem.preflight.child import estimate_here
    from ipy_gpumem.preflight.run import answer_of, sealed

    def timed(ns, cell, whole):
        began = time.perf_counter()
        if cell:
            program = cell_program(STEP_CELL)
            value, notes = sealed(estimate_here, run_cell, (ns, program), {}, label="cuda:0", costs={}, gpu="T4",
                                  namespace=ns, program=program, whole=whole, timeout_s=600)
        else:
            value, notes = sealed(estimate_here, ns["step"], (), {}, label="cuda:0", costs={}, gpu="T4", namespace=ns,
                                  whole=whole, timeout_s=600)
        est, _marks, names = answer_of(value, notes)
        return time.perf_counter() - began, est, names

    print("| unrelated in the namespace | path | every name faked (before) | what the step reaches (now) | "
          "same figures | names faked (now) |")
    print("|---|---|---:|---:|---|---|")
    rows = [(n, 0) for n in sizes] + ([(200_000, 2_000_000)] if big else [])
    for tensors, dicts in rows:
        ns = {}
        exec(STEP_SOURCE, ns)  # noqa: S102
        ns["junk"] = [torch.zeros(4) for _ in range(tensors)]
        ns["records"] = [{"id": i} for i in range(dicts)]
        label = f"{tensors:,} tensors" + (f" + {dicts:,} dicts" if dicts else "")
        for cell in (False, True):
            path = "%%gpumem --estimate" if cell else "estimate()"
            now_s, now, names = timed(ns, cell, False)
            if dicts:  # before: past the 300 s an estimate used to be given
                before = "not run (past 300 s before)"
                same = "-"
            else:
                before_s, then, _names = timed(ns, cell, True)
                a, b = then.to_dict(), now.to_dict()
                a.pop("seconds"), b.pop("seconds")
                before, same = f"{before_s:.2f} s", "yes" if a == b else "NO"
            print(f"| {label} | {path} | {before} | {now_s:.2f} s | {same} | {', '.join(names)} |", flush=True)
        del ns
    print()


def main():
    parser = argparse.ArgumentParser()
    for name in ("zoo", "gpt2", "captures", "loop", "max_batch", "batch", "steady", "attention", "namespace"):
        parser.add_argument(f"--skip-{name.replace('_', '-')}", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated tables to run (zoo, captures, loop, max_batch, "
                                                   "gpt2, batch, steady, attention, namespace)")
    parser.add_argument("--namespace-sizes", default="0,20000,100000",
                        help="unrelated tensors in the namespace table, comma-separated")
    parser.add_argument("--no-namespace-big", action="store_true",
                        help="leave out the namespace table's 200k tensors + 2M dicts row")
    parser.add_argument("--max-batch-against", metavar="BATCH_PY",
                        help="another version of ipy_gpumem/preflight/batch.py, each search run with both")
    parser.add_argument("--max-batch-gpt2-small", action="store_true", help="the GPT-2-small search in that table too")
    parser.add_argument("--gpu", default="A100-80")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))

    def wanted(name):
        return (name in only) if only else not getattr(args, f"skip_{name}")

    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}\n")
    if wanted("zoo"):
        zoo_table()
    if wanted("captures"):
        captures_table()
    if wanted("loop"):
        loop_table()
    if wanted("max_batch"):
        max_batch_table(args.max_batch_against, args.max_batch_gpt2_small)
    if wanted("gpt2"):
        gpt2_table(args.gpu)
    if wanted("batch"):
        batch_table()
    if wanted("steady"):
        steady_table(args.gpu)
    if wanted("attention"):
        attention_table("T4")
    if wanted("namespace"):
        namespace_table(tuple(int(n) for n in args.namespace_sizes.split(",")), not args.no_namespace_big)
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")


if __name__ == "__main__":
    main()
