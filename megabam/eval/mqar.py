"""Multi-query associative recall (MQAR), the recall test of the linear-RNN literature (Arora et al.,
"Zoology", 2023; also Based, GLA, DeltaNet, xLSTM), and `megabam repro mqar`: every mixer alone and as
a SWA hybrid trained on it, over model width and number of pairs.

A sample of `seq_len` tokens (vocabulary `vocab`): `pairs` key–value pairs first, k1 v1 … kD vD (keys
distinct, drawn from tokens 1 … vocab/2 − 1; values from vocab/2 … vocab − 1, repeats allowed), then
the query region: `queries` of the keys (a random subset, each once, in random order) at random
distinct even offsets of the region, each followed by its value; every other position of the region
is a random token of the whole vocabulary. The model is scored where it reads a query key: its
next-token prediction there must be that key's value (`targets`, −100 elsewhere). Accuracy is the
share of queried values predicted exactly; the loss is the cross-entropy on those positions only.

A cell is one small decoder (2 layers of the mixer's pattern, d_model `width`) trained from scratch
with AdamW on fresh samples every step and scored on held-out samples of its own seed; its result is
a JSON file, so an interrupted grid skips the cells it finished (a cell runs for minutes, so an
interrupted cell starts over).
"""

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from megabam.config import load_config
from megabam.eval.stats import bootstrap_mean
from megabam.model import Decoder
from megabam.staging import write_json

IGNORE = -100
LAYERS = 2
# Each mixer as a layer pattern of megabam's config (MIXER_LETTERS): the two layers it repeats over.
MIXERS = {
    "attention": "A",
    "swa": "S",
    "mlstm": "M",
    "gated_deltanet": "G",
    "swa+mlstm": "SM",
    "swa+gated_deltanet": "SG",
}


@dataclass
class MqarBatch:
    inputs: torch.Tensor  # (B, seq_len) token ids
    targets: torch.Tensor  # (B, seq_len): the value at each query key's position, IGNORE elsewhere


