"""`megabam plot priors|attention|training`: what a run learned, drawn.

- priors: each layer's and head's log-prior b(Δ) over the distance Δ to the key looked back at (log
  scale), from the checkpoint's θ's through the kernels' own prior formula, heads coloured along a
  colormap; heads with θ_β ≤ 0 (flat or inverted: the retrieval heads of BAM) drawn dashed and named
  in the panel's title;
- attention: every attention layer's and head's probabilities on one input (a passkey prompt by
  default), axes in tokens, the needle's key and the question's query marked, a log colorbar;
- training: loss, learning rate, SWA window draws, grad norm, throughput, MFU and memory, a panel
  each, then each layer's heads' θ_α, β, ln α and SSMax s, from the run's metrics.jsonl; series that
  never change are named under the figure instead of drawn.
"""

import json
import math
import re
from pathlib import Path

import torch

from megabam.data.passkey import passkey_sample
from megabam.errors import UserError
from megabam.eval.figures import fit, head_colours, new_figure, save, token_axis, wrap
from megabam.eval.trained import Trained
from megabam.kernels.bam_attention import BamParams, prior_terms


class NothingToPlot(UserError):
    """The run or checkpoint has nothing of the kind asked for; the message says what is missing."""


def plot_priors(trained: Trained, out: Path, max_distance: int | None = None) -> Path:
    return save(draw_priors(trained, max_distance), out)


