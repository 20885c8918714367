"""`megabam plot priors|attention|training`: what a run learned, drawn.

- priors: each layer's and head's log-prior b(Δ) over the distance Δ to the key looked back at (log
  scale), from the checkpoint's θ's through the kernels' own prior formula; heads with θ_β ≤ 0
  (flat or inverted: the retrieval heads of BAM) drawn dashed and named in the legend;
- attention: every attention layer's and head's probabilities on one input (a passkey prompt by
  default), the needle's and the question's positions marked;
- training: loss, learning rate, SWA window draws and each head's θ_α, θ_β and SSMax s over the
  steps, from the run's metrics.jsonl.
"""

import json
import math
from pathlib import Path

import torch

from megabam.data.passkey import passkey_sample
from megabam.errors import UserError
from megabam.eval.figures import pyplot, save
from megabam.eval.trained import Trained
from megabam.kernels.bam_attention import BamParams, prior_terms


class NothingToPlot(UserError):
    """The run or checkpoint has nothing of the kind asked for; the message says what is missing."""


def plot_priors(trained: Trained, out: Path, max_distance: int | None = None) -> Path:
    layers = [(i, b.mixer) for i, b in enumerate(trained.model.blocks) if getattr(b.mixer, "prior", None) is not None]
    if not layers:
        raise NothingToPlot(trained.checkpoint, None, "no attention layer has a positional prior (GGD-BAM or ALiBi)")
    seq_len = trained.config.data.seq_len
    far = max_distance or 64 * seq_len
    distance = torch.unique(torch.logspace(0, math.log10(far), 200).round()).double()
    plt = pyplot()
    fig, axes = plt.subplots(1, len(layers), figsize=(4 * len(layers), 3.6), squeeze=False, sharey=True)
    for ax, (layer, mixer) in zip(axes[0], layers):
        alpha, beta, mu = (None if t is None else t.detach().double() for t in mixer.prior())
        prior = prior_terms(BamParams(alpha, beta, mu, None, False, 1.0), -distance)[0]
        for h in range(prior.shape[0]):
            flat = float(beta[h]) <= 0
            label = f"head {h}: β={float(beta[h]):.2f}" + (" (≤ 0)" if flat else "")
            ax.plot(distance.numpy(), prior[h].clamp(min=-60).numpy(), "--" if flat else "-", label=label)
        ax.axvline(seq_len, color="grey", linewidth=0.8, label=f"training length {seq_len}")
        ax.set_xscale("log")
        ax.set_xlabel("distance to the key Δ (tokens)")
        ax.set_title(f"layer {layer}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("log-prior b(Δ) (clipped at −60)")
    fig.suptitle(f"learned priors, {trained.run_dir.name} @ step {trained.meta.step}", fontsize=10)
    fig.tight_layout()
    return save(fig, out)


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
    maps = {i: model.blocks[i].mixer.weights(x)[0].float().cpu() for i, x in captured.items()}
    n_heads = next(iter(maps.values())).shape[0]
    plt = pyplot()
    fig, axes = plt.subplots(len(maps), n_heads, figsize=(2.6 * n_heads, 2.6 * len(maps)), squeeze=False)
    for row, (layer, probs) in zip(axes, maps.items()):
        for h, ax in enumerate(row):
            # log scale: a retrieval head's few sharp entries and a local head's band both show
            ax.imshow(probs[h].clamp(min=1e-6).log10().numpy(), cmap="magma", vmin=-6, vmax=0, interpolation="nearest")
            for name, pos in marks.items():
                ax.axvline(pos, color="cyan" if name == "needle" else "lime", linewidth=0.6)
            ax.set_title(f"layer {layer} head {h}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(
        f"attention (log10), {trained.run_dir.name} @ step {trained.meta.step}; "
        f"cyan: needle at {marks.get('needle')}, green: question at {marks.get('question')}",
        fontsize=9,
    )
    fig.tight_layout()
    return save(fig, out)


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

    def series(key: str) -> tuple[list, list]:
        points = [(r["step"], r[key]) for r in rows if key in r]
        return ([s for s, _ in points], [v for _, v in points]) if points else ([], [])

    head_keys = sorted({k for r in rows for k in r if "/head" in k})
    panels = [("loss", ["loss", "val_loss"]), ("learning rate", ["lr"]), ("SWA window", ["window"])]
    panels += [(name, [k for k in head_keys if k.endswith(suffix)]) for name, suffix in HEAD_PANELS]
    panels = [(name, keys) for name, keys in panels if any(series(k)[0] for k in keys)]
    if not panels:
        raise NothingToPlot(path, None, "holds no metrics rows")
    plt = pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.4 * len(panels)), sharex=True, squeeze=False)
    for ax, (name, keys) in zip(axes[:, 0], panels):
        for key in keys:
            steps, values = series(key)
            style = "." if key in ("window", "val_loss") else "-"
            ax.plot(steps, values, style, label=key.replace("bam/", "").replace("ssmax/", ""), linewidth=0.9)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        if len(keys) <= 16:
            ax.legend(fontsize=6, ncol=4)
    axes[-1, 0].set_xlabel("optimizer step")
    fig.suptitle(f"training of {run_dir.name}", fontsize=10)
    fig.tight_layout()
    return save(fig, out)


HEAD_PANELS = [("θ_α per head", "/theta_alpha"), ("θ_β per head", "/beta"), ("SSMax s per head", "/s")]
