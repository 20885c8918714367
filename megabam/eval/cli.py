"""`megabam eval passkey|niah|ppl|copying RUN|CKPT` and `megabam plot priors|attention|training`.

Evaluation runs a trained model in one process. Each eval command prints a table and writes JSON and
(but copying) a figure (PNG, or --format pdf|svg) into --out (default RUN/eval), named after the checkpoint's step;
plots go to RUN/plots. Files are written through temporary names (an interrupted command leaves no
half file).
"""

import argparse
import sys
from pathlib import Path

from megabam import exit_codes
from megabam.config.schema import MAX_TOKENS
from megabam.data.niah import VARIANTS
from megabam.errors import BadArgument
from megabam.eval.figures import FORMATS
from megabam.progress import Progress, note
from megabam.staging import write_json


def add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="long-context evaluation of a run or checkpoint (passkey, niah, ppl)")
    tasks = ev.add_subparsers(dest="task", required=True)

    def common(p: argparse.ArgumentParser, seeded: str | None = "keys and needles") -> None:
        p.add_argument(
            "source",
            nargs="?",
            help="run directory (its newest verified checkpoint), checkpoint directory or consolidated folder",
        )
        p.add_argument("--hf", metavar="DIR", help="a megabam Hugging Face export (megabam convert to-hf) instead")
        p.add_argument("--out", help="directory for the JSON and the figure (default: RUN/eval)")
        add_format_argument(p)
        p.add_argument("--device", default="cpu", help="torch device (default cpu)")
        p.add_argument(
            "--chunk", type=int, default=1024, help="tokens per prefill chunk: memory ∝ chunk × context (default 1024)"
        )
        if seeded:
            p.add_argument("--seed", type=int, default=0, help=f"seed of the {seeded} (default 0)")

    pk = tasks.add_parser("passkey", help="passkey retrieval (the BAM paper's protocol) over lengths × depths")
    common(pk)
    pk.add_argument("--lengths", type=int, nargs="+", help="tokens per prompt (default: 1×, 4×, 16× data.seq_len)")
    pk.add_argument(
        "--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths in [0, 1]"
    )
    pk.add_argument("--trials", type=int, default=4, help="prompts (random keys) per cell (default 4)")

    nh = tasks.add_parser("niah", help="RULER's needle-in-a-haystack tasks, answered by greedy generation")
    common(nh)
    nh.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, metavar="VARIANT")
    nh.add_argument("--lengths", type=int, nargs="+", help="prompt tokens (default: 1×, 4× data.seq_len)")
    nh.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.5, 1.0], help="needle depths in [0, 1]")
    nh.add_argument("--trials", type=int, default=2, help="prompts per cell (default 2)")
    nh.add_argument("--essay", help="haystack text of the essay variants (default: the Python documentation's prose)")

    cp = tasks.add_parser(
        "copying", help="per layer and head, the attention each puts on the passkey's tokens as it copies them"
    )
    cp.add_argument("source", nargs="?", help="run directory, checkpoint directory or consolidated folder")
    cp.add_argument("--hf", metavar="DIR", help="a megabam Hugging Face export (megabam convert to-hf) instead")
    cp.add_argument("--out", help="directory for the JSON (default: RUN/eval)")
    cp.add_argument("--device", default="cpu", help="torch device (default cpu)")
    cp.add_argument("--seed", type=int, default=0, help="seed of the keys (default 0)")
    cp.add_argument("--lengths", type=int, nargs="+", help="tokens per prompt (default: 1×, 4× data.seq_len)")
    cp.add_argument("--depth", type=float, default=0.5, help="needle depth in [0, 1] (default 0.5)")
    cp.add_argument("--keys", type=int, default=3, help="prompts (random keys) averaged per length (default 3)")
    cp.set_defaults(chunk=1, format=None)  # no prefill chunks (the whole map is read), no figure

    pp = tasks.add_parser("ppl", help="perplexity of a text file or MDS dataset, plain and sliding-window")
    common(pp, seeded=None)  # nothing drawn: the input is scored as it is
    src = pp.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="a UTF-8 text file, tokenized whole")
    src.add_argument("--dataset", help="an MDS dataset directory (megabam data prepare); samples joined in order")
    pp.add_argument("--length", type=int, help="tokens per scored sequence (default 4× data.seq_len)")
    pp.add_argument("--window", type=int, help="sliding window in tokens (default: data.seq_len)")
    pp.add_argument("--stride", type=int, help="sliding-window stride (default: window / 2)")
    pp.add_argument("--max-tokens", type=int, default=65536, help="tokens of the input used at most (default 65536)")
    pp.add_argument("--buckets", type=int, default=8, help="position buckets of the loss-by-position table")


