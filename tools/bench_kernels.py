"""Speed of the fused Triton BAM attention kernel against PyTorch SDPA, FlexAttention and the reference.

Prepared for one GPU (H200; estimated, not yet measured, at about 5 minutes with the defaults, under
the 8 the kernels issue allows; --variants drops variants if time is short):

    python tools/bench_kernels.py

1. Correctness first: the kernel (bf16, GGD prior + SSMax, documents, a window) and FlexAttention with
   the same prior against kernels/bam_attention.py (fp32 on the same bf16 values), output and input
   gradients; the script stops with exit code 1 if either is off by more than 3e-2 relative.
2. Timing, bf16, head dim 128, batch 1 × 16 heads, GGD prior + SSMax, fully causal, for N in --lengths:
   bam       the fused kernel (kernels/bam_attention_triton.py), prior and SSMax inside the tile loop;
   sdpa      torch SDPA restricted to the flash backend, no prior and no SSMax: the speed ceiling;
   flex      torch.compile'd FlexAttention with the prior and SSMax as a score_mod, causal block mask;
   ref       the pure-PyTorch tiled op (kernels/bam_attention.py), query blocks of 128.
   Then the kernel with sliding windows --windows against full causal at the longest length.
Each line is timed forward and forward+backward (median of CUDA-event timings). TFLOP/s count the
useful work, 4·D·Σ n_i per head forward (n_i keys row i sees) and 2.5× that more for the backward,
the same for every variant, so the TFLOP/s ratio is the speed ratio. A variant that fails prints
its error and gets NaN in its cell rather than ending the run.

--dry-run runs the same code path on CPU at tiny shapes (fp32, the Triton interpreter, eager
FlexAttention) to prove it end to end without a GPU; its timings mean nothing.
"""
import argparse
import math
import os
import statistics
import sys
import time

HEADS, BATCH, DIM = 16, 1, 128
VARIANTS = ("bam", "sdpa", "flex", "ref")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    p.add_argument("--windows", type=int, nargs="+", default=[128, 2048])
    p.add_argument("--heads", type=int, default=HEADS)
    p.add_argument("--dim", type=int, default=DIM)
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per cell (median)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                   help="which variants to time (the kernel's full causal run is always timed)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    args = p.parse_args()
    if args.dry_run:
        args.lengths, args.windows, args.heads, args.dim, args.reps = [32, 48], [8, 16], 2, 16, 1
    return args


def flops(n: int, window, heads: int, dim: int, backward: bool) -> float:
    keys = sum(min(i + 1, window or n) for i in range(n))  # Σ n_i over the rows
    return 4 * dim * keys * heads * BATCH * (3.5 if backward else 1.0)


