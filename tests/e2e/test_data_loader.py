"""The streaming loader over the parallel layout: DP shares, TP/PP replicas, mixtures, remotes, resume."""

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from megabam.data.errors import DataError
from megabam.data.loader import build_loader
from megabam.data.mixture import StreamSpec
from megabam.data.packing import pack_documents
from megabam.data.shards import write_mds
from megabam.data.shm_cleanup import clean_streaming
from megabam.parallel.layout import ParallelLayout
from megabam.parallel.ranks import free_port, rank_environment

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("clean_shm")


def write_dataset(path, n_samples, sample_len, lo, hi, seed, size_limit=400):
    """An MDS dataset whose token ids lie in [lo, hi) (so a sample tells its stream); its samples."""
    rng = random.Random(seed)
    docs = [[rng.randrange(lo, hi) for _ in range(rng.randrange(1, 2 * sample_len))] for _ in range(4 * n_samples)]
    samples = list(pack_documents(docs, sample_len, eos_id=3))[:n_samples]
    write_mds(samples, path, size_limit=size_limit)
    return samples


# Each rank: join a gloo group, read with the given settings, save its input rows; optionally
# save the loader state after `stop_after` batches, or start from a saved state.
_RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import torch
    import torch.distributed as dist
    from megabam.data.loader import build_loader
    from megabam.data.mixture import StreamSpec

    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = build_loader([StreamSpec(**s) for s in args["streams"]], micro_batch_size=args["batch"],
                          shuffle=True, seed=11, replication=args["replication"], num_workers=args["workers"])
    if args.get("state_in"):
        loader.load_state_dict(json.load(open(args["state_in"])))
    rows = []
    for i, batch in enumerate(loader):
        rows.append(batch["input_ids"].numpy())
        if i + 1 == args.get("stop_after"):  # the state after `stop_after` batches, as a checkpoint saves it
            json.dump(loader.state_dict(), open(f"{args['out']}/state{rank}.json", "w"))
    np.save(f"{args['out']}/rank{rank}.npy", np.concatenate(rows))
    dist.barrier()
    dist.destroy_process_group()
    """
)


def run_ranks(world, args):
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, **rank_environment(rank, world, port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, json.dumps(args)], env=env, cwd=REPO))
    for p in procs:
        assert p.wait(timeout=120) == 0
    clean_streaming()
    return [np.load(Path(args["out"]) / f"rank{r}.npy") for r in range(world)]


def rows_of(array):
    return [tuple(row) for row in array]


def test_layout_rank_order():
    layout = ParallelLayout(data=2, tensor=2, pipeline=3)
    assert layout.world_size == 12 and layout.replication == 6
    ranks = [layout.rank(dp, pp, tp) for dp in range(2) for pp in range(3) for tp in range(2)]
    assert ranks == list(range(12))  # TP fastest, then PP, then DP
    assert all(layout.coordinates(layout.rank(*c)) == c for c in [(1, 2, 1), (0, 1, 0), (1, 0, 1)])


def test_2x2_layout_dp_ranks_disjoint_tp_peers_identical(tmp_path):
    layout = ParallelLayout(data=2, tensor=2, pipeline=1)
    samples = write_dataset(tmp_path / "mds", 48, 9, 4, 500, seed=0)
    (tmp_path / "out").mkdir()
    ranks = run_ranks(
        layout.world_size,
        dict(
            streams=[{"local": str(tmp_path / "mds")}],
            batch=4,
            replication=layout.replication,
            workers=0,
            out=str(tmp_path / "out"),
        ),
    )
    by_dp = {}
    for rank, rows in enumerate(ranks):
        dp, _, _ = layout.coordinates(rank)
        if dp in by_dp:
            assert np.array_equal(rows, by_dp[dp])  # tensor peers: the same samples in the same order
        by_dp[dp] = rows
    shares = [set(rows_of(by_dp[dp])) for dp in range(layout.data)]
    assert len(by_dp[0]) == len(by_dp[1]) == 24
    assert shares[0].isdisjoint(shares[1])
    assert shares[0] | shares[1] == {tuple(s.tokens[:-1]) for s in samples}


def test_mid_epoch_resume_in_fresh_processes_over_a_remote_mixture(tmp_path):
    write_dataset(tmp_path / "web" / "train", 60, 9, 4, 200, seed=1)
    write_dataset(tmp_path / "remote" / "code" / "train", 30, 9, 200, 400, seed=2)

    def streams(cache):
        return [
            {"local": str(tmp_path / "web"), "split": "train", "weight": 2.0},
            {
                "local": str(tmp_path / cache),
                "remote": str(tmp_path / "remote" / "code"),
                "split": "train",
                "weight": 1.0,
            },
        ]

    stop_after, batch = 3, 4
    for phase in ("whole", "resumed"):
        (tmp_path / phase).mkdir()
    whole = run_ranks(
        2,
        dict(
            streams=streams("cache_a"),
            batch=batch,
            replication=1,
            workers=1,
            stop_after=stop_after,
            out=str(tmp_path / "whole"),
        ),
    )
    resumed = run_ranks(
        2,
        dict(
            streams=streams("cache_b"),
            batch=batch,
            replication=1,
            workers=1,
            state_in=str(tmp_path / "whole" / "state0.json"),
            out=str(tmp_path / "resumed"),
        ),
    )
    for rank in range(2):
        assert len(whole[rank]) > (stop_after + 2) * batch
        assert np.array_equal(resumed[rank], whole[rank][stop_after * batch :])
    # the remote stream was fetched into the local cache and mixed in
    assert (tmp_path / "cache_a" / "train" / "index.json").exists()
    assert any(row.max() >= 200 for rows in whole for row in rows)


def test_mixture_proportions_and_repeats(tmp_path):
    a = write_dataset(tmp_path / "a", 300, 9, 4, 200, seed=3)
    b = write_dataset(tmp_path / "b", 100, 9, 200, 400, seed=4)

    def count_b(streams):
        loader = build_loader(streams, micro_batch_size=5, shuffle=True, seed=0)
        rows = np.concatenate([batch["input_ids"].numpy() for batch in loader])
        return len(rows), int((rows.max(axis=1) >= 200).sum())

    # weights 1:3 → a quarter of the epoch (of default size len(a) + len(b) = 400) from b
    total, from_b = count_b([StreamSpec(str(tmp_path / "a"), weight=3.0), StreamSpec(str(tmp_path / "b"), weight=1.0)])
    assert total == 400 and abs(from_b / total - 0.25) <= 0.01
    clean_streaming()
    total, from_b = count_b([StreamSpec(str(tmp_path / "a"), repeat=1.0), StreamSpec(str(tmp_path / "b"), repeat=2.0)])
    assert (total, from_b) == (len(a) + 2 * len(b), 2 * len(b))


def test_loader_refuses_token_ids_beyond_the_vocabulary(tmp_path):
    write_dataset(tmp_path / "mds", 8, 9, 4, 500, seed=5)
    with pytest.raises(DataError, match="outside the vocabulary of 300"):
        list(build_loader(tmp_path / "mds", micro_batch_size=4, shuffle=False, seed=0, vocab_size=300))


def test_corrupted_remote_shard_raises_instead_of_ending_the_epoch(tmp_path):
    write_dataset(tmp_path / "remote" / "train", 60, 9, 4, 500, seed=6)
    shard = sorted((tmp_path / "remote" / "train").glob("shard.*"))[1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    loader = build_loader(
        [StreamSpec(str(tmp_path / "cache"), remote=str(tmp_path / "remote"), split="train")],
        micro_batch_size=4,
        shuffle=False,
        seed=0,
    )
    with pytest.raises(DataError, match="Checksum failure"):
        list(loader)


# Each rank of one of two jobs: join its job's gloo group, build a loader over the shared dataset,
# wait until all four ranks of both jobs hold a live dataset, read its share, save rows and prefix.
# With `skew`, this rank's own scan answers one prefix higher than its leader's, as when another
# job registered in between: streaming's ranks would then disagree (megabam/data/shm_prefix.py).
_JOB_SCRIPT = textwrap.dedent(
    """
    import glob, json, os, sys, time
    import numpy as np
    import torch.distributed as dist
    from megabam.data.loader import build_loader
    from megabam.data.streaming_import import import_streaming

    args = json.loads(sys.argv[1])
    import_streaming()
    from streaming.base.shared import prefix as streaming_prefix
    if args["skew"]:
        scan = streaming_prefix._check_and_find_retrying
        streaming_prefix._check_and_find_retrying = lambda *a, **k: scan(*a, **k) + 1
    dist.init_process_group("gloo")
    loader = build_loader(args["mds"], micro_batch_size=2, shuffle=False, seed=0)
    me = f"{args['out']}/{args['job']}{dist.get_rank()}"
    open(me + ".ready", "w").close()
    deadline = time.monotonic() + 60
    while len(glob.glob(f"{args['out']}/*.ready")) < 4:
        assert time.monotonic() < deadline, "the other job's ranks never built their datasets"
        time.sleep(0.05)
    np.save(me + ".npy", np.concatenate([b["input_ids"].numpy() for b in loader]))
    json.dump(loader.dataset._shm_prefix_int, open(me + ".json", "w"))
    dist.barrier()
    dist.destroy_process_group()
    """
)


_DECOMPRESS_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from megabam.data.mixture import StreamSpec, make_streams

    folder, rounds = Path(sys.argv[1]), int(sys.argv[2])
    stream = make_streams([StreamSpec(local=str(folder))])[0]
    if sys.argv[3] == "streaming":  # the control: streaming's own Stream
        stream = type(stream).__mro__[1](local=str(folder))
    stream.validate_hash, stream.safe_keep_zip = None, True  # what a dataset's defaults give a local stream
    for _ in range(rounds):
        for packed in sorted(folder.glob("*.mds.zstd")):
            stream._decompress_shard_part(None, str(packed), str(packed)[: -len(".zstd")], "zstd")
    """
)


