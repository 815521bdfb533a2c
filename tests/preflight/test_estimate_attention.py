"""Attention as the GPU runs it: the estimate picks scaled_dot_product_attention's kernel by torch's CUDA rules for the named card, counts that kernel's memory, and says which it assumed.

The rules are torch 2.13's (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``,
``sdp_utils_cpp.h``, ``attention.cpp``); the table below restates them case by case, each row naming
the check that decides it. The model tests build GPT-2 from a config (``transformers``, no
download), as ``tests/whole/test_real_models.py`` does, and estimate a training step at 8 x 1024 tokens,
with one layer (what a kernel keeps is per layer; a second layer doubled the time and proved nothing
more), the estimates the tests share made once.
"""
from __future__ import annotations

import contextlib
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ipy_gpumem  # noqa: E402
from ipy_gpumem.preflight.attention import CUDNN, EFFICIENT, FLASH, MATH, Settings, backward_scratch, choose  # noqa: E402
from ipy_gpumem.preflight.gpus import GPUS, resolve_gpu  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
transformers.utils.logging.set_verbosity_error()
SDPBackend = torch.nn.attention.SDPBackend
F = torch.nn.functional


def _qkv(dtype=torch.float16, head=64, q_len=16, kv_len=16, heads=2, grad=True):
    q = torch.empty(2, heads, q_len, head, dtype=dtype, requires_grad=grad)
    k = torch.empty(2, heads, kv_len, head, dtype=dtype, requires_grad=grad)
    v = torch.empty(2, heads, kv_len, head, dtype=dtype, requires_grad=grad)
    return q, k, v


F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
#: (card, dtype, head size, mask, causal with unequal lengths, dropout, expected kernel, the check that decides)
RULES = [
    ("T4", F16, 64, None, False, 0.1, EFFICIENT, "flash needs sm80+; memory-efficient takes fp16 on sm50+"),
    ("T4", F32, 64, None, False, 0.1, EFFICIENT, "memory-efficient takes fp32; no tensor cores for fp32: alignment 1"),
    ("T4", BF16, 64, None, False, 0.1, MATH, "below sm80 neither fused kernel takes bf16"),
    ("T4", F16, 100, None, False, 0.0, MATH, "fp16 on sm75 uses tensor cores: head size a multiple of 8"),
    ("T4", F16, 64, "float", False, 0.0, EFFICIENT, "memory-efficient takes an additive mask"),
    ("T4", F16, 64, "bool", False, 0.0, EFFICIENT, "a bool mask becomes an additive one"),
    ("A100", F16, 64, None, False, 0.1, FLASH, "flash first: sm80, fp16, no mask"),
    ("A100", BF16, 128, None, False, 0.0, FLASH, "flash takes bf16 on sm80"),
    ("A100", F32, 64, None, False, 0.0, EFFICIENT, "flash refuses fp32"),
    ("A100", F16, 64, "float", False, 0.0, EFFICIENT, "flash refuses any attn_mask"),
    ("A100", F32, 66, None, False, 0.0, MATH, "fp32 on sm80: head size a multiple of 4"),
    ("A100", F16, 100, None, False, 0.0, FLASH, "flash pads head sizes to 8 itself"),
    ("A100", F16, 64, None, True, 0.0, EFFICIENT, "flash refuses is_causal with different lengths"),
    ("A100", F16, 320, None, False, 0.0, EFFICIENT, "flash takes head sizes up to 256"),
    ("A10G", BF16, 256, None, False, 0.1, EFFICIENT, "sm86 training, head in (224, 256] with dropout"),
    ("A10G", BF16, 256, None, False, 0.0, FLASH, "... without dropout flash takes it"),
    ("K80", F32, 64, None, False, 0.0, MATH, "memory-efficient needs sm50+"),
    ("P100", F16, 60, None, False, 0.0, EFFICIENT, "sm60 has no tensor cores: alignment 1"),
    ("V100-16", F16, 60, None, False, 0.0, MATH, "sm70 fp16 on tensor cores: alignment 8"),
    ("H100", F16, 64, None, False, 0.1, FLASH, "flash on sm90"),
    ("A100", F64, 64, None, False, 0.0, MATH, "no fused kernel takes fp64"),
]


