"""What a prepared dataset holds, read back plainly for comparisons."""

from megabam.data.shards import iter_mds_samples


def prepared_samples(out) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Every sample's tokens and document starts of a prepared dataset, by split, in order."""
    return {
        split: [(s["tokens"].tolist(), s["doc_starts"].tolist()) for s in iter_mds_samples(out / split)]
        for split in ("train", "val")
    }
