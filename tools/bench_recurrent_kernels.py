"""The recurrent cells' CUDA ops (kernels/dispatch.py, mode auto) against the libraries they call and
megabam's own forms: Gated DeltaNet on flash-linear-attention, the mLSTM on NX-AI's TFLA. Run first by
tools/gpu_check.sh:

    python tools/bench_recurrent_kernels.py             # one GPU, about a minute
    python tools/bench_recurrent_kernels.py --dry-run   # CPU, tiny shapes: proves the script only

1. Correctness first, at --check-length tokens: the dispatch's op for each cell on bf16 q, k, v (fp32
   gates and state, as the model feeds them) against the PyTorch reference in fp32 on the same values:
   output, final state and the gradient of every input (the incoming state's too); then the step ops
   (TFLA's step kernel, fla's fused recurrent kernel) in fp32 against the reference's step, and the
   mLSTM's chunkwise op continuing from a state. Exit code 1 beyond 3e-2 relative (bf16; steps
   1e-4), printed per tensor; the op that ran is logged.
2. Forward + backward time (median of CUDA-event timings) at --length tokens, batch 1:
   mLSTM at xLSTM-7B's head widths (8 heads, d_qk 256, d_v 512, chunk 64):
     megabam   dispatch.mlstm_chunkwise (TFLA where it runs, else megabam's kernel: logged)
     tfla      TFLA's xl_chunk kernel called directly on the same tensors
     triton    megabam's own kernel (kernels/mlstm_triton.py)
   Gated DeltaNet at SWAX 1.4B's (16 heads of 128):
     megabam   dispatch.gated_delta (fla's chunk kernel; q, k normalised before it)
     fla       fla's chunk_gated_delta_rule called directly, its in-kernel q, k norm on (its usual call)
     ref       the PyTorch chunkwise form (kernels/gated_deltanet.py), fp32
   The ratio is each line's time over the library's direct call (the issue's target: megabam ≤ 1.1×).
A variant that fails prints its error and gets NaN rather than ending the run. --dry-run runs the
checks (where the dispatch picks the references) and the reference rows on CPU at tiny shapes, and
skips the library rows (they need CUDA).
"""

import argparse
import logging
import math
import sys

import torch
import torch.nn.functional as F
from bench_kernels import median_ms  # tools/, this script's own directory

from megabam.kernels import dispatch
from megabam.kernels.gated_deltanet import gated_delta_chunkwise, gated_delta_recurrent
from megabam.kernels.mlstm import mlstm_chunkwise, mlstm_step

MLSTM_SHAPE = dict(heads=8, dqk=256, dv=512, chunk=64)  # xLSTM-7B's heads
GDN_SHAPE = dict(heads=16, dk=128, dv=128, chunk=64)  # SWAX 1.4B's Gated DeltaNet heads
TOL, STEP_TOL = 3e-2, 1e-4


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--check-length", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args()
    if a.dry_run:
        a.length, a.check_length, a.reps = 40, 40, 1
        MLSTM_SHAPE.update(heads=2, dqk=16, dv=32, chunk=16)
        GDN_SHAPE.update(heads=2, dk=16, dv=16, chunk=16)
    return a


def mlstm_inputs(n, device, dtype=torch.bfloat16, seed=0):
    """q, k, v in dtype, fp32 gates (forget gates near 1, as trained), all requiring grad."""
    g = torch.Generator(device=device).manual_seed(seed)
    s = MLSTM_SHAPE
    q, k = (torch.randn(1, s["heads"], n, s["dqk"], generator=g, device=device).to(dtype) for _ in range(2))
    v = torch.randn(1, s["heads"], n, s["dv"], generator=g, device=device).to(dtype)
    i = 2 * torch.randn(1, s["heads"], n, generator=g, device=device) - 2
    f = 3 + torch.randn(1, s["heads"], n, generator=g, device=device)
    return [t.requires_grad_() for t in (q, k, v, i, f)]


