"""Tokenizers: sentencepiece models (trained here, or brought) and Hugging Face tokenizers
(``tokenizer.json`` or a ``save_pretrained`` folder, read with the ``tokenizers`` library), behind
one interface.

A megabam folder (prepared data, a run, a consolidated or imported model) carries its tokenizer as
``tokenizer.model`` (sentencepiece) or ``tokenizer.json`` with a ``tokenizer_config.json`` beside it
naming the special tokens; ``tokenizer_in`` finds it and ``copy_tokenizer`` writes it. Only local
paths are read: nothing is downloaded.
"""

import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import sentencepiece as spm

from megabam.data.errors import DataError
from megabam.data.sources import read_json_object
from megabam.progress import Progress
from megabam.staging import staged_name

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
SENTENCEPIECE_FILE, HF_FILE, HF_CONFIG = "tokenizer.model", "tokenizer.json", "tokenizer_config.json"
# Where a folder holds both (a Llama-2-style save_pretrained folder, megabam's own export), the
# sentencepiece model is read: the original, of which tokenizer.json is a conversion.
TOKENIZER_FILES = (SENTENCEPIECE_FILE, HF_FILE)
# End-of-document tokens recognised in a tokenizer.json without a config naming its eos.
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# Lines longer than sentencepiece's default limit (4192 bytes) would be dropped from training.
_MAX_SENTENCE_BYTES = 1 << 16


