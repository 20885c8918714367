"""CPU training speed of megabam's models beside a Hugging Face Llama of the same shape, in one run.

Same shape for every model: d 128, 4 layers, 4 heads, vocabulary 4096, megabam's SwiGLU width, tied
embeddings, no dropout; same plain loop (torch.optim.AdamW, forward with the loss, backward, step) on
random tokens, fp32, 2,048 tokens per step (8 × 256 or 1 × 2,048). The peer is transformers'
LlamaForCausalLM with its `sdpa` attention. megabam runs its CPU path exactly as training does
(kernels/dispatch.py picks the op; the choice is printed per case).

Method: every (model, length, round) case runs in a fresh subprocess that sets up the CPU as
training does (megabam.parallel.threads.configure_cpu: threads sized, denormals flushed; the garbage
collector held through start-up and what it built frozen, as megabam's entry point does; for the
Llama too; `--setups megabam torch` adds cases that set the thread count alone), builds the model,
reads ru_maxrss (its peak resident set so far), runs `--warmup` untimed and `--steps` timed steps and
reads it again: tokens/s from the timed steps, "step MiB" the growth of the peak (a training step's
whole footprint above the built model: activations, gradients, optimizer state, temporaries). Rounds
interleave the models (round 1: every model, round 2: every model, ...) so that drifts of the
machine's speed hit every model alike; the table gives the median over rounds, the spread (min–max),
the ratio of medians to the Llama's, and the ratio to the Llama within each round (median and
min–max over rounds: a round's ratio is free of drifts between rounds).

`--compile` adds, beside each megabam model, the same model with `train.compile=blocks` (each block
compiled by megabam/parallel/compile.py, inductor on CPU; the compile happens in the warm-up steps,
so its memory counts in "step MiB"), and a column with its tokens/s over the eager model's, median
and min–max of the rounds' ratios.

`--ranks` measures what the thread sizing of megabam/parallel/threads.py is for: one process, then two
processes at once (two local ranks on this machine, each training its own copy), with threads sized
by megabam (cores ÷ local ranks) and with torch's default (every process takes every core).

    .venv/bin/python tools/bench_cpu_train.py --lengths 256 2048 --rounds 5
    .venv/bin/python tools/bench_cpu_train.py --lengths 256 2048 --rounds 3 --setups megabam torch
    .venv/bin/python tools/bench_cpu_train.py --ranks --lengths 256 --rounds 3
    .venv/bin/python tools/bench_cpu_train.py --models bam+ssmax rope swax --lengths 256 2048 --rounds 3 --compile
"""

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOKENS_PER_STEP = 2048

# megabam models: (config file, overrides). The tiny configs of the README with document masking off
# (the Llama has none) and every other setting as shipped.
MODELS = {
    "bam+ssmax": ("yaml_configs/tiny_cpu.yaml", []),
    # the same on the PyTorch forms everywhere (what runs where no C can be built)
    "bam+ssmax-ref": ("yaml_configs/tiny_cpu.yaml", ["model.kernels=reference"]),
    "alibi": ("yaml_configs/tiny_cpu.yaml", ["model.attention.positional=alibi", "model.attention.ssmax=false"]),
    "rope": ("yaml_configs/tiny_cpu.yaml", ["model.attention.positional=rope", "model.attention.ssmax=false"]),
    "nope": ("yaml_configs/tiny_cpu.yaml", ["model.attention.positional=nope", "model.attention.ssmax=false"]),
    "sinusoidal": (
        "yaml_configs/tiny_cpu.yaml",
        ["model.attention.positional=sinusoidal", "model.attention.ssmax=false"],
    ),
    "swax": ("yaml_configs/swax_tiny_cpu.yaml", []),
}
PEER = "llama"
COMPILED = "+compile"  # a megabam model's name with this suffix: the model with train.compile=blocks
SETUPS = {"megabam": "configure_cpu", "torch": "threads only"}  # --setups: each process's CPU set-up


def megabam_model(name: str, seq_len: int):
    from megabam.config import load_config
    from megabam.model import Decoder
    from megabam.parallel.compile import apply_compile

    path, overrides = MODELS[name.removesuffix(COMPILED)]
    config = load_config(os.path.join(REPO, path), [*overrides, "model.attention.document_aware=false"])
    model = Decoder(config.model)
    apply_compile(model, "blocks" if name.endswith(COMPILED) else "off")

    def loss(ids):
        return model(ids[:, :-1], ids[:, 1:])

    return model, loss, config.model


def llama_model(seq_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megabam.config import load_config

    cfg = load_config(os.path.join(REPO, "yaml_configs/tiny_cpu.yaml")).model
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            intermediate_size=cfg.ffn_hidden_size(),
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_heads,
            max_position_embeddings=seq_len,
            rms_norm_eps=cfg.norm_eps,
            tie_word_embeddings=True,
            attn_implementation="sdpa",
        )
    )

    def loss(ids):
        x = ids[:, :-1]
        return model(input_ids=x, labels=x).loss  # transformers shifts the labels itself

    return model, loss, cfg


