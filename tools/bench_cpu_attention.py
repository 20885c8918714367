"""The CPU attention ops alone, forward + backward, beside torch's fused causal attention (the op a
Llama of the same shape runs), in one process.

Ops: `sdpa causal` (torch.nn.functional.scaled_dot_product_attention, is_causal, no prior: the peer),
`reference` (kernels/bam_attention.py, the tiled PyTorch op) and `c_tiles` (kernels/bam_attention_cpu.py,
the fused C kernel), the last two with a learned GGD prior and SSMax (gradients for q, k, v, θα, θβ
and s), and `c_tiles, no prior` (the C kernel on the peer's very call: what RoPE and NoPE run), fp32,
after megabam's CPU set-up (configure_cpu: threads sized, denormals flushed). Rounds interleave the
ops; the table gives the median over rounds (the first dropped as warm-up), the spread and the ratio
to the peer.

`--key-cap K` caps SSMax's key count at K in the heads whose prior decays (θβ > 0), as the model does
past the training length (model.attention.ssmax_key_cap; kernels/dispatch.py then runs the C kernel,
and ran the tiled op until 2026-12-06): `reference` and `c_tiles` with the cap.

    .venv/bin/python tools/bench_cpu_attention.py --shapes 8x256 1x2048 --rounds 15
    .venv/bin/python tools/bench_cpu_attention.py --shapes 1x1024 1x4096 --key-cap 256 --rounds 5
"""

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from megabam.kernels.bam_attention import AttentionOptions, bam_attention
from megabam.kernels.bam_attention_cpu import bam_attention_cpu, library
from megabam.parallel.threads import configure_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["8x256", "1x2048"], help="B x N per call")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=32, help="head width")
    parser.add_argument("--block", type=int, default=128, help="query rows per tile of the tiled reference op")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--key-cap", type=int, help="SSMax's key cap in the heads with θβ > 0 (default: none)")
    args = parser.parse_args()
    threads = configure_cpu()
    if library() is None:
        raise SystemExit("the C tiles could not be built (see the warning above)")
    H, D = args.heads, args.dim
    cap = "" if args.key_cap is None else f", SSMax's key cap {args.key_cap} where θβ > 0"
    print(f"fp32, {threads} threads, H {H}, D {D}, block {args.block}{cap}, forward + backward, ms per call")
    print("| B × N | op | ms (median) | spread | × sdpa causal time |")
    print("|---|---|---:|---:|---:|")
    for shape in args.shapes:
        B, N = (int(x) for x in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, N, D, generator=g).requires_grad_() for _ in range(3))
        # the `mixed` init's kind of heads: ALiBi-like, flat and inverted, with SSMax at 1/ln 256
        alpha = torch.full((H,), -1.0, requires_grad=True)
        beta = torch.tensor([1.0, 0.0, -0.5, 1.5] * (H // 4) + [1.0] * (H % 4), requires_grad=True)
        s = torch.full((H,), 0.18, requires_grad=True)
        key_cap = None
        if args.key_cap is not None:  # as megabam/model/attention.py makes it
            key_cap = torch.where(beta.detach() > 0, float(args.key_cap), math.inf)
        prior = AttentionOptions(
            theta_alpha=alpha, theta_beta=beta, ssmax_s=s, block_size=args.block, ssmax_key_cap=key_cap
        )
        ops = {
            "sdpa causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "reference": lambda: bam_attention(q, k, v, prior),
            "c_tiles": lambda: bam_attention_cpu(q, k, v, prior),
            "c_tiles, no prior": lambda: bam_attention_cpu(q, k, v),
        }
        times = {name: [] for name in ops}
        for _ in range(args.rounds + 1):
            for name, op in ops.items():
                t0 = time.perf_counter()
                op().square().sum().backward()
                times[name].append(1e3 * (time.perf_counter() - t0))
        peer = statistics.median(times["sdpa causal"][1:])
        for name, ts in times.items():
            ts = ts[1:]
            print(
                f"| {B} × {N} | {name} | {statistics.median(ts):.1f} | {min(ts):.1f}–{max(ts):.1f} | "
                f"{statistics.median(ts) / peer:.2f} |"
            )


if __name__ == "__main__":
    main()
