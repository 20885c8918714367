"""Passkey retrieval score (the BAM paper's protocol, megabam/data/passkey.py builds the prompts).

A prompt counts as retrieved when the model's argmax reproduces every token of the key. One forward
pass over prompt + key scores all key positions at once (teacher forcing): if every argmax matches,
greedy decoding would have produced exactly the key.
"""

import random
from collections.abc import Callable

import torch

from megabam.data.passkey import passkey_sample, random_key
from megabam.data.tokenizer import Tokenizer


@torch.no_grad()
def passkey_accuracy(
    predict: Callable[[torch.Tensor], torch.Tensor],
    tokenizer: Tokenizer,
    n_tokens: int,
    n_samples: int,
    seed: int,
    device,
) -> float:
    """Share of `n_samples` prompts of `n_tokens` tokens (needle depths spread evenly over 0..1)
    whose key the model reproduces. `predict(ids)` maps token ids (1, n) to the model's most likely
    next token at each position (1, n), e.g. `Decoder.greedy`."""
    rng = random.Random(seed)
    hits = 0
    for i in range(n_samples):
        key = random_key(rng)
        answer_len = len(tokenizer.encode(f" {key}"))
        sample = passkey_sample(tokenizer, n_tokens - answer_len, i / max(1, n_samples - 1), key)
        ids = torch.tensor([sample.prompt_ids + sample.answer_ids], device=device)
        # All n tokens go in (the last position's prediction goes unused) so that a sequence-parallel
        # model, which needs lengths divisible by its TP size, scores n = data.seq_len as it trains.
        predicted = predict(ids)[0, -len(sample.answer_ids) - 1 : -1]
        hits += int(predicted.tolist() == sample.answer_ids)
    return hits / n_samples
