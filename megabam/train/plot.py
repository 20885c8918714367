"""The loss curve of a run as a PNG, drawn from its metrics.jsonl."""

import json
from pathlib import Path

from megabam.eval.figures import fit, new_figure, save, wrap


def plot_loss(metrics_path: Path, out_path: Path) -> None:
    save(draw_loss(metrics_path), out_path)


def draw_loss(metrics_path: Path):
    """Training and validation loss over the steps, titled with the run's name."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig = new_figure(7, 4)  # matplotlib is imported here, when rank 0 draws, once, at the end
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(wrap(metrics_path.parent.name, fig.get_figwidth(), 12))
    ax.grid(alpha=0.3)
    if train or val:  # below the axes: a legend inside would cover the curves
        fig.legend(loc="outside lower center", ncol=2, fontsize=9)
    return fit(fig)