def add_repro_parser(sub) -> None:
    from megabam.eval.repro import STUDIES

    rp = sub.add_parser(
        "repro",
        help="reproduce BAM's or SWAX's claims in miniature on CPU (arms × seeds, resumable); mqar: the recall grid",
        description="Train every arm for every seed (each a run directory; finished runs are not retrained, "
        "interrupted ones resume), evaluate retrieval beyond the training length, write a table and a figure. "
        "`mqar` instead trains every mixer × width × number of pairs × seed on multi-query associative recall "
        "(megabam/eval/mqar.py; finished cells are skipped).",
    )
    rp.add_argument("study", choices=sorted([*STUDIES, "mqar"]))
    rp.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides for every arm")
    rp.add_argument("--out", help="directory of the runs and results (default runs/repro-STUDY)")
    arms = "; ".join(f"{name}: {', '.join(study.arms)}" for name, study in sorted(STUDIES.items()))
    rp.add_argument("--arms", nargs="+", metavar="ARM", help=f"arms to run (default: all of the study's; {arms})")
    rp.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds per arm (default 0 1 2)")
    rp.add_argument(
        "--steps",
        type=int,
        help="training steps per run (default: the study's, bam 1200; swax: its config's train.steps)",
    )
    rp.add_argument(
        "--lengths", type=int, nargs="+", default=[1, 4, 16, 32, 64], help="multiples of the training length scored"
    )
    rp.add_argument(
        "--depths",
        type=float,
        nargs="+",
        default=[0.0, 0.25, 0.5, 0.75, 1.0],
        help="needle depths in [0, 1] (default 0 0.25 0.5 0.75 1)",
    )
    rp.add_argument(
        "--trials",
        type=int,
        default=4,
        help="prompts per (length, depth) cell (default 4: 20 prompts per length, each with its own key)",
    )
    rp.add_argument(
        "--average",
        type=int,
        default=1,
        help="score the mean of each run's last K checkpoints (megabam convert average; default 1: the final "
        "checkpoint alone)",
    )
    # Their defaults live in megabam/eval/mqar.py (MIXERS, Setting), imported only when mqar runs:
    # it imports torch, which the parser of every command would otherwise pay for (~1 s).
    mq = rp.add_argument_group("mqar only (defaults: megabam/eval/mqar.py)")
    mq.add_argument("--mixers", nargs="+", help="mixers or hybrids (default: all six)")
    mq.add_argument("--widths", type=int, nargs="+", default=[64, 128], help="d_model of the cells (default 64 128)")
    mq.add_argument("--pairs", type=int, nargs="+", default=[4, 8, 16], help="key-value pairs (default 4 8 16)")
    mq.add_argument("--seq-len", type=int, help="tokens per sample (default 64)")
    mq.add_argument("--vocab", type=int, help="vocabulary size (default 64)")
    mq.add_argument("--window", type=int, help="the SWA layers' window (default 8)")
    mq.add_argument("--lr", type=float, help="peak AdamW learning rate (default 0.003)")
    mq.add_argument("--batch", type=int, help="samples per step (default 32)")


def run_repro(args) -> int:
    from megabam.eval.repro import ArmFailed

    try:
        return _guarded(lambda: _repro(args))
    except ArmFailed as e:  # not bad input: the run's own log says why; finished arms are kept
        print(f"megabam: error: {e}", file=sys.stderr)
        return 1


