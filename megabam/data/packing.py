"""Packing token documents into fixed-length training samples."""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np


@dataclass
class PackedSample:
    """``tokens`` (sample_len,) int32; ``doc_starts`` int32 offsets where a segment starts.

    ``doc_starts`` always begins with 0: the first segment is either a new document or the rest
    of one carried over from the previous sample.
    """

    tokens: np.ndarray
    doc_starts: np.ndarray


def pack_documents(
    docs: Iterable[list[int]], sample_len: int, eos_id: int
) -> Iterator[PackedSample]:
    """Concatenate documents, each followed by ``eos_id``, and cut into ``sample_len`` samples.

    A document crossing a sample border continues at the start of the next sample. The eos
    belongs to the document it ends; the next document's segment starts after it. The final
    incomplete remainder (fewer than ``sample_len`` tokens) is dropped.
    """
    buf = np.empty(sample_len, dtype=np.int32)
    fill = 0
    starts = [0]
    for doc in docs:
        tokens = np.empty(len(doc) + 1, dtype=np.int32)
        tokens[:-1] = doc
        tokens[-1] = eos_id
        if fill > 0:
            starts.append(fill)
        pos = 0
        while pos < len(tokens):
            n = min(sample_len - fill, len(tokens) - pos)
            buf[fill : fill + n] = tokens[pos : pos + n]
            fill += n
            pos += n
            if fill == sample_len:
                yield PackedSample(buf.copy(), np.array(starts, dtype=np.int32))
                fill = 0
                starts = [0]


def doc_ids_from_starts(doc_starts: np.ndarray, length: int) -> np.ndarray:
    """Segment index (0, 1, ...) of each of the first ``length`` positions of a sample."""
    return np.searchsorted(np.asarray(doc_starts), np.arange(length), side="right") - 1