def mqar_batch(
    batch: int, seq_len: int, pairs: int, vocab: int, generator: torch.Generator, queries: int | None = None
) -> MqarBatch:
    """`batch` MQAR samples (module docstring); `queries` defaults to every pair."""
    queries = pairs if queries is None else queries
    half = vocab // 2
    region = seq_len - 2 * pairs
    if not (1 <= queries <= pairs < half and 2 * queries <= region):
        raise ValueError(
            f"MQAR needs 1 <= queries <= pairs < vocab/2 and 2·pairs + 2·queries <= seq_len; got pairs {pairs}, "
            f"queries {queries}, vocab {vocab}, seq_len {seq_len}"
        )
    keys = torch.rand(batch, half - 1, generator=generator).argsort(-1)[:, :pairs] + 1
    values = torch.randint(half, vocab, (batch, pairs), generator=generator)
    inputs = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    targets = torch.full((batch, seq_len), IGNORE, dtype=torch.long)
    inputs[:, 0 : 2 * pairs : 2], inputs[:, 1 : 2 * pairs : 2] = keys, values
    rows = torch.arange(batch)[:, None]
    asked = torch.rand(batch, pairs, generator=generator).argsort(-1)[:, :queries]  # which pairs
    slots = torch.rand(batch, region // 2, generator=generator).argsort(-1)[:, :queries]  # where
    at = 2 * pairs + 2 * slots
    inputs[rows, at], inputs[rows, at + 1] = keys[rows, asked], values[rows, asked]
    targets[rows, at] = values[rows, asked]
    return MqarBatch(inputs, targets)


def accuracy(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of the scored positions (targets ≠ IGNORE) where the prediction is the target."""
    scored = targets != IGNORE
    return (predictions[scored] == targets[scored]).float().mean().item()


def recall_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the scored positions."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


@dataclass(frozen=True)
class Cell:
    mixer: str
    width: int
    pairs: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.mixer}-d{self.width}-p{self.pairs}-seed{self.seed}"


@dataclass(frozen=True)
class Setting:
    """What every cell of a grid shares."""

    # Measured (docs/results.md, "MQAR"): at 64 tokens and a 64-token vocabulary, 3,000 steps at 3e-3
    # take 2-layer attention at d 64 from the plateau of guessing among the sample's values (loss
    # ln 4 with 4 pairs, still there at 1,000 steps) to 1.00; a few minutes per cell on 2 cores.
    seq_len: int = 64
    vocab: int = 64
    steps: int = 3000
    batch: int = 32
    lr: float = 3e-3
    window: int = 8  # the SWA layers': most queries sit farther than this from their pair
    eval_samples: int = 512
    overrides: tuple[str, ...] = ()  # model.* config overrides after the cell's own (an arm's variant)

    def record(self) -> dict:
        """As a cell's JSON file holds it (a finished cell counts only under the same setting)."""
        return {**self.__dict__, "overrides": list(self.overrides)}


def model_overrides(cell: Cell, setting: Setting) -> list[str]:
    """The config of a cell's model: megabam's defaults for each mixer, heads of 32 (at least 1),
    RoPE without SSMax in the attention layers (the field's baseline attention), then the setting's
    own overrides."""
    return [
        f"model.vocab_size={setting.vocab}",
        f"model.d_model={cell.width}",
        f"model.n_layers={LAYERS}",
        f"model.n_heads={max(1, cell.width // 32)}",
        f"model.layer_pattern=[{MIXERS[cell.mixer]}]",
        "model.tie_embeddings=true",
        "model.attention.positional=rope",
        "model.attention.ssmax=false",
        "model.swa.positional=rope",
        f"window.windows=[{setting.window}]",
        "window.probabilities=[1.0]",
        f"data.seq_len={setting.seq_len}",
        *setting.overrides,
    ]


def train_cell(cell: Cell, setting: Setting, log=None) -> dict:
    """Train the cell's model and score it on held-out samples; its result as a dict."""
    cfg = load_config(None, model_overrides(cell, setting)).model
    torch.manual_seed(cell.seed)
    model = Decoder(cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=setting.lr, betas=(0.9, 0.98), weight_decay=0.1)
    warmup = max(1, setting.steps // 10)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine to 0
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, setting.steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optim, lr_factor)
    train_data = torch.Generator().manual_seed(2 * cell.seed)
    start, losses = time.perf_counter(), []
    for step in range(setting.steps):
        batch = mqar_batch(setting.batch, setting.seq_len, cell.pairs, setting.vocab, train_data)
        loss = recall_loss(model(batch.inputs, window=setting.window), batch.targets)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        schedule.step()
        losses.append(loss.item())
        if log and (step + 1) % max(1, setting.steps // 5) == 0:
            log(f"  {cell.name} step {step + 1}: recall loss {statistics.fmean(losses[-20:]):.3f}")
    return {
        "cell": cell.__dict__,
        "setting": setting.record(),
        "accuracy": evaluate(model, cell, setting),
        "final_loss": statistics.fmean(losses[-20:]),
        "params": model.num_params(),
        "seconds": round(time.perf_counter() - start, 1),
    }


@torch.no_grad()
def evaluate(model: Decoder, cell: Cell, setting: Setting) -> float:
    """Accuracy on `eval_samples` held-out samples (their own generator: never trained on)."""
    model.eval()
    data = torch.Generator().manual_seed(2 * cell.seed + 1)
    hits = total = 0
    for start in range(0, setting.eval_samples, setting.batch):
        n = min(setting.batch, setting.eval_samples - start)
        batch = mqar_batch(n, setting.seq_len, cell.pairs, setting.vocab, data)
        predictions = model(batch.inputs, window=setting.window).argmax(-1)
        scored = batch.targets != IGNORE
        hits += (predictions[scored] == batch.targets[scored]).sum().item()
        total += scored.sum().item()
    model.train()
    return hits / total


def run_grid(
    out: Path, mixers: list[str], widths: list[int], pairs: list[int], seeds: list[int], setting: Setting, say=print
) -> list[str]:
    """Every cell not finished before (its JSON under out/cells with this setting), then the table
    (out/results.md, results.json) and the figure (out/mqar.png). Returns the table and the paths."""
    cells_dir = out / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    todo = [Cell(m, w, p, s) for w in widths for p in pairs for m in mixers for s in seeds]
    results = []
    for i, cell in enumerate(todo, 1):
        path = cells_dir / f"{cell.name}.json"
        done = json.loads(path.read_text()) if path.is_file() else None
        if done is not None and done["setting"] == setting.record():
            what = "done before"
        else:
            done = train_cell(cell, setting, log=say)
            write_json(path, done)  # a kill mid-write leaves no torn result
            what = f"trained in {done['seconds']:.0f} s"
        results.append(done)
        say(f"[{i}/{len(todo)}] {cell.name}: {what} | accuracy {done['accuracy']:.3f}")
    table = summarise(results, mixers, widths, pairs)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(f"MQAR, setting {json.dumps(setting.record())}\n\n" + "\n".join(table) + "\n")
    return [*table, "", str(out / "results.md"), str(draw(results, mixers, widths, pairs, out / "mqar.png"))]


def _accuracies(results: list[dict], mixer: str, width: int, pairs: int) -> list[float]:
    return [
        r["accuracy"]
        for r in results
        if (r["cell"]["mixer"], r["cell"]["width"], r["cell"]["pairs"]) == (mixer, width, pairs)
    ]


def summarise(results: list[dict], mixers: list[str], widths: list[int], pairs: list[int]) -> list[str]:
    """Markdown table: a row per (width, mixer), a column per number of pairs; mean accuracy over
    seeds with its 95 % bootstrap interval over the seeds (stats.py) when there are several."""
    head = ["d_model", "mixer", *(f"{p} pairs" for p in pairs)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for width in widths:
        for mixer in mixers:
            cells = []
            for p in pairs:
                acc = _accuracies(results, mixer, width, p)
                cells.append(f"{acc[0]:.2f}" if len(acc) == 1 else str(bootstrap_mean([[a] for a in acc])))
            lines.append(f"| {width} | {mixer} | " + " | ".join(cells) + " |")
    return lines


def draw(results: list[dict], mixers: list[str], widths: list[int], pairs: list[int], out: Path) -> Path:
    """Accuracy against the number of pairs, one line per mixer (error bars: the bootstrap interval over
    seeds), one panel per width."""
    from megabam.eval.figures import pyplot, save

    plt = pyplot()
    fig, axes = plt.subplots(1, len(widths), figsize=(4.5 * len(widths), 3.6), squeeze=False)
    for ax, width in zip(axes[0], widths):
        for mixer in mixers:
            spans = [bootstrap_mean([[a] for a in _accuracies(results, mixer, width, p)]) for p in pairs]
            errors = [[i.mean - i.low for i in spans], [i.high - i.mean for i in spans]]
            ax.errorbar(pairs, [i.mean for i in spans], yerr=errors, marker="o", capsize=3, label=mixer)
        ax.set_xscale("log", base=2)
        ax.set_xticks(pairs, [str(p) for p in pairs])
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("key-value pairs")
        ax.set_ylabel("MQAR accuracy")
        ax.set_title(f"d_model {width}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    return save(fig, out)