def gdn_inputs(n, device, dtype=torch.bfloat16, seed=0):
    """Unit q, k and v in dtype, fp32 log decay and rate, an fp32 incoming state, all requiring grad."""
    g = torch.Generator(device=device).manual_seed(seed)
    s = GDN_SHAPE
    q, k = (F.normalize(torch.randn(1, s["heads"], n, s["dk"], generator=g, device=device), dim=-1) for _ in "qk")
    v = torch.randn(1, s["heads"], n, s["dv"], generator=g, device=device)
    decay = -0.1 * torch.rand(1, s["heads"], n, generator=g, device=device)
    beta = torch.rand(1, s["heads"], n, generator=g, device=device)
    S0 = 0.1 * torch.randn(1, s["heads"], s["dk"], s["dv"], generator=g, device=device)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)] + [t.requires_grad_() for t in (decay, beta, S0)]


def errors(op, ref_op, ins, state_in_loss: bool, seed=1):
    """Max error of op's output, final state and input gradients relative to ref_op's on fp32 copies
    of ins. The mLSTM's state is compared as the sums it stands for (C·exp(m): an empty start scales
    it otherwise in TFLA, kernels/mlstm_tfla.py) and kept out of the loss, as training keeps it."""
    ref_ins = [t.detach().float().requires_grad_() for t in ins]
    results = []
    for fn, args in ((op, ins), (ref_op, ref_ins)):
        out, state = fn(args)
        if not isinstance(state, torch.Tensor):
            state = state.C * torch.exp(state.m)[..., None, None]
        g = torch.Generator(device=out.device).manual_seed(seed)
        loss = (out.float() * torch.randn(out.shape, generator=g, device=out.device)).sum()
        if state_in_loss:
            loss = loss + (state.float() * torch.randn(state.shape, generator=g, device=out.device)).sum()
        results.append([out.detach().float(), state.detach().float(), *torch.autograd.grad(loss, args)])
    return [((a.float() - b).abs().max() / (1 + b.abs().max())).item() for a, b in zip(*results)]


