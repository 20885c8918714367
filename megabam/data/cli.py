"""`megabam data tokenizer|prepare|inspect|synth`: the data pipeline's commands."""

import argparse
from pathlib import Path

from megabam import exit_codes
from megabam.data.errors import DataError

TOKENIZER_HELP = "a sentencepiece .model, a Hugging Face tokenizer.json, or a save_pretrained folder (local)"
INPUTS_HELP = (
    "text inputs: .txt/.md/.jsonl (plain, .gz or .zst), .parquet, .arrow, Hugging Face datasets folders "
    "(save_to_disk or a hub download), MDS dirs; directories; globs"
)


def add_data_parser(sub) -> None:
    """Register the ``data`` command and its subcommands on ``megabam``'s subparsers."""
    data = sub.add_parser(
        "data",
        help="tokenizers, MDS shard preparation, inspection, synthetic tasks",
        description="Data pipeline: train a tokenizer, prepare MDS shards, inspect them, "
        "write synthetic retrieval tasks.",
    )
    cmds = data.add_subparsers(dest="data_command", required=True)

    tok = cmds.add_parser(
        "tokenizer",
        help="train a sentencepiece model, or check an existing tokenizer",
        description="Train a sentencepiece model on text inputs (files, directories, globs, Parquet, Arrow, "
        "datasets folders, MDS text shards), or check an existing .model with --load. "
        "Example: megabam data tokenizer corpus/*.jsonl.zst --out tok.model --vocab-size 32000",
    )
    tok.add_argument("inputs", nargs="*", help=INPUTS_HELP)
    tok.add_argument("--out", help="where to write the .model (written atomically)")
    tok.add_argument("--overwrite", action="store_true", help="replace an existing .model at --out")
    tok.add_argument(
        "--load",
        metavar="TOKENIZER",
        help="check an existing tokenizer (a sentencepiece .model, a tokenizer.json or a save_pretrained folder)",
    )
    tok.add_argument("--vocab-size", type=int, help="pieces in the vocabulary (required to train; checked with --load)")
    tok.add_argument(
        "--model-type", choices=["bpe", "unigram"], default="bpe", help="sentencepiece algorithm (default bpe)"
    )
    tok.add_argument("--no-byte-fallback", action="store_true", help="map unknown characters to <unk> instead of bytes")
    tok.add_argument("--no-split-digits", action="store_true", help="allow pieces of several digits")
    tok.add_argument(
        "--special",
        nargs="*",
        default=[],
        metavar="PIECE",
        help="user-defined special tokens, never split (ids after pad 0, unk 1, bos 2, eos 3)",
    )
    tok.add_argument(
        "--max-sentences", type=int, default=0, help="train on a random sample of this many lines (0 = all)"
    )
    _add_reading_args(tok)

    prep = cmds.add_parser(
        "prepare",
        help="tokenize text into packed MDS shards (train/val)",
        description="Tokenize inputs, pack into seq_len+1-token samples (document boundaries kept) and write MDS "
        "shards with a train/val split, in tasks of about --task-size of input that worker processes run "
        "(reading, tokenizing, packing and writing each its own part), merged at the end. The dataset is the same "
        "for any --workers or --num-shards; an interrupted prepare run again with the same arguments keeps its "
        "finished tasks. Example: megabam data prepare web/*.jsonl.gz --out data/web --tokenizer tok.model "
        "--seq-len 4096 --workers 8",
    )
    prep.add_argument("inputs", nargs="+", help=INPUTS_HELP)
    prep.add_argument("--out", required=True, help="output directory (appears only when complete)")
    prep.add_argument("--tokenizer", required=True, help=TOKENIZER_HELP)
    prep.add_argument(
        "--seq-len", type=int, required=True, help="training sequence length; samples hold seq_len+1 tokens"
    )
    prep.add_argument(
        "--workers", type=int, default=1, help="processes running tasks (0 or 1 = this process; default 1)"
    )
    prep.add_argument(
        "--task-size", default="64mb", help="input bytes per task, the unit of work and of resuming (default 64mb)"
    )
    prep.add_argument(
        "--shard-index",
        type=int,
        default=0,
        help="this process's part of a prepare split over --num-shards processes (nodes) writing into one --out",
    )
    prep.add_argument(
        "--num-shards",
        type=int,
        default=1,
        help="processes sharing the prepare (e.g. a SLURM array: --shard-index $SLURM_ARRAY_TASK_ID); the last "
        "to finish merges, or `megabam data merge OUT` does",
    )
    prep.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out for validation")
    prep.add_argument("--seed", type=int, default=0, help="seed of the train/val assignment")
    prep.add_argument(
        "--compression", default="zstd", help="shard compression (zstd, zstd:LEVEL, gz, br, snappy, none)"
    )
    prep.add_argument("--size-limit", default="64mb", help="shard size limit before compression (e.g. 64mb)")
    prep.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_reading_args(prep)

    mrg = cmds.add_parser(
        "merge",
        help="join the parts of a prepare split over several processes",
        description="Join the finished tasks of `data prepare --num-shards S` into the dataset OUT (streaming's "
        "index merge). Example: megabam data merge data/web",
    )
    mrg.add_argument("out", help="the --out of the prepare")
    mrg.add_argument("--overwrite", action="store_true", help="replace an existing OUT")

    ins = cmds.add_parser(
        "inspect",
        help="verify shards and summarise a prepared dataset",
        description="Verify shard sizes and hashes, count shards, samples and tokens, summarise token ids "
        "and decode a few samples. Example: megabam data inspect data/web",
    )
    ins.add_argument("path", help="a prepared dataset (train/, val/) or one MDS directory")
    ins.add_argument(
        "--tokenizer", help="the tokenizer for decoding (default: the one beside the splits); " + TOKENIZER_HELP
    )
    ins.add_argument("--vocab-size", type=int, help="refuse token ids at or above this size (default: the tokenizer's)")
    ins.add_argument("--samples", type=int, default=2, help="samples to decode per split")
    ins.add_argument("--max-samples", type=int, help="read at most this many samples per split for the statistics")

    syn = cmds.add_parser(
        "synth",
        help="write passkey / RULER NIAH samples as a prepared dataset",
        description="Write synthetic retrieval samples (one whole document per sample) in the layout of "
        "`prepare`, to mix into training. Example: megabam data synth passkey --out data/passkey "
        "--tokenizer tok.model --seq-len 4096 --train 10000 --val 100",
    )
    from megabam.data.synth import KINDS

    syn.add_argument("kind", choices=KINDS, help="passkey (the BAM paper's protocol) or a RULER single-needle variant")
    syn.add_argument("--out", required=True, help="output directory (appears only when complete)")
    syn.add_argument("--tokenizer", required=True, help=TOKENIZER_HELP)
    syn.add_argument(
        "--seq-len", type=int, required=True, help="training sequence length; samples hold seq_len+1 tokens"
    )
    syn.add_argument("--train", type=int, required=True, help="training samples")
    syn.add_argument("--val", type=int, default=0, help="validation samples")
    syn.add_argument("--seed", type=int, default=0, help="seed of keys, values and depths")
    syn.add_argument(
        "--essay", help="haystack text file of the essay NIAH variants (default: the Python documentation's prose)"
    )
    syn.add_argument("--overwrite", action="store_true", help="replace an existing output directory")


