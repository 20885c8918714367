"""The figures of `megabam eval` and `megabam plot` (PNG, PDF or SVG), drawn with matplotlib's file backends.

Each figure is drawn by a `draw_*` function that returns it (sized to its content: every label, title
and legend on the canvas, checked by tests/unit/test_figures.py) and written by `save`.
"""

import textwrap
from pathlib import Path

from megabam.staging import staged_path

FORMATS = ("png", "pdf", "svg")


def pyplot():
    # Imported when a figure is drawn: matplotlib costs about a second at start-up.
    import matplotlib

    matplotlib.use("Agg")  # no display on training nodes
    import matplotlib.pyplot as plt

    return plt


def save(fig, out: Path) -> Path:
    """Write `fig` to `out`, in the format its suffix names (.png, .pdf, .svg), through a temporary
    name, so a reader never sees half a file."""
    try:
        with staged_path(out) as tmp:
            fig.savefig(tmp, dpi=100, format=out.suffix[1:])
    finally:
        pyplot().close(fig)
    return out


def new_figure(width: float, height: float):
    """A figure whose layout engine keeps the labels, titles, colorbars and outside legends of its axes
    on the canvas."""
    return pyplot().figure(figsize=(width, height), layout="constrained")


def wrap(text: str, width_in: float, fontsize: float) -> str:
    """`text` broken into lines that fit `width_in` inches at `fontsize` (an average glyph is about
    0.6 em wide): a long title wraps instead of running off both sides of a small figure."""
    return textwrap.fill(text, max(20, int(width_in * 72 / (0.6 * fontsize))))


def fit(fig, tries: int = 3):
    """Grow `fig` until everything drawn lies on its canvas. The layout engine moves the axes to make
    room for their labels, but cannot make room that the figure does not have (a long unbreakable
    title, a wide outside legend)."""
    for _ in range(tries):
        fig.draw_without_rendering()
        box = fig.get_tightbbox()  # inches
        width, height = fig.get_size_inches()
        grow_x = max(0.0, -box.x0) + max(0.0, box.x1 - width)
        grow_y = max(0.0, -box.y0) + max(0.0, box.y1 - height)
        if grow_x < 0.01 and grow_y < 0.01:
            break
        fig.set_size_inches(width + grow_x + 0.1, height + grow_y + 0.1)
    return fig


def head_colours(fig, n_heads: int, axes):
    """A colour per head along a colormap (16 heads: none repeated, as the 10-colour cycle would) and
    its colorbar beside `axes`, in place of a legend that would cover the curves."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.ticker import MaxNLocator

    cmap = colormaps["viridis"].resampled(n_heads)
    mappable = ScalarMappable(Normalize(-0.5, n_heads - 0.5), cmap)
    fig.colorbar(mappable, ax=axes, label="head", ticks=MaxNLocator(integer=True))
    return cmap


def luminance(rgb) -> float:
    """WCAG's relative luminance of an sRGB colour with components in [0, 1]."""
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb[:3]]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(a, b) -> float:
    """WCAG's contrast ratio of two colours, 1 (none) to 21 (black on white)."""
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def text_colour(background) -> str:
    """Black or white, whichever reads better on `background` (at least 4.6:1 on any colour)."""
    return "black" if contrast((0, 0, 0), background) >= contrast((1, 1, 1), background) else "white"


def heatmap(values: list[list[float]], lengths: list[int], depths: list[float], title: str, out: Path) -> Path:
    return save(draw_heatmap(values, lengths, depths, title), out)


def draw_heatmap(values: list[list[float]], lengths: list[int], depths: list[float], title: str):
    """Accuracy per (length, depth) cell, lengths down, depths across, 0 red to 1 green, each cell's
    value written on it."""
    # room for the y label and tick labels, the colorbar, the x label and title around the cells
    fig = new_figure(max(4.5, 2.4 + 0.55 * len(depths)), max(2.6, 1.6 + 0.3 * len(lengths)))
    ax = fig.add_subplot()
    image = ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("needle depth")
    ax.set_ylabel("context length (tokens)")
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            colour = text_colour(image.cmap(image.norm(v)))
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8, color=colour)
    ax.set_title(wrap(title, fig.get_figwidth(), 9), fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.05, label="accuracy")
    return fit(fig)


def plain_count(n: float) -> str:
    """A token count or position as people write it: 256, 512, 1k, 64k, 1M (binary multiples)."""
    n = int(round(n))
    for unit, scale in (("M", 2**20), ("k", 2**10)):
        if n >= scale and n % (scale // 4) == 0:
            return f"{n / scale:g}{unit}"
    return str(n)


def powers_of_two(low: float, high: float, most: int = 9) -> list[int]:
    """At most `most` powers of two in [low, high], evenly spaced on a log scale: the ticks of a
    position axis."""
    powers = [2**k for k in range(64) if low <= 2**k <= high]
    step = -(-len(powers) // most)
    return powers[::step]


def token_axis(axis, low: float, high: float) -> None:
    """A log-scale axis of token positions or distances ticked at powers of two in plain numbers (256,
    512, 1k), not 10² and the minor ticks' 3×10², 4×10²."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    axis.set_major_locator(FixedLocator(powers_of_two(low, high)))
    axis.set_major_formatter(FuncFormatter(lambda x, _: plain_count(x)))
    axis.set_minor_locator(NullLocator())


def bucket_plot(
    buckets: list[tuple[int, int, float]], tokens: list[int], title: str, out: Path, train_length: int | None
) -> Path:
    return save(draw_bucket_plot(buckets, tokens, title, train_length), out)


def draw_bucket_plot(buckets: list[tuple[int, int, float]], tokens: list[int], title: str, train_length: int | None):
    """Mean loss per position bucket (start, end, loss) over the position (log scale), each bucket's
    span drawn; below it, the tokens scored in each bucket."""
    from matplotlib.ticker import StrMethodFormatter

    fig = new_figure(7, 4.6)
    ax, counts = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    starts, ends, losses = zip(*buckets)
    ax.hlines(losses, starts, ends, color="C0", linewidth=1.5)
    ax.plot([(a + b) / 2 for a, b in zip(starts, ends)], losses, "o", color="C0", markersize=4)
    counts.bar(
        starts,
        tokens,
        width=[b - a for a, b in zip(starts, ends)],
        align="edge",
        color="C0",
        alpha=0.5,
        edgecolor="white",
    )
    counts.set_xscale("log")
    token_axis(counts.xaxis, min(starts), max(ends))
    counts.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    counts.set_ylim(0, max(tokens) * 1.15)
    if train_length:
        for a in (ax, counts):
            a.axvline(train_length, color="grey", linestyle="--", label=f"training length {plain_count(train_length)}")
        fig.legend(handles=[ax.get_lines()[-1]], loc="outside lower center", fontsize=8)
    ax.set_ylabel("mean next-token\nloss (nats)")
    counts.set_ylabel("tokens\nscored")
    counts.set_xlabel("token position")
    ax.set_title(wrap(title, fig.get_figwidth(), 9), fontsize=9)
    for a in (ax, counts):
        a.grid(alpha=0.3)
    return fit(fig)
