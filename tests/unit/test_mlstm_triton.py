"""The chunkwise mLSTM Triton kernels (kernels/mlstm_triton.py) against the PyTorch chunkwise form, on
CPU under the Triton interpreter, and the mLSTM mixer reaching the kernel through the dispatch point
(whose own rules are tested in tests/unit/test_dispatch.py).

TRITON_INTERPRET=1 is set here, in-process, before the kernel module is imported, as in
tests/unit/test_kernels_triton.py (see its docstring for why); dispatch imports the kernel lazily, which
the assert below checks.

Reference: kernels.mlstm.mlstm_chunkwise in float64 on the same values (itself checked against a
float64 loop over time in tests/unit/test_mlstm.py), with random incoming gradients on h and on all three
parts of the final state. Error: max |error| / (1 + max |reference|) per output and gradient
(h, final C, n, m; q, k, v, i, f and the initial C, n, m). Tolerances: 5e-5 for fp32 q, k, v,
2e-3 for fp16 (h, dq, dk, dv are rounded to fp16), 2e-2 for bf16. Measured worst cases over this
file's cases: fp32 9.4e-6 (dk), fp16 3.9e-4 (dk), bf16 6.2e-3 (dv); gate and state gradients stay
below 2.1e-5 in every dtype (they are fp32). Shapes are small (d_qk 8, d_v 16, chunk 16; N = 37,
and 9 < chunk) so the file runs in about 25 s on two cores.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"
from helpers.dispatch_spy import spy_on_ops  # noqa: E402

import megabam.kernels.mlstm_triton as kt  # noqa: E402
from megabam.kernels import dispatch  # noqa: E402
from megabam.kernels.mlstm import MLstmState, mlstm_chunkwise  # noqa: E402

assert kt.INTERPRET, "kernels.mlstm_triton was imported before TRITON_INTERPRET=1 was set"

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
B, H, DQK, DV, CHUNK, EPS = 2, 3, 8, 16, 16, 1e-6
TOL = {torch.float32: 5e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
NAMES = ["h", "C", "n", "m", "dq", "dk", "dv", "di", "df", "dC0", "dn0", "dm0"]


def make_inputs(dtype, n, gates="random", state=False, seed=0):
    """q, k, v in `dtype`, fp32 gates, and (if state) an fp32 initial state whose second head is
    empty (m = -inf); all require grad.

    gates: "random" (i ~ 3·N(0,1), f ~ 3 + 2·N(0,1)) or "extreme": pre-activations spread over the
    soft cap's whole range ±15, where the stabiliser often sits on the input gate and |q̃·n| can fall
    below exp(-m), so the exact gradient through the stabiliser matters.
    """
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, n, DQK, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(B, H, n, DV, generator=g).to(dtype)
    if gates == "random":
        i, f = 3 * torch.randn(B, H, n, generator=g), 3 + 2 * torch.randn(B, H, n, generator=g)
    else:
        i, f = (30 * torch.rand(B, H, n, generator=g) - 15 for _ in range(2))
    ins = [q, k, v, i, f]
    if state:
        C = torch.randn(B, H, DQK, DV, generator=g)
        nrm = torch.randn(B, H, DQK, generator=g)
        m = 4 * torch.randn(B, H, generator=g)
        C[:, 1], nrm[:, 1], m[:, 1] = 0.0, 0.0, -math.inf
        ins += [C, nrm, m]
    return [t.requires_grad_() for t in ins]


def run(op, ins, grads, chunk=CHUNK):
    """Outputs (h, C, n, m) of op on ins and the gradients of Σ outputs⊙grads w.r.t. every input."""
    state = MLstmState(*ins[5:]) if len(ins) > 5 else None
    h, final = op(*ins[:5], EPS, chunk, state)
    outs = [h, *final]
    return outs + list(torch.autograd.grad(outs, ins, [g.to(o.dtype) for o, g in zip(outs, grads)]))


def errors(ins, chunk=CHUNK, seed=1):
    """Max relative errors of the kernel's outputs and gradients against the float64 reference;
    asserts all are finite and within TOL of the inputs' dtype."""
    dtype = ins[0].dtype
    g = torch.Generator().manual_seed(seed)
    B_, H_, n, _ = ins[0].shape
    grads = [
        torch.randn(B_, H_, n, DV, generator=g).to(dtype),  # h's gradient, as it arrives
        torch.randn(B_, H_, DQK, DV, generator=g),
        torch.randn(B_, H_, DQK, generator=g),
        torch.randn(B_, H_, generator=g),
    ]
    got = run(kt.mlstm_chunkwise_triton, ins, grads, chunk)
    want = run(mlstm_chunkwise, [t.detach().double().requires_grad_() for t in ins], [t.double() for t in grads], chunk)
    assert [t.dtype for t in got[4:]] == [t.dtype for t in ins]
    errs = {}
    for name, a, b in zip(NAMES, got, want):
        assert torch.isfinite(a).all(), name
        errs[name] = ((a.double() - b).abs().max() / (1 + b.abs().max())).item()
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, f"over {TOL[dtype]}: {bad}"
    return errs


