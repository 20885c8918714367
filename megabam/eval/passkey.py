"""Passkey retrieval score (the BAM paper's protocol, megabam/data/passkey.py builds the prompts).

A prompt counts as retrieved when the model's argmax reproduces every token of the key. One forward
pass over prompt + key scores all key positions at once (teacher forcing): if every argmax matches,
greedy decoding would have produced exactly the key. A length n means n tokens fed: prompt + key.
"""

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from megabam.data.passkey import passkey_sample, random_key
from megabam.data.tokenizer import Tokenizer
from megabam.progress import Progress

Predict = Callable[[torch.Tensor], torch.Tensor]  # token ids (1, n) → the argmax next token at each position (1, n)


class KeyPrediction(NamedTuple):
    """The model's argmax at each key token of one prompt, and whether it is that token."""

    right: list[bool]
    predicted: list[int]


@torch.no_grad()
def score_prompt(
    predict: Predict, tokenizer: Tokenizer, n_tokens: int, depth: float, key: str, device
) -> KeyPrediction:
    """For one prompt of `n_tokens` (prompt + key) with the needle at `depth`: the model's argmax at
    each key token, and whether it is right."""
    answer_len = len(tokenizer.encode(f" {key}"))
    sample = passkey_sample(tokenizer, n_tokens - answer_len, depth, key)
    ids = torch.tensor([sample.prompt_ids + sample.answer_ids], device=device)
    # All n tokens go in (the last position's prediction goes unused) so that a sequence-parallel
    # model, which needs lengths divisible by its TP size, scores n = data.seq_len as it trains.
    predicted = predict(ids)[0, -len(sample.answer_ids) - 1 : -1].tolist()
    return KeyPrediction([p == a for p, a in zip(predicted, sample.answer_ids)], predicted)


class PasskeyScore(NamedTuple):
    retrieved: float  # share of prompts with every key token right
    key_tokens: float  # share of key tokens right


def passkey_accuracy(
    predict: Predict, tokenizer: Tokenizer, n_tokens: int, n_samples: int, seed: int, device
) -> PasskeyScore:
    """Scores of `n_samples` prompts of `n_tokens` tokens (needle depths spread evenly over 0..1).
    `predict` is e.g. `Decoder.greedy`."""
    rng = random.Random(seed)
    right = [
        score_prompt(predict, tokenizer, n_tokens, i / max(1, n_samples - 1), random_key(rng), device).right
        for i in range(n_samples)
    ]
    return PasskeyScore(sum(map(all, right)) / n_samples, sum(map(sum, right)) / sum(map(len, right)))


@dataclass
class PasskeyGrid:
    """Scores per (length, depth) cell: `retrieved` prompts of `trials` with every key token right,
    and `key_tokens` the share of key tokens right (partial copying shows here first); per length,
    `by_position` the share right of the key's first, second, ... token over every depth (which part
    of the copy fails as prompts grow: finding the needle loses the first token, a copy that blurs
    loses the later ones), and `misses` what the model put in place of each key token it got wrong,
    with counts (an eos in place of the last digit is a model that ends the answer by counting)."""

    lengths: list[int]
    depths: list[float]
    trials: int
    retrieved: list[list[int]]  # [length][depth]
    key_tokens: list[list[float]]
    by_position: list[list[float]]  # [length][key token]
    misses: list[list[dict[str, int]]]  # [length][key token]: predicted token's text → prompts

    def accuracy(self) -> list[list[float]]:
        return [[r / self.trials for r in row] for row in self.retrieved]

    def by_length(self) -> dict[int, float]:
        return {n: sum(row) / (self.trials * len(row)) for n, row in zip(self.lengths, self.retrieved)}

    def table(self) -> list[str]:
        key_tokens = [f"{sum(row) / len(row):.2f}" for row in self.key_tokens]
        grid = grid_table(self.lengths, self.depths, self.accuracy(), ("key tokens", key_tokens))
        positions = [f"{n:>8} | " + " ".join(f"{v:.2f}" for v in row) for n, row in zip(self.lengths, self.by_position)]
        misses = [
            f"{n:>8} | "
            + (
                "; ".join(
                    f"token {i + 1}: " + ", ".join(f"{text} ×{count}" for text, count in wrong.items())
                    for i, wrong in enumerate(row)
                    if wrong
                )
                or "none"
            )
            for n, row in zip(self.lengths, self.misses)
        ]
        return [
            *grid,
            "",
            "share right by key token (first to last), every depth:",
            *positions,
            "",
            "predicted in place of the key tokens missed, with counts:",
            *misses,
        ]

    def to_json(self) -> dict:
        return {
            "lengths": self.lengths,
            "depths": self.depths,
            "trials": self.trials,
            "retrieved": self.retrieved,
            "accuracy": self.accuracy(),
            "key_token_accuracy": self.key_tokens,
            "key_token_accuracy_by_position": self.by_position,
            "misses_by_position": self.misses,
            "accuracy_by_length": {str(n): a for n, a in self.by_length().items()},
        }