def decompress_together(folder: Path, kind: str) -> list[subprocess.CompletedProcess]:
    """Two processes ("jobs") decompressing every shard of one dataset over and over at once."""
    cmd = [sys.executable, "-c", _DECOMPRESS_SCRIPT, str(folder), "40", kind]
    procs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO) for _ in range(2)]
    return [(p.wait(timeout=120), p.stderr.read()) for p in procs]


def test_two_jobs_decompressing_one_shard_at_once_both_succeed(tmp_path):
    """streaming writes every process's decompressed copy to one `.tmp` name; megabam's stream writes
    its own, so two jobs starting on one dataset on one node no longer lose one of them. (The control,
    streaming's own class, usually fails here with the error a job reported; not asserted: a race.)"""
    write_dataset(tmp_path / "mds", 16, 9, 4, 500, seed=3, size_limit=120)
    shards = sorted((tmp_path / "mds").glob("*.mds.zstd"))
    assert len(shards) >= 4
    results = decompress_together(tmp_path / "mds", "megabam")
    assert [code for code, _ in results] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    import zstandard

    for packed in shards:
        raw = packed.with_name(packed.name[: -len(".zstd")])
        assert raw.read_bytes() == zstandard.ZstdDecompressor().decompress(packed.read_bytes())
    assert sorted(p.name for p in (tmp_path / "mds").iterdir() if ".tmp" in p.name or "-" in p.name) == []