@pytest.mark.parametrize("card, dtype, head, mask, uneven, dropout, kernel, why", RULES,
                         ids=[f"{r[0]}-{str(r[1])[6:]}-d{r[2]}-{r[3]}{'-uneven' if r[4] else ''}-p{r[5]}"
                              for r in RULES])
def test_the_kernel_is_the_one_torchs_cuda_rules_pick(card, dtype, head, mask, uneven, dropout, kernel, why):
    q, k, v = _qkv(dtype, head, q_len=16, kv_len=32 if uneven else 16)
    attn_mask = None
    if mask == "float":
        attn_mask = torch.zeros(2, 1, q.size(2), k.size(2), dtype=dtype)
    elif mask == "bool":
        attn_mask = torch.ones(2, 1, q.size(2), k.size(2), dtype=torch.bool)
    sm = resolve_gpu(card).sm
    chosen, refused = choose(torch, sm, q, k, v, attn_mask, dropout, uneven, False, True, Settings())
    assert chosen == kernel, (why, refused)
    assert all(reason for reason in refused.values())  # every kernel tried first says why it refused


def test_the_users_switches_and_priority_order_steer_the_choice():
    q, k, v = _qkv(F16)
    sm = GPUS["A100-80"].sm
    assert choose(torch, sm, q, k, v, s=Settings(flash=False))[0] == EFFICIENT
    assert choose(torch, sm, q, k, v, s=Settings(flash=False, efficient=False))[0] == MATH
    first_cudnn = Settings(order=(CUDNN, FLASH, EFFICIENT, MATH))
    assert choose(torch, sm, q, k, v, s=first_cudnn)[0] == CUDNN
    assert choose(torch, sm, q, k, v, s=first_cudnn._replace(deterministic=True))[0] == FLASH
    with pytest.raises(RuntimeError, match="No available kernel"):
        choose(torch, GPUS["T4"].sm, q, k, v, s=Settings(efficient=False, math=False, cudnn=False))


# -- a GPT-2-small-like step ----------------------------------------------------------------------

BATCH, SEQ, HEADS = 8, 1024, 12
#: GPT-2's layers in the tests, and the calls of the step an estimate runs: a kernel keeps its tensors per layer and call.
LAYERS, CALLS = 1, 2  # (an attention row counts its calls in one step: LAYERS)


def gpt2(layers=LAYERS, embd=768, heads=HEADS, vocab=8000):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=embd, n_head=heads, vocab_size=vocab, n_positions=SEQ,
                                     attn_implementation="sdpa")  # dropouts as GPT-2's: 0.1
    return transformers.GPT2LMHeadModel(config)


def lm_step(model, opt, x, dtype):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
        loss = model(x, labels=x).loss
    loss.backward()
    opt.step()
    return loss.detach()


def _estimate(model, dtype, gpu="T4", backends=None, batch=BATCH):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, model.config.vocab_size, (batch, SEQ))
    ctx = torch.nn.attention.sdpa_kernel(backends) if backends else contextlib.nullcontext()
    with ctx:  # the user's own switch, copied into the estimate's sealed child
        return ipy_gpumem.estimate(lm_step, model, opt, x, dtype, gpu=gpu)


def _scores(est, nbytes):
    """How many allocations the size of a batch x heads x seq^2 tensor of ``nbytes`` an element the run made
    (GPT-2's fp32 MLP activations have the size of the one-byte ones: compare runs, not counts)."""
    size = BATCH * HEADS * SEQ * SEQ * nbytes
    return sum(1 for _k, n in est.events if n == size)


@pytest.fixture(scope="module")
def model():
    return gpt2()


@pytest.fixture(scope="module")
def estimated(model):
    """``estimated(dtype, gpu, backends)``: the module model's step estimated once for every test that asks."""
    made = {}

    def get(dtype, gpu="T4", backends=None):
        key = (dtype, gpu, tuple(backends or ()))
        if key not in made:
            made[key] = _estimate(model, dtype, gpu, backends)
        return made[key]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, None], ids=["fp16-autocast", "fp32"])
