"""The dispatch point (kernels/dispatch.py) of each op that has a Triton kernel: on CPU tensors unless
forced, the reference for the mLSTM and for attention the C kernel (kernels/bam_attention_cpu.py),
where it cannot build torch's fused attention for the calls it can compute, else the reference; on
CUDA tensors (the dispatch's device predicate standing in, the ops running on CPU) torch's SDPA,
FlexAttention or the kernel for attention, by the call's prior, masks and SSMax and whether dynamo
is on; the kernel when forced (under the interpreter here), the environment winning over the config,
each choice logged once per op (and reason), and bad modes refused in one line.

TRITON_INTERPRET=1 is set before the kernel modules are imported, as in tests/unit/test_kernels_triton.py.
"""

import logging
import math
import os

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

os.environ["TRITON_INTERPRET"] = "1"
from helpers.dispatch_spy import spy_on_ops  # noqa: E402

import megabam.kernels.bam_attention_cpu as attention_c_tiles  # noqa: E402
import megabam.kernels.bam_attention_sdpa as attention_sdpa  # noqa: E402
import megabam.kernels.bam_attention_torch as attention_torch  # noqa: E402
import megabam.kernels.bam_attention_triton as attention_kernel  # noqa: E402
import megabam.kernels.mlstm_triton as mlstm_kernel  # noqa: E402
from megabam.kernels import dispatch  # noqa: E402
from megabam.kernels.bam_attention import AttentionOptions  # noqa: E402


def _attention_call(backend: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 16, generator=g) for _ in range(3))
    options = AttentionOptions(
        theta_alpha=-torch.rand(3, generator=g),
        theta_beta=torch.tensor([-0.5, 0.5, 1.5]),
        ssmax_s=0.5 + torch.rand(3, generator=g),
        window=16,
    )
    return dispatch.attention(q, k, v, options, backend=backend)


def _mlstm_call(backend: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 20, 8, generator=g) for _ in range(2))
    v = torch.randn(2, 3, 20, 16, generator=g)
    i, f = 3 * torch.randn(2, 3, 20, generator=g), 3 + 2 * torch.randn(2, 3, 20, generator=g)
    return dispatch.mlstm_chunkwise(q, k, v, i, f, 1e-6, 16, backend=backend)[0]


# op name → (the reference as dispatch sees it, the kernel, a small call through the dispatch point,
# the op that mode auto runs on CPU: its label and (module, name))
OPS = {
    "attention": (
        (dispatch, "bam_attention"),
        (attention_kernel, "bam_attention_triton"),
        _attention_call,
        ("c_tiles", (attention_c_tiles, "bam_attention_cpu")),
    ),
    "mlstm": (
        (dispatch, "mlstm_chunkwise_reference"),
        (mlstm_kernel, "mlstm_chunkwise_triton"),
        _mlstm_call,
        ("reference", None),
    ),
}


@pytest.fixture(params=list(OPS))
def op(request, monkeypatch):
    """(op name, list of the ops the dispatch point ran, the op's small call, the auto CPU choice)."""
    reference, kernel, call, (cpu_choice, cpu_op) = OPS[request.param]
    extra = {cpu_choice: cpu_op} if cpu_op else {}
    return request.param, spy_on_ops(monkeypatch, reference, kernel, **extra), call, cpu_choice


def test_dispatch_picks_the_cpu_op_on_cpu_and_logs_once(op, caplog):
    name, ran, call, cpu_choice = op
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        auto = call("auto")
        call("auto")
        reference = call("reference")
    assert ran == [cpu_choice, cpu_choice, "reference"]
    assert [r.getMessage() for r in caplog.records][:1] == [f"{name} op: {cpu_choice} (mode auto, cpu tensors)"]
    torch.testing.assert_close(auto, reference, rtol=1e-5, atol=1e-5)


def test_dispatch_forced_triton_runs_the_kernel(op, monkeypatch):
    _, ran, call, _ = op
    ref = call("reference")
    got = call("triton")
    monkeypatch.setenv(dispatch.ENV, "triton")
    call("auto")  # the environment forces the kernel
    monkeypatch.setenv(dispatch.ENV, "reference")  # the environment wins over the config
    call("triton")
    assert ran == ["reference", "triton", "triton", "reference"]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_dispatch_refuses_triton_on_cpu_without_interpreter(op, monkeypatch):
    _, ran, call, _ = op
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="need TRITON_INTERPRET=1"):
        call("triton")
    monkeypatch.setenv(dispatch.ENV, "fast")
    with pytest.raises(ValueError, match="MEGABAM_KERNELS must be one of auto, triton, reference"):
        call("auto")
    assert ran == []


