"""Perplexity beyond the training length: plain, sliding-window, and loss by position.

- plain: the input cut into sequences of `length` tokens, every next-token prediction scored;
- sliding window (the usual protocol for models whose context is limited): windows of `window`
  tokens moved by `stride`, each scoring only the targets that earlier windows did not, with the
  context the window gives them (stride = window is the plain perplexity of window-long pieces);
- loss by position: the plain sequences' per-token losses averaged over equal position buckets, which
  shows whether tokens far past the training length are predicted as well as the early ones.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from megabam.data.errors import DataError
from megabam.data.shards import iter_mds_samples
from megabam.data.tokenizer import Tokenizer
from megabam.eval.generate import token_losses
from megabam.model import Decoder
from megabam.progress import Progress


def read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise DataError(path, None, f"cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise DataError(path, None, f"not UTF-8 text (byte {e.start})") from None


def evaluation_tokens(tokenizer: Tokenizer, text: str | None, dataset: str | None, max_tokens: int) -> list[int]:
    """The first `max_tokens` tokens of a text file (tokenized whole) or of an MDS dataset's samples, joined."""
    if text is not None:
        return tokenizer.encode(read_text(text))[:max_tokens]
    if not Path(dataset, "index.json").is_file():
        raise DataError(dataset, None, "not an MDS dataset (no index.json)")
    tokens: list[int] = []
    for sample in iter_mds_samples(dataset):
        tokens += sample["tokens"].tolist()
        if len(tokens) >= max_tokens:
            break
    return tokens[:max_tokens]


@dataclass
class PerplexityReport:
    length: int
    sequences: int
    loss: float  # mean next-token loss of the plain sequences
    window: int
    stride: int
    window_loss: float
    window_targets: int
    buckets: list[tuple[int, int, float]]  # (first position, last position + 1, mean loss)

    def bucket_tokens(self) -> list[int]:
        """The tokens scored in each bucket: its positions in every sequence."""
        return [(b - a) * self.sequences for a, b, _ in self.buckets]

    def table(self) -> list[str]:
        lines = [
            f"plain          {self.sequences} × {self.length} tokens: "
            f"loss {self.loss:.4f}, perplexity {math.exp(self.loss):.3f}",
            f"sliding window {self.window}, stride {self.stride}, {self.window_targets} targets: "
            f"loss {self.window_loss:.4f}, perplexity {math.exp(self.window_loss):.3f}",
            "loss by position:",
        ]
        lines += [
            f"  {a:>8}–{b - 1:<8} {loss:.4f}  ({tokens:,} tokens)"
            for (a, b, loss), tokens in zip(self.buckets, self.bucket_tokens())
        ]
        return lines

    def to_json(self) -> dict:
        return {
            "length": self.length,
            "sequences": self.sequences,
            "loss": self.loss,
            "perplexity": math.exp(self.loss),
            "window": self.window,
            "stride": self.stride,
            "window_loss": self.window_loss,
            "window_perplexity": math.exp(self.window_loss),
            "window_targets": self.window_targets,
            "loss_by_position": [
                {"start": a, "end": b, "loss": loss, "tokens": tokens}
                for (a, b, loss), tokens in zip(self.buckets, self.bucket_tokens())
            ],
        }


def plain_losses(
    model: Decoder, tokens: list[int], length: int, chunk: int, progress: Progress | None = None
) -> torch.Tensor:
    """Per-token losses (sequences, length − 1) of the consecutive `length`-token sequences of `tokens`."""
    device = model.embed.weight.device
    rows = []
    for i in range(0, len(tokens) - length + 1, length):
        rows.append(token_losses(model, torch.tensor([tokens[i : i + length]], device=device), chunk))
        if progress:
            progress.advance(length)
    return torch.stack(rows)


def windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int]]:
    """The (begin, end) spans the sliding-window protocol scores: every `stride` tokens until one reaches the end."""
    spans = []
    for begin in range(0, n_tokens - 1, stride):
        spans.append((begin, min(begin + window, n_tokens)))
        if spans[-1][1] == n_tokens:
            break
    return spans


def sliding_window_loss(
    model: Decoder, tokens: list[int], window: int, stride: int, chunk: int, progress: Progress | None = None
) -> tuple[float, int]:
    """Mean loss and number of targets under the sliding-window protocol over all of `tokens`."""
    device = model.embed.weight.device
    total, count, scored_to = 0.0, 0, 1  # target positions < scored_to are done (position 0 has no context)
    for begin, end in windows(len(tokens), window, stride):
        losses = token_losses(model, torch.tensor([tokens[begin:end]], device=device), chunk)
        first = max(scored_to, begin + 1) - (begin + 1)  # losses[j] is target position begin + 1 + j
        total += losses[first:].double().sum().item()
        count += losses.shape[0] - first
        scored_to = end
        if progress:
            progress.advance(end - begin)
    return total / count, count


def tokens_run(n_tokens: int, length: int, window: int, stride: int) -> int:
    """Tokens perplexity_report runs the model on: the plain sequences, then the sliding windows."""
    return n_tokens // length * length + sum(end - begin for begin, end in windows(n_tokens, window, stride))


def perplexity_report(
    model: Decoder,
    tokens: list[int],
    length: int,
    window: int,
    stride: int,
    n_buckets: int,
    chunk: int,
    progress: Progress | None = None,
) -> PerplexityReport:
    """Both protocols' losses; `progress` advances by the tokens run (of `tokens_run`'s total)."""
    losses = plain_losses(model, tokens, length, chunk, progress)
    per_position = losses.double().mean(0)  # index p − 1 = target position p
    edges = [round(1 + k * (length - 1) / n_buckets) for k in range(n_buckets + 1)]
    buckets = [(a, b, per_position[a - 1 : b - 1].mean().item()) for a, b in zip(edges, edges[1:]) if b > a]
    window_loss, targets = sliding_window_loss(model, tokens, window, stride, chunk, progress)
    return PerplexityReport(
        length, losses.shape[0], losses.double().mean().item(), window, stride, window_loss, targets, buckets
    )