@pytest.mark.parametrize("n", [37, 9])  # 37 = 2 chunks + 5 steps; 9 < one chunk
@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("gates", ["random", "extreme"])
def test_fp32_matches_reference(n, state, gates):
    errors(make_inputs(torch.float32, n, gates, state, seed=n))


@pytest.mark.parametrize("gates", ["random", "extreme"])
def test_fp16_matches_reference(gates):
    errors(make_inputs(torch.float16, 37, gates, state=True, seed=3))


def test_bf16_matches_reference():
    errors(make_inputs(torch.bfloat16, 37, "random", state=True, seed=4))


def test_chunk_size_not_a_power_of_two_and_strided_inputs():
    """Chunks of 5 steps (tile 16, masked) and q as a non-contiguous view, as the mixer passes it."""
    q, k, v, i, f = make_inputs(torch.float32, 23, seed=5)
    q = torch.randn(B, 23, H, DQK, generator=torch.Generator().manual_seed(5)).transpose(1, 2).requires_grad_()
    assert not q.is_contiguous()
    errors([q, k, v, i, f], chunk=5)


def test_no_nan_for_empty_state_and_saturated_gates():
    """Gates pinned at exactly ±15 (many equal maxima), an empty incoming state given explicitly
    (m = -inf everywhere): every output and gradient is finite."""
    q, k, v, i, f = (t.detach() for t in make_inputs(torch.float32, 37, seed=6))
    i = (15 * torch.sign(torch.randn(i.shape))).requires_grad_()
    f = (15 * torch.sign(torch.randn(f.shape))).requires_grad_()
    state = [torch.zeros(B, H, DQK, DV), torch.zeros(B, H, DQK), torch.full((B, H), -math.inf)]
    ins = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), i, f, *(t.requires_grad_() for t in state)]
    grads = [torch.randn(B, H, 37, DV), torch.randn(B, H, DQK, DV), torch.randn(B, H, DQK), torch.randn(B, H)]
    for t in run(kt.mlstm_chunkwise_triton, ins, grads):
        assert torch.isfinite(t).all()


def test_poisoned_outputs_are_overwritten(monkeypatch):
    """Every buffer the kernels write (states, h, row terms, state gradients, dq, dk, dv, di, db) is
    fully written: with NaN-filled buffers the results are finite and bit-identical."""
    ins = make_inputs(torch.float32, 37, state=True, seed=7)
    grads = [torch.randn(B, H, 37, DV), torch.randn(B, H, DQK, DV), torch.randn(B, H, DQK), torch.randn(B, H)]
    clean = run(kt.mlstm_chunkwise_triton, ins, grads)
    real = kt.buffer
    monkeypatch.setattr(kt, "buffer", lambda *shape, **kw: real(*shape, **kw).fill_(math.nan))
    poisoned = run(kt.mlstm_chunkwise_triton, ins, grads)
    for a, b in zip(poisoned, clean):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert torch.isfinite(a).all()


def test_no_grad_for_inputs_not_requiring_it():
    q, k, v, i, f = make_inputs(torch.float32, 20)
    h, _ = kt.mlstm_chunkwise_triton(q, k.detach(), v, i.detach(), f, EPS, CHUNK)
    h.sum().backward()
    assert k.grad is None and i.grad is None
    assert all(t.grad is not None for t in (q, v, f))


