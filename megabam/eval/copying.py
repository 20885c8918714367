"""`megabam eval copying`: which attention heads copy the passkey, and whether they keep doing so
at longer prompts.

Retrieving a key is copying it: to predict the key's token j, a head reads the needle's token j,
the one after the token the answer holds now (an induction head). Its attention probability there,
from that answer query, is what SSMax and the prior must keep as the prompt grows: a head whose
share falls with length blurs the copy (later digits go wrong) even where it still finds the needle.
"""

import random

import torch

from megabam.data.passkey import passkey_sample, random_key
from megabam.errors import UserError
from megabam.eval.plots import attention_maps
from megabam.eval.trained import Trained


class KeySplitApart(UserError):
    """The tokenizer splits the key differently in the needle than in the answer: no copy to measure."""


def copy_mass(trained: Trained, n_tokens: int, depth: float, keys: list[str]) -> dict[int, torch.Tensor]:
    """Per attention layer, (heads, key tokens after the first): the attention probability each head
    puts on the needle's copies of key token j (both of the needle's), from the answer's query that
    predicts token j (the one before it), averaged over `keys` (over those with a j-th token, where a
    tokenizer splits keys into different numbers of tokens). The key's first token is left out: it
    follows " is", which the filler holds too."""
    tok = trained.tokenizer
    sums: dict[int, list[torch.Tensor]] = {}
    counts: list[int] = []
    for key in keys:
        answer = tok.encode(f" {key}")
        sample = passkey_sample(tok, n_tokens - len(answer), depth, key)
        prompt, body = sample.prompt_ids, answer[1:]
        starts = [i for i in range(len(prompt) - len(body) + 1) if prompt[i : i + len(body)] == body]
        if not starts:
            raise KeySplitApart(None, None, f"the tokenizer splits the key {key} apart differently in the needle")
        counts += [0] * (len(body) - len(counts))
        for j in range(len(body)):
            counts[j] += 1
        # Answer token j (j >= 1) is predicted at query len(prompt) + j - 1 and sits at start + j - 1 in
        # each of the needle's copies of the key.
        for layer, probs in attention_maps(trained, prompt + answer).items():
            per_token = sums.setdefault(layer, [])
            for j in range(1, len(answer)):
                mass = probs[:, len(prompt) + j - 1, [s + j - 1 for s in starts]].sum(-1)
                if j > len(per_token):
                    per_token.append(torch.zeros_like(mass))
                per_token[j - 1] += mass
    return {layer: torch.stack([m / c for m, c in zip(per_token, counts)], 1) for layer, per_token in sums.items()}


def copying_keys(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [random_key(rng) for _ in range(count)]


COPY_HEAD = 0.1  # a head with at least this mean share on the token being copied gets its per-token line


def copy_table(masses: dict[int, dict[int, torch.Tensor]]) -> list[str]:
    """One block per prompt length: rows of layers, columns of heads, each the mean over the key's
    tokens; then, for the heads with a mean of at least COPY_HEAD, their share per key token (a copy
    that fails at one digit shows there)."""
    lines = []
    for n, by_layer in masses.items():
        heads = len(next(iter(by_layer.values())))
        lines.append(f"{n:>8} tokens | " + " ".join(f"head {h:<3}" for h in range(heads)))
        lines += [
            f"{'layer ' + str(layer):>15} | " + " ".join(f"{v:>8.3f}" for v in row.mean(1).tolist())
            for layer, row in by_layer.items()
        ]
        lines += [
            f"{'':>15}   layer {layer} head {h} by key token: " + " ".join(f"{v:.3f}" for v in row[h].tolist())
            for layer, row in by_layer.items()
            for h in range(heads)
            if row[h].mean() >= COPY_HEAD
        ]
    return lines
