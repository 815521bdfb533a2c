"""Real closure-style training that runs out of host memory in forward, backward or the optimizer's update (issue 29).

Each scenario trains a small model on the CPU with a real framework (torch.optim.LBFGS, Lightning's
automatic and manual optimization, an accelerate loop) and makes one real allocation fail where it
says:

- ``forward``: the model's forward makes an expanded 256 MiB view contiguous;
- ``backward``: the forward reads 4 elements of an expanded 256 MiB view with ``index_select``, whose
  backward allocates a dense 256 MiB gradient inside autograd's engine (C++, no Python frame of ours);
- ``update``: the optimizer's own first allocation (Adam's 128 MiB ``exp_avg``, LBFGS's flat gradient).

Each is refused by the address-space limit (RLIMIT_AS), set just before to what the process maps plus
64 MiB, with most of the machine's RAM still free: a real allocator failure of a realistic size, where
the scenario says. Only in a subprocess (:func:`main`): the limit stays until the analysis has run, as
it would in the user's kernel.

:func:`run` returns the error, its traceback and the names a notebook would hold; :func:`analysed`
runs the OOM analysis and panel on them. ``python oom_closures.py SCENARIO...`` prints one JSON line
per scenario for the parent test.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import sys
import warnings

import torch
from torch import nn

#: 256 MiB of float32: more than the limit leaves, far less than the machine has.
BIG = 2 ** 26
#: What the address-space limit leaves above the process's mappings when the update must fail.
SLACK = 64 * 2 ** 20
FRAMEWORKS = ("lbfgs", "lightning_auto", "lightning_manual", "accelerate")
PHASES = ("forward", "backward", "update")


class Net(nn.Module):
    """A 128 MiB linear layer and a one-element parameter whose expanded view makes the failing allocation."""

    def __init__(self, fail: str):
        super().__init__()
        self.fc = nn.Linear(4096, 8192)
        self.src = nn.Parameter(torch.zeros(1))
        self.fail = fail

    def forward(self, x):
        h = self.fc(x)
        if self.fail == "forward":
            limit_address_space()
            h = h + self.src.expand(BIG, 1).contiguous()[:1].sum()  # a real 256 MiB allocation in forward
        if self.fail == "backward":
            idx = torch.zeros(4, dtype=torch.long)
            h = h + self.src.expand(BIG).index_select(0, idx).sum()  # backward allocates a dense 256 MiB gradient
            limit_address_space()
        return h


def limit_address_space(slack: int = SLACK) -> None:
    """RLIMIT_AS = what this process maps now + ``slack``: the next large allocation is refused."""
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (size + slack, hard))


def unlimit() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


def _data():
    return torch.randn(4, 4096)


def _lbfgs(fail, ns):
    model = Net(fail)
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=2)
    x = _data()
    ns.update(model=model, optimizer=optimizer, x=x)

    def closure():
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        if fail == "update":
            limit_address_space()  # LBFGS's own flat gradient (torch.cat of the grads) is refused
        return loss

    optimizer.step(closure)


def _lightning(fail, manual, ns):
    import lightning as L

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net(fail)
            self.automatic_optimization = not manual

        def training_step(self, batch, batch_idx):
            (x,) = batch
            if self.automatic_optimization:
                return self.net(x).pow(2).mean()
            optimizer = self.optimizers()

            def closure():
                loss = self.net(x).pow(2).mean()
                optimizer.zero_grad()
                self.manual_backward(loss)
                if fail == "update":
                    limit_address_space()
                return loss

            optimizer.step(closure=closure)

        def on_after_backward(self):
            if fail == "update" and self.automatic_optimization:
                limit_address_space()  # inside Lightning's closure, after backward: Adam's update is next

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4096)), batch_size=4)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    module = Module()
    ns.update(trainer=trainer, module=module)
    try:
        trainer.fit(module, data)
    finally:
        ns["optimizer"] = trainer.optimizers[0] if trainer.optimizers else None


def _accelerate(fail, ns):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = Net(fail)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = _data()
    ns.update(accelerator=accelerator, model=model, optimizer=optimizer, x=x)
    loss = model(x).pow(2).mean()
    accelerator.backward(loss)
    if fail == "update":
        limit_address_space()
    optimizer.step()  # accelerate's AcceleratedOptimizer, then Adam's own step
    optimizer.zero_grad()


def run(framework: str, fail: str):
    """``(error, namespace)``: the scenario's real out-of-memory error (None if it did not fail) and what a
    notebook would hold (the model, the optimizer, the trainer)."""
    warnings.filterwarnings("ignore")
    ns: dict = {}
    try:
        if framework == "lbfgs":
            _lbfgs(fail, ns)
        elif framework.startswith("lightning"):
            _lightning(fail, framework == "lightning_manual", ns)
        elif framework == "accelerate":
            _accelerate(fail, ns)
        else:
            raise ValueError(framework)
    except (RuntimeError, MemoryError) as exc:
        return exc, ns
    return None, ns


def analysed(exc, ns):
    """The OOM analysis and panel of a scenario's error, as the extension makes them."""
    from ipy_gpumem.oom.analysis import analyse
    from ipy_gpumem.oom.panel import oom_panel
    from ipy_gpumem.oom.parse import parse_oom

    oom = parse_oom(f"{type(exc).__name__}: {exc}")
    analysis = analyse(oom, None, namespace=ns, tb=exc.__traceback__, env={}, modules=())
    return analysis, oom_panel(analysis)


def summary(exc, ns) -> dict:
    """What the tests check, as JSON-able data."""
    if exc is None:
        return {"failed": False}
    from ipy_gpumem.oom.analysis import traceback_frames

    analysis, view = analysed(exc, ns)
    op = analysis.operation
    frames = traceback_frames(exc.__traceback__)
    return {"failed": True, "error": str(exc)[:300], "phase": analysis.phase,
            "optimizer_frames": [list(f[:2]) for f in frames if "optim" in f[0].replace("\\", "/").split("/")[-2:][0]],
            "phase_frame": list(analysis.phase_frame) if analysis.phase_frame else None,
            "findings": [[f.key, f.confidence, f.title] for f in analysis.findings],
            "operation": [op.key, op.what] if op is not None else None,
            "limit": [analysis.limit.name, analysis.limit.limit] if analysis.limit is not None else None,
            "text": view.text, "errors": list(analysis.errors)}


def main(argv) -> int:
    for name in argv:
        framework, fail = name.rsplit(":", 1)
        exc, ns = run(framework, fail)
        out = summary(exc, ns)  # under the limit still, as the user's kernel would be
        unlimit()
        out["scenario"] = name
        print("RESULT " + json.dumps(out), flush=True)
        del exc, ns
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main(sys.argv[1:]))
