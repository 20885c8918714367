"""RULER's needle-in-a-haystack tasks (megabam/data/niah.py builds the prompts), answered by greedy
generation and scored with RULER's string_match_all (the share of the asked values the answer holds).

A length n means a prompt of exactly n tokens; the model then generates up to the answer's length
plus a few tokens, through the chunked prefill and the carried state of megabam/eval/generate.py.
"""

import random
from dataclasses import dataclass, field

from megabam.data.niah import niah_sample, string_match_all
from megabam.data.tokenizer import Tokenizer
from megabam.eval.generate import generate_greedy
from megabam.eval.passkey import grid_table
from megabam.model import Decoder
from megabam.progress import Progress

SPARE_TOKENS = 4  # generated beyond the answer's own length


@dataclass
class NiahGrid:
    variant: str
    lengths: list[int]
    depths: list[float]
    trials: int
    scores: list[list[float]]  # [length][depth] mean string_match_all
    examples: list[dict] = field(default_factory=list)  # the first trial of each cell: answer and output

    def table(self) -> list[str]:
        shown = [
            next((" ".join(e["output"].split()) for e in self.examples if e["length"] == n), "")[:24]
            for n in self.lengths
        ]
        return [f"{self.variant}:", *grid_table(self.lengths, self.depths, self.scores, ("an answer", shown))]

    def to_json(self) -> dict:
        return {
            "variant": self.variant,
            "lengths": self.lengths,
            "depths": self.depths,
            "trials": self.trials,
            "string_match_all": self.scores,
            "by_length": {str(n): sum(row) / len(row) for n, row in zip(self.lengths, self.scores)},
            "examples": self.examples,
        }


def niah_grid(
    model: Decoder,
    tokenizer: Tokenizer,
    variant: str,
    lengths: list[int],
    depths: list[float],
    trials: int,
    seed: int,
    chunk: int,
    essay: str | None = None,
    progress: Progress | None = None,
) -> NiahGrid:
    """`trials` prompts of each (length, depth) cell, each with its own keys and values."""
    rng = random.Random(seed)
    scores, examples = [], []
    for n in lengths:
        row = []
        for depth in depths:
            total = 0.0
            for trial in range(trials):
                sample = niah_sample(tokenizer, n, depth, variant, rng, essay)
                limit = len(sample.answer_ids) + SPARE_TOKENS
                output = tokenizer.decode(generate_greedy(model, sample.prompt_ids, limit, {tokenizer.eos_id}, chunk))
                total += string_match_all(output, sample.values)
                if progress:
                    progress.advance(n)
                if trial == 0:
                    examples.append({"length": n, "depth": depth, "answer": sample.answer, "output": output.strip()})
            row.append(total / trials)
        scores.append(row)
        if progress:
            progress.note(f"{variant} @ {n}: {sum(row) / len(row):.0%}")
    return NiahGrid(variant, lengths, depths, trials, scores, examples)