@pytest.fixture
def attention_ops(monkeypatch):
    """Which attention op the dispatch point ran: "reference", "triton", "sdpa" or "c_tiles"."""
    return spy_on_ops(
        monkeypatch,
        (dispatch, "bam_attention"),
        (attention_kernel, "bam_attention_triton"),
        sdpa=(attention_sdpa, "bam_attention_sdpa"),
        c_tiles=(attention_c_tiles, "bam_attention_cpu"),
    )


def _call(backend="auto", prior=False, learnable=(), **fields):
    """A small attention call through the dispatch point; `learnable`: which of theta_alpha and ssmax_s
    require grad."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 16, generator=g) for _ in range(3))
    if prior:
        fields.update(theta_alpha=-torch.rand(3, generator=g), theta_beta=torch.tensor([-0.5, 0.5, 1.5]))
    fields = dict(ssmax_s=0.5 + torch.rand(3, generator=g)) | fields
    fields.update({name: fields[name].clone().requires_grad_() for name in learnable})
    return dispatch.attention(q, k, v, AttentionOptions(**fields), backend=backend)


def test_auto_on_cpu_runs_the_c_kernel_else_torchs_fused_attention(attention_ops, caplog, monkeypatch):
    monkeypatch.setattr(dispatch, "c_tiles_wide", lambda: True)  # built for AVX-512, as on CI's machine type
    docs = torch.tensor([[0] * 20 + [1] * 17] * 2)
    calls = [dict(), dict(window=8), dict(window=8, doc_ids=docs), dict(prior=True), dict(doc_ids=docs)]
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        c_kernel = [_call(**kw) for kw in calls]  # every variant, with or without a prior
        monkeypatch.setattr(dispatch, "c_tiles_built", lambda: False)  # as where no compiler works
        fallback = [_call(**kw) for kw in calls]
        references = [_call("reference", **kw) for kw in calls]
    assert attention_ops == ["c_tiles"] * 5 + ["sdpa"] * 3 + ["reference"] * 7
    assert [r.getMessage() for r in caplog.records] == [
        "attention op: c_tiles (mode auto, cpu tensors)",
        "attention op: sdpa (mode auto, cpu tensors)",
        "attention op: reference (mode auto, cpu tensors)",
        "attention op: reference (mode reference, cpu tensors)",
    ]
    for got in (c_kernel, fallback):
        for a, b in zip(got, references):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_auto_leaves_prior_free_calls_to_torch_where_the_c_kernel_is_narrow(attention_ops, monkeypatch):
    """Built for vectors under 512 bits (an AVX2 machine), the C kernel is not measured against torch's
    fused attention: the calls torch can compute go there, the others still to the kernel."""
    monkeypatch.setattr(dispatch, "c_tiles_wide", lambda: False)
    _call()
    _call(window=8)
    _call(prior=True)
    assert attention_ops == ["sdpa", "sdpa", "c_tiles"]


def test_the_c_kernel_is_wide_where_the_cpu_has_avx512():
    """bam_attention_cpu.c picks its vector width from what -march=native enables: 512 bits with
    AVX-512."""
    flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "").split()
    assert attention_c_tiles.wide_vectors() == ("avx512f" in flags)


def test_auto_keeps_v_wider_than_q_off_the_c_kernel(attention_ops):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 2, 20, 8, generator=g), torch.randn(1, 2, 20, 8, generator=g), torch.randn(1, 2, 20, 16)
    out = dispatch.attention(q, k, v)
    assert attention_ops == ["sdpa"]
    torch.testing.assert_close(out, dispatch.attention(q, k, v, backend="reference"), rtol=1e-5, atol=1e-5)


def test_fused_calls_take_at_least_256_query_rows(monkeypatch):
    """The tiled op's block_size is a memory bound (block_size · N per tile); torch's fused op's memory
    does not grow with it, so the dispatch gives it at least SDPA_MIN_BLOCK rows per call (where the C
    kernel cannot build) and the tiled op exactly the configured block."""
    seen = []
    for module, name in ((dispatch, "bam_attention"), (attention_sdpa, "bam_attention_sdpa")):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, real=real, name=name: seen.append((name, a[3].block_size)) or real(*a)
        )
    monkeypatch.setattr(dispatch, "c_tiles_built", lambda: False)
    for block in (16, 512):
        _call(block_size=block)
        _call(prior=True, block_size=block)
    assert dispatch.SDPA_MIN_BLOCK == 256
    assert seen == [
        ("bam_attention_sdpa", 256),
        ("bam_attention", 16),
        ("bam_attention_sdpa", 512),
        ("bam_attention", 512),
    ]


def test_mlstm_kernel_takes_bf16_qkv_and_the_reference_fp32(monkeypatch):
    """The model hands the dispatch point q, k, v in its own dtype: the kernel gets bf16 as it is (its
    products on tensor cores), the reference the compute dtype; gates arrive fp32 either way."""
    seen = {}
    for label, (module, name) in {
        "triton": (mlstm_kernel, "mlstm_chunkwise_triton"),
        "reference": (dispatch, "mlstm_chunkwise_reference"),
    }.items():
        real = getattr(module, name)

        def op(*args, _label=label, _real=real):
            seen[_label] = [t.dtype for t in args[:5]]
            return _real(*args)

        monkeypatch.setattr(module, name, op)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(dispatch.ENV, raising=False)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 20, 16, generator=g).bfloat16() for _ in range(2))
    v = torch.randn(1, 2, 20, 16, generator=g).bfloat16()
    i, f = 3 * torch.randn(1, 2, 20, generator=g), 3 + 2 * torch.randn(1, 2, 20, generator=g)
    got = dispatch.mlstm_chunkwise(q, k, v, i, f, 1e-6, 16, backend="triton")[0]
    want = dispatch.mlstm_chunkwise(q, k, v, i, f, 1e-6, 16, backend="reference")[0]
    bf16, fp32 = torch.bfloat16, torch.float32
    assert seen == {"triton": [bf16, bf16, bf16, fp32, fp32], "reference": [fp32] * 5}
    assert got.dtype == bf16 and want.dtype == fp32
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


@pytest.fixture
def cuda_ops(monkeypatch):
    """The attention ops the dispatch point ran, with its device predicate answering CUDA and dynamo
    on: the choice is the dispatch's own; the ops it picks still run on these CPU tensors
    (FlexAttention eagerly, the kernel under the interpreter), so their results are checked too."""
    import torch._dynamo

    monkeypatch.setattr(dispatch, "on_cuda", lambda tensor: True)
    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    with torch._dynamo.config.patch(disable=False):  # its own patch: monkeypatch would delete the entry
        yield spy_on_ops(
            monkeypatch,
            (dispatch, "bam_attention"),
            (attention_kernel, "bam_attention_triton"),
            sdpa_cuda=(attention_torch, "bam_attention_sdpa_causal"),
            flex=(attention_torch, "bam_attention_flex"),
        )


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_auto_on_cuda_runs_sdpa_flex_or_the_kernel_and_logs_why(cuda_ops, caplog, monkeypatch):
    docs = torch.tensor([[0] * 20 + [1] * 17] * 2)
    calls = [
        dict(),  # RoPE, NoPE, sinusoidal: SSMax (fixed here) folded into q
        dict(learnable=["ssmax_s"]),
        dict(window=8),
        dict(doc_ids=docs),
        dict(prior=True),  # ALiBi's case: a fixed prior, here scaled by a fixed SSMax
        dict(prior=True, learnable=["theta_alpha"]),
        dict(prior=True, learnable=["ssmax_s"]),  # a fixed prior scaled by a learnable s
        dict(prior=True, learnable=["ssmax_s"], ssmax_before_prior=True),
    ]
    # The last call's s requires grad, which torch refuses for FlexAttention on CPU (not on CUDA):
    # lifted, as in tests/unit/test_attention_torch.py.
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        auto = [_call(**kw) for kw in calls]
        monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # as a user may set it
        off = [_call(**kw) for kw in calls[:4]]
        forced = [_call("triton", window=8), _call("reference", window=8)]
        references = [_call("reference", **kw) for kw in calls]
    assert cuda_ops == (
        ["sdpa_cuda"] * 2
        + ["flex"] * 3
        + ["triton"] * 2
        + ["flex"]
        + ["sdpa_cuda"] * 2
        + ["triton"] * 2
        + ["triton", "reference"]
        + ["reference"] * 8
    )
    backend = attention_torch.sdpa_backend(torch.zeros(2, 3, 37, 16), torch.zeros(2, 3, 37, 16), AttentionOptions())
    assert [r.getMessage() for r in caplog.records] == [
        f"attention op: sdpa_cuda (mode auto, cpu tensors): no prior, window or documents; torch picks {backend}",
        "attention op: flex (mode auto, cpu tensors): window, documents or fixed prior",
        "attention op: triton (mode auto, cpu tensors): learnable prior",
        "attention op: triton (mode auto, cpu tensors): learnable SSMax scales the prior",
        "attention op: triton (mode auto, cpu tensors): dynamo is disabled, and FlexAttention uncompiled would "
        "materialise N x N scores",
        "attention op: triton (mode triton, cpu tensors)",
        "attention op: reference (mode reference, cpu tensors)",
    ]
    for got, want in zip(auto + off + forced, references + references[:4] + references[2:3] * 2):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_call_past_an_ssmax_key_cap_runs_the_kernel_on_cuda(cuda_ops, caplog):
    """Evaluation past the training length with ssmax_key_cap: on CUDA the Triton kernel, which applies
    the cap (the same call uncapped, a fixed prior under no_grad, takes FlexAttention, which does not);
    mode reference keeps the reference, which applies it too."""
    caps = torch.tensor([math.inf, 5.0, 12.0])
    with torch.no_grad(), caplog.at_level(logging.INFO, logger=dispatch.__name__):
        capped = _call(prior=True, ssmax_key_cap=caps)
        plain = _call(prior=True)
        reference = _call("reference", prior=True, ssmax_key_cap=caps)
    assert cuda_ops == ["triton", "flex", "reference"]
    assert caplog.records[0].getMessage() == (
        "attention op: triton (mode auto, cpu tensors): an SSMax key cap is reached: the kernel applies it"
    )
    torch.testing.assert_close(capped, reference, rtol=1e-5, atol=1e-5)
    assert (capped - plain).abs().max() > 1e-2  # the cap changes the result


def test_the_cuda_rule_by_prior_ssmax_masks_and_dynamo(monkeypatch):
    """dispatch.cuda_attention_choice case by case (the recurrent cells': test_library_kernels.py);
    dynamo counts as disabled by TORCHDYNAMO_DISABLE=1 (torch.compile's check) or
    torch._dynamo.config.disable (compiled code's)."""
    import torch._dynamo

    monkeypatch.delenv("TORCHDYNAMO_DISABLE", raising=False)
    q = k = torch.zeros(1, 4, 16, 8)
    fixed = dict(theta_alpha=torch.zeros(4), theta_beta=torch.ones(4))
    learnable_prior = dict(theta_alpha=torch.zeros(4, requires_grad=True), theta_beta=torch.ones(4))
    s, learnable_s = torch.ones(4), torch.ones(4, requires_grad=True)

    def choice(config_disable=False, **fields):
        with torch._dynamo.config.patch(disable=config_disable):  # monkeypatch would delete the entry
            return dispatch.cuda_attention_choice(q, k, AttentionOptions(**fields))[0]

    assert [choice(), choice(ssmax_s=learnable_s), choice(ssmax_s=s, doc_ids=torch.zeros(1, 16))] == [
        "sdpa_cuda",
        "sdpa_cuda",
        "flex",
    ]
    assert [choice(window=4, **fixed), choice(ssmax_s=s, **fixed), choice(ssmax_s=learnable_s, **fixed)] == [
        "flex",
        "flex",
        "triton",
    ]
    assert choice(ssmax_s=learnable_s, ssmax_before_prior=True, **fixed) == "flex"
    assert [choice(**learnable_prior), choice(window=4, **learnable_prior)] == ["triton", "triton"]
    with torch.no_grad():  # inference: no prior needs a gradient
        assert [choice(**learnable_prior), choice(ssmax_s=learnable_s, **fixed)] == ["flex", "flex"]
    assert [choice(True), choice(True, window=4), choice(True, **fixed)] == ["sdpa_cuda", "triton", "triton"]
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert [choice(), choice(window=4)] == ["sdpa_cuda", "triton"]
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    assert choice(window=4) == "flex"
