"""A sentencepiece tokenizer: training from in-memory documents and a small wrapper."""

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

# Lines longer than sentencepiece's default limit (4192 bytes) would be dropped from training.
_MAX_SENTENCE_BYTES = 1 << 16


class Tokenizer:
    """A trained sentencepiece model loaded from ``path``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._sp = spm.SentencePieceProcessor(model_file=str(self.path))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no bos/eos added)."""
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, encoded on all cores."""
        return self._sp.encode(texts, num_threads=os.cpu_count() or 1)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids."""
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()


def train_tokenizer(
    documents: list[str],
    out_path: str | os.PathLike,
    vocab_size: int,
    model_type: str = "bpe",
    split_digits: bool = True,
    byte_fallback: bool = True,
) -> Tokenizer:
    """Train a sentencepiece model on ``documents`` and write it atomically to ``out_path``.

    Settings keep text (code, here) exactly recoverable: no normalisation, whitespace kept as is
    (runs of spaces may become pieces, for indentation), no dummy leading space, and byte fallback
    for characters outside the vocabulary. Ids: pad 0, unk 1, bos 2, eos 3. The vocabulary has
    exactly ``vocab_size`` pieces (sentencepiece raises if the text cannot fill it).
    """
    out_path = Path(out_path)
    prefix = out_path.parent / f".{out_path.name}.tmp-{uuid.uuid4().hex}"
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_lines(documents),
            model_prefix=str(prefix),
            vocab_size=vocab_size,
            hard_vocab_limit=True,
            model_type=model_type,
            split_digits=split_digits,
            byte_fallback=byte_fallback,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            max_sentence_length=_MAX_SENTENCE_BYTES,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
        os.replace(f"{prefix}.model", out_path)
    finally:
        for suffix in (".model", ".vocab"):
            Path(f"{prefix}{suffix}").unlink(missing_ok=True)
    tokenizer = Tokenizer(out_path)
    if tokenizer.vocab_size != vocab_size:
        raise RuntimeError(f"trained vocab has {tokenizer.vocab_size} pieces, not {vocab_size}")
    return tokenizer


def _lines(documents: list[str]) -> Iterator[str]:
    # sentencepiece trains on sentences; lines are the natural unit of code.
    for doc in documents:
        yield from doc.splitlines()
