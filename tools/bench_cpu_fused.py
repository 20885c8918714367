"""The one-pass C forms of the RMS norm, the SwiGLU product and the rotary embedding (kernels/cpu_fused.py)
beside their PyTorch forms (megabam/model/layers.py, positional.py), forward + backward, in one process.

Shapes as in the tiny models' training step at 2,048 tokens (d 128, SwiGLU hidden 344, 4 heads of 32,
q and k as the view of the fused [q | k | v] projection that attention hands over). Rounds interleave
the two forms; the table gives the median time per call over rounds, the spread and the ratio.

    .venv/bin/python tools/bench_cpu_fused.py --tokens 2048 --rounds 9
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def cases(tokens: int):
    """(name, PyTorch form, C form) of fn() -> None running forward and backward once."""
    from megabam.kernels import cpu_fused
    from megabam.model.layers import rms_norm
    from megabam.model.positional import apply_rope, rope_rotation

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, 128, generator=g, requires_grad=True)
    w = torch.ones(128, requires_grad=True)
    dx = torch.randn(1, tokens, 128, generator=g)
    gate_up = torch.randn(1, tokens, 2 * 344, generator=g, requires_grad=True)
    dmlp = torch.randn(1, tokens, 344, generator=g)
    qkv = torch.randn(1, tokens, 12, 32, generator=g, requires_grad=True)
    drot = torch.randn(1, tokens, 8, 32, generator=g)
    rotation = rope_rotation(tokens, 32, 10000.0)

    def swiglu_pytorch():
        gate, up = gate_up.chunk(2, dim=-1)
        (F.silu(gate) * up).backward(dmlp)

    return [
        (
            f"RMS norm ({tokens} × 128)",
            lambda: rms_norm(x, w, 1e-5, "reference").backward(dx),
            lambda: cpu_fused.rms_norm(x, w, 1e-5).backward(dx),
        ),
        (
            f"SwiGLU product ([gate, up] {tokens} × 688)",
            swiglu_pytorch,
            lambda: cpu_fused.swiglu(gate_up).backward(dmlp),
        ),
        (
            f"rotary embedding (q, k: {tokens} × 8 × 32, a view of [q, k, v])",
            lambda: apply_rope(qkv[:, :, :8], rotation, "reference").backward(drot),
            lambda: cpu_fused.rope(qkv[:, :, :8], rotation).backward(drot),
        ),
    ]


def per_call_ms(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e3 * (time.perf_counter() - start) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=50, help="calls per round and form")
    args = parser.parse_args()
    from megabam.kernels import cpu_fused
    from megabam.parallel.threads import configure_cpu

    configure_cpu()
    if cpu_fused.library() is None:
        raise SystemExit("the C forms did not build (see the warning above)")
    print(f"{torch.get_num_threads()} threads, fp32, forward + backward, ms per call")
    print("| op | PyTorch form (median) | spread | C form (median) | spread | C × faster |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, pytorch, fused in cases(args.tokens):
        times = {"pytorch": [], "fused": []}
        for fn in (pytorch, fused):  # warm-up
            per_call_ms(fn, 5)
        for _ in range(args.rounds):
            times["pytorch"].append(per_call_ms(pytorch, args.calls))
            times["fused"].append(per_call_ms(fused, args.calls))
        a, b = (statistics.median(times[k]) for k in ("pytorch", "fused"))
        spread = {k: f"{min(v):.2f}–{max(v):.2f}" for k, v in times.items()}
        print(f"| {name} | {a:.2f} | {spread['pytorch']} | {b:.2f} | {spread['fused']} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
