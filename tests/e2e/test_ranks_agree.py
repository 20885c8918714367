"""What several real processes must agree on without talking to the trainer: streaming gives two
data-parallel ranks disjoint halves of an epoch, and the window sampler draws the same window on
every rank (one gloo group, the windows all-gathered)."""

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megabam.config.schema import WindowConfig
from megabam.data.packing import pack_documents
from megabam.data.shards import write_mds
from megabam.parallel.ranks import free_port, rank_environment
from megabam.train.window_sampler import WindowSampler

REPO = Path(__file__).resolve().parents[2]
STEPS = 10_000


def packed_samples(n, sample_len, seed=0):
    rng = random.Random(seed)
    docs = [[rng.randrange(4, 1000) for _ in range(rng.randrange(0, 2 * sample_len))] for _ in range(4 * n)]
    return list(pack_documents(docs, sample_len, eos_id=3))[:n]


def paper_7b(seed=1234, total=STEPS, anneal=0.1):
    return WindowSampler(
        WindowConfig(windows=[128, 2048], probabilities=[0.25, 0.75], anneal_fraction=anneal), seed, total
    )


_RANK_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch
    import torch.distributed as dist
    from megabam.data.loader import build_loader

    dist.init_process_group("gloo")
    loader = build_loader(sys.argv[1], micro_batch_size=4, shuffle=True, seed=7)
    rows = torch.cat([b["input_ids"] for b in loader]).numpy()
    np.save(f"{sys.argv[2]}/rank{dist.get_rank()}.npy", rows)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_two_ranks_split_the_epoch(tmp_path, clean_shm):
    samples = packed_samples(64, sample_len=9)
    write_mds(samples, tmp_path / "mds")
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, **rank_environment(rank, 2, port))
        cmd = [sys.executable, "-c", _RANK_SCRIPT, str(tmp_path / "mds"), str(tmp_path)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO))
    for p in procs:
        assert p.wait(timeout=120) == 0
    ranks = [np.load(tmp_path / f"rank{r}.npy") for r in range(2)]
    assert ranks[0].shape == ranks[1].shape == (32, 8)
    sets = [{tuple(row) for row in rows} for rows in ranks]
    assert sets[0].isdisjoint(sets[1])
    assert sets[0] | sets[1] == {tuple(s.tokens[:-1]) for s in samples}


def _gather_windows(rank: int, init_file: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    mine = torch.tensor([paper_7b().window(t) for t in range(STEPS)])
    both = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(both, mine)
    out[rank] = [w.tolist() for w in both]
    dist.destroy_process_group()


def test_two_processes_draw_the_same_sequence(tmp_path):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_gather_windows, args=(str(tmp_path / "rendezvous"), out), nprocs=2)
        gathered = out[0]
    assert gathered[0] == gathered[1] == [paper_7b().window(t) for t in range(STEPS)]
