"""Step time and bytes communicated per step of tensor (and sequence) parallelism on CPU (gloo), beside the formula.

Runs a fixed global batch through TP=1 (one process), TP=2 and TP=2 with sequence parallelism (two
processes) with plain AdamW, and
counts the payload of every collective the tensor-parallel layers issue (torch.distributed's
all_reduce and all_gather, wrapped here to count). The expected payload per rank and step, for
activations of B·N·d elements (B sequences of N tokens per step, width d) of `bytes` bytes each, is

    V_TP = (2 + 4 · layers) · B·N·d·bytes + 3 · B·N · 4

- per layer, the forward all-reduces the mixer's and the MLP's row-parallel outputs (2) and the
  backward all-reduces the input gradient of each region once: the mixer's (attention's fused qkv;
  mLSTM's six and Gated DeltaNet's four projections share one entry) and the MLP's fused gate_up;
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
(all-reduce, or ZeRO's reduce-scatter + all-gather).

Pipeline parallelism runs through the real DeepSpeed engine (`build_engine`, ZeRO-1, the global
batch as M micro-batches of B/M sequences, 1F1B) for TP ∈ {1, 2} × PP ∈ {1, 2}. Point to point,
each stage boundary carries per micro-batch the activation forward and its gradient backward, plus
the document ids (int64) forward:

    V_PP = (PP − 1) · M · (B/M)·N · (2 · d·bytes / TP + 8)     bytes sent per step by one tensor rank's stages

/TP because DeepSpeed sends each tensor rank 1/TP of an activation (the tensor ranks hold the same
one) and all-gathers it on arrival, an all-gather of (TP−1)/TP of it per rank per received activation
(counted under "other", with the tied embedding's gradient all-reduce, d·V·bytes / TP, between the
first and last stage, the gradient norm and the loss broadcast). The tensor-parallel payload V_TP
stays what it is without pipelining, shared between the stages.

Usage: .venv/bin/python tools/bench_parallel.py [--steps 6]
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megabam.config import load_config
from megabam.model import Decoder
from megabam.parallel.layout import ParallelLayout
from megabam.parallel.ranks import free_port
from megabam.parallel.sequence_parallel import apply_sp
from megabam.parallel.tensor_parallel import apply_tp
from megabam.parallel.topology import Topology

BASE = [
    "model.vocab_size=4096",
    "model.d_model=128",
    "model.n_layers=4",
    "model.n_heads=4",
    "data.seq_len=256",
    "model.attention.block_size=128",
]
MODELS = {  # tiny_cpu's shape; the SWAX pattern checks that mLSTM layers enter their region once
    "BAM attention": BASE,
    "SWAX [SM]": BASE
    + ["model.layer_pattern=[SM]", "model.swa.window=128", "window.windows=[128]", "window.probabilities=[1.0]"],
}
BATCH = 8  # global batch in sequences: every TP rank processes all of it


def expected_payload(overrides: list[str], batch: int, sp: bool) -> int:
    """V_TP or V_SP of the docstring, in bytes, for fp32 activations."""
    config = load_config(None, overrides)
    layers, d = config.model.n_layers, config.model.d_model
    tokens = batch * config.data.seq_len
    per_activation = tokens * d * 4
    if sp:
        return (4 + 8 * layers) * per_activation + 3 * tokens * 4 + (2 * layers + 1) * d * 4
    return (2 + 4 * layers) * per_activation + 3 * tokens * 4


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


PP_MICRO = 4  # micro-batches per step in the pipeline rows (BATCH // PP_MICRO sequences each)


def expected_pipeline_payload(overrides: list[str], tp: int, pp: int) -> int:
    """V_PP of the docstring, in bytes, for fp32 activations."""
    config = load_config(None, overrides)
    tokens = BATCH // PP_MICRO * config.data.seq_len
    return (pp - 1) * PP_MICRO * tokens * (2 * config.model.d_model * 4 // tp + 8)


def _count_engine_traffic(counter: dict, tp_group) -> None:
    """Count every collective payload (tensor-parallel ones, on `tp_group`, apart) and the pipeline's
    point-to-point sends."""
    from deepspeed.runtime.pipe import p2p

    def counting(fn, size_of):
        def wrapped(*args, **kwargs):
            group = kwargs.get("group")
            counter["tp" if group is not None and group is tp_group else "other"] += size_of(*args, **kwargs)
            return fn(*args, **kwargs)

        return wrapped

    def tensor_size(tensor, *args, **kwargs):
        return tensor.numel() * tensor.element_size()

    dist.all_reduce = counting(dist.all_reduce, tensor_size)
    dist.broadcast = counting(dist.broadcast, tensor_size)
    dist.all_gather = counting(
        dist.all_gather, lambda outputs, *a, **k: sum(t.numel() * t.element_size() for t in outputs)
    )
    dist.all_gather_into_tensor = counting(dist.all_gather_into_tensor, tensor_size)
    send = p2p.send

    def counted_send(tensor, *args, **kwargs):
        counter["p2p"] += tensor.numel() * tensor.element_size()
        return send(tensor, *args, **kwargs)

    p2p.send = counted_send


def _pipeline_worker(rank: int, world: int, port: int, name: str, tp: int, pp: int, steps: int, results) -> None:
    import os

    from megabam.parallel.distributed import init_distributed
    from megabam.parallel.ranks import rank_environment
    from megabam.parallel.topology import build_topology
    from megabam.train.engine import build_engine

    torch.set_num_threads(1)
    os.environ.update(rank_environment(rank, world, port), DS_ACCELERATOR="cpu")
    init_distributed()
    config = load_config(
        None,
        MODELS[name]
        + [
            f"parallel.tensor={tp}",
            f"parallel.pipeline={pp}",
            "parallel.zero_stage=1",
            f"train.micro_batch_size={BATCH // PP_MICRO}",
            f"train.grad_accum={PP_MICRO}",
            "optim.lr=1e-3",
        ],
    )
    topology = build_topology(config.parallel.tensor, config.parallel.pipeline)
    engine = build_engine(config, topology)
    counter = {"tp": 0, "p2p": 0, "other": 0}
    _count_engine_traffic(counter, topology.tp_group)
    g = torch.Generator().manual_seed(0)
    times = []
    n = config.data.seq_len
    for step in range(steps + 1):  # the first step warms up and is not counted
        micro = []
        for _ in range(PP_MICRO):
            ids, labels = torch.randint(0, config.model.vocab_size, (2, BATCH // PP_MICRO, n), generator=g)
            micro.append({"input_ids": ids, "labels": labels, "doc_ids": torch.zeros_like(ids)})
        counter.update(tp=0, p2p=0, other=0)
        dist.barrier()
        t0 = time.perf_counter()
        engine.step(micro, None)
        dist.barrier()
        if step:
            times.append(time.perf_counter() - t0)
    results[name, tp, pp, rank] = (statistics.median(times), dict(counter))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    results = mp.Manager().dict()
    runs = [(1, False), (2, False), (2, True)]  # (TP, SP)
    for name in MODELS:
        for tp, sp in runs:
            mp.start_processes(
                _worker, args=(tp, free_port(), name, sp, args.steps, results), nprocs=tp, start_method="spawn"
            )
    print(f"{' '.join(BASE)}; global batch {BATCH} sequences, fp32, gloo, AdamW; median of {args.steps} steps")
    print(
        "| model | TP | SP | PP | step time (s) | payload per rank (MiB) | expected V_TP / V_SP (MiB) | "
        "ring traffic per rank (MiB) |"
    )
    print("| --- | ---: | :---: | ---: | ---: | ---: | ---: | ---: |")
    for name, overrides in MODELS.items():
        for tp, sp in runs:
            step_s, (reduced, gathered) = results[name, tp, sp]
            expected = expected_payload(overrides, BATCH, sp) if tp > 1 else 0
            # A ring all-reduce moves 2·(TP−1)/TP of its payload per rank, an all-gather (TP−1)/TP. This is
            # what gloo runs; NCCL's true reduce-scatter would halve SP's reduce-scatter share.
            ring = (tp - 1) / tp * (2 * reduced + gathered)
            print(
                f"| {name} | {tp} | {'on' if sp else 'off'} | 1 | {step_s:.3f} | {(reduced + gathered) / 2**20:.2f} | "
                f"{expected / 2**20:.2f} | {ring / 2**20:.2f} |"
            )

    layouts = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (TP, PP)
    for name in MODELS:
        for tp, pp in layouts:
            mp.start_processes(
                _pipeline_worker,
                args=(tp * pp, free_port(), name, tp, pp, args.steps, results),
                nprocs=tp * pp,
                start_method="spawn",
            )
    print()
    print(
        f"Through DeepSpeed's engine (ZeRO-1): {PP_MICRO} micro-batches of {BATCH // PP_MICRO} sequences per step; "
        "TP and other payloads per rank (the largest), p2p summed over the stages of tensor rank 0"
    )
    print(
        "| model | TP | PP | step time (s) | TP collectives (MiB) | p2p sent (MiB) "
        "| expected V_PP (MiB) | other (MiB) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, overrides in MODELS.items():
        for tp, pp in layouts:
            ranks = [results[name, tp, pp, r] for r in range(tp * pp)]
            step_s = max(t for t, _ in ranks)
            most = {k: max(c[k] for _, c in ranks) / 2**20 for k in ("tp", "other")}
            # both directions of the boundaries: what the stages of tensor rank 0 send
            sent = sum(c["p2p"] for r, (_, c) in enumerate(ranks) if r % tp == 0) / 2**20
            print(
                f"| {name} | {tp} | {pp} | {step_s:.3f} | {most['tp']:.2f} | {sent:.2f} | "
                f"{expected_pipeline_payload(overrides, tp, pp) / 2**20:.2f} | {most['other']:.2f} |"
            )


if __name__ == "__main__":
    main()
