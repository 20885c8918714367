"""`megabam repro bam|swax`: the methods' claims in miniature, on CPU, in one resumable command.

Every arm (a set of config overrides) is trained for every seed as a run directory of its own under
--out, through `megabam train` in a fresh process: an interrupted reproduction continues each run
from its checkpoint, and a finished run (its final checkpoint present) is not trained again. Each run
is then evaluated once (passkey at multiples of the training length; NIAH for SWAX) and the result
kept beside it (RUN/eval/repro.json), so a rerun only evaluates what is missing. The table (mean over
seeds with its 95 % bootstrap interval; for SWAX also each length past 1× without the depth-100 %
prompts, whose needle any window holds) goes to --out/results.md and results.json, with a figure of
retrieval against length and, for the BAM arms, each run's θ_β per head over training.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megabam.progress import Progress
from megabam.staging import write_json

REPO = Path(__file__).resolve().parents[2]


class ArmFailed(RuntimeError):
    """One arm's `megabam train` exited with an error; the message names the run and its log."""


@dataclass(frozen=True)
class Study:
    config: str  # relative to the repository
    arms: dict[str, list[str]]  # name → overrides
    niah: bool  # also score RULER's single_1 needle task
    # Training steps per run unless --steps or a train.steps override says otherwise (None: the
    # config's). BAM: 1,200, twice the main job's 600, because at 600 only some seeds had begun to
    # copy; measured over seeds 0-2, GGD + SSMax retrieved from step 600-800 (docs/results.md).
    steps: int | None = None
    # Also score the longer lengths without the depth-100 % prompts, whose needle ends a few tokens
    # before the question, inside any sliding window at every length: what is left needs a memory
    # that reaches past the window (SWAX's recurrent layers). Those scores come from the per-depth
    # counts a result keeps (RUN/eval/repro.json's passkey_by_depth).
    past_window: bool = False


RADAM = ["optim.kind=radam", "schedule.warmup_steps=0"]

STUDIES = {
    "bam": Study(
        "yaml_configs/tiny_cpu.yaml",
        {
            "ggd_ssmax": [],
            "ggd": ["model.attention.ssmax=false"],
            "alibi": ["model.attention.positional=alibi", "model.attention.ssmax=false"],
            "alibi_ssmax": ["model.attention.positional=alibi"],
            "rope": ["model.attention.positional=rope", "model.attention.ssmax=false"],
            "nope": ["model.attention.positional=nope", "model.attention.ssmax=false"],
            "nope_ssmax": ["model.attention.positional=nope"],
            # The BAM reference code's recipe: RAdam without warm-up (alone: from megabam's init), every
            # θ starting at 0 (a flat, NoPE-like prior per layer), or (its May 2025 version) one prior
            # for all layers from ALiBi.
            "ggd_ssmax_radam": RADAM,
            "ggd_ssmax_radam_flat": [*RADAM, "model.attention.bam.init=nope"],
            "ggd_ssmax_radam_shared": [
                *RADAM,
                "model.attention.bam.init=alibi",
                "model.attention.bam.shared_across_layers=true",
            ],
        },
        niah=False,
        steps=1200,
    ),
    "swax": Study(
        "yaml_configs/swax_tiny_cpu.yaml",
        {
            "short_16": ["window.windows=[16]", "window.probabilities=[1.0]"],
            "long_128": ["window.windows=[128]", "window.probabilities=[1.0]"],
            "stochastic_16_128": ["window.windows=[16,128]", "window.probabilities=[0.5,0.5]"],
        },
        niah=True,
        past_window=True,
    ),
}


def run_name(arm: str, seed: int) -> str:
    return f"{arm}-seed{seed}"


def trained_to_the_end(run_dir: Path, steps: int) -> bool:
    latest = run_dir / "checkpoints" / "latest"
    return latest.is_file() and latest.read_text().strip() == f"step_{steps:08d}"


def train_run(study: Study, arm: str, seed: int, out: Path, overrides: list[str], log: Path, steps: int) -> None:
    """`megabam train` of one arm and seed (resuming the run if it was interrupted), its output into
    `log`; its steps shown as they reach the run's metrics.jsonl."""
    cmd = [
        sys.executable,
        "-m",
        "megabam.cli",
        "train",
        str(REPO / study.config),
        *study.arms[arm],
        *overrides,
        f"run.seed={seed}",
        f"run.output_dir={out}",
        f"run.name={run_name(arm, seed)}",
        "logging.progress_bar=false",
    ]
    metrics = out / run_name(arm, seed) / "metrics.jsonl"
    with log.open("a") as f, Progress(f"train {run_name(arm, seed)}", steps, " steps") as progress:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        with subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=os.environ.copy()) as proc:
            while proc.poll() is None:
                time.sleep(1.0)
                progress.advance_to(last_step(metrics))
        code = proc.returncode
    if code != 0:
        raise ArmFailed(f"training {run_name(arm, seed)} failed (exit {code}); its output is in {log}")