def _repro(args) -> list[str]:
    from megabam.config import ConfigError, load_config
    from megabam.eval.repro import REPO, STUDIES, reproduce

    if args.study == "mqar":
        return _mqar(args)
    study = STUDIES[args.study]
    arms = args.arms or list(study.arms)
    unknown = [a for a in arms if a not in study.arms]
    _require(not unknown, f"--arms: unknown arm(s) {', '.join(unknown)} (known: {', '.join(study.arms)})")
    _require(
        bool(args.seeds) and len(set(args.seeds)) == len(args.seeds), f"--seeds must be distinct, got {args.seeds}"
    )
    _require(all(m >= 1 for m in args.lengths), f"--lengths must be positive multiples, got {args.lengths}")
    _require(args.trials >= 1, f"--trials must be at least 1, got {args.trials}")
    _require(all(0.0 <= d <= 1.0 for d in args.depths), f"--depths must lie in [0, 1], got {args.depths}")
    _require(args.steps is None or args.steps >= 1, f"--steps must be at least 1, got {args.steps}")
    _require(args.average >= 1, f"--average must be at least 1, got {args.average}")
    try:  # every arm's config checked before the first run starts
        default_steps = [f"train.steps={study.steps}"] if study.steps else []
        configs = [load_config(REPO / study.config, [*default_steps, *study.arms[a], *args.overrides]) for a in arms]
    except ConfigError as e:
        raise BadArgument(e.source, e.key, e.message) from None
    steps = args.steps or configs[0].train.steps
    kept = min(c.checkpoint.keep for c in configs)
    _require(args.average <= kept, f"--average {args.average}: the runs keep {kept} checkpoints (checkpoint.keep)")
    out = Path(args.out) if args.out else Path("runs") / f"repro-{args.study}"
    lengths = sorted(set(args.lengths))
    return reproduce(
        args.study,
        out,
        arms,
        args.seeds,
        lengths,
        args.depths,
        args.trials,
        args.overrides,
        steps,
        say=_say,
        average=args.average,
    )


def _mqar(args) -> list[str]:
    from dataclasses import replace

    from megabam.config import ConfigError, load_config
    from megabam.eval.mqar import MIXERS, Cell, Setting, model_overrides, mqar_batch, run_grid

    odd = [o for o in args.overrides if not o.startswith("model.")]
    _require(not odd, f"mqar takes model.* overrides only (a cell's training is its own), got {' '.join(odd)}")
    mixers = args.mixers or list(MIXERS)
    unknown = [m for m in mixers if m not in MIXERS]
    _require(not unknown, f"--mixers: unknown mixer(s) {', '.join(unknown)} (known: {', '.join(MIXERS)})")
    _require(len(set(args.seeds)) == len(args.seeds), f"--seeds must be distinct, got {args.seeds}")
    _require(args.steps is None or args.steps >= 1, f"--steps must be at least 1, got {args.steps}")
    _require(args.average >= 1, f"--average must be at least 1, got {args.average}")
    _require(all(w >= 32 and w % 32 == 0 for w in args.widths), f"--widths must be multiples of 32, got {args.widths}")
    _require(args.lr is None or args.lr > 0, f"--lr must be positive, got {args.lr}")
    _require(args.batch is None or args.batch >= 1, f"--batch must be at least 1, got {args.batch}")
    given = dict(
        seq_len=args.seq_len, vocab=args.vocab, window=args.window, steps=args.steps, lr=args.lr, batch=args.batch
    )
    setting = replace(Setting(overrides=tuple(args.overrides)), **{k: v for k, v in given.items() if v is not None})
    try:  # every cell's data and config checked before the first one trains
        import torch

        for p in args.pairs:
            mqar_batch(1, setting.seq_len, p, setting.vocab, torch.Generator())
        for m in mixers:
            load_config(None, model_overrides(Cell(m, min(args.widths), min(args.pairs), 0), setting))
    except ConfigError as e:
        raise BadArgument(e.source, e.key, e.message) from None
    except ValueError as e:  # the sample's layout (mqar_batch): pairs, seq_len and vocab together
        raise BadArgument(None, "--pairs", str(e)) from None
    out = Path(args.out) if args.out else Path("runs") / "repro-mqar"
    return run_grid(out, mixers, sorted(set(args.widths)), sorted(set(args.pairs)), args.seeds, setting, say=_say)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def add_plot_parser(sub) -> None:
    pl = sub.add_parser("plot", help="draw a run's learned priors, attention maps or training curves")
    kinds = pl.add_subparsers(dest="kind", required=True)
    pr = kinds.add_parser("priors", help="each layer's and head's learned log-prior over distance")
    pr.add_argument("source", help="run directory (its newest verified checkpoint) or checkpoint directory")
    pr.add_argument("--max-distance", type=int, help="longest distance drawn (default 64× data.seq_len)")
    at = kinds.add_parser("attention", help="attention maps of every attention layer and head on a passkey prompt")
    at.add_argument("source", help="run directory (its newest verified checkpoint) or checkpoint directory")
    at.add_argument("--length", type=int, help="prompt tokens (default data.seq_len)")
    tr = kinds.add_parser("training", help="loss, LR, window draws and per-head θ_α, θ_β, s over training")
    tr.add_argument("source", help="run directory (reads its metrics.jsonl)")
    for p in (pr, at, tr):
        p.add_argument("--out", help="figure file to write (default: RUN/plots/KIND-STEP.FORMAT)")
        add_format_argument(p)