class Bench:
    def __init__(self, args):
        import torch
        self.torch, self.args, self.start = torch, args, time.perf_counter()
        self.device = "cpu" if args.dry_run else "cuda"
        # The interpreter's bf16 arithmetic is wrong: the dry run uses fp32.
        self.dtype = torch.float32 if args.dry_run else torch.bfloat16
        from kernels.bam_attention import bam_attention
        from kernels.bam_attention_triton import bam_attention_triton
        self.reference, self.fused = bam_attention, bam_attention_triton
        from torch.nn.attention.flex_attention import flex_attention
        torch._dynamo.config.cache_size_limit = 64  # one compile per length and pass, not a fallback
        self._flex_fn = flex_attention if args.dry_run else torch.compile(flex_attention, dynamic=False)
        self._flex_cache = {}

    def inputs(self, n: int, heads: int):
        """q, k, v and per-head (θα, θβ, θμ, s) spread over heads, all requiring grad."""
        torch = self.torch
        g = torch.Generator(device=self.device).manual_seed(n)
        qkv = [torch.randn(BATCH, heads, n, self.args.dim, generator=g, device=self.device, dtype=self.dtype)
               for _ in range(3)]
        theta = [torch.linspace(lo, hi, heads, device=self.device)
                 for lo, hi in ((-3.0, 0.0), (-0.5, 1.5), (-0.3, 0.3), (0.8, 1.2))]
        return [t.requires_grad_() for t in qkv + theta]

    # --- the variants: each maps (inputs, window) to the output --------------------------------

    def bam(self, ins, window):
        return self.fused(*ins[:3], theta_alpha=ins[3], theta_beta=ins[4], theta_mu=ins[5],
                          ssmax_s=ins[6], window=window)

    def ref(self, ins, window):
        return self.reference(*ins[:3], theta_alpha=ins[3], theta_beta=ins[4], theta_mu=ins[5],
                              ssmax_s=ins[6], window=window, block_size=128)

    def sdpa(self, ins, window):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        assert window is None, "SDPA has no sliding window"
        backends = [SDPBackend.FLASH_ATTENTION] if self.device == "cuda" else [SDPBackend.MATH]
        with sdpa_kernel(backends):
            return self.torch.nn.functional.scaled_dot_product_attention(*ins[:3], is_causal=True)

    def flex(self, ins, window):
        """FlexAttention with the BAM prior and SSMax in a score_mod (the published BAM code's route).

        θ and s enter as constants (only q, k, v get gradients), which spares Flex the per-head
        reductions the kernel always does: the comparison favours Flex. The score_mod and block mask
        are built once per case, so the compiled function is not re-traced for every call.
        """
        torch = self.torch
        from torch.nn.attention.flex_attention import create_block_mask
        if self.device == "cpu":  # Flex has no backward on CPU: forward only there
            ins = [t.detach() for t in ins]
        n = ins[0].shape[-2]
        cached = self._flex_cache.get((n, window))
        if cached is None or cached[0] is not ins[3]:
            alpha, beta, s = (t.detach() for t in (ins[3], ins[4], ins[6]))
            mu = 2 * torch.sinh(ins[5].detach())
            log_n = torch.log(torch.arange(1, n + 1, device=self.device).clamp(max=window or n).float())

            def score_mod(score, b, h, i, j):
                d = (j - i).float() - mu[h]
                expo = torch.clamp(alpha[h] + beta[h] * torch.log(d.abs() + 1e-5), max=60.0)
                return (score - torch.exp(expo)) * s[h] * log_n[i]

            def mask(b, h, i, j):
                return (j <= i) & (i - j < (window or n))

            block_mask = create_block_mask(mask, None, None, n, n, device=self.device)
            self._flex_cache[(n, window)] = (ins[3], score_mod, block_mask)
        _, score_mod, block_mask = self._flex_cache[(n, window)]
        return self._flex_fn(*ins[:3], score_mod=score_mod, block_mask=block_mask)

    # --- measuring ------------------------------------------------------------------------------

    def time_ms(self, fn, ins, window, backward: bool) -> float:
        torch = self.torch
        dout = torch.randn(ins[0].shape, device=self.device, dtype=self.dtype)

        def step():
            out = fn(ins, window)
            if backward:
                torch.autograd.grad(out, ins[:3], dout)

        step()  # warm-up: autotuning, compilation
        times = []
        for _ in range(self.args.reps):
            if self.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                step()
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    def check(self) -> bool:
        """The kernel and Flex vs the reference on the same values; True when both are close."""
        torch = self.torch
        # The first timed shape, so compiled Flex and the autotuned kernel are reused by the timings.
        n = min(self.args.lengths)
        ins = self.inputs(n, self.args.heads)
        doc = torch.arange(n, device=self.device).div(n // 3 + 1, rounding_mode="floor")[None]
        dout = torch.randn(ins[0].shape, device=self.device, dtype=self.dtype)
        ref_ins = [t.detach().float().requires_grad_() for t in ins]
        kw = dict(theta_alpha=ref_ins[3], theta_beta=ref_ins[4], theta_mu=ref_ins[5], ssmax_s=ref_ins[6])
        ok = True
        cases = [("bam", lambda x, w: self.fused(*x[:3], theta_alpha=x[3], theta_beta=x[4], theta_mu=x[5],
                                                  ssmax_s=x[6], doc_ids=doc, window=w), doc, n // 4),
                 ("flex", self.flex, None, None)][:2 if "flex" in self.args.variants else 1]
        for name, fn, doc_ids, window in cases:
            want = self.reference(*ref_ins[:3], **kw, doc_ids=doc_ids, window=window, block_size=128)
            want_grads = torch.autograd.grad(want, ref_ins[:3], dout.float())
            got = []
            try:  # a failing variant is reported; only the kernel's failure stops the run
                got.append(fn(ins, window))
                got += torch.autograd.grad(got[0], ins[:3], dout)
            except Exception as e:  # noqa: BLE001
                print(f"check {name}: failed: {type(e).__name__}: {str(e).splitlines()[0]}")
                ok = ok and name != "bam"
            for label, a, b in zip(["out", "dq", "dk", "dv"], got, (want, *want_grads)):
                err = ((a.float() - b).abs().max() / (1 + b.abs().max())).item()
                good = err <= 3e-2
                ok = ok and good
                print(f"check {name} {label}: max rel err {err:.2e} {'ok' if good else 'FAIL'}")
        return ok

    def run(self):
        torch, a = self.torch, self.args
        print(f"device: {torch.cuda.get_device_name() if self.device == 'cuda' else 'cpu (dry run)'}, "
              f"torch {torch.__version__}, dtype {str(self.dtype).split('.')[-1]}, "
              f"B={BATCH} H={a.heads} D={a.dim}")
        if not self.check():
            print("correctness check failed: no timings")
            sys.exit(1)
        rows = []
        longest = max(a.lengths)
        names = ["bam"] + [v for v in a.variants if v != "bam"]
        cases = [(n, None, name) for n in a.lengths for name in names]
        cases += [(longest, w, "bam") for w in a.windows]
        results = {}
        for n, window, name in cases:
            ins = self.inputs(n, a.heads)
            for backward in (False, True):
                try:
                    ms = self.time_ms(getattr(self, name), ins, window, backward)
                except Exception as e:  # noqa: BLE001 - one failing variant must not end the table
                    ms = math.nan
                    print(f"{name} N={n} w={window}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                results[(n, window, name, backward)] = ms
                tflops = flops(n, window, a.heads, a.dim, backward) / (ms * 1e9)
                rows.append((n, window, name, backward, ms, tflops))
            del ins
            if self.device == "cuda":
                torch.cuda.empty_cache()
        print_table(rows, results, longest)
        print(f"total {time.perf_counter() - self.start:.0f} s")


def print_table(rows, results, longest):
    """One table: time, TFLOP/s and the ratios the issue's targets are stated in."""
    print("\n| N | window | pass | variant | ms | TFLOP/s | ratio |")
    print("| ---: | ---: | --- | --- | ---: | ---: | --- |")
    for n, window, name, backward, ms, tflops in rows:
        full = results[(n, None, "bam", backward)]
        if window is not None:  # the kernel with a window against itself fully causal
            ratio = f"{full / ms:.2f}× faster than full causal"
        elif name != "bam":
            ratio = f"bam is {ms / full:.2f}× as fast"
        else:
            ratio = ""
        print(f"| {n} | {window or 'causal'} | {'fwd+bwd' if backward else 'fwd'} | {name} | "
              f"{ms:.3f} | {tflops:.1f} | {ratio} |")
    print(f"\nTargets at N={longest}: bam ≥ 0.9× sdpa's speed and ≥ 1.5× flex's; "
          "window 128 ≥ 20× faster than full causal.")


def main():
    args = parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    Bench(args).run()


if __name__ == "__main__":
    main()
