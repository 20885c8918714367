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


def pack_documents(docs: Iterable[list[int]], sample_len: int, eos_id: int) -> Iterator[PackedSample]:
    """Concatenate documents, each followed by ``eos_id``, and cut into ``sample_len`` samples.

    A document crossing a sample border continues at the start of the next sample. The eos
    belongs to the document it ends; the next document's segment starts after it. The final
    incomplete remainder (fewer than ``sample_len`` tokens) is dropped.
    """
    packer = Packer(sample_len, eos_id)
    for doc in docs:
        yield from packer.add(doc)


class Packer:
    """The incremental form of ``pack_documents``: feed documents one at a time.

    ``pending`` is the number of tokens waiting for the next full sample (dropped if no more
    documents come).
    """

    def __init__(self, sample_len: int, eos_id: int):
        self.sample_len = sample_len
        self.eos_id = eos_id
        self._buf = np.empty(sample_len, dtype=np.int32)
        self._starts = [0]
        self.pending = 0

    def add(self, doc: list[int] | np.ndarray) -> list[PackedSample]:
        """Append ``doc`` and its eos; return the samples it completed."""
        tokens = np.empty(len(doc) + 1, dtype=np.int32)
        tokens[:-1] = doc
        tokens[-1] = self.eos_id
        if self.pending > 0:
            self._starts.append(self.pending)
        done = []
        pos = 0
        while pos < len(tokens):
            n = min(self.sample_len - self.pending, len(tokens) - pos)
            self._buf[self.pending : self.pending + n] = tokens[pos : pos + n]
            self.pending += n
            pos += n
            if self.pending == self.sample_len:
                done.append(PackedSample(self._buf.copy(), np.array(self._starts, dtype=np.int32)))
                self.pending = 0
                self._starts = [0]
        return done


def doc_ids_from_starts(doc_starts: np.ndarray, length: int) -> np.ndarray:
    """Segment index (0, 1, ...) of each of the first ``length`` positions of a sample."""
    return np.searchsorted(np.asarray(doc_starts), np.arange(length), side="right") - 1
