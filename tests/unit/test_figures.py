"""Every figure of `megabam eval` and `megabam plot` drawn at its extreme sizes (one cell; 20 × 10 cells,
16 heads in 2 layers, a long title), then measured: no text past the canvas, no legend over an axes,
heatmap annotations readable on their cells, and each --format writes a file of its kind."""

import json
import math

import matplotlib
import pytest
import torch

from megabam.eval.figures import contrast, draw_bucket_plot, draw_heatmap, save
from megabam.eval.plots import draw_attention, draw_priors, draw_training, read_metrics
from megabam.train.plot import draw_loss

matplotlib.use("Agg")

LONG_TITLE = "passkey retrieval, a_run_directory_with_a_long_name @ step 123456 (trained at 262144 tokens)"


def undrawn_tick_labels(fig) -> set:
    """Tick labels at locations outside their axis' view: kept by matplotlib, not drawn."""
    out = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
                if not low - 1e-9 * abs(high - low) <= tick.get_loc() <= high + 1e-9 * abs(high - low):
                    out |= {tick.label1, tick.label2}
    return out


def texts_past_the_canvas(fig) -> list[str]:
    """The drawn, non-empty text artists whose extent leaves the figure (1 px tolerance)."""
    fig.canvas.draw()  # runs the layout engine, as saving does
    renderer = fig.canvas.get_renderer()
    canvas = fig.bbox
    undrawn = undrawn_tick_labels(fig)
    out = []
    for text in fig.findobj(matplotlib.text.Text):
        if not text.get_visible() or not text.get_text().strip() or text in undrawn:
            continue
        box = text.get_window_extent(renderer)
        if box.x0 < canvas.x0 - 1 or box.y0 < canvas.y0 - 1 or box.x1 > canvas.x1 + 1 or box.y1 > canvas.y1 + 1:
            out.append(f"{text.get_text()!r} at {box.bounds}, canvas {canvas.bounds}")
    return out


