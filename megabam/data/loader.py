"""Reading MDS shards back as training batches with mosaicml-streaming."""

import os

import numpy as np
import torch

from megabam.data.packing import doc_ids_from_starts
from megabam.data.streaming_import import import_streaming


def build_loader(
    data_dir: str | os.PathLike,
    *,
    micro_batch_size: int,
    shuffle: bool,
    seed: int,
    replication: int = 1,
    num_workers: int = 0,
    drop_last: bool = True,
    num_canonical_nodes: int = 1,
):
    """A ``StreamingDataLoader`` over the MDS dataset in ``data_dir``.

    Batches are dicts of int64 tensors, each (micro_batch_size, sample_len - 1): ``input_ids``
    (tokens[:-1]), ``labels`` (tokens[1:]) and ``doc_ids`` (segment index of each input position).

    Rank and world size are read by streaming itself from RANK, WORLD_SIZE, LOCAL_RANK and
    LOCAL_WORLD_SIZE (set by torchrun); each rank gets its own share of every epoch.
    ``replication=k`` gives k consecutive ranks identical samples (tensor-parallel peers).

    Gotchas (docs/platform-notes.md):
    - the same ``micro_batch_size`` goes to the dataset and the loader, else streaming's
      partition of samples over ranks and the batches disagree;
    - to resume mid-epoch exactly (``state_dict()`` / ``load_state_dict()`` of the loader), keep
      ``seed`` and ``num_canonical_nodes`` fixed across runs: both decide the sample order, and
      streaming's default for the latter depends on the world size;
    - streaming keeps state in shared memory (/dev/shm): two live datasets on one ``data_dir`` in a
      process raise "Reused local directory", and killed runs leave files that
      ``streaming.base.util.clean_stale_shared_memory()`` removes (mostly).
    """
    streaming = import_streaming()
    dataset = streaming.StreamingDataset(
        local=str(data_dir),
        remote=None,
        batch_size=micro_batch_size,
        shuffle=shuffle,
        shuffle_seed=seed,
        num_canonical_nodes=num_canonical_nodes,
        replication=replication if replication > 1 else None,
    )
    return streaming.StreamingDataLoader(
        dataset,
        batch_size=micro_batch_size,
        num_workers=num_workers,
        drop_last=drop_last,
        collate_fn=collate_samples,
    )


def collate_samples(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack MDS samples into ``input_ids``, ``labels`` and ``doc_ids`` (all int64)."""
    # np.stack copies, so the read-only arrays streaming hands out are never exposed to torch.
    tokens = torch.from_numpy(np.stack([s["tokens"] for s in samples]).astype(np.int64))
    length = tokens.shape[1] - 1
    doc_ids = np.stack([doc_ids_from_starts(s["doc_starts"], length) for s in samples])
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "doc_ids": torch.from_numpy(doc_ids.astype(np.int64)),
    }
