"""Reading MDS shards back as training batches with mosaicml-streaming."""

import functools
import os
import re
from collections.abc import Sequence

import numpy as np
import torch

from megabam.data.errors import DataError
from megabam.data.mixture import StreamSpec, make_streams
from megabam.data.packing import doc_ids_from_starts
from megabam.data.shards import check_columns, read_index
from megabam.data.streaming_import import import_streaming


def build_loader(
    source: str | os.PathLike | Sequence[StreamSpec],
    *,
    micro_batch_size: int,
    shuffle: bool,
    seed: int,
    replication: int = 1,
    num_workers: int = 0,
    prefetch_factor: int | None = None,
    drop_last: bool = True,
    num_canonical_nodes: int = 1,
    vocab_size: int | None = None,
    validate_hash: bool = True,
):
    """A ``StreamingDataLoader`` over an MDS dataset directory or a mixture of streams.

    Batches are dicts of int64 tensors, each (micro_batch_size, sample_len - 1): ``input_ids``
    (tokens[:-1]), ``labels`` (tokens[1:]) and ``doc_ids`` (segment index of each input position).
    With ``vocab_size``, a batch holding a token id ≥ it raises DataError instead of reaching the
    embedding. Shards fetched from a remote are checked against their sha1 unless
    ``validate_hash`` is False.

    Rank and world size are read by streaming itself from RANK, WORLD_SIZE, LOCAL_RANK and
    LOCAL_WORLD_SIZE (set by torchrun); each data-parallel rank gets its own share of every epoch.
    ``replication=k`` gives k consecutive ranks identical samples: with the project's rank order
    (megabam/parallel/layout.py) pass ``ParallelLayout.replication`` (TP · PP). ``num_workers`` > 0
    reads in worker processes, each prefetching ``prefetch_factor`` batches.

    Gotchas (docs/platform-notes.md):
    - the same ``micro_batch_size`` goes to the dataset and the loader, else streaming's
      partition of samples over ranks and the batches disagree;
    - to resume mid-epoch exactly (``state_dict()`` / ``load_state_dict()`` of the loader), keep
      ``seed``, ``num_canonical_nodes`` and the streams fixed across runs: they decide the sample
      order, and streaming's default for ``num_canonical_nodes`` depends on the world size;
    - streaming keeps state in shared memory (/dev/shm): two live datasets on one local directory
      in a process raise "Reused local directory", and killed runs leave files that
      ``streaming.base.util.clean_stale_shared_memory()`` removes (mostly).
    """
    streaming = import_streaming()
    if isinstance(source, (str, os.PathLike)):
        source = [StreamSpec(local=os.fspath(source))]
    dataset = _checked_dataset_class()(
        streams=make_streams(list(source)),
        batch_size=micro_batch_size,
        shuffle=shuffle,
        shuffle_seed=seed,
        num_canonical_nodes=num_canonical_nodes,
        replication=replication if replication > 1 else None,
        validate_hash="sha1" if validate_hash else None,
    )
    return streaming.StreamingDataLoader(
        dataset,
        batch_size=micro_batch_size,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        drop_last=drop_last,
        collate_fn=functools.partial(collate_samples, vocab_size=vocab_size),
    )


def load_loader_state(loader, state: dict) -> None:
    """`loader.load_state_dict(state)` on every rank, each node's local leader first. Every rank
    creates or attaches streaming's `{prefix}_resume` segment; one that attaches between another's
    create and its sizing fails ("cannot mmap an empty file": a resume of two ranks under load in the
    suite), so the others wait at a barrier until the leader's segment is whole."""
    import torch.distributed as dist

    import_streaming()  # before any streaming module: its package would import its vision parts
    from streaming.base.world import World

    distributed = dist.is_available() and dist.is_initialized()
    leader = not distributed or World.detect().is_local_leader
    if leader:
        loader.load_state_dict(state)
    if distributed:
        dist.barrier()
        if not leader:
            loader.load_state_dict(state)


@functools.cache
def _checked_dataset_class():
    """``StreamingDataset`` that raises when a shard failed to download or to match its hash.

    It also refuses, before any sample is decoded, shards whose columns megabam will not decode
    (shards.check_columns: a pickle column would run code), local and remote streams alike.

    Streaming runs downloads and hash checks in background threads; on a failure it only ends the
    epoch early (and raises at the next epoch), so a corrupted remote shard would look like a short
    epoch. This subclass keeps the failure and raises it as a DataError where the epoch ends.
    """
    streaming = import_streaming()

    class CheckedStreamingDataset(streaming.StreamingDataset):
        def __init__(self, *, streams, **kwargs):
            for stream in streams:  # local copies: checked before streaming reads anything of them
                index = os.path.join(stream.local, stream.split or "")
                if os.path.isfile(os.path.join(index, "index.json")):
                    read_index(index)
            try:
                super().__init__(streams=streams, **kwargs)
            except ValueError as e:  # streaming's own refusal of a pickle column in a downloaded index
                unsafe = re.match(r"Column (.+) contains an unsafe type: (\S+)\.", str(e))
                if unsafe is None:
                    raise
                check_columns(", ".join(s.remote or s.local for s in streams), [unsafe[1]], [unsafe[2]])
                raise
            # Every stream's index is read (or downloaded) now, and no sample decoded yet.
            for reader in self.shards:
                where = os.path.join(reader.dirname, reader.split or "", reader.raw_data.basename)
                if type(reader).__name__ != "MDSReader":
                    raise DataError(where, None, f"{type(reader).__name__} shards are not MDS (megabam reads MDS only)")
                check_columns(where, reader.column_names, reader.column_encodings)

        def on_exception(self, future) -> None:
            if future.exception() is not None:
                self._shard_failure = future.exception()
            super().on_exception(future)

        def __iter__(self):
            yield from super().__iter__()
            failure = getattr(self, "_shard_failure", None)
            if failure is not None:
                raise DataError("<data>", None, f"reading shards failed: {failure}") from failure

    return CheckedStreamingDataset


def collate_samples(samples: list[dict[str, np.ndarray]], vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Stack MDS samples into ``input_ids``, ``labels`` and ``doc_ids`` (all int64)."""
    # np.stack copies, so the read-only arrays streaming hands out are never exposed to torch.
    stacked = np.stack([s["tokens"] for s in samples])
    if vocab_size is not None and (stacked.max() >= vocab_size or stacked.min() < 0):
        bad = int(stacked.max() if stacked.max() >= vocab_size else stacked.min())
        raise DataError(
            "<data>", "model.vocab_size", f"token id {bad} in the data lies outside the vocabulary of {vocab_size}"
        )
    tokens = torch.from_numpy(stacked.astype(np.int64))
    length = tokens.shape[1] - 1
    doc_ids = np.stack([doc_ids_from_starts(s["doc_starts"], length) for s in samples])
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "doc_ids": torch.from_numpy(doc_ids.astype(np.int64)),
    }
