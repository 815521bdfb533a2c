"""The estimate against real CPU runs: a zoo of architectures and optimizers built in code, each step run for real under the exact storage tracker and on fake tensors; peaks must agree within 1%.

The zoo lives here so the benchmark (benchmarks/bench_estimate.py) measures the same models.
"""
import copy

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from ipy_gpumem.preflight.run import estimate  # noqa: E402
from ipy_gpumem.preflight.steps import run_steps  # noqa: E402
from ipy_gpumem.preflight.world import FakeWorld  # noqa: E402
from ipy_gpumem.tensors.torch_api import api  # noqa: E402
from ipy_gpumem.tensors.tracker import StorageTracker  # noqa: E402


# -- the zoo ---------------------------------------------------------------------------------
class TinyGPT(nn.Module):
    """Token and position embeddings, causal self-attention blocks, an LM head tied to the embedding."""

    def __init__(self, vocab=512, dim=64, heads=4, layers=2, context=64, sdpa=True):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, sdpa) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class Block(nn.Module):
    def __init__(self, dim, heads, sdpa=True):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # explicit attention: the t x t matrix is saved
            att = (q @ k.transpose(-2, -1)) / (c // self.heads) ** 0.5
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(-1)
            y = att @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class ConvNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


class Recurrent(nn.Module):
    def __init__(self, vocab=200, dim=48, hidden=96):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, num_layers=2, batch_first=True)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, idx):
        h, _ = self.lstm(self.emb(idx))
        h, _ = self.gru(h)
        return self.out(h)


class Checkpointed(nn.Module):
    def __init__(self, dim=128, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                    for _ in range(depth))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:
            x = x + checkpoint(layer, x, use_reentrant=False)
        return x


def lm_step(model, opt, idx, targets):
    opt.zero_grad(set_to_none=True)
    logits = model(idx)
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
    loss.backward()
    opt.step()
    return loss.item()


def cls_step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def reg_step(model, opt, x):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    print(f"loss {loss.item():.4f}")


def bf16_step(model, opt, idx, targets):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(idx)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
    loss.backward()
    opt.step()
    return loss


def zoo(scale=1):
    """(name, optimizer name, step, args) for each member; ``scale`` multiplies the batch."""
    g = torch.Generator().manual_seed(0)
    out = []

    m = TinyGPT()
    idx = torch.randint(0, 512, (4 * scale, 64), generator=g)
    out.append(("attention, tied weights (SDPA)", "AdamW", lm_step,
                (m, torch.optim.AdamW(m.parameters(), lr=1e-3), idx, torch.roll(idx, -1, 1))))
    m = TinyGPT(sdpa=False, layers=1)
    out.append(("attention, explicit softmax", "Adam(amsgrad)", lm_step,
                (m, torch.optim.Adam(m.parameters(), amsgrad=True), idx, torch.roll(idx, -1, 1))))
    m = Recurrent()
    idx2 = torch.randint(0, 200, (8 * scale, 40), generator=g)
    out.append(("LSTM + GRU", "RMSprop", lm_step,
                (m, torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.9), idx2, torch.roll(idx2, -1, 1))))
    m = ConvNet()
    out.append(("conv + BatchNorm", "SGD(momentum)", cls_step,
                (m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                 torch.randn(16 * scale, 3, 32, 32, generator=g), torch.randint(0, 10, (16 * scale,), generator=g))))
    m = Checkpointed()
    out.append(("gradient checkpointing", "Adam", reg_step,
                (m, torch.optim.Adam(m.parameters()), torch.randn(64 * scale, 128, generator=g))))
    m = TinyGPT(layers=1)
    out.append(("bf16 autocast transformer", "Adam", bf16_step,
                (m, torch.optim.Adam(m.parameters()), idx, torch.roll(idx, -1, 1))))
    m = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Dropout(0.1), nn.Linear(512, 256))
    out.append(("MLP + dropout", "Adagrad", reg_step,
                (m, torch.optim.Adagrad(m.parameters()), torch.randn(128 * scale, 256, generator=g))))
    return out


def real_peak(step, args):
    """The peak live storage bytes of two real calls on deep copies (the ground truth)."""
    args = copy.deepcopy(args)
    tracker = StorageTracker()
    world = FakeWorld(api(), None, [("args", args)])  # no fakes: what exists, with its roles
    world.substitute()
    modules = [a for a in args if isinstance(a, nn.Module)]
    optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
    run_steps(step, args, {}, tracker, world.existing, modules, optimizers)
    return tracker.peak


ZOO = zoo()


#: Each member with its marks: every one takes over a second, the MLP too (3.7 s in the fast set on two busy cores).
MEMBERS = [pytest.param(z, id=z[0] + " / " + z[1], marks=pytest.mark.slow) for z in ZOO]


@pytest.mark.parametrize("member", MEMBERS)
def test_estimate_matches_a_real_cpu_run_within_one_percent(member):
    name, _opt, step, args = member
    real = real_peak(step, args)
    est = estimate(step, *args, device="cpu")
    assert abs(est.peak_allocated - real) <= 0.01 * real, (name, est.peak_allocated, real)
    assert est.start_allocated > 0 and est.peak_allocated >= est.start_allocated


@pytest.mark.slow
def test_the_peak_holds_the_parameters_and_the_optimizer_state_of_the_first_call():
    _name, _opt, step, args = ZOO[0]
    est = estimate(step, *args, device="cpu")
    # the second call holds the optimizer state the first one created
    roles = est.roles["cpu"]
    params = sum(p.numel() * p.element_size() for p in args[0].parameters())
    assert roles["parameters"] >= params
    assert roles.get("optimizer_state", 0) >= 2 * params