def run_case(args) -> None:
    """Child: train one model for warm-up + timed steps; print one JSON line."""
    if args.setup == "megabam":  # megabam's entry point holds the collector through start-up (cli.run)
        gc.disable()
    import torch

    if args.setup == "megabam":  # as training does; else torch's defaults (OMP_NUM_THREADS, or every core)
        from megabam.parallel.threads import configure_cpu

        configure_cpu()
    torch.manual_seed(0)
    model, loss_fn, cfg = llama_model(args.seq) if args.case == PEER else megabam_model(args.case, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    if args.setup == "megabam":  # and freezes what start-up built
        from megabam.process import start_collecting

        start_collecting()
    batch = max(1, TOKENS_PER_STEP // args.seq)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (batch, args.seq + 1), generator=g) for _ in range(4)]

    def step(i):
        loss = loss_fn(batches[i % len(batches)])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(i)
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    from megabam.kernels.dispatch import logged_choices

    ops = sorted(f"{op}:{choice}" for op, _, choice, _ in logged_choices)
    print(
        json.dumps(
            {
                "tok_s": args.steps * batch * args.seq / dt,
                "warmup_s": warmup_s,
                "step_mib": (peak - before) / 1024,
                "loss": loss.item(),
                "threads": torch.get_num_threads(),
                "ops": ops,
            }
        )
    )


def child(case: str, seq: int, args, extra=(), env=None) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--case", case, "--seq", str(seq)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)


def result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"a benchmark case failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{min(values):,.0f}–{max(values):,.0f}"


def by_round(ratios: list[float]) -> str:
    """The median and min–max of the rounds' ratios."""
    ratios = sorted(ratios)
    return f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}–{ratios[-1]:.2f})"


def speed_table(args) -> None:
    names = [PEER, *(args.models or MODELS)]
    if args.compile:
        names = [case for name in names for case in ([name] if name == PEER else [name, name + COMPILED])]
    cases = [(setup, name) for setup in args.setups for name in names]
    for seq in args.lengths:
        runs: dict[tuple, list[dict]] = {c: [] for c in cases}
        for r in range(args.rounds):
            for setup, name in cases:
                env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
                runs[setup, name].append(result(child(name, seq, args, ["--setup", setup], env)))
            print(f"  N={seq}: round {r + 1}/{args.rounds} done", file=sys.stderr)
        batch = max(1, TOKENS_PER_STEP // seq)
        print(f"\nN = {seq} ({batch} × {seq} tokens per step, {args.threads} threads)")
        header = ["model", "CPU set-up", "tokens/s (median)", "spread", "× Llama", "× Llama by round"]
        header += ["× eager by round", "warm-up s"] if args.compile else []
        print("| " + " | ".join([*header, "step MiB", "op"]) + " |")
        print("|---|---|" + "---:|" * (len(header) - 1) + "---|")
        for setup, name in cases:
            peers = [x["tok_s"] for x in runs[setup, PEER]]
            tok = [x["tok_s"] for x in runs[setup, name]]
            label = "transformers Llama (sdpa)" if name == PEER else f"megabam {name}"
            # each round's ratio: drifts between rounds cancel
            row = [label, SETUPS[setup], f"{statistics.median(tok):,.0f}", spread(tok)]
            row += [
                f"{statistics.median(tok) / statistics.median(peers):.2f}",
                by_round([t / p for t, p in zip(tok, peers)]),
            ]
            if args.compile:
                eager = [x["tok_s"] for x in runs[setup, name.removesuffix(COMPILED)]]
                row += [by_round([t / e for t, e in zip(tok, eager)]) if name.endswith(COMPILED) else "-"]
                row += [f"{statistics.median(x['warmup_s'] for x in runs[setup, name]):.1f}"]
            row += [f"{statistics.median(x['step_mib'] for x in runs[setup, name]):,.0f}"]
            row += [", ".join(runs[setup, name][0]["ops"]) or "-"]
            print("| " + " | ".join(row) + " |")


def ranks_table(args) -> None:
    """Aggregate tokens/s of 1 and 2 concurrent processes, threads sized by megabam or torch's default."""
    seq = args.lengths[0]
    name = args.models[0] if args.models else "rope"
    rows = []
    for ranks in (1, 2):
        for sized in (True, False):
            totals = []
            threads = None
            for _ in range(args.rounds):
                env = dict(os.environ, LOCAL_WORLD_SIZE=str(ranks))
                env.pop("OMP_NUM_THREADS", None)
                setup = "megabam" if sized else "torch"
                procs = [child(name, seq, args, ["--setup", setup], env) for _ in range(ranks)]
                outs = [result(p) for p in procs]
                totals.append(sum(o["tok_s"] for o in outs))
                threads = outs[0]["threads"]
            rows.append((ranks, "megabam (cores ÷ local ranks)" if sized else "torch default", threads, totals))
    print(f"\nmegabam {name}, N = {seq}, {os.cpu_count()} cores: processes training at once")
    print("| local ranks | threads | per process | tokens/s, all ranks (median) | spread |")
    print("|---:|---|---:|---:|---:|")
    for ranks, how, threads, totals in rows:
        print(f"| {ranks} | {how} | {threads} | {statistics.median(totals):,.0f} | {spread(totals)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), help="megabam models (default: all)")
    ap.add_argument("--ranks", action="store_true", help="the 1 vs 2 local ranks table instead")
    ap.add_argument(
        "--compile", action="store_true", help="each megabam model also with train.compile=blocks, beside it"
    )
    ap.add_argument(
        "--setups",
        nargs="+",
        choices=list(SETUPS),
        default=["megabam"],
        help="each process's CPU set-up, in interleaved rounds: megabam's (training's: configure_cpu), "
        "torch's defaults (the thread count alone)",
    )
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--setup", choices=list(SETUPS), default="megabam", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        run_case(args)
    elif args.ranks:
        ranks_table(args)
    else:
        speed_table(args)


if __name__ == "__main__":
    main()
