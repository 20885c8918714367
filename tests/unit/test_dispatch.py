"""The dispatch point (kernels/dispatch.py) of each op that has a Triton kernel: the reference on CPU
tensors unless forced (attention without a prior: torch's fused attention), the kernel when forced
(under the interpreter here), the environment winning over the config, each choice logged once per
op, and bad modes refused in one line.

TRITON_INTERPRET=1 is set before the kernel modules are imported, as in tests/unit/test_kernels_triton.py.
"""

import logging
import os

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
from helpers.dispatch_spy import spy_on_ops  # noqa: E402

import megabam.kernels.bam_attention_sdpa as attention_sdpa  # noqa: E402
import megabam.kernels.bam_attention_triton as attention_kernel  # noqa: E402
import megabam.kernels.mlstm_triton as mlstm_kernel  # noqa: E402
from megabam.kernels import dispatch  # noqa: E402


def _attention_call(backend: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 16, generator=g) for _ in range(3))
    theta = dict(
        theta_alpha=-torch.rand(3, generator=g),
        theta_beta=torch.tensor([-0.5, 0.5, 1.5]),
        ssmax_s=0.5 + torch.rand(3, generator=g),
    )
    return dispatch.attention(q, k, v, **theta, window=16, backend=backend)


def _mlstm_call(backend: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 20, 8, generator=g) for _ in range(2))
    v = torch.randn(2, 3, 20, 16, generator=g)
    i, f = 3 * torch.randn(2, 3, 20, generator=g), 3 + 2 * torch.randn(2, 3, 20, generator=g)
    return dispatch.mlstm_chunkwise(q, k, v, i, f, 1e-6, 16, backend=backend)[0]


# op name → (the reference as dispatch sees it, the kernel, a small call through the dispatch point)
OPS = {
    "attention": ((dispatch, "bam_attention"), (attention_kernel, "bam_attention_triton"), _attention_call),
    "mlstm": ((dispatch, "mlstm_chunkwise_reference"), (mlstm_kernel, "mlstm_chunkwise_triton"), _mlstm_call),
}


@pytest.fixture(params=list(OPS))
def op(request, monkeypatch):
    """(op name, list of the ops the dispatch point ran, the op's small call)."""
    reference, kernel, call = OPS[request.param]
    return request.param, spy_on_ops(monkeypatch, reference, kernel), call


def test_dispatch_picks_reference_on_cpu_and_logs_once(op, caplog):
    name, ran, call = op
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        call("auto")
        call("auto")
    assert ran == ["reference", "reference"]
    assert [r.getMessage() for r in caplog.records] == [f"{name} op: reference (mode auto, cpu tensors)"]


def test_dispatch_forced_triton_runs_the_kernel(op, monkeypatch):
    _, ran, call = op
    ref = call("reference")
    got = call("triton")
    monkeypatch.setenv(dispatch.ENV, "triton")
    call("auto")
    monkeypatch.setenv(dispatch.ENV, "reference")  # the environment wins over the config
    call("triton")
    assert ran == ["reference", "triton", "triton", "reference"]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_dispatch_refuses_triton_on_cpu_without_interpreter(op, monkeypatch):
    _, ran, call = op
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="need TRITON_INTERPRET=1"):
        call("triton")
    monkeypatch.setenv(dispatch.ENV, "fast")
    with pytest.raises(ValueError, match="MEGABAM_KERNELS must be one of auto, triton, reference"):
        call("auto")
    assert ran == []


@pytest.fixture
def attention_ops(monkeypatch):
    """Which attention op the dispatch point ran: "reference", "triton" or "sdpa"."""
    return spy_on_ops(
        monkeypatch,
        (dispatch, "bam_attention"),
        (attention_kernel, "bam_attention_triton"),
        (attention_sdpa, "bam_attention_sdpa"),
    )


def _call(backend="auto", prior=False, **options):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 16, generator=g) for _ in range(3))
    if prior:
        options.update(theta_alpha=-torch.rand(3, generator=g), theta_beta=torch.tensor([-0.5, 0.5, 1.5]))
    return dispatch.attention(q, k, v, ssmax_s=0.5 + torch.rand(3, generator=g), backend=backend, **options)


def test_auto_on_cpu_fuses_attention_without_a_prior(attention_ops, caplog):
    docs = torch.tensor([[0] * 20 + [1] * 17] * 2)
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        fused = _call()
        _call(window=8)
        _call(window=8, doc_ids=docs)
        _call(prior=True)  # a learned prior needs its gradient: the tiled op
        _call(doc_ids=docs)  # documents without a window: the tiled op (bounded masks)
        reference = _call("reference")
    assert attention_ops == ["sdpa", "sdpa", "sdpa", "reference", "reference", "reference"]
    assert [r.getMessage() for r in caplog.records] == [
        "attention op: sdpa (mode auto, cpu tensors)",
        "attention op: reference (mode auto, cpu tensors)",
        "attention op: reference (mode reference, cpu tensors)",
    ]
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


def test_fused_calls_take_at_least_256_query_rows(monkeypatch):
    """The tiled op's block_size is a memory bound (block_size · N per tile); the fused op's memory does
    not grow with it, so the dispatch gives it at least SDPA_MIN_BLOCK rows per call and the tiled op
    exactly the configured block."""
    seen = []
    for module, name in ((dispatch, "bam_attention"), (attention_sdpa, "bam_attention_sdpa")):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, real=real, name=name, **kw: seen.append((name, kw["block_size"])) or real(*a, **kw)
        )
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
