"""Real models nobody here wrote (Hugging Face transformers built from configs, on the CPU): the census counts their outputs' cache objects, its roles match what backward and the optimizer really allocate and free, per line too, and the estimate matches a real step."""
import copy
import warnings
import weakref

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
nn = torch.nn

from ipy_gpumem.preflight.steps import run_steps  # noqa: E402
from ipy_gpumem.preflight.world import FakeWorld  # noqa: E402
from ipy_gpumem.tensors import census  # noqa: E402
from ipy_gpumem.tensors.torch_api import api  # noqa: E402
from ipy_gpumem.tensors.tracker import StorageTracker  # noqa: E402
from tests.conftest import EXACT_S, run  # noqa: E402


pytestmark = pytest.mark.filterwarnings("ignore")
transformers.utils.logging.set_verbosity_error()


def gpt2(checkpointing=False):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                     vocab_size=500, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=3)
    return transformers.BertForSequenceClassification(config)


def _take(ns):
    return census.take(ns, caches=False, user_modules=False, budget_s=EXACT_S)


def _unique(tensors):
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


class Live:
    """Independent truth: every storage the operators produce while active, alive as long as its weakref."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        refs = self.refs = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        old = refs.get(id(st))
                        if (old is None or old[0]() is None) and st.nbytes():
                            refs[id(st)] = (weakref.ref(st), st.nbytes())
                return out

        self.mode = Mode()

    def live(self):
        return sum(n for ref, n in self.refs.values() if ref() is not None)


@pytest.mark.slow
def test_a_model_outputs_cache_objects_are_counted_exactly():
    model = gpt2()
    with torch.no_grad():
        out = model(torch.randint(0, 500, (2, 32)), use_cache=True)
    cache = out.past_key_values
    tensors = [out.logits] + [t for layer in cache.layers for t in (layer.keys, layer.values)]
    snap = _take({"out": out})
    assert snap.complete and sum(snap.parts.values()) == _unique(tensors)
    assert snap.role_bytes("other_tensors", owner="out") == _unique(tensors)


CASES = {
    "gpt2, non-reentrant checkpointing, AdamW": lambda: (gpt2(checkpointing=True), "lm", None),
    "gpt2, bf16 autocast, clipping": lambda: (gpt2(), "lm", torch.bfloat16),
    "bert classifier, Adam": lambda: (bert(), "cls", None),
}


def _loss(model, kind, x, y, dtype):
    ctx = torch.autocast("cpu", dtype=dtype) if dtype else torch.autocast("cpu", enabled=False)
    with ctx:
        if kind == "lm":
            return model(x, labels=x).loss
        return model(x, labels=y).loss


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_roles_match_what_backward_and_the_optimizer_really_do(case):
    model, kind, dtype = CASES[case]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randint(0, 500, (4, 32)), torch.randint(0, 3, (4,))
    ns = {"model": model, "opt": opt, "x": x, "y": y}
    for step in (1, 2):
        live = Live()
        with live.mode:
            loss = _loss(model, kind, x, y, dtype)
        ns["loss"] = loss
        snap = _take(ns)
        assert snap.complete
        assert snap.role_bytes("parameters") == _unique(list(model.parameters()) + list(model.buffers()))
        before = live.live()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        freed = before - live.live()
        acts = snap.role_bytes("activations")
        assert freed > 0 and abs(acts - freed) <= 0.01 * freed, (case, step, acts, freed)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grads = _take(ns).role_bytes("gradients")
        assert grads == _unique([p.grad for p in model.parameters() if p.grad is not None])
        opt.step()
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        assert _take(ns).role_bytes("optimizer_state") == _unique(state)
        del loss
        ns.pop("loss")


def lm_step(model, opt, x):
    opt.zero_grad()
    loss = model(x, labels=x).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


@pytest.mark.slow
def test_the_estimate_of_a_real_models_step_matches_a_real_run():
    import ipy_gpumem

    model = gpt2(checkpointing=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 500, (4, 32))
    lm_step(model, opt, x)  # the notebook's usual state: after one real step
    est = ipy_gpumem.estimate(lm_step, model, opt, x, device="cpu")
    args = copy.deepcopy((model, opt, x))
    tracker = StorageTracker()
    world = FakeWorld(api(), None, [("args", args)])
    world.substitute()
    run_steps(lm_step, args, {}, tracker, world.existing, [args[0]], [args[1]])
    assert abs(est.peak_allocated - tracker.peak) <= 0.01 * tracker.peak, (est.peak_allocated, tracker.peak)


STEP = (
    "%%gpumem --lines -o rec\n"
    "loss = model(x, labels=x).loss\n"
    "optimizer.zero_grad()\n"
    "loss.backward()\n"
    "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
    "optimizer.step()\n"
)


@pytest.mark.slow
def test_per_line_roles_match_an_independent_per_line_truth(ip, gpumem, restore_user_ns):
    model = gpt2(checkpointing=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 500, (4, 32))
    ip.user_ns.update(torch=torch, model=model, optimizer=optimizer, x=x)
    params = _unique(list(model.parameters()))
    for run_number in (1, 2):
        # the truth, measured on a copy run the same way, line by line
        twin, twin_opt = copy.deepcopy((model, optimizer))
        live = Live()
        with live.mode:
            loss = twin(x, labels=x).loss
        before_backward = live.live()
        twin_opt.zero_grad()
        loss.backward()
        freed = before_backward - live.live()
        result, _cap = run(ip, STEP)
        assert result.success
        rec = ip.user_ns["rec"].to_dict()
        rows = {line["lineno"]: line for line in rec["lines"]}
        forward, zero, backward, step = rows[2]["roles"]["cpu"], rows[3]["roles"], rows[4]["roles"]["cpu"], rows[6]["roles"]
        assert abs(forward["activations"] - freed) <= 0.01 * freed, (forward, freed)
        assert backward["gradients"] == params and abs(-backward["activations"] - freed) <= 0.01 * freed
        if run_number == 1:
            assert zero == {} and step["cpu"]["optimizer_state"] == 2 * params + 4 * len(list(model.parameters()))
        else:
            assert zero["cpu"]["gradients"] == -params and step.get("cpu", {}).get("optimizer_state", 0) == 0