def check(device) -> bool:
    ok = True
    n = ARGS.check_length
    mlstm_chunk = MLSTM_SHAPE["chunk"]
    cases = {
        "mlstm": (
            lambda a: dispatch.mlstm_chunkwise(*a, 1e-6, mlstm_chunk),
            lambda a: mlstm_chunkwise(*a, 1e-6, mlstm_chunk),
            mlstm_inputs(n, device),
            False,
            ("h", "C", "dq", "dk", "dv", "di", "df"),
        ),
        "gated_deltanet": (
            lambda a: dispatch.gated_delta(*a[:5], GDN_SHAPE["chunk"], a[5]),
            lambda a: gated_delta_chunkwise(*a[:5], GDN_SHAPE["chunk"], a[5]),
            gdn_inputs(n, device),
            True,
            ("o", "S", "dq", "dk", "dv", "dg", "dbeta", "dS0"),
        ),
    }
    for cell, (op, ref_op, ins, state_in_loss, names) in cases.items():
        for name, err in zip(names, errors(op, ref_op, ins, state_in_loss)):
            good = err <= TOL
            ok = ok and good
            print(f"check {cell} bf16 {name}: max rel err {err:.2e} {'ok' if good else 'FAIL'}")
    with torch.no_grad():
        ins = [t.detach().float() for t in mlstm_inputs(20, device)]
        state = mlstm_chunkwise(*ins, 1e-6, 8)[1]
        one = [t[..., :1, :] for t in ins[:3]] + [t[..., :1] for t in ins[3:]]
        got = dispatch.mlstm_steps(*one, 1e-6, state)
        want = mlstm_step(*(t[..., 0, :] for t in one[:3]), *(t[..., 0] for t in one[3:]), 1e-6, state)
        pairs = {"mlstm step h": (got[0][..., 0, :], want[0]), "mlstm step C": (got[1].C, want[1].C)}
        # The chunkwise op continuing from a state (streaming a prompt in pieces), bf16 q, k, v as trained.
        more = [t.detach() for t in mlstm_inputs(ARGS.check_length // 2 + 3, device, seed=1)]
        got = dispatch.mlstm_chunkwise(*more, 1e-6, mlstm_chunk, state)
        want = mlstm_chunkwise(*(t.float() for t in more), 1e-6, mlstm_chunk, state)
        pairs.update({"mlstm from a state h": (got[0].float(), want[0]), "mlstm from a state C": (got[1].C, want[1].C)})
        g_ins = [t.detach().float() for t in gdn_inputs(1, device)]
        got, want = dispatch.gated_delta(*g_ins[:5], 1, g_ins[5]), gated_delta_recurrent(*g_ins)
        pairs.update({"gated_deltanet step o": (got[0], want[0]), "gated_deltanet step S": (got[1], want[1])})
    for name, (a, b) in pairs.items():
        err = ((a - b).abs().max() / (1 + b.abs().max())).item()
        tol = TOL if "from a state" in name else STEP_TOL  # bf16 inputs there
        ok = ok and err <= tol
        print(f"check {name}: max rel err {err:.2e} {'ok' if err <= tol else 'FAIL'}")
    return ok


def time_ms(fn, ins) -> float:
    """Median forward + backward time of fn(ins) (gradients of every input)."""
    dout = []

    def step():
        out = fn(ins)
        if not dout:
            dout.append(torch.randn_like(out))
        torch.autograd.grad(out, ins, dout[0], allow_unused=True)

    return median_ms(step, ARGS.reps, ins[0].is_cuda)


def variants(device):
    """(cell, name, fn(ins) -> output, inputs maker, is the library's direct call)."""
    mc, gc = MLSTM_SHAPE["chunk"], GDN_SHAPE["chunk"]
    rows = []
    if device == "cuda":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from mlstm_kernels.torch.chunkwise.triton_xl_chunk import mlstm_chunkwise__xl_chunk

        from megabam.kernels.mlstm_triton import mlstm_chunkwise_triton

        def fla_direct(a):
            q, k, v, g, beta = (t.transpose(1, 2) for t in a[:5])
            return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=a[5], use_qk_l2norm_in_kernel=True)[0]

        rows += [
            ("mlstm", "megabam", lambda a: dispatch.mlstm_chunkwise(*a, 1e-6, mc)[0], mlstm_inputs, False),
            ("mlstm", "tfla", lambda a: mlstm_chunkwise__xl_chunk(*a, eps=1e-6, chunk_size=mc), mlstm_inputs, True),
            ("mlstm", "triton", lambda a: mlstm_chunkwise_triton(*a, 1e-6, mc)[0], mlstm_inputs, False),
            ("gated_deltanet", "megabam", lambda a: dispatch.gated_delta(*a[:5], gc, a[5])[0], gdn_inputs, False),
            ("gated_deltanet", "fla", fla_direct, gdn_inputs, True),
        ]
    rows.append(
        (
            "gated_deltanet",
            "ref",
            lambda a: gated_delta_chunkwise(*a[:5], gc, a[5])[0],
            lambda n, dev: gdn_inputs(n, dev, torch.float32),
            False,
        )
    )
    return rows


def main() -> int:
    global ARGS
    ARGS = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = "cuda" if torch.cuda.is_available() and not ARGS.dry_run else "cpu"
    if device == "cpu" and not ARGS.dry_run:
        print("bench_recurrent_kernels: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    if not check(device):  # on CPU (the dry run) the dispatch picks the references: the path only
        print("bench_recurrent_kernels: a check failed")
        return 1
    print(f"\nN = {ARGS.length}, batch 1; mLSTM {MLSTM_SHAPE}; Gated DeltaNet {GDN_SHAPE}")
    print("\n| cell | variant | fwd+bwd ms | × the library's direct call |")
    print("| --- | --- | ---: | ---: |")
    direct = {}
    rows = variants(device)
    for cell, name, fn, make, is_direct in sorted(rows, key=lambda r: not r[4]):  # the direct calls first
        try:
            ms = time_ms(fn, make(ARGS.length, device))
        except Exception as e:  # noqa: BLE001 - one failing variant must not end the table
            ms = math.nan
            print(f"{cell} {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        if is_direct:
            direct[cell] = ms
        ratio = f"{ms / direct[cell]:.2f}" if cell in direct else "n/a"
        print(f"| {cell} | {name} | {ms:.3f} | {ratio} |")
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