def draw_priors(trained: Trained, max_distance: int | None = None):
    """Each attention layer's log-prior per head over the distance to the key (log scale)."""
    from matplotlib.lines import Line2D

    layers = [(i, b.mixer) for i, b in enumerate(trained.model.blocks) if getattr(b.mixer, "prior", None) is not None]
    if not layers:
        raise NothingToPlot(trained.checkpoint, None, "no attention layer has a positional prior (GGD-BAM or ALiBi)")
    seq_len = trained.config.data.seq_len
    far = max_distance or 64 * seq_len
    distance = torch.unique(torch.logspace(0, math.log10(far), 200).round()).double()
    fig = new_figure(1.8 + 3.6 * len(layers), 4.0)
    axes = fig.subplots(1, len(layers), squeeze=False, sharey=True)[0]
    cmap = head_colours(fig, max(mixer.prior()[1].shape[0] for _, mixer in layers), axes)
    for ax, (layer, mixer) in zip(axes, layers):
        alpha, beta, mu = (None if t is None else t.detach().double() for t in mixer.prior())
        prior = prior_terms(BamParams(alpha, beta, mu, None, False, 1.0), -distance)[0]
        flat = [h for h in range(prior.shape[0]) if float(beta[h]) <= 0]
        for h in range(prior.shape[0]):
            ax.plot(distance.numpy(), prior[h].clamp(min=-60).numpy(), "--" if h in flat else "-", color=cmap(h))
        ax.axvline(seq_len, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        token_axis(ax.xaxis, 1, far)
        ax.set_xlabel("distance to the key Δ (tokens)")
        flat_heads = f"; β ≤ 0 (dashed): head {', '.join(map(str, flat))}" if flat else ""
        ax.set_title(wrap(f"layer {layer}{flat_heads}", 3.4, 9), fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("log-prior b(Δ) (clipped at −60)")
    line = Line2D([], [], color="grey", linewidth=0.8, label=f"training length {seq_len}")
    fig.legend(handles=[line], loc="outside lower center", fontsize=8)
    title = f"learned priors, {trained.run_dir.name} @ step {trained.meta.step}"
    fig.suptitle(wrap(title, fig.get_figwidth(), 10), fontsize=10)
    return fit(fig)


def passkey_prompt(trained: Trained, n_tokens: int) -> tuple[list[int], dict[str, int]]:
    """A passkey prompt of `n_tokens` with the needle in the middle, and where its parts start."""
    tok = trained.tokenizer
    sample = passkey_sample(tok, n_tokens, 0.5, "71432")
    ids = sample.prompt_ids
    needle = tok.encode(" The pass key is 71432")
    at = next(i for i in range(len(ids)) if ids[i : i + len(needle)] == needle)
    question = len(ids) - len(tok.encode(" What is the pass key? The pass key is"))
    return ids, {"needle": at, "question": question}


def plot_attention(trained: Trained, ids: list[int], marks: dict[str, int], out: Path) -> Path:
    title = f"attention, {trained.run_dir.name} @ step {trained.meta.step}"
    return save(draw_attention(attention_maps(trained, ids), marks, title), out)


def attention_maps(trained: Trained, ids: list[int]) -> dict[int, torch.Tensor]:
    """Each attention layer's probabilities (heads, queries, keys) on the prompt `ids`."""
    model = trained.model
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        block.mixer.register_forward_pre_hook(lambda m, args, i=i: captured.__setitem__(i, args[0]))
        for i, block in enumerate(model.blocks)
        if hasattr(block.mixer, "weights")
    ]
    if not hooks:
        raise NothingToPlot(trained.checkpoint, None, "the model has no attention layers")
    try:
        with torch.no_grad():
            model(torch.tensor([ids], device=model.embed.weight.device))
    finally:
        for hook in hooks:
            hook.remove()
    return {i: model.blocks[i].mixer.weights(x)[0].float().cpu() for i, x in captured.items()}


HEADS_PER_ROW = 8  # 16 or 32 heads wrap into rows instead of one figure 40 panels wide


def draw_attention(maps: dict[int, torch.Tensor], marks: dict[str, int], title: str):
    """A panel per layer and head, queries down and keys across in tokens, probabilities on a log scale
    (a retrieval head's few sharp entries and a local head's band both show); the needle's key column
    and the question's query row (`marks`, as `passkey_prompt` gives them) marked."""
    from matplotlib.colors import LogNorm
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    n_heads = next(iter(maps.values())).shape[0]
    cols = min(n_heads, HEADS_PER_ROW)
    rows_per_layer = -(-n_heads // cols)
    fig = new_figure(1.6 + 2.1 * cols, 1.0 + 2.1 * rows_per_layer * len(maps))
    axes = fig.subplots(rows_per_layer * len(maps), cols, squeeze=False)
    norm = LogNorm(1e-6, 1.0)
    for index, (layer, probs) in enumerate(maps.items()):
        for h in range(rows_per_layer * cols):
            ax = axes[index * rows_per_layer + h // cols, h % cols]
            if h >= n_heads:  # the last row of a layer whose heads do not fill it
                ax.set_visible(False)
                continue
            image = ax.imshow(probs[h].clamp(min=1e-6).numpy(), cmap="magma", norm=norm, interpolation="nearest")
            ax.axvline(marks["needle"], color="cyan", linewidth=0.7)
            ax.axhline(marks["question"], color="lime", linewidth=0.7)
            ax.set_title(f"layer {layer} head {h}", fontsize=8)
            for axis in (ax.xaxis, ax.yaxis):
                axis.set_major_locator(MaxNLocator(4, integer=True))
            ax.tick_params(labelsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("key position (tokens)", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("query position (tokens)", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention probability (log scale)")
    lines = [
        Line2D([], [], color="cyan", label=f"needle at token {marks['needle']} (key)"),
        Line2D([], [], color="lime", label=f"question from token {marks['question']} (query)"),
    ]
    fig.legend(handles=lines, loc="outside lower center", ncol=2, fontsize=8)
    fig.suptitle(wrap(title, fig.get_figwidth(), 10), fontsize=10)
    return fit(fig)


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl, each row's per-head values merged in (null → NaN)."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            heads = row.pop("heads", {})
            rows.append({**row, **{k: math.nan if v is None else v for k, v in heads.items()}})
        except (ValueError, AttributeError, TypeError):
            raise NothingToPlot(path, f"line {number}", "not a metrics row") from None
    return rows


def plot_training(run_dir: Path, out: Path) -> Path:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise NothingToPlot(run_dir, None, "no metrics.jsonl (not a run directory?)")
    rows = read_metrics(path)
    if not any(key in SERIES_LABELS or HEAD_KEY.match(key) for row in rows for key in row):
        raise NothingToPlot(path, None, "holds no metrics rows")
    return save(draw_training(rows, f"training of {run_dir.name}"), out)


# One panel per quantity: its label and its series (metrics.jsonl keys, as the trainer logs them) with
# the legend name of each; per-head quantities below, a row of panels (one per layer) each.
PANELS = [
    ("loss (nats)", {"loss": "train", "val_loss": "validation"}),
    ("learning rate", {"lr": "lr"}),
    ("SWA window", {"window": "window"}),
    ("grad norm", {"grad_norm": "grad norm"}),
    ("tokens/s", {"tokens_per_s": "tokens/s"}),
    ("MFU", {"mfu": "MFU"}),
    ("memory (MiB)", {"peak_memory_mib": "measured peak", "predicted_memory_mib": "planner's prediction"}),
]
SERIES_LABELS = {key: label for _, series in PANELS for key, label in series.items()}
HEAD_PANELS = [("θ_α", "theta_alpha"), ("β = θ_β", "beta"), ("ln α", "ln_alpha"), ("SSMax s", "s")]
HEAD_KEY = re.compile(r"^\w+/layer(\d+)/head(\d+)/(\w+)$")


def series(rows: list[dict], key: str) -> tuple[list, list]:
    """The steps and finite values of `key` over the rows."""
    points = [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def constant(values: list) -> bool:
    return len(values) > 1 and min(values) == max(values)


def draw_training(rows: list[dict], title: str):
    """Loss, learning rate, window draws, grad norm, throughput, MFU and memory over the steps, a panel
    each; then θ_α, β, ln α and SSMax s, a panel per layer with its heads coloured along a colormap.
    Series that never change are not drawn but named, with their value, under the figure."""
    dropped: list[str] = []
    scalar_panels = []
    for name, keys in PANELS:
        drawn = {}
        for key, label in keys.items():
            steps, values = series(rows, key)
            if constant(values):
                dropped.append(f"{key} = {values[0]:g}")
            elif steps:
                drawn[label] = (steps, values)
        if drawn:
            scalar_panels.append((name, drawn))
    heads: dict[str, dict[int, dict[int, str]]] = {}  # quantity → layer → head → key
    for key in sorted({k for r in rows for k in r}):
        if match := HEAD_KEY.match(key):
            layer, head, quantity = int(match[1]), int(match[2]), match[3]
            heads.setdefault(quantity, {}).setdefault(layer, {})[head] = key
    head_panels = []
    for name, quantity in HEAD_PANELS:
        layers = {}
        for layer, keys in sorted(heads.get(quantity, {}).items()):
            drawn = {h: series(rows, key) for h, key in keys.items()}
            still = sorted(h for h, (_, values) in drawn.items() if constant(values))
            if still:
                dropped.append(f"{name} layer {layer}: {head_list(still, len(keys))} {values_of(drawn, still)}")
            layers[layer] = {h: points for h, points in drawn.items() if h not in still and points[0]}
        if any(layers.values()):
            head_panels.append((name, layers))
    n_layers = max((len(layers) for _, layers in head_panels), default=1)
    n_heads = 1 + max((h for layers in heads.values() for keys in layers.values() for h in keys), default=0)
    n_rows = max(1, len(scalar_panels) + len(head_panels))
    fig = new_figure(max(8.0, 2.0 + 3.2 * n_layers), 0.9 + 1.9 * n_rows)
    grid = fig.add_gridspec(n_rows, n_layers)
    first, row_axes = None, []
    for row, (name, drawn) in enumerate(scalar_panels):
        ax = fig.add_subplot(grid[row, :], sharex=first)
        first, row_axes = first or ax, [ax]
        for label, (steps, values) in drawn.items():
            ax.plot(steps, values, "." if label in ("window", "validation") else ".-", label=label, markersize=3)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if len(drawn) > 1:  # above the panel, never over its curves
            ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(drawn), fontsize=7, frameon=False)
    for row, (name, layers) in enumerate(head_panels, len(scalar_panels)):
        row_axes = [fig.add_subplot(grid[row, col], sharex=first) for col in range(len(layers))]
        first = first or row_axes[0]
        cmap = head_colours(fig, n_heads, row_axes)
        for col, (ax, (layer, drawn)) in enumerate(zip(row_axes, layers.items())):
            for h, (steps, values) in drawn.items():
                ax.plot(steps, values, ".-", color=cmap(h), linewidth=0.9, markersize=2)
            if not drawn:  # another layer's heads of this quantity change
                ax.text(0.5, 0.5, "constant", ha="center", va="center", transform=ax.transAxes, fontsize=8)
            ax.set_title(f"layer {layer}", fontsize=8)
            ax.set_ylabel(name if col == 0 else "")
            ax.grid(alpha=0.3)
    for ax in row_axes:
        ax.set_xlabel("optimizer step")
    if dropped:
        fig.supxlabel(wrap("constant, not drawn: " + "; ".join(dropped), fig.get_figwidth(), 7), fontsize=7)
    fig.suptitle(wrap(title, fig.get_figwidth(), 10), fontsize=10)
    return fit(fig)


def head_list(still: list[int], n_heads: int) -> str:
    return f"all {n_heads} heads" if len(still) == n_heads else "head " + ", ".join(map(str, still))


def values_of(drawn: dict[int, tuple[list, list]], still: list[int]) -> str:
    values = {drawn[h][1][0] for h in still}
    return f"= {values.pop():g}" if len(values) == 1 else "(each its own value)"