def legends_over_axes(fig) -> list[str]:
    """Legends whose box overlaps an axes (where they would cover data)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    return [
        f"legend over axes {ax.get_label() or ax.get_title()!r}"
        for legend in legends
        for ax in fig.axes
        if legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer).shrunk(0.999, 0.999))
    ]


def check(fig) -> None:
    assert texts_past_the_canvas(fig) == []
    assert legends_over_axes(fig) == []


def grid(n_lengths: int, n_depths: int) -> tuple[list[list[float]], list[int], list[float]]:
    values = [[((i * n_depths + j) % 11) / 10 for j in range(n_depths)] for i in range(n_lengths)]
    lengths = [64 * 2**i for i in range(n_lengths)]
    depths = [j / max(1, n_depths - 1) for j in range(n_depths)]
    return values, lengths, depths


@pytest.mark.parametrize("n_lengths, n_depths", [(1, 1), (1, 3), (20, 10)])
def test_heatmap_fits_its_canvas(n_lengths, n_depths):
    check(draw_heatmap(*grid(n_lengths, n_depths), LONG_TITLE))


def test_heatmap_annotations_are_readable_on_their_cells():
    fig = draw_heatmap(*grid(3, 11), "contrast")
    (ax,) = [ax for ax in fig.axes if ax.get_images()]
    image = ax.get_images()[0]
    values = image.get_array()
    annotations = [t for t in ax.texts]
    assert len(annotations) == values.size
    for text in annotations:
        j, i = (round(c) for c in text.get_position())
        cell = image.cmap(image.norm(values[i, j]))
        # WCAG's threshold for normal text: 4.5:1 (black on the darkest red is 2.7:1)
        assert contrast(matplotlib.colors.to_rgb(text.get_color()), cell[:3]) >= 4.5, text.get_text()


@pytest.mark.parametrize("n", [1, 12])
def test_bucket_plot_fits_its_canvas_with_plain_ticks_and_tokens_per_bucket(n):
    length = 65536
    edges = [round(1 + k * (length - 1) / n) for k in range(n + 1)]
    buckets = [(a, b, 3.0 + math.log(b)) for a, b in zip(edges, edges[1:])]
    tokens = [(b - a) * 4 for a, b in zip(edges, edges[1:])]
    fig = draw_bucket_plot(buckets, tokens, LONG_TITLE, 4096)
    check(fig)
    fig.canvas.draw()
    labels = {t.get_text() for ax in fig.axes for t in ax.get_xticklabels() if t.get_text()}
    assert {"4k", "64k"} <= labels and not any("times" in s or "^" in s for s in labels), labels
    assert any("tokens" in ax.get_ylabel() for ax in fig.axes)


def metrics_file(tmp_path, rows: list[dict]):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_metrics(path)


def big_rows() -> list[dict]:
    rows = []
    for step in range(10, 210, 10):
        heads = {}
        for layer in range(2):
            for h in range(16):
                heads[f"bam/layer{layer}/head{h}/theta_alpha"] = -0.1 * h - step / 1000
                heads[f"bam/layer{layer}/head{h}/beta"] = 1.0 - h / 16 + step / 2000
                heads[f"bam/layer{layer}/head{h}/ln_alpha"] = None if h == 0 and step < 100 else 0.1 * h + step / 1e3
                heads[f"ssmax/layer{layer}/head{h}/s"] = 1.0  # frozen: a constant series
        rows.append(
            {
                "step": step,
                "loss": 6.0 - step / 100,
                "lr": 3e-4,  # constant
                "grad_norm": 1.0 + (step % 30) / 10,
                "tokens_per_s": 1e5 + step,
                "tokens": step * 4096,
                "tflops_per_device": 100.0 + step / 10,
                "mfu": 0.3 + step / 10000,
                "peak_memory_mib": 30000.0 + step,
                "predicted_memory_mib": 31000.0,
                "heads": heads,
            }
        )
        rows.append({"step": step, "window": [64, 128, 256][step // 10 % 3]})
        if step % 50 == 0:
            rows.append({"step": step, "val_loss": 6.1 - step / 100})
    return rows


def test_training_plot_of_one_row_fits_its_canvas(tmp_path):
    check(draw_training(metrics_file(tmp_path, [{"step": 1, "loss": 7.0, "lr": 1e-3}]), LONG_TITLE))


def test_training_plot_of_16_heads_in_2_layers(tmp_path):
    fig = draw_training(metrics_file(tmp_path, big_rows()), LONG_TITLE)
    check(fig)
    labels = [ax.get_ylabel() for ax in fig.axes]
    for quantity in ("loss", "grad norm", "tokens/s", "MFU", "memory"):
        assert any(quantity in label for label in labels), (quantity, labels)
    head_axes = [ax for ax in fig.axes if len(ax.get_lines()) == 16]
    assert len(head_axes) == 2 * 3  # θ_α, β and ln α for each layer; s is constant
    for ax in head_axes:  # a colormap over the heads, no colour repeated
        assert len({matplotlib.colors.to_hex(line.get_color()) for line in ax.get_lines()}) == 16
    note = " ".join(t.get_text() for t in fig.texts)
    assert "constant" in note and "lr" in note and "s" in note


def attention_maps(layers: int, heads: int, n: int) -> dict[int, torch.Tensor]:
    torch.manual_seed(0)
    scores = torch.randn(layers, heads, n, n).masked_fill(torch.ones(n, n).triu(1).bool(), -math.inf)
    return {layer: scores[layer].softmax(-1) for layer in range(layers)}


@pytest.mark.parametrize("layers, heads, n", [(1, 1, 8), (2, 16, 48)])
def test_attention_plot_fits_its_canvas_with_axes_in_tokens_and_a_colorbar(layers, heads, n):
    fig = draw_attention(attention_maps(layers, heads, n), {"needle": n // 3, "question": n - 4}, LONG_TITLE)
    check(fig)
    labels = " ".join(ax.get_xlabel() + " " + ax.get_ylabel() for ax in fig.axes)
    assert "key position (tokens)" in labels and "query position (tokens)" in labels
    assert any("attention probability" in ax.get_ylabel() for ax in fig.axes)  # the colorbar
    assert any(t.get_text().isdigit() for ax in fig.axes for t in ax.get_xticklabels())


@pytest.mark.parametrize("fmt, magic", [("png", b"\x89PNG"), ("pdf", b"%PDF"), ("svg", b"<svg")])
def test_each_format_writes_a_file_of_its_kind(tmp_path, fmt, magic):
    out = save(draw_heatmap(*grid(2, 2), "formats"), tmp_path / f"heatmap.{fmt}")
    head = out.read_bytes()[:400]
    assert out.suffix == f".{fmt}" and (head.startswith(magic) or magic in head)
    assert [p.name for p in tmp_path.iterdir()] == [f"heatmap.{fmt}"]  # the temporary name is gone


@pytest.mark.parametrize("steps", [1, 600])
def test_the_runs_loss_figure_fits_its_canvas_with_its_legend_off_the_curves(tmp_path, steps):
    run = tmp_path / ("a_run_directory_with_a_long_name_" * 3)
    run.mkdir()
    rows = [{"step": s, "loss": 7.0 - s / 100} for s in range(1, steps + 1)] + [{"step": steps, "val_loss": 6.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    check(draw_loss(run / "metrics.jsonl"))


@pytest.mark.parametrize("layers, heads", [(1, 1), (6, 16)])
def test_the_priors_figure_fits_its_canvas(tmp_path, layers, heads):
    from types import SimpleNamespace

    from megabam.config import load_config
    from megabam.model import Decoder

    overrides = [f"model.n_layers={layers}", f"model.n_heads={heads}", "model.d_model=64"]
    cfg = load_config(None, [*overrides, "model.attention.bam.init=spread"])
    trained = SimpleNamespace(
        model=Decoder(cfg.model),
        config=cfg,
        run_dir=tmp_path / LONG_TITLE.replace(" ", "_"),
        meta=SimpleNamespace(step=7),
    )
    check(draw_priors(trained))