def _add_reading_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--field",
        default="text",
        help="JSON Lines field / Parquet, Arrow or MDS column that holds the text (default text)",
    )
    parser.add_argument(
        "--hf-split",
        default="train",
        help="the split read from a Hugging Face datasets folder that holds several (default train)",
    )
    parser.add_argument(
        "--text-unit",
        choices=["file", "line"],
        default="file",
        help="a plain text file is one document (file) or one per line (line)",
    )
    parser.add_argument(
        "--on-bad-utf8",
        choices=["fail", "replace"],
        default="fail",
        help="non-UTF-8 bytes: stop with an error (fail) or replace them and count (replace)",
    )


def run_data(args) -> int:
    """Run a ``megabam data`` subcommand (bad input: a DataError, one line from the CLI, exit 2)."""
    lines = _COMMANDS[args.data_command](args)
    print("\n".join(lines))
    return exit_codes.OK


def _tokenizer(args) -> list[str]:
    from megabam.data.sources import SourceStats, expand_inputs, read_documents
    from megabam.data.tokenizer import load_tokenizer, train_tokenizer

    if args.load:
        tok = load_tokenizer(args.load, args.vocab_size)
        kind = type(tok).__name__.removesuffix("Tokenizer")
        ids = f"pad {tok.pad_id}, bos {tok.bos_id}, eos {tok.eos_id}"
        return [f"tokenizer {args.load} ({kind}, {tok.path.name}): {tok.vocab_size} pieces, {ids}"]
    if not args.inputs or not args.out or not args.vocab_size:
        raise DataError(
            None, "--out", "training a tokenizer needs inputs, --out and --vocab-size (or check one with --load)"
        )
    out = Path(args.out)
    if out.is_dir():
        raise DataError(None, "--out", f"{out} is a directory; give the path of the .model to write")
    if out.exists() and not args.overwrite:
        raise DataError(None, "--out", f"{out} exists; pass --overwrite to replace it")
    stats = SourceStats()
    docs = read_documents(
        expand_inputs(args.inputs, args.hf_split),
        text_field=args.field,
        text_unit=args.text_unit,
        on_bad_utf8=args.on_bad_utf8,
        stats=stats,
    )
    try:
        tok = train_tokenizer(
            docs,
            args.out,
            args.vocab_size,
            model_type=args.model_type,
            split_digits=not args.no_split_digits,
            byte_fallback=not args.no_byte_fallback,
            special_tokens=args.special,
            max_sentences=args.max_sentences,
            progress=True,
        )
    except RuntimeError as e:  # sentencepiece: e.g. too little text for the vocabulary size
        if stats.documents == 0:
            raise DataError(" ".join(args.inputs), None, "the inputs hold no non-empty document") from None
        raise DataError(args.out, None, f"tokenizer training failed: {str(e).splitlines()[0]}") from None
    return [f"tokenizer {args.out}: {tok.vocab_size} pieces ({args.model_type})"]


