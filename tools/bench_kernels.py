"""Speed of the fused Triton BAM attention kernel against PyTorch SDPA, FlexAttention and the reference,
and of the chunkwise mLSTM kernels against the PyTorch chunkwise form.

Prepared for one GPU (H200; estimated, not yet measured, at about 5.5 minutes for attention, GQA rows
included, and 1.5 for the mLSTM with the defaults, under the 8 the kernels issue allows; --variants
drops attention variants, --gqa with no value the GQA rows and --mlstm-lengths with no value the
mLSTM rows if time is short):

    python tools/bench_kernels.py

1. Correctness first: the kernel (bf16, GGD prior + SSMax, documents, a window), the dispatch's
   FlexAttention op with the same prior, SSMax and masks held fixed, and its SDPA op (SSMax, no prior,
   fully causal) against kernels/bam_attention.py (fp32 on the same bf16 values), output and input
   gradients; the script stops with exit code 1 if any is off by more than 3e-2 relative.
2. Timing, bf16, head dim 128, batch 1 × 16 heads, GGD prior + SSMax, fully causal, for N in --lengths:
   bam       the fused kernel (kernels/bam_attention_triton.py), prior (an offset table) and SSMax in the tile loop;
   sdpa      torch SDPA restricted to the flash backend, no prior and no SSMax: the speed ceiling;
   flex      the FlexAttention op the dispatch runs on CUDA (kernels/bam_attention_torch.py: compiled,
             the prior a score_mod, SSMax folded into q), prior and SSMax held fixed;
   ref       the pure-PyTorch tiled op (kernels/bam_attention.py), query blocks of 128.
   Then the kernel with sliding windows --windows against full causal at the longest length, Flex
   with the same windows (SWAX's path) against the kernel, what a drawn window costs the Flex op
   (its block mask's first build, a later draw's lookup), and
   grouped-query attention at the longest length (--gqa: 16 query heads sharing 4 key/value heads,
   fully causal; checked against the reference first): the kernel ("bam gqa 16/4", ratio to the
   kernel with 16 kv heads) and SDPA flash with enable_gqa=True ("sdpa gqa 16/4"; skipped when
   this torch's SDPA has no enable_gqa).
3. mLSTM, the model's shape per TP rank: batch 1 × 8 heads, d_qk 128, d_v 256, chunk 64, N in
   --mlstm-lengths (16,384). First the kernels (fp32 and bf16 q, k, v) against the PyTorch chunkwise
   form (kernels/mlstm.py, fp32 on the same values): h and the gradients of q, k, v, i, f, stopping
   with exit code 1 beyond 1e-3 (fp32) or, for bf16, 3e-2 relative or twice what the reference itself
   moves with TF32 products (check_mlstm says why). --mlstm-configs instead checks each kernel with
   each of its autotune configs pinned in turn, twice (bitwise repeat), and exits. Then, forward and
   forward+backward (gradients of q, k, v, i, f):
   triton    the kernels (kernels/mlstm_triton.py) on fp32 inputs (exact fp32 dots; fp32 training)
             and on bf16 inputs (TF32 dots, as bf16 training feeds them; state and accumulation
             fp32 either way);
   ref       the PyTorch chunkwise form on fp32 inputs, a Python loop over chunks.
Each line is timed forward and forward+backward (median of CUDA-event timings). TFLOP/s count the
useful work, the same for every variant of an op, so the TFLOP/s ratio is the speed ratio: for
attention 4·D·Σ n_i per head forward (n_i keys row i sees) and 2.5× that more for the backward; for
the mLSTM what MLstm.mixing_flops counts, N·(chunk·(d_qk + d_v) + 4·d_qk·d_v) per head forward
and 2× that more for the backward. A variant that fails prints its error and gets NaN in its cell
rather than ending the run.

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
MLSTM_GRADS = ("h", "dq", "dk", "dv", "di", "df")
MLSTM_HEADS, MLSTM_DIMS, MLSTM_CHUNK = 8, (128, 256), 64


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    p.add_argument("--windows", type=int, nargs="+", default=[128, 2048])
    p.add_argument("--heads", type=int, default=HEADS)
    p.add_argument("--dim", type=int, default=DIM)
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per cell (median)")
    p.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=VARIANTS,
        help="which variants to time (the kernel's full causal run is always timed)",
    )
    p.add_argument(
        "--gqa",
        type=int,
        nargs="*",
        default=[HEADS, 4],
        metavar="HEADS",
        help="query heads and key/value heads of the GQA rows (none: no GQA rows)",
    )
    p.add_argument(
        "--mlstm-lengths",
        type=int,
        nargs="*",
        default=[16384],
        help="sequence lengths of the mLSTM rows (none: no mLSTM rows)",
    )
    p.add_argument(
        "--mlstm-configs",
        action="store_true",
        help="only check the mLSTM kernels with each autotune config pinned in turn (then exit)",
    )
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    args = p.parse_args()
    args.mlstm_shape = (MLSTM_HEADS, *MLSTM_DIMS, MLSTM_CHUNK)  # heads, d_qk, d_v, chunk
    if args.dry_run:
        args.lengths, args.windows, args.heads, args.dim, args.reps = [32, 48], [8, 16], 2, 16, 1
        args.mlstm_lengths, args.mlstm_shape = [40], (2, 16, 32, 16)
        args.gqa = args.gqa and [4, 2]
    if args.gqa and (len(args.gqa) != 2 or args.gqa[0] % args.gqa[1]):
        p.error(f"--gqa takes query heads and key/value heads dividing them, got {args.gqa}")
    return args


def flops(n: int, window, heads: int, dim: int, backward: bool) -> float:
    keys = sum(min(i + 1, window or n) for i in range(n))  # Σ n_i over the rows
    return 4 * dim * keys * heads * BATCH * (3.5 if backward else 1.0)


def mlstm_flops(n: int, shape, backward: bool) -> float:
    heads, dqk, dv, chunk = shape
    return n * (min(chunk, n) * (dqk + dv) + 4 * dqk * dv) * heads * BATCH * (3.0 if backward else 1.0)


def median_ms(step, reps: int, cuda: bool) -> float:
    """Median milliseconds of `step()` over `reps` calls after one warm-up call (autotuning,
    compilation): timed by CUDA events on a GPU, by the wall clock on CPU. tools/bench_recurrent_kernels.py
    times its cells with it too."""
    import torch  # as everywhere in this file: after the environment (TRITON_INTERPRET) is set

    step()
    times = []
    for _ in range(reps):
        if cuda:
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


class Bench:
    def __init__(self, args):
        import torch

        self.torch, self.args, self.start = torch, args, time.perf_counter()
        self.device = "cpu" if args.dry_run else "cuda"
        # The interpreter's bf16 arithmetic is wrong: the dry run uses fp32.
        self.dtype = torch.float32 if args.dry_run else torch.bfloat16
        from megabam.kernels.bam_attention import AttentionOptions, bam_attention
        from megabam.kernels.bam_attention_triton import bam_attention_triton

        self.reference, self.fused, self.options = bam_attention, bam_attention_triton, AttentionOptions
        from megabam.kernels.mlstm import mlstm_chunkwise
        from megabam.kernels.mlstm_triton import mlstm_chunkwise_triton

        self.mlstm_ops = {"triton": mlstm_chunkwise_triton, "ref": mlstm_chunkwise}
        from megabam.kernels.bam_attention_torch import bam_attention_flex, bam_attention_sdpa_causal

        self.flex_op, self.sdpa_causal = bam_attention_flex, bam_attention_sdpa_causal
        torch._dynamo.config.cache_size_limit = 64  # one compile per length and pass, not a fallback

    def inputs(self, n: int, heads: int, kv_heads=None):
        """q, k, v (k, v with kv_heads heads if given: GQA) and per-query-head (θα, θβ, θμ, s) spread
        over heads, all requiring grad."""
        torch = self.torch
        g = torch.Generator(device=self.device).manual_seed(n)
        qkv = [
            torch.randn(BATCH, h, n, self.args.dim, generator=g, device=self.device, dtype=self.dtype)
            for h in (heads, kv_heads or heads, kv_heads or heads)
        ]
        theta = [
            torch.linspace(lo, hi, heads, device=self.device)
            for lo, hi in ((-3.0, 0.0), (-0.5, 1.5), (-0.3, 0.3), (0.8, 1.2))
        ]
        return [t.requires_grad_() for t in qkv + theta]

    def options_of(self, ins, prior=True, **masks):
        """The attention options of a call with the θα, θβ, θμ (unless not `prior`) and s of `ins` (3..6)
        and `masks`."""
        theta = dict(theta_alpha=ins[3], theta_beta=ins[4], theta_mu=ins[5]) if prior else {}
        return self.options(**theta, ssmax_s=ins[6], **masks)

    # --- the variants: each maps (inputs, window) to the output --------------------------------

    def bam(self, ins, window):
        return self.fused(*ins[:3], self.options_of(ins, window=window))

    def ref(self, ins, window):
        return self.reference(*ins[:3], self.options_of(ins, window=window, block_size=128))

    def sdpa(self, ins, window):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        assert window is None, "SDPA has no sliding window"
        backends = [SDPBackend.FLASH_ATTENTION] if self.device == "cuda" else [SDPBackend.MATH]
        gqa = {"enable_gqa": True} if ins[1].shape[1] != ins[0].shape[1] else {}
        with sdpa_kernel(backends):
            return self.torch.nn.functional.scaled_dot_product_attention(*ins[:3], is_causal=True, **gqa)

    def sdpa_has_gqa(self) -> bool:
        """Whether this torch's SDPA takes enable_gqa (2.5 on)."""
        return "enable_gqa" in (self.torch.nn.functional.scaled_dot_product_attention.__doc__ or "")

    def flex(self, ins, window, doc_ids=None):
        """The FlexAttention op the dispatch runs on CUDA (kernels/bam_attention_torch.py: compiled, the
        block mask cached per length and window, the prior from its per-offset table in a score_mod,
        SSMax folded into q and scaling the prior there) with the prior and SSMax fixed, as the
        dispatch sends it calls: only q, k, v get gradients, which spares Flex the per-head reductions
        the kernel always does, so the comparison favours Flex."""
        if self.device == "cpu":  # Flex has no backward on CPU: forward only there
            ins = [t.detach() for t in ins]
        fixed = ins[:3] + [t.detach() for t in ins[3:]]
        return self.flex_op(*ins[:3], self.options_of(fixed, window=window, doc_ids=doc_ids))

    def sdpa_cuda(self, ins):
        """The SDPA op the dispatch runs on CUDA for full causal attention without a prior: one call, SSMax
        folded into q, torch's pick of kernel."""
        return self.sdpa_causal(*ins[:3], self.options_of(ins, prior=False))

    # --- measuring ------------------------------------------------------------------------------

    def time_ms(self, fn, ins, window, backward: bool, wrt: int = 3) -> float:
        """Median time of fn(ins, window), with the gradients of ins[:wrt] if backward."""
        torch = self.torch
        douts = []

        def step():
            out = fn(ins, window)
            if backward:
                if not douts:
                    douts.append(torch.randn(out.shape, device=self.device, dtype=out.dtype))
                torch.autograd.grad(out, ins[:wrt], douts[0])

        return median_ms(step, self.args.reps, self.device == "cuda")

    def check(self) -> bool:
        """The kernel (also with GQA and with SSMax's key cap) and Flex vs the reference on the same
        values; True when all are close."""
        torch = self.torch
        # The first timed shape, so compiled Flex and the autotuned kernel are reused by the timings.
        n = min(self.args.lengths)
        doc = torch.arange(n, device=self.device).div(n // 3 + 1, rounding_mode="floor")[None]

        def setup(heads, kv_heads=None):
            """Inputs, their fp32 copies and an output gradient."""
            ins = self.inputs(n, heads, kv_heads)
            ref_ins = [t.detach().float().requires_grad_() for t in ins]
            return ins, ref_ins, torch.randn(ins[0].shape, device=self.device, dtype=self.dtype)

        masks = dict(doc_ids=doc, window=n // 4)

        def bam(x):
            return self.fused(*x[:3], self.options_of(x, **masks))

        # SSMax's key count capped at n/8 in every head (AttentionOptions.ssmax_key_cap: evaluation past
        # the training length, which the dispatch sends to the kernel on CUDA).
        capped = dict(masks, ssmax_key_cap=torch.full((self.args.heads,), n / 8, device=self.device))

        ok = True
        mha = setup(self.args.heads)
        cases = [("bam", bam, masks, *mha)]
        cases.append(("bam key cap", lambda x: self.fused(*x[:3], self.options_of(x, **capped)), capped, *mha))
        if "flex" in self.args.variants:
            cases.append(("flex", lambda x: self.flex(x, n // 4, doc), masks, *mha))
        if "sdpa" in self.args.variants:
            cases.append(("sdpa_cuda", self.sdpa_cuda, dict(prior=False), *mha))
        if self.args.gqa:  # the kernel with k, v shared by groups of query heads
            cases.append((f"bam gqa {self.args.gqa[0]}/{self.args.gqa[1]}", bam, masks, *setup(*self.args.gqa)))
        for name, fn, fields, ins, ref_ins, dout in cases:
            want = self.reference(*ref_ins[:3], self.options_of(ref_ins, block_size=128, **fields))
            want_grads = torch.autograd.grad(want, ref_ins[:3], dout.float())
            got = []
            try:  # a failing variant is reported; only the kernel's failure stops the run
                got.append(fn(ins))
                got += torch.autograd.grad(got[0], ins[:3], dout)
            except Exception as e:  # noqa: BLE001
                print(f"check {name}: failed: {type(e).__name__}: {str(e).splitlines()[0]}")
                ok = ok and not name.startswith("bam")
            for label, a, b in zip(["out", "dq", "dk", "dv"], got, (want, *want_grads)):
                err = ((a.float() - b).abs().max() / (1 + b.abs().max())).item()
                good = err <= 3e-2
                ok = ok and good
                print(f"check {name} {label}: max rel err {err:.2e} {'ok' if good else 'FAIL'}")
        return ok

    def run(self):
        torch, a = self.torch, self.args
        print(
            f"device: {torch.cuda.get_device_name() if self.device == 'cuda' else 'cpu (dry run)'}, "
            f"torch {torch.__version__}, dtype {str(self.dtype).split('.')[-1]}, "
            f"B={BATCH} H={a.heads} D={a.dim}"
        )
        if a.mlstm_configs:
            sys.exit(0 if self.check_mlstm_configs() else 1)
        # `&`, not `and`: both checks run and print whatever the first finds.
        if not (self.check() & (not a.mlstm_lengths or self.check_mlstm())):
            print("correctness check failed: no timings")
            sys.exit(1)
        rows = []
        longest = max(a.lengths)
        names = ["bam"] + [v for v in a.variants if v != "bam"]
        cases = [(n, None, name) for n in a.lengths for name in names]
        cases += [(longest, w, name) for name in ("bam", "flex") if name in names for w in a.windows]
        if a.gqa:
            gqa = f" gqa {a.gqa[0]}/{a.gqa[1]}"
            cases.append((longest, None, "bam" + gqa))
            if "sdpa" in a.variants and self.sdpa_has_gqa():
                cases.append((longest, None, "sdpa" + gqa))
            elif "sdpa" in a.variants:
                print(f"sdpa{gqa}: this torch's SDPA has no enable_gqa, cell skipped")
        results = {}
        for n, window, name in cases:
            variant = name.split(" ")[0]
            ins = self.inputs(n, *a.gqa) if name != variant else self.inputs(n, a.heads)
            heads = ins[0].shape[1]
            for backward in (False, True):
                try:
                    ms = self.time_ms(getattr(self, variant), ins, window, backward)
                except Exception as e:  # noqa: BLE001 - one failing variant must not end the table
                    ms = math.nan
                    print(f"{name} N={n} w={window}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                results[(n, window, name, backward)] = ms
                tflops = flops(n, window, heads, a.dim, backward) / (ms * 1e9)
                rows.append((n, window, name, backward, ms, tflops))
            del ins
            if self.device == "cuda":
                torch.cuda.empty_cache()
        print_table(rows, results, longest)
        if "flex" in a.variants and a.windows:
            self.window_draw_cost(longest)
        if a.mlstm_lengths:
            self.run_mlstm()
        print(f"total {time.perf_counter() - self.start:.0f} s")

    def window_draw_cost(self, n: int):
        """What SWAX's per-step window draw costs the Flex op: a window's first step builds its block
        mask (cached per length and window, kernels/bam_attention_torch.py), each later draw of it looks
        the mask up; neither recompiles FlexAttention (a new window is new tensors of the same shapes)."""
        from megabam.kernels.bam_attention_torch import causal_block_mask

        sync = self.torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        causal_block_mask.cache_clear()
        for window in self.args.windows:
            times = []
            for _ in range(2):  # the first draw of this window, then a later one
                sync()
                t0 = time.perf_counter()
                causal_block_mask(n, window, self.torch.device(self.device))
                sync()
                times.append(1e3 * (time.perf_counter() - t0))
            print(f"window draw at N={n}, w={window}: first {times[0]:.2f} ms (block mask), later {times[1]:.4f} ms")

    # --- the chunkwise mLSTM ------------------------------------------------------------------

    def mlstm_inputs(self, n: int, dtype):
        """q, k, v in dtype and fp32 gates (forget gates near 1, as trained), all requiring grad."""
        torch = self.torch
        heads, dqk, dv, _ = self.args.mlstm_shape
        g = torch.Generator(device=self.device).manual_seed(n)
        shape = (BATCH, heads, n)
        q, k = (torch.randn(*shape, dqk, generator=g, device=self.device).to(dtype) for _ in range(2))
        v = torch.randn(*shape, dv, generator=g, device=self.device).to(dtype)
        i = 2 * torch.randn(shape, generator=g, device=self.device) - 2
        f = 3 + torch.randn(shape, generator=g, device=self.device)
        return [t.requires_grad_() for t in (q, k, v, i, f)]

    def mlstm(self, name: str):
        """The variant `name` as fn(ins, window) -> h, for time_ms."""
        op, chunk = self.mlstm_ops[name], self.args.mlstm_shape[3]
        return lambda ins, window: op(*ins, 1e-6, chunk)[0]

    MLSTM_TOL = {"float32": 1e-3, "bfloat16": 3e-2}

    def mlstm_case(self, dtype):
        """Inputs, the incoming gradient and the reference's h and input gradients (fp32, same values)."""
        torch = self.torch
        ins = self.mlstm_inputs(min(self.args.mlstm_lengths), dtype)
        ref_ins = [t.detach().float().requires_grad_() for t in ins]
        want = self.mlstm("ref")(ref_ins, None)
        dout = torch.randn(want.shape, device=self.device, generator=torch.Generator(self.device).manual_seed(0))
        return ins, dout, [want.detach(), *torch.autograd.grad(want, ref_ins, dout)]

    def mlstm_tf32_floor(self, ins, dout, want):
        """How far the reference itself moves when its matrix products round as the kernels' do on
        bf16 inputs (TF32): the gradients' conditioning on these inputs (0 on CPU)."""
        torch = self.torch
        ref_ins = [t.detach().float().requires_grad_() for t in ins]
        before, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, True
        try:
            h = self.mlstm("ref")(ref_ins, None)
            got = [h.detach(), *torch.autograd.grad(h, ref_ins, dout)]
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before
        return [((a - b).abs().max() / (1 + b.abs().max())).item() for a, b in zip(got, want)]

    def mlstm_errors(self, ins, dout, want):
        """The kernels' h and input gradients, and each one's max error relative to the reference."""
        got = self.mlstm("triton")(ins, None)
        got = [got.detach(), *self.torch.autograd.grad(got, ins, dout.to(got.dtype))]
        errs = [((a.float() - b).abs().max() / (1 + b.abs().max())).item() for a, b in zip(got, want)]
        return got, errs

    def check_mlstm(self) -> bool:
        """The kernels (fp32 and bf16 inputs) vs the PyTorch chunkwise form in fp32 on the same values.

        On bf16 inputs the kernels' products round as TF32, and on these random inputs that alone moves
        the gradients by up to 6e-2 (measured on an H200: the reference with TF32 products, against
        itself in fp32, 2.5-6.3e-2 for dq/dk/di over six incoming gradients; rows near the kink of
        max(|q·n|, exp(-m)) and with small denominators amplify it). So a bf16 gradient passes within
        3e-2 or within twice that floor, printed beside it."""
        ok = True
        for dtype in (self.torch.float32, self.torch.bfloat16):
            name = str(dtype).split(".")[-1]
            case = self.mlstm_case(dtype)
            _, errs = self.mlstm_errors(*case)
            floors = self.mlstm_tf32_floor(*case) if dtype != self.torch.float32 else [0.0] * len(errs)
            for label, err, floor in zip(MLSTM_GRADS, errs, floors):
                good = err <= max(self.MLSTM_TOL[name], 2 * floor)
                ok = ok and good
                note = f" (reference with TF32 products: {floor:.2e})" if dtype != self.torch.float32 else ""
                print(f"check mlstm {name} {label}: max rel err {err:.2e}{note} {'ok' if good else 'FAIL'}")
        return ok

    def check_mlstm_configs(self) -> bool:
        """Each mLSTM kernel with each of its autotune configs pinned (the other kernels at their first),
        fp32 and bf16 inputs, twice each: which config, if any, is off, and whether a result repeats
        bit for bit (a race would not). Autotuning picks by speed, so a run meets whichever is fastest."""
        from megabam.kernels import mlstm_triton as mt

        kernels = {
            k: getattr(mt, k) for k in ("fwd_state_kernel", "fwd_chunk_kernel", "bwd_state_kernel", "bwd_chunk_kernel")
        }
        saved = {k: list(kern.configs) for k, kern in kernels.items()}
        # bf16 first: a config that faults (fp32 ones were seen to) ends the process, so it goes last.
        cases = {str(d).split(".")[-1]: self.mlstm_case(d) for d in (self.torch.bfloat16, self.torch.float32)}
        print("\n| kernel | config | inputs | " + " | ".join(MLSTM_GRADS) + " | repeats bitwise | verdict |")
        print("| --- | --- | --- |" + " ---: |" * len(MLSTM_GRADS) + " --- | --- |")
        ok = True
        for name, kern in kernels.items():
            for cfg in saved[name]:
                for dtype, case in cases.items():
                    prec = "ieee" if dtype == "float32" else "tf32"
                    prune = getattr(kern, "early_config_prune", None)
                    if prune and not prune([cfg], {}, PRECISION=prec):
                        continue  # the kernel never runs this config on these inputs
                    for k2, kern2 in kernels.items():
                        kern2.configs = [cfg] if k2 == name else saved[k2][:1]
                        kern2.cache.clear()
                    first, errs = self.mlstm_errors(*case)
                    again, _ = self.mlstm_errors(*case)
                    same = all(self.torch.equal(a, b) for a, b in zip(first, again))
                    good = same and all(e <= self.MLSTM_TOL[dtype] for e in errs)
                    ok = ok and good
                    label = f"BLOCK_DV {cfg.kwargs['BLOCK_DV']}, {cfg.num_warps} warps, {cfg.num_stages} stages"
                    cells = " | ".join(f"{e:.1e}" for e in errs)
                    print(f"| {name} | {label} | {dtype} | {cells} | {same} | {'ok' if good else 'FAIL'} |")
        for name, kern in kernels.items():
            kern.configs = saved[name]
            kern.cache.clear()
        return ok

    def run_mlstm(self):
        torch, a = self.torch, self.args
        heads, dqk, dv, chunk = a.mlstm_shape
        print(f"\nmLSTM chunkwise: B={BATCH} H={heads} d_qk={dqk} d_v={dv} chunk={chunk}")
        print("\n| N | pass | variant | inputs | ms | TFLOP/s | ratio |")
        print("| ---: | --- | --- | --- | ---: | ---: | --- |")
        for n in a.mlstm_lengths:
            ref_ms = {}
            for name, dtype in (("ref", torch.float32), ("triton", torch.float32), ("triton", torch.bfloat16)):
                ins = self.mlstm_inputs(n, dtype)
                for backward in (False, True):
                    try:
                        ms = self.time_ms(self.mlstm(name), ins, None, backward, wrt=5)
                    except Exception as e:  # noqa: BLE001 - one failing variant must not end the table
                        ms = math.nan
                        print(f"mlstm {name} N={n}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                    if name == "ref":
                        ref_ms[backward] = ms
                    ratio = f"{ref_ms[backward] / ms:.2f}× the ref's speed" if name != "ref" else ""
                    tflops = mlstm_flops(n, a.mlstm_shape, backward) / (ms * 1e9)
                    print(
                        f"| {n} | {'fwd+bwd' if backward else 'fwd'} | {name} | {str(dtype).split('.')[-1]} | "
                        f"{ms:.3f} | {tflops:.2f} | {ratio} |"
                    )
                del ins
                if self.device == "cuda":
                    torch.cuda.empty_cache()


def print_table(rows, results, longest):
    """One table: time, TFLOP/s and the ratios the issue's targets are stated in."""
    # TFLOP/s count useful work per query head, so the ratio holds for any pair of head counts.
    mha_tflops = {
        (n, backward): tflops for n, window, name, backward, _, tflops in rows if name == "bam" and window is None
    }
    print("\n| N | window | pass | variant | ms | TFLOP/s | ratio |")
    print("| ---: | ---: | --- | --- | ---: | ---: | --- |")
    for n, window, name, backward, ms, tflops in rows:
        full = results[(n, None, "bam", backward)]
        if window is not None and name != "bam":  # Flex with a window (SWAX's path) against the kernel's
            ratio = f"bam is {ms / results[(n, window, 'bam', backward)]:.2f}× as fast"
        elif window is not None:  # the kernel with a window against itself fully causal
            ratio = f"{full / ms:.2f}× faster than full causal"
        elif name.startswith("bam gqa"):  # against the kernel with one kv head per query head
            ratio = f"{tflops / mha_tflops[(n, backward)]:.2f}× the TFLOP/s with all kv heads"
        elif " gqa " in name:  # SDPA with GQA against the kernel with GQA
            bam_gqa = results[(n, None, "bam" + name[name.index(" gqa") :], backward)]
            ratio = f"bam is {ms / bam_gqa:.2f}× as fast"
        elif name != "bam":
            ratio = f"bam is {ms / full:.2f}× as fast"
        else:
            ratio = ""
        print(
            f"| {n} | {window or 'causal'} | {'fwd+bwd' if backward else 'fwd'} | {name} | "
            f"{ms:.3f} | {tflops:.1f} | {ratio} |"
        )
    print(
        f"\nTargets at N={longest}: bam ≥ 0.9× sdpa's speed and ≥ 1.5× flex's; "
        "window 128 ≥ 20× faster than full causal."
    )


def main():
    args = parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported
    Bench(args).run()


if __name__ == "__main__":
    main()