def test_on_a_t4_the_step_runs_memory_efficient_attention_and_keeps_no_scores(estimated, dtype):
    est = estimated(dtype)
    assert [(row["kernel"], row["calls"]) for row in est.attention] == [(EFFICIENT, LAYERS)]
    row = est.attention[0]
    assert (row["batch"], row["heads"], row["q_len"], row["head_dim"]) == (BATCH, HEADS, SEQ, 64)
    assert row["dtype"] == ("fp16" if dtype else "fp32") and row["dropout"] == pytest.approx(0.1) and row["causal"]
    assert "flash" in row["refused"] and "7.5" in row["refused"]["flash"]
    assert any("memory-efficient kernel" in n and "T4" in n for n in est.notes)
    assert est.to_dict()["attention"] == est.attention
    # The same step with the math kernel (the CPU's choice, or a user who asks for it) keeps, per layer
    # and call, the fp32 probabilities and CUDA's one-byte dropout mask.
    forced = estimated(dtype, backends=[SDPBackend.MATH])
    assert [r["kernel"] for r in forced.attention] == [MATH]
    assert _scores(est, 4) == _scores(est, 2) == 0
    assert _scores(forced, 4) >= LAYERS * CALLS and _scores(forced, 1) - _scores(est, 1) >= LAYERS * CALLS
    per_layer = BATCH * HEADS * SEQ * SEQ * (4 + 1)
    assert forced.peak_allocated - est.peak_allocated >= LAYERS * per_layer


@pytest.mark.slow
def test_bf16_on_a_t4_falls_back_to_the_math_kernel_and_keeps_the_scores(estimated):
    """Below compute capability 8.0 neither fused kernel takes bf16: the math path, which computes half
    precision in fp32 (its probabilities are fp32) and keeps CUDA's one-byte dropout mask."""
    est = estimated(torch.bfloat16)
    assert [(row["kernel"], row["calls"]) for row in est.attention] == [(MATH, LAYERS)]
    assert "bf16" in est.attention[0]["refused"]["memory-efficient"]
    assert any("math kernel" in n and "probabilities" in n for n in est.notes)
    on_a100 = estimated(torch.bfloat16, gpu="A100-80")
    assert [r["kernel"] for r in on_a100.attention] == [FLASH] and _scores(on_a100, 4) == 0
    # softmax's fp32 output and the dropout mask, per layer and call
    assert _scores(est, 4) >= LAYERS * CALLS and _scores(est, 1) - _scores(on_a100, 1) >= LAYERS * CALLS


@pytest.mark.slow
def test_a_head_size_the_fused_kernels_refuse_keeps_the_math_paths_cost():
    """Head size 100 in fp16 on a T4: flash needs sm80, memory-efficient needs a multiple of 8."""
    est = _estimate(gpt2(embd=1200), torch.float16)
    assert [r["kernel"] for r in est.attention] == [MATH]
    assert "multiple of 8" in est.attention[0]["refused"]["memory-efficient"]
    assert _scores(est, 4) >= LAYERS * CALLS


@pytest.mark.slow
def test_a_padding_mask_goes_to_the_memory_efficient_kernel_not_the_math_one(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 8000, (BATCH, SEQ))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[:, -16:] = 0  # padded ends: transformers passes an explicit mask

    def step(model, opt, x, mask):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, attention_mask=mask, labels=x).loss
        loss.backward()
        opt.step()

    for gpu in ("T4", "A100-80"):
        est = ipy_gpumem.estimate(step, model, opt, x, mask, gpu=gpu)
        assert [r["kernel"] for r in est.attention] == [EFFICIENT] and est.attention[0]["mask"] in ("bool", "float")
        assert _scores(est, 4) == _scores(est, 2) == 0
        if gpu == "A100-80":
            assert "attn_mask" in est.attention[0]["refused"]["flash"]


@pytest.mark.slow
def test_the_users_switch_is_read_in_the_estimate(model, estimated):
    flash = estimated(torch.bfloat16, gpu="A100-80")  # the bf16 test's: flash takes bf16 on sm80
    assert [r["kernel"] for r in flash.attention] == [FLASH]
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        est = _estimate(model, torch.bfloat16, gpu="A100-80")
    finally:
        torch.backends.cuda.enable_flash_sdp(True)
    assert [r["kernel"] for r in est.attention] == [EFFICIENT] and "switched off" in est.attention[0]["refused"]["flash"]


