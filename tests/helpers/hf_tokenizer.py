"""A Llama-3-style Hugging Face tokenizer built with the `tokenizers` library alone: byte-level BPE,
digits grouped in threes (so a 5-digit passkey is several tokens), <|begin_of_text|> prepended by its
post-processor, <|end_of_text|> a special token — saved as a bare tokenizer.json, as Llama 3 ships it."""

from pathlib import Path

from megabam.data.corpus import python_stdlib_documents

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def write_hf_tokenizer(path: Path, vocab_size: int = 512) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\d{1,3}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(python_stdlib_documents(300_000), trainer)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]),
        ]
    )
    assert tok.get_vocab_size() == vocab_size
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path
