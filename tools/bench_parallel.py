"""Step time and bytes communicated per step of tensor (and sequence) parallelism on CPU (gloo), beside the formula.

Runs a fixed global batch through TP=1 (one process), TP=2 and TP=2 with sequence parallelism (two
processes) with plain AdamW, and
counts the payload of every collective the tensor-parallel layers issue (torch.distributed's
all_reduce and all_gather, wrapped here to count). The expected payload per rank and step, for
activations of B·N·d elements (B sequences of N tokens per step, width d) of `bytes` bytes each, is

    V_TP = (2 + Σ_layers (3 + c_mixer)) · B·N·d·bytes + 3 · B·N · 4

- per layer, the forward all-reduces the mixer's and the MLP's row-parallel outputs (2) and the
  backward all-reduces the input gradient of each column-parallel linear: the mixer's c_mixer
  (attention 1: the fused qkv; mLSTM 6: q, k, v, i, f, o; Gated DeltaNet 4: qkv, a, b, gate) and the
  MLP's fused gate_up (1);
- the vocab-parallel embedding all-reduces its output (forward) and the LM head its input gradient
  (backward): the 2;
- the vocab-parallel loss all-reduces three fp32 numbers per token (row max, sum of exponentials,
  target logit).
With sequence parallelism (SP) every region (mixer, MLP, output head) is entered by an all-gather
of the sequence and left by a reduce-scatter, each with the other as its backward, and the
embedding reduce-scatters; counting full tensors:

    V_SP = (4 + 8 · layers) · B·N·d·bytes + 3 · B·N · 4 + (2 · layers + 1) · d · 4

(the last term: the norm weights' gradient all-reduce). gloo has no reduce-scatter, so here it is an
all-reduce of the full tensor; with NCCL's reduce-scatter and all-gather, each moving (TP−1)/TP of
the full tensor per rank, SP's ring traffic on an attention model equals TP's while the norms'
activations shrink by TP.
B counts the sequences of one data-parallel rank per optimizer step (all micro-batches). A ring
all-reduce moves 2·(TP−1)/TP times the payload per rank, an all-gather (TP−1)/TP; TP=1 moves
nothing. Beside it, for the planner: data parallelism moves about 2·(DP−1)/DP · (P/TP) · bytes per rank for P parameters
(all-reduce, or ZeRO's reduce-scatter + all-gather); pipeline parallelism (not built yet) will send
B_micro·N·d·bytes point to point per stage boundary and micro-batch, forward and backward.

Usage: .venv/bin/python tools/bench_parallel.py [--steps 6]
"""
import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megabam.config import load_config
from megabam.data.layout import ParallelLayout
from megabam.model import Decoder
from megabam.model.transformer import expand_pattern
from megabam.parallel.sequence_parallel import apply_sp
from megabam.parallel.tensor_parallel import apply_tp
from megabam.parallel.topology import Topology

BASE = ["model.vocab_size=4096", "model.d_model=128", "model.n_layers=4", "model.n_heads=4", "data.seq_len=256",
        "model.attention.block_size=128"]
MODELS = {  # tiny_cpu's shape; the SWAX pattern checks the formula's mLSTM count
    "BAM attention": BASE,
    "SWAX [SM]": BASE + ["model.layer_pattern=[SM]", "model.swa.window=128", "window.windows=[128]",
                         "window.probabilities=[1.0]"],
}
BATCH = 8  # global batch in sequences: every TP rank processes all of it
COLUMN_LINEARS = {"attention": 1, "swa": 1, "mlstm": 6, "gated_deltanet": 4}


def expected_payload(overrides: list[str], batch: int, sp: bool) -> int:
    """V_TP or V_SP of the docstring, in bytes, for fp32 activations."""
    config = load_config(None, overrides)
    m, period = config.model, expand_pattern(config.model.layer_pattern)
    layers = period * (m.n_layers // len(period))
    tokens = batch * config.data.seq_len
    per_activation = tokens * m.d_model * 4
    if sp:
        return (4 + 8 * len(layers)) * per_activation + 3 * tokens * 4 + (2 * len(layers) + 1) * m.d_model * 4
    return (2 + sum(3 + COLUMN_LINEARS[name] for name in layers)) * per_activation + 3 * tokens * 4


def _count_collectives(counter: dict) -> None:
    """Wrap all_reduce and all_gather so each call adds its payload (the full tensor) to counter, by kind."""
    all_reduce, all_gather = dist.all_reduce, dist.all_gather

    def counted_all_reduce(tensor, *args, **kwargs):
        counter["reduce"] += tensor.numel() * tensor.element_size()
        return all_reduce(tensor, *args, **kwargs)

    def counted_all_gather(outputs, tensor, *args, **kwargs):
        counter["gather"] += sum(t.numel() * t.element_size() for t in outputs)
        return all_gather(outputs, tensor, *args, **kwargs)

    dist.all_reduce, dist.all_gather = counted_all_reduce, counted_all_gather


def _worker(rank: int, world: int, port: int, name: str, sp: bool, steps: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    config = load_config(None, MODELS[name])
    cfg = config.model
    torch.manual_seed(0)
    model = Decoder(cfg)
    if world > 1:
        topology = Topology(ParallelLayout(tensor=world))
        apply_tp(model, topology)
        if sp:
            apply_sp(model, topology)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counter = {"reduce": 0, "gather": 0}
    _count_collectives(counter)
    g = torch.Generator().manual_seed(0)
    times, payloads = [], []
    for step in range(steps + 1):  # the first step warms up and is not counted
        ids, labels = torch.randint(0, cfg.vocab_size, (2, BATCH, config.data.seq_len), generator=g)
        counter["reduce"] = counter["gather"] = 0
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        model(ids, labels).backward()
        opt.step()
        dist.barrier()
        if step:
            times.append(time.perf_counter() - t0)
            payloads.append((counter["reduce"], counter["gather"]))
    if rank == 0:
        # Every step issues the same collectives, so the last step's payloads stand for all.
        results[name, world, sp] = (statistics.median(times), payloads[-1])
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    results = mp.Manager().dict()
    runs = [(1, False), (2, False), (2, True)]  # (TP, SP)
    for name in MODELS:
        for tp, sp in runs:
            mp.start_processes(_worker, args=(tp, _free_port(), name, sp, args.steps, results), nprocs=tp,
                               start_method="spawn")
    print(f"{' '.join(BASE)}; global batch {BATCH} sequences, fp32, gloo, AdamW; median of {args.steps} steps")
    print("| model | TP | SP | PP | step time (s) | payload per rank (MiB) | expected V_TP / V_SP (MiB) | "
          "ring traffic per rank (MiB) |")
    print("| --- | ---: | :---: | ---: | ---: | ---: | ---: | ---: |")
    for name, overrides in MODELS.items():
        for tp, sp in runs:
            step_s, (reduced, gathered) = results[name, tp, sp]
            expected = expected_payload(overrides, BATCH, sp) if tp > 1 else 0
            # A ring all-reduce moves 2·(TP−1)/TP of its payload per rank, an all-gather (TP−1)/TP. This is
            # what gloo runs; NCCL's true reduce-scatter would halve SP's reduce-scatter share.
            ring = (tp - 1) / tp * (2 * reduced + gathered)
            print(f"| {name} | {tp} | {'on' if sp else 'off'} | 1 | {step_s:.3f} | {(reduced + gathered) / 2**20:.2f} | "
                  f"{expected / 2**20:.2f} | {ring / 2**20:.2f} |")


if __name__ == "__main__":
    main()
