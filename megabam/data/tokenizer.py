"""A sentencepiece tokenizer: training from in-memory documents and a small wrapper."""

import os
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from megabam.data.errors import DataError

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
    documents: Iterable[str],
    out_path: str | os.PathLike,
    vocab_size: int,
    model_type: str = "bpe",
    split_digits: bool = True,
    byte_fallback: bool = True,
    special_tokens: Sequence[str] = (),
    max_sentences: int = 0,
    progress: bool = False,
) -> Tokenizer:
    """Train a sentencepiece model on ``documents`` and write it atomically to ``out_path``.

    Settings keep text (code, here) exactly recoverable: no normalisation, whitespace kept as is
    (runs of spaces may become pieces, for indentation), no dummy leading space, and byte fallback
    for characters outside the vocabulary. Ids: pad 0, unk 1, bos 2, eos 3, then
    ``special_tokens`` (user-defined pieces, never split). The vocabulary has exactly
    ``vocab_size`` pieces (sentencepiece raises if the text cannot fill it). ``max_sentences``
    > 0 trains on a random sample of that many lines (for corpora too large to hold in memory).
    ``progress`` shows a bar of lines read.
    """
    out_path = Path(out_path)
    prefix = out_path.parent / f".{out_path.name}.tmp-{uuid.uuid4().hex}"
    lines = _lines(documents)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(lines, desc="tokenizer: reading", unit=" lines", unit_scale=True, disable=None)  # None: tty only
        lines = iter(bar)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines,
            model_prefix=str(prefix),
            vocab_size=vocab_size,
            hard_vocab_limit=True,
            model_type=model_type,
            split_digits=split_digits,
            byte_fallback=byte_fallback,
            user_defined_symbols=list(special_tokens),
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
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
        if bar is not None:
            bar.close()
        for suffix in (".model", ".vocab"):
            Path(f"{prefix}{suffix}").unlink(missing_ok=True)
    tokenizer = Tokenizer(out_path)
    if tokenizer.vocab_size != vocab_size:
        raise RuntimeError(f"trained vocab has {tokenizer.vocab_size} pieces, not {vocab_size}")
    return tokenizer


def load_tokenizer(path: str | os.PathLike, expected_vocab_size: int | None = None) -> Tokenizer:
    """Load a sentencepiece model, refusing (DataError) a bad file or a vocab size other than expected."""
    if not Path(path).is_file():
        raise DataError(f"tokenizer {path} does not exist")
    try:
        tokenizer = Tokenizer(path)
    except (OSError, RuntimeError) as e:
        raise DataError(f"tokenizer {path} is not a sentencepiece model ({str(e).splitlines()[0]})") from None
    if expected_vocab_size is not None and tokenizer.vocab_size != expected_vocab_size:
        raise DataError(
            f"tokenizer {path} has {tokenizer.vocab_size} pieces but model.vocab_size is {expected_vocab_size}"
        )
    return tokenizer


def _lines(documents: Iterable[str]) -> Iterator[str]:
    # sentencepiece trains on sentences; lines are the natural unit of code.
    for doc in documents:
        yield from doc.splitlines()