def passkey_grid(
    predict: Predict,
    tokenizer: Tokenizer,
    lengths: list[int],
    depths: list[float],
    trials: int,
    seed: int,
    device,
    progress: Progress | None = None,
) -> PasskeyGrid:
    """`trials` prompts, each with its own random key, in every (length, depth) cell; `progress` counts
    the prompts' tokens (a 16k prompt costs 16 of 1k) and gets a line per finished length."""
    rng = random.Random(seed)
    retrieved, key_tokens, by_position, misses = [], [], [], []
    for n in lengths:
        row_hits, row_tokens, prompts = [], [], []
        for depth in depths:
            scored = []
            for _ in range(trials):
                scored.append(score_prompt(predict, tokenizer, n, depth, random_key(rng), device))
                if progress:
                    progress.advance(n)
            right = [s.right for s in scored]
            row_hits.append(sum(all(r) for r in right))
            row_tokens.append(sum(sum(r) for r in right) / sum(len(r) for r in right))
            prompts += scored
        retrieved.append(row_hits)
        key_tokens.append(row_tokens)
        by_position.append(share_by_position([p.right for p in prompts]))
        misses.append(missed_by_position(prompts, tokenizer))
        if progress:
            progress.note(f"passkey @ {n}: {sum(row_hits)}/{trials * len(depths)} retrieved")
    return PasskeyGrid(lengths, depths, trials, retrieved, key_tokens, by_position, misses)


def share_by_position(prompts: list[list[bool]]) -> list[float]:
    """The share of prompts with their key's i-th token right, for each i; a tokenizer may split keys
    into different numbers of tokens, so position i counts only the keys that have an i-th token."""
    longest = max(map(len, prompts))
    return [sum(p[i] for p in prompts if len(p) > i) / sum(len(p) > i for p in prompts) for i in range(longest)]


def missed_by_position(prompts: list[KeyPrediction], tokenizer: Tokenizer) -> list[dict[str, int]]:
    """For each key position, the tokens predicted where the key's token was missed, most frequent
    first, as text (`<eos>` for the eos, others quoted) with the number of prompts."""

    def text(token: int) -> str:  # two tokens that decode alike are counted under one text
        return "<eos>" if token == tokenizer.eos_id else repr(tokenizer.decode([token]))

    counts = [Counter() for _ in range(max(len(p.right) for p in prompts))]
    for p in prompts:
        for i, (ok, token) in enumerate(zip(p.right, p.predicted)):
            if not ok:
                counts[i][text(token)] += 1
    return [dict(c.most_common()) for c in counts]


def grid_table(
    lengths: list[int], depths: list[float], values: list[list[float]], extra: tuple[str, list[str]]
) -> list[str]:
    """Rows of lengths, columns of depths, then each row's mean and one more column (name, cells)."""
    name, cells = extra
    head = f"{'length':>8} | " + " ".join(f"{d:>6.0%}" for d in depths) + f" |    all  {name}"
    lines = [head, "-" * len(head)]
    for n, row, cell in zip(lengths, values, cells):
        mean = sum(row) / len(row)
        lines.append(f"{n:>8} | " + " ".join(f"{v:>6.0%}" for v in row) + f" | {mean:>6.0%}  {cell:>{len(name)}}")
    return lines
