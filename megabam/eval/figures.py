"""The PNG figures of `megabam eval` and `megabam plot`, drawn with matplotlib's file backend."""

from pathlib import Path


def pyplot():
    # Imported when a figure is drawn: matplotlib costs about a second at start-up.
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    return plt


def save(fig, out: Path) -> Path:
    """Write `fig` to `out` through a temporary name, so a reader never sees half a PNG."""
    plt = pyplot()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.rename(out)
    return out


def heatmap(values: list[list[float]], lengths: list[int], depths: list[float], title: str, out: Path) -> Path:
    """Accuracy per (length, depth) cell, lengths down, depths across, 0 red to 1 green."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.2 + 0.7 * len(depths), 1.2 + 0.5 * len(lengths)))
    image = ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("needle depth")
    ax.set_ylabel("context length (tokens)")
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.05)
    fig.tight_layout()
    return save(fig, out)


def bucket_plot(buckets: list[tuple[int, int, float]], title: str, out: Path, train_length: int | None) -> Path:
    """Mean loss per position bucket (start, end, loss) over the position (log scale)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    mids = [(a + b) / 2 for a, b, _ in buckets]
    ax.plot(mids, [loss for _, _, loss in buckets], "o-")
    if train_length:
        ax.axvline(train_length, color="grey", linestyle="--", label=f"training length {train_length}")
        ax.legend()
    ax.set_xscale("log")
    ax.set_xlabel("token position")
    ax.set_ylabel("mean next-token loss (nats)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return save(fig, out)