class Tokenizer:
    """What megabam asks of a tokenizer. ``path`` is the file read (``tokenizer.model`` or
    ``tokenizer.json``); ``pad_id`` and ``bos_id`` may be None (a tokenizer without them), ``eos_id``
    (the document separator) never is."""

    path: Path
    file_name: str  # under which name a megabam folder carries it

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no bos/eos added)."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        """Text of token ids."""
        raise NotImplementedError

    vocab_size: int
    pad_id: int | None
    bos_id: int | None
    eos_id: int


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model loaded from ``path``."""

    file_name = SENTENCEPIECE_FILE

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        self.vocab_size = self._sp.get_piece_size()
        self.pad_id, self.bos_id, self.eos_id = (
            i if i >= 0 else None for i in (self._sp.pad_id(), self._sp.bos_id(), self._sp.eos_id())
        )

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, encoded on all cores."""
        return self._sp.encode(texts, num_threads=os.cpu_count() or 1)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def piece(self, i: int) -> str:
        return self._sp.id_to_piece(i)


class HFTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer (``tokenizer.json``); its special tokens from the
    ``tokenizer_config.json`` beside it, else from the file itself (the post-processor's template and
    the added special tokens). Raises DataError when no end-of-sequence token can be found."""

    file_name = HF_FILE

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer as RustTokenizer

        self.path = Path(path)
        self._tok = RustTokenizer.from_file(str(self.path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.config = (
            read_json_object(self.path.with_name(HF_CONFIG)) if self.path.with_name(HF_CONFIG).is_file() else {}
        )
        template_bos, template_eos = _template_specials(json.loads(self._tok.to_str()).get("post_processor"))
        named = lambda key: _token_name(self.config.get(key))  # noqa: E731
        added = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        eos = named("eos_token") or template_eos or next((n for n in EOS_NAMES if n in added), None)
        self.bos_token, self.eos_token, self.pad_token = named("bos_token") or template_bos, eos, named("pad_token")
        self.bos_id, self.pad_id = (self._id(t) for t in (self.bos_token, self.pad_token))
        eos_id = self._id(eos)
        if eos_id is None:
            raise DataError(
                self.path,
                None,
                f"no end-of-sequence token (no eos_token in a {HF_CONFIG} beside it, none in its "
                f"post-processor, no special token named {' or '.join(EOS_NAMES)}): give its save_pretrained folder",
            )
        self.eos_id = eos_id

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def config_for_copy(self) -> dict:
        """The tokenizer_config.json a copy carries: the original's, else one naming what was found."""
        if self.config:
            return self.config
        names = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        return {"tokenizer_class": "PreTrainedTokenizerFast", **{k: v for k, v in names.items() if v is not None}}


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json gives it: a string or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_specials(post_processor) -> tuple[str | None, str | None]:
    """(bos, eos) of a TemplateProcessing post-processor's single-sequence template (inside a Sequence
    too, as Llama 3's): the special token before $A, the one after it."""
    if not isinstance(post_processor, dict):
        return None, None
    if post_processor.get("type") == "Sequence":
        for inner in post_processor.get("processors", []):
            found = _template_specials(inner)
            if found != (None, None):
                return found
        return None, None
    if post_processor.get("type") != "TemplateProcessing":
        return None, None
    items = post_processor.get("single", [])
    at = next((i for i, item in enumerate(items) if "Sequence" in item), None)
    special = lambda item: item.get("SpecialToken", {}).get("id") if isinstance(item, dict) else None  # noqa: E731
    if at is None:
        return None, None
    return (special(items[at - 1]) if at > 0 else None), (special(items[at + 1]) if at + 1 < len(items) else None)


def tokenizer_in(folder: str | os.PathLike) -> Path | None:
    """The tokenizer file a folder holds (TOKENIZER_FILES), or None."""
    return next((Path(folder) / name for name in TOKENIZER_FILES if (Path(folder) / name).is_file()), None)


def open_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer at ``path``: a sentencepiece model, a tokenizer.json, or a folder holding one."""
    path = Path(path)
    if path.is_dir():
        found = tokenizer_in(path)
        if found is None:
            raise DataError(path, None, f"a tokenizer folder without {' or '.join(TOKENIZER_FILES)}")
        path = found
    return HFTokenizer(path) if path.name.lower().endswith(".json") else SentencePieceTokenizer(path)


def copy_tokenizer(tokenizer: Tokenizer, folder: Path) -> Path:
    """Write ``tokenizer`` into ``folder`` under its file name (with its config, for a Hugging Face one)."""
    target = folder / tokenizer.file_name
    shutil.copyfile(tokenizer.path, target)
    if isinstance(tokenizer, HFTokenizer):
        (folder / HF_CONFIG).write_text(json.dumps(tokenizer.config_for_copy(), indent=1) + "\n")
    return target


def same_tokenizer(a: Path, b: Path) -> bool:
    """Whether two tokenizer files encode alike (byte-equal files)."""
    return a.name == b.name and a.read_bytes() == b.read_bytes()


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
) -> SentencePieceTokenizer:
    """Train a sentencepiece model on ``documents`` and write it atomically to ``out_path``.

    Settings keep text (code, here) exactly recoverable: no normalisation, whitespace kept as is
    (runs of spaces may become pieces, for indentation), no dummy leading space, and byte fallback
    for characters outside the vocabulary. Ids: pad 0, unk 1, bos 2, eos 3, then
    ``special_tokens`` (user-defined pieces, never split). The vocabulary has exactly
    ``vocab_size`` pieces (sentencepiece raises if the text cannot fill it). ``max_sentences``
    > 0 trains on a random sample of that many lines (for corpora too large to hold in memory).
    ``progress`` shows the lines read (megabam/progress.py).
    """
    out_path = Path(out_path)
    prefix = staged_name(out_path)  # sentencepiece writes PREFIX.model and PREFIX.vocab
    # the lines read (their number is not known before: the inputs are read as a stream)
    report = Progress("tokenizer: reading", None, " lines", enabled=progress)
    lines = report.iterate(_lines(documents))
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
        report.close()
        for suffix in (".model", ".vocab"):
            Path(f"{prefix}{suffix}").unlink(missing_ok=True)
    tokenizer = SentencePieceTokenizer(out_path)
    if tokenizer.vocab_size != vocab_size:
        raise RuntimeError(f"trained vocab has {tokenizer.vocab_size} pieces, not {vocab_size}")
    return tokenizer


def load_tokenizer(path: str | os.PathLike, expected_vocab_size: int | None = None) -> Tokenizer:
    """Load a tokenizer (a sentencepiece .model, a tokenizer.json or a save_pretrained folder), refusing
    (DataError, one line) a missing or bad one, a hub id, or a vocabulary size other than expected."""
    where = Path(path)
    if not where.exists():
        if HUB_ID.match(str(path)):
            raise DataError(
                path,
                None,
                "the tokenizer is not a local path (a hub id?); only local files are read, nothing is downloaded: "
                "save the tokenizer with save_pretrained (or download its repository) and give the folder",
            )
        raise DataError(path, None, "tokenizer does not exist")
    try:
        tokenizer = open_tokenizer(where)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 -- sentencepiece raises OSError/RuntimeError, tokenizers a bare Exception
        kind = "Hugging Face tokenizer.json" if where.suffix == ".json" or where.is_dir() else "sentencepiece model"
        raise DataError(path, None, f"not a {kind} ({str(e).splitlines()[0] if str(e) else e!r})") from None
    if expected_vocab_size is not None and tokenizer.vocab_size != expected_vocab_size:
        raise DataError(
            path, "model.vocab_size", f"{expected_vocab_size}, but the tokenizer has {tokenizer.vocab_size} pieces"
        )
    return tokenizer


def _lines(documents: Iterable[str]) -> Iterator[str]:
    # sentencepiece trains on sentences; lines are the natural unit of code.
    for doc in documents:
        yield from doc.splitlines()