@pytest.mark.slow
def test_max_batch_size_is_no_longer_bounded_by_the_scores():
    """fp16 on a T4: the memory-efficient kernel's batch is well above what the math kernel's seq^2
    probabilities allow (the CPU's choice, which the estimate used to inherit). One layer and a 2,000-word
    vocabulary: with 8,000 words the head's logits weigh more beside the scores (74 against 50, where two
    layers gave 55 against 30; this gives 127 against 64 in half the time). Each search takes four estimates
    (the math kernel's took seven, one size at a time once its reserved bytes passed the card)."""
    model = gpt2(layers=1, vocab=2000)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 2000, (BATCH, SEQ))
    fused = ipy_gpumem.max_batch_size(lm_step, model, opt, x, torch.float16, gpu="T4")
    with torch.nn.attention.sdpa_kernel([SDPBackend.MATH]):
        math_only = ipy_gpumem.max_batch_size(lm_step, model, opt, x, torch.float16, gpu="T4")
    assert int(fused) >= 1.5 * int(math_only) and int(math_only) >= 1, (int(fused), int(math_only))
    assert [r["kernel"] for r in fused.estimate.attention] == [EFFICIENT]
    assert len(fused.tried) == len(math_only.tried) == 4, (sorted(fused.tried), sorted(math_only.tried))


# -- the fused kernels' backward scratch and CUDA's dropout ----------------------------------------

@pytest.mark.slow
def test_a_fused_backward_takes_its_scratch_for_the_call():
    """flash's ``dq_accum`` (fp32; queries rounded up to 128, head size to 32) and ``softmax_d``, taken
    after the gradients and given back before the next op: a transient pair in the events."""
    q, k, v = (torch.randn(4, 8, 300, 40, requires_grad=True) for _ in range(3))

    def step(q, k, v):
        with torch.autocast("cuda", dtype=torch.float16):
            out = F.scaled_dot_product_attention(q, k, v)
        out.float().sum().backward()
        q.grad = k.grad = v.grad = None

    est = ipy_gpumem.estimate(step, q, k, v, gpu="A100-80")
    assert [r["kernel"] for r in est.attention] == [FLASH]
    grad_q = torch.empty(4, 8, 300, 40)
    scratch = backward_scratch("_scaled_dot_product_flash_attention_backward", (grad_q,))
    assert scratch == 4 * 384 * 8 * 64 * 4 + 4 * 8 * 384 * 4
    pairs = [i for i in range(len(est.events) - 1)
             if est.events[i][1] == scratch and est.events[i + 1] == (est.events[i][0], -1)]
    assert len(pairs) == 2  # one backward per call of the step


@pytest.mark.slow
def test_cuda_dropout_keeps_a_one_byte_mask():
    """On CUDA ``dropout`` is the fused ``native_dropout`` (a bool mask for backward); the CPU keeps a
    mask of the input's dtype. The CUDA estimate keeps CUDA's."""
    x = torch.randn(512, 1024, requires_grad=True)

    def step(x):
        F.dropout(x * 2, 0.5, training=True).sum().backward()
        x.grad = None

    n = x.numel()
    on_cuda = [size for _k, size in ipy_gpumem.estimate(step, x, gpu="T4").events if size > 0]
    on_cpu = [size for _k, size in ipy_gpumem.estimate(step, x, device="cpu").events if size > 0]
    assert on_cuda.count(n) >= 2 and on_cpu.count(n) == 0          # the bool mask, once per call
    assert on_cpu.count(4 * n) - on_cuda.count(4 * n) == 2          # the CPU's fp32 mask, once per call


@pytest.mark.slow
def test_a_cuda_estimate_names_cudnns_convolution_workspaces():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3))
    x = torch.randn(4, 3, 32, 32)

    def step(model, x):
        model(x).sum().backward()

    est = ipy_gpumem.estimate(step, model, x, gpu="T4")
    assert any("cuDNN picks each one's algorithm" in n and "not counted" in n for n in est.notes)
    linear = torch.nn.Linear(32, 32)
    assert not any("cuDNN" in n for n in ipy_gpumem.estimate(step, linear, torch.randn(4, 32), gpu="T4").notes)