def add_format_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", help=f"figure format: {', '.join(FORMATS)} (default: --out's suffix, else png)")


def _figure_suffix(args) -> str:
    """The figure's suffix, from --format (checked here: a bad value is one line, not argparse's usage)."""
    if args.format is not None and args.format not in FORMATS:
        raise BadArgument(None, "--format", f"{args.format!r} is not one of {', '.join(FORMATS)}")
    return f".{args.format or 'png'}"


def _guarded(work) -> int:
    """Run `work()`, print its lines; bad input (a path, a checkpoint, a value) is one line, exit 2.
    torch's threads are sized and flush denormals as in a training rank (a long prompt's far keys under
    a prior are mostly denormal probabilities: ~3x slower unflushed), before any of the work."""
    from megabam.parallel.threads import configure_cpu

    configure_cpu()
    lines = work()  # bad input: a UserError, one line from the CLI
    print("\n".join(lines))
    return exit_codes.OK


def run_eval(args) -> int:
    return _guarded(lambda: TASKS[args.task](args))


def run_plot(args) -> int:
    return _guarded(lambda: [str(PLOTS[args.kind](args))])


def _plot_priors(args) -> Path:
    from megabam.eval.plots import plot_priors

    _require(
        args.max_distance is None or args.max_distance >= 2,
        f"--max-distance must be at least 2, got {args.max_distance}",
    )
    trained = _trained(args.source)
    return plot_priors(trained, _plot_path(args, trained.run_dir, f"priors-{trained.tag}"), args.max_distance)


def _plot_attention(args) -> Path:
    from megabam.data.passkey import PromptTooShort
    from megabam.eval.plots import passkey_prompt, plot_attention

    trained = _trained(args.source)
    length = trained.config.data.seq_len if args.length is None else args.length
    try:
        ids, marks = passkey_prompt(trained, length)
    except PromptTooShort:
        raise BadArgument(
            None, "--length", f"{length} (default data.seq_len) is too short for a passkey prompt"
        ) from None
    # one forward pass, unmeasured: seconds at 16k tokens on a CPU
    note(f"attention: running the model on a {len(ids):,}-token passkey prompt, then drawing every head")
    return plot_attention(trained, ids, marks, _plot_path(args, trained.run_dir, f"attention-{trained.tag}"))


def _plot_training(args) -> Path:
    from megabam.eval.plots import plot_training

    run_dir = Path(args.source)
    return plot_training(run_dir, _plot_path(args, run_dir, "training"))


def _plot_path(args, run_dir: Path, name: str) -> Path:
    if args.out is None:
        return run_dir / "plots" / f"{name}{_figure_suffix(args)}"
    out = Path(args.out)
    if args.format is None:  # the suffix names the format
        suffixes = ", ".join(f".{f}" for f in FORMATS)
        _require(out.suffix[1:] in FORMATS, f"--out must name a {suffixes} file, got {args.out}")
    else:
        suffix = _figure_suffix(args)
        _require(out.suffix == suffix, f"--out {args.out} does not end in {suffix} (--format {args.format})")
    return out


def _trained(source: str):
    from megabam.eval.trained import load_trained

    return load_trained(source)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise BadArgument(None, None, message)


def _load(args):
    import torch

    from megabam.eval.trained import load_trained

    _require((args.source is None) != (args.hf is None), "give a run, checkpoint or folder, or --hf DIR (one of them)")
    _require(args.chunk >= 1, f"--chunk must be at least 1, got {args.chunk}")
    _figure_suffix(args)  # checked before the model loads
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise BadArgument(None, "--device", f"{args.device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if not torch.cuda.is_available():
        _require(device.type != "cuda", f"--device {args.device}: no CUDA device on this machine")
    trained = load_trained(args.source or args.hf, args.device)
    out = Path(args.out) if args.out else trained.run_dir / "eval"
    return trained, out, trained.tag


def _passkey(args) -> list[str]:
    from megabam.eval.figures import heatmap
    from megabam.eval.generate import predict_next
    from megabam.eval.passkey import passkey_grid

    _require(args.trials >= 1, f"--trials must be at least 1, got {args.trials}")
    _require(all(0.0 <= d <= 1.0 for d in args.depths), f"--depths must lie in [0, 1], got {args.depths}")
    trained, out, tag = _load(args)
    seq_len = trained.config.data.seq_len
    lengths = args.lengths or [seq_len, 4 * seq_len, 16 * seq_len]
    _require(all(1 <= n <= MAX_TOKENS for n in lengths), f"--lengths must lie in 1..{MAX_TOKENS:,}, got {lengths}")
    prompts = len(args.depths) * args.trials
    with Progress("passkey", prompts * sum(lengths), " tok") as progress:
        grid = passkey_grid(
            lambda ids: predict_next(trained.model, ids, args.chunk),
            trained.tokenizer,
            lengths,
            args.depths,
            args.trials,
            args.seed,
            args.device,
            progress,
        )
    data = {"checkpoint": str(trained.checkpoint), "step": trained.meta.step, "train_length": seq_len, **grid.to_json()}
    json_path = write_json(out / f"passkey-{tag}.json", data)
    title = f"passkey retrieval, {trained.run_dir.name} @ step {trained.meta.step} (trained at {seq_len})"
    figure = heatmap(grid.accuracy(), lengths, args.depths, title, out / f"passkey-{tag}{_figure_suffix(args)}")
    return [
        f"passkey retrieval ({args.trials} keys per cell), {trained.checkpoint}",
        *grid.table(),
        "",
        str(json_path),
        str(figure),
    ]


def _niah(args) -> list[str]:
    from megabam.eval.figures import heatmap
    from megabam.eval.niah import niah_grid
    from megabam.eval.perplexity import read_text

    _require(args.trials >= 1, f"--trials must be at least 1, got {args.trials}")
    _require(all(0.0 <= d <= 1.0 for d in args.depths), f"--depths must lie in [0, 1], got {args.depths}")
    essay = read_text(args.essay) if args.essay else None
    _require(essay is None or essay.strip() != "", f"--essay {args.essay}: holds no text to hide the needles in")
    trained, out, tag = _load(args)
    seq_len = trained.config.data.seq_len
    lengths = args.lengths or [seq_len, 4 * seq_len]
    _require(all(1 <= n <= MAX_TOKENS for n in lengths), f"--lengths must lie in 1..{MAX_TOKENS:,}, got {lengths}")
    lines, results = [f"RULER NIAH, string_match_all ({args.trials} prompts per cell), {trained.checkpoint}"], []
    prompts = len(args.depths) * args.trials
    progress = Progress("niah", len(args.variants) * prompts * sum(lengths), " tok")
    for variant in args.variants:
        grid = niah_grid(
            trained.model,
            trained.tokenizer,
            variant,
            lengths,
            args.depths,
            args.trials,
            args.seed,
            args.chunk,
            essay,
            progress,
        )
        results.append(grid.to_json())
        title = f"NIAH {variant}, {trained.run_dir.name} @ step {trained.meta.step} (trained at {seq_len})"
        figure = heatmap(grid.scores, lengths, args.depths, title, out / f"niah-{variant}-{tag}{_figure_suffix(args)}")
        lines += [*grid.table(), str(figure), ""]
    progress.close()
    data = {"checkpoint": str(trained.checkpoint), "step": trained.meta.step, "train_length": seq_len, "tasks": results}
    return [*lines, str(write_json(out / f"niah-{tag}.json", data))]


def _ppl(args) -> list[str]:
    from megabam.eval.figures import bucket_plot
    from megabam.eval.perplexity import evaluation_tokens, perplexity_report, tokens_run

    trained, out, tag = _load(args)
    seq_len = trained.config.data.seq_len
    # `is None`, not `or`: an explicit 0 is refused below rather than replaced by the default.
    length = 4 * seq_len if args.length is None else args.length
    window = seq_len if args.window is None else args.window
    stride = max(1, window // 2) if args.stride is None else args.stride
    _require(length >= 2, f"--length must be at least 2, got {length}")
    _require(window >= 2, f"--window must be at least 2, got {window}")
    _require(1 <= stride <= window, f"--stride must lie in [1, --window={window}], got {stride}")
    _require(args.buckets >= 1, f"--buckets must be at least 1, got {args.buckets}")
    _require(args.max_tokens >= length, f"--max-tokens ({args.max_tokens}) must be at least --length ({length})")
    tokens = evaluation_tokens(trained.tokenizer, args.text, args.dataset, args.max_tokens)
    _require(len(tokens) >= length, f"the input holds {len(tokens)} tokens, fewer than --length {length}")
    with Progress("ppl", tokens_run(len(tokens), length, window, stride), " tok") as progress:
        report = perplexity_report(trained.model, tokens, length, window, stride, args.buckets, args.chunk, progress)
    data = {
        "checkpoint": str(trained.checkpoint),
        "step": trained.meta.step,
        "train_length": seq_len,
        **report.to_json(),
    }
    json_path = write_json(out / f"ppl-{tag}.json", data)
    title = f"loss by position, {trained.run_dir.name} @ step {trained.meta.step}, sequences of {length}"
    figure = out / f"ppl-{tag}{_figure_suffix(args)}"
    bucket_plot(report.buckets, report.bucket_tokens(), title, figure, seq_len)
    return [f"perplexity, {trained.checkpoint}", *report.table(), "", str(json_path), str(figure)]


def _copying(args) -> list[str]:
    from megabam.eval.copying import copy_mass, copy_table, copying_keys

    _require(args.keys >= 1, f"--keys must be at least 1, got {args.keys}")
    _require(0.0 <= args.depth <= 1.0, f"--depth must lie in [0, 1], got {args.depth}")
    trained, out, tag = _load(args)
    seq_len = trained.config.data.seq_len
    lengths = args.lengths or [seq_len, 4 * seq_len]
    # The maps are whole (heads × n × n per layer): far below MAX_TOKENS, 32k tokens is 4 GiB per head.
    _require(
        all(1 <= n <= MAX_MAP_TOKENS for n in lengths), f"--lengths must lie in 1..{MAX_MAP_TOKENS:,}, got {lengths}"
    )
    keys = copying_keys(args.keys, args.seed)
    masses = {n: copy_mass(trained, n, args.depth, keys) for n in lengths}
    data = {
        "checkpoint": str(trained.checkpoint),
        "step": trained.meta.step,
        "train_length": seq_len,
        "depth": args.depth,
        "keys": keys,
        # [head][key token after the first] per layer; the printed table is each head's mean over tokens
        "copy_mass": {str(n): {str(layer): m.tolist() for layer, m in by.items()} for n, by in masses.items()},
    }
    return [
        f"attention on the key token being copied, needle at {args.depth:.0%}, {len(keys)} keys, {trained.checkpoint}",
        *copy_table(masses),
        "",
        str(write_json(out / f"copying-{tag}.json", data)),
    ]


MAX_MAP_TOKENS = 16384
TASKS = {"passkey": _passkey, "niah": _niah, "ppl": _ppl, "copying": _copying}
PLOTS = {"priors": _plot_priors, "attention": _plot_attention, "training": _plot_training}