def test_rejects_unsupported_dtype():
    q = torch.randn(1, 1, 8, DQK, dtype=torch.float64)
    with pytest.raises(TypeError, match="fp32, fp16 or bf16"):
        kt.mlstm_chunkwise_triton(q, q, q, q[..., 0], q[..., 0], EPS, CHUNK)


def test_fp32_inputs_skip_the_faulting_wide_tile():
    """On an H200 (Triton 3.6) fwd_chunk_kernel faulted (misaligned address) with BLOCK_DV 128 on fp32
    inputs at d_qk 128 (docs/benchmarks.md): its autotuner drops that tile for fp32, keeps it for
    bf16/fp16."""
    import triton

    narrow = triton.Config({"BLOCK_DV": 64}, num_warps=4, num_stages=2)
    wide = triton.Config({"BLOCK_DV": 128}, num_warps=8, num_stages=2)
    assert kt.fwd_chunk_kernel.early_config_prune is kt._no_wide_fp32_tiles
    assert kt._no_wide_fp32_tiles([narrow, wide], {}, PRECISION="ieee") == [narrow]
    assert kt._no_wide_fp32_tiles([narrow, wide], {}, PRECISION="tf32") == [narrow, wide]
    assert kt._no_wide_fp32_tiles([narrow, wide], {"PRECISION": "ieee"}) == [narrow]  # passed positionally


# --- the mixer through the dispatch point ----------------------------------------------------------


@pytest.fixture
def ops(monkeypatch):
    """Records which op the dispatch point ran ("reference" / "triton")."""
    return spy_on_ops(monkeypatch, (dispatch, "mlstm_chunkwise_reference"), (kt, "mlstm_chunkwise_triton"))


def test_mixer_with_triton_kernels_matches_reference(ops):
    """The MLstm mixer built with model.kernels = triton runs the kernel (under the interpreter) and
    gives the reference's output and parameter gradients (fp32; tolerance 1e-4 relative)."""
    from megabam.config import load_config
    from megabam.model.layers import SequenceInfo
    from megabam.model.mlstm import MLstm

    results = []
    for kernels in ("triton", "reference"):
        cfg = load_config(
            None, [f"model.kernels={kernels}", "model.d_model=32", "model.n_heads=2", "model.mlstm.chunk_size=16"]
        ).model
        torch.manual_seed(0)
        layer = MLstm(cfg)
        x = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(1))
        y = layer(x, SequenceInfo())
        y.pow(2).sum().backward()
        results.append([y] + [p.grad for p in layer.parameters()])
    assert ops == ["triton", "reference"]
    for a, b in zip(*results):
        assert (a - b).abs().max() <= 1e-4 * (1 + b.abs().max())


# --- the compiled (GPU) path -----------------------------------------------------------------------

COMPILE_FOR_H100 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import megabam.kernels.mlstm_triton as kt

flags = dict(PRECISION="tf32", CHUNK=64, BLOCK_L=64, BLOCK_DQK=128, BLOCK_DV=64, HAS_STATE=True,
             HAS_DSTATE=True)
inputs = ("Q", "K", "V", "DH", "DQ", "DK", "DV_OUT")
for kernel in (kt.fwd_state_kernel, kt.fwd_chunk_kernel, kt.bwd_state_kernel, kt.bwd_chunk_kernel):
    fn = kernel.fn
    consts = {a: v for a, v in flags.items() if a in fn.arg_names}
    sig = {a: "constexpr" if a in consts else "fp32" if a in ("scale", "eps") else "*bf16" if a in inputs
           else "*fp32" if a[0].isupper() and a not in ("H", "N", "DQK", "DV", "NC") else "i32"
           for a in fn.arg_names}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(a),): v for a, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 1})
print("compiled")
"""


def test_kernels_compile_for_the_gpu():
    """The tests above run the kernels as Python; this compiles all four (bf16 inputs, the model's
    chunk 64 and head dims 128 / 64-wide d_v tiles) for an sm_90 GPU, without one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_H100], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "compiled", done.stderr[-3000:]