def _check_shard_options(args) -> None:
    """--workers, --compression and --size-limit of `prepare`, refused before any input is read."""
    from megabam.data.streaming_import import import_streaming

    import_streaming()  # its stand-ins go in before streaming.base is first imported
    from streaming.base.compression import get_compressions
    from streaming.base.util import bytes_to_int

    if args.workers < 0:
        raise DataError(None, "--workers", f"must be 0 (in the main process) or more, got {args.workers}")
    if args.num_shards < 1 or not 0 <= args.shard_index < args.num_shards:
        raise DataError(
            None, "--shard-index", f"{args.shard_index} must lie in 0..{args.num_shards - 1} (--num-shards)"
        )
    if args.compression != "none" and args.compression not in get_compressions():
        raise DataError(
            None, "--compression", f"unknown {args.compression!r} (zstd, zstd:LEVEL, gz, br, bz2, snappy, none)"
        )
    for flag, value in (("--size-limit", args.size_limit), ("--task-size", args.task_size)):
        try:
            if bytes_to_int(value) < 1:
                raise ValueError
        except ValueError:
            raise DataError(None, flag, f"{value!r} is not a size (e.g. 64mb, 1gb, 500000)") from None


def _prepare(args) -> list[str]:
    from megabam.data.prepare import prepare_dataset
    from megabam.data.streaming_import import import_streaming

    _check_shard_options(args)
    bytes_to_int = import_streaming().base.util.bytes_to_int
    result = prepare_dataset(
        args.inputs,
        args.out,
        args.tokenizer,
        args.seq_len,
        text_field=args.field,
        text_unit=args.text_unit,
        on_bad_utf8=args.on_bad_utf8,
        hf_split=args.hf_split,
        workers=args.workers,
        val_fraction=args.val_fraction,
        seed=args.seed,
        compression=None if args.compression == "none" else args.compression,
        size_limit=args.size_limit,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        task_bytes=bytes_to_int(args.task_size),
        shard_index=args.shard_index,
        num_shards=args.num_shards,
    )
    return result.lines(Path(args.out))


def _merge(args) -> list[str]:
    from megabam.data.prepare import merge_prepared

    summary = merge_prepared(args.out, args.overwrite)
    if summary is None:
        return [f"{args.out}: another process is merging it"]
    return [f"merged {args.out}"] + summary.lines()


def _inspect(args) -> list[str]:
    from megabam.data.inspect_data import inspect_dataset, report_lines

    return report_lines(inspect_dataset(args.path, args.tokenizer, args.vocab_size, args.samples, args.max_samples))


def _synth(args) -> list[str]:
    from megabam.data.synth import write_synthetic_dataset

    if args.essay is not None:
        try:
            Path(args.essay).read_bytes().decode("utf-8")
        except OSError as e:
            raise DataError(args.essay, "--essay", f"cannot read ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise DataError(args.essay, "--essay", f"not UTF-8 text (byte {e.start})") from None
    counts = write_synthetic_dataset(
        args.kind,
        args.out,
        args.tokenizer,
        args.seq_len,
        args.train,
        args.val,
        seed=args.seed,
        essay_path=args.essay,
        overwrite=args.overwrite,
    )
    return [
        f"{args.kind}: {counts['train']} train and {counts['val']} val samples of {args.seq_len + 1} tokens "
        f"in {args.out}"
    ]


_COMMANDS = {"tokenizer": _tokenizer, "prepare": _prepare, "merge": _merge, "inspect": _inspect, "synth": _synth}