def test_two_jobs_starting_together_on_a_node_each_get_a_prefix_their_ranks_agree_on(tmp_path):
    samples = write_dataset(tmp_path / "mds", 16, 9, 4, 500, seed=3)
    (tmp_path / "out").mkdir()
    procs = []
    for job in ("a", "b"):
        port = free_port()
        for rank in range(2):
            args = dict(mds=str(tmp_path / "mds"), out=str(tmp_path / "out"), job=job, skew=(job, rank) == ("a", 1))
            env = dict(os.environ, **rank_environment(rank, 2, port), OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen([sys.executable, "-c", _JOB_SCRIPT, json.dumps(args)], env=env, cwd=REPO))
    try:
        assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    finally:
        for p in procs:
            p.kill()
        clean_streaming()
    out = tmp_path / "out"
    prefix = {name: json.loads((out / f"{name}.json").read_text()) for name in ("a0", "a1", "b0", "b1")}
    assert prefix["a0"] == prefix["a1"] != prefix["b0"] == prefix["b1"]
    for job in ("a", "b"):  # each job read every sample once, its two ranks disjoint halves
        rows = [rows_of(np.load(out / f"{job}{rank}.npy")) for rank in range(2)]
        assert len(rows[0]) == len(rows[1]) == 8 and set(rows[0]).isdisjoint(rows[1])
        assert set(rows[0]) | set(rows[1]) == {tuple(s.tokens[:-1]) for s in samples}


_RESUME_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import torch.distributed as dist
    from megabam.data.loader import load_loader_state

    class Loader:  # the leader's load is slow, as a creator descheduled before sizing its segment
        def load_state_dict(self, state):
            start = time.monotonic()  # CLOCK_MONOTONIC: one clock for both processes
            time.sleep(0.5 if dist.get_rank() == 0 else 0)
            out = {"start": start, "end": time.monotonic(), "state": state}
            json.dump(out, open(f"{sys.argv[1]}/{dist.get_rank()}.json", "w"))

    dist.init_process_group("gloo")
    load_loader_state(Loader(), {"epoch": 3, "sample_in_epoch": 40})
    dist.destroy_process_group()
    """
)


def test_a_resume_loads_the_loader_state_on_the_local_leader_before_the_other_ranks(tmp_path):
    """Two ranks each creating or attaching streaming's `{prefix}_resume` segment at once: the one that
    attached between the other's create and its sizing failed ("cannot mmap an empty file", a resume
    under load in the suite). megabam's resume (megabam/data/loader.py) lets the node's leader finish
    first; every rank still loads the same state."""
    probe = tmp_path / "probe.py"
    probe.write_text(_RESUME_SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(probe),
        str(tmp_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    leader, other = (json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1))
    assert other["start"] >= leader["end"]
    assert leader["state"] == other["state"] == {"epoch": 3, "sample_in_epoch": 40}
