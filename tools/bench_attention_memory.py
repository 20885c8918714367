"""Peak CPU memory and time of forward+backward of kernels.bam_attention vs a dense N x N version.

Both run the GGD prior (θα, θβ, θμ) and SSMax with every input requiring grad, in float32. Beside
them, "fused": the CPU path for a prior without gradient (kernels/bam_attention_sdpa.py, torch's flash
attention with the prior as a Toeplitz bias, called through kernels/dispatch.py as the model calls
it), run with ALiBi's fixed slopes, no SSMax, gradients for q, k, v: its memory must stay linear in N
like the tiled op's; and "c_tiles", the CPU path for a learned prior (kernels/bam_attention_cpu.py, the
tiled op with its elementwise passes in C) on the tiled case's inputs.

Method: every (variant, N) case runs in a fresh subprocess, so one case's high-water mark cannot leak
into the next. The child imports torch, runs a tiny warm-up call (lazy initialisation, thread pools),
allocates q, k, v, θ, s and dO, then reads ru_maxrss (the process's peak resident set, KiB on Linux)
as the baseline. It then runs forward+backward once and reads ru_maxrss again: the difference is the
peak extra memory the op needed (activations, saved tensors, gradients, temporaries), counted in
pages actually touched. A second, timed run gives the wall time. The dense case is skipped when its
estimated footprint does not fit in available memory, and reported as OOM if the child is killed.

    .venv/bin/python tools/bench_attention_memory.py --lengths 2048 4096 8192 --heads 4 --dim 64 --block 128
"""

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

DENSE_NN_TENSORS = 12  # rough count of live B·H·N² fp32 tensors in the dense autograd graph


def dense_attention(q, k, v, alpha, beta, mu, s, window=None):
    """Materialised N x N float32 BAM attention (prior, then SSMax; causal, optional window)."""
    import torch

    n = q.shape[-2]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    allowed = (j <= i) & (j > i - (window or n))
    d = (j - i) - 2 * torch.sinh(mu)[:, None, None]
    prior = -torch.exp(alpha)[:, None, None] * (d.abs() + 1e-5) ** beta[:, None, None]
    c = s[:, None, None] * torch.log(allowed.sum(-1, keepdim=True).to(q.dtype))
    logits = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + prior) * c
    return torch.softmax(logits.masked_fill(~allowed, -math.inf), -1) @ v


def run_case(args):
    """Child process: print {"peak_mib", "ms"} for one variant at one N."""
    import torch

    from megabam.kernels import dispatch
    from megabam.kernels.bam_attention import AttentionOptions, bam_attention
    from megabam.kernels.bam_attention_cpu import bam_attention_cpu
    from megabam.model.positional import alibi_slopes
    from megabam.parallel.threads import configure_cpu

    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    configure_cpu()  # as a training rank: --threads threads, denormals flushed

    def inputs(n):
        g = torch.Generator().manual_seed(0)
        qkv = [torch.randn(args.batch, args.heads, n, args.dim, generator=g, requires_grad=True) for _ in range(3)]
        h = args.heads
        theta = [torch.linspace(-3, 0, h), torch.linspace(-0.5, 1.5, h), torch.zeros(h), torch.ones(h)]
        return qkv + [t.requires_grad_() for t in theta], torch.randn(args.batch, h, n, args.dim)

    def step(ins, dout):
        if args.case == "dense":
            out = dense_attention(*ins, window=args.window)
        elif args.case == "fused":
            slopes = alibi_slopes(args.heads).log()
            options = AttentionOptions(
                theta_alpha=slopes, theta_beta=torch.ones(args.heads), window=args.window, block_size=args.block
            )
            # as the model calls it: the fused op, at least 256 query rows per call
            out = dispatch.attention(*ins[:3], options)
            torch.autograd.grad(out, ins[:3], dout)
            return
        else:
            op = bam_attention_cpu if args.case == "c_tiles" else bam_attention
            options = AttentionOptions(
                theta_alpha=ins[3],
                theta_beta=ins[4],
                theta_mu=ins[5],
                ssmax_s=ins[6],
                window=args.window,
                block_size=args.block,
            )
            out = op(*ins[:3], options)
        torch.autograd.grad(out, ins, dout)

    step(*inputs(2 * args.block))  # warm-up, so one-time initialisation lands in the baseline
    ins, dout = inputs(args.n)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(ins, dout)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    step(ins, dout)
    ms = (time.perf_counter() - t0) * 1e3
    print(json.dumps({"peak_mib": (peak - base) / 1024, "ms": ms}))


def available_bytes():
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def measure(case, n, args):
    """Run one case in a fresh interpreter; returns its dict, or None if it was killed."""
    cmd = [sys.executable, os.path.abspath(__file__), "--case", case, "--n", str(n)]
    for key in ("heads", "dim", "block", "batch", "threads"):
        cmd += [f"--{key}", str(getattr(args, key))]
    if args.window is not None:
        cmd += ["--window", str(args.window)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--window", type=int, default=None, help="sliding window (both variants)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads; 1 keeps timings stable on a shared machine"
    )
    ap.add_argument("--case", choices=["tiled", "dense", "fused", "c_tiles"], help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        return run_case(args)

    print(
        f"B={args.batch} H={args.heads} D={args.dim} block={args.block} window={args.window} "
        f"threads={args.threads}, fp32, GGD prior + SSMax, forward+backward"
    )
    print(
        f"{'N':>7} {'tiled MiB':>10} {'dense MiB':>10} {'ratio':>7} {'tiled ms':>9} {'dense ms':>9}"
        f" {'fused MiB':>10} {'fused ms':>9} {'c_tiles MiB':>11} {'c_tiles ms':>10}"
    )
    for n in args.lengths:
        tiled = measure("tiled", n, args)
        fused = measure("fused", n, args)
        c_tiles = measure("c_tiles", n, args)
        need = DENSE_NN_TENSORS * args.batch * args.heads * n * n * 4
        dense = measure("dense", n, args) if need < 0.8 * available_bytes() else None
        dense_txt = "OOM/skip" if dense is None else f"{dense['peak_mib']:.1f}"
        ratio = "-" if dense is None or tiled is None else f"{dense['peak_mib'] / tiled['peak_mib']:.1f}x"
        t_mib = "failed" if tiled is None else f"{tiled['peak_mib']:.1f}"
        t_ms = "-" if tiled is None else f"{tiled['ms']:.0f}"
        d_ms = "-" if dense is None else f"{dense['ms']:.0f}"
        f_mib, f_ms = ("failed", "-") if fused is None else (f"{fused['peak_mib']:.1f}", f"{fused['ms']:.0f}")
        c_mib, c_ms = ("failed", "-") if c_tiles is None else (f"{c_tiles['peak_mib']:.1f}", f"{c_tiles['ms']:.0f}")
        print(
            f"{n:>7} {t_mib:>10} {dense_txt:>10} {ratio:>7} {t_ms:>9} {d_ms:>9} {f_mib:>10} {f_ms:>9}"
            f" {c_mib:>11} {c_ms:>10}",
            flush=True,
        )


if __name__ == "__main__":
    main()
