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
    """Per attention layer, per head: the attention probability it puts on the needle's copies of key
    token j (both of the needle's), from the answer's query that predicts token j (the one before
    it), averaged over the key's tokens after the first (that one follows " is", which the filler
    holds too) and over `keys`."""
    tok = trained.tokenizer
    total: dict[int, torch.Tensor] = {}
    for key in keys:
        answer = tok.encode(f" {key}")
        sample = passkey_sample(tok, n_tokens - len(answer), depth, key)
        prompt, body = sample.prompt_ids, answer[1:]
        starts = [i for i in range(len(prompt) - len(body) + 1) if prompt[i : i + len(body)] == body]
        if not starts:
            raise KeySplitApart(None, None, f"the tokenizer splits the key {key} apart differently in the needle")
        # Answer token j (j >= 1) is predicted at query len(prompt) + j - 1 and sits at start + j - 1 in
        # each of the needle's copies of the key.
        for layer, probs in attention_maps(trained, prompt + answer).items():
            per_token = [
                probs[:, len(prompt) + j - 1, [s + j - 1 for s in starts]].sum(-1) for j in range(1, len(answer))
            ]
            total[layer] = total.get(layer, 0) + torch.stack(per_token).mean(0)
    return {layer: mass / len(keys) for layer, mass in total.items()}


def copying_keys(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [random_key(rng) for _ in range(count)]


def copy_table(masses: dict[int, dict[int, torch.Tensor]]) -> list[str]:
    """One block per prompt length: rows of layers, columns of heads."""
    lines = []
    for n, by_layer in masses.items():
        heads = len(next(iter(by_layer.values())))
        lines.append(f"{n:>8} tokens | " + " ".join(f"head {h:<3}" for h in range(heads)))
        lines += [
            f"{'layer ' + str(layer):>15} | " + " ".join(f"{v:>8.3f}" for v in row.tolist())
            for layer, row in by_layer.items()
        ]
    return lines