def last_step(metrics: Path) -> int:
    """The step of a metrics.jsonl's last complete row (0 before the first)."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):  # a row being written
            continue
    return 0


def evaluation(multiples: list[int], depths: list[float], trials: int, average: int = 1) -> dict:
    """The settings a run's cached result (eval/repro.json) was scored with: a rerun asking for
    other lengths, depths, trials or checkpoints averaged evaluates the run again instead of reusing
    it. The final checkpoint alone (average 1) is recorded as results were before averaging existed."""
    settings = {"lengths": list(multiples), "depths": list(depths), "trials": trials}
    return settings | ({"average": average} if average > 1 else {})


def reusable(
    result: dict | None, study: Study, multiples: list[int], depths: list[float], trials: int, average: int = 1
) -> bool:
    """Whether a run's cached result answers this evaluation: scored with the same settings, and
    holding the per-depth counts where the study's table needs them (results from before they were
    kept are scored again)."""
    if result is None or result.get("evaluation") != evaluation(multiples, depths, trials, average):
        return False
    return not study.past_window or "passkey_by_depth" in result


def averaged_model(run_dir: Path, average: int) -> Path:
    """RUN/average-K: the mean of the run's last `average` checkpoints (`megabam convert average`),
    written afresh each time the run is scored."""
    from megabam.checkpoint.consolidated import average as write_average
    from megabam.checkpoint.store import checkpoint_root, list_tags

    tags = list_tags(run_dir)[:average]
    if len(tags) < average:
        raise ArmFailed(f"{run_dir} keeps {len(tags)} checkpoint(s), fewer than --average {average}")
    folder = run_dir / f"average-{average}"
    write_average([checkpoint_root(run_dir) / tag for tag in tags], folder, overwrite=True)
    return folder


def evaluate_run(
    run_dir: Path, multiples: list[int], depths: list[float], trials: int, niah: bool, average: int = 1
) -> dict:
    """Passkey (and NIAH single_1) scores at each multiple of the training length, the validation loss,
    of the final checkpoint or (average > 1) of the mean of the last `average` checkpoints."""
    from megabam.eval.generate import predict_next
    from megabam.eval.niah import niah_grid
    from megabam.eval.passkey import passkey_grid
    from megabam.eval.plots import read_metrics
    from megabam.eval.trained import load_trained

    trained = load_trained(run_dir if average == 1 else averaged_model(run_dir, average))
    n = trained.config.data.seq_len
    lengths = [m * n for m in multiples]
    tasks = 2 if niah else 1
    progress = Progress(f"score {run_dir.name}", tasks * len(depths) * trials * sum(lengths), " tok")
    grid = passkey_grid(
        lambda ids: predict_next(trained.model, ids), trained.tokenizer, lengths, depths, trials, 0, "cpu", progress
    )
    result = {
        "evaluation": evaluation(multiples, depths, trials, average),
        "step": trained.meta.step,
        "train_length": n,
        "passkey": {str(m): grid.by_length()[length] for m, length in zip(multiples, lengths)},
        "passkey_by_depth": {str(m): row for m, row in zip(multiples, grid.retrieved)},  # retrieved per depth
        "key_tokens": {str(m): sum(row) / len(row) for m, row in zip(multiples, grid.key_tokens)},
        "val_loss": next(
            (r["val_loss"] for r in reversed(read_metrics(run_dir / "metrics.jsonl")) if "val_loss" in r), None
        ),
    }
    if niah:
        needles = niah_grid(
            trained.model, trained.tokenizer, "single_1", lengths, depths, trials, 0, 1024, progress=progress
        )
        result["niah_single_1"] = {str(m): sum(row) / len(row) for m, row in zip(multiples, needles.scores)}
    progress.close()
    return result


PAST_WINDOW = "passkey_past_window"  # the table's name for the passkey prompts at depths below 100 %


def prompt_outcomes(result: dict, metric: str, multiple: int) -> list[float]:
    """One run's prompts at a length as 1 (retrieved) or 0: its score there times the prompts it
    was scored on (trials × depths, from the result's own evaluation settings); for PAST_WINDOW,
    the retrieved counts of the depths below 100 %."""
    trials, depths = result["evaluation"]["trials"], result["evaluation"]["depths"]
    if metric == PAST_WINDOW:
        counts = result["passkey_by_depth"][str(multiple)]
        hits = sum(count for depth, count in zip(depths, counts) if depth < 1)
        n = trials * sum(depth < 1 for depth in depths)
    else:
        n = trials * len(depths)
        hits = round(result[metric][str(multiple)] * n)
    return [1.0] * hits + [0.0] * (n - hits)


def score_interval(seeds: dict[int, dict], metric: str, multiple: int):
    """The mean over seeds with its 95 % bootstrap interval, seeds and prompts redrawn (stats.py)."""
    from megabam.eval.stats import bootstrap_mean  # imports torch, which the CLI's parser (STUDIES) must not

    return bootstrap_mean([prompt_outcomes(r, metric, multiple) for r in seeds.values()])


def summarise(
    results: dict[str, dict[int, dict]], multiples: list[int], niah: bool, past_window: bool = False
) -> list[str]:
    """Markdown table: per arm, each retrieval score's mean over seeds with its 95 % bootstrap
    interval (seeds and prompts redrawn), the validation loss's mean (min–max over seeds); with
    `past_window`, the passkey beyond 1× once more without the depth-100 % prompts."""

    def loss_cell(values: list[float]) -> str:
        if not values:
            return ""
        mean = statistics.fmean(values)
        return f"{mean:.3f}" if len(values) == 1 else f"{mean:.3f} ({min(values):.3f}–{max(values):.3f})"

    metrics = [("passkey", m) for m in multiples]
    depths = {d for seeds in results.values() for r in seeds.values() for d in r["evaluation"]["depths"]}
    if past_window and min(depths, default=1.0) < 1:  # else there is no prompt past the window to score
        metrics += [(PAST_WINDOW, m) for m in multiples if m > 1]
    metrics += [("niah_single_1", m) for m in multiples] if niah else []
    names = {PAST_WINDOW: "passkey depth < 100 %"}
    head = ["arm", "seeds", "prompts", *(f"{names.get(name, name)} {m}×" for name, m in metrics), "val loss"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for arm, seeds in results.items():
        prompts = {len(prompt_outcomes(r, "passkey", multiples[0])) for r in seeds.values()}
        cells = [arm, str(len(seeds)), "/".join(map(str, sorted(prompts)))]
        cells += [str(score_interval(seeds, name, m)) for name, m in metrics]
        cells.append(loss_cell([r["val_loss"] for r in seeds.values() if r["val_loss"] is not None]))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def draw(results: dict[str, dict[int, dict]], multiples: list[int], title: str, out: Path) -> Path:
    """Passkey retrieval by length, one line per arm, error bars the 95 % bootstrap intervals."""
    from megabam.eval.figures import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, seeds in results.items():
        spans = [score_interval(seeds, "passkey", m) for m in multiples]
        means = [s.mean for s in spans]
        errors = [[s.mean - s.low for s in spans], [s.high - s.mean for s in spans]]
        ax.errorbar(multiples, means, yerr=errors, marker="o", capsize=3, label=arm)
    ax.set_xscale("log", base=2)
    ax.set_xticks(multiples, [f"{m}×" for m in multiples])
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("context length / training length")
    ax.set_ylabel("passkey retrieval (95 % bootstrap interval)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, out)


def reproduce(
    name: str,
    out: Path,
    arms: list[str],
    seeds: list[int],
    multiples: list[int],
    depths: list[float],
    trials: int,
    overrides: list[str],
    steps: int,
    say=print,
    average: int = 1,
) -> list[str]:
    from megabam.eval.plots import plot_training

    study = STUDIES[name]
    out.mkdir(parents=True, exist_ok=True)
    log = out / "train.log"
    results: dict[str, dict[int, dict]] = {}
    todo = [(arm, seed) for arm in arms for seed in seeds]
    for i, (arm, seed) in enumerate(todo, 1):
        run_dir = out / run_name(arm, seed)
        cached = run_dir / "eval" / "repro.json"
        start = time.perf_counter()
        result = json.loads(cached.read_text()) if cached.is_file() else None
        if reusable(result, study, multiples, depths, trials, average):
            what = "done before"
        else:
            trained_before = trained_to_the_end(run_dir, steps)
            if not trained_before:
                train_run(study, arm, seed, out, [*overrides, f"train.steps={steps}"], log, steps)
            result = evaluate_run(run_dir, multiples, depths, trials, study.niah, average)
            write_json(cached, result)  # a kill mid-write leaves no torn result
            what = "evaluated" if trained_before else "trained and evaluated"
            if name == "bam" and (run_dir / "metrics.jsonl").is_file():
                plot_training(run_dir, out / "plots" / f"{run_name(arm, seed)}-training.png")
        results.setdefault(arm, {})[seed] = result
        scores = " ".join(f"{m}×:{result['passkey'][str(m)]:.2f}" for m in multiples)
        say(f"[{i}/{len(todo)}] {arm} seed {seed}: {what} in {time.perf_counter() - start:.0f} s | passkey {scores}")
    table = summarise(results, multiples, study.niah, study.past_window)
    if average > 1:
        table += [
            "",
            f"Each run scored as the mean of its last {average} checkpoints (megabam convert average); "
            "val loss is the final checkpoint's, from training.",
        ]
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text("\n".join(table) + "\n")
    figure = draw(results, multiples, f"megabam repro {name}: passkey retrieval by length", out / f"{name}.png")
    return [*table, "", str(out / "results.md"), str(figure)]
